//! Redis Sentinel with real processes: a master, a replica and a sentinel
//! (`redis-server --sentinel`), the daemon finding the master through the
//! sentinel, and a failover forced with `SENTINEL FAILOVER` under load;
//! then three sentinels, and what a planned failover admits at a known
//! limit.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::sentinel::MASTER_NAME;
use common::{args, wait_until, Daemon, Deadline, RedisServer, Sentinel};
use ratelimitd::protocol::{CheckArgs, Decision, FailPolicy, Source};
use redis::Commands;
use tokio::sync::Notify;

fn role(r: &RedisServer) -> String {
    let v: Vec<redis::Value> = redis::cmd("ROLE").query(&mut r.conn()).unwrap();
    match &v[0] {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => format!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_under_load_moves_the_daemon_to_the_new_master() {
    // Replication and the sentinel's view of the servers go over TCP.
    let master = RedisServer::start();
    let replica = RedisServer::start();
    let _: () = redis::cmd("REPLICAOF").arg("127.0.0.1").arg(master.port).query(&mut replica.conn()).unwrap();
    wait_until("replica synced", Duration::from_secs(10), || {
        redis::cmd("INFO").arg("replication").query::<String>(&mut master.conn()).unwrap().contains("connected_slaves:1")
    });
    let sentinel = Sentinel::start(master.port);
    wait_until("sentinel saw the replica", Duration::from_secs(20), || sentinel.known_replicas() > 0);

    // No redis.url: the sentinel names the master.
    let d = Daemon::start_config(&format!(
        "[redis]\ntimeout_ms = 200\n[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [\"127.0.0.1:{}\"]\n",
        sentinel.port
    ));
    let mut probe = d.client().await;
    let a = CheckArgs { on_error: FailPolicy::Open, ..args("sentinel", 1_000_000, 60_000) };
    assert_eq!(probe.check(&a).await.unwrap().source, Source::Redis);

    // Load through the failover.
    let stop = Arc::new(Notify::new());
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let mut c = d.client().await;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let a = CheckArgs { on_error: FailPolicy::Open, ..args("sentinel", 1_000_000, 60_000) };
            let stopped = stop.notified();
            tokio::pin!(stopped);
            let mut n = 0u32;
            loop {
                tokio::select! {
                    _ = &mut stopped => return n,
                    r = c.check(&a) => {
                        let r = r.expect("answered");
                        assert_eq!(r.decision, Decision::Allowed);
                        n += 1;
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _: redis::Value = redis::cmd("SENTINEL").arg("FAILOVER").arg("mymaster").query(&mut sentinel.conn().unwrap()).unwrap();
    // Polled without blocking the runtime: the load tasks keep running.
    let failover = Deadline::start("failover", Duration::from_secs(20));
    while sentinel.master_port() != replica.port || role(&replica) != "master" {
        failover.retry_in(Duration::from_millis(50), || sentinel.log()).await;
    }
    // Decisions come from the new master again.
    let switched = Deadline::start("deciding on the new master", Duration::from_secs(10));
    let before: i64 = replica.conn().zcard("ratelimitd:{sentinel}:60000ms").unwrap();
    loop {
        let r = probe.check(&a).await.unwrap();
        let now: i64 = replica.conn().zcard("ratelimitd:{sentinel}:60000ms").unwrap();
        if r.source == Source::Redis && now > before {
            break;
        }
        switched.retry_in(Duration::from_millis(20), || format!("{r:?}")).await;
    }
    eprintln!("sentinel failover: Redis-backed on the new master {:?} after the switch was visible", switched.elapsed());
    stop.notify_waiters();
    let mut served = 0;
    for t in tasks {
        served += t.await.unwrap();
    }
    assert!(served > 100, "{served} requests through the failover");
    assert!(d.log().contains("connected to the server the sentinels name as master"), "{}", d.log());
    assert!(d.log().contains("sentinel announced a failover"), "the +switch-master watch saw it: {}", d.log());
    drop(master);
}

/// A master, its replicas and three sentinels (quorum 2) that know them
/// all and each other, every replica online and caught up.
struct Group {
    master: RedisServer,
    replicas: Vec<RedisServer>,
    sentinels: Vec<Sentinel>,
    /// Held while the group lives: one group at a time in this binary.
    _alone: std::sync::MutexGuard<'static, ()>,
}

/// The tests of a group run one after the other: each drives its daemon as
/// hard as it can on a 2-core machine, and four at once starved each other
/// past their deadlines (one run in six).
static ONE_GROUP_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn offsets_equal(master: &RedisServer, replicas: usize) -> bool {
    let info: String = redis::cmd("INFO").arg("replication").query(&mut master.conn()).unwrap();
    let offset = info.lines().find_map(|l| l.trim().strip_prefix("master_repl_offset:")).and_then(|o| o.parse::<u64>().ok());
    let online: Vec<u64> = info
        .lines()
        .filter(|l| l.starts_with("slave") && l.contains("state=online"))
        .filter_map(|l| l.split(',').find_map(|f| f.strip_prefix("offset=")).and_then(|o| o.trim().parse().ok()))
        .collect();
    online.len() == replicas && offset.is_some_and(|o| o > 0 && online.iter().all(|&r| r == o))
}

impl Group {
    fn start(replicas: usize, server_args: &[&str]) -> Self {
        // A test that panicked poisons it; the next one may still run.
        let alone = ONE_GROUP_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let master = RedisServer::start_with(server_args);
        let replicas: Vec<RedisServer> = (0..replicas).map(|_| RedisServer::start_with(server_args)).collect();
        for r in &replicas {
            let _: () = redis::cmd("REPLICAOF").arg("127.0.0.1").arg(master.port).query(&mut r.conn()).unwrap();
        }
        // A write the replicas must acknowledge: a primary holds its stream
        // back from a freshly synced replica until its first REPLCONF ACK
        // (SCALING.md), and a failover then would lose everything.
        // (Retried: with `min-replicas-to-write` the master refuses it
        // until the replicas are there.)
        wait_until("a write the master accepts", Duration::from_secs(20), || master.conn().set::<_, _, ()>("synced", 1).is_ok());
        wait_until("replicas online and caught up", Duration::from_secs(20), || offsets_equal(&master, replicas.len()));
        let sentinels: Vec<Sentinel> = (0..3).map(|_| Sentinel::start_with_quorum(master.port, 2)).collect();
        wait_until("the sentinels know the replicas and each other", Duration::from_secs(30), || {
            sentinels.iter().all(|s| s.known_replicas() == replicas.len() && s.known_sentinels() == 2)
        });
        Self { master, replicas, sentinels, _alone: alone }
    }

    /// `[redis.sentinel]` listing `sentinels` (indexes into `self.sentinels`).
    fn daemon(&self, sentinels: &[usize], extra: &str) -> Daemon {
        let list: Vec<String> = sentinels.iter().map(|&i| format!("\"127.0.0.1:{}\"", self.sentinels[i].port)).collect();
        Daemon::start_config(&format!("[redis]\ntimeout_ms = 200\n{extra}\n[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [{}]\n", list.join(", ")))
    }
}

/// What `admit_across_a_planned_failover` counted.
#[derive(Debug)]
struct Across {
    /// Answers `Allowed` (policy closed: every one by Redis).
    allowed: u32,
    /// The window's entries on the new master at the end.
    record: u32,
    /// Answers not decided by Redis (the fail policy's), and requests.
    by_policy: u32,
    requests: u32,
    /// From `SENTINEL FAILOVER` to the sentinels naming the new master.
    switch: Duration,
    /// From the first answer by the fail policy to the last.
    policy_span: Duration,
}

/// How the failover starts.
#[derive(Clone, Copy)]
enum Failover {
    /// `SENTINEL FAILOVER` on this sentinel.
    Planned(usize),
    /// The master SIGKILLed (the sentinels find it down after 2 s).
    Killed,
}

/// `admit_across` a failover ordered on sentinel `via`.
async fn admit_across_a_planned_failover(g: &Group, d: &Daemon, via: usize, limit: u32) -> Across {
    admit_across(g, d, Failover::Planned(via), limit).await
}

/// 8 connections check one key (limit `limit` per 60 s, policy closed) as
/// fast as they can; once 300 are admitted, the failover starts; the load
/// goes on until the new master's window holds the limit (or 60 s), then
/// 200 ms more.
async fn admit_across(g: &Group, d: &Daemon, how: Failover, limit: u32) -> Across {
    const KEY: &str = "planned";
    let rk = format!("ratelimitd:{{{KEY}}}:60000ms");
    let allowed = Arc::new(AtomicU32::new(0));
    let by_policy = Arc::new(AtomicU32::new(0));
    let start = Instant::now();
    // µs since `start` of the first and the last answer by the fail policy.
    let (first_policy, last_policy) = (Arc::new(AtomicU64::new(u64::MAX)), Arc::new(AtomicU64::new(0)));
    let requests = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let mut c = d.client().await;
        let (allowed, by_policy, requests, stop) = (allowed.clone(), by_policy.clone(), requests.clone(), stop.clone());
        let (first_policy, last_policy) = (first_policy.clone(), last_policy.clone());
        tasks.push(tokio::spawn(async move {
            let a = args(KEY, limit, 60_000);
            while !stop.load(Ordering::Relaxed) {
                let r = c.check(&a).await.expect("answered");
                requests.fetch_add(1, Ordering::Relaxed);
                if r.decision == Decision::Allowed {
                    allowed.fetch_add(1, Ordering::Relaxed);
                }
                if !matches!(r.source, Source::Redis | Source::DenialCache) {
                    by_policy.fetch_add(1, Ordering::Relaxed);
                    let at = start.elapsed().as_micros() as u64;
                    first_policy.fetch_min(at, Ordering::Relaxed);
                    last_policy.fetch_max(at, Ordering::Relaxed);
                }
            }
        }));
    }
    let warm = Deadline::start("300 admissions before the failover", Duration::from_secs(20));
    while allowed.load(Ordering::Relaxed) < 300 {
        warm.retry_in(Duration::from_millis(5), || format!("{:?}", d.log())).await;
    }
    let ordered = Instant::now();
    let via = match how {
        Failover::Planned(via) => {
            let _: redis::Value = redis::cmd("SENTINEL").arg("FAILOVER").arg(MASTER_NAME).query(&mut g.sentinels[via].conn().unwrap()).unwrap();
            via
        }
        Failover::Killed => {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(g.master.pid() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
            0
        }
    };
    let failover = Deadline::start("failover", Duration::from_secs(30));
    let new_master = loop {
        let named = g.sentinels[via].master_port();
        if let Some(r) = g.replicas.iter().find(|r| r.port == named && role(r) == "master") {
            break r;
        }
        failover.retry_in(Duration::from_millis(20), || g.sentinels[via].log()).await;
    };
    let switch = ordered.elapsed();
    let full = Deadline::start("the new master's window holds the limit", Duration::from_secs(60));
    loop {
        let held: u32 = new_master.conn().zcard(&rk).unwrap();
        if held >= limit {
            break;
        }
        full.retry_in(Duration::from_millis(20), || format!("{held} of {limit}; allowed {}\n{}", allowed.load(Ordering::Relaxed), d.log())).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let record: u32 = new_master.conn().zcard(&rk).unwrap();
    let policy_span = Duration::from_micros(last_policy.load(Ordering::Relaxed).saturating_sub(first_policy.load(Ordering::Relaxed)));
    Across { allowed: allowed.load(Ordering::Relaxed), record, by_policy: by_policy.load(Ordering::Relaxed), requests: requests.load(Ordering::Relaxed), switch, policy_span }
}

/// Issue 33, 7a: a planned failover under load admitted 7056-7266 at limit
/// 6000: the daemon kept writing to the old master (writable until the
/// sentinels convert it, about 10 s later) until `+switch-master`, about a
/// second after the replica's promotion, and the new master never saw those
/// admissions. The daemon lists all three sentinels; the failover is
/// ordered on the last (so its leader is not the first the daemon asks).
/// The limit holds: the daemon leaves the old master at the leader's first
/// step and uses the promoted replica once it answers as master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planned_failover_admits_no_more_than_the_limit() {
    const LIMIT: u32 = 4000;
    let g = Group::start(1, &[]);
    let d = g.daemon(&[0, 1, 2], "");
    let got = admit_across_a_planned_failover(&g, &d, 2, LIMIT).await;
    eprintln!(
        "planned failover, limit {LIMIT}: {} admitted, {} on the new master; {} of {} requests to the fail policy, for {:?}; sentinels named the new master {:?} after SENTINEL FAILOVER",
        got.allowed, got.record, got.by_policy, got.requests, got.policy_span, got.switch
    );
    assert!(got.allowed <= LIMIT, "{got:?}\n{}", d.log());
    assert!(got.allowed <= got.record, "every admission is on the new master: {got:?}");
    assert!(d.log().contains("sentinel announced a failover; leaving the old master"), "{}", d.log());
    drop(g.master);
}

/// A master SIGKILLed under the same load: the fence follows the leader's
/// steps as for a planned failover (the same steps, seen from a real
/// 3-sentinel set-up), so the daemon uses the promoted replica as soon as
/// it answers as master. A killed master admits nothing after its death;
/// what it can lose is its replication lag: on loopback, at most the
/// answers of its last event loop, which hold at most one call per
/// connection (8). Asserted so; every run so far lost none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_master_failover_admits_no_more_than_the_limit() {
    const LIMIT: u32 = 4000;
    let g = Group::start(1, &[]);
    let d = g.daemon(&[0, 1, 2], "");
    let got = admit_across(&g, &d, Failover::Killed, LIMIT).await;
    eprintln!(
        "killed master, limit {LIMIT}: {} admitted, {} on the new master; {} of {} requests to the fail policy, for {:?}; sentinels named the new master {:?} after the kill",
        got.allowed, got.record, got.by_policy, got.requests, got.policy_span, got.switch
    );
    assert!(got.allowed <= LIMIT + 8, "{got:?}\n{}", d.log());
    assert!(d.log().contains("sentinel announced a failover; leaving the old master"), "{}", d.log());
}

/// The same with `quota_leases` (issue 33's set-up): units leased from
/// the old master before the fence were recorded there and replicated; a
/// lease taken ahead goes through the fenced link like any call. The new
/// master's record may hold leased units never used, so only the limit is
/// asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planned_failover_with_quota_leases_admits_no_more_than_the_limit() {
    const LIMIT: u32 = 4000;
    let g = Group::start(1, &[]);
    let d = g.daemon(&[0, 1, 2], "quota_leases = true");
    let got = admit_across_a_planned_failover(&g, &d, 2, LIMIT).await;
    eprintln!(
        "planned failover with quota leases, limit {LIMIT}: {} admitted, {} on the new master; {} of {} requests to the fail policy, for {:?}",
        got.allowed, got.record, got.by_policy, got.requests, got.policy_span
    );
    assert!(got.allowed <= LIMIT, "{got:?}\n{}", d.log());
    drop(g.master);
}

/// What remains of issue 33's 7a, and what Redis's `min-replicas-to-write`
/// does to it: the figures of docs/FAILURES.md ("Sentinel failover") and
/// SCALING.md. Each line: a fresh group, a planned failover ordered on the
/// third sentinel under the load of `admit_across_a_planned_failover`
/// (limit 4000). A daemon that hears only a sentinel that does not lead the
/// failover (the leader unreachable from it) learns of it at
/// `+switch-master`, as every daemon did before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: scripts/measure sentinel-failover runs it"]
async fn planned_failover_bounds() {
    const LIMIT: u32 = 4000;
    let min_replicas: &[&str] = &["--min-replicas-to-write", "1", "--min-replicas-max-lag", "10"];
    let runs: [(&str, usize, &[&str], &[usize]); 4] = [
        ("every sentinel watched", 1, &[], &[0, 1, 2]),
        ("only a sentinel that does not lead watched", 1, &[], &[0]),
        ("the same, min-replicas-to-write 1, one replica", 1, min_replicas, &[0]),
        ("the same, min-replicas-to-write 1, two replicas", 2, min_replicas, &[0]),
    ];
    for (what, replicas, server_args, watched) in runs {
        let g = Group::start(replicas, server_args);
        let d = g.daemon(watched, "");
        let got = admit_across_a_planned_failover(&g, &d, 2, LIMIT).await;
        eprintln!(
            "{what}: limit {LIMIT}, {} admitted ({} over), {} on the new master; {} of {} requests to the fail policy, for {:?}; switch {:?}",
            got.allowed,
            got.allowed.saturating_sub(LIMIT),
            got.record,
            got.by_policy,
            got.requests,
            got.policy_span,
            got.switch
        );
    }
}

/// The admin API's daemons on `g`, sharing its Redis through all three
/// sentinels: (A, serving the API on a socket in `dir`; B, only refreshing).
fn admin_daemons(g: &Group, dir: &std::path::Path) -> (Daemon, Daemon) {
    let list: Vec<String> = g.sentinels.iter().map(|s| format!("\"127.0.0.1:{}\"", s.port)).collect();
    let config = |admin: &str| {
        format!(
            "[redis]\ntimeout_ms = 200\n[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [{}]\n[admin]\n{admin}overrides_refresh = \"200ms\"\n[[policy]]\nname = \"per_tenant\"\nlimit = 1\nwindow = \"60s\"\n",
            list.join(", ")
        )
    };
    let a = Daemon::start_config(&config(&format!("listen = \"{}\"\n", dir.join("admin.sock").display())));
    let b = Daemon::start_config(&config(""));
    (a, b)
}

/// Issue 35 item 5: around a planned `SENTINEL FAILOVER`, override PUTs
/// answered 200 went to the old master (writable until the sentinels
/// convert it, about 10 s after the switch) and were lost; and a PUT on
/// the new master was not applied by the other daemon within 1 s, its
/// refresher still reading the old master. Now a PUT is answered 200 only
/// once it is on the current master and its replicas (or said not to be,
/// 503), and the other daemon follows the master within its refresh and
/// the 1 s reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn override_puts_answered_200_across_a_planned_failover_are_on_the_new_master_and_reach_the_other_daemon() {
    use ratelimitd::admin_api::client::request;
    use ratelimitd::config::AdminListen;
    use ratelimitd::protocol::PolicyCheckArgs;
    let g = Group::start(2, &[]);
    let dir = tempfile::tempdir().unwrap();
    let (_a, b) = admin_daemons(&g, dir.path());
    let socket = AdminListen::Unix { path: dir.path().join("admin.sock"), mode: 0o600 };
    let errors = std::cell::RefCell::new(std::collections::BTreeSet::new());
    let put = |key: &str| match request(&socket, None, "PUT", "/v1/overrides", Some(&format!("{{\"policy\": \"per_tenant\", \"key\": \"{key}\", \"limit\": 1000, \"ttl\": \"1h\"}}"))) {
        Ok(r) if r.status == 200 => 200,
        Ok(r) => {
            // Numbers (run ids, ports) cut off: one line per kind of refusal.
            errors.borrow_mut().insert(r.body["error"].as_str().unwrap_or("").chars().take(300).collect::<String>());
            r.status
        }
        Err(_) => 0,
    };
    // PUTs every 10 ms; the failover after the 10th; on until the
    // sentinels name the new master and 2 s more.
    let mut answered_200 = Vec::new();
    let mut refused = 0;
    let mut ordered: Option<Instant> = None;
    let mut switched: Option<Instant> = None;
    let old_port = g.master.port;
    for i in 0.. {
        let key = format!("k{i}");
        match put(&key) {
            200 => answered_200.push(key),
            _ => refused += 1,
        }
        if i == 10 {
            let _: redis::Value = redis::cmd("SENTINEL").arg("FAILOVER").arg(MASTER_NAME).query(&mut g.sentinels[0].conn().unwrap()).unwrap();
            ordered = Some(Instant::now());
        }
        if ordered.is_some() && switched.is_none() && g.sentinels.iter().all(|s| s.master_port() != old_port) {
            switched = Some(Instant::now());
        }
        if switched.is_some_and(|s| s.elapsed() > Duration::from_secs(2)) {
            break;
        }
        assert!(ordered.map_or(true, |o| o.elapsed() < Duration::from_secs(30)), "no switch within 30 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    let new_port = g.sentinels[0].master_port();
    let new_master = g.replicas.iter().find(|r| r.port == new_port).expect("a replica was promoted");
    let held: Vec<Vec<u8>> = redis::cmd("HKEYS").arg("ratelimitd:admin:overrides").query(&mut new_master.conn()).unwrap();
    let lost: Vec<&String> = answered_200.iter().filter(|k| !held.iter().any(|f| f.ends_with(k.as_bytes()) && f.len() == 1 + "per_tenant".len() + k.len())).collect();
    eprintln!(
        "planned failover: {} PUTs answered 200, {refused} refused (503) meanwhile, {} of the 200s missing on the new master; switch {:?} after SENTINEL FAILOVER",
        answered_200.len(),
        lost.len(),
        switched.unwrap() - ordered.unwrap()
    );
    eprintln!("refusals: {:?}", errors.borrow());
    assert!(lost.is_empty(), "PUTs answered 200 and lost in the failover: {lost:?}");

    // A PUT on the new master reaches B, whose refresher read the old one.
    let mut cb = b.client().await;
    let fresh = PolicyCheckArgs { policy: b"per_tenant", key: b"after-the-switch", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
    assert_eq!(cb.check_policy(&fresh).await.unwrap().decision, Decision::Allowed);
    assert_eq!(cb.check_policy(&fresh).await.unwrap().decision, Decision::Denied);
    let deadline = Instant::now() + Duration::from_secs(5);
    while put("after-the-switch") != 200 {
        assert!(Instant::now() < deadline, "no PUT answered 200 after the switch");
        std::thread::sleep(Duration::from_millis(100));
    }
    let done = Instant::now();
    // The refresh (200 ms), the refresher's reconnect through the
    // sentinels (at most 1 s on Sentinel), slack for a loaded host.
    let bound = Duration::from_millis(200 + 1000 + 800);
    loop {
        if cb.check_policy(&fresh).await.unwrap().decision == Decision::Allowed {
            break;
        }
        assert!(done.elapsed() < bound, "B did not apply a PUT made on the new master within {bound:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("a PUT on the new master reached B after {:?}; the first PUT answered 200 after the failover began came {:?} after SENTINEL FAILOVER", done.elapsed(), done - ordered.unwrap());
}

/// Issue 35 item 5 reports one hung replica slowing every admin PUT to
/// 0.25-0.5 s. Not reproduced here before the change (SIGSTOP on one of two
/// replicas: PUTs took 3.7 ms median, 8.7 ms max on ec96304); the bound
/// matters now that a PUT waits for its replicas' acknowledgement (`WAIT`,
/// at most 100 ms) and the sentinels' answers: this test states and checks
/// it (measured: 138 ms median, 255 ms max), with slack for a loaded host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_replica_costs_an_admin_put_at_most_the_acknowledgement_timeout() {
    use ratelimitd::admin_api::client::request;
    use ratelimitd::config::AdminListen;
    let g = Group::start(2, &[]);
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b) = admin_daemons(&g, dir.path());
    let socket = AdminListen::Unix { path: dir.path().join("admin.sock"), mode: 0o600 };
    let put = |key: &str| {
        let start = Instant::now();
        let r = request(&socket, None, "PUT", "/v1/overrides", Some(&format!("{{\"policy\": \"per_tenant\", \"key\": \"{key}\", \"limit\": 1000, \"ttl\": \"1h\"}}"))).unwrap();
        assert_eq!(r.status, 200, "{:?}", r.body);
        start.elapsed()
    };
    let healthy: Vec<Duration> = (0..5).map(|i| put(&format!("healthy-{i}"))).collect();
    g.replicas[0].pause();
    let mut hung: Vec<Duration> = (0..10).map(|i| put(&format!("hung-{i}"))).collect();
    g.replicas[0].resume();
    hung.sort();
    eprintln!("admin PUT with healthy replicas: {healthy:?}; with one replica hung: median {:?}, max {:?}", hung[hung.len() / 2], hung[hung.len() - 1]);
    assert!(hung[hung.len() / 2] <= Duration::from_millis(220), "median PUT {:?} with one replica hung", hung[hung.len() / 2]);
    assert!(hung[hung.len() - 1] <= Duration::from_millis(600), "slowest PUT {:?} with one replica hung", hung[hung.len() - 1]);
}
