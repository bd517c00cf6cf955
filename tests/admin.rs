//! `ratelimitd inspect` and `reset` address a policy's windows by the
//! policy's name and the key, as `ratelimitd top` shows them: the window,
//! algorithm and shards come from the configuration. The real binary, a
//! real Redis and the real daemon.

mod common;

use std::process::{Command, Output};

use common::{Daemon, RedisServer};
use ratelimitd::protocol::{Decision, FailPolicy, PolicyCheckArgs, PolicyLeaseArgs, Source};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

const POLICIES: &str = "[[policy]]\nname = \"per_tenant\"\nlimit = 5\nwindow = \"60s\"\n\
    [[policy]]\nname = \"hot\"\nlimit = 6\nwindow = \"60s\"\nshards = 3\n\
    [[policy]]\nname = \"daily\"\nlimit = 3\nwindow = \"1d\"\nalgorithm = \"fixed\"\n\
    [[policy]]\nname = \"uploads\"\nalgorithm = \"concurrency\"\nlimit = 2\nlease = \"30s\"\n";

/// The daemon's denial cache does not see a reset's DEL: a refused key is
/// refused from it for at most `max_ms` more (docs/OPERATIONS.md, admin
/// commands). 100 ms here; the tests wait `SEEN`.
const DENIAL_CACHE: &str = "[denial_cache]\nmax_ms = 100\n";
const SEEN: std::time::Duration = std::time::Duration::from_millis(300);

fn start() -> (RedisServer, Daemon) {
    let redis = RedisServer::start_unix();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\nkey_prefix = \"gw:\"\n{DENIAL_CACHE}{POLICIES}", redis.url()));
    (redis, d)
}

fn run(d: &Daemon, args: &[&str]) -> Output {
    Command::new(BIN).arg(args[0]).arg("--config").arg(&d.config).args(&args[1..]).output().unwrap()
}

fn inspect_json(d: &Daemon, args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["inspect"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = run(d, &all);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array().unwrap().clone()
}

fn policy(name: &'static str, key: &'static str) -> PolicyCheckArgs<'static> {
    PolicyCheckArgs { policy: name.as_bytes(), key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// A client of `d` that has spent the quota of (`name`, `key`): `n` checks
/// admitted, the next refused.
async fn spent(d: &Daemon, name: &'static str, key: &'static str, n: usize) -> ratelimitd::client::Client {
    let mut c = d.client().await;
    for _ in 0..n {
        assert_eq!(c.check_policy(&policy(name, key)).await.unwrap().decision, Decision::Allowed);
    }
    assert_eq!(c.check_policy(&policy(name, key)).await.unwrap().decision, Decision::Denied);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_reset_address_a_policys_window_by_name_and_key_as_top_shows_them() {
    let (_redis, d) = start();
    let mut c = spent(&d, "per_tenant", "tenant-a", 5).await;

    let windows = inspect_json(&d, &["--policy", "per_tenant", "--key", "tenant-a"]);
    assert_eq!(windows.len(), 1, "{windows:?}");
    let w = &windows[0];
    assert_eq!(w["redis_key"], "gw:{\u{a}per_tenanttenant-a}:60000ms", "the daemon's policy-scoped key");
    assert_eq!((w["window_ms"].as_u64(), w["algorithm"].as_str(), w["members"].as_u64(), w["in_window"].as_u64()), (Some(60_000), Some("log"), Some(5), Some(5)));
    assert!(w.get("shard").is_none());

    // The text view shows the key's control byte (the name's length) escaped.
    let text = run(&d, &["inspect", "--policy", "per_tenant", "--key", "tenant-a"]);
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("key:          gw:{\\x0aper_tenanttenant-a}:60000ms\n") && text.contains("admissions:   5\n"), "{text}");

    // The inline key of the same name is another window: nothing there.
    let out = run(&d, &["reset", "--key", "tenant-a", "--scan"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "tenant-a: no such key");
    assert_eq!(inspect_json(&d, &["--policy", "per_tenant", "--key", "tenant-a"])[0]["members"], 5, "an inline reset leaves the policy's window alone");

    let out = run(&d, &["reset", "--policy", "per_tenant", "--key", "tenant-a"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "gw:{\\x0aper_tenanttenant-a}:60000ms: deleted");
    tokio::time::sleep(SEEN).await;
    let r = c.check_policy(&policy("per_tenant", "tenant-a")).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 1), "the quota is whole again");
    let out = run(&d, &["reset", "--policy", "per_tenant", "--key", "tenant-b"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "policy per_tenant key tenant-b: no such key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_policy_is_inspected_and_reset_in_every_shard() {
    let (redis, d) = start();
    // 6 over 3 shards of 2: every shard full, the key refused.
    let mut c = spent(&d, "hot", "t1", 6).await;

    let windows = inspect_json(&d, &["--policy", "hot", "--key", "t1"]);
    let shards: Vec<u64> = windows.iter().map(|w| w["shard"].as_u64().unwrap()).collect();
    assert_eq!(shards, [0, 1, 2]);
    assert!(windows.iter().all(|w| w["in_window"] == 2 && w["window_ms"] == 60_000), "{windows:?}");
    // Exactly the keys the daemon wrote: every shard key in Redis is listed.
    let mut in_redis: Vec<String> = redis::cmd("KEYS").arg("gw:*hott1*").query(&mut redis.conn()).unwrap();
    let mut listed: Vec<String> = windows.iter().map(|w| w["redis_key"].as_str().unwrap().to_string()).collect();
    in_redis.sort();
    listed.sort();
    assert_eq!(listed, in_redis);

    let out = run(&d, &["reset", "--policy", "hot", "--key", "t1"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.ends_with(": deleted")).count(), 3, "{}", String::from_utf8_lossy(&out.stdout));
    let left: Vec<String> = redis::cmd("KEYS").arg("gw:*hott1*").query(&mut redis.conn()).unwrap();
    assert!(left.is_empty(), "{left:?}");
    tokio::time::sleep(SEEN).await;
    for _ in 0..6 {
        assert_eq!(c.check_policy(&policy("hot", "t1")).await.unwrap().decision, Decision::Allowed, "the whole limit again");
    }
    // A shard not yet written is listed as absent.
    let windows = inspect_json(&d, &["--policy", "hot", "--key", "fresh"]);
    assert!(windows.len() == 3 && windows.iter().all(|w| w["ttl_ms"] == -2), "{windows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policys_algorithm_and_leases_come_from_the_configuration() {
    let (_redis, d) = start();
    let mut c = d.client().await;
    c.check_policy(&policy("daily", "t1")).await.unwrap();
    let windows = inspect_json(&d, &["--policy", "daily", "--key", "t1"]);
    assert_eq!(windows.len(), 1);
    assert_eq!((windows[0]["redis_key"].as_str(), windows[0]["algorithm"].as_str(), windows[0]["members"].as_u64()), (Some("gw:{\u{5}dailyt1}:86400000ms:fixed"), Some("fixed"), Some(1)));

    let lease = |id: &'static str| PolicyLeaseArgs { check: PolicyCheckArgs { policy: b"uploads", key: b"t1", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }, lease: id.as_bytes() };
    for id in ["a", "b"] {
        let r = c.policy_lease(false, &lease(id)).await.unwrap();
        assert_eq!((r.decision, r.source), (Decision::Allowed, Source::Redis));
    }
    assert_eq!(c.policy_lease(false, &lease("c")).await.unwrap().decision, Decision::Denied);
    let windows = inspect_json(&d, &["--policy", "uploads", "--key", "t1"]);
    assert_eq!(windows.len(), 1);
    let w = &windows[0];
    assert_eq!((w["redis_key"].as_str(), w["algorithm"].as_str(), w["window_ms"].as_u64(), w["in_window"].as_u64()), (Some("gw:{\u{7}uploadst1}:concurrency"), Some("concurrency"), Some(30_000), Some(2)));
    let out = run(&d, &["reset", "--policy", "uploads", "--key", "t1"]);
    assert!(String::from_utf8_lossy(&out.stdout).ends_with(":concurrency: deleted\n"), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(c.policy_lease(false, &lease("c")).await.unwrap().decision, Decision::Allowed, "the slots are free again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_policy_is_a_clear_error_that_names_the_configured_ones() {
    let (_redis, d) = start();
    for cmd in ["inspect", "reset"] {
        let out = run(&d, &[cmd, "--policy", "per_tenat", "--key", "tenant-a"]);
        assert_eq!(out.status.code(), Some(2), "{cmd}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no [[policy]] named 'per_tenat'") && err.contains("per_tenant, hot, daily, uploads"), "{cmd}: {err}");
    }
    // A policy has one window: --window-ms is for inline keys.
    let out = run(&d, &["inspect", "--policy", "per_tenant", "--key", "a", "--window-ms", "1000"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"), "{}", String::from_utf8_lossy(&out.stderr));
}
