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
        // Nagle off: a pipelined command must not wait for the ACK of the
        // one before it (a round trip on a real network; redis-rs leaves
        // Nagle on by default).
        let info = info.set_redis_settings(settings).set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
        let client = match &secrets.tls {
            Some(tls) => {
                let client_tls = tls.client.clone().map(|(client_cert, client_key)| redis::ClientTlsConfig { client_cert, client_key });
                redis::Client::build_with_tls(info, redis::TlsCertificates { client_tls, root_cert: tls.ca.clone() })?
            }
            None => redis::Client::open(info)?,
        };
        Ok(Self::Direct(client))
    }

    /// One connection to the master, verified with `ROLE`: a direct URL can
    /// point at a replica (after a `REPLICAOF`), and a sentinel's view can
    /// lag a failover. `SCRIPT LOAD` succeeds on a replica, so without this
    /// check every reconnect would "succeed" and the next request would
    /// meet `READONLY`.
    pub async fn connect(&self, cfg: &AsyncConnectionConfig) -> Result<MultiplexedConnection, RedisError> {
        let mut conn = match self {
            Self::Direct(client) => client.get_multiplexed_async_connection_with_config(cfg).await?,
            Self::Sentinel(s) => s.connect_master(cfg).await?,
        };
        ensure_master(&mut conn).await?;
        Ok(conn)
    }

    /// Where the link points, for logs (no credentials).
    pub fn describe(&self) -> String {
        match self {
            Self::Direct(client) => client.get_connection_info().addr().to_string(),
            Self::Sentinel(s) => s.describe(),
        }
    }
}

/// Fails unless the server answers `ROLE` with `master`. An ACL user not
/// allowed `ROLE` (NOPERM) is let through: the link then learns of a replica
/// from `READONLY`, and the supervisor's backoff bounds the reconnects.
async fn ensure_master(conn: &mut MultiplexedConnection) -> Result<(), RedisError> {
    let role: Vec<redis::Value> = match redis::cmd("ROLE").query_async(conn).await {
        Ok(role) => role,
        Err(e) if e.code() == Some("NOPERM") => {
            tracing::debug!("the ACL user may not run ROLE; the master is not verified");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let name = match role.first() {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        other => format!("{other:?}"),
    };
    if name != "master" {
        return Err(RedisError::from(std::io::Error::other(format!("the server answers ROLE '{name}', not 'master'"))));
    }
    Ok(())
}
