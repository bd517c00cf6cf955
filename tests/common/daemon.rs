//! The real `ratelimitd` binary, serving on a socket in a temp dir.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use nix::sys::signal::Signal;
use ratelimitd::client::Client;
use tempfile::TempDir;

use super::ports::{listens_on, on_own_port};
use super::process::ChildGuard;
use super::wait::{poll, Waited};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

/// The daemon the tests start: this build's, or `RATELIMITD_TEST_BIN` when
/// set (scripts/test runs tests/fleet_under_admission.rs with the release
/// build the package ships: that test measures how fast the daemon refills
/// a key at its limit, and a debug daemon is several times slower).
fn bin() -> std::ffi::OsString {
    std::env::var_os("RATELIMITD_TEST_BIN").unwrap_or_else(|| BIN.into())
}
const START_LIMIT: Duration = Duration::from_secs(10);

/// The real daemon binary; killed when dropped.
pub struct Daemon {
    child: ChildGuard,
    dir: TempDir,
    pub socket: PathBuf,
    pub config: PathBuf,
    /// `[metrics] listen` port, for a daemon started with `start_config_with_metrics`.
    metrics_port: Option<u16>,
}

impl Daemon {
    /// Starts `ratelimitd serve` with `[redis] url` set (or no Redis) and
    /// any extra TOML appended to the `[redis]` table.
    pub fn start(redis_url: Option<&str>, redis_extra: &str) -> Self {
        Self::start_with("socket_mode = \"0600\"", redis_url, redis_extra)
    }

    /// Like `start`, with extra lines for the `[server]` table.
    pub fn start_with(server_extra: &str, redis_url: Option<&str>, redis_extra: &str) -> Self {
        let mut rest = server_extra.to_string();
        if let Some(url) = redis_url {
            rest += &format!("\n[redis]\nurl = \"{url}\"\n{redis_extra}\n");
        }
        Self::start_config(&rest)
    }

    /// Starts with `[server] listen` set, followed by `rest` verbatim (more
    /// `[server]` lines first, then any tables).
    pub fn start_config(rest: &str) -> Self {
        Self::launch(rest, None).unwrap_or_else(|why| panic!("{why}"))
    }

    /// `start_config` that returns why the daemon did not start (it exited
    /// first, say, when a port in `rest` was taken) instead of panicking.
    pub fn try_start_config(rest: &str) -> Result<Self, String> {
        Self::launch(rest, None)
    }

    /// Like `start_config`, and serving metrics on a loopback port of its
    /// own (a `[metrics]` table is appended to `rest`): the daemon exits when
    /// the port is taken as it binds, and is then started on another.
    pub fn start_config_with_metrics(rest: &str) -> Self {
        on_own_port("ratelimitd metrics", |port| Self::launch(rest, Some(port)))
    }

    /// On `Err` the attempt's process and temp dir are gone.
    fn launch(rest: &str, metrics_port: Option<u16>) -> Result<Self, String> {
        let dir = tempfile::tempdir().unwrap();
        // Other users (nginx workers) must be able to reach the socket inside.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let socket = dir.path().join("ratelimitd.sock");
        let config = dir.path().join("ratelimitd.toml");
        let mut text = format!("[server]\nlisten = \"{}\"\nshutdown_grace = \"2s\"\n{rest}\n", socket.display());
        if let Some(port) = metrics_port {
            text += &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n");
        }
        std::fs::write(&config, text).unwrap();
        let mut d = Self { child: Self::spawn(&dir, &config), dir, socket, config, metrics_port };
        d.wait_ready(0).map(|()| d)
    }

    fn spawn(dir: &TempDir, config: &Path) -> ChildGuard {
        let log = dir.path().join("daemon.log");
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let mut cmd = Command::new(bin());
        // DAEMON_RUST_LOG: another filter for a run that needs more (e.g.
        // `ratelimitd=debug,redis=debug` for redis-rs's cluster recovery).
        let filter = std::env::var("DAEMON_RUST_LOG").unwrap_or_else(|_| "ratelimitd=debug".into());
        cmd.args(["serve", "--config"]).arg(config).env("RUST_LOG", filter).stderr(file);
        ChildGuard::spawn("ratelimitd", &mut cmd, Some(log))
    }

    /// Ready once its socket accepts, its metrics port (if any) is its own
    /// and, with a `[redis]` table, it has said how its start-up wait for
    /// Redis ended (more such lines in its log than `redis_lines_before`):
    /// the daemon binds its socket before Redis first answers, and a test
    /// that counts Redis calls must not meet the start-up probe's late.
    /// `Err` with the log if it exits first or does not get there.
    fn wait_ready(&mut self, redis_lines_before: usize) -> Result<(), String> {
        let (socket, pid, metrics) = (self.socket.clone(), self.child.pid(), self.metrics_port);
        let uses_redis = std::fs::read_to_string(&self.config).is_ok_and(|c| c.contains("[redis]"));
        let log = self.dir.path().join("daemon.log");
        let redis_said = || !uses_redis || redis_start_lines(&std::fs::read_to_string(&log).unwrap_or_default()) > redis_lines_before;
        let ready = || std::os::unix::net::UnixStream::connect(&socket).is_ok() && metrics.map_or(true, |port| listens_on(pid, port)) && redis_said();
        match poll(START_LIMIT, Some(&mut self.child), ready) {
            Waited::Ready => Ok(()),
            Waited::Exited(status) => Err(format!("ratelimitd exited with {status} before it was ready\n{}", self.log())),
            Waited::TimedOut => Err(format!("ratelimitd not ready after {START_LIMIT:?}\n{}", self.log())),
        }
    }

    /// `kill -9` (no shutdown: leases, shares and reservations are left
    /// outstanding), reaped, then started again with the same config and
    /// socket.
    pub fn kill9_and_start_again(&mut self) {
        self.child.signal(Signal::SIGKILL);
        self.child.kill();
        self.start_again();
    }

    /// Starts the daemon again with the same config and socket, after `terminate`.
    pub fn start_again(&mut self) {
        let before = redis_start_lines(&self.log());
        self.child = Self::spawn(&self.dir, &self.config);
        if let Err(why) = self.wait_ready(before) {
            panic!("started again: {why}");
        }
    }

    pub async fn client(&self) -> Client {
        Client::connect(&self.socket).await.unwrap()
    }

    pub fn log(&self) -> String {
        self.child.log()
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: Signal) {
        self.child.signal(sig);
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// The metrics endpoint of a daemon started with `start_config_with_metrics`.
    pub fn metrics_url(&self) -> String {
        format!("http://127.0.0.1:{}/metrics", self.metrics_port.expect("started with start_config_with_metrics"))
    }

    /// Rewrites the configuration file (for SIGHUP tests).
    pub fn rewrite_config(&self, text: &str) {
        std::fs::write(&self.config, text).unwrap();
    }

    pub fn config_text(&self) -> String {
        std::fs::read_to_string(&self.config).unwrap()
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        self.child.terminate(Duration::from_secs(10))
    }
}

/// The lines in which a daemon said how its start-up wait for Redis ended
/// (src/daemon.rs `log_readiness`).
fn redis_start_lines(log: &str) -> usize {
    log.matches("redis backend ready").count() + log.matches("redis not reachable yet").count()
}
