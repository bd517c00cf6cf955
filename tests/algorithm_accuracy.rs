//! The accuracy table of docs/ALGORITHMS.md holds: the reference traces
//! (steady 1.5x the limit, bursts at window edges, a ramp, random costs),
//! short versions, replayed through every algorithm's script on a real
//! redis-server by scripts/bench-algorithms.d/replay.py, the same replayer
//! that measured the table. It fails if an algorithm's over- or
//! under-admission leaves the bound documented for it there, or if the
//! ring decides one request differently from the log.

mod common;

use std::process::Command;

use common::RedisServer;

#[test]
fn every_algorithm_stays_within_its_documented_bounds() {
    let redis = RedisServer::start_unix();
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("python3")
        .arg(format!("{root}/scripts/bench-algorithms.d/replay.py"))
        .arg("--redis")
        .arg(redis.socket().unwrap())
        .arg("--short")
        .arg("--check-bounds")
        .arg(format!("{root}/docs/ALGORITHMS.md"))
        .output()
        .expect("python3 runs (scripts/test installs it)");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}\n{stdout}");
    // The replayer measured something: every algorithm on every trace.
    for name in ["log", "ring", "gcra", "sliding_counter", "fixed"] {
        assert_eq!(stdout.matches(&format!("\"{name}\"")).count(), 4, "{name} on each of the 4 traces:\n{stdout}");
    }
}
