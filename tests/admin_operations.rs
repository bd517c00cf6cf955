//! Admin writes are operations of the limit, not beside it (issue 33,
//! defects 1 and 5), through the real daemon and a real redis-server:
//! - a reset while the daemon holds a quota lease forgets the admissions
//!   but not the lease's units, so the window after the reset admits at
//!   most the limit (it admitted 247 of 200 when the reset deleted the
//!   units the daemon kept admitting from), and Redis's record says so;
//!   and the lease forgets the admissions before the reset, so that the
//!   window after it admits the whole limit (a log lease), on the daemon
//!   that made the reset and, through the change log, on every other;
//! - the daemon that serves `PUT /v1/overrides` (or its DELETE) decides
//!   with it before the answer returns, whatever its refresh interval.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Daemon, RedisServer};
use ratelimitd::admin_api::client::{request, Reply};
use ratelimitd::config::AdminListen;
use ratelimitd::protocol::{Decision, FailPolicy, PolicyCheckArgs};
use serde_json::json;

fn admin_socket(dir: &Path) -> PathBuf {
    dir.join("admin.sock")
}

fn call(dir: &Path, method: &str, path: &str, body: Option<serde_json::Value>) -> Reply {
    request(&AdminListen::Unix { path: admin_socket(dir), mode: 0o600 }, None, method, path, body.map(|b| b.to_string()).as_deref()).unwrap()
}

/// A daemon on `redis` with the admin API in `dir`, `redis_extra` in
/// `[redis]`, refreshing overrides every `refresh`, and `policies`.
fn daemon(redis: &RedisServer, dir: &Path, redis_extra: &str, refresh: &str, policies: &str) -> Daemon {
    Daemon::start_config(&format!(
        "socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{redis_extra}\n[admin]\nlisten = \"{}\"\noverrides_refresh = \"{refresh}\"\n{policies}",
        redis.url(),
        admin_socket(dir).display()
    ))
}

fn args<'a>(policy: &'a str, key: &'a str) -> PolicyCheckArgs<'a> {
    PolicyCheckArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// Checks of policy "hot", `key`, from 8 connections of `d` at once, `each`
/// per connection: how many were admitted.
async fn admitted_from_eight_connections(d: &Daemon, key: &'static str, each: usize) -> u32 {
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0u32;
            for _ in 0..each {
                if c.check_policy(&args("hot", key)).await.unwrap().decision == Decision::Allowed {
                    admitted += 1;
                }
            }
            admitted
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_while_a_quota_lease_is_held_admits_at_most_the_limit() {
    reset_with_a_lease_held("log").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_of_a_fixed_window_while_a_quota_lease_is_held_admits_at_most_the_limit() {
    reset_with_a_lease_held("fixed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_of_a_sliding_counter_while_a_quota_lease_is_held_admits_at_most_the_limit() {
    reset_with_a_lease_held("sliding_counter").await;
}

async fn reset_with_a_lease_held(algorithm: &str) {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    // 200 per day: the whole test runs inside one window (a fixed one too,
    // unless it starts in the last second of a UTC day).
    let d = daemon(&redis, dir.path(), "quota_leases = true", "1s", &format!("[[policy]]\nname = \"hot\"\nlimit = 200\nwindow = \"1d\"\nalgorithm = \"{algorithm}\"\n"));
    let mut c = d.client().await;
    // Hot: the daemon leases units of the key's quota.
    for _ in 0..40 {
        assert_eq!(c.check_policy(&args("hot", "k")).await.unwrap().decision, Decision::Allowed);
    }
    // Past any settle in flight (one round trip); the lease in hand lives 1 s.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let reset = call(dir.path(), "DELETE", "/v1/keys?policy=hot&key=k", None);
    assert_eq!(reset.status, 200, "{reset:?}");
    let kept = reset.body["kept_outstanding"].as_u64();
    // After the reset: as many checks as fit, from 8 connections at once.
    let admitted = admitted_from_eight_connections(&d, "k", 60).await;
    assert!(admitted <= 200, "{admitted} admitted after the reset where the limit is 200 ({kept:?} units kept)");
    if algorithm == "log" {
        // The lease forgot its admissions before the reset: its units are
        // the window's after it (the counters' leases carry no Redis time
        // and count theirs until they settle: docs/ADMIN.md "Reset").
        assert_eq!(admitted, 200, "the whole limit after the reset ({kept:?} units kept)");
    }
    assert!(kept.is_some_and(|k| k > 0), "the daemon held no lease at the reset, so the test proved nothing: {:?}", reset.body);
    // The units the daemon held stand for admissions made before the reset or
    // after it: at least the units used after it are in the record. Every
    // admission after the reset is in Redis's record once the lease settles.
    // Redis's record, as the admin API's peek reads it (the log's members
    // in the window; a counter's current count).
    let members = || -> u64 { call(dir.path(), "GET", "/v1/keys?policy=hot&key=k", None).body["count"].as_u64().unwrap() };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while members() > 200 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let recorded = members();
    assert!(recorded <= 200, "Redis's record holds {recorded} where the limit is 200");
    assert!(recorded >= u64::from(admitted), "Redis's record holds {recorded}, fewer than the {admitted} admissions made after the reset");
    // And the key was really reset: the first check after it was admitted.
    assert!(admitted > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_is_in_force_on_the_daemon_that_took_it_before_it_answers() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    // A refresh interval far beyond the test: only the write itself can
    // put the override in force here.
    let d = daemon(&redis, dir.path(), "", "1h", "[[policy]]\nname = \"per_tenant\"\nlimit = 2\nwindow = \"60s\"\n");
    let mut c = d.client().await;
    for _ in 0..2 {
        assert_eq!(c.check_policy(&args("per_tenant", "t")).await.unwrap().decision, Decision::Allowed);
    }
    assert_eq!(c.check_policy(&args("per_tenant", "t")).await.unwrap().decision, Decision::Denied);
    let put = call(dir.path(), "PUT", "/v1/overrides", Some(json!({"policy": "per_tenant", "key": "t", "limit": 5, "ttl": "1h"})));
    assert_eq!(put.status, 200, "{put:?}");
    // At once: no sleep between the answer and the checks.
    for i in 0..3 {
        let r = c.check_policy(&args("per_tenant", "t")).await.unwrap();
        assert_eq!(r.decision, Decision::Allowed, "check {i} after the PUT answered: {r:?}");
    }
    assert_eq!(c.check_policy(&args("per_tenant", "t")).await.unwrap().decision, Decision::Denied);
    // Lowered again by the DELETE, also at once.
    let del = call(dir.path(), "DELETE", "/v1/overrides?policy=per_tenant&key=u", None);
    assert_eq!(del.status, 404, "{del:?}");
    let put = call(dir.path(), "PUT", "/v1/overrides", Some(json!({"policy": "per_tenant", "key": "u", "limit": 1, "ttl": "1h"})));
    assert_eq!(put.status, 200, "{put:?}");
    assert_eq!(c.check_policy(&args("per_tenant", "u")).await.unwrap().decision, Decision::Allowed);
    assert_eq!(c.check_policy(&args("per_tenant", "u")).await.unwrap().decision, Decision::Denied, "the override of 1 was not in force");
    let del = call(dir.path(), "DELETE", "/v1/overrides?policy=per_tenant&key=u", None);
    assert_eq!(del.status, 200, "{del:?}");
    assert_eq!(c.check_policy(&args("per_tenant", "u")).await.unwrap().decision, Decision::Allowed, "the file's limit of 2 was not back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answer_tells_the_limit_in_force_after_an_override_lowers_it() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(&redis, dir.path(), "", "1h", "[[policy]]\nname = \"per_tenant\"\nlimit = 20\nwindow = \"60s\"\n");
    let mut c = d.client().await;
    for _ in 0..15 {
        assert_eq!(c.check_policy(&args("per_tenant", "t")).await.unwrap().decision, Decision::Allowed);
    }
    let put = call(dir.path(), "PUT", "/v1/overrides", Some(json!({"policy": "per_tenant", "key": "t", "limit": 10, "ttl": "1h"})));
    assert_eq!(put.status, 200, "{put:?}");
    // The client shows count + remaining as the limit (RateLimit-Limit,
    // lua/resty/ratelimitd/wire.lua): it must be the 10 in force, not the
    // 15 the window holds.
    for _ in 0..3 {
        let r = c.check_policy(&args("per_tenant", "t")).await.unwrap();
        assert_eq!(r.decision, Decision::Denied);
        assert_eq!((r.count, r.remaining), (10, 0), "{r:?}");
    }
}


/// A key far from its limit keeps its spent leases in the daemon until their
/// life ends (their units at `t0 + life` in Redis, settled then with no
/// re-score: docs/PERFORMANCE.md, "Redis CPU per decision"). A reset within
/// that life keeps those future-scored units in Redis, and the daemon's
/// `forget_before` reaches the kept leases: their units are removed, and
/// the whole limit is admitted after the reset. Settled at once without a
/// re-score, they would have outlived the reset, out of its reach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_the_spent_leases_a_daemon_keeps_on_a_key_far_from_its_limit() {
    const LIMIT: u32 = 1000;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    // A day's window: lease life 1 s.
    let d = daemon(&redis, dir.path(), "quota_leases = true", "1s", &format!("[[policy]]\nname = \"hot\"\nlimit = {LIMIT}\nwindow = \"1d\"\n"));
    let mut c = d.client().await;
    // A spent lease is kept only while a lease in hand tells the key's room:
    // one that ends while its successor's call is still in flight is settled
    // at once (about 1 run in 20 here kept none by the reset). Up to three
    // keys, until one had spent leases kept at its reset; each must admit its
    // whole limit after the reset.
    let mut kept_spent = false;
    for key in ["k1", "k2", "k3"] {
        // 300 admissions: several 64-unit leases spent, the key never past a third of its limit.
        for _ in 0..300 {
            assert_eq!(c.check_policy(&args("hot", key)).await.unwrap().decision, Decision::Allowed);
        }
        // Past a lease call in flight (one round trip): the reset's
        // `forget_before` waits for it. Well within the leases' 1 s life.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let reset = call(dir.path(), "DELETE", &format!("/v1/keys?policy=hot&key={key}"), None);
        assert_eq!(reset.status, 200, "{reset:?}");
        // Members scored after the reset's now: the lease in hand and the one
        // taken ahead hold at most 128; more are spent leases' units.
        let kept = reset.body["kept_outstanding"].as_u64().unwrap_or(0);
        let admitted = admitted_from_eight_connections(&d, key, 250).await;
        assert_eq!(admitted, LIMIT, "{key}: the whole limit after the reset ({kept} units kept in Redis at the reset)");
        if kept > 128 {
            kept_spent = true;
            break;
        }
    }
    assert!(kept_spent, "no spent lease was kept at any of three resets, so the test proved nothing");
}

/// Two daemons on one Redis, each holding a lease of the key: a reset made
/// through one's admin API reaches the other through the change log, whose
/// lease forgets its admissions before the reset; together they admit the
/// whole limit after it, no more. Without the change log entry the other's
/// lease settled its admissions before the reset back into the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_every_daemon_s_leases_through_the_change_log() {
    let redis = RedisServer::start();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let policy = "[[policy]]\nname = \"hot\"\nlimit = 200\nwindow = \"1d\"\n";
    let a = daemon(&redis, dir_a.path(), "quota_leases = true", "100ms", policy);
    let b = daemon(&redis, dir_b.path(), "quota_leases = true", "100ms", policy);
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    for _ in 0..40 {
        assert_eq!(ca.check_policy(&args("hot", "k")).await.unwrap().decision, Decision::Allowed);
        assert_eq!(cb.check_policy(&args("hot", "k")).await.unwrap().decision, Decision::Allowed);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let reset = call(dir_a.path(), "DELETE", "/v1/keys?policy=hot&key=k", None);
    assert_eq!(reset.status, 200, "{reset:?}");
    assert_eq!(reset.body["announced"], true, "{:?}", reset.body);
    assert!(reset.body["kept_outstanding"].as_u64().is_some_and(|k| k > 0), "no lease held at the reset: {:?}", reset.body);
    // b reads the log within its 100 ms refresh.
    let log: Vec<Vec<u8>> = redis::cmd("ZRANGE").arg("ratelimitd:admin:log").arg(0).arg(-1).query(&mut redis.conn()).unwrap();
    assert!(log.iter().any(|e| e.starts_with(b"r")), "a reset entry in the change log: {log:?}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut admitted = 0u32;
    for _ in 0..150 {
        for c in [&mut ca, &mut cb] {
            if c.check_policy(&args("hot", "k")).await.unwrap().decision == Decision::Allowed {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 200, "the whole limit after the reset, across both daemons");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let members = || -> u64 { call(dir_a.path(), "GET", "/v1/keys?policy=hot&key=k", None).body["count"].as_u64().unwrap() };
    while members() > 200 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(members(), 200, "Redis's record: the admissions after the reset");
}
