//! Real nginx with the Lua module, in a temp prefix, on loopback ports
//! confirmed to be its own.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use super::ports::{listens_on, on_own_ports};
use super::process::ChildGuard;
use super::wait::{poll, Waited};
use super::{is_root, WORKER_GROUP};

const START_LIMIT: Duration = Duration::from_secs(10);

/// As root, its workers run as `nobody:nogroup`. Stopped with SIGQUIT when
/// dropped, so that the master takes its workers down with it.
pub struct Nginx {
    child: ChildGuard,
    pub prefix: TempDir,
    /// The port `{PORT}` stands for.
    pub port: u16,
    /// The ports `{PORT:name}` stand for, by name.
    named_ports: BTreeMap<String, u16>,
}

impl Nginx {
    /// Starts nginx with `http_body` inside `http { }`. In it, `{PORT}` and
    /// each `{PORT:name}` are replaced by loopback ports of nginx's own, and
    /// `{LUA}` by the directory holding the shipped Lua client.
    pub fn start(http_body: &str) -> Self {
        Self::start_with_lua(http_body, std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/resty")))
    }

    /// Like `start`, with the Lua client's `resty/` directory taken from
    /// `lua_resty` (an installed rock's tree) instead of the checkout.
    pub fn start_with_lua(http_body: &str, lua_resty: &std::path::Path) -> Self {
        let names = port_names(http_body);
        on_own_ports("nginx", 1 + names.len(), |ports| {
            let named_ports: BTreeMap<String, u16> = names.iter().cloned().zip(ports[1..].iter().copied()).collect();
            Self::launch(http_body, ports[0], named_ports, lua_resty)
        })
    }

    /// On `Err` (nginx exited: a port was taken) the attempt's processes and
    /// prefix are gone.
    fn launch(http_body: &str, port: u16, named_ports: BTreeMap<String, u16>, lua_resty: &std::path::Path) -> Result<Self, String> {
        let prefix = tempfile::tempdir().unwrap();
        std::fs::set_permissions(prefix.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        // A copy the workers can read wherever the checkout lives.
        let lua_dir = prefix.path().join("lua");
        copy_lua_tree(lua_resty, &lua_dir.join("resty"));
        std::fs::create_dir_all(prefix.path().join("logs")).unwrap();
        let mut body = http_body.replace("{PORT}", &port.to_string()).replace("{LUA}", &lua_dir.display().to_string());
        for (name, p) in &named_ports {
            body = body.replace(&format!("{{PORT:{name}}}"), &p.to_string());
        }
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
        );
        let conf_path = prefix.path().join("nginx.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let error_log = prefix.path().join("logs/error.log");
        let mut cmd = Command::new("nginx");
        cmd.arg("-p").arg(prefix.path()).arg("-c").arg(&conf_path).arg("-e").arg(&error_log).args(["-g", "daemon off;"]).stderr(Stdio::null());
        let mut child = ChildGuard::spawn("nginx", &mut cmd, Some(error_log)).stop_politely_with(Signal::SIGQUIT, Duration::from_secs(5));
        // The master binds every listening socket before it forks workers;
        // holding them all means the ports are its own, and connections
        // wait in the backlog until a worker accepts them.
        let master = child.pid();
        let ports: Vec<u16> = std::iter::once(port).chain(named_ports.values().copied()).collect();
        match poll(START_LIMIT, Some(&mut child), || ports.iter().all(|&p| listens_on(master, p))) {
            Waited::Ready => Ok(Self { child, prefix, port, named_ports }),
            Waited::Exited(status) => Err(format!("nginx exited with {status}: {}", child.log().lines().last().unwrap_or(""))),
            Waited::TimedOut => panic!("nginx not listening on {ports:?} after {START_LIMIT:?}\n{}", child.log()),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The port `{PORT:name}` stood for.
    pub fn named_port(&self, name: &str) -> u16 {
        *self.named_ports.get(name).unwrap_or_else(|| panic!("no {{PORT:{name}}} in the configuration"))
    }

    pub fn error_log(&self) -> String {
        self.child.log()
    }

    /// The error log's lines at level error or worse.
    pub fn error_lines(&self) -> Vec<String> {
        self.error_log().lines().filter(|l| ["[error]", "[crit]", "[alert]", "[emerg]"].iter().any(|level| l.contains(level))).map(str::to_string).collect()
    }

    /// Fails when the error log holds a line at level error or worse.
    pub fn assert_no_errors(&self) {
        let errors = self.error_lines();
        assert!(errors.is_empty(), "nginx error log:\n{}", errors.join("\n"));
    }

    /// Sends `sig` to the master (SIGHUP: a reload, new workers, the shared
    /// dicts kept).
    pub fn signal(&self, sig: Signal) {
        self.child.signal(sig);
    }

    /// A reload (SIGHUP) that returns once it is over: new workers run and
    /// every worker from before has exited. A request sent earlier may meet
    /// an old worker that is shutting down, which closes a connection it
    /// accepted but has not read from yet: the client sees the peer
    /// disconnect with no response.
    #[allow(dead_code)]
    pub fn reload(&self) {
        let master = self.child.pid();
        let before = worker_pids(master);
        self.signal(Signal::SIGHUP);
        let deadline = std::time::Instant::now() + START_LIMIT;
        loop {
            let now = worker_pids(master);
            if !now.is_empty() && now.iter().all(|p| !before.contains(p)) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "nginx's reload did not finish: workers {before:?} before, {now:?} now");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The processes whose parent is `master` (/proc/<pid>/stat: the field
/// after the command's closing parenthesis is the state, then the parent).
fn worker_pids(master: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { continue };
        if rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) == Some(master) {
            pids.push(pid);
        }
    }
    pids
}

/// The shipped Lua client: `resty/ratelimitd.lua` and its modules under
/// `resty/ratelimitd/` (the unit tests beside them are not shipped).
fn copy_lua_tree(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            copy_lua_tree(&path, &to.join(path.file_name().unwrap()));
        } else if path.extension().is_some_and(|e| e == "lua") {
            std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
        }
    }
}

/// The distinct `name`s of `{PORT:name}` in `text`.
fn port_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in text.match_indices("{PORT:") {
        let rest = &text[at + "{PORT:".len()..];
        let name = &rest[..rest.find('}').expect("{PORT:name} closed by }")];
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    names
}
