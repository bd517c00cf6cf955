//! The ring (src/redis/scripts/ring.lua) against the log (src/redis/scripts/sliding_window.lua):
//! the same random traces (costs, batches, limit changes, windows sliding)
//! through both scripts on a real redis-server, every reply compared field
//! by field. The log is the reference: the ring must decide exactly as it
//! does, and report the same count, remaining, retry-after and reset.

mod common;

use common::RedisServer;

const LOG: &str = common::scripts::LOG;
const RING: &str = common::scripts::RING;

use common::rng::Rng;

fn call(conn: &mut redis::Connection, sha: &str, key: &str, window: u64, now: u64, member: &str, asks: &[(u64, u64)]) -> Vec<i64> {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(1).arg(key).arg(window).arg(now).arg(member);
    for (limit, cost) in asks {
        cmd.arg(*limit).arg(*cost);
    }
    cmd.query(conn).unwrap_or_else(|e| panic!("{key}: {e}"))
}

/// Runs `steps` calls of one random trace through both scripts; returns
/// the number of decisions compared and how many were admissions.
fn run_trace(conn: &mut redis::Connection, log_sha: &str, ring_sha: &str, seed: u64, steps: usize) -> (usize, usize) {
    let mut rng = Rng(seed | 1);
    // Virtual time, in windows of a minute or more, so that the keys' real
    // PEXPIRE (which follows Redis's own clock) never fires during a trace.
    let window = 60_000 + rng.below(4) * 30_000;
    let mut now = 1_700_000_000_000u64;
    let max_limit = [3u64, 10, 40, 200][rng.below(4) as usize];
    let mut limit = 1 + rng.below(max_limit);
    let (log_key, ring_key) = (format!("eq:{{t{seed}}}:log"), format!("eq:{{t{seed}}}:ring"));
    let (mut decisions, mut admitted) = (0, 0);
    for step in 0..steps {
        // Time: mostly small steps, sometimes none (same instant), sometimes
        // most of a window or more.
        now += match rng.below(10) {
            0 => 0,
            1 => window / 2 + rng.below(window),
            _ => rng.below(window / (4 * max_limit).max(1) + 1),
        };
        // The limit changes now and then (both up and down, inside a window).
        if rng.below(12) == 0 {
            limit = 1 + rng.below(max_limit);
        }
        // A batch of 1-4 requests (as coalescing sends them), each with its
        // own cost and, sometimes, its own limit.
        let batch = 1 + if rng.below(3) == 0 { rng.below(4) } else { 0 };
        let asks: Vec<(u64, u64)> = (0..batch)
            .map(|_| {
                let l = if rng.below(8) == 0 { 1 + rng.below(max_limit) } else { limit };
                let c = if rng.below(4) == 0 { 1 + rng.below(l) } else { 1 };
                (l, c)
            })
            .collect();
        let member = format!("m{step}");
        let log = call(conn, log_sha, &log_key, window, now, &member, &asks);
        let ring = call(conn, ring_sha, &ring_key, window, now, &member, &asks);
        assert_eq!(log.len(), 5 * asks.len());
        for (i, (l, r)) in log.chunks(5).zip(ring.chunks(5)).enumerate() {
            assert_eq!(l, r, "seed {seed}, step {step}, request {i} of {asks:?} at now {now} (window {window}): log {l:?} vs ring {r:?}");
            decisions += 1;
            admitted += l[0] as usize;
        }
    }
    (decisions, admitted)
}

#[test]
fn the_ring_decides_as_the_log_on_random_traces() {
    let r = RedisServer::start_unix();
    let mut conn = r.conn();
    let log_sha = common::scripts::load(&mut conn, LOG);
    let ring_sha = common::scripts::load(&mut conn, RING);
    let base = common::rng::base_seed("RING_SEED");
    let (mut decisions, mut admitted) = (0, 0);
    for t in 0..60u64 {
        let (d, a) = run_trace(&mut conn, &log_sha, &ring_sha, base + t, 400);
        decisions += d;
        admitted += a;
    }
    eprintln!("base seed {base}: {decisions} decisions, {admitted} admitted, 0 mismatches");
    assert!(decisions > 20_000, "{decisions}");
    assert!(admitted > decisions / 10 && admitted < decisions * 9 / 10, "traces must mix admissions and refusals: {admitted} of {decisions}");
}

#[test]
fn the_ring_holds_8_bytes_per_admission() {
    let r = RedisServer::start_unix();
    let mut conn = r.conn();
    let ring_sha = common::scripts::load(&mut conn, RING);
    let now = 1_700_000_000_000u64;
    for i in 0..1000u64 {
        let v = call(&mut conn, &ring_sha, "eq:{size}", 600_000, now + i, "m", &[(1000, 1)]);
        assert_eq!(v[0], 1);
    }
    let v = call(&mut conn, &ring_sha, "eq:{size}", 600_000, now + 1000, "m", &[(1000, 1)]);
    assert_eq!(v, [0, 1000, 0, 600_000 - 1000, 600_000 - 1]);
    let len: u64 = redis::cmd("STRLEN").arg("eq:{size}").query(&mut conn).unwrap();
    assert_eq!(len, 8 + 8 * 1000);
    // A lower limit keeps the slots it would drop while they are in the
    // window, and shrinks to the newest `limit` once they have left.
    let v = call(&mut conn, &ring_sha, "eq:{size}", 600_000, now + 600_000 + 499, "m", &[(10, 1)]);
    assert_eq!(v[0], 0, "500 admissions are still in the window");
    assert_eq!(redis::cmd("STRLEN").arg("eq:{size}").query::<u64>(&mut conn).unwrap(), 8 + 8 * 1000);
    let v = call(&mut conn, &ring_sha, "eq:{size}", 600_000, now + 600_000 + 995, "m", &[(10, 1)]);
    assert_eq!(v[..2], [1, 5]);
    assert_eq!(redis::cmd("STRLEN").arg("eq:{size}").query::<u64>(&mut conn).unwrap(), 8 + 8 * 10);
}
