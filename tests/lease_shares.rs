//! Worker shares of quota leases (LEASE_SHARE, op 10; docs/PROTOCOL.md 4h,
//! docs/PERFORMANCE.md "Worker shares") against real daemons and a real
//! Redis: the documented frame, every hostile variant with its code and the
//! stream in sync, what gets no share, and workers admitting a hot key from
//! their shares with Redis's own record audited afterwards: never more than
//! the limit, every share unit counted.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::{Daemon, RedisServer};
use ratelimitd::client::Client;
use ratelimitd::protocol::{encode_give_back, encode_lease_share, Decision, ErrorCode, FailPolicy, PolicyCheckArgs, Source, MAX_SHARE_UNITS};
use ratelimitd::MAX_SHARE_MS;

const POLICIES: &str = "[[policy]]\nname = \"order\"\nlimit = 3000\nwindow = \"1m\"\n[policy.overrides]\n\"vip\" = \"unlimited\"\n\
[[policy]]\nname = \"dry\"\nlimit = 3000\nwindow = \"1m\"\nshadow = true\n\
[[policy]]\nname = \"hot\"\nlimit = 3000\nwindow = \"1m\"\nshards = 3\n\
[[policy]]\nname = \"strikes\"\nlimit = 3000\nwindow = \"1m\"\npenalty = { after = 5, within = \"1m\", ban = \"1m\" }\n";

fn config(redis: &RedisServer) -> String {
    format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 2000\nquota_leases = true\n{POLICIES}", redis.url())
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn args<'a>(policy: &'a str, key: &'a str, cost: u32) -> PolicyCheckArgs<'a> {
    PolicyCheckArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// Enough single checks for the daemon to lease the key (8 within a lease life).
async fn make_hot(c: &mut Client, policy: &str, key: &str) {
    for _ in 0..12 {
        let d = c.check_policy(&args(policy, key, 1)).await.unwrap().decision;
        assert!(matches!(d, Decision::Allowed | Decision::ShadowAllowed), "{policy}/{key}: {d:?}");
    }
}

fn zcard(redis: &RedisServer, pattern: &str) -> u64 {
    let mut conn = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query(&mut conn).unwrap();
    keys.iter().map(|k| redis::cmd("ZCARD").arg(k).query::<u64>(&mut conn).unwrap()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_share_frames_have_the_documented_bytes_and_hostile_ones_get_their_code() {
    let redis = RedisServer::start();
    let d = Daemon::start_config(&config(&redis));
    let mut c = d.client().await;
    // docs/PROTOCOL.md section 4h: id 7, fail policy open, one item: 16 units
    // wanted, policy "order", key "t1".
    let bytes = hex("0000001c010a000000070000000100000000000000100002056f726465727431");
    let mut encoded = BytesMut::new();
    encode_lease_share(7, &PolicyCheckArgs { on_error: FailPolicy::Open, ..args("order", "t1", 16) }, &mut encoded);
    assert_eq!(&encoded[..], &bytes[..], "the encoder writes the documented bytes");

    // No lease yet: no units, and nothing decided or recorded.
    c.send_raw(&bytes).await.unwrap();
    let r = c.read_response().await.unwrap();
    assert_eq!((r.id, r.op, r.decision, r.error, r.count, r.retry_after_ms), (7, 10, Decision::Allowed, ErrorCode::None, 0, 0), "{}", r.message);
    // The key's windows only: the link's start-up probe (a script call on
    // its own key, `{\0probe}`, expiring 1 ms later) may still be there.
    assert_eq!(zcard(&redis, "*order*t1*"), 0, "a share request records nothing");

    make_hot(&mut c, "order", "t1").await;
    c.send_raw(&bytes).await.unwrap();
    let r = c.read_response().await.unwrap();
    assert_eq!((r.id, r.op, r.decision, r.source, r.error, r.reset_ms), (7, 10, Decision::Allowed, Source::Redis, ErrorCode::None, 60_000), "{}", r.message);
    assert!((1..=16).contains(&r.count), "units granted from the lease: {}", r.count);
    assert!((5..=MAX_SHARE_MS).contains(&r.retry_after_ms), "valid for {} ms", r.retry_after_ms);

    let with = |at: usize, b: &[u8]| {
        let mut v = bytes.clone();
        v[at..at + b.len()].copy_from_slice(b);
        v
    };
    let unknown = {
        let mut v = BytesMut::new();
        encode_lease_share(7, &args("ordr", "t1", 16), &mut v);
        v.to_vec()
    };
    let control = {
        let mut v = BytesMut::new();
        encode_lease_share(7, &args("order", "t\x1f1", 16), &mut v);
        v.to_vec()
    };
    let short = {
        let mut v = bytes[..4 + 18].to_vec();
        v[..4].copy_from_slice(&18u32.to_be_bytes());
        v
    };
    let cases: Vec<(Vec<u8>, ErrorCode)> = vec![
        (unknown, ErrorCode::UnknownPolicy),
        (control, ErrorCode::InvalidKey),
        (short, ErrorCode::Malformed),
        (with(4 + 6, &[0, 4]), ErrorCode::UnsupportedFlags),
        (with(4 + 6, &[0, 3]), ErrorCode::UnsupportedFlags),
        (with(4 + 8, &[3]), ErrorCode::InvalidPolicy),
        (with(4 + 9, &[2]), ErrorCode::UnsupportedLimitCount),
        (with(4 + 9, &[0]), ErrorCode::UnsupportedLimitCount),
        (with(4 + 14, &0u32.to_be_bytes()), ErrorCode::InvalidCost),
        (with(4 + 14, &(MAX_SHARE_UNITS + 1).to_be_bytes()), ErrorCode::InvalidCost),
        (with(4 + 14, &u32::MAX.to_be_bytes()), ErrorCode::InvalidCost),
        (with(4 + 18, &[2]), ErrorCode::Malformed),
        (with(4 + 18, &[0xff, 0xff]), ErrorCode::Malformed),
        (with(4 + 20, &[0]), ErrorCode::Malformed),
        (with(4 + 20, &[32]), ErrorCode::Malformed),
        (with(4 + 8, &[2]), ErrorCode::InvalidLocalLimit),
    ];
    for (frame, code) in cases {
        c.send_raw(&frame).await.unwrap();
        let r = c.read_response().await.unwrap();
        assert_eq!((r.id, r.op, r.decision, r.error, r.count), (7, 10, Decision::Error, code, 0), "{frame:02x?}: {}", r.message);
        let after = c.check_policy(&args("order", "after-error", 1)).await.unwrap();
        assert_eq!(after.decision, Decision::Allowed, "the stream stays in sync");
    }

    // What never gets a share: an exempt key, a shadow policy, a sharded
    // one (each shard leases on its own), a penalty-box policy (each refusal
    // is a strike Redis must see), a key the daemon holds no lease on.
    for (policy, key) in [("order", "vip"), ("dry", "t1"), ("hot", "t1"), ("strikes", "t1"), ("order", "cold")] {
        if key != "cold" {
            make_hot(&mut c, policy, key).await;
        }
        let r = c.lease_share(&args(policy, key, 16)).await.unwrap();
        assert_eq!((r.decision, r.error, r.count, r.retry_after_ms), (Decision::Allowed, ErrorCode::None, 0, 0), "{policy}/{key}: {}", r.message);
    }
}

/// Units of a share no worker used, given back (LEASE_SHARE with flag
/// `0x0001`, or an inline limit's CHECK with `0x3000`; docs/PROTOCOL.md
/// 4h): the documented frames, hostile ones get their code, the daemon
/// takes back no more than its shares of the key hold, and once the lease
/// settled Redis's record holds the units used only: the rest of the limit
/// is admitted, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_given_back_are_free_again_and_redis_records_only_the_units_used() {
    use ratelimitd::protocol::{encode_inline_give_back, CheckArgs, MAX_GIVE_BACK_UNITS};
    let redis = RedisServer::start();
    let d = Daemon::start_config(&config(&redis));
    let mut c = d.client().await;
    // Id 7, fail policy open, 16 units of policy `order`, key `t1`, given
    // back; and an inline limit's: fail policy closed, limit 1000, window
    // 1000 ms, 16 units, key `t1`.
    let policy = hex("0000001c010a000000070001000100000000000000100002056f726465727431");
    let inline = hex("0000001e01010000000730000101000003e8000003e8000000100000000000027431");
    let mut encoded = BytesMut::new();
    encode_give_back(7, &PolicyCheckArgs { on_error: FailPolicy::Open, ..args("order", "t1", 16) }, &mut encoded);
    assert_eq!(&encoded[..], &policy[..], "the encoder writes the documented bytes");
    let inline_args = |key: &'static str, window_ms: u32, cost: u32| CheckArgs { key: key.as_bytes(), limit: 1000, window_ms, cost, on_error: FailPolicy::Closed, local_limit: 0 };
    encoded.clear();
    encode_inline_give_back(7, &inline_args("t1", 1000, 16), &mut encoded);
    assert_eq!(&encoded[..], &inline[..], "the encoder writes the documented bytes");
    // Nothing shared: nothing taken back, nothing recorded.
    for (frame, op) in [(&policy, 10), (&inline, 1)] {
        c.send_raw(frame).await.unwrap();
        let r = c.read_response().await.unwrap();
        assert_eq!((r.id, r.op, r.decision, r.error, r.count), (7, op, Decision::Allowed, ErrorCode::None, 0), "{}", r.message);
    }
    assert_eq!(zcard(&redis, "*t1*"), 0, "a give-back records nothing");
    let with = |bytes: &[u8], at: usize, b: &[u8]| {
        let mut v = bytes.to_vec();
        v[at..at + b.len()].copy_from_slice(b);
        v
    };
    let cases = [
        (with(&policy, 4 + 14, &0u32.to_be_bytes()), ErrorCode::InvalidCost),
        (with(&policy, 4 + 14, &(MAX_GIVE_BACK_UNITS + 1).to_be_bytes()), ErrorCode::InvalidCost),
        (with(&policy, 4 + 6, &[0, 3]), ErrorCode::UnsupportedFlags),
        (with(&inline, 4 + 18, &0u32.to_be_bytes()), ErrorCode::InvalidCost),
        (with(&inline, 4 + 18, &(MAX_GIVE_BACK_UNITS + 1).to_be_bytes()), ErrorCode::InvalidCost),
        // The give-back bit without the share bit.
        (with(&inline, 4 + 6, &[0x20]), ErrorCode::UnsupportedFlags),
    ];
    for (frame, code) in cases {
        c.send_raw(&frame).await.unwrap();
        let r = c.read_response().await.unwrap();
        assert_eq!((r.id, r.decision, r.error, r.count), (7, Decision::Error, code, 0), "{frame:02x?}: {}", r.message);
        let after = c.check_policy(&args("order", "after-error", 1)).await.unwrap();
        assert_eq!(after.decision, Decision::Allowed, "the stream stays in sync");
    }

    // A policy's key: 12 admissions, a share, half of it used.
    make_hot(&mut c, "order", "gb").await;
    let s = c.lease_share(&args("order", "gb", 64)).await.unwrap();
    assert!(s.count >= 2, "a share: {} units, {}", s.count, s.message);
    let used = s.count / 2;
    let r = give_back(&mut c, "order", "gb", s.count - used).await;
    assert_eq!(r.count, s.count - used, "the units given back are taken back");
    let r = give_back(&mut c, "order", "gb", s.count).await;
    assert_eq!(r.count, used, "no more than the shares out: the daemon's own admissions stay");
    // An inline limit's key (a 4 s window: its lease lives 1 s): the same.
    for _ in 0..12 {
        assert_eq!(c.check(&inline_args("t3", 4000, 1)).await.unwrap().decision, Decision::Allowed);
    }
    let s3 = c.inline_share(&inline_args("t3", 4000, 64)).await.unwrap();
    assert!(s3.count >= 1, "a share: {}", s3.message);
    let mut frame = BytesMut::new();
    encode_inline_give_back(8, &inline_args("t3", 4000, s3.count), &mut frame);
    c.send_raw(&frame).await.unwrap();
    let r = c.read_response().await.unwrap();
    assert_eq!((r.id, r.op, r.error, r.count), (8, 1, ErrorCode::None, s3.count), "{}", r.message);
    // The leases settle within their life (1 s): the units given back are
    // not in Redis's record, and a give-back after the settle takes nothing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(zcard(&redis, "*order*gb*"), 12, "the 12 admissions; the share's units all came back");
    assert_eq!(zcard(&redis, "*{t3}:4000ms"), 12);
    assert_eq!(give_back(&mut c, "order", "gb", 1).await.count, 0, "settled: nothing to take back");
    let mut more = 0;
    while c.check_policy(&args("order", "gb", 1)).await.unwrap().decision == Decision::Allowed {
        more += 1;
    }
    assert_eq!(more, 3000 - 12, "the rest of the limit, exactly");
}

/// One simulated nginx worker: it admits from its share while the share
/// has units and time (the shared-dict rule of lua/resty/ratelimitd/share.lua,
/// timed on the same monotonic clock), gives the units left back when the
/// deadline is within `RENEW` (share.lua's RENEW_MS), else asks the daemon
/// per request, and asks for a share after an admission.
struct Tally {
    attempts: AtomicU64,
    admitted: AtomicU64,
    from_shares: AtomicU64,
    round_trips: AtomicU64,
    refused: AtomicU64,
    share_units: AtomicU64,
    wasted: AtomicU64,
    given_back: AtomicU64,
}

const RENEW: Duration = Duration::from_millis(8);

/// Gives `units` of a share of `policy`'s `key` back: the daemon's answer.
async fn give_back(c: &mut Client, policy: &str, key: &str, units: u32) -> ratelimitd::protocol::Response {
    let mut frame = BytesMut::new();
    encode_give_back(9, &args(policy, key, units), &mut frame);
    c.send_raw(&frame).await.unwrap();
    let r = c.read_response().await.unwrap();
    assert_eq!((r.id, r.op, r.error), (9, 10, ErrorCode::None), "{}", r.message);
    r
}

/// A worker's share ended with `units` left: given back, and what the
/// daemon did not take back counted unused.
async fn end_share(c: &mut Client, key: &str, units: u32, t: &Tally) {
    if units > 0 {
        t.round_trips.fetch_add(1, Ordering::Relaxed);
        let taken = give_back(c, "order", key, units).await.count;
        t.given_back.fetch_add(u64::from(taken), Ordering::Relaxed);
        t.wasted.fetch_add(u64::from(units - taken), Ordering::Relaxed);
    }
}

async fn worker(mut c: Client, key: &'static str, until_attempts: u64, t: Arc<Tally>) {
    let mut share: Option<(u32, Instant)> = None;
    while t.attempts.fetch_add(1, Ordering::Relaxed) < until_attempts {
        if let Some((units, deadline)) = share {
            let now = Instant::now();
            if units > 0 && now + RENEW < deadline {
                share = Some((units - 1, deadline));
                t.admitted.fetch_add(1, Ordering::Relaxed);
                t.from_shares.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            share = None;
            if now < deadline {
                end_share(&mut c, key, units, &t).await;
            } else {
                t.wasted.fetch_add(u64::from(units), Ordering::Relaxed);
            }
        }
        t.round_trips.fetch_add(1, Ordering::Relaxed);
        let r = c.check_policy(&args("order", key, 1)).await.unwrap();
        if r.decision != Decision::Allowed {
            t.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        t.admitted.fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        t.round_trips.fetch_add(1, Ordering::Relaxed);
        let s = c.lease_share(&args("order", key, 64)).await.unwrap();
        assert_eq!(s.error, ErrorCode::None, "{}", s.message);
        if s.count > 0 {
            t.share_units.fetch_add(u64::from(s.count), Ordering::Relaxed);
            share = Some((s.count, sent + Duration::from_millis(u64::from(s.retry_after_ms))));
        }
    }
    if let Some((units, deadline)) = share {
        if Instant::now() < deadline {
            end_share(&mut c, key, units, &t).await;
        } else {
            t.wasted.fetch_add(u64::from(units), Ordering::Relaxed);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_admit_a_hot_key_from_shares_and_redis_never_records_more_than_the_limit() {
    let redis = RedisServer::start();
    let (a, b) = (Daemon::start_config(&config(&redis)), Daemon::start_config(&config(&redis)));
    let t = Arc::new(Tally { attempts: 0.into(), admitted: 0.into(), from_shares: 0.into(), round_trips: 0.into(), refused: 0.into(), share_units: 0.into(), wasted: 0.into(), given_back: 0.into() });
    let mut tasks = Vec::new();
    for i in 0..6 {
        let c = if i % 2 == 0 { a.client().await } else { b.client().await };
        tasks.push(tokio::spawn(worker(c, "hot-key", 6000, t.clone())));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let (admitted, from_shares, trips, units, wasted) = (t.admitted.load(Ordering::Relaxed), t.from_shares.load(Ordering::Relaxed), t.round_trips.load(Ordering::Relaxed), t.share_units.load(Ordering::Relaxed), t.wasted.load(Ordering::Relaxed));
    let given_back = t.given_back.load(Ordering::Relaxed);
    let refused = t.refused.load(Ordering::Relaxed);
    let per_admission = (trips - refused) as f64 / admitted as f64;
    eprintln!("6000 attempts, limit 3000: admitted {admitted} ({from_shares} from shares of {units} units, {given_back} given back, {wasted} unused and not given back), {trips} daemon round trips ({refused} refused, {per_admission:.3} per admission)");
    // Nothing is leased within the last quarter of the limit: those 750
    // admissions cost a check and a share request that gets nothing each
    // (this worker asks after every admission; the Lua client waits 100 ms),
    // about 0.5 round trips per admission of the whole run by themselves.
    assert!(from_shares * 2 > admitted, "most admissions from shares: {from_shares} of {admitted}");
    assert!(per_admission < 0.7, "{per_admission} daemon round trips per admission with shares");
    assert!(admitted <= 3000, "over-admission: {admitted} admitted at a limit of 3000");
    assert_eq!(units, from_shares + given_back + wasted, "every share unit is used, given back or counted unused");
    assert!(from_shares > 0, "the workers admitted from shares");
    // Every lease settles within its life (1 s for a 1 min window).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let recorded = zcard(&redis, "*order*hot-key*");
    assert!(recorded <= 3000, "Redis's record holds {recorded} at a limit of 3000");
    assert_eq!(recorded, admitted + wasted, "Redis's record is every admission plus the share units no worker used and none gave back (counted as used)");
    // Near the limit leases and shares shrink to nothing: the rest of the
    // limit is admitted exactly, request by request.
    let mut c = a.client().await;
    let mut more = 0;
    while c.check_policy(&args("order", "hot-key", 1)).await.unwrap().decision == Decision::Allowed {
        more += 1;
    }
    assert_eq!(recorded + more, 3000, "after the settles exactly the rest of the limit is admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_holding_shares_over_admits_nothing() {
    let redis = RedisServer::start();
    let mut a = Daemon::start_config(&config(&redis));
    let mut c = a.client().await;
    make_hot(&mut c, "order", "k9").await;
    let sent = Instant::now();
    let s = c.lease_share(&args("order", "k9", 64)).await.unwrap();
    assert!(s.count > 0, "a share: {}", s.message);
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = a.terminate();
    // The worker admits from its share until its deadline, daemon or not.
    let deadline = sent + Duration::from_millis(u64::from(s.retry_after_ms));
    let mut used = 0;
    while used < s.count && Instant::now() < deadline {
        used += 1;
    }
    let b = Daemon::start_config(&config(&redis));
    let mut c = b.client().await;
    let mut more = 0;
    while c.check_policy(&args("order", "k9", 1)).await.unwrap().decision == Decision::Allowed {
        more += 1;
    }
    let admitted = 12 + u64::from(used) + more;
    assert!(admitted <= 3000, "over-admission after kill -9 with a share out: {admitted}");
    let recorded = zcard(&redis, "*order*k9*");
    assert_eq!(recorded, 3000, "the killed daemon's units (its lease's and the share's) stay counted");
    eprintln!("killed holding a share of {} units ({used} used by the worker after the kill): then {more} admitted, {} short of the limit until the units leave the window", s.count, 3000 - admitted);
}

/// A share in hand when Redis goes away (docs/PERFORMANCE.md, "Worker
/// shares", the Redis outage row): the worker admits from it until its
/// deadline, with no daemon call; the daemon then answers a share request
/// with no units (its lease call fails) and checks get the fail policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_redis_outage_a_share_admits_until_its_deadline_then_the_fail_policy_decides() {
    let mut redis = RedisServer::start_unix();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 200\nquota_leases = true\n{POLICIES}", redis.url()));
    let mut c = d.client().await;
    make_hot(&mut c, "order", "k7").await;
    let sent = Instant::now();
    let s = c.lease_share(&args("order", "k7", 64)).await.unwrap();
    assert!(s.count > 0, "a share: {}", s.message);
    redis.kill();
    let deadline = sent + Duration::from_millis(u64::from(s.retry_after_ms));
    assert!(Instant::now() < deadline, "the share is still valid after the kill (valid {} ms)", s.retry_after_ms);
    // Past the deadline nothing more is taken from it (the worker's rule).
    // The daemon's own lease may keep units the share did not take (a
    // share holds what the host uses within its validity at its rate): it
    // admits from them until its life ends, 1 s after its call for a 1 min
    // window. After both, the daemon gives no new units while Redis is down.
    let lease_over = sent + Duration::from_millis(1000);
    tokio::time::sleep(deadline.max(lease_over).saturating_duration_since(Instant::now()) + Duration::from_millis(300)).await;
    let again = c.lease_share(&args("order", "k7", 64)).await.unwrap();
    assert_eq!((again.error, again.count), (ErrorCode::None, 0), "no units while Redis is down: {}", again.message);
    // No lease left: the check goes to Redis, which is down.
    let r = c.check_policy(&PolicyCheckArgs { on_error: FailPolicy::Closed, ..args("order", "k7", 1) }).await.unwrap();
    assert_eq!((r.decision, r.source), (Decision::Denied, Source::FailClosed), "{}", r.message);
}

/// An inline limit (CHECK with the share flag, docs/PROTOCOL.md 4h) gets
/// shares from a daemon with nothing switched on: leases are on by default.
/// The documented frame; a hot log key gets units, valid at most
/// `MAX_SHARE_MS`, from the same lease as its checks; a cold key, another
/// algorithm or a daemon with `quota_leases = false` gets none; and Redis's
/// record holds every unit handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_limit_gets_worker_shares_from_a_daemon_with_the_defaults() {
    use ratelimitd::protocol::{encode_inline_share, Algorithm, CheckArgs};
    let redis = RedisServer::start();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n", redis.url()));
    let mut c = d.client().await;
    let doc = CheckArgs { key: b"t1", limit: 1000, window_ms: 1000, cost: 64, on_error: FailPolicy::Closed, local_limit: 0 };
    // A 4 s window: its lease lives 1 s, and every admission is still in
    // its window when the lease has settled.
    let check = |key: &'static str, cost: u32| CheckArgs { window_ms: 4000, key: key.as_bytes(), cost, ..doc };
    let bytes = hex("0000001e01010000000710000101000003e8000003e8000000400000000000027431");
    let mut encoded = BytesMut::new();
    encode_inline_share(7, &doc, &mut encoded);
    assert_eq!(&encoded[..], &bytes[..], "the encoder writes the documented bytes");
    // Cold: no units, nothing recorded.
    c.send_raw(&bytes).await.unwrap();
    let r = c.read_response().await.unwrap();
    assert_eq!((r.id, r.op, r.decision, r.error, r.count), (7, 1, Decision::Allowed, ErrorCode::None, 0), "{}", r.message);
    for _ in 0..12 {
        assert_eq!(c.check(&check("t1", 1)).await.unwrap().decision, Decision::Allowed);
        assert_eq!(c.check_with(&check("g1", 1), Algorithm::Gcra).await.unwrap().decision, Decision::Allowed);
    }
    let r = c.inline_share(&check("t1", 64)).await.unwrap();
    assert_eq!((r.op, r.source, r.error, r.reset_ms), (1, Source::Redis, ErrorCode::None, 4000), "{}", r.message);
    assert!((1..=64).contains(&r.count), "units granted from the lease: {}", r.count);
    assert!((5..=MAX_SHARE_MS).contains(&r.retry_after_ms), "valid for {} ms", r.retry_after_ms);
    let units = r.count;
    // GCRA keys are never leased, so never shared.
    let mut gcra = BytesMut::new();
    ratelimitd::protocol::encode_request_with(8, &check("g1", 64), Algorithm::Gcra, &mut gcra);
    gcra[4 + 6] |= 0x10;
    c.send_raw(&gcra).await.unwrap();
    let r = c.read_response().await.unwrap();
    assert_eq!((r.error, r.count), (ErrorCode::None, 0), "{}", r.message);
    // 12 admissions and the units handed out (counted as used), once the
    // leases settled (their life: 1 s for a 4 s window).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(zcard(&redis, "*{t1}:4000ms"), 12 + u64::from(units));
    drop(c);
    drop(d);
    let off = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 2000\nquota_leases = false\n", redis.url()));
    let mut c = off.client().await;
    for _ in 0..12 {
        assert_eq!(c.check(&check("t2", 1)).await.unwrap().decision, Decision::Allowed);
    }
    let r = c.inline_share(&check("t2", 64)).await.unwrap();
    assert_eq!((r.error, r.count), (ErrorCode::None, 0), "quota_leases = false: no shares");
}
