//! The daemon's configuration: one TOML file, read, parsed, validated, with
//! the file and the field named in every error. Every field is documented in
//! docs/CONFIG.md and in the commented example `ratelimitd.example.toml`.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::protocol::{Bounds, MAX_FRAME_LEN, REQUEST_HEADER_LEN, LIMIT_ENTRY_LEN};

/// Where a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("{path}: line {line}: {message}")]
    Parse { path: PathBuf, line: usize, message: String },
    #[error("{path}: {field}: {message}")]
    Invalid { path: PathBuf, field: &'static str, message: String },
}

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The Unix socket and connection handling.
    #[serde(default)]
    pub server: ServerConfig,
    /// The shared store. Absent: the in-memory backend, limits per host.
    #[serde(default)]
    pub redis: Option<RedisConfig>,
    /// Bounds every request must respect.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// The Prometheus endpoint. Absent: no metrics served.
    #[serde(default)]
    pub metrics: Option<MetricsConfig>,
}

/// `[metrics]`: Prometheus text format over HTTP, `GET /metrics`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// A loopback address and port, e.g. "127.0.0.1:9464".
    pub listen: std::net::SocketAddr,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Path of the Unix socket Nginx workers connect to.
    pub listen: PathBuf,
    /// Octal permission bits of the socket file, as a string ("0660").
    pub socket_mode: String,
    /// Group that owns the socket file (e.g. "www-data"); unset keeps the daemon's group.
    pub socket_group: Option<String>,
    /// Most client connections served at once; more wait in the accept queue.
    pub max_connections: usize,
    /// Most requests one connection may have in flight (pipelined) at once.
    pub max_in_flight_per_connection: usize,
    /// On shutdown, how long to let in-flight requests finish, in ms.
    pub shutdown_grace_ms: u64,
    /// Close a connection with nothing in flight after this long, in ms.
    /// Keep it above the Lua client's keepalive_timeout (60 s).
    pub idle_timeout_ms: u64,
    /// Close a connection whose frame is not complete this long after its
    /// first byte arrived (slow or stuck clients), in ms.
    pub frame_timeout_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: PathBuf::from("/run/ratelimitd/ratelimitd.sock"),
            socket_mode: "0660".into(),
            socket_group: None,
            max_connections: 4096,
            max_in_flight_per_connection: 128,
            shutdown_grace_ms: 5000,
            idle_timeout_ms: 300_000,
            frame_timeout_ms: 2000,
        }
    }
}

/// Which clock timestamps admissions.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ClockSource {
    /// Redis `TIME`, read inside the script: one clock for every gateway.
    #[default]
    Redis,
    /// This host's wall clock, sent with each call; hosts must be in sync.
    Local,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// `redis://[user[:password]@]host:port/db`, `rediss://...` (TLS) or
    /// `redis+unix:///path/to/redis.sock`. Unset: `redis://127.0.0.1:6379/0`,
    /// or the master named by `[redis.sentinel]`.
    pub url: Option<String>,
    /// ACL user; overrides the URL's.
    pub username: Option<String>,
    /// File holding the password (one line); overrides the URL's.
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the password; overrides the URL's.
    pub password_env: Option<String>,
    /// PEM file of the CA that signed the server's certificate (`rediss://`).
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate for mutual TLS; needs `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// Deadline of one decision in Redis, in ms; past it the fail policy decides.
    pub timeout_ms: u64,
    /// Deadline of establishing a connection, in ms.
    pub connect_timeout_ms: u64,
    /// Consecutive timeouts that open the circuit breaker.
    pub breaker_failures: u32,
    /// Prepended to every key; keys cannot reach outside it.
    pub key_prefix: String,
    /// Which clock timestamps admissions.
    pub clock: ClockSource,
    /// Find the master through Redis Sentinel instead of a fixed URL.
    pub sentinel: Option<SentinelConfig>,
}

/// The default Redis URL.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379/0";

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            username: None,
            password_file: None,
            password_env: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            timeout_ms: 20,
            connect_timeout_ms: 250,
            breaker_failures: 5,
            key_prefix: "ratelimitd:".into(),
            clock: ClockSource::Redis,
            sentinel: None,
        }
    }
}

impl RedisConfig {
    /// The URL to connect to (direct mode).
    pub fn url(&self) -> &str {
        self.url.as_deref().unwrap_or(DEFAULT_REDIS_URL)
    }

    /// The password from `password_file` or `password_env`, if set.
    pub fn password(&self) -> Result<Option<String>, String> {
        read_secret(self.password_file.as_deref(), self.password_env.as_deref())
    }

    /// Where the link points, without credentials.
    pub fn describe(&self) -> String {
        match &self.sentinel {
            Some(s) => format!("master '{}' via sentinels {}", s.master_name, s.addresses.join(",")),
            None => redacted_url(self.url()),
        }
    }
}

/// `[redis.sentinel]`: the sentinels that know the master.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SentinelConfig {
    /// The master's name in the sentinels' configuration.
    pub master_name: String,
    /// Sentinel addresses, "host:port".
    pub addresses: Vec<String>,
    /// ACL user for the sentinels (not the master).
    #[serde(default)]
    pub username: Option<String>,
    /// File holding the sentinels' password.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the sentinels' password.
    #[serde(default)]
    pub password_env: Option<String>,
}

impl SentinelConfig {
    pub fn password(&self) -> Result<Option<String>, String> {
        read_secret(self.password_file.as_deref(), self.password_env.as_deref())
    }
}

/// A secret from a file (first line) or an environment variable, never both.
fn read_secret(file: Option<&Path>, env: Option<&str>) -> Result<Option<String>, String> {
    match (file, env) {
        (Some(_), Some(_)) => Err("set password_file or password_env, not both".into()),
        (Some(path), None) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let line = text.lines().next().unwrap_or("").to_string();
            if line.is_empty() {
                return Err(format!("{} is empty", path.display()));
            }
            Ok(Some(line))
        }
        (None, Some(var)) => match std::env::var(var) {
            Ok(v) if !v.is_empty() => Ok(Some(v)),
            _ => Err(format!("environment variable {var} is not set")),
        },
        (None, None) => Ok(None),
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Longest key a client may send, in bytes.
    pub max_key_len: usize,
    /// Largest limit (and local limit) a request may carry. Redis holds one
    /// ZSET member per admission, so this bounds memory per key.
    pub max_limit: u32,
    /// Longest window a request may carry, in ms.
    pub max_window_ms: u32,
    /// Largest cost of one request. Each unit of cost is one ZSET member
    /// written inside the atomic script, so this bounds the script's run time.
    pub max_cost: u32,
    /// Most keys the in-memory windows (memory backend, local fallback) hold.
    pub max_local_keys: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let b = Bounds::default();
        Self { max_key_len: b.max_key_len, max_limit: b.max_limit, max_window_ms: b.max_window_ms, max_cost: b.max_cost, max_local_keys: 1_000_000 }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `error`, `warn`, `info`, `debug` or `trace`, or a tracing filter
    /// such as `ratelimitd=debug`. `RUST_LOG` overrides it.
    pub level: String,
    /// `text` (human-readable) or `json` (one object per line).
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { level: "info".into(), format: LogFormat::Text }
    }
}

impl Config {
    /// Reads, parses and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read { path: path.into(), err })?;
        let cfg = Self::parse(path, &text)?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Parses TOML; errors name the file and line.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let line = e.span().map_or(0, |s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            ConfigError::Parse { path: path.into(), line, message: e.message().trim().replace('\n', " ") }
        })
    }

    /// Checks values that parse but cannot work.
    pub fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |field: &'static str, message: String| Err(ConfigError::Invalid { path: path.into(), field, message });
        let s = &self.server;
        if s.listen.as_os_str().is_empty() {
            return bad("server.listen", "must be a socket path".into());
        }
        // sun_path holds 108 bytes including the NUL, and the socket is bound
        // first as "<listen>.<pid>.tmp" (up to 16 bytes more).
        if s.listen.as_os_str().len() > 91 {
            return bad("server.listen", format!("{} bytes is longer than the 91 a socket path may have here (sun_path is 108 bytes, less a temporary suffix)", s.listen.as_os_str().len()));
        }
        if let Err(m) = self.socket_mode() {
            return bad("server.socket_mode", m);
        }
        if s.max_connections == 0 {
            return bad("server.max_connections", "must be at least 1".into());
        }
        if s.idle_timeout_ms == 0 {
            return bad("server.idle_timeout_ms", "must be at least 1".into());
        }
        if s.frame_timeout_ms == 0 {
            return bad("server.frame_timeout_ms", "must be at least 1".into());
        }
        if s.max_in_flight_per_connection == 0 {
            return bad("server.max_in_flight_per_connection", "must be at least 1".into());
        }
        if let Some(r) = &self.redis {
            if let Err(e) = redis::Client::open(r.url()) {
                return bad("redis.url", format!("'{}' is not a Redis URL: {e}", redacted_url(r.url())));
            }
            if let Err(m) = r.password() {
                return bad(if r.password_env.is_some() && r.password_file.is_none() { "redis.password_env" } else { "redis.password_file" }, m);
            }
            let tls = r.url().starts_with("rediss://");
            for (field, path) in [("redis.tls_ca_file", &r.tls_ca_file), ("redis.tls_cert_file", &r.tls_cert_file), ("redis.tls_key_file", &r.tls_key_file)] {
                if let Some(path) = path {
                    if !tls {
                        return bad(field, "needs a rediss:// url".into());
                    }
                    if let Err(e) = std::fs::metadata(path) {
                        return bad(field, format!("{}: {e}", path.display()));
                    }
                }
            }
            if r.tls_cert_file.is_some() != r.tls_key_file.is_some() {
                return bad("redis.tls_key_file", "tls_cert_file and tls_key_file go together".into());
            }
            if r.breaker_failures == 0 || r.breaker_failures > 1000 {
                return bad("redis.breaker_failures", format!("{} is outside 1..=1000", r.breaker_failures));
            }
            if let Some(s) = &r.sentinel {
                if r.url.is_some() {
                    return bad("redis.url", "leave it unset with [redis.sentinel]: the sentinels name the master".into());
                }
                if s.master_name.is_empty() {
                    return bad("redis.sentinel.master_name", "must not be empty".into());
                }
                if s.addresses.is_empty() {
                    return bad("redis.sentinel.addresses", "needs at least one \"host:port\"".into());
                }
                for a in &s.addresses {
                    let port = a.rsplit_once(':').and_then(|(h, p)| (!h.is_empty()).then(|| p.parse::<u16>().ok()).flatten());
                    if port.is_none() {
                        return bad("redis.sentinel.addresses", format!("'{a}' is not \"host:port\""));
                    }
                }
                if let Err(m) = s.password() {
                    return bad(if s.password_env.is_some() && s.password_file.is_none() { "redis.sentinel.password_env" } else { "redis.sentinel.password_file" }, m);
                }
            }
            if r.timeout_ms == 0 || r.timeout_ms > 10_000 {
                return bad("redis.timeout_ms", format!("{} is outside 1..=10000", r.timeout_ms));
            }
            if r.connect_timeout_ms == 0 || r.connect_timeout_ms > 60_000 {
                return bad("redis.connect_timeout_ms", format!("{} is outside 1..=60000", r.connect_timeout_ms));
            }
            if r.key_prefix.len() > 64 || r.key_prefix.contains(['{', '}']) || r.key_prefix.chars().any(char::is_control) {
                return bad("redis.key_prefix", "must be at most 64 bytes, without braces or control characters".into());
            }
        }
        let l = &self.limits;
        let max_key = MAX_FRAME_LEN - REQUEST_HEADER_LEN - LIMIT_ENTRY_LEN;
        if l.max_key_len == 0 || l.max_key_len > max_key {
            return bad("limits.max_key_len", format!("{} is outside 1..={max_key}", l.max_key_len));
        }
        if l.max_limit == 0 || l.max_limit > 100_000_000 {
            return bad("limits.max_limit", format!("{} is outside 1..=100000000", l.max_limit));
        }
        if l.max_window_ms == 0 || l.max_window_ms > 30 * 86_400_000 {
            return bad("limits.max_window_ms", format!("{} is outside 1..=2592000000 (30 days)", l.max_window_ms));
        }
        if l.max_local_keys < 64 {
            return bad("limits.max_local_keys", format!("{} is below the minimum of 64", l.max_local_keys));
        }
        if l.max_cost == 0 || l.max_cost > 100_000 {
            return bad("limits.max_cost", format!("{} is outside 1..=100000", l.max_cost));
        }
        if !valid_log_filter(&self.log.level) {
            return bad("log.level", format!("'{}' is not error, warn, info, debug, trace or a filter such as \"ratelimitd=debug\"", self.log.level));
        }
        if let Some(m) = &self.metrics {
            if !m.listen.ip().is_loopback() {
                return bad("metrics.listen", format!("{} is not a loopback address; the endpoint is for a local scraper or agent", m.listen));
            }
        }
        if let Some(group) = &self.server.socket_group {
            match nix::unistd::Group::from_name(group) {
                Ok(Some(_)) => {}
                Ok(None) => return bad("server.socket_group", format!("group '{group}' does not exist")),
                Err(e) => return bad("server.socket_group", format!("cannot look up group '{group}': {e}")),
            }
        }
        Ok(())
    }

    /// The socket mode as permission bits.
    pub fn socket_mode(&self) -> Result<u32, String> {
        let m = &self.server.socket_mode;
        match u32::from_str_radix(m.trim_start_matches("0o"), 8) {
            Ok(bits) if bits <= 0o777 => Ok(bits),
            _ => Err(format!("'{m}' is not an octal mode such as \"0660\"")),
        }
    }

    pub fn bounds(&self) -> Bounds {
        let l = &self.limits;
        Bounds { max_key_len: l.max_key_len, max_limit: l.max_limit, max_window_ms: l.max_window_ms, max_cost: l.max_cost }
    }
}

/// A bare level, or directives each of which names a level after `=`:
/// a typo such as "infoo" would otherwise parse as a target and log nothing.
fn valid_log_filter(filter: &str) -> bool {
    const LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];
    let level_ok = |l: &str| LEVELS.contains(&l.trim().to_ascii_lowercase().as_str());
    !filter.trim().is_empty()
        && filter.split(',').all(|d| match d.split_once('=') {
            Some((target, level)) => !target.trim().is_empty() && level_ok(level),
            None => level_ok(d),
        })
}

/// The URL with its password replaced by `***`, for logs and messages.
pub fn redacted_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        let p = Path::new("test.toml");
        let c = Config::parse(p, text)?;
        c.validate(p)?;
        Ok(c)
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redacted_url("redis://u:secret@h:6379/0"), "redis://u:***@h:6379/0");
        assert_eq!(redacted_url("redis://:secret@h"), "redis://:***@h");
        assert_eq!(redacted_url("redis://h:6379"), "redis://h:6379");
    }

    #[test]
    fn empty_file_gives_defaults_and_memory_backend() {
        let c = parse("").unwrap();
        assert_eq!(c, Config::default());
        assert!(c.redis.is_none());
        assert_eq!(c.socket_mode().unwrap(), 0o660);
    }

    #[test]
    fn secrets_come_from_a_file_or_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pw");
        std::fs::write(&f, "s3cret\n").unwrap();
        let c = parse(&format!("[redis]\npassword_file = \"{}\"\n", f.display())).unwrap();
        assert_eq!(c.redis.unwrap().password().unwrap().as_deref(), Some("s3cret"));
        let e = parse("[redis]\npassword_env = \"RATELIMITD_TEST_UNSET_VAR\"\n").unwrap_err().to_string();
        assert!(e.contains("redis.password_env: environment variable RATELIMITD_TEST_UNSET_VAR is not set"), "{e}");
        let e = parse(&format!("[redis]\npassword_file = \"{}\"\npassword_env = \"X\"\n", f.display())).unwrap_err().to_string();
        assert!(e.contains("not both"), "{e}");
    }

    #[test]
    fn sentinel_and_tls_settings_are_checked() {
        let ok = parse("[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [\"127.0.0.1:26379\"]\n").unwrap();
        assert_eq!(ok.redis.unwrap().sentinel.unwrap().master_name, "mymaster");
        let e = parse("[redis]\nurl = \"redis://h\"\n[redis.sentinel]\nmaster_name = \"m\"\naddresses = [\"h:1\"]\n").unwrap_err().to_string();
        assert!(e.contains("redis.url"), "{e}");
        let e = parse("[redis.sentinel]\nmaster_name = \"m\"\naddresses = [\"h\"]\n").unwrap_err().to_string();
        assert!(e.contains("redis.sentinel.addresses"), "{e}");
        let e = parse("[redis]\ntls_ca_file = \"/etc/hostname\"\n").unwrap_err().to_string();
        assert!(e.contains("needs a rediss:// url"), "{e}");
    }

    #[test]
    fn metrics_only_on_loopback() {
        assert!(parse("[metrics]\nlisten = \"127.0.0.1:9464\"\n").is_ok());
        assert!(parse("[metrics]\nlisten = \"[::1]:9464\"\n").is_ok());
        let e = parse("[metrics]\nlisten = \"0.0.0.0:9464\"\n").unwrap_err().to_string();
        assert!(e.contains("metrics.listen"), "{e}");
    }

    #[test]
    fn example_config_is_valid() {
        let c = parse(include_str!("../ratelimitd.example.toml")).unwrap();
        assert_eq!(c.redis.unwrap().timeout_ms, 20);
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = parse("[redis]\nurl = \"redis://127.0.0.1\"\ntimeout = 5\n").unwrap_err().to_string();
        assert!(e.starts_with("test.toml: line 3:"), "{e}");
        assert!(e.contains("unknown field `timeout`"), "{e}");
        let e = parse("[sever]\n").unwrap_err().to_string();
        assert!(e.contains("unknown field `sever`"), "{e}");
    }

    #[test]
    fn invalid_values_name_the_field() {
        let e = parse("[server]\nsocket_mode = \"0999\"\n").unwrap_err().to_string();
        assert_eq!(e, "test.toml: server.socket_mode: '0999' is not an octal mode such as \"0660\"");
        let e = parse("[redis]\ntimeout_ms = 0\n").unwrap_err().to_string();
        assert!(e.contains("redis.timeout_ms"), "{e}");
        let e = parse("[redis]\nkey_prefix = \"a{b}\"\n").unwrap_err().to_string();
        assert!(e.contains("redis.key_prefix"), "{e}");
        let e = parse("[redis]\nurl = \"http://x\"\n").unwrap_err().to_string();
        assert!(e.contains("redis.url"), "{e}");
        let e = parse("[log]\nlevel = \"infoo\"\n").unwrap_err().to_string();
        assert!(e.contains("log.level"), "{e}");
        assert!(parse("[log]\nlevel = \"warn,ratelimitd=debug\"\n").is_ok());
        let e = parse("[server]\nsocket_group = \"no-such-group-xyz\"\n").unwrap_err().to_string();
        assert!(e.contains("server.socket_group"), "{e}");
        let e = parse("[redis]\nurl = \"http://u:secret@x\"\n").unwrap_err().to_string();
        assert!(!e.contains("secret"), "{e}");
        let e = parse("[redis]\nclock = \"ntp\"\n").unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
    }
}
