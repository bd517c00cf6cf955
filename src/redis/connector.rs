//! How to open a connection to the master: a redis-rs client built from
//! `[redis]` and the secrets `preflight` fetched, or Sentinel discovery.
//! Built once per link; reads no file and no environment variable.

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisError};

use super::sentinel::SentinelConnector;
use crate::config::{RedisConfig, RedisSecrets, RedisTarget};

/// How the link reaches the master. Built once per link, so the size
/// difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Connector {
    /// A fixed address (`redis://`, `rediss://`, `redis+unix://`).
    Direct(redis::Client),
    /// Ask the sentinels for the master, connect, and check `ROLE`.
    Sentinel(Box<SentinelConnector>),
}

/// Why a connector could not be built: redis-rs refused the settings.
#[derive(Debug, thiserror::Error)]
#[error("redis.url: {0}")]
pub struct ConnectorError(#[from] RedisError);

impl Connector {
    pub fn new(cfg: &RedisConfig, secrets: &RedisSecrets) -> Result<Self, ConnectorError> {
        let url = match &cfg.target {
            RedisTarget::Sentinel(s) => {
                let master_auth = (cfg.username.clone(), secrets.password.clone());
                let connector = SentinelConnector::new(s, master_auth, secrets.sentinel_password.clone())?;
                return Ok(Self::Sentinel(Box::new(connector)));
            }
            RedisTarget::Url(url) => url,
        };
        let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())?;
        let mut settings = info.redis_settings().clone();
        if let Some(u) = &cfg.username {
            settings = settings.set_username(u);
        }
        if let Some(p) = &secrets.password {
            settings = settings.set_password(p);
        }
        let info = info.set_redis_settings(settings);
        let client = match &secrets.tls {
            Some(tls) => {
                let client_tls = tls.client.clone().map(|(client_cert, client_key)| redis::ClientTlsConfig { client_cert, client_key });
                redis::Client::build_with_tls(info, redis::TlsCertificates { client_tls, root_cert: tls.ca.clone() })?
            }
            None => redis::Client::open(info)?,
        };
        Ok(Self::Direct(client))
    }

    /// One connection to the master (verified with ROLE through Sentinel).
    pub async fn connect(&self, cfg: &AsyncConnectionConfig) -> Result<MultiplexedConnection, RedisError> {
        match self {
            Self::Direct(client) => client.get_multiplexed_async_connection_with_config(cfg).await,
            Self::Sentinel(s) => s.connect_master(cfg).await,
        }
    }

    /// Where the link points, for logs (no credentials).
    pub fn describe(&self) -> String {
        match self {
            Self::Direct(client) => client.get_connection_info().addr().to_string(),
            Self::Sentinel(s) => s.describe(),
        }
    }
}
