//! Redis Sentinel with real processes: a master, a replica and a sentinel
//! (`redis-server --sentinel`), the daemon finding the master through the
//! sentinel, and a failover forced with `SENTINEL FAILOVER` under load.

mod common;

use std::sync::Arc;
use std::time::Duration;

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
