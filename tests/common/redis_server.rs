//! `redis-server` processes of the tests' own: on a Unix socket in a temp
//! dir where a test needs no TCP, else on a loopback port confirmed to be
//! served by the process started (see `ports`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use super::ports::on_own_port;
use super::process::ChildGuard;
use super::tls::Certs;
use super::wait::{poll, Waited};

/// How long a starting server may take to answer.
const START_LIMIT: Duration = Duration::from_secs(10);

/// Where the server listens.
#[derive(Clone)]
enum Listen {
    Tcp,
    Tls(TlsFiles),
    Unix(PathBuf),
}

/// The TLS server's files and the client certificate the helper's own
/// connections present (the server may require one).
#[derive(Clone)]
struct TlsFiles {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

/// A `redis-server` of its own, with an empty temp dir (nothing is saved),
/// its stdout in `redis.log` there. Killed when dropped.
pub struct RedisServer {
    child: Option<ChildGuard>,
    /// The TCP (or TLS) port; 0 for a server on a Unix socket only, as with
    /// `redis-server --port 0`.
    pub port: u16,
    dir: TempDir,
    listen: Listen,
    /// `start_with`'s arguments, given again on `restart`.
    extra: Vec<String>,
    /// From `--requirepass`: the helper's own connections authenticate.
    password: Option<String>,
}

impl RedisServer {
    /// On a loopback TCP port of its own.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// On a loopback TCP port of its own, with more `redis-server` arguments
    /// (after the helper's, so they may override them).
    pub fn start_with(args: &[&str]) -> Self {
        Self::start_on_own_port(Listen::Tcp, args)
    }

    /// TLS only (no plaintext port), on a port of its own, with `certs`'
    /// server certificate and CA.
    pub fn start_tls_with(certs: &Certs, args: &[&str]) -> Self {
        let files = TlsFiles { ca: certs.ca(), server_cert: certs.server_cert(), server_key: certs.server_key(), client_cert: certs.client_cert(), client_key: certs.client_key() };
        Self::start_on_own_port(Listen::Tls(files), args)
    }

    /// On `redis.sock` in its temp dir, no TCP at all: nothing another test
    /// does can reach it or take its address, and `restart` gets the same
    /// address back.
    pub fn start_unix() -> Self {
        Self::start_unix_with(&[])
    }

    pub fn start_unix_with(args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("redis.sock");
        Self::start_unix_in(dir, socket, args)
    }

    /// On the Unix socket `socket`, which the caller chose (and may have
    /// handed to a daemon before the server existed).
    pub fn start_unix_at(socket: &Path) -> Self {
        Self::start_unix_in(tempfile::tempdir().unwrap(), socket.to_path_buf(), &[])
    }

    fn start_unix_in(dir: TempDir, socket: PathBuf, args: &[&str]) -> Self {
        // sun_path holds 108 bytes; a longer path fails in bind with a
        // message that does not say why.
        assert!(socket.as_os_str().len() < 108, "{}: too long for a Unix socket; set TMPDIR to a shorter directory", socket.display());
        let mut s = Self::new(dir, Listen::Unix(socket), 0, args);
        if let Err(why) = s.spawn_confirmed() {
            panic!("redis-server on {}: {why}", s.url());
        }
        s
    }

    fn start_on_own_port(listen: Listen, args: &[&str]) -> Self {
        on_own_port("redis-server", |port| {
            let mut s = Self::new(tempfile::tempdir().unwrap(), listen.clone(), port, args);
            s.spawn_confirmed().map(|()| s)
        })
    }

    fn new(dir: TempDir, listen: Listen, port: u16, args: &[&str]) -> Self {
        let password = args.iter().position(|a| *a == "--requirepass").and_then(|i| args.get(i + 1)).map(|p| p.to_string());
        Self { child: None, port, dir, listen, extra: args.iter().map(|a| a.to_string()).collect(), password }
    }

    /// Starts the process and waits until it answers as itself; on `Err`
    /// (it exited, say because its port was taken, or another process
    /// answered on the port) nothing of it is left running.
    fn spawn_confirmed(&mut self) -> Result<(), String> {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]).arg("--dir").arg(self.dir.path());
        match &self.listen {
            Listen::Tcp => {
                cmd.args(["--port", &self.port.to_string()]);
            }
            Listen::Tls(t) => {
                cmd.args(["--port", "0", "--tls-port", &self.port.to_string()]);
                cmd.arg("--tls-cert-file").arg(&t.server_cert).arg("--tls-key-file").arg(&t.server_key).arg("--tls-ca-cert-file").arg(&t.ca);
            }
            Listen::Unix(path) => {
                cmd.args(["--port", "0", "--unixsocketperm", "700", "--unixsocket"]).arg(path);
            }
        }
        cmd.args(&self.extra);
        let log = self.dir.path().join("redis.log");
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        cmd.stdout(out).stderr(Stdio::null());
        let mut child = ChildGuard::spawn("redis-server", &mut cmd, Some(log));
        let confirmed = confirm_own_pid(&mut child, || self.client());
        if confirmed.is_ok() {
            self.child = Some(child);
        }
        confirmed
    }

    /// For the daemon's configuration: no credentials (tests hand the
    /// password over the way they test it).
    pub fn url(&self) -> String {
        match &self.listen {
            Listen::Tcp => format!("redis://127.0.0.1:{}/0", self.port),
            Listen::Tls(_) => format!("rediss://127.0.0.1:{}/0", self.port),
            Listen::Unix(path) => format!("redis+unix://{}", path.display()),
        }
    }

    /// The Unix socket, for a server started with `start_unix*`.
    pub fn socket(&self) -> Option<&Path> {
        match &self.listen {
            Listen::Unix(path) => Some(path),
            _ => None,
        }
    }

    /// A client for the helper's own connections: authenticated, and with
    /// the client certificate on TLS.
    fn client(&self) -> redis::RedisResult<redis::Client> {
        let auth = self.password.as_deref();
        match &self.listen {
            Listen::Tcp => redis::Client::open(format!("redis://{}127.0.0.1:{}/0", auth.map(|p| format!(":{p}@")).unwrap_or_default(), self.port).as_str()),
            Listen::Tls(t) => {
                let read = |p: &PathBuf| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                let certs = redis::TlsCertificates {
                    client_tls: Some(redis::ClientTlsConfig { client_cert: read(&t.client_cert), client_key: read(&t.client_key) }),
                    root_cert: Some(read(&t.ca)),
                };
                let url = format!("rediss://{}127.0.0.1:{}/0", auth.map(|p| format!(":{p}@")).unwrap_or_default(), self.port);
                redis::Client::build_with_tls(url.as_str(), certs)
            }
            Listen::Unix(path) => redis::Client::open(format!("redis+unix://{}{}", path.display(), auth.map(|p| format!("?pass={p}")).unwrap_or_default()).as_str()),
        }
    }

    /// A plain connection for assertions on Redis's own state.
    pub fn conn(&self) -> redis::Connection {
        self.client().and_then(|c| c.get_connection()).unwrap_or_else(|e| panic!("connect to {}: {e}\n{}", self.url(), self.log()))
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("redis-server running").pid()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// SIGKILL: the server vanishes with everything it held.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }

    /// SIGSTOP: the server hangs with its connections open.
    pub fn pause(&self) {
        self.child.as_ref().expect("redis-server running").signal(Signal::SIGSTOP);
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        self.child.as_ref().expect("redis-server running").signal(Signal::SIGCONT);
    }

    /// A fresh server at the same address (empty: nothing was saved). On a
    /// Unix socket the address is certain to be free; a TCP port may have
    /// been taken while the server was down, which fails the test rather
    /// than let it talk to someone else's server.
    pub fn restart(&mut self) {
        self.kill();
        if let Err(why) = self.spawn_confirmed() {
            panic!("redis-server restarted on {}: {why}", self.url());
        }
    }
}

/// Waits until the server at `client()` says (`INFO server` `process_id`)
/// that it is `child`. `Err` when `child` exited first or another process
/// answered; `child` is stopped then.
pub(super) fn confirm_own_pid(child: &mut ChildGuard, client: impl Fn() -> redis::RedisResult<redis::Client>) -> Result<(), String> {
    let ours = child.pid();
    let mut answered = None;
    let waited = poll(START_LIMIT, Some(child), || {
        answered = server_pid(&client);
        answered.is_some()
    });
    match (waited, answered) {
        (Waited::Ready, Some(pid)) if pid == ours => Ok(()),
        (Waited::Ready, Some(pid)) => {
            child.kill();
            Err(format!("process {pid}, not ours ({ours}), answered"))
        }
        (Waited::Exited(status), _) => Err(format!("{} exited with {status}: {}", child.name(), last_lines(&child.log(), 2))),
        _ => panic!("{} did not answer within {START_LIMIT:?}\n{}", child.name(), child.log()),
    }
}

/// The `process_id` the server reports, if it answers at all.
fn server_pid(client: &impl Fn() -> redis::RedisResult<redis::Client>) -> Option<u32> {
    // Bounded: a foreign process on the port might accept and never answer.
    let mut conn = client().ok()?.get_connection_with_timeout(Duration::from_secs(1)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    let info: String = redis::cmd("INFO").arg("server").query(&mut conn).ok()?;
    info.lines().find_map(|l| l.strip_prefix("process_id:")).and_then(|pid| pid.trim().parse().ok())
}

fn last_lines(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" / ")
}

/// `calls` of `cmdstat_evalsha` in `INFO commandstats`: the script calls
/// Redis ran since it started (or its last `CONFIG RESETSTAT`).
pub fn evalsha_calls(r: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut r.conn()).unwrap();
    info.lines().find_map(|l| l.strip_prefix("cmdstat_evalsha:calls=")).map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// The daemon's Redis window store on `r` (2 s timeout), ready to decide,
/// for the tests that call it directly rather than through a daemon.
pub async fn window(r: &RedisServer, token: &tokio_util::sync::CancellationToken) -> std::sync::Arc<ratelimitd::RedisWindow> {
    use ratelimitd::config::{RedisConfig, RedisSecrets, RedisTarget};
    let cfg = RedisConfig { target: RedisTarget::Url(r.url()), timeout: Duration::from_secs(2), ..RedisConfig::default() };
    let w = ratelimitd::RedisWindow::start(&cfg, &RedisSecrets::default(), token.clone()).unwrap();
    assert!(w.wait_ready(Duration::from_secs(5)).await);
    w
}
