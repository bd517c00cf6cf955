//! A Redis Sentinel (`redis-server --sentinel`) of the test's own, on a
//! loopback port confirmed to be served by it.

use std::process::{Command, Stdio};

use tempfile::TempDir;

use super::ports::on_own_port;
use super::process::ChildGuard;
use super::redis_server::confirm_own_pid;

/// The name the sentinel monitors its master under.
pub const MASTER_NAME: &str = "mymaster";

pub struct Sentinel {
    child: ChildGuard,
    pub port: u16,
    _dir: TempDir,
}

impl Sentinel {
    /// Monitors the master on 127.0.0.1:`master_port` as `mymaster`, alone
    /// (quorum 1), declaring it down after 2 s.
    pub fn start(master_port: u16) -> Self {
        Self::start_with_quorum(master_port, 1)
    }

    /// As `start`, one of several sentinels of the master: `quorum` of them
    /// must agree it is down. They find each other through the master.
    pub fn start_with_quorum(master_port: u16, quorum: u32) -> Self {
        on_own_port("redis sentinel", |port| {
            let dir = tempfile::tempdir().unwrap();
            let conf = dir.path().join("sentinel.conf");
            // The sentinel rewrites this file (its id, what it learns): it
            // must be a file of its own, writable.
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {quorum}\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 2000\nsentinel failover-timeout {MASTER_NAME} 10000\n",
                    dir.path().display()
                ),
            )
            .unwrap();
            let log = dir.path().join("sentinel.log");
            let out = std::fs::File::create(&log).unwrap();
            let mut cmd = Command::new("redis-server");
            cmd.arg(&conf).arg("--sentinel").stdout(out).stderr(Stdio::null());
            let mut child = ChildGuard::spawn("redis sentinel", &mut cmd, Some(log));
            confirm_own_pid(&mut child, || redis::Client::open(format!("redis://127.0.0.1:{port}").as_str()))?;
            Ok(Self { child, port, _dir: dir })
        })
    }

    pub fn conn(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port).as_str())?.get_connection()
    }

    /// The port of the master it names now.
    pub fn master_port(&self) -> u16 {
        let addr: Vec<String> = redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg(MASTER_NAME).query(&mut self.conn().unwrap()).unwrap();
        addr[1].parse().unwrap()
    }

    pub fn known_replicas(&self) -> usize {
        let replicas: Vec<redis::Value> = redis::cmd("SENTINEL").arg("replicas").arg(MASTER_NAME).query(&mut self.conn().unwrap()).unwrap();
        replicas.len()
    }

    /// The other sentinels of the master it has heard of.
    pub fn known_sentinels(&self) -> usize {
        let others: Vec<redis::Value> = redis::cmd("SENTINEL").arg("sentinels").arg(MASTER_NAME).query(&mut self.conn().unwrap()).unwrap();
        others.len()
    }

    pub fn log(&self) -> String {
        self.child.log()
    }
}
