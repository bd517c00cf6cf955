//! The configuration file's schema, as serde reads it: plain numbers and
//! strings with their defaults. `Config::from_file` turns it into typed
//! values once; nothing downstream sees this form.

use std::path::PathBuf;

use serde::Deserialize;

use super::model::{ClockSource, LogFormat};
use crate::protocol::Bounds;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct File {
    #[serde(default)]
    pub server: ServerSection,
    #[serde(default)]
    pub redis: Option<RedisSection>,
    #[serde(default)]
    pub limits: LimitsSection,
    #[serde(default)]
    pub log: LogSection,
    #[serde(default)]
    pub metrics: Option<MetricsSection>,
    #[serde(default)]
    pub denial_cache: DenialCacheSection,
    #[serde(default)]
    pub admin: AdminSection,
    /// `[[policy]]` tables, in file order.
    #[serde(default)]
    pub policy: Vec<PolicySection>,
}

/// One `[[policy]]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PolicySection {
    pub name: String,
    pub limit: u64,
    /// A duration: "500ms", "1s", "1m", "1h", "1d"; or "month" (fixed only).
    /// Absent for algorithm = "concurrency" (which has a `lease` instead).
    #[serde(default, deserialize_with = "duration_text")]
    pub window: String,
    /// "+02:00": fixed windows aligned to this offset's midnight (fixed only).
    #[serde(default)]
    pub utc_offset: Option<String>,
    /// The fail policy, named as in Lua and the command line.
    #[serde(default)]
    pub on_error: Option<String>,
    /// The old name of `on_error`: accepted, with a deprecation line.
    #[serde(default)]
    pub fail_policy: Option<String>,
    #[serde(default)]
    pub local_limit: Option<u64>,
    #[serde(default)]
    pub shadow: bool,
    /// "log" (default), "ring", ...: how the policy's windows count.
    #[serde(default)]
    pub algorithm: Option<String>,
    /// A concurrency policy's lease: how long a slot is held if never released.
    #[serde(default)]
    pub lease: Option<String>,
    /// Hot-key shards: the key's quota split over this many windows.
    #[serde(default)]
    pub shards: Option<i64>,
    /// The penalty box: `{ after = N, within = "W", ban = "D" }`.
    #[serde(default)]
    pub penalty: Option<PenaltySection>,
    /// Exact key to a limit or "unlimited"; a BTreeMap so errors come in a
    /// stable order.
    #[serde(default)]
    pub overrides: std::collections::BTreeMap<String, OverrideValue>,
    #[serde(default)]
    pub allowlist: Vec<String>,
}

/// A policy's `penalty = { after = N, within = "W", ban = "D" }` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PenaltySection {
    pub after: i64,
    pub within: String,
    pub ban: String,
}

/// An override as written: a number or a word (only "unlimited" is valid).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum OverrideValue {
    Limit(i64),
    Word(String),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct DenialCacheSection {
    pub enabled: bool,
    pub slots: usize,
    /// `max_age = "1s"`; `max_ms` is its old spelling.
    #[serde(deserialize_with = "optional_duration_text")]
    pub max_age: Option<String>,
    pub max_ms: Option<u64>,
}

impl Default for DenialCacheSection {
    fn default() -> Self {
        Self { enabled: true, slots: 16_384, max_age: None, max_ms: None }
    }
}

/// `[admin]`: the admin API's listener and the overrides' refresh.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct AdminSection {
    /// A socket path, or a host:port (then `token_file` is required).
    pub listen: Option<String>,
    pub socket_mode: String,
    pub token_file: Option<PathBuf>,
    pub read_token_file: Option<PathBuf>,
    pub overrides_refresh: String,
    /// TLS on a TCP listener: the certificate chain and its key (PEM).
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// The CA the command line trusts for the API (default: `tls_cert_file`).
    pub tls_ca_file: Option<PathBuf>,
    /// Connections the admin listener holds open at most.
    pub max_connections: u64,
    /// How long each phase of an admin request may wait for the peer.
    pub read_timeout: String,
}

impl Default for AdminSection {
    fn default() -> Self {
        Self {
            listen: None,
            socket_mode: "0600".into(),
            token_file: None,
            read_token_file: None,
            overrides_refresh: "1s".into(),
            tls_cert_file: None,
            tls_key_file: None,
            tls_ca_file: None,
            max_connections: super::model::ADMIN_MAX_CONNECTIONS_DEFAULT as u64,
            read_timeout: "10s".into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MetricsSection {
    pub listen: std::net::SocketAddr,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct ServerSection {
    pub listen: PathBuf,
    pub socket_mode: String,
    pub socket_group: Option<String>,
    pub max_connections: usize,
    pub max_in_flight_per_connection: usize,
    /// Durations with their unit ("5s"); the `*_ms` numbers are their old
    /// spelling, read with a deprecation line.
    #[serde(deserialize_with = "optional_duration_text")]
    pub shutdown_grace: Option<String>,
    #[serde(deserialize_with = "optional_duration_text")]
    pub idle_timeout: Option<String>,
    #[serde(deserialize_with = "optional_duration_text")]
    pub frame_timeout: Option<String>,
    #[serde(deserialize_with = "optional_duration_text")]
    pub write_timeout: Option<String>,
    pub shutdown_grace_ms: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
    pub frame_timeout_ms: Option<u64>,
    pub write_timeout_ms: Option<u64>,
    pub worker_threads: usize,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            listen: PathBuf::from("/run/ratelimitd/ratelimitd.sock"),
            socket_mode: "0660".into(),
            socket_group: None,
            max_connections: 4096,
            max_in_flight_per_connection: 128,
            shutdown_grace: None,
            idle_timeout: None,
            frame_timeout: None,
            write_timeout: None,
            shutdown_grace_ms: None,
            idle_timeout_ms: None,
            frame_timeout_ms: None,
            write_timeout_ms: None,
            worker_threads: 1,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RedisSection {
    pub url: Option<String>,
    pub cluster: Option<Vec<String>>,
    pub cluster_tls: bool,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub password_env: Option<String>,
    pub tls_ca_file: Option<PathBuf>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// `timeout = "20ms"`; `timeout_ms` is its old spelling.
    #[serde(deserialize_with = "optional_duration_text")]
    pub timeout: Option<String>,
    #[serde(deserialize_with = "optional_duration_text")]
    pub connect_timeout: Option<String>,
    pub timeout_ms: Option<u64>,
    pub connect_timeout_ms: Option<u64>,
    pub breaker_failures: u32,
    pub min_in_flight: u32,
    pub max_in_flight: u32,
    pub key_prefix: String,
    pub clock: ClockSource,
    /// Unset: on, but off with a Cluster (docs/CONFIG.md, "Fast by default").
    pub quota_leases: Option<bool>,
    /// Unset: on where the topology allows (not a Cluster).
    pub batch_cold_keys: Option<bool>,
    pub sentinel: Option<SentinelSection>,
}

impl Default for RedisSection {
    fn default() -> Self {
        Self {
            url: None,
            cluster: None,
            cluster_tls: false,
            username: None,
            password_file: None,
            password_env: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            timeout: None,
            connect_timeout: None,
            timeout_ms: None,
            connect_timeout_ms: None,
            breaker_failures: 5,
            min_in_flight: 16,
            max_in_flight: 1024,
            key_prefix: "ratelimitd:".into(),
            clock: ClockSource::Redis,
            // On by default: docs/CONFIG.md says what each costs and why.
            quota_leases: None,
            batch_cold_keys: None,
            sentinel: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SentinelSection {
    pub master_name: String,
    pub addresses: Vec<String>,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    #[serde(default)]
    pub password_env: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct LimitsSection {
    pub max_key_len: usize,
    pub max_limit: u32,
    pub max_window_ms: u32,
    pub max_cost: u32,
    pub max_local_keys: usize,
}

impl Default for LimitsSection {
    fn default() -> Self {
        let b = Bounds::default();
        Self { max_key_len: b.max_key_len, max_limit: b.max_limit, max_window_ms: b.max_window_ms, max_cost: b.max_cost, max_local_keys: 1_000_000 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct LogSection {
    pub level: String,
    pub format: LogFormat,
}

impl Default for LogSection {
    fn default() -> Self {
        Self { level: "info".into(), format: LogFormat::Text }
    }
}

/// A duration's text; a bare number is kept as its digits, which the
/// validation refuses with a message naming the unit to write (a number
/// alone would leave the unit to a guess: `window = 60000`).
fn duration_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        Text(String),
        Number(i64),
    }
    Ok(match Text::deserialize(d)? {
        Text::Text(s) => s,
        Text::Number(n) => n.to_string(),
    })
}

/// `duration_text` of a field that may be absent.
fn optional_duration_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    duration_text(d).map(Some)
}
