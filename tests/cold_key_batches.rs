//! Different keys in one script call (src/redis/sliding_window.lua, mode
//! 'B') against the same requests one by one: random traces on a real
//! redis-server, on virtual time. Every reply must be the same field by
//! field, and every key's log the same afterwards (members' count and
//! scores), as if each request had been a call of its own at that instant.

mod common;

use common::RedisServer;

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

fn scores(conn: &mut redis::Connection, key: &str) -> Vec<u64> {
    let v: Vec<(String, u64)> = redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES").query(conn).unwrap();
    v.into_iter().map(|(_, s)| s).collect()
}

/// One trace: returns (decisions compared, admitted).
fn run_trace(conn: &mut redis::Connection, sha: &str, seed: u64, steps: usize) -> (usize, usize) {
    let mut rng = Rng(seed | 1);
    let keys = 2 + rng.below(8);
    let windows = [60_000u64, 90_000, 120_000];
    let max_limit = [3u64, 10, 50][rng.below(3) as usize];
    let mut now = 1_700_000_000_000u64;
    let (mut decisions, mut admitted) = (0, 0);
    for step in 0..steps {
        now += match rng.below(12) {
            0 => 0,
            1 => 30_000 + rng.below(90_000),
            _ => rng.below(2_000),
        };
        // A batch of 1-6 requests, keys drawn with repetition now and then.
        let n = 1 + rng.below(6);
        let asks: Vec<(u64, u64, u64, u64)> = (0..n)
            .map(|_| {
                let k = rng.below(keys);
                let limit = 1 + rng.below(max_limit);
                let cost = if rng.below(4) == 0 { 1 + rng.below(limit) } else { 1 };
                (k, windows[(k % 3) as usize], limit, cost)
            })
            .collect();
        let mut batch = redis::cmd("EVALSHA");
        batch.arg(sha).arg(asks.len());
        for (k, w, _, _) in &asks {
            batch.arg(format!("b:{{t{seed}k{k}}}:{w}"));
        }
        batch.arg("B").arg(now).arg(format!("m{step}"));
        for (_, w, limit, cost) in &asks {
            batch.arg(w).arg(limit).arg(cost);
        }
        let got: Vec<i64> = batch.query(conn).unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
        assert_eq!(got.len(), 5 * asks.len());
        for (i, (k, w, limit, cost)) in asks.iter().enumerate() {
            let one: Vec<i64> = redis::cmd("EVALSHA").arg(sha).arg(1).arg(format!("s:{{t{seed}k{k}}}:{w}")).arg(w).arg(now).arg(format!("m{step}.{i}")).arg(limit).arg(cost).query(conn).unwrap();
            assert_eq!(&got[5 * i..5 * i + 5], &one[..], "seed {seed} step {step} request {i} of {asks:?} at {now}");
            decisions += 1;
            admitted += one[0] as usize;
        }
        for (k, w, _, _) in &asks {
            assert_eq!(scores(conn, &format!("b:{{t{seed}k{k}}}:{w}")), scores(conn, &format!("s:{{t{seed}k{k}}}:{w}")), "seed {seed} step {step}: key {k}'s log");
        }
    }
    (decisions, admitted)
}

#[test]
fn a_batch_of_different_keys_decides_exactly_as_calls_one_by_one() {
    let r = RedisServer::start_unix();
    let mut conn = r.conn();
    let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(LOG).query(&mut conn).unwrap();
    let base: u64 = std::env::var("BATCH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| std::process::id() as u64 * 7919);
    let (mut decisions, mut admitted) = (0, 0);
    for t in 0..40u64 {
        let (d, a) = run_trace(&mut conn, &sha, base + t, 200);
        decisions += d;
        admitted += a;
    }
    eprintln!("base seed {base}: {decisions} decisions compared, {admitted} admitted, 0 mismatches");
    assert!(admitted > decisions / 10 && admitted < decisions * 9 / 10, "traces must mix admissions and refusals: {admitted} of {decisions}");
}
