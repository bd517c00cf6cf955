//! Turns the file's values into typed ones in one pass that reports every
//! bad field. Pure: it reads the file it is given and nothing else.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::file;
use super::model::{valid_policy_name, 
    redacted_url, AdminConfig, AdminListen, AdminTls, Config, ConfigError, DenialCacheConfig, HostPort, LimitsConfig, LogConfig, MetricsConfig, Overrides, Penalty, PolicyConfig, PolicyLimit, PolicyRule, Problems, RedisConfig, RedisTarget, SecretSource,
    SentinelConfig, ClusterConfig, ServerConfig, TlsFiles, ADMIN_MAX_CONNECTIONS_DEFAULT, ADMIN_MAX_CONNECTIONS_MAX, DEFAULT_REDIS_URL, MAX_PENALTY_AFTER, MAX_SHARDS,
};
use crate::protocol::{Algorithm, Bounds, FailPolicy, LIMIT_ENTRY_LEN, MAX_FRAME_LEN, MAX_POLICY_NAME_LEN, REQUEST_HEADER_LEN};

impl Default for Config {
    /// The configuration of an empty file.
    fn default() -> Self {
        Self::from_file(Path::new("defaults"), file::File::default()).expect("the defaults are valid")
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Config::default().server
    }
}

impl Default for RedisConfig {
    /// The defaults of an empty `[redis]` table.
    fn default() -> Self {
        let mut p = Problems::default();
        redis_config(file::RedisSection::default(), &mut p, &mut Vec::new()).expect("the defaults are valid")
    }
}

impl Config {
    /// Reads, parses and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_with(Some(path), &Overrides::default())
    }

    /// Reads `path` (none: the defaults), applies `overrides`, and validates.
    pub fn load_with(path: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        let mut raw = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read { path: path.into(), err })?;
                parse_file(path, &text)?
            }
            None => file::File::default(),
        };
        if let Some(listen) = &overrides.listen {
            raw.server.listen = listen.clone();
        }
        if let Some(url) = &overrides.redis_url {
            raw.redis.get_or_insert_with(file::RedisSection::default).url = Some(url.clone());
        }
        let origin = match (path, overrides.is_empty()) {
            (Some(path), true) => path.to_path_buf(),
            (Some(path), false) => PathBuf::from(format!("{} (with command-line overrides)", path.display())),
            (None, _) => PathBuf::from("command line"),
        };
        Self::from_file(&origin, raw)
    }

    /// Parses and validates TOML text; errors name `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        Self::from_file(path, parse_file(path, text)?)
    }

    /// Turns the file's values into typed ones, reporting every bad field.
    fn from_file(path: &Path, f: file::File) -> Result<Self, ConfigError> {
        let written_durations = f.written_durations();
        let mut p = Problems::default();
        let mut deprecated = Vec::new();
        let server = server_config(f.server, &mut p, &mut deprecated);
        let redis = f.redis.and_then(|r| redis_config(r, &mut p, &mut deprecated));
        let limits = limits_config(f.limits, &mut p);
        if !valid_log_filter(&f.log.level) {
            p.add("log.level", format!("'{}' is not error, warn, info, debug, trace or a filter such as \"ratelimitd=debug\"", f.log.level));
        }
        let metrics = f.metrics.map(|m| {
            if !m.listen.ip().is_loopback() {
                p.add("metrics.listen", format!("{} is not a loopback address; the endpoint is for a local scraper or agent", m.listen));
            }
            MetricsConfig { listen: m.listen }
        });
        let log = LogConfig { level: f.log.level, format: f.log.format };
        let denial_cache = denial_cache_config(f.denial_cache, &mut p, &mut deprecated);
        let mut policy_sections = f.policy;
        let envoy = f.envoy.map(|e| {
            let read = super::envoy::read(e, path, &mut p);
            policy_sections.extend(read.policies);
            read.envoy
        });
        let policies = policies_config(policy_sections, &limits.bounds, &mut p, &mut deprecated);
        if let Some(e) = &envoy {
            super::envoy::check_routes(e, &policies, &mut p);
        }
        let admin = admin_config(f.admin, &mut p);
        p.into_result(path, Self { server, redis, limits, log, metrics, denial_cache, admin, policies, envoy, deprecated, written_durations })
    }
}

fn parse_file(path: &Path, text: &str) -> Result<file::File, ConfigError> {
    file::parse(path, text)
}

fn at_least_one<T: PartialEq + Default>(p: &mut Problems, field: &'static str, v: T) -> T {
    if v == T::default() {
        p.add(field, "must be at least 1");
    }
    v
}

/// A duration written with its unit (`new = "20ms"`), or by its old name in
/// milliseconds (`old = 20`: read, with a deprecation line), or `default_ms`:
/// the name the file used (for the problems below) and the milliseconds.
/// Both names at once is a problem of its own.
fn duration_ms(p: &mut Problems, deprecated: &mut Vec<String>, new: (&'static str, Option<String>), old: (&'static str, Option<u64>), default_ms: u64) -> (&'static str, u64) {
    let ((new_name, new_text), (old_name, old_ms)) = (new, old);
    match (new_text, old_ms) {
        (Some(_), Some(_)) => {
            p.add(new_name, format!("give {new_name} only ({old_name} is its old spelling)"));
            (new_name, default_ms)
        }
        (Some(text), None) => match parse_duration(&text) {
            Ok(d) => (new_name, u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            Err(e) => {
                p.add(new_name, e);
                (new_name, default_ms)
            }
        },
        (None, Some(ms)) => {
            deprecated.push(format!("{old_name} is the old spelling of {new_name}, a duration with its unit: write {} = \"{}\"", new_name.rsplit('.').next().unwrap_or(new_name), duration_text_of(ms)));
            (old_name, ms)
        }
        (None, None) => (new_name, default_ms),
    }
}

/// `ms` in the largest unit that divides it: 300000 is "5m", 250 "250ms".
pub fn duration_text_of(ms: u64) -> String {
    for (unit, per) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)] {
        if ms > 0 && ms % per == 0 {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

fn server_config(s: file::ServerSection, p: &mut Problems, deprecated: &mut Vec<String>) -> ServerConfig {
    let (_, shutdown_grace_ms) = duration_ms(p, deprecated, ("server.shutdown_grace", s.shutdown_grace), ("server.shutdown_grace_ms", s.shutdown_grace_ms), 5000);
    let (idle_field, idle_timeout_ms) = duration_ms(p, deprecated, ("server.idle_timeout", s.idle_timeout), ("server.idle_timeout_ms", s.idle_timeout_ms), 300_000);
    let (frame_field, frame_timeout_ms) = duration_ms(p, deprecated, ("server.frame_timeout", s.frame_timeout), ("server.frame_timeout_ms", s.frame_timeout_ms), 2000);
    let (write_field, write_timeout_ms) = duration_ms(p, deprecated, ("server.write_timeout", s.write_timeout), ("server.write_timeout_ms", s.write_timeout_ms), 2000);
    if s.listen.as_os_str().is_empty() {
        p.add("server.listen", "must be a socket path");
    }
    // sun_path holds 108 bytes including the NUL, and the socket is bound
    // first as "<listen>.<pid>.tmp" (up to 16 bytes more).
    if s.listen.as_os_str().len() > 91 {
        p.add("server.listen", format!("{} bytes is longer than the 91 a socket path may have here (sun_path is 108 bytes, less a temporary suffix)", s.listen.as_os_str().len()));
    }
    let socket_mode = match u32::from_str_radix(s.socket_mode.trim_start_matches("0o"), 8) {
        Ok(bits) if bits <= 0o777 => bits,
        _ => {
            p.add("server.socket_mode", format!("'{}' is not an octal mode such as \"0660\"", s.socket_mode));
            0
        }
    };
    if s.socket_group.as_deref() == Some("") {
        p.add("server.socket_group", "must not be empty (leave it unset to keep the daemon's group)");
    }
    ServerConfig {
        listen: s.listen,
        socket_mode,
        socket_group: s.socket_group,
        max_connections: at_least_one(p, "server.max_connections", s.max_connections),
        max_in_flight_per_connection: at_least_one(p, "server.max_in_flight_per_connection", s.max_in_flight_per_connection),
        shutdown_grace: Duration::from_millis(shutdown_grace_ms),
        idle_timeout: Duration::from_millis(at_least_one(p, idle_field, idle_timeout_ms)),
        frame_timeout: Duration::from_millis(at_least_one(p, frame_field, frame_timeout_ms)),
        write_timeout: Duration::from_millis(at_least_one(p, write_field, write_timeout_ms)),
        worker_threads: in_range(p, "server.worker_threads", s.worker_threads as u64, MAX_WORKER_THREADS) as usize,
        spin: Duration::from_micros(if s.spin_us > MAX_SPIN_US {
            p.add("server.spin_us", format!("{} is outside 0..={MAX_SPIN_US}", s.spin_us));
            0
        } else {
            s.spin_us
        }),
    }
}

/// Upper bound of `server.spin_us`: past a few wake-ups' worth the spin
/// only burns a core.
const MAX_SPIN_US: u64 = 10_000;

/// Upper bound of `server.worker_threads`.
const MAX_WORKER_THREADS: u64 = 256;

/// Upper bound of `redis.min_in_flight` and `redis.max_in_flight`: a
/// pipeline deeper than this misses any sane deadline on any Redis.
const MAX_IN_FLIGHT: u64 = 100_000;

fn in_range(p: &mut Problems, field: &'static str, v: u64, max: u64) -> u64 {
    if v == 0 || v > max {
        p.add(field, format!("{v} is outside 1..={max}"));
    }
    v
}

/// Where a secret comes from: a file or a variable, never both.
fn secret_source(p: &mut Problems, file_field: &'static str, file: Option<PathBuf>, env: Option<String>) -> Option<SecretSource> {
    match (file, env) {
        (Some(_), Some(_)) => {
            p.add(file_field, "set password_file or password_env, not both");
            None
        }
        (Some(path), None) => Some(SecretSource::File(path)),
        (None, Some(var)) => Some(SecretSource::Env(var)),
        (None, None) => None,
    }
}

/// Where `[redis]` points: one Redis (`url`), a master through sentinels
/// (`[redis.sentinel]`) or a Cluster (`cluster`), and what is wrong with
/// that choice; those fields taken out of `r`.
fn redis_target(r: &mut file::RedisSection, p: &mut Problems) -> RedisTarget {
    match (r.sentinel.take(), r.cluster.take()) {
        (Some(_), Some(_)) => {
            p.add("redis.cluster", "set [redis.sentinel] or redis.cluster, not both");
            RedisTarget::Url(DEFAULT_REDIS_URL.to_string())
        }
        (None, Some(nodes)) => {
            if r.url.is_some() {
                p.add("redis.url", "leave it unset with redis.cluster: the cluster names its nodes");
            }
            if nodes.is_empty() {
                p.add("redis.cluster", "needs at least one \"host:port\"");
            }
            let mut seeds = Vec::with_capacity(nodes.len());
            for n in &nodes {
                match HostPort::parse(n) {
                    Some(hp) if hp.port != 0 => seeds.push(hp),
                    _ => p.add("redis.cluster", format!("'{n}' is not \"host:port\"")),
                }
            }
            RedisTarget::Cluster(ClusterConfig { seeds, tls: r.cluster_tls })
        }
        (Some(s), None) => {
            if r.url.is_some() {
                p.add("redis.url", "leave it unset with [redis.sentinel]: the sentinels name the master");
            }
            if s.master_name.is_empty() {
                p.add("redis.sentinel.master_name", "must not be empty");
            }
            if s.addresses.is_empty() {
                p.add("redis.sentinel.addresses", "needs at least one \"host:port\"");
            }
            let mut addresses = Vec::with_capacity(s.addresses.len());
            for a in &s.addresses {
                match HostPort::parse(a) {
                    Some(hp) => addresses.push(hp),
                    None => p.add("redis.sentinel.addresses", format!("'{a}' is not \"host:port\"")),
                }
            }
            let password = secret_source(p, "redis.sentinel.password_file", s.password_file, s.password_env);
            RedisTarget::Sentinel(SentinelConfig { master_name: s.master_name, addresses, username: s.username, password })
        }
        (None, None) => {
            let url = r.url.take().unwrap_or_else(|| DEFAULT_REDIS_URL.to_string());
            if let Err(e) = redis::Client::open(url.as_str()) {
                p.add("redis.url", format!("'{}' is not a Redis URL: {e}", redacted_url(&url)));
            }
            RedisTarget::Url(url)
        }
    }
}

/// `[redis]`'s TLS files, each only where the target speaks TLS, the
/// client's certificate and key together; those fields taken out of `r`.
fn redis_tls(target: &RedisTarget, r: &mut file::RedisSection, p: &mut Problems) -> TlsFiles {
    if r.cluster_tls && !matches!(target, RedisTarget::Cluster(_)) {
        p.add("redis.cluster_tls", "applies to redis.cluster only (a single Redis says rediss:// in its url)");
    }
    let tls_target = match target {
        RedisTarget::Url(u) => u.starts_with("rediss://"),
        RedisTarget::Cluster(c) => c.tls,
        RedisTarget::Sentinel(_) => false,
    };
    for (field, path) in [("redis.tls_ca_file", &r.tls_ca_file), ("redis.tls_cert_file", &r.tls_cert_file), ("redis.tls_key_file", &r.tls_key_file)] {
        if path.is_some() && !tls_target {
            p.add(field, "needs a rediss:// url, or cluster_tls = true with redis.cluster");
        }
    }
    let client = match (r.tls_cert_file.take(), r.tls_key_file.take()) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => {
            p.add("redis.tls_key_file", "tls_cert_file and tls_key_file go together");
            None
        }
    };
    TlsFiles { ca: r.tls_ca_file.take(), client }
}

/// `None` only when the section had errors (they are in `p`).
fn redis_config(mut r: file::RedisSection, p: &mut Problems, deprecated: &mut Vec<String>) -> Option<RedisConfig> {
    let before = p.0.len();
    let target = redis_target(&mut r, p);
    // Unset: on where the topology allows it. Asked for on a Cluster: the
    // same refusal at start, reload and check-config (all come here), so
    // that no daemon runs without what its file says.
    let one_node = !matches!(&target, RedisTarget::Cluster(_));
    if r.batch_cold_keys == Some(true) && !one_node {
        p.add("redis.batch_cold_keys", "not with redis.cluster: one call's keys would span slots (leave it unset: off on a Cluster, on elsewhere)");
    }
    let batch_cold_keys = r.batch_cold_keys.unwrap_or(one_node);
    let tls = redis_tls(&target, &mut r, p);
    let password = secret_source(p, "redis.password_file", r.password_file, r.password_env);
    let breaker_failures = in_range(p, "redis.breaker_failures", r.breaker_failures.into(), 1000) as u32;
    let (timeout_field, timeout_ms) = duration_ms(p, deprecated, ("redis.timeout", r.timeout), ("redis.timeout_ms", r.timeout_ms), 20);
    let (connect_field, connect_timeout_ms) = duration_ms(p, deprecated, ("redis.connect_timeout", r.connect_timeout), ("redis.connect_timeout_ms", r.connect_timeout_ms), 250);
    let timeout = Duration::from_millis(in_range(p, timeout_field, timeout_ms, 10_000));
    let connect_timeout = Duration::from_millis(in_range(p, connect_field, connect_timeout_ms, 60_000));
    let min_in_flight = in_range(p, "redis.min_in_flight", r.min_in_flight.into(), MAX_IN_FLIGHT) as u32;
    let max_in_flight = in_range(p, "redis.max_in_flight", r.max_in_flight.into(), MAX_IN_FLIGHT) as u32;
    if min_in_flight > max_in_flight && max_in_flight > 0 && u64::from(min_in_flight) <= MAX_IN_FLIGHT {
        p.add("redis.max_in_flight", format!("{max_in_flight} is below redis.min_in_flight ({min_in_flight})"));
    }
    if r.key_prefix.len() > 64 || r.key_prefix.contains(['{', '}']) || r.key_prefix.chars().any(char::is_control) {
        p.add("redis.key_prefix", "must be at most 64 bytes, without braces or control characters");
    }
    let cfg = RedisConfig {
        target,
        username: r.username,
        password,
        tls,
        timeout,
        connect_timeout,
        breaker_failures,
        min_in_flight,
        max_in_flight,
        key_prefix: r.key_prefix,
        clock: r.clock,
        // Unset: off on a Cluster: there a hot key's admissions from leases
        // leave the cluster connection few calls to answer, and a dead
        // primary's timeouts then count as evidence against every node and
        // open the breaker for all (tests/cluster.rs).
        // On everywhere: a Cluster's breakers are per slot, so a dead
        // primary's silence is not counted against the keys its leases
        // keep from calling the live ones (src/redis/link/breaker.rs).
        quota_leases: r.quota_leases.unwrap_or(true),
        batch_cold_keys,
    };
    (p.0.len() == before).then_some(cfg)
}

fn limits_config(l: file::LimitsSection, p: &mut Problems) -> LimitsConfig {
    let max_key = MAX_FRAME_LEN - REQUEST_HEADER_LEN - LIMIT_ENTRY_LEN;
    in_range(p, "limits.max_key_len", l.max_key_len as u64, max_key as u64);
    in_range(p, "limits.max_limit", l.max_limit.into(), 4_000_000_000);
    if l.max_window_ms == 0 || l.max_window_ms > 30 * 86_400_000 {
        p.add("limits.max_window_ms", format!("{} is outside 1..=2592000000 (30 days)", l.max_window_ms));
    }
    in_range(p, "limits.max_cost", l.max_cost.into(), 100_000);
    if l.max_local_keys < 64 {
        p.add("limits.max_local_keys", format!("{} is below the minimum of 64", l.max_local_keys));
    }
    LimitsConfig {
        bounds: Bounds { max_key_len: l.max_key_len, max_limit: l.max_limit, max_window_ms: l.max_window_ms, max_cost: l.max_cost },
        max_local_keys: l.max_local_keys,
    }
}

fn denial_cache_config(d: file::DenialCacheSection, p: &mut Problems, deprecated: &mut Vec<String>) -> DenialCacheConfig {
    if !(64..=1 << 24).contains(&d.slots) || !d.slots.is_power_of_two() {
        p.add("denial_cache.slots", format!("{} is not a power of two from 64 to 16777216", d.slots));
    }
    let (field, max_ms) = duration_ms(p, deprecated, ("denial_cache.max_age", d.max_age), ("denial_cache.max_ms", d.max_ms), 1000);
    in_range(p, field, max_ms, 60_000);
    DenialCacheConfig { enabled: d.enabled, slots: d.slots, max_age: Duration::from_millis(max_ms) }
}

fn admin_config(a: file::AdminSection, p: &mut Problems) -> AdminConfig {
    let mode = match u32::from_str_radix(a.socket_mode.trim_start_matches("0o"), 8) {
        Ok(m) if m <= 0o777 => m,
        _ => {
            p.add("admin.socket_mode", format!("'{}' is not an octal mode such as \"0600\"", a.socket_mode));
            0o600
        }
    };
    let listen = a.listen.map(|l| match l.parse::<SocketAddr>() {
        Ok(addr) => {
            if a.token_file.is_none() {
                p.add("admin.listen", format!("{addr} is a TCP address: set admin.token_file (a bearer token is required on TCP, with or without TLS; add admin.tls_cert_file and tls_key_file beyond loopback)"));
            }
            AdminListen::Tcp(addr)
        }
        Err(_) if l.starts_with('/') => AdminListen::Unix { path: PathBuf::from(l), mode },
        Err(_) => {
            p.add("admin.listen", format!("'{l}' is neither an absolute socket path nor a host:port address"));
            AdminListen::Unix { path: PathBuf::from(l), mode }
        }
    });
    let overrides_refresh = duration_within(p, "admin.overrides_refresh", &a.overrides_refresh, (Duration::from_millis(10), Duration::from_secs(3600)), "10ms and 1h", Duration::from_secs(1));
    let tcp = matches!(listen, Some(AdminListen::Tcp(_)));
    let tls = match (a.tls_cert_file, a.tls_key_file) {
        (Some(cert_file), Some(key_file)) if tcp => Some(AdminTls { cert_file, key_file, ca_file: a.tls_ca_file }),
        (Some(_), Some(_)) => {
            p.add("admin.tls_cert_file", "TLS is for a TCP listener (admin.listen = \"host:port\"); a Unix socket is protected by its mode");
            None
        }
        (None, None) => {
            if a.tls_ca_file.is_some() {
                p.add("admin.tls_ca_file", "is the command line's trust for a TLS listener: set admin.tls_cert_file and tls_key_file too");
            }
            None
        }
        _ => {
            p.add("admin.tls_cert_file", "give both admin.tls_cert_file and admin.tls_key_file (PEM), or neither");
            None
        }
    };
    let max_connections = match usize::try_from(a.max_connections) {
        Ok(n) if (1..=ADMIN_MAX_CONNECTIONS_MAX).contains(&n) => n,
        _ => {
            p.add("admin.max_connections", format!("{} is not between 1 and {ADMIN_MAX_CONNECTIONS_MAX}", a.max_connections));
            ADMIN_MAX_CONNECTIONS_DEFAULT
        }
    };
    let read_timeout = duration_within(p, "admin.read_timeout", &a.read_timeout, (Duration::from_millis(100), Duration::from_secs(300)), "100ms and 5m", Duration::from_secs(10));
    AdminConfig { listen, token_file: a.token_file, read_token_file: a.read_token_file, overrides_refresh, tls, max_connections, read_timeout }
}

/// `text` as a duration within `range` (`range_text` in the error), else
/// `fallback` and the problem reported under `field`.
fn duration_within(p: &mut Problems, field: &'static str, text: &str, range: (Duration, Duration), range_text: &str, fallback: Duration) -> Duration {
    match parse_duration(text) {
        Ok(d) if d >= range.0 && d <= range.1 => d,
        Ok(_) => {
            p.add(field, format!("must be between {range_text}"));
            fallback
        }
        Err(e) => {
            p.add(field, e);
            fallback
        }
    }
}

/// A duration such as "500ms", "1s", "2m", "1h" or "1d": a whole number and
/// a unit, in whole milliseconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let ms_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" if digits > 0 => return Err(format!("{s} has no unit: write \"{s}ms\" (or \"{}s\", ...): a duration is a quoted number with its unit", s.trim_start_matches('0').parse::<u64>().map_or(0, |n| n / 1000))),
        _ => return Err(format!("'{s}' is not a duration such as \"500ms\", \"1s\", \"1m\", \"1h\" or \"1d\"")),
    };
    let n: u64 = number.parse().map_err(|_| format!("'{s}' is not a duration such as \"500ms\", \"1s\", \"1m\", \"1h\" or \"1d\""))?;
    n.checked_mul(ms_per_unit).map(Duration::from_millis).ok_or_else(|| format!("'{s}' is too long"))
}


/// A limit of a policy or an override: 1..=`limits.max_limit`.
fn policy_limit(p: &mut Problems, field: &'static str, name: &str, what: &str, v: i64, bounds: &Bounds) -> u32 {
    if v < 1 || v > i64::from(bounds.max_limit) {
        p.add(field, format!("policy '{name}': {what} {v} is outside 1..={} (limits.max_limit)", bounds.max_limit));
        return 1;
    }
    v as u32
}

/// Why no request can carry a key (`sendable_key`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnsendableKey {
    #[error("the key is empty")]
    Empty,
    #[error("the key is {len} bytes, longer than limits.max_key_len ({max})")]
    TooLong { len: usize, max: usize },
    #[error("key byte {pos} is a control character")]
    Control { pos: usize },
}

/// Whether a request can carry `key`, by the rule the protocol decodes
/// keys with (1..=`max_key_len` bytes, no control byte): the one rule for
/// every key an operator names (the file's overrides and allowlist, the
/// admin API's), so nothing is stored for, or counted against a cap by, a
/// key no request can match.
pub fn sendable_key(key: &[u8], max_key_len: usize) -> Result<(), UnsendableKey> {
    if key.is_empty() {
        return Err(UnsendableKey::Empty);
    }
    if key.len() > max_key_len {
        return Err(UnsendableKey::TooLong { len: key.len(), max: max_key_len });
    }
    match key.iter().position(|&b| b < 0x20 || b == 0x7f) {
        Some(pos) => Err(UnsendableKey::Control { pos }),
        None => Ok(()),
    }
}

/// A key of an override or the allowlist: what a client can send.
fn policy_key_ok(p: &mut Problems, field: &'static str, name: &str, key: &str, bounds: &Bounds) -> bool {
    let ok = sendable_key(key.as_bytes(), bounds.max_key_len).is_ok();
    if !ok {
        p.add(field, format!("policy '{name}': key {key:?} can never be sent: it must be 1..={} bytes without control characters", bounds.max_key_len));
    }
    ok
}

fn policies_config(sections: Vec<file::PolicySection>, bounds: &Bounds, p: &mut Problems, deprecated: &mut Vec<String>) -> Vec<PolicyConfig> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(sections.len());
    for (i, s) in sections.into_iter().enumerate() {
        let name = s.name;
        if !valid_policy_name(&name) {
            p.add("policy.name", format!("[[policy]] #{}: '{name}' is not 1..={MAX_POLICY_NAME_LEN} characters of A-Z a-z 0-9 _ . -", i + 1));
        } else if !seen.insert(name.clone()) {
            p.add("policy.name", format!("[[policy]] #{}: '{name}' is already the name of an earlier policy", i + 1));
        }
        let limit = policy_limit(p, "policy.limit", &name, "limit", i64::try_from(s.limit).unwrap_or(i64::MAX), bounds);
        let concurrency = s.algorithm.as_deref() == Some(CONCURRENCY);
        let lease_ms = policy_lease(p, &name, concurrency, s.lease.as_deref(), &s.window, bounds);
        let algorithm = if concurrency { Algorithm::Log } else { policy_algorithm(p, &name, s.algorithm.as_deref()) };
        let calendar_window_ms = policy_calendar(p, &name, &s.window, s.utc_offset.as_deref(), algorithm);
        let window = match parse_duration(&s.window) {
            _ if concurrency => Duration::from_millis(u64::from(lease_ms.unwrap_or(1))),
            _ if s.window.is_empty() => {
                p.add("policy.window", format!("policy '{name}': missing field `window` (such as \"1s\"), or algorithm = \"{CONCURRENCY}\" with a lease"));
                Duration::from_millis(1)
            }
            _ if s.window == "month" => Duration::from_millis(31 * 86_400_000),
            Ok(w) if w.is_zero() || w.as_millis() > u128::from(bounds.max_window_ms) => {
                p.add("policy.window", format!("policy '{name}': {} is outside 1ms..={}ms (limits.max_window_ms)", s.window, bounds.max_window_ms));
                Duration::from_millis(1)
            }
            Ok(w) => w,
            Err(e) => {
                p.add("policy.window", format!("policy '{name}': {e}"));
                Duration::from_millis(1)
            }
        };
        // One name for the fail policy everywhere: on_error, as in Lua and
        // the command line; fail_policy is read as the old spelling.
        let on_error = match (s.on_error, s.fail_policy) {
            (Some(_), Some(_)) => {
                p.add("policy.on_error", format!("policy '{name}': give on_error only (fail_policy is its old name)"));
                None
            }
            (Some(o), None) => Some(o),
            (None, Some(f)) => {
                deprecated.push(format!("policy '{name}': fail_policy is the old name of on_error (as in Lua and the command line); write on_error = \"{f}\""));
                Some(f)
            }
            (None, None) => None,
        };
        let fail_policy = on_error.as_deref().and_then(|f| match f.parse::<FailPolicy>() {
            Ok(f) => Some(f),
            Err(e) => {
                p.add("policy.on_error", format!("policy '{name}': {e}"));
                None
            }
        });
        let local_limit = s.local_limit.map(|l| policy_limit(p, "policy.local_limit", &name, "local_limit", i64::try_from(l).unwrap_or(i64::MAX), bounds));
        match (fail_policy, local_limit) {
            (Some(FailPolicy::Local), None) => p.add("policy.local_limit", format!("policy '{name}': on_error = \"local\" needs a local_limit")),
            (Some(FailPolicy::Open | FailPolicy::Closed), Some(_)) => p.add("policy.local_limit", format!("policy '{name}': local_limit is used only with on_error = \"local\"")),
            (None, Some(_)) if on_error.is_none() => p.add("policy.local_limit", format!("policy '{name}': local_limit needs on_error = \"local\"")),
            _ => {}
        }
        let mut overrides = std::collections::BTreeMap::new();
        for (key, v) in s.overrides {
            if !policy_key_ok(p, "policy.overrides", &name, &key, bounds) {
                continue;
            }
            let value = match v {
                file::OverrideValue::Limit(n) => PolicyLimit::Limit(policy_limit(p, "policy.overrides", &name, &format!("override of {key:?}"), n, bounds)),
                file::OverrideValue::Word(w) if w == "unlimited" => PolicyLimit::Unlimited,
                file::OverrideValue::Word(w) => {
                    p.add("policy.overrides", format!("policy '{name}': override of {key:?} is '{w}', not a limit or \"unlimited\""));
                    continue;
                }
            };
            overrides.insert(key, value);
        }
        for key in s.allowlist {
            if !policy_key_ok(p, "policy.allowlist", &name, &key, bounds) {
                continue;
            }
            if overrides.contains_key(&key) {
                p.add("policy.allowlist", format!("policy '{name}': key {key:?} is both allowlisted and overridden (or listed twice); keep one"));
                continue;
            }
            overrides.insert(key, PolicyLimit::Unlimited);
        }
        if concurrency && s.shards.is_some_and(|n| n != 1) {
            p.add("policy.shards", format!("policy '{name}': shards are not supported with algorithm = \"concurrency\" (one key's leases are one set)"));
        }
        let shards = if concurrency { 1 } else { policy_shards(p, &name, s.shards, limit, &overrides) };
        let penalty = s.penalty.as_ref().and_then(|pen| policy_penalty(p, &name, pen, concurrency, algorithm, shards, bounds));
        // Validated to fit limits.max_window_ms, a u32; a calendar window's
        // code (src/window.rs) when it has one.
        let window_ms = calendar_window_ms.unwrap_or_else(|| u32::try_from(window.as_millis()).unwrap_or(u32::MAX));
        let rule = PolicyRule { limit, window_ms, fail_policy, local_limit, shadow: s.shadow, algorithm, lease_ms, shards, penalty };
        out.push(PolicyConfig { name, rule, overrides });
    }
    out
}

/// `penalty = { after = N, within = "W", ban = "D" }`: N in
/// 1..=`MAX_PENALTY_AFTER`, W and D durations within `limits.max_window_ms`;
/// a rate policy of algorithm log, unsharded (the ban is decided in the
/// log's call, in the key's Cluster slot: a sharded key has no one slot).
fn policy_penalty(p: &mut Problems, name: &str, pen: &file::PenaltySection, concurrency: bool, algorithm: Algorithm, shards: u32, bounds: &Bounds) -> Option<Penalty> {
    let before = p.0.len();
    if concurrency {
        p.add("policy.penalty", format!("policy '{name}': penalty is not supported with algorithm = \"{CONCURRENCY}\" (a lease is released, not refused for good)"));
    } else if algorithm != Algorithm::Log {
        p.add("policy.penalty", format!("policy '{name}': penalty needs algorithm = \"log\" (it is decided in the log's script), not \"{}\"", algorithm.as_str()));
    }
    if shards > 1 {
        p.add("policy.penalty", format!("policy '{name}': penalty is not supported with shards = {shards} (a ban lives in the key's one Cluster slot)"));
    }
    if pen.after < 1 || pen.after > i64::from(MAX_PENALTY_AFTER) {
        p.add("policy.penalty", format!("policy '{name}': penalty.after {} is outside 1..={MAX_PENALTY_AFTER} (refusals within `within` that engage a ban)", pen.after));
    }
    let mut ms = |what: &str, text: &str| match parse_duration(text) {
        Ok(d) if !d.is_zero() && d.as_millis() <= u128::from(bounds.max_window_ms) => d.as_millis() as u32,
        Ok(_) => {
            p.add("policy.penalty", format!("policy '{name}': penalty.{what} {text} is outside 1ms..={}ms (limits.max_window_ms)", bounds.max_window_ms));
            0
        }
        Err(e) => {
            p.add("policy.penalty", format!("policy '{name}': penalty.{what}: {e}"));
            0
        }
    };
    let within_ms = ms("within", &pen.within);
    let ban_ms = ms("ban", &pen.ban);
    (p.0.len() == before).then_some(Penalty { after: pen.after as u32, within_ms, ban_ms })
}

/// A `fixed` policy's calendar window: `window = "month"` and/or a
/// `utc_offset` ("+02:00", within ±14:00), encoded as `window_ms`
/// (`crate::window::calendar_window_ms`); None for a plain window.
fn policy_calendar(p: &mut Problems, name: &str, window: &str, utc_offset: Option<&str>, algorithm: Algorithm) -> Option<u32> {
    let month = window == "month";
    if !month && utc_offset.is_none() {
        return None;
    }
    if algorithm != Algorithm::Fixed {
        let what = if month { "window = \"month\"" } else { "utc_offset" };
        p.add(if month { "policy.window" } else { "policy.utc_offset" }, format!("policy '{name}': {what} needs algorithm = \"fixed\""));
        return None;
    }
    let offset = match utc_offset.map(parse_utc_offset) {
        None => 0,
        Some(Ok(o)) => o,
        Some(Err(e)) => {
            p.add("policy.utc_offset", format!("policy '{name}': {e}"));
            return None;
        }
    };
    let minutes = if month {
        0
    } else {
        match parse_duration(window) {
            Ok(w) if !w.is_zero() && w.as_millis() % 60_000 == 0 && w.as_millis() <= 30 * 86_400_000 => (w.as_millis() / 60_000) as u32,
            Ok(_) => {
                p.add("policy.utc_offset", format!("policy '{name}': a utc_offset needs a window of whole minutes, up to 30 days, or \"month\" (not '{window}')"));
                return None;
            }
            Err(_) => return None, // reported as policy.window
        }
    };
    Some(crate::window::calendar_window_ms(minutes, offset))
}

/// "+HH:MM" or "-HH:MM" within ±14:00, in minutes east of UTC.
fn parse_utc_offset(s: &str) -> Result<i32, String> {
    let err = || format!("utc_offset '{s}' is not an offset such as \"+02:00\" or \"-05:30\" within ±14:00");
    let b = s.as_bytes();
    if b.len() != 6 || !matches!(b[0], b'+' | b'-') || b[3] != b':' || ![1, 2, 4, 5].iter().all(|&i| b[i].is_ascii_digit()) {
        return Err(err());
    }
    let (h, m) = (i32::from(b[1] - b'0') * 10 + i32::from(b[2] - b'0'), i32::from(b[4] - b'0') * 10 + i32::from(b[5] - b'0'));
    if m >= 60 || h * 60 + m > 14 * 60 {
        return Err(err());
    }
    Ok(if b[0] == b'-' { -(h * 60 + m) } else { h * 60 + m })
}

/// The `algorithm` of a concurrency policy: not a wire algorithm (a CHECK
/// cannot name it), the policy's kind.
const CONCURRENCY: &str = "concurrency";

/// A concurrency policy's `lease` (required, 1ms..=`limits.max_window_ms`;
/// a `window` is refused); any other policy's `lease` is refused.
fn policy_lease(p: &mut Problems, name: &str, concurrency: bool, lease: Option<&str>, window: &str, bounds: &Bounds) -> Option<u32> {
    if !concurrency {
        if lease.is_some() {
            p.add("policy.lease", format!("policy '{name}': lease is used only with algorithm = \"concurrency\""));
        }
        return None;
    }
    if !window.is_empty() {
        p.add("policy.window", format!("policy '{name}': algorithm = \"concurrency\" has a lease, not a window"));
    }
    let Some(lease) = lease else {
        p.add("policy.lease", format!("policy '{name}': algorithm = \"concurrency\" needs a lease (such as \"30s\"): how long a slot is held if never released"));
        return Some(1);
    };
    match parse_duration(lease) {
        Ok(l) if !l.is_zero() && l.as_millis() <= u128::from(bounds.max_window_ms) => Some(l.as_millis() as u32),
        Ok(_) => {
            p.add("policy.lease", format!("policy '{name}': lease {lease} is outside 1ms..={}ms (limits.max_window_ms)", bounds.max_window_ms));
            Some(1)
        }
        Err(e) => {
            p.add("policy.lease", format!("policy '{name}': {e}"));
            Some(1)
        }
    }
}

/// A policy's `algorithm`, the log when absent; an unknown name is an error.
fn policy_algorithm(p: &mut Problems, name: &str, algorithm: Option<&str>) -> Algorithm {
    match algorithm.map(str::parse::<Algorithm>) {
        None => Algorithm::Log,
        Some(Ok(a)) => a,
        Some(Err(e)) => {
            p.add("policy.algorithm", format!("policy '{name}': {e}, or {CONCURRENCY} for requests in flight"));
            Algorithm::Log
        }
    }
}

/// `shards`: 1..=`MAX_SHARDS`, and no more than the policy's limit or any
/// override's, so that every shard has a limit of at least 1.
fn policy_shards(p: &mut Problems, name: &str, shards: Option<i64>, limit: u32, overrides: &std::collections::BTreeMap<String, PolicyLimit>) -> u32 {
    let Some(s) = shards else { return 1 };
    if !(1..=i64::from(MAX_SHARDS)).contains(&s) {
        p.add("policy.shards", format!("policy '{name}': shards {s} is outside 1..={MAX_SHARDS}"));
        return 1;
    }
    let s = s as u32;
    if s > limit {
        p.add("policy.shards", format!("policy '{name}': shards {s} is above its limit {limit}: every shard needs a limit of at least 1"));
    }
    for (key, v) in overrides {
        if let PolicyLimit::Limit(l) = v {
            if s > *l {
                p.add("policy.shards", format!("policy '{name}': shards {s} is above the override {l} of {key:?}: every shard needs a limit of at least 1"));
            }
        }
    }
    s
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` refused, with an error that says `says`.
    #[track_caller]
    fn refused(text: &str, says: &str) {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
    }

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("test.toml"), text)
    }

    fn redis_of(c: Config) -> RedisConfig {
        c.redis.expect("a [redis] table")
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redacted_url("redis://u:secret@h:6379/0"), "redis://u:***@h:6379/0");
        assert_eq!(redacted_url("redis://:secret@h"), "redis://:***@h");
        assert_eq!(redacted_url("redis://h:6379"), "redis://h:6379");
    }

    #[test]
    fn the_config_dump_shows_every_value_but_never_the_url_password() {
        let c = parse("[redis]\nurl = \"redis://u:s3cret@h:6379/0\"\n[[policy]]\nname = \"order\"\nlimit = 7\nwindow = \"2s\"\n").unwrap();
        let dump = c.dump();
        assert!(!dump.contains("s3cret"), "{dump}");
        assert!(dump.contains("redis://u:***@h:6379/0") && dump.contains("name = \"order\"\nlimit = 7\nwindow = \"2s\"\n"), "{dump}");
        assert_eq!(dump, c.clone().dump(), "deterministic: the hash of equal configurations is equal");
    }

    #[test]
    fn empty_file_gives_defaults_and_the_local_backend() {
        let c = parse("").unwrap();
        assert_eq!(c, Config::default());
        assert!(c.redis.is_none());
        assert_eq!(c.server.socket_mode, 0o660);
        assert_eq!(c.server.idle_timeout, Duration::from_secs(300));
        assert_eq!(c.server.write_timeout, Duration::from_secs(2));
        assert_eq!(c.limits.bounds, Bounds::default());
        assert_eq!(c.denial_cache, DenialCacheConfig { enabled: true, slots: 16_384, max_age: Duration::from_secs(1) });
    }

    #[test]
    fn denial_cache_settings_are_checked() {
        let c = parse("[denial_cache]\nenabled = false\nslots = 64\nmax_ms = 250\n").unwrap();
        assert_eq!(c.denial_cache, DenialCacheConfig { enabled: false, slots: 64, max_age: Duration::from_millis(250) });
        let e = parse("[denial_cache]\nslots = 1000\nmax_ms = 0\n").unwrap_err().to_string();
        assert_eq!(
            e,
            "test.toml: denial_cache.slots: 1000 is not a power of two from 64 to 16777216\ntest.toml: denial_cache.max_ms: 0 is outside 1..=60000"
        );
        assert!(parse("[denial_cache]\nslots = 32\n").unwrap_err().to_string().contains("denial_cache.slots"));
        assert!(parse("[denial_cache]\nmax_ms = 60001\n").unwrap_err().to_string().contains("denial_cache.max_ms"));
        assert!(parse("[denial_cache]\nttl = 5\n").unwrap_err().to_string().contains("unknown field `ttl`"));
    }

    #[test]
    fn values_become_typed_once() {
        let c = parse("[server]\nsocket_mode = \"0o640\"\nframe_timeout_ms = 500\nwrite_timeout_ms = 750\n[redis]\ntimeout_ms = 35\n").unwrap();
        assert_eq!(c.server.socket_mode, 0o640);
        assert_eq!(c.server.frame_timeout, Duration::from_millis(500));
        assert_eq!(c.server.write_timeout, Duration::from_millis(750));
        let r = redis_of(c);
        assert_eq!(r.timeout, Duration::from_millis(35));
        assert_eq!((r.min_in_flight, r.max_in_flight), (16, 1024), "defaults");
        assert_eq!(r.target, RedisTarget::Url(DEFAULT_REDIS_URL.into()));
    }

    #[test]
    fn leases_and_cold_key_batches_are_on_by_default_where_the_topology_allows_and_each_can_be_turned_off() {
        let one = redis_of(parse("[redis]\n").unwrap());
        assert!(one.quota_leases && one.batch_cold_keys, "one Redis: both on");
        let sentinel = redis_of(parse("[redis.sentinel]\nmaster_name = \"m\"\naddresses = [\"h:1\"]\n").unwrap());
        assert!(sentinel.quota_leases && sentinel.batch_cold_keys, "Sentinel: both on");
        let cluster = redis_of(parse("[redis]\ncluster = [\"h:1\"]\n").unwrap());
        assert!(cluster.quota_leases && !cluster.batch_cold_keys, "a Cluster: leases on (a breaker per slot), batches off (a call's keys would span slots)");
        assert!(!redis_of(parse("[redis]\ncluster = [\"h:1\"]\nquota_leases = false\n").unwrap()).quota_leases, "said: off");
        let off = redis_of(parse("[redis]\nquota_leases = false\nbatch_cold_keys = false\n").unwrap());
        assert!(!off.quota_leases && !off.batch_cold_keys, "each switch turns it off");
        let cluster_off = redis_of(parse("[redis]\ncluster = [\"h:1\"]\nbatch_cold_keys = false\n").unwrap());
        assert!(!cluster_off.batch_cold_keys, "saying off on a Cluster is fine");
        // The dump (config show, GET /config) says what is in force.
        let shown = parse("[redis]\ncluster = [\"h:1\"]\n").unwrap().dump();
        assert!(shown.contains("batch_cold_keys = false\n") && shown.contains("quota_leases = true\n"), "{shown}");
    }

    #[test]
    fn secrets_are_named_not_read() {
        let r = redis_of(parse("[redis]\npassword_env = \"RATELIMITD_TEST_UNSET_VAR\"\n").unwrap());
        assert_eq!(r.password, Some(SecretSource::Env("RATELIMITD_TEST_UNSET_VAR".into())));
        refused("[redis]\npassword_file = \"/x\"\npassword_env = \"X\"\n", "redis.password_file: set password_file or password_env, not both");
    }

    #[test]
    fn sentinel_and_tls_settings_are_checked() {
        let ok = redis_of(parse("[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [\"127.0.0.1:26379\", \"[::1]:26380\"]\n").unwrap());
        let RedisTarget::Sentinel(s) = ok.target else { panic!("sentinel target") };
        assert_eq!(s.master_name, "mymaster");
        assert_eq!(s.addresses, [HostPort { host: "127.0.0.1".into(), port: 26379 }, HostPort { host: "::1".into(), port: 26380 }]);
        assert_eq!(s.addresses[1].to_string(), "[::1]:26380");
        refused("[redis]\nurl = \"redis://h\"\n[redis.sentinel]\nmaster_name = \"m\"\naddresses = [\"h:1\"]\n", "redis.url");
        refused("[redis.sentinel]\nmaster_name = \"m\"\naddresses = [\"h\"]\n", "redis.sentinel.addresses");
        refused("[redis]\ntls_ca_file = \"/etc/hostname\"\n", "needs a rediss:// url");
        refused("[redis]\nurl = \"rediss://h\"\ntls_cert_file = \"/c\"\n", "redis.tls_key_file: tls_cert_file and tls_key_file go together");
    }

    #[test]
    fn cluster_settings_are_checked() {
        let ok = redis_of(parse("[redis]\ncluster = [\"10.0.0.1:6379\", \"[::1]:7000\"]\npassword_env = \"X\"\n").unwrap());
        let RedisTarget::Cluster(c) = &ok.target else { panic!("cluster target") };
        assert_eq!(c.seeds, [HostPort { host: "10.0.0.1".into(), port: 6379 }, HostPort { host: "::1".into(), port: 7000 }]);
        assert!(!c.tls);
        assert_eq!(ok.describe(), "cluster 10.0.0.1:6379,[::1]:7000");
        let tls = redis_of(parse("[redis]\ncluster = [\"h:1\"]\ncluster_tls = true\ntls_ca_file = \"/etc/hostname\"\n").unwrap());
        assert!(matches!(&tls.target, RedisTarget::Cluster(c) if c.tls));
        refused("[redis]\ncluster = [\"h:1\"]\nbatch_cold_keys = true\n", "redis.batch_cold_keys: not with redis.cluster");
        refused("[redis]\ncluster = []\n", "redis.cluster: needs at least one");
        let e = parse("[redis]\ncluster = [\"h\", \"h:0\", \"h:70000\"]\n").unwrap_err().to_string();
        assert_eq!(e.matches("is not \"host:port\"").count(), 3, "{e}");
        refused("[redis]\nurl = \"redis://h\"\ncluster = [\"h:1\"]\n", "redis.url: leave it unset with redis.cluster");
        refused("[redis]\ncluster = [\"h:1\"]\n[redis.sentinel]\nmaster_name = \"m\"\naddresses = [\"h:1\"]\n", "redis.cluster: set [redis.sentinel] or redis.cluster, not both");
        refused("[redis]\ncluster_tls = true\n", "redis.cluster_tls: applies to redis.cluster only");
        refused("[redis]\ncluster = [\"h:1\"]\ntls_ca_file = \"/etc/hostname\"\n", "redis.tls_ca_file: needs a rediss:// url, or cluster_tls = true");
    }

    #[test]
    fn the_admin_api_listens_on_a_socket_or_on_tcp_only_with_a_token() {
        let c = parse("[admin]\nlisten = \"/run/ratelimitd/admin.sock\"\n").unwrap();
        assert_eq!(c.admin.listen, Some(AdminListen::Unix { path: "/run/ratelimitd/admin.sock".into(), mode: 0o600 }));
        assert_eq!(c.admin.overrides_refresh, Duration::from_secs(1));
        assert!(parse("[admin]\nlisten = \"127.0.0.1:9465\"\ntoken_file = \"/etc/t\"\n").is_ok());
        let e = parse("[admin]\nlisten = \"127.0.0.1:9465\"\n").unwrap_err().to_string();
        assert!(e.contains("admin.listen") && e.contains("token_file"), "{e}");
        let e = parse("[admin]\nlisten = \"admin.sock\"\noverrides_refresh = \"1ms\"\n").unwrap_err().to_string();
        assert!(e.contains("absolute socket path") && e.contains("admin.overrides_refresh"), "{e}");
    }

    #[test]
    fn the_admin_listener_has_a_connection_cap_and_a_read_timeout_within_bounds() {
        let c = parse("[admin]\nlisten = \"/run/a.sock\"\n").unwrap();
        assert_eq!((c.admin.max_connections, c.admin.read_timeout), (64, Duration::from_secs(10)));
        let c = parse("[admin]\nmax_connections = 8\nread_timeout = \"500ms\"\n").unwrap();
        assert_eq!((c.admin.max_connections, c.admin.read_timeout), (8, Duration::from_millis(500)));
        for (bad, field) in [("max_connections = 0", "admin.max_connections"), ("max_connections = 4097", "admin.max_connections"), ("read_timeout = \"50ms\"", "admin.read_timeout"), ("read_timeout = \"6m\"", "admin.read_timeout"), ("read_timeout = \"soon\"", "admin.read_timeout")] {
            let e = parse(&format!("[admin]\n{bad}\n")).unwrap_err().to_string();
            assert!(e.contains(&format!("{field}: ")), "{bad}: {e}");
        }
    }

    #[test]
    fn tls_is_for_a_tcp_listener_with_both_files_and_still_a_token() {
        let c = parse("[admin]\nlisten = \"0.0.0.0:9465\"\ntoken_file = \"/etc/t\"\ntls_cert_file = \"/etc/c.pem\"\ntls_key_file = \"/etc/k.pem\"\n").unwrap();
        assert_eq!(c.admin.tls, Some(AdminTls { cert_file: "/etc/c.pem".into(), key_file: "/etc/k.pem".into(), ca_file: None }));
        for (bad, field, says) in [
            ("listen = \"0.0.0.0:9465\"\ntls_cert_file = \"/c\"\ntls_key_file = \"/k\"", "admin.listen", "a bearer token is required on TCP, with or without TLS"),
            ("listen = \"/run/a.sock\"\ntls_cert_file = \"/c\"\ntls_key_file = \"/k\"", "admin.tls_cert_file", "TLS is for a TCP listener"),
            ("listen = \"127.0.0.1:9465\"\ntoken_file = \"/t\"\ntls_cert_file = \"/c\"", "admin.tls_cert_file", "give both"),
            ("listen = \"127.0.0.1:9465\"\ntoken_file = \"/t\"\ntls_ca_file = \"/ca\"", "admin.tls_ca_file", "set admin.tls_cert_file and tls_key_file too"),
        ] {
            let e = parse(&format!("[admin]\n{bad}\n")).unwrap_err().to_string();
            assert!(e.contains(&format!("{field}: ")) && e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn metrics_only_on_loopback() {
        assert!(parse("[metrics]\nlisten = \"127.0.0.1:9464\"\n").is_ok());
        assert!(parse("[metrics]\nlisten = \"[::1]:9464\"\n").is_ok());
        refused("[metrics]\nlisten = \"0.0.0.0:9464\"\n", "metrics.listen");
    }

    #[test]
    fn example_config_is_valid() {
        let c = parse(include_str!("../../ratelimitd.example.toml")).unwrap();
        assert_eq!(redis_of(c).timeout, Duration::from_millis(20));
    }

    #[test]
    fn durations_have_units_and_the_old_ms_fields_are_read_with_a_deprecation_line() {
        let c = parse("[server]\nidle_timeout = \"5m\"\nframe_timeout = \"500ms\"\nwrite_timeout = \"1s\"\nshutdown_grace = \"3s\"\n[redis]\nurl = \"redis://127.0.0.1\"\ntimeout = \"35ms\"\nconnect_timeout = \"1s\"\n[denial_cache]\nmax_age = \"250ms\"\n").unwrap();
        assert_eq!((c.server.idle_timeout, c.server.frame_timeout, c.server.write_timeout, c.server.shutdown_grace), (Duration::from_secs(300), Duration::from_millis(500), Duration::from_secs(1), Duration::from_secs(3)));
        assert_eq!(c.denial_cache.max_age, Duration::from_millis(250));
        assert!(c.deprecated.is_empty(), "{:?}", c.deprecated);
        let r = redis_of(c);
        assert_eq!((r.timeout, r.connect_timeout), (Duration::from_millis(35), Duration::from_secs(1)));

        let c = parse("[server]\nidle_timeout_ms = 300000\n[redis]\nurl = \"redis://127.0.0.1\"\ntimeout_ms = 20\n").unwrap();
        assert_eq!(c.server.idle_timeout, Duration::from_secs(300));
        assert_eq!(
            c.deprecated,
            [
                "server.idle_timeout_ms is the old spelling of server.idle_timeout, a duration with its unit: write idle_timeout = \"5m\"",
                "redis.timeout_ms is the old spelling of redis.timeout, a duration with its unit: write timeout = \"20ms\"",
            ]
        );

        let e = parse("[redis]\nurl = \"redis://127.0.0.1\"\ntimeout = \"20ms\"\ntimeout_ms = 20\nconnect_timeout = 250\n[server]\nframe_timeout = \"0ms\"\n").unwrap_err().to_string();
        assert!(e.contains("redis.timeout: give redis.timeout only (redis.timeout_ms is its old spelling)"), "{e}");
        assert!(e.contains("redis.connect_timeout: 250 has no unit: write \"250ms\""), "{e}");
        assert!(e.contains("server.frame_timeout: must be at least 1"), "{e}");
        assert_eq!(duration_text_of(1500), "1500ms");
        assert_eq!(duration_text_of(86_400_000), "1d");
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = parse("[redis]\nurl = \"redis://127.0.0.1\"\ntimout = \"5ms\"\n").unwrap_err().to_string();
        assert!(e.starts_with("test.toml: line 3:"), "{e}");
        assert!(e.contains("unknown field `timout`"), "{e}");
        refused("[sever]\n", "unknown field `sever`");
    }

    #[test]
    fn invalid_values_name_the_field() {
        let e = parse("[server]\nsocket_mode = \"0999\"\n").unwrap_err().to_string();
        assert_eq!(e, "test.toml: server.socket_mode: '0999' is not an octal mode such as \"0660\"");
        refused("[redis]\ntimeout_ms = 0\n", "redis.timeout_ms");
        let e = parse("[server]\nwrite_timeout_ms = 0\n").unwrap_err().to_string();
        assert_eq!(e, "test.toml: server.write_timeout_ms: must be at least 1");
        refused("[redis]\nkey_prefix = \"a{b}\"\n", "redis.key_prefix");
        refused("[redis]\nurl = \"http://x\"\n", "redis.url");
        refused("[log]\nlevel = \"infoo\"\n", "log.level");
        assert!(parse("[log]\nlevel = \"warn,ratelimitd=debug\"\n").is_ok());
        let e = parse("[redis]\nurl = \"http://u:secret@x\"\n").unwrap_err().to_string();
        assert!(!e.contains("secret"), "{e}");
        refused("[redis]\nclock = \"ntp\"\n", "line 2");
    }

    #[test]
    fn in_flight_bounds_are_checked_each_and_together() {
        let c = parse("[redis]\nmin_in_flight = 4\nmax_in_flight = 64\n").unwrap();
        let r = redis_of(c);
        assert_eq!((r.min_in_flight, r.max_in_flight), (4, 64));
        let e = parse("[redis]\nmin_in_flight = 0\nmax_in_flight = 200000\n").unwrap_err().to_string();
        assert!(e.contains("redis.min_in_flight: 0 is outside 1..=100000"), "{e}");
        assert!(e.contains("redis.max_in_flight: 200000 is outside 1..=100000"), "{e}");
        let e = parse("[redis]\nmin_in_flight = 64\nmax_in_flight = 8\n").unwrap_err().to_string();
        assert_eq!(e, "test.toml: redis.max_in_flight: 8 is below redis.min_in_flight (64)");
    }

    #[test]
    fn the_spin_before_parking_is_off_unless_set_and_bounded() {
        assert_eq!(parse("").unwrap().server.spin, Duration::ZERO);
        assert_eq!(parse("[server]\nspin_us = 300\n").unwrap().server.spin, Duration::from_micros(300));
        let e = parse("[server]\nspin_us = 10001\n").unwrap_err().to_string();
        assert_eq!(e, "test.toml: server.spin_us: 10001 is outside 0..=10000");
    }

    #[test]
    fn every_bad_field_is_reported_at_once() {
        let e = parse("[server]\nsocket_mode = \"x\"\nmax_connections = 0\nworker_threads = 0\n[redis]\ntimeout_ms = 0\nbreaker_failures = 0\n[limits]\nmax_cost = 0\n[log]\nlevel = \"loud\"\n")
            .unwrap_err();
        let ConfigError::Invalid { errors, .. } = &e else { panic!("{e}") };
        let fields: Vec<_> = errors.iter().map(|e| e.field).collect();
        assert_eq!(fields, ["server.socket_mode", "server.max_connections", "server.worker_threads", "redis.breaker_failures", "redis.timeout_ms", "limits.max_cost", "log.level"]);
        assert_eq!(e.to_string().lines().count(), 7);
        assert!(e.to_string().lines().all(|l| l.starts_with("test.toml: ")));
    }

    #[test]
    fn policies_become_typed_once() {
        let c = parse(
            "[[policy]]\nname = \"order\"\nlimit = 1000\nwindow = \"1s\"\nallowlist = [\"internal\"]\n[policy.overrides]\n\"tenant-big\" = 5000\n\"tenant-free\" = \"unlimited\"\n\
             [[policy]]\nname = \"login.ip\"\nlimit = 5\nwindow = \"10m\"\nfail_policy = \"local\"\nlocal_limit = 2\nshadow = true\n",
        )
        .unwrap();
        assert_eq!(c.policies.len(), 2);
        let order = &c.policies[0];
        assert_eq!((order.name.as_str(), order.rule.limit, order.rule.window_ms, order.rule.fail_policy, order.rule.shadow), ("order", 1000, 1000, None, false));
        assert_eq!(order.overrides.get("tenant-big"), Some(&PolicyLimit::Limit(5000)));
        assert_eq!(order.overrides.get("tenant-free"), Some(&PolicyLimit::Unlimited));
        assert_eq!(order.overrides.get("internal"), Some(&PolicyLimit::Unlimited));
        let login = &c.policies[1];
        assert_eq!((login.rule.window_ms, login.rule.fail_policy, login.rule.local_limit, login.rule.shadow), (600_000, Some(FailPolicy::Local), Some(2), true));
        assert_eq!((order.rule.algorithm, login.rule.algorithm), (Algorithm::Log, Algorithm::Log), "the log by default");
    }

    #[test]
    fn calendar_windows_need_fixed_and_a_valid_offset() {
        let policy = |window: &str, extra: &str| parse(&format!("[[policy]]\nname = \"a\"\nlimit = 10\nwindow = \"{window}\"\n{extra}"));
        let c = policy("month", "algorithm = \"fixed\"\n").unwrap();
        assert_eq!(c.policies[0].rule.window_ms, crate::window::calendar_window_ms(0, 0));
        let c = policy("1d", "algorithm = \"fixed\"\nutc_offset = \"-05:30\"\n").unwrap();
        assert_eq!(c.policies[0].rule.window_ms, crate::window::calendar_window_ms(1440, -330));
        assert_eq!(policy("1d", "algorithm = \"fixed\"\nutc_offset = \"+00:00\"\n").unwrap().policies[0].rule.window_ms, 86_400_000);
        assert_eq!(policy("1h", "algorithm = \"fixed\"\n").unwrap().policies[0].rule.calendar_window_ms(), None);
        for (window, extra, field, text) in [
            ("month", "", "policy.window", "window = \"month\" needs algorithm = \"fixed\""),
            ("1d", "algorithm = \"gcra\"\nutc_offset = \"+02:00\"\n", "policy.utc_offset", "utc_offset needs algorithm"),
            ("1d", "algorithm = \"fixed\"\nutc_offset = \"+15:00\"\n", "policy.utc_offset", "within ±14:00"),
            ("1d", "algorithm = \"fixed\"\nutc_offset = \"2:00\"\n", "policy.utc_offset", "not an offset"),
            ("1d", "algorithm = \"fixed\"\nutc_offset = \"+02:60\"\n", "policy.utc_offset", "not an offset"),
            ("90s", "algorithm = \"fixed\"\nutc_offset = \"+02:00\"\n", "policy.utc_offset", "whole minutes"),
        ] {
            let e = policy(window, extra).unwrap_err();
            let ConfigError::Invalid { errors, .. } = &e else { panic!("{e}") };
            assert_eq!(errors.iter().map(|e| e.field).collect::<Vec<_>>(), [field], "{window} {extra}");
            assert!(e.to_string().contains(text), "{e}");
        }
    }

    #[test]
    fn a_policy_names_its_algorithm() {
        let c = parse("[[policy]]\nname = \"a\"\nlimit = 10\nwindow = \"1s\"\nalgorithm = \"ring\"\n").unwrap();
        assert_eq!(c.policies[0].rule.algorithm, Algorithm::Ring);
        let e = parse("[[policy]]\nname = \"a\"\nlimit = 10\nwindow = \"1s\"\nalgorithm = \"leaky\"\n").unwrap_err();
        let ConfigError::Invalid { errors, .. } = &e else { panic!("{e}") };
        assert_eq!(errors.iter().map(|e| e.field).collect::<Vec<_>>(), ["policy.algorithm"]);
        assert!(e.to_string().contains("policy 'a': unknown algorithm 'leaky' (expected one of: log, ring, gcra, sliding_counter, fixed"), "{e}");
    }

    #[test]
    fn a_concurrency_policy_has_a_lease_and_no_window_or_shards() {
        let c = parse("[[policy]]\nname = \"up\"\nalgorithm = \"concurrency\"\nlimit = 10\nlease = \"30s\"\n[policy.overrides]\nbig = 20\n").unwrap();
        let up = &c.policies[0];
        assert_eq!((up.rule.lease_ms, up.rule.limit, up.rule.shards, up.overrides.get("big")), (Some(30_000), 10, 1, Some(&PolicyLimit::Limit(20))));
        assert_eq!(parse("[[policy]]\nname = \"r\"\nlimit = 10\nwindow = \"1s\"\n").unwrap().policies[0].rule.lease_ms, None, "a rate policy");
        let cases = [
            ("algorithm = \"concurrency\"\n", "policy.lease", "needs a lease"),
            ("algorithm = \"concurrency\"\nlease = \"0s\"\n", "policy.lease", "outside 1ms"),
            ("algorithm = \"concurrency\"\nlease = \"soon\"\n", "policy.lease", "soon"),
            ("algorithm = \"concurrency\"\nlease = \"30s\"\nwindow = \"1s\"\n", "policy.window", "a lease, not a window"),
            ("algorithm = \"concurrency\"\nlease = \"30s\"\nshards = 4\n", "policy.shards", "shards are not supported"),
            ("window = \"1s\"\nlease = \"30s\"\n", "policy.lease", "only with algorithm = \"concurrency\""),
            ("window = \"1s\"\nalgorithm = \"concurrent\"\n", "policy.algorithm", "or concurrency for requests in flight"),
        ];
        for (extra, field, text) in cases {
            let e = parse(&format!("[[policy]]\nname = \"up\"\nlimit = 10\n{extra}")).unwrap_err();
            let ConfigError::Invalid { errors, .. } = &e else { panic!("{e}") };
            assert_eq!(errors.iter().map(|e| e.field).collect::<Vec<_>>(), [field], "{extra}: {e}");
            assert!(e.to_string().contains(text), "{extra}: {e}");
        }
    }

    #[test]
    fn a_penalty_box_is_n_refusals_within_w_ban_d_on_an_unsharded_log_policy() {
        let policy = |extra: &str| format!("[[policy]]\nname = \"login\"\nlimit = 5\nwindow = \"1m\"\n{extra}\n");
        assert_eq!(parse(&policy("")).unwrap().policies[0].rule.penalty, None, "no penalty by default");
        let p = parse(&policy("penalty = { after = 3, within = \"10m\", ban = \"1h\" }")).unwrap().policies[0].rule.penalty;
        assert_eq!(p, Some(Penalty { after: 3, within_ms: 600_000, ban_ms: 3_600_000 }));
        for (bad, says) in [
            ("penalty = { after = 0, within = \"1m\", ban = \"1m\" }", "penalty.after 0 is outside 1..=10000"),
            ("penalty = { after = 10001, within = \"1m\", ban = \"1m\" }", "penalty.after 10001 is outside 1..=10000"),
            ("penalty = { after = 3, within = \"0s\", ban = \"1m\" }", "penalty.within 0s is outside 1ms..="),
            ("penalty = { after = 3, within = \"1m\", ban = \"soon\" }", "penalty.ban: 'soon' is not a duration"),
            ("penalty = { after = 3, within = \"1m\", ban = \"400d\" }", "penalty.ban 400d is outside 1ms..="),
            ("penalty = { after = 3, within = \"1m\", ban = \"1m\" }\nalgorithm = \"gcra\"", "penalty needs algorithm = \"log\""),
            ("penalty = { after = 3, within = \"1m\", ban = \"1m\" }\nshards = 2", "penalty is not supported with shards = 2"),
        ] {
            refused(&policy(bad), &format!("policy.penalty: policy 'login': {says}"));
        }
        refused("[[policy]]\nname = \"c\"\nlimit = 5\nalgorithm = \"concurrency\"\nlease = \"30s\"\npenalty = { after = 3, within = \"1m\", ban = \"1m\" }\n", "penalty is not supported with algorithm = \"concurrency\"");
        // An unknown field is named, and a missing one.
        refused(&policy("penalty = { after = 3, within = \"1m\", ban = \"1m\", forever = true }"), "forever");
        refused(&policy("penalty = { after = 3, ban = \"1m\" }"), "within");
    }

    #[test]
    fn shards_are_1_to_64_and_at_most_every_limit() {
        let policy = |extra: &str| format!("[[policy]]\nname = \"hot\"\nlimit = 100\nwindow = \"1s\"\n{extra}\n");
        assert_eq!(parse(&policy("")).unwrap().policies[0].rule.shards, 1, "default: one window");
        assert_eq!(parse(&policy("shards = 64")).unwrap().policies[0].rule.shards, 64);
        for (bad, says) in [
            ("shards = 0", "shards 0 is outside 1..=64"),
            ("shards = 65", "shards 65 is outside 1..=64"),
            ("shards = -1", "shards -1 is outside 1..=64"),
            ("shards = 8\n[policy.overrides]\nsmall = 5", "shards 8 is above the override 5 of \"small\""),
        ] {
            refused(&policy(bad), &format!("policy.shards: policy 'hot': {says}"));
        }
        refused("[[policy]]\nname = \"tiny\"\nlimit = 3\nwindow = \"1s\"\nshards = 4\n", "shards 4 is above its limit 3");
        // "unlimited" overrides take no shards.
        assert!(parse(&policy("shards = 8\n[policy.overrides]\nfree = \"unlimited\"")).is_ok());
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
        for bad in ["", "1", "s", "1.5s", "-1s", "1 s", "1S", "99999999999999999999ms"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_bad_policy_field_is_reported_at_once() {
        let e = parse(
            "[[policy]]\nname = \"bad name\"\nlimit = 0\nwindow = \"1x\"\n\
             [[policy]]\nname = \"a\"\nlimit = 1\nwindow = \"3d\"\nfail_policy = \"local\"\n\
             [[policy]]\nname = \"a\"\nlimit = 1\nwindow = \"1s\"\nfail_policy = \"maybe\"\nallowlist = [\"k\", \"\"]\n[policy.overrides]\nk = 5\nj = \"lots\"\n",
        )
        .unwrap_err();
        let ConfigError::Invalid { errors, .. } = &e else { panic!("{e}") };
        let fields: Vec<_> = errors.iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            ["policy.name", "policy.limit", "policy.window", "policy.window", "policy.local_limit", "policy.name", "policy.on_error", "policy.overrides", "policy.allowlist", "policy.allowlist"],
            "{e}"
        );
        let text = e.to_string();
        assert!(text.contains("policy 'a': 3d is outside 1ms..=86400000ms"), "{text}");
        assert!(text.contains("'a' is already the name of an earlier policy"), "{text}");
        assert!(text.contains("override of \"j\" is 'lots'"), "{text}");
        assert!(parse("[[policy]]\nname = \"a\"\nlimit = 1\nwindow = \"1s\"\nburst = 2\n").unwrap_err().to_string().contains("unknown field `burst`"));
        assert!(parse("[[policy]]\nname = \"a\"\nlimit = 1\n").unwrap_err().to_string().contains("policy 'a': missing field `window` (such as \"1s\"), or algorithm = \"concurrency\" with a lease"));
        refused("[[policy]]\nname = \"a\"\nlimit = 1\nwindow = \"1s\"\nlocal_limit = 3\n", "local_limit needs on_error");
    }

    #[test]
    fn overrides_replace_the_file_and_are_named_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[server]\nsocket_mode = \"0600\"\n").unwrap();
        let o = Overrides { listen: Some("/tmp/x.sock".into()), redis_url: Some("redis://127.0.0.1:7000/0".into()) };
        let c = Config::load_with(Some(&path), &o).unwrap();
        assert_eq!(c.server.listen, Path::new("/tmp/x.sock"));
        assert_eq!(redis_of(c).target, RedisTarget::Url("redis://127.0.0.1:7000/0".into()));
        let bad = Overrides { redis_url: Some("http://x".into()), ..Overrides::default() };
        let e = Config::load_with(Some(&path), &bad).unwrap_err().to_string();
        assert!(e.contains("(with command-line overrides): redis.url"), "{e}");
    }
}
