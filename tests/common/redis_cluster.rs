//! A real Redis Cluster of the test's own: six `redis-server
//! --cluster-enabled yes` on loopback ports (each port and its cluster bus
//! port, port + 10000, free and confirmed to be served by the process
//! started), joined by `redis-cli --cluster create --cluster-replicas 1`:
//! three primaries with one replica each. `cluster-node-timeout` is 1 s, so
//! a killed primary's replica is promoted within a few seconds. Every node
//! is killed and the temp dir removed on drop.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::ports::on_own_ports;
use super::process::ChildGuard;
use super::tls::Certs;
use super::wait::{poll, Waited};

const NODES: usize = 6;
/// Redis puts the cluster bus on port + 10000.
const BUS_OFFSET: u16 = 10_000;
const NODE_TIMEOUT_MS: &str = "1000";
/// How long forming the cluster may take on a loaded 2-core machine.
const FORM_LIMIT: Duration = Duration::from_secs(30);

pub struct RedisCluster {
    /// Indexed like `ports`; `None` once killed.
    nodes: Vec<Option<ChildGuard>>,
    ports: Vec<u16>,
    dir: TempDir,
    access: Access,
    /// One cluster at a time per test binary, held until the nodes are
    /// gone (fields drop in order: this one last). Six redis-servers per
    /// test, several tests at once on a 2-core machine, made the failover
    /// tests' deadlines a matter of luck.
    one_at_a_time: Option<OneAtATime>,
}

/// A process-wide turn (a flag and a condition variable, so the turn is
/// `Send`, unlike a `MutexGuard`, and a cluster can move between threads).
struct OneAtATime;

static BUSY: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
static FREED: std::sync::Condvar = std::sync::Condvar::new();

impl OneAtATime {
    fn take() -> Self {
        // A test that panicked while holding the flag poisoned nothing of ours.
        let mut busy = BUSY.lock().unwrap_or_else(|e| e.into_inner());
        while *busy {
            busy = FREED.wait(busy).unwrap_or_else(|e| e.into_inner());
        }
        *busy = true;
        OneAtATime
    }
}

impl Drop for OneAtATime {
    fn drop(&mut self) {
        *BUSY.lock().unwrap_or_else(|e| e.into_inner()) = false;
        FREED.notify_one();
    }
}

/// What a client needs to talk to the nodes, and what the nodes are started
/// with: `requirepass` (and `masterauth`), and TLS only (client certificate
/// required, TLS on the cluster bus and for replication).
#[derive(Clone, Default)]
struct Access {
    password: Option<String>,
    /// CA, certificate and key; the server certificate (127.0.0.1) serves
    /// both as the nodes' server and client certificate.
    tls: Option<TlsPaths>,
    /// More `redis-server` options for every node.
    server_args: Vec<String>,
}

#[derive(Clone)]
struct TlsPaths {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

impl Access {
    /// redis-cli's options.
    fn cli_args(&self, cmd: &mut Command) {
        if let Some(pw) = &self.password {
            cmd.args(["-a", pw, "--no-auth-warning"]);
        }
        if let Some(t) = &self.tls {
            cmd.arg("--tls").arg("--cacert").arg(&t.ca).arg("--cert").arg(&t.client_cert).arg("--key").arg(&t.client_key);
        }
    }
}

impl RedisCluster {
    /// Six nodes on ports of their own, formed into a cluster with every
    /// node reporting `cluster_state:ok`, all 16384 slots and six nodes.
    pub fn start() -> Self {
        Self::start_inner(Access::default())
    }

    /// Like `start`, TLS only on every node (clients must present a
    /// certificate of `certs`' CA), on the cluster bus too.
    pub fn start_tls(certs: &Certs) -> Self {
        let tls = TlsPaths { ca: certs.ca(), server_cert: certs.server_cert(), server_key: certs.server_key(), client_cert: certs.client_cert(), client_key: certs.client_key() };
        Self::start_inner(Access { tls: Some(tls), ..Access::default() })
    }

    /// Like `start`, every node requiring `password` (replicas use it as
    /// `masterauth`; `cli` authenticates with it).
    pub fn start_with_password(password: &str) -> Self {
        Self::start_inner(Access { password: Some(password.to_string()), ..Access::default() })
    }

    /// Like `start`, every node also started with `args` (e.g.
    /// `--cluster-require-full-coverage no`).
    pub fn start_with_args(args: &[&str]) -> Self {
        Self::start_inner(Access { server_args: args.iter().map(|a| a.to_string()).collect(), ..Access::default() })
    }

    fn start_inner(access: Access) -> Self {
        // Taken before the ports are chosen, so none is taken meanwhile.
        let one_at_a_time = OneAtATime::take();
        let mut cluster = on_own_ports("redis cluster", NODES, |ports| {
            if ports.iter().any(|&p| p > u16::MAX - BUS_OFFSET || std::net::TcpListener::bind(("127.0.0.1", p + BUS_OFFSET)).is_err()) {
                return Err("a cluster bus port (port + 10000) is not free".into());
            }
            let dir = tempfile::tempdir().unwrap();
            let mut c = Self {
                nodes: Vec::new(),
                ports: ports.to_vec(),
                dir,
                access: access.clone(),
                one_at_a_time: None,
            };
            for &port in ports {
                let node = c.spawn(port);
                c.nodes.push(Some(node));
            }
            c.confirm_own().map(|()| c)
        });
        cluster.one_at_a_time = Some(one_at_a_time);
        cluster.create();
        cluster
    }

    fn spawn(&self, port: u16) -> ChildGuard {
        let node_dir = self.dir.path().join(port.to_string());
        std::fs::create_dir_all(&node_dir).unwrap();
        let log = node_dir.join("redis.log");
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let mut cmd = Command::new("redis-server");
        match &self.access.tls {
            None => cmd.args(["--port", &port.to_string()]),
            Some(t) => cmd
                .args(["--port", "0", "--tls-port", &port.to_string(), "--tls-cluster", "yes", "--tls-replication", "yes", "--tls-auth-clients", "yes"])
                .arg("--tls-cert-file")
                .arg(&t.server_cert)
                .arg("--tls-key-file")
                .arg(&t.server_key)
                .arg("--tls-ca-cert-file")
                .arg(&t.ca),
        };
        // Formed in about 3 s, not 11: a primary pings its replica every
        // second while the cluster forms (Redis's default, restored once it
        // has formed, `create`: 10 s), and a replica of an idle primary
        // acknowledges an offset above 0, which `replicas_linked` waits
        // for, only once something was sent; and a replica's first sync
        // starts at once (the default waits 5 s for more replicas before a
        // diskless transfer).
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--repl-ping-replica-period", "1", "--repl-diskless-sync-delay", "0"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", NODE_TIMEOUT_MS, "--cluster-config-file"])
            .arg(node_dir.join("nodes.conf"))
            .arg("--dir")
            .arg(&node_dir)
            .stdout(out)
            .stderr(Stdio::null());
        if let Some(pw) = &self.access.password {
            cmd.args(["--requirepass", pw, "--masterauth", pw]);
        }
        cmd.args(&self.access.server_args);
        ChildGuard::spawn("redis-server (cluster node)", &mut cmd, Some(log))
    }

    /// Every node answers `INFO server` with the pid of the process started
    /// on its port (not another test's server that got the port first).
    fn confirm_own(&mut self) -> Result<(), String> {
        for i in 0..NODES {
            let port = self.ports[i];
            let node = self.nodes[i].as_mut().unwrap();
            let pid = node.pid();
            let access = self.access.clone();
            let own = || cli_output(port, &access, &["INFO", "server"]).is_some_and(|info| info.lines().any(|l| l.trim() == format!("process_id:{pid}")));
            match poll(Duration::from_secs(10), Some(node), own) {
                Waited::Ready => {}
                Waited::Exited(status) => return Err(format!("node on {port} exited with {status} (port taken?)\n{}", node.log())),
                Waited::TimedOut => return Err(format!("node on {port} does not answer as itself")),
            }
        }
        Ok(())
    }

    /// `redis-cli --cluster create`, then waits until every node agrees.
    fn create(&self) {
        let addrs: Vec<String> = self.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let mut cmd = Command::new("redis-cli");
        self.access.cli_args(&mut cmd);
        let out = cmd
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("redis-cli: {e} (scripts/test installs redis-tools)"));
        assert!(out.status.success(), "redis-cli --cluster create: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let formed = |port: u16| {
            cli_output(port, &self.access, &["CLUSTER", "INFO"]).is_some_and(|i| {
                i.contains("cluster_state:ok") && i.contains("cluster_slots_ok:16384") && i.contains(&format!("cluster_known_nodes:{NODES}"))
            })
        };
        let start = Instant::now();
        while !(self.ports.iter().all(|&p| formed(p)) && self.primaries().len() == 3 && self.replicas_linked()) {
            assert!(start.elapsed() < FORM_LIMIT, "the cluster did not form in {FORM_LIMIT:?}:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
        // Formed: back to Redis's default ping period. A ping a second
        // moves every primary's offset each second, and `wait_replicated`
        // (a replica's acknowledged offset equal to its primary's) would
        // then rarely hold: replicas acknowledge once a second too.
        for p in self.live_ports() {
            assert_eq!(self.cli(p, &["CONFIG", "SET", "repl-ping-replica-period", "10"]).trim(), "OK");
        }
    }

    /// Every replica's link to its primary is up (replication done), and
    /// every primary streams to its replica (`state=online`): after the
    /// initial (diskless) sync a primary holds its writes back until the
    /// replica's first `REPLCONF ACK`, up to a second later, although the
    /// replica already says `master_link_status:up`. A primary killed in
    /// that second leaves a promoted replica with none of them.
    fn replicas_linked(&self) -> bool {
        self.live_ports().into_iter().all(|p| match cli_output(p, &self.access, &["INFO", "replication"]) {
            Some(info) if info.contains("role:slave") => info.contains("master_link_status:up"),
            Some(info) => {
                let replicas: Vec<&str> = info.lines().filter(|l| l.starts_with("slave") && l.contains("ip=")).collect();
                // The ACK's offset: 0 until the first one arrives.
                let acked = |l: &str| l.split(',').find_map(|f| f.strip_prefix("offset=")).and_then(|o| o.parse::<u64>().ok()).is_some_and(|o| o > 0);
                replicas.iter().all(|l| l.contains("state=online") && acked(l))
            }
            None => false,
        })
    }

    /// `host:port` of every node, for `[redis] cluster`.
    pub fn seeds(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect()
    }

    fn live_ports(&self) -> Vec<u16> {
        self.ports.iter().zip(&self.nodes).filter(|(_, n)| n.is_some()).map(|(&p, _)| p).collect()
    }

    /// Ports of the live nodes that are primaries now (by `ROLE`).
    pub fn primaries(&self) -> Vec<u16> {
        self.live_ports().into_iter().filter(|&p| cli_output(p, &self.access, &["ROLE"]).is_some_and(|r| r.lines().next() == Some("master"))).collect()
    }

    /// `redis-cli -p port args...`: its stdout (raw, not a terminal's
    /// formatting). Panics if redis-cli fails.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli_output(port, &self.access, args).unwrap_or_else(|| panic!("redis-cli -p {port} {args:?} failed"))
    }

    /// `redis-cli --cluster reshard`: moves `slots` slots from the primary
    /// `from` to the primary `to` (redis-cli takes the source's lowest
    /// slots first), keys and all; returns redis-cli's output. Panics if it
    /// fails.
    pub fn reshard(&self, from: u16, to: u16, slots: u16) -> String {
        let id = |p: u16| self.cli(p, &["CLUSTER", "MYID"]).trim().to_string();
        let mut cmd = Command::new("redis-cli");
        self.access.cli_args(&mut cmd);
        let out = cmd
            .args(["--cluster", "reshard", &format!("127.0.0.1:{from}")])
            .args(["--cluster-from", &id(from), "--cluster-to", &id(to), "--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && !text.contains("[ERR]"), "redis-cli --cluster reshard: {text}");
        text
    }

    /// The slot ranges `port`'s node serves, from its `CLUSTER NODES` line.
    pub fn slot_ranges(&self, port: u16) -> Vec<(u16, u16)> {
        let nodes = self.cli(port, &["CLUSTER", "NODES"]);
        let me = nodes.lines().find(|l| l.contains("myself")).expect("CLUSTER NODES names myself");
        me.split_whitespace()
            .skip(8)
            .filter(|r| !r.starts_with('['))
            .map(|r| match r.split_once('-') {
                Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
                None => (r.parse().unwrap(), r.parse().unwrap()),
            })
            .collect()
    }

    /// Moves `slot` from the primary `from` to `to` as `redis-cli --cluster
    /// reshard` does (IMPORTING, MIGRATING, MIGRATE of its keys, SETSLOT NODE
    /// on every primary), with `ask_ms` between the MIGRATE and the
    /// hand-over (the keys on `to`, the slot still `from`'s: every request
    /// meets `ASK`). Blocks the calling thread.
    pub fn move_slot(&self, slot: u16, from: u16, to: u16, ask_ms: u64) {
        let id = |p: u16| self.cli(p, &["CLUSTER", "MYID"]).trim().to_string();
        let ok = |out: String| assert_eq!(out.trim(), "OK", "{out}");
        let slot = slot.to_string();
        let (from_id, to_id) = (id(from), id(to));
        ok(self.cli(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]));
        ok(self.cli(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]));
        loop {
            let keys = self.cli(from, &["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
            let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let to_port = to.to_string();
            let mut migrate = vec!["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
            migrate.extend(keys.iter().copied());
            ok(self.cli(from, &migrate));
        }
        std::thread::sleep(Duration::from_millis(ask_ms));
        for p in self.primaries() {
            ok(self.cli(p, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]));
        }
    }

    /// Moves `slot` as `move_slot` does, in steps: after `pause`, one
    /// `MIGRATE` of half the keys left (at least one), until none is left,
    /// then `pause` and the hand-over. Between two steps some of the slot's
    /// keys are on `to` and some on `from`, and a call naming keys of both
    /// gets `TRYAGAIN` (so does one naming a key that exists nowhere, from
    /// the start of the migration to the hand-over). Returns the steps.
    /// Blocks the calling thread.
    pub fn move_slot_in_halves(&self, slot: u16, from: u16, to: u16, pause: Duration) -> usize {
        let id = |p: u16| self.cli(p, &["CLUSTER", "MYID"]).trim().to_string();
        let ok = |out: String| assert_eq!(out.trim(), "OK", "{out}");
        let slot = slot.to_string();
        let (from_id, to_id, to_port) = (id(from), id(to), to.to_string());
        ok(self.cli(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]));
        ok(self.cli(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]));
        let mut steps = 0;
        loop {
            std::thread::sleep(pause);
            let keys = self.cli(from, &["CLUSTER", "GETKEYSINSLOT", &slot, "1000"]);
            let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let mut migrate = vec!["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
            migrate.extend(keys.iter().take(keys.len().div_ceil(2)).copied());
            ok(self.cli(from, &migrate));
            steps += 1;
        }
        std::thread::sleep(pause);
        for p in self.primaries() {
            ok(self.cli(p, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]));
        }
        steps
    }

    /// The primary serving `slot` now (from `CLUSTER NODES` of a live node).
    pub fn owner(&self, slot: u16) -> u16 {
        self.primaries().into_iter().find(|&p| self.slot_ranges(p).iter().any(|&(a, b)| a <= slot && slot <= b)).expect("every slot is served")
    }

    /// Waits until every live replica has every write its primary has
    /// (replication offsets equal), so a primary killed now loses nothing.
    pub fn wait_replicated(&self, limit: Duration) -> bool {
        let caught_up = || {
            self.primaries().into_iter().all(|p| match cli_output(p, &self.access, &["INFO", "replication"]) {
                Some(info) => {
                    let offset = info.lines().find_map(|l| l.trim().strip_prefix("master_repl_offset:")).and_then(|o| o.parse::<u64>().ok());
                    let replicas: Vec<u64> = info.lines().filter(|l| l.starts_with("slave") && l.contains("ip=")).filter_map(|l| l.split(',').find_map(|f| f.strip_prefix("offset=")).and_then(|o| o.trim().parse().ok())).collect();
                    offset.is_some_and(|o| replicas.iter().all(|&r| r == o))
                }
                None => false,
            })
        };
        poll(limit, None, caught_up) == Waited::Ready
    }

    /// SIGKILL the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|&p| p == port).expect("a node of this cluster");
        if let Some(mut node) = self.nodes[i].take() {
            node.kill();
        }
    }

    /// Waits until every live node says `cluster_state:ok` and three live
    /// nodes are primaries (after a kill: the replica was promoted and the
    /// others know it). Returns whether that happened within `limit`.
    pub fn wait_ok(&self, limit: Duration) -> bool {
        let ok = || self.primaries().len() == 3 && self.live_ports().into_iter().all(|p| cli_output(p, &self.access, &["CLUSTER", "INFO"]).is_some_and(|i| i.contains("cluster_state:ok")));
        poll(limit, None, ok) == Waited::Ready
    }

    /// Every node's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut all = String::new();
        for p in &self.ports {
            let path: PathBuf = self.dir.path().join(p.to_string()).join("redis.log");
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            all += &format!("--- node {p} ---\n");
            for l in tail.into_iter().rev() {
                all += l;
                all += "\n";
            }
        }
        all
    }
}

/// `redis-cli -p port args...`, stdout if it exited 0 and printed no error.
fn cli_output(port: u16, access: &Access, args: &[&str]) -> Option<String> {
    let mut cmd = Command::new("redis-cli");
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    access.cli_args(&mut cmd);
    let out = cmd.args(args).stderr(Stdio::null()).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success() && !text.starts_with("ERR") && !text.starts_with("NOAUTH") && !text.starts_with("Could not connect")).then_some(text)
}

/// The Cluster slot of `key` (CRC16/XMODEM of the key, or of its first
/// non-empty `{...}` hash tag, mod 16384), as Redis computes it: lets a
/// test pick keys by slot without a redis-cli call per candidate.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter().position(|&b| b == b'}').filter(|&len| len > 0).map(|len| &rest[..len])
    });
    let mut crc: u16 = 0;
    for &b in tagged.unwrap_or(key) {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc & 0x3fff
}
