//! Quota leases (src/decision/lease.rs, src/redis/sliding_window.lua modes
//! 'L' and 'S') against a serial model on virtual time, with several
//! daemons: random traces of requests, lease calls, settles, crashes
//! (a lease dropped unsettled), call latencies and clock offsets, through
//! the real script on a real redis-server and the daemon's own
//! `QuotaLease`. After every step, from Redis's own record:
//! - no window of the true admissions (each at its true time, local ones
//!   included) holds more than the limit;
//! - Redis's record never counts fewer units than the true admissions in
//!   the window ending now, nor more than the limit.
//! No timing assertions: time is virtual.

mod common;

use common::RedisServer;
use ratelimitd::QuotaLease;

const LOG: &str = include_str!("../src/redis/sliding_window.lua");

/// xorshift64*: reproducible traces from a printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One simulated daemon: its clock offset and the lease it holds.
struct Daemon {
    offset_us: u64,
    lease: Option<(String, QuotaLease)>,
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

/// Runs one trace; returns (decisions, admitted, admitted locally).
fn run_trace(conn: &mut redis::Connection, sha: &str, seed: u64, steps: usize) -> (u64, u64, u64) {
    let mut rng = Rng(seed | 1);
    let window = 60_000 + rng.below(3) * 30_000;
    let limit = [4u64, 20, 100, 300][rng.below(4) as usize];
    let life = window / 40 + rng.below(window / 4 - window / 40);
    let n = 2 + rng.below(3) as usize;
    let mut daemons: Vec<Daemon> = (0..n).map(|_| Daemon { offset_us: rng.below(1 << 40), lease: None }).collect();
    let key = format!("lease:{{t{seed}}}:log");
    let mut tr = Trace { conn, sha, key, window, limit, t_us: 1_700_000_000_000_000, truth: Vec::new(), seq: 0, seed, step: 0 };
    let (mut decisions, mut admitted, mut local) = (0, 0, 0);
    // Mean gap between requests: about the limit's rate, a bit above or below.
    let gap_us = window * 1000 / limit * [1, 2, 4][rng.below(3) as usize] / 3;
    for step in 0..steps {
        tr.step = step;
        let d = rng.below(n as u64) as usize;
        let latency = |rng: &mut Rng| rng.below(3_000) + 50;
        match rng.below(20) {
            // Time passes: a request gap, or now and then most of a window.
            0 => tr.t_us += window * 1000 / 2 + rng.below(window * 1000),
            // A crash: the lease is dropped unsettled.
            1 => daemons[d].lease = None,
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
    (decisions, admitted, local)
}

#[test]
fn leases_never_let_a_window_hold_more_than_the_limit_on_random_traces() {
    let r = RedisServer::start_unix();
    let mut conn = r.conn();
    let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(LOG).query(&mut conn).unwrap();
    let base: u64 = std::env::var("LEASE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| std::process::id() as u64 * 7919);
    let (mut decisions, mut admitted, mut local) = (0, 0, 0);
    for t in 0..40u64 {
        let (d, a, l) = run_trace(&mut conn, &sha, base + t, 400);
        decisions += d;
        admitted += a;
        local += l;
    }
    eprintln!("base seed {base}: {decisions} decisions, {admitted} units admitted, {local} of them from leases");
    assert!(local > admitted / 10, "the traces must exercise leases: {local} of {admitted}");
}
