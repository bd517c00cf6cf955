//! The daemon's configuration: one TOML file, read once and turned into
//! typed values (durations, socket mode, host:port lists) by a pure
//! validation that reports every bad field, not just the first. Everything
//! that touches the outside world (secret files, the environment, TLS files,
//! the group database) is `preflight`'s, done once per load. Every field is
//! documented in docs/CONFIG.md and in the commented `ratelimitd.example.toml`.
//!
//! - `model`: the typed configuration and its errors;
//! - `file`: the schema serde reads, with its defaults, and its parse errors (every one, naming the field);
//! - `validate`: file to model, every bad field reported;
//! - `preflight`: secrets, TLS material and the socket group, resolved;
//! - `nginx_names`: the policy names an nginx configuration uses (`check-config --nginx`);
//! - `show`: the configuration in force written back as TOML in the file's terms (`GET /config`);
//! - `descriptors`: Envoy's descriptors matched as envoyproxy/ratelimit matches them;
//! - `envoy`: `[envoy]`'s YAML files and routes read into policies and that tree;
//! - `reserve`: which policies a reserve and settle can name (the daemon's rule and check-config's).

mod descriptors;
mod envoy;
mod file;
mod model;
mod nginx_names;
mod preflight;
mod reserve;
mod show;
mod validate;

pub use model::{
    redacted_url, AdminConfig, AdminListen, AdminTls, ClockSource, ClusterConfig, Config, ConfigError, DenialCacheConfig, DescriptorMode, EnvoyConfig, EnvoyHeaderStyle, EnvoyWritten, FieldError, HostPort, ParseError, LimitsConfig, LogConfig, LogFormat, MetricsConfig, Overrides, Penalty, PolicyConfig, PolicyLimit, PolicyRule, RedisConfig, RedisTarget, SecretSource,
    SentinelConfig, ServerConfig, TlsFiles, ADMIN_MAX_CONNECTIONS_DEFAULT, ADMIN_MAX_CONNECTIONS_MAX, DEFAULT_REDIS_URL, MAX_PENALTY_AFTER, MAX_SHARDS,
};
pub use descriptors::{EnvoyRoutes, EnvoyUnit, Found, Target, MAX_ENVOY_DEPTH};
pub use nginx_names::{check_limiter_options, nginx_limiter_tables, nginx_multi_policy_names, nginx_policy_names, nginx_settle_policy_names, LimiterCheckError, LimiterTable, NamedPolicy, NginxReadError};
pub use reserve::{multi_refusal, reserve_refusal};
pub use validate::{parse_duration, sendable_key, UnsendableKey};
pub use preflight::{preflight, RedisSecrets, Resolved, TlsMaterial};
