//! Redis Sentinel with real processes: a master, a replica and a sentinel
//! (`redis-server --sentinel`), the daemon finding the master through the
//! sentinel, and a failover forced with `SENTINEL FAILOVER` under load.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{args, Daemon, RedisServer};
use ratelimitd::protocol::{CheckArgs, Decision, FailPolicy, Source};
use redis::Commands;
use tokio::sync::Notify;

struct Sentinel {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    fn start(master_port: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds mymaster 2000\nsentinel failover-timeout mymaster 10000\n",
                dir.path().display()
            ),
        )
        .unwrap();
        let child = Command::new("redis-server").arg(&conf).arg("--sentinel").stdout(Stdio::null()).spawn().unwrap();
        let s = Self { child, port, _dir: dir };
        let t0 = Instant::now();
        while s.conn().is_err() {
            assert!(t0.elapsed() < Duration::from_secs(10), "sentinel did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn conn(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port).as_str())?.get_connection()
    }

    fn master_port(&self) -> u16 {
        let addr: Vec<String> = redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg("mymaster").query(&mut self.conn().unwrap()).unwrap();
        addr[1].parse().unwrap()
    }

    fn known_replicas(&self) -> usize {
        let replicas: Vec<redis::Value> = redis::cmd("SENTINEL").arg("replicas").arg("mymaster").query(&mut self.conn().unwrap()).unwrap();
        replicas.len()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn role(r: &RedisServer) -> String {
    let v: Vec<redis::Value> = redis::cmd("ROLE").query(&mut r.conn()).unwrap();
    match &v[0] {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => format!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_under_load_moves_the_daemon_to_the_new_master() {
    let master = RedisServer::start();
    let replica = RedisServer::start();
    let _: () = redis::cmd("REPLICAOF").arg("127.0.0.1").arg(master.port).query(&mut replica.conn()).unwrap();
    let t0 = Instant::now();
    while !redis::cmd("INFO").arg("replication").query::<String>(&mut master.conn()).unwrap().contains("connected_slaves:1") {
        assert!(t0.elapsed() < Duration::from_secs(10), "replica never synced");
        std::thread::sleep(Duration::from_millis(20));
    }
    let sentinel = Sentinel::start(master.port);
    let t0 = Instant::now();
    while sentinel.known_replicas() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "sentinel never saw the replica");
        std::thread::sleep(Duration::from_millis(50));
    }

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
    let t0 = Instant::now();
    while sentinel.master_port() != replica.port || role(&replica) != "master" {
        assert!(t0.elapsed() < Duration::from_secs(20), "failover did not happen");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let switched = Instant::now();
    // Decisions come from the new master again.
    let before: i64 = replica.conn().zcard("ratelimitd:{sentinel}").unwrap();
    loop {
        let r = probe.check(&a).await.unwrap();
        let now: i64 = replica.conn().zcard("ratelimitd:{sentinel}").unwrap();
        if r.source == Source::Redis && now > before {
            break;
        }
        assert!(switched.elapsed() < Duration::from_secs(10), "still not deciding on the new master: {:?}", r);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("sentinel failover: Redis-backed on the new master {:?} after the switch was visible", switched.elapsed());
    stop.notify_waiters();
    let mut served = 0;
    for t in tasks {
        served += t.await.unwrap();
    }
    assert!(served > 100, "{served} requests through the failover");
    assert!(d.log().contains("connected to the master named by the sentinels"), "{}", d.log());
    assert!(d.log().contains("sentinel announced a failover"), "the +switch-master watch saw it: {}", d.log());
    drop(master);
}
