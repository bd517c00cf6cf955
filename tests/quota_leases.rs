//! Quota leases (src/decision/lease.rs, src/redis/sliding_window.lua modes
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

const LOG: &str = include_str!("../src/redis/sliding_window.lua");

use common::rng::Rng;

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
                    if let Some(s) = l.share(tr.t_us + host.offset_us, limit as u32, want, 1) {
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
                    tr.t_us += latency(&mut rng);
                    let mut args = vec!["S".to_string(), base, l.granted().to_string()];
                    args.extend(l.used_scores().map(|s| s.to_string()));
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
                        let mut args = vec!["S".to_string(), base, l.granted().to_string()];
                        args.extend(l.used_scores().map(|s| s.to_string()));
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
    assert!(local > admitted / 10, "the traces must exercise leases: {local} of {admitted}");
    assert!(shared > admitted / 20, "the traces must exercise worker shares: {shared} of {admitted}");
}

/// `calls` of `cmdstat_evalsha` in `INFO commandstats`: the script calls Redis ran.
fn evalsha_calls(r: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut r.conn()).unwrap();
    info.lines().find_map(|l| l.strip_prefix("cmdstat_evalsha:calls=")).map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
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
