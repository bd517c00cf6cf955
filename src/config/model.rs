//! The configuration as the daemon uses it: typed values (durations,
//! permission bits, host:port pairs, where each secret is kept), and the
//! errors that name the file and the field.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::protocol::{Algorithm, Bounds, FailPolicy, MAX_POLICY_NAME_LEN};

/// Where a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    /// The file does not fit its schema: every error found, in file order
    /// (a syntax error alone: what follows it cannot be read).
    #[error("{}", FileErrors { path, errors })]
    Parse { path: PathBuf, errors: Vec<ParseError> },
    /// Every field that parsed but cannot work, in file order.
    #[error("{}", FileErrors { path, errors })]
    Invalid { path: PathBuf, errors: Vec<FieldError> },
}

/// One bad field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// One error of a file that did not parse: its line (1-based; 0 when not
/// known) and what is wrong, naming the field (`config::file::parse`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// A file's errors, a line each, each led by the file's path.
struct FileErrors<'a, E> {
    path: &'a Path,
    errors: &'a [E],
}

impl<E: fmt::Display> fmt::Display for FileErrors<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{}: {e}", self.path.display())?;
        }
        Ok(())
    }
}

/// Collects field errors during one validation pass.
#[derive(Default)]
pub(super) struct Problems(pub(super) Vec<FieldError>);

impl Problems {
    pub(super) fn add(&mut self, field: &'static str, message: impl Into<String>) {
        self.0.push(FieldError { field, message: message.into() });
    }

    pub(super) fn into_result<T>(self, path: &Path, value: T) -> Result<T, ConfigError> {
        if self.0.is_empty() {
            Ok(value)
        } else {
            Err(ConfigError::Invalid { path: path.into(), errors: self.0 })
        }
    }
}

/// The whole configuration, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The Unix socket and connection handling.
    pub server: ServerConfig,
    /// The shared store. Absent: the per-host store only, limits per host.
    pub redis: Option<RedisConfig>,
    /// Bounds every request must respect, and the per-host store's size.
    pub limits: LimitsConfig,
    pub log: LogConfig,
    /// The Prometheus endpoint. Absent: no metrics served.
    pub metrics: Option<MetricsConfig>,
    /// Refusals remembered between Redis calls (Redis backend only).
    pub denial_cache: DenialCacheConfig,
    /// The admin API (`[admin]`); its overrides are refreshed without it too.
    pub admin: AdminConfig,
    /// `[[policy]]`: named limits that CHECK_POLICY requests refer to, in
    /// file order; names are unique.
    pub policies: Vec<PolicyConfig>,
    /// `[envoy]`: the Envoy rate limit service (docs/ENVOY.md); its YAML
    /// files' limits are in `policies` too.
    pub envoy: Option<EnvoyConfig>,
    /// Old spellings the file used, one line each, for the log and
    /// `check-config` (accepted, to be rewritten).
    pub deprecated: Vec<String>,
    /// The durations as the file wrote them, by field path
    /// (`policy.login.window` = "60s"): what `GET /config` shows for a
    /// duration that still has that value.
    pub written_durations: BTreeMap<String, String>,
}

/// One `[[policy]]` (docs/POLICIES.md): its name, the rule it decides
/// with, its keys' overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyConfig {
    /// `[A-Za-z0-9_.-]`, 1..=31 bytes, unique in the file.
    pub name: String,
    pub rule: PolicyRule,
    /// Exact keys with another limit, or none; the allowlist's keys are
    /// here as `Unlimited`.
    pub overrides: BTreeMap<String, PolicyLimit>,
}

/// What a policy decides with: typed once, from its table
/// (config/validate.rs, every bad field reported), and carried as it is
/// to the decision: `policies::Policy` holds this record, the request path
/// reads it there. No layer below declares these fields again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyRule {
    pub limit: u32,
    /// The window in whole milliseconds, 1..=`limits.max_window_ms`; a
    /// `fixed` policy's calendar window (`window = "month"` or a
    /// `utc_offset`) as its code, `crate::window::CALENDAR` or above; a
    /// concurrency policy's lease.
    pub window_ms: u32,
    /// Replaces the location's fail policy for this policy's checks.
    pub fail_policy: Option<FailPolicy>,
    /// The local quota of `fail_policy = "local"` (required with it).
    pub local_limit: Option<u32>,
    /// Decide and count, but admit every request.
    pub shadow: bool,
    /// How the policy's windows count (docs/ALGORITHMS.md); the log by default.
    /// Unused by a concurrency policy.
    pub algorithm: Algorithm,
    /// `Some`: a concurrency policy (`algorithm = "concurrency"`, ops 7),
    /// `limit` requests in flight at most, each slot held for at most this
    /// lease if never released (1..=`limits.max_window_ms`). `None`: a rate
    /// policy (CHECK_POLICY).
    pub lease_ms: Option<u32>,
    /// Hot-key shards (docs/SCALING.md): each key's quota split over this
    /// many windows in different Cluster slots; 1..=`MAX_SHARDS` and at
    /// most the policy's limit and every override's. 1: one window.
    pub shards: u32,
    /// The penalty box (docs/POLICIES.md): a key refused `after` times
    /// within `within_ms` is banned for `ban_ms`. Log, unsharded, rate
    /// policies only.
    pub penalty: Option<Penalty>,
}

impl PolicyRule {
    /// A rate policy of the log, unsharded, with no fail policy of its own,
    /// no shadow and no penalty: the tests' starting point.
    #[cfg(test)]
    pub(crate) fn rate(limit: u32, window_ms: u32) -> Self {
        Self { limit, window_ms, fail_policy: None, local_limit: None, shadow: false, algorithm: Algorithm::Log, lease_ms: None, shards: 1, penalty: None }
    }

    /// The calendar window's code (`window = "month"` or a `utc_offset`),
    /// if the window is one.
    pub fn calendar_window_ms(&self) -> Option<u32> {
        (self.lease_ms.is_none() && self.window_ms >= crate::window::CALENDAR).then_some(self.window_ms)
    }
}

/// A policy's penalty box: `after` refusals of one key within `within_ms`
/// ban the key for `ban_ms` (every request refused, fleet-wide).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Penalty {
    /// Refusals that engage a ban: 1..=`MAX_PENALTY_AFTER`.
    pub after: u32,
    /// The window the refusals are counted in, ms.
    pub within_ms: u32,
    /// How long a ban lasts, ms.
    pub ban_ms: u32,
}

/// Most refusals a penalty may wait for (each is a member of the key's
/// strike set in Redis).
pub const MAX_PENALTY_AFTER: u32 = 10_000;

/// Most shards a `[[policy]]` may split a key over: each is a Redis call
/// when the shards before it refuse.
pub const MAX_SHARDS: u32 = 64;

/// The limit an override gives a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyLimit {
    Limit(u32),
    /// Admitted without asking a store (source `exempt`).
    Unlimited,
}

/// `[denial_cache]`: after Redis refuses a key, its later requests of at
/// least that cost are refused in the daemon until Redis could admit them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenialCacheConfig {
    pub enabled: bool,
    /// Entries in the table (a power of two); one key per slot.
    pub slots: usize,
    /// Longest an entry refuses without asking Redis again: how late a
    /// `reset`, or a failover to a master with another clock, is seen.
    pub max_age: Duration,
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Path of the Unix socket Nginx workers connect to.
    pub listen: PathBuf,
    /// Permission bits of the socket file.
    pub socket_mode: u32,
    /// Group that owns the socket file; unset keeps the daemon's group.
    /// Looked up by `preflight`.
    pub socket_group: Option<String>,
    /// Most client connections served at once. At the cap, the connection
    /// idle the longest (at least 1 s) is closed for a new one; if none is,
    /// new ones wait in the accept queue.
    pub max_connections: usize,
    /// Most requests one connection may have in flight (pipelined) at once.
    pub max_in_flight_per_connection: usize,
    /// On shutdown, how long in-flight requests may take to finish.
    pub shutdown_grace: Duration,
    /// Close a connection with nothing in flight after this long.
    pub idle_timeout: Duration,
    /// Close a connection whose frame is not complete this long after its
    /// first byte arrived (slow or stuck clients).
    pub frame_timeout: Duration,
    /// Close a connection with responses waiting to be sent when none of
    /// them could be written for this long (a client that does not read).
    pub write_timeout: Duration,
    /// Threads of the daemon's runtime (restart to change).
    pub worker_threads: usize,
    /// How long the runtime's worker keeps polling after the last frame
    /// before it parks (restart to change; zero: never).
    pub spin: Duration,
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

/// `[redis]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// Where the master is.
    pub target: RedisTarget,
    /// ACL user; overrides the URL's.
    pub username: Option<String>,
    /// Where the password is; overrides the URL's. Read by `preflight`.
    pub password: Option<SecretSource>,
    /// PEM files for `rediss://`. Read by `preflight`.
    pub tls: TlsFiles,
    /// Deadline of one decision in Redis; past it the fail policy decides.
    pub timeout: Duration,
    /// Deadline of establishing a connection.
    pub connect_timeout: Duration,
    /// Consecutive timeouts that open the circuit breaker (only timeouts
    /// with no reply from Redis meanwhile count).
    pub breaker_failures: u32,
    /// Floor of the adaptive limit on Redis calls in flight.
    pub min_in_flight: u32,
    /// Ceiling of the adaptive limit on Redis calls in flight; calls over
    /// the limit get `OVERLOADED` at once.
    pub max_in_flight: u32,
    /// Prepended to every key; keys cannot reach outside it.
    pub key_prefix: String,
    /// Which clock timestamps admissions.
    pub clock: ClockSource,
    /// Hot keys are admitted from quota leases (docs/PERFORMANCE.md); as in
    /// force: unset in the file, on unless the target is a Cluster
    /// (docs/CONFIG.md says what it costs).
    pub quota_leases: bool,
    /// Checks of different log keys queued while every cold lane is busy
    /// go to Redis in one call (one Redis or Sentinel; not a Cluster). As
    /// in force: unset in the file, on unless the target is a Cluster.
    pub batch_cold_keys: bool,
}

/// The default Redis URL.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379/0";

/// How to reach the master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis://`, `rediss://` or `redis+unix://`, checked to parse.
    Url(String),
    /// Ask Redis Sentinel for the master.
    Sentinel(SentinelConfig),
    /// A Redis Cluster, found from these seed nodes.
    Cluster(ClusterConfig),
}

/// `[redis] cluster = [...]`: a Redis Cluster. The seeds are only where the
/// topology is first read (`CLUSTER SLOTS`); the link then follows the
/// cluster's own view (MOVED/ASK, failovers), so any few nodes will do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    pub seeds: Vec<HostPort>,
    /// `redis.cluster_tls`: TLS to every node (a cluster has no URL scheme
    /// to say so).
    pub tls: bool,
}

/// `[redis.sentinel]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelConfig {
    /// The master's name in the sentinels' configuration.
    pub master_name: String,
    pub addresses: Vec<HostPort>,
    /// ACL user for the sentinels (not the master).
    pub username: Option<String>,
    /// The sentinels' password. Read by `preflight`.
    pub password: Option<SecretSource>,
}

/// A `host:port` pair; IPv6 hosts are written in brackets and kept without.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl HostPort {
    pub(super) fn parse(s: &str) -> Option<Self> {
        let (host, port) = s.rsplit_once(':')?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() || host.contains(['[', ']']) {
            return None;
        }
        Some(Self { host: host.to_string(), port: port.parse().ok()? })
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Where a secret is kept: never in the configuration file itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// The first line of a file.
    File(PathBuf),
    /// An environment variable.
    Env(String),
}

/// PEM files for TLS to Redis.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsFiles {
    /// The CA that signed the server's certificate.
    pub ca: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    pub client: Option<(PathBuf, PathBuf)>,
}

impl Config {
}

impl RedisConfig {
    /// Where the link points, without credentials.
    pub fn describe(&self) -> String {
        match &self.target {
            RedisTarget::Sentinel(s) => {
                let list: Vec<String> = s.addresses.iter().map(HostPort::to_string).collect();
                format!("master '{}' via sentinels {}", s.master_name, list.join(","))
            }
            RedisTarget::Url(url) => redacted_url(url),
            RedisTarget::Cluster(c) => {
                let list: Vec<String> = c.seeds.iter().map(HostPort::to_string).collect();
                format!("cluster {}{}", if c.tls { "(tls) " } else { "" }, list.join(","))
            }
        }
    }
}

/// `[limits]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsConfig {
    /// What a request may ask for.
    pub bounds: Bounds,
    /// Most keys the per-host store (local backend, local fallback) holds.
    pub max_local_keys: usize,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    /// A level or a tracing filter; `RUST_LOG` overrides it.
    pub level: String,
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Where the admin API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminListen {
    /// A Unix socket of this mode: who may open it may use the API (with
    /// the write scope unless tokens are configured).
    Unix { path: PathBuf, mode: u32 },
    /// A TCP address: a bearer token is always required.
    Tcp(SocketAddr),
}

/// `[admin]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// `None`: no admin API on this daemon.
    pub listen: Option<AdminListen>,
    /// Holds the token of the write scope (reads included).
    pub token_file: Option<PathBuf>,
    /// Holds the token of the read scope.
    pub read_token_file: Option<PathBuf>,
    /// How often the overrides are read from Redis (also without `listen`).
    pub overrides_refresh: Duration,
    /// TLS on a TCP listener (a token is still required).
    pub tls: Option<AdminTls>,
    /// Connections the admin listener holds open at most (and never more
    /// than a quarter of the process's descriptors: `admin_api::server`).
    pub max_connections: usize,
    /// How long the TLS handshake, the request head and the body may each
    /// wait for the peer.
    pub read_timeout: Duration,
}

/// `[admin] max_connections` when not set: enough for operators and their
/// scripts, few enough that a daemon with 1024 descriptors keeps 960.
pub const ADMIN_MAX_CONNECTIONS_DEFAULT: usize = 64;
/// The largest `[admin] max_connections`.
pub const ADMIN_MAX_CONNECTIONS_MAX: usize = 4096;

/// `[admin] tls_cert_file`, `tls_key_file` (PEM; read when the listener is
/// bound) and `tls_ca_file` (the command line's trust; the daemon does not
/// read it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// `None`: the command line trusts `cert_file` (a self-signed certificate).
    pub ca_file: Option<PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: None,
            token_file: None,
            read_token_file: None,
            overrides_refresh: Duration::from_secs(1),
            tls: None,
            max_connections: ADMIN_MAX_CONNECTIONS_DEFAULT,
            read_timeout: Duration::from_secs(10),
        }
    }
}

/// `[metrics]`: Prometheus text format over HTTP, `GET /metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsConfig {
    /// A loopback address and port.
    pub listen: SocketAddr,
}

/// Command-line values that replace the file's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// Replaces `server.listen`.
    pub listen: Option<PathBuf>,
    /// Replaces `redis.url` (and enables Redis if the file has no `[redis]`).
    pub redis_url: Option<String>,
}

impl Overrides {
    pub(super) fn is_empty(&self) -> bool {
        self.listen.is_none() && self.redis_url.is_none()
    }
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

/// How a request's descriptors are decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DescriptorMode {
    /// One multi-item check: every limited descriptor admitted or none
    /// (nothing recorded for a refused request).
    AllOrNothing,
    /// Each descriptor alone, as envoyproxy/ratelimit does: a refused
    /// request may have spent the other descriptors' quota.
    Each,
}

/// The quota headers added to Envoy's response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyHeaderStyle {
    None,
    /// `RateLimit-Limit`, `-Remaining`, `-Reset` (envoyproxy/ratelimit's
    /// `LIMIT_RESPONSE_HEADERS_ENABLED`).
    Ratelimit,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    X,
    /// `RateLimit-Policy` and `RateLimit` of the IETF draft.
    Draft,
}

/// `[envoy]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyConfig {
    pub listen: Option<SocketAddr>,
    pub socket: Option<PathBuf>,
    pub socket_mode: u32,
    pub descriptors: DescriptorMode,
    pub header_style: EnvoyHeaderStyle,
    /// The fail policy of a routed `[[policy]]` without its own: open or
    /// closed (the YAML files' limits carry `on_error` themselves).
    pub on_error: FailPolicy,
    pub max_connections: usize,
    pub routes: super::descriptors::EnvoyRoutes,
    /// As the file wrote them, for `GET /config`: `config`, `algorithm`,
    /// `on_error`, the routes (domain, descriptor, policy), and the names of
    /// the policies the YAML files made (shown as the files, not as tables).
    pub written: EnvoyWritten,
}

/// `[envoy]` in the file's terms (`GET /config`, show.rs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvoyWritten {
    pub config: Vec<PathBuf>,
    pub algorithm: Option<String>,
    pub on_error: Option<String>,
    pub routes: Vec<(String, Vec<String>, String)>,
    pub yaml_policies: std::collections::BTreeSet<String>,
}

/// Whether `name` may name a policy: it goes into metrics labels and logs as is.
pub(super) fn valid_policy_name(name: &str) -> bool {
    (1..=MAX_POLICY_NAME_LEN).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}
