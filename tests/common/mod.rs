//! Real processes for the integration tests: `redis-server` on a free
//! loopback port in a temp dir, and the `ratelimitd` binary on a socket in a
//! temp dir. Both are stopped when dropped.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ratelimitd::client::Client;
use ratelimitd::protocol::{CheckArgs, FailPolicy};
use tempfile::TempDir;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn wait_until(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "{what} not ready after {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A `redis-server` of its own.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: TempDir,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_on(free_port())
    }

    pub fn start_on(port: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Self { child: None, port, dir };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (scripts/test installs it)");
        self.child = Some(child);
        let url = self.url();
        wait_until("redis-server", Duration::from_secs(10), || {
            redis::Client::open(url.as_str()).unwrap().get_connection().and_then(|mut c| redis::cmd("PING").query::<String>(&mut c)).is_ok()
        });
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// A plain connection for assertions on Redis's own state.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url().as_str()).unwrap().get_connection().unwrap()
    }

    /// SIGKILL: the server vanishes with everything it held.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = self.child.as_ref().expect("running").id();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).unwrap();
    }

    /// SIGSTOP: the server hangs with its connections open.
    pub fn pause(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    /// A fresh server on the same port (empty: nothing was saved).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A paused server must be woken to be killed cleanly.
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGCONT);
        }
        self.kill();
    }
}

/// The real daemon binary.
pub struct Daemon {
    child: Child,
    dir: TempDir,
    pub socket: PathBuf,
    pub config: PathBuf,
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
        let dir = tempfile::tempdir().unwrap();
        // Other users (nginx workers) must be able to reach the socket inside.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let socket = dir.path().join("ratelimitd.sock");
        let config = dir.path().join("ratelimitd.toml");
        let text = format!("[server]\nlisten = \"{}\"\nshutdown_grace_ms = 2000\n{rest}\n", socket.display());
        std::fs::write(&config, text).unwrap();
        let child = Self::spawn(&dir, &config);
        let d = Self { child, dir, socket, config };
        d.wait_ready();
        d
    }

    fn spawn(dir: &TempDir, config: &std::path::Path) -> Child {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.path().join("daemon.log")).unwrap();
        Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
            .args(["serve", "--config"])
            .arg(config)
            .env("RUST_LOG", "ratelimitd=debug")
            .stderr(log)
            .spawn()
            .unwrap()
    }

    fn wait_ready(&self) {
        wait_until("ratelimitd", Duration::from_secs(10), || std::os::unix::net::UnixStream::connect(&self.socket).is_ok());
    }

    /// Starts the daemon again with the same config and socket, after `terminate`.
    pub fn start_again(&mut self) {
        self.child = Self::spawn(&self.dir, &self.config);
        self.wait_ready();
    }

    pub async fn client(&self) -> Client {
        Client::connect(&self.socket).await.unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    /// Rewrites the configuration file (for SIGHUP tests).
    pub fn rewrite_config(&self, text: &str) {
        std::fs::write(&self.config, text).unwrap();
    }

    pub fn config_text(&self) -> String {
        std::fs::read_to_string(&self.config).unwrap()
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::Signal::SIGTERM);
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "daemon did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Check arguments with the defaults most tests use.
pub fn args(key: &str, limit: u32, window_ms: u32) -> CheckArgs<'_> {
    CheckArgs { key: key.as_bytes(), limit, window_ms, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// Redis-backed or in-memory daemon, for cases both backends must pass.
pub enum Setup {
    Redis(RedisServer, Daemon),
    Memory(Daemon),
}

impl Setup {
    pub fn redis() -> Self {
        let r = RedisServer::start();
        // A generous deadline: these tests are about semantics, not latency.
        let d = Daemon::start(Some(&r.url()), "timeout_ms = 500");
        Self::Redis(r, d)
    }

    pub fn memory() -> Self {
        Self::Memory(Daemon::start(None, ""))
    }

    pub fn daemon(&self) -> &Daemon {
        match self {
            Self::Redis(_, d) | Self::Memory(d) => d,
        }
    }

    pub fn source(&self) -> ratelimitd::protocol::Source {
        match self {
            Self::Redis(..) => ratelimitd::protocol::Source::Redis,
            Self::Memory(_) => ratelimitd::protocol::Source::Memory,
        }
    }
}

/// True when the tests run as root, so nginx workers can run as `nobody`.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The group unprivileged nginx workers run as (Debian: nogroup).
pub const WORKER_GROUP: &str = "nogroup";

/// Real nginx with the Lua module, on a free loopback port, in a temp prefix.
/// As root, its workers run as `nobody:nogroup`.
pub struct Nginx {
    child: Option<Child>,
    pub prefix: TempDir,
    pub port: u16,
}

impl Nginx {
    /// Starts nginx with `http_body` inside `http { }`. The string `{LUA}`
    /// in it is replaced by the directory holding the shipped Lua client.
    pub fn start(http_body: &str) -> Self {
        let prefix = tempfile::tempdir().unwrap();
        std::fs::set_permissions(prefix.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        // A copy the workers can read wherever the checkout lives.
        let lua_dir = prefix.path().join("lua");
        std::fs::create_dir_all(lua_dir.join("resty")).unwrap();
        std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/resty/ratelimitd.lua"), lua_dir.join("resty/ratelimitd.lua")).unwrap();
        std::fs::create_dir_all(prefix.path().join("logs")).unwrap();
        let port = free_port();
        let user = if is_root() { format!("user nobody {WORKER_GROUP};") } else { String::new() };
        let conf = format!(
            "load_module /usr/lib/nginx/modules/ndk_http_module.so;\n\
             load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;\n\
             {user}\nworker_processes 2;\npid {p}/nginx.pid;\nerror_log {p}/logs/error.log info;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n access_log off;\n client_body_temp_path {p}/tmp_body;\n proxy_temp_path {p}/tmp_proxy;\n\
             fastcgi_temp_path {p}/tmp_fastcgi;\n uwsgi_temp_path {p}/tmp_uwsgi;\n scgi_temp_path {p}/tmp_scgi;\n\
             lua_package_path \"{p}/lua/?.lua;;\";\n{body}\n}}\n",
            p = prefix.path().display(),
            body = http_body.replace("{PORT}", &port.to_string()).replace("{LUA}", &lua_dir.display().to_string()),
        );
        let conf_path = prefix.path().join("nginx.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let child = Command::new("nginx")
            .arg("-p")
            .arg(prefix.path())
            .arg("-c")
            .arg(&conf_path)
            .arg("-e")
            .arg(prefix.path().join("logs/error.log"))
            .args(["-g", "daemon off;"])
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx must be installed (scripts/test installs it)");
        let mut n = Self { child: Some(child), prefix, port };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = n.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("nginx exited with {status}: {}", n.error_log());
            }
            assert!(start.elapsed() < Duration::from_secs(10), "nginx not ready: {}", n.error_log());
            std::thread::sleep(Duration::from_millis(10));
        }
        n
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.prefix.path().join("logs/error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGQUIT: graceful stop of master and workers.
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGQUIT);
            let start = Instant::now();
            while c.try_wait().ok().flatten().is_none() && start.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
