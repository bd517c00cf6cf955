//! Quota leases (src/decision/lease.rs, src/redis/scripts/sliding_window.lua modes
//! 'L' and 'S') against a serial model on virtual time, with several
//! daemons: random traces of requests, lease calls, settles, crashes
//! (a lease dropped unsettled), call latencies and clock offsets, through
//! the real script on a real redis-server and the daemon's own
//! `QuotaLease`, and nginx workers of each host admitting from shares of
//! their daemon's lease (op 10) until the share's deadline, through daemon
//! crashes. After every step, from Redis's own record:
//! - no window of the true admissions (each at its true time, local ones
//!   included) holds more than the limit;
//! - Redis's record never counts fewer units than the true admissions in
//!   the window ending now, nor more than the limit.
//!
//! No timing assertions: time is virtual.

mod common;

use common::{Daemon, RedisServer};
use ratelimitd::protocol::{Decision, Source};
use ratelimitd::QuotaLease;

const LOG: &str = common::scripts::LOG;

use common::rng::Rng;
use common::redis_server::evalsha_calls;

/// One simulated host: its clock offset, the lease its daemon holds, and
/// the worker shares its nginx workers hold (units left, deadline in µs of
/// the host's clock: the worker's send in whole ms plus the validity, as
/// lua/resty/ratelimitd/share.lua keeps it).
struct SimDaemon {
    offset_us: u64,
    lease: Option<(String, QuotaLease)>,
    shares: Vec<(u64, u64)>,
}

struct Trace<'a> {
    conn: &'a mut redis::Connection,
    sha: &'a str,
    key: String,
    window: u64,
    limit: u64,
    /// Virtual Redis time, µs.
    t_us: u64,
    /// True admissions: (ms on the script's clock, units).
    truth: Vec<(u64, u64)>,
    seq: u64,
    seed: u64,
    step: usize,
}

impl Trace<'_> {
    fn now_ms(&self) -> u64 {
        self.t_us / 1000
    }

    fn eval(&mut self, args: &[String]) -> Vec<i64> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.sha).arg(1).arg(&self.key);
        for a in args {
            cmd.arg(a);
        }
        cmd.query(self.conn).unwrap_or_else(|e| panic!("seed {} step {}: {args:?}: {e}", self.seed, self.step))
    }

    fn member(&mut self, d: usize) -> String {
        self.seq += 1;
        format!("d{d}:{}", self.seq)
    }

    /// A plain check at the current time.
    fn check(&mut self, d: usize, cost: u64) -> bool {
        let m = self.member(d);
        let now = self.now_ms();
        let r = self.eval(&[self.window.to_string(), now.to_string(), m, self.limit.to_string(), cost.to_string()]);
        if r[0] == 1 {
            self.truth.push((now, cost));
        }
        r[0] == 1
    }

    /// Every invariant, from Redis's record and the true admissions.
    fn audit(&mut self, what: &str) {
        let now = self.now_ms();
        let w = self.window;
        let ctx = format!("seed {} step {} ({what}) now {now}", self.seed, self.step);
        for &(t, _) in &self.truth {
            let held: u64 = self.truth.iter().filter(|&&(u, _)| u <= t && u + w > t).map(|&(_, c)| c).sum();
            assert!(held <= self.limit, "{ctx}: the window ending at {t} holds {held} true admissions, limit {}", self.limit);
        }
        let true_now: u64 = self.truth.iter().filter(|&&(u, _)| u <= now && u + w > now).map(|&(_, c)| c).sum();
        let recorded: u64 = redis::cmd("ZCOUNT").arg(&self.key).arg(format!("({}", now as i64 - w as i64)).arg("+inf").query(self.conn).unwrap();
        assert!(recorded >= true_now, "{ctx}: Redis records {recorded} in the window, {true_now} were admitted");
        assert!(recorded <= self.limit, "{ctx}: Redis records {recorded}, over the limit {}", self.limit);
    }
}

/// The settle call of lease `l` (member base `base`) as the daemon makes it
/// at local time `now_us`, for `limit`: its used units re-scored, or, once
/// its life is over on a key with half its limit free
/// (`QuotaLease::must_rescore`), left at `t0 + life` (a 0 each).
fn settle_args(base: String, l: &QuotaLease, limit: u64, now_us: u64) -> Vec<String> {
    let mut args = vec!["S".to_string(), base, l.granted().to_string()];
    // Far from the limit by the lease's own room (the daemon asks its
    // newest lease; the model's invariants hold either way).
    if l.must_rescore(now_us, u64::from(l.remaining()) * 2 >= limit) {
        args.extend(l.used_scores().map(|s| s.to_string()));
    } else {
        KEPT_SCORES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        args.extend((0..l.used()).map(|_| "0".to_string()));
    }
    args
}

/// Settles of the traces that left the used units at `t0 + life`.
static KEPT_SCORES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Runs one trace; returns (decisions, admitted, admitted locally, admitted
/// from worker shares).
fn run_trace(conn: &mut redis::Connection, sha: &str, seed: u64, steps: usize) -> (u64, u64, u64, u64) {
    let mut rng = Rng(seed | 1);
    let window = 60_000 + rng.below(3) * 30_000;
    let limit = [4u64, 20, 100, 300][rng.below(4) as usize];
    let life = window / 40 + rng.below(window / 4 - window / 40);
    let n = 2 + rng.below(3) as usize;
    let mut daemons: Vec<SimDaemon> = (0..n).map(|_| SimDaemon { offset_us: rng.below(1 << 40), lease: None, shares: Vec::new() }).collect();
    let key = format!("lease:{{t{seed}}}:log");
    let mut tr = Trace { conn, sha, key, window, limit, t_us: 1_700_000_000_000_000, truth: Vec::new(), seq: 0, seed, step: 0 };
    let (mut decisions, mut admitted, mut local, mut shared) = (0, 0, 0, 0);
    // Mean gap between requests: about the limit's rate, a bit above or below.
    let gap_us = window * 1000 / limit * [1, 2, 4][rng.below(3) as usize] / 3;
    for step in 0..steps {
        tr.step = step;
        let d = rng.below(n as u64) as usize;
        let latency = |rng: &mut Rng| rng.below(3_000) + 50;
        match rng.below(22) {
            // Time passes: a request gap, or now and then most of a window.
            0 => tr.t_us += window * 1000 / 2 + rng.below(window * 1000),
            // A crash: the lease is dropped unsettled; the workers keep
            // their shares (kill -9 of the daemon: nginx does not notice).
            1 => daemons[d].lease = None,
            // A worker asks its daemon for a share (op 10): sent, decided
            // by the daemon after a latency, answered after another.
            20 | 21 => {
                let host = &mut daemons[d];
                if let Some((_, l)) = host.lease.as_mut() {
                    let send_local = tr.t_us + host.offset_us;
                    tr.t_us += latency(&mut rng);
                    let want = 1 + rng.below(64) as u32;
                    // A validity cut by the host's rate (the daemon's
                    // share_valid_ms), or none: the units are scored at the
                    // share's deadline either way.
                    let max_valid = [40, 250, 250, 250][rng.below(4) as usize];
                    if let Some(s) = l.share(tr.t_us + host.offset_us, limit as u32, want, 1, max_valid) {
                        assert!(s.units <= want && s.valid_ms <= ratelimitd::MAX_SHARE_MS);
                        host.shares.push((u64::from(s.units), (send_local / 1000 + u64::from(s.valid_ms)) * 1000));
                    }
                    tr.t_us += latency(&mut rng);
                    // A burst on the hot key: the host's workers take from
                    // their shares while they last (in units and in time).
                    for _ in 0..rng.below(48) {
                        tr.t_us += rng.below(12_000);
                        let local_now = tr.t_us + host.offset_us;
                        let cost = 1 + rng.below(2);
                        let Some(share) = host.shares.iter_mut().find(|(units, deadline)| *units >= cost && local_now < *deadline) else { break };
                        share.0 -= cost;
                        tr.truth.push((tr.now_ms(), cost));
                        admitted += cost;
                        shared += cost;
                        decisions += 1;
                        tr.audit("worker share admission in a burst");
                    }
                }
            }
            // A settle while the lease may still have units (the timer).
            2 | 3 => {
                if let Some((base, l)) = daemons[d].lease.take() {
                    let args = settle_args(base, &l, limit, tr.t_us + daemons[d].offset_us);
                    tr.t_us += latency(&mut rng);
                    let r = tr.eval(&args);
                    assert!(r[0] <= i64::from(l.used()) && r[1] <= i64::from(l.granted() - l.used()), "seed {seed} step {step}: settle {r:?} of {} used, {} granted", l.used(), l.granted());
                    tr.t_us += latency(&mut rng);
                    tr.audit("settle");
                }
            }
            _ => {
                tr.t_us += rng.below(2 * gap_us);
                let cost = if rng.below(5) == 0 { 1 + rng.below(limit / 4 + 1) } else { 1 };
                let cost = cost.min(limit);
                decisions += 1;
                let local_now = tr.t_us + daemons[d].offset_us;
                // A worker of this host with a share in time admits with no call.
                if rng.below(2) == 0 {
                    if let Some(share) = daemons[d].shares.iter_mut().find(|(units, deadline)| *units >= cost && local_now < *deadline) {
                        share.0 -= cost;
                        tr.truth.push((tr.now_ms(), cost));
                        admitted += cost;
                        shared += cost;
                        tr.audit("worker share admission");
                        continue;
                    }
                }
                daemons[d].shares.retain(|&(units, deadline)| units > 0 && local_now < deadline);
                let from_lease = daemons[d].lease.as_mut().and_then(|(_, l)| l.admit(local_now, limit as u32, cost as u32));
                if let Some(v) = from_lease {
                    assert!(v.allowed);
                    tr.truth.push((tr.now_ms(), cost));
                    admitted += cost;
                    local += cost;
                    tr.audit("local admission");
                    continue;
                }
                // The lease can no longer admit: settled first (as the daemon's task would, possibly later).
                if rng.below(2) == 0 {
                    if let Some((base, l)) = daemons[d].lease.take() {
                        let args = settle_args(base, &l, limit, local_now);
                        tr.eval(&args);
                        tr.audit("settle after its end");
                    }
                }
                if daemons[d].lease.is_none() && rng.below(3) != 0 {
                    // A lease call: sent now, run after a latency, answered after another.
                    let sent_us = tr.t_us + daemons[d].offset_us;
                    tr.t_us += latency(&mut rng);
                    let base = tr.member(d);
                    let want = 2 + rng.below(40);
                    let now = tr.now_ms();
                    let r = tr.eval(&["L".into(), window.to_string(), now.to_string(), base.clone(), limit.to_string(), cost.to_string(), want.to_string(), life.to_string()]);
                    assert_eq!(r.len(), 7);
                    assert_eq!(r[6] as u64, now);
                    let granted = r[5] as u64;
                    assert!(granted <= want, "granted {granted} of {want}");
                    if r[0] == 1 {
                        tr.truth.push((now, cost));
                        admitted += cost;
                        // Only from room to spare: half what is left after the request.
                        assert!(granted <= (limit - (r[1] as u64 - granted)) / 2, "seed {seed} step {step}: {r:?}");
                        if granted > 0 {
                            daemons[d].lease = Some((base, QuotaLease::new(0, limit as u32, now, sent_us, life as u32, granted as u32, r[2] as u32)));
                        }
                    } else {
                        assert_eq!(granted, 0);
                    }
                    tr.audit("lease call");
                    tr.t_us += latency(&mut rng);
                } else if tr.check(d, cost) {
                    admitted += cost;
                    tr.audit("check");
                } else {
                    tr.audit("refusal");
                }
            }
        }
        // The model's truth list only needs the last window or two.
        let horizon = tr.now_ms().saturating_sub(3 * window);
        tr.truth.retain(|&(t, _)| t >= horizon);
    }
    (decisions, admitted, local, shared)
}

#[test]
fn leases_never_let_a_window_hold_more_than_the_limit_on_random_traces() {
    let r = RedisServer::start_unix();
    let mut conn = r.conn();
    let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(LOG).query(&mut conn).unwrap();
    let base: u64 = std::env::var("LEASE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| std::process::id() as u64 * 7919);
    let (mut decisions, mut admitted, mut local, mut shared) = (0, 0, 0, 0);
    for t in 0..40u64 {
        let (d, a, l, s) = run_trace(&mut conn, &sha, base + t, 400);
        decisions += d;
        admitted += a;
        local += l;
        shared += s;
    }
    eprintln!("base seed {base}: {decisions} decisions, {admitted} units admitted, {local} of them from daemons' leases, {shared} from workers' shares");
    // Since leases stop within the last quarter of the limit and hold at
    // most 64 units, 100 base seeds saw 10.0-14.3 % of units from leases
    // and 5.6-10.8 % from shares. A bound at 1/50 fails when either stops
    // admitting, not on an unlucky seed (1/20 was 0.6 points from the
    // shares' lowest).
    assert!(local > admitted / 50, "the traces must exercise leases: {local} of {admitted}");
    assert!(shared > admitted / 50, "the traces must exercise worker shares: {shared} of {admitted}");
    let kept = KEPT_SCORES.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("{kept} settles left their used units at t0 + life");
    assert!(kept > 0, "the traces must exercise settles without re-score");
}

/// The log's members and scores for client key `key`, window `window_ms`.
fn record(r: &RedisServer, key: &str, window_ms: u32) -> Vec<(String, u64)> {
    redis::cmd("ZRANGE").arg(format!("ratelimitd:{{{key}}}:{window_ms}ms")).arg(0).arg(-1).arg("WITHSCORES").query(&mut r.conn()).unwrap()
}

/// Most members of `rec` in any window of `window_ms` (right-closed, as the script counts).
fn fullest_window(rec: &[(String, u64)], window_ms: u64) -> usize {
    let scores: Vec<u64> = rec.iter().map(|(_, s)| *s).collect();
    scores.iter().map(|&t| scores.iter().filter(|&&u| u <= t && u + window_ms > t).count()).max().unwrap_or(0)
}

/// `clients` connections to `d`, each sending `n` checks of `key` in turn;
/// returns (admitted, refused).
async fn hammer(d: &Daemon, key: &'static str, limit: u32, window_ms: u32, clients: usize, n: usize) -> (u64, u64) {
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let (mut yes, mut no) = (0, 0);
            for _ in 0..n {
                let r = c.check(&common::args(key, limit, window_ms)).await.unwrap();
                match r.decision {
                    Decision::Allowed => {
                        assert_eq!(r.source, Source::Redis, "{r:?}");
                        yes += 1;
                    }
                    Decision::Denied => no += 1,
                    _ => panic!("{r:?}"),
                }
            }
            (yes, no)
        }));
    }
    let mut total = (0, 0);
    for t in tasks {
        let (y, n) = t.await.unwrap();
        total = (total.0 + y, total.1 + n);
    }
    total
}

const LEASES: &str = "timeout_ms = 2000\nquota_leases = true";

/// Two real daemons with leases on one hot key, run past the limit: the
/// clients' admissions never exceed it, and once the leases are settled
/// Redis's record holds exactly the admitted requests (no unit lost, none
/// extra), no window of it over the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_with_leases_admit_exactly_what_redis_records_and_never_over_the_limit() {
    const LIMIT: u32 = 1500;
    const WINDOW: u32 = 60_000; // longer than the test: nothing leaves the window
    let redis = RedisServer::start_unix();
    let (a, b) = (Daemon::start(Some(&redis.url()), LEASES), Daemon::start(Some(&redis.url()), LEASES));
    let ((ya, na), (yb, nb)) = tokio::join!(hammer(&a, "shared", LIMIT, WINDOW, 3, 700), hammer(&b, "shared", LIMIT, WINDOW, 3, 700));
    let admitted = ya + yb;
    assert!(admitted <= u64::from(LIMIT), "over-admission: {admitted} > {LIMIT}");
    assert!(na + nb > 0, "the run must reach the limit");
    // Leases live min(window / 4, 1 s) after their call: all settled 3 s on.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let rec = record(&redis, "shared", WINDOW);
    assert!(rec.iter().all(|(m, _)| !m.contains(".l")) || rec.len() as u64 == admitted, "unused units left after settling: {} members", rec.len());
    assert_eq!(rec.len() as u64, admitted, "Redis's record vs the clients' admissions");
    assert!(fullest_window(&rec, WINDOW.into()) <= LIMIT as usize);
    // Under-admission while leases were out: what was refused with room left.
    eprintln!("admitted {admitted} of {LIMIT} ({ya} + {yb}), refused {} while leases were out", na + nb);
    // The room held in leases comes back: the rest of the limit is admitted now.
    let (more, _) = hammer(&a, "shared", LIMIT, WINDOW, 1, (LIMIT as usize - admitted as usize) + 5).await;
    assert_eq!(admitted + more, u64::from(LIMIT), "after settling, exactly the limit");
}

/// Redis calls per admitted decision on a hot key far from its limit: at
/// most 0.05 (a count, not a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_costs_at_most_one_redis_call_per_20_admissions() {
    let redis = RedisServer::start_unix();
    let (a, b) = (Daemon::start(Some(&redis.url()), LEASES), Daemon::start(Some(&redis.url()), LEASES));
    let before = evalsha_calls(&redis);
    let ((ya, _), (yb, _)) = tokio::join!(hammer(&a, "hot", 1_000_000, 60_000, 4, 2000), hammer(&b, "hot", 1_000_000, 60_000, 4, 2000));
    tokio::time::sleep(std::time::Duration::from_secs(2)).await; // the settles
    let calls = evalsha_calls(&redis) - before;
    let per = calls as f64 / (ya + yb) as f64;
    eprintln!("{} admissions, {calls} Redis calls (leases, settles, plain checks): {per:.4} per admission", ya + yb);
    assert_eq!(ya + yb, 16_000);
    assert!(per <= 0.05, "{per}");
    assert_eq!(record(&redis, "hot", 60_000).len(), 16_000, "every admission recorded once");
}

/// A hot key far from its limit: a spent lease is kept until its life is
/// over, then its units' reserved score (`t0 + life`) has passed and, with
/// half the limit free, nothing is moved or removed: no settle call. So a
/// lease costs one call, and each lease's units keep one score in Redis's
/// record (re-scored, they would hold each admission's own ms). A count,
/// not a time: at most one call per 40 admissions (a lease call per 64
/// units, the first requests and the last lease's settle; with a settle per
/// lease it was one per 31). A 1 s window (lease life 250 ms): a host that
/// spends more than `MAX_RETIRED` (256) leases of one key within a life
/// settles the oldest early, re-scored; this one spends 100-145.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_far_from_its_limit_costs_one_call_per_lease_and_its_units_keep_their_score() {
    const WINDOW: u32 = 1000;
    let redis = RedisServer::start_unix();
    let d = Daemon::start(Some(&redis.url()), LEASES);
    let before = evalsha_calls(&redis);
    let started = std::time::Instant::now();
    let (admitted, refused) = hammer(&d, "far", 1_000_000, WINDOW, 4, 3000).await;
    let took = started.elapsed();
    assert_eq!((admitted, refused), (12_000, 0));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await; // every lease's life over
    let calls = evalsha_calls(&redis) - before;
    let per = calls as f64 / admitted as f64;
    // The members of the last window (the lease calls trim older ones).
    let rec = record(&redis, "far", WINDOW);
    let mut leases: std::collections::HashMap<&str, Vec<u64>> = Default::default();
    for (m, score) in &rec {
        if let Some((base, _)) = m.split_once(".l") {
            leases.entry(base).or_default().push(*score);
        }
    }
    eprintln!("{admitted} admissions in {took:?}, {calls} Redis calls: {per:.4} per admission; {} leases in the last window's record", leases.len());
    assert!(per <= 1.0 / 40.0, "{calls} calls for {admitted} admissions");
    assert!(leases.len() >= 10, "{} leases", leases.len());
    let moved = leases.values().filter(|s| s.iter().any(|x| *x != s[0])).count();
    // The last leases (in hand and taken ahead when the run stops) may be
    // settled before their life ends, re-scored.
    eprintln!("{moved} of {} leases' units re-scored", leases.len());
    assert!(moved <= 2, "{moved} of {} leases' units were re-scored", leases.len());
}

/// `kill -9` of a daemon holding a lease: nothing over the limit; its
/// unused units are held until they leave the window (t0 + life + window),
/// then the whole limit is available again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_holding_a_lease_over_admits_nothing_and_its_units_come_back() {
    const LIMIT: u32 = 200;
    const WINDOW: u32 = 4000; // lease life 1 s
    let redis = RedisServer::start_unix();
    let a = Daemon::start(Some(&redis.url()), LEASES);
    let b = Daemon::start(Some(&redis.url()), LEASES);
    let (ya, _) = hammer(&a, "crash", LIMIT, WINDOW, 1, 30).await;
    assert_eq!(ya, 30);
    // Every member so far is a's: "<instance>:<seq>[.l<unit>]".
    let before = record(&redis, "crash", WINDOW);
    let instance = before[0].0.split(':').next().unwrap().to_string();
    let units_of_a = |rec: &[(String, u64)]| rec.iter().filter(|(m, _)| m.starts_with(&instance) && m.contains(".l")).count() as u64;
    let held = units_of_a(&before);
    assert!(held > 0, "a lease must be out: {before:?}");
    let killed = std::time::Instant::now();
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let (yb1, nb) = hammer(&b, "crash", LIMIT, WINDOW, 1, LIMIT as usize).await;
    // b's own leases settled (a life after their calls), a's units still in the window.
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let (yb2, _) = hammer(&b, "crash", LIMIT, WINDOW, 1, 20).await;
    let yb = yb1 + yb2;
    assert!(killed.elapsed() < std::time::Duration::from_millis(u64::from(WINDOW)), "too slow to measure before a's units leave");
    let rec = record(&redis, "crash", WINDOW);
    let plain_a = rec.iter().filter(|(m, _)| m.starts_with(&instance) && !m.contains(".l")).count() as u64;
    let unused_a = units_of_a(&rec) - (ya - plain_a);
    eprintln!("a admitted {ya} ({plain_a} through Redis) and was killed holding {held} units, {unused_a} unused; b then admitted {yb}, refused {nb}");
    assert!(ya + yb <= u64::from(LIMIT), "over-admission: {} > {LIMIT}", ya + yb);
    assert_eq!(ya + yb + unused_a, u64::from(LIMIT), "the under-admission is exactly the killed lease's unused units");
    // Scored t0 + life, they leave the window at t0 + life + window.
    let back = std::time::Duration::from_millis(u64::from(WINDOW) + 1000 + 500);
    tokio::time::sleep(back.saturating_sub(killed.elapsed())).await;
    let (again, _) = hammer(&b, "crash", LIMIT, WINDOW, 1, 1).await;
    assert_eq!(again, 1);
    assert_eq!(units_of_a(&record(&redis, "crash", WINDOW)), 0, "a's units outlived t0 + life + window");
}

const FIXED: &str = common::scripts::FIXED;
const SLIDING_COUNTER: &str = common::scripts::SLIDING_COUNTER;

/// Redis's counts of the fixed window starting at `start` and of the one
/// before it, from the key's string ("start count" for the fixed window,
/// "start cur prev" for the sliding counter).
fn o1_counts(conn: &mut redis::Connection, key: &str, start: u64, window: u64) -> (u64, u64) {
    let stored: Option<String> = redis::cmd("GET").arg(key).query(conn).unwrap();
    let Some(stored) = stored else { return (0, 0) };
    let f: Vec<u64> = stored.split(' ').map(|x| x.parse().unwrap()).collect();
    let (s, cur, prev) = (f[0], f[1], f.get(2).copied().unwrap_or(0));
    if s == start {
        (cur, prev)
    } else if s + window == start {
        (0, cur)
    } else {
        (0, 0)
    }
}

/// One trace of "reserve then give back" leases (fixed window or sliding
/// counter) on virtual time: 2-4 daemons with clock offsets, call
/// latencies, checks, leases (a check, then a reserve of at most half the
/// room, admitting locally through the daemon's `QuotaLease` for the life
/// `reserved_life_ms` allows), settles at any time (also after the window
/// ended), crashes (a lease dropped unsettled). After every step: no fixed
/// window of the true admissions holds more than the limit, and Redis's
/// count of the current and the previous fixed window is never below the
/// true admissions in it; once every lease is settled, equal to them.
/// Returns (decisions, units admitted, units admitted from leases).
fn run_o1_trace(conn: &mut redis::Connection, sha: &str, algorithm: ratelimitd::protocol::Algorithm, seed: u64, steps: usize) -> (u64, u64, u64) {
    let mut rng = Rng(seed | 1);
    let window = [1_000u64, 4_000, 60_000][rng.below(3) as usize];
    let limit = [4u64, 20, 100, 300][rng.below(4) as usize];
    let life = ratelimitd::lease_life_ms(window as u32);
    let n = 2 + rng.below(3) as usize;
    let offsets: Vec<u64> = (0..n).map(|_| rng.below(1 << 40)).collect();
    // (handle, lease) per daemon.
    let mut leases: Vec<Option<(String, QuotaLease, u64)>> = (0..n).map(|_| None).collect();
    // Unused units of crashed leases: (fixed window of the reserve, units).
    let mut lost: Vec<(u64, u64)> = Vec::new();
    let key = format!("o1-{seed}");
    let mut t_us: u64 = 1_700_000_000_000_000 + rng.below(window * 1000);
    let mut truth: Vec<(u64, u64)> = Vec::new(); // (true µs, units)
    let (mut decisions, mut local) = (0u64, 0u64);
    let gap_us = window * 1000 / limit * [1, 2, 4][rng.below(3) as usize] / 3;
    let mut handle_seq = 0u64;
    let eval = |conn: &mut redis::Connection, keys: &[&str], args: &[String]| -> Vec<i64> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha).arg(keys.len());
        for k in keys {
            cmd.arg(*k);
        }
        for a in args {
            cmd.arg(a);
        }
        cmd.query(conn).unwrap_or_else(|e| panic!("seed {seed}: {args:?}: {e}"))
    };
    let audit = |conn: &mut redis::Connection, truth: &[(u64, u64)], lost: &[(u64, u64)], t_us: u64, settled: bool, what: &str| {
        let w_us = window * 1000;
        let mut per: std::collections::BTreeMap<u64, u64> = Default::default();
        for &(at, u) in truth {
            *per.entry(at / w_us).or_default() += u;
        }
        if let Some((w, c)) = per.iter().find(|(_, c)| **c > limit) {
            panic!("seed {seed} ({what}): fixed window {w} holds {c} true admissions > limit {limit}");
        }
        let cur_w = t_us / w_us;
        let (cur, prev) = o1_counts(conn, &key, cur_w * window, window);
        let (tc, tp) = (per.get(&cur_w).copied().unwrap_or(0), cur_w.checked_sub(1).and_then(|p| per.get(&p)).copied().unwrap_or(0));
        assert!(cur >= tc, "seed {seed} ({what}): Redis counts {cur} in the current window, {tc} admitted");
        if algorithm == ratelimitd::protocol::Algorithm::SlidingCounter {
            assert!(prev >= tp, "seed {seed} ({what}): Redis counts {prev} in the previous window, {tp} admitted");
        }
        if settled {
            let lost: u64 = lost.iter().filter(|(w, _)| *w == cur_w).map(|(_, u)| u).sum();
            assert_eq!(cur, tc + lost, "seed {seed} ({what}): every lease settled: Redis's count is the true one plus the unused units of crashed leases");
        }
    };
    for step in 0..steps {
        let d = rng.below(n as u64) as usize;
        let latency = |rng: &mut Rng| rng.below(3_000) + 50;
        let what;
        match rng.below(20) {
            0 => {
                what = "time jump";
                t_us += window * 1000 / 3 + rng.below(window * 1000);
            }
            1 => {
                what = "crash";
                if let Some((_, lease, w)) = leases[d].take() {
                    lost.push((w, u64::from(lease.granted() - lease.used())));
                }
            }
            2..=3 => {
                what = "settle";
                if let Some((handle, lease, _)) = leases[d].take() {
                    t_us += latency(&mut rng);
                    let record = format!("{key}:rec:{handle}");
                    eval(conn, &[&key, &record], &[window.to_string(), (t_us / 1000).to_string(), "s".into(), limit.to_string(), lease.used().to_string()]);
                }
            }
            4..=9 => {
                what = "lease";
                if leases[d].is_none() {
                    let now = t_us / 1000;
                    decisions += 1;
                    let r = eval(conn, &[&key], &[window.to_string(), now.to_string(), "m".into(), limit.to_string(), "1".into()]);
                    if r[0] == 1 {
                        truth.push((t_us, 1));
                        let units = (2 + rng.below(40)).min(r[2] as u64 / 2);
                        if units >= 2 {
                            let sent_local = t_us + offsets[d];
                            t_us += latency(&mut rng);
                            handle_seq += 1;
                            let handle = format!("{d}-{handle_seq}");
                            let record = format!("{key}:rec:{handle}");
                            let g = eval(conn, &[&key, &record], &[window.to_string(), (t_us / 1000).to_string(), "r".into(), limit.to_string(), units.to_string()]);
                            if g[0] == 1 {
                                let life = ratelimitd::reserved_life_ms(algorithm, life, g[4] as u32, window as u32);
                                let lease = QuotaLease::reserved(handle_seq, algorithm, [0; 16], limit as u32, sent_local, life, units as u32, g[2] as u32);
                                leases[d] = Some((handle, lease, t_us / (window * 1000)));
                            }
                        }
                    }
                }
            }
            _ => {
                what = "check";
                t_us += rng.below(2 * gap_us);
                let cost = if rng.below(5) == 0 { 1 + rng.below(limit / 4 + 1) } else { 1 };
                decisions += 1;
                let local_now = t_us + offsets[d];
                if let Some(v) = leases[d].as_mut().and_then(|(_, l, _)| l.admit(local_now, limit as u32, cost as u32)) {
                    assert!(v.allowed);
                    truth.push((t_us, cost));
                    local += cost;
                } else {
                    let r = eval(conn, &[&key], &[window.to_string(), (t_us / 1000).to_string(), "m".into(), limit.to_string(), cost.to_string()]);
                    if r[0] == 1 {
                        truth.push((t_us, cost));
                    }
                }
            }
        }
        let _ = step;
        audit(conn, &truth, &lost, t_us, false, what);
    }
    // Settle everything: Redis's count is then the truth.
    for (handle, lease, _) in leases.iter_mut().filter_map(Option::take) {
        let record = format!("{key}:rec:{handle}");
        eval(conn, &[&key, &record], &[window.to_string(), (t_us / 1000).to_string(), "s".into(), limit.to_string(), lease.used().to_string()]);
    }
    audit(conn, &truth, &lost, t_us, true, "all settled");
    (decisions, truth.iter().map(|t| t.1).sum(), local)
}

#[test]
fn reserve_then_give_back_leases_never_let_a_fixed_window_hold_more_than_the_limit_on_random_traces() {
    use ratelimitd::protocol::Algorithm;
    let r = RedisServer::start_unix();
    let mut conn = r.conn();
    let base: u64 = std::env::var("LEASE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| std::process::id() as u64 * 7919);
    for (algorithm, script) in [(Algorithm::Fixed, FIXED), (Algorithm::SlidingCounter, SLIDING_COUNTER)] {
        let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(script).query(&mut conn).unwrap();
        let (mut decisions, mut admitted, mut local) = (0, 0, 0);
        for t in 0..40u64 {
            let (d, a, l) = run_o1_trace(&mut conn, &sha, algorithm, base + t, 400);
            decisions += d;
            admitted += a;
            local += l;
        }
        eprintln!("{algorithm:?}, base seed {base}: {decisions} decisions, {admitted} units admitted, {local} of them from daemons' leases");
        // The share admitted from leases was 4.8-10.6 % over 100 base seeds
        // (40 traces each); a bound at 1/50 fails only when leases stop
        // admitting, not on an unlucky seed.
        assert!(local > admitted / 50, "the traces must exercise leases: {local} of {admitted}");
    }
}

/// `clients` connections to `d`, each sending `n` checks of `key` counted
/// by `algorithm`; returns (admitted, refused).
async fn hammer_with(d: &Daemon, key: &'static str, limit: u32, window_ms: u32, algorithm: ratelimitd::protocol::Algorithm, clients: usize, n: usize) -> (u64, u64) {
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let (mut yes, mut no) = (0, 0);
            for _ in 0..n {
                let r = c.check_with(&common::args(key, limit, window_ms), algorithm).await.unwrap();
                match r.decision {
                    Decision::Allowed => yes += 1,
                    Decision::Denied => no += 1,
                    _ => panic!("{r:?}"),
                }
            }
            (yes, no)
        }));
    }
    let mut total = (0, 0);
    for t in tasks {
        let (y, n) = t.await.unwrap();
        total = (total.0 + y, total.1 + n);
    }
    total
}

/// Redis's count of the current fixed window of client key `key`.
fn fixed_count(r: &RedisServer, key: &str, window_ms: u64) -> u64 {
    let v: Option<String> = redis::cmd("GET").arg(format!("ratelimitd:{{{key}}}:{window_ms}ms:fixed")).query(&mut r.conn()).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    match v.map(|v| v.split(' ').map(|x| x.parse::<u64>().unwrap()).collect::<Vec<_>>()) {
        Some(f) if f[0] == now - now % window_ms => f[1],
        _ => 0,
    }
}

/// Fixed windows with "reserve then give back" leases, on a real Redis and
/// two real daemons: admitted never over the limit, fewer Redis calls than
/// decisions, Redis's count exactly the admissions once the leases are
/// settled and the rest of the limit admitted exactly; then `kill -9` of a
/// daemon holding a lease: nothing over the limit, and what is not admitted
/// is exactly its unused units (they stay in their fixed window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_window_leases_admit_exactly_the_limit_from_redis_record_and_a_kill_9_over_admits_nothing() {
    use ratelimitd::protocol::Algorithm;
    const LIMIT: u32 = 1500;
    const WINDOW: u32 = 3_600_000; // aligned hours: the test stays in one
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let left = u64::from(WINDOW) - now % u64::from(WINDOW);
    if left < 60_000 {
        tokio::time::sleep(std::time::Duration::from_millis(left + 100)).await;
    }
    let redis = RedisServer::start_unix();
    let (a, b) = (Daemon::start(Some(&redis.url()), LEASES), Daemon::start(Some(&redis.url()), LEASES));
    let before = evalsha_calls(&redis);
    let ((ya, na), (yb, nb)) = tokio::join!(hammer_with(&a, "fx", LIMIT, WINDOW, Algorithm::Fixed, 3, 700), hammer_with(&b, "fx", LIMIT, WINDOW, Algorithm::Fixed, 3, 700));
    let calls = evalsha_calls(&redis) - before;
    let admitted = ya + yb;
    eprintln!("fixed: admitted {admitted} of {LIMIT}, refused {}, {calls} Redis calls for {} decisions", na + nb, ya + yb + na + nb);
    assert!(admitted <= u64::from(LIMIT), "over-admission: {admitted} > {LIMIT}");
    assert!(na + nb > 0, "the run must reach the limit");
    assert!(calls * 2 < ya + yb + na + nb, "leases must spare Redis calls: {calls}");
    assert!(fixed_count(&redis, "fx", WINDOW.into()) >= admitted);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await; // settles (life 1 s)
    assert_eq!(fixed_count(&redis, "fx", WINDOW.into()), admitted, "after the settles Redis counts exactly the admissions");
    let (more, _) = hammer_with(&a, "fx", LIMIT, WINDOW, Algorithm::Fixed, 1, (LIMIT - admitted as u32) as usize + 5).await;
    assert_eq!(admitted + more, u64::from(LIMIT), "after settling, exactly the limit");

    // kill -9 holding a lease.
    let (ya, _) = hammer_with(&a, "fx-crash", 200, WINDOW, Algorithm::Fixed, 1, 30).await;
    assert_eq!(ya, 30);
    let held = fixed_count(&redis, "fx-crash", WINDOW.into()) - ya;
    assert!(held > 0, "a lease must be out");
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let (yb1, _) = hammer_with(&b, "fx-crash", 200, WINDOW, Algorithm::Fixed, 1, 200).await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await; // b's settles
    let (yb2, _) = hammer_with(&b, "fx-crash", 200, WINDOW, Algorithm::Fixed, 1, 20).await;
    let yb = yb1 + yb2;
    let count = fixed_count(&redis, "fx-crash", WINDOW.into());
    eprintln!("fixed, kill -9: a admitted {ya} and was killed holding {held} unused units; b then admitted {yb}; Redis counts {count}");
    assert!(ya + yb <= 200, "over-admission: {}", ya + yb);
    assert_eq!(count, 200);
    assert_eq!(ya + yb + held, 200, "the under-admission is exactly the killed lease's unused units, until the window ends");
}
