//! The daemon's configuration: one TOML file, read once and turned into
//! typed values (durations, socket mode, host:port lists) by a pure
//! validation that reports every bad field, not just the first. Everything
//! that touches the outside world (secret files, the environment, TLS files,
//! the group database) is `preflight`'s, done once per load. Every field is
//! documented in docs/CONFIG.md and in the commented `ratelimitd.example.toml`.
//!
//! - `model`: the typed configuration and its errors;
//! - `file`: the schema serde reads, with its defaults;
//! - `validate`: file to model, every bad field reported;
//! - `preflight`: secrets, TLS material and the socket group, resolved;
//! - `nginx_names`: the policy names an nginx configuration uses (`check-config --nginx`);
//! - `reserve`: which policies a reserve and settle can name (the daemon's rule and check-config's).

mod file;
mod model;
mod nginx_names;
mod preflight;
mod reserve;
mod validate;

pub use model::{
    redacted_url, AdminConfig, AdminListen, AdminTls, ClockSource, ClusterConfig, Config, ConfigError, DenialCacheConfig, FieldError, HostPort, LimitsConfig, LogConfig, LogFormat, MetricsConfig, Overrides, Penalty, PolicyConfig, PolicyLimit, RedisConfig, RedisTarget, SecretSource, SentinelConfig,
    ServerConfig, TlsFiles, ADMIN_MAX_CONNECTIONS_DEFAULT, ADMIN_MAX_CONNECTIONS_MAX, DEFAULT_REDIS_URL, MAX_PENALTY_AFTER, MAX_SHARDS,
};
pub use nginx_names::{nginx_multi_policy_names, nginx_policy_names, nginx_settle_policy_names, NamedPolicy, NginxReadError};
pub use reserve::{multi_refusal, reserve_refusal};
pub use validate::{parse_duration, sendable_key, UnsendableKey};
pub use preflight::{preflight, RedisSecrets, Resolved, TlsMaterial};
