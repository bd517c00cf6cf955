//! How to open a connection to the master: a redis-rs client built from
//! `[redis]` and the secrets `preflight` fetched, Sentinel discovery, or a
//! Redis Cluster client. Built once per link; reads no file and no
//! environment variable.

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, Value};

use super::sentinel::SentinelConnector;
use crate::config::{ClusterConfig, RedisConfig, RedisSecrets, RedisTarget};

/// The link's connection: one multiplexed connection to a single master
/// (direct or found through Sentinel), or a Redis Cluster connection, which
/// keeps one multiplexed connection per node, routes each command by the
/// slot of its key, follows MOVED/ASK and refreshes the slot map itself.
/// Both are cheap to clone (a handle on a shared connection task).
#[derive(Clone)]
pub enum LinkConnection {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl LinkConnection {
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

/// Delegates to the connection inside: `Cmd::query_async`, `Script::load_async`
/// and pipelines work on either. No allocation of its own: both inner
/// connections return their boxed future, which is passed on.
impl ConnectionLike for LinkConnection {
    #[inline]
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(&'a mut self, pipeline: &'a Pipeline, offset: usize, count: usize) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// How the link reaches the master. Built once per link, so the size
/// difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Connector {
    /// A fixed address (`redis://`, `rediss://`, `redis+unix://`).
    Direct(redis::Client),
    /// Ask the sentinels for the master, connect, and check `ROLE`.
    Sentinel(Box<SentinelConnector>),
    /// A Redis Cluster: read the slot map from the seeds, connect to every
    /// primary. `seeds` is for logs.
    Cluster { client: ClusterClient, seeds: String },
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
            RedisTarget::Cluster(c) => {
                let seeds = c.seeds.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
                return Ok(Self::Cluster { client: cluster_client(c, cfg, secrets)?, seeds: format!("cluster {seeds}") });
            }
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
    ///
    /// A cluster connection is checked by redis-rs itself: it reads the slot
    /// map (`CLUSTER SLOTS`) and sends each command to its slot's primary.
    pub async fn connect(&self, cfg: &AsyncConnectionConfig) -> Result<LinkConnection, RedisError> {
        let mut conn = match self {
            Self::Direct(client) => client.get_multiplexed_async_connection_with_config(cfg).await?,
            Self::Sentinel(s) => s.connect_master(cfg).await?,
            Self::Cluster { client, .. } => return Ok(LinkConnection::Cluster(client.get_async_connection().await?)),
        };
        ensure_master(&mut conn).await?;
        Ok(LinkConnection::Single(conn))
    }

    /// Where the link points, for logs (no credentials).
    pub fn describe(&self) -> String {
        match self {
            Self::Direct(client) => client.get_connection_info().addr().to_string(),
            Self::Sentinel(s) => s.describe(),
            Self::Cluster { seeds, .. } => seeds.clone(),
        }
    }
}

/// The cluster client: AUTH/ACL and TLS as for a single Redis, the link's
/// timeouts, and Nagle off on every node's connection.
///
/// redis-rs retries nothing itself (`retries(0)`): a redirect comes back
/// to the link, which follows `ASK` with `ASKING` and the command in one
/// pipeline and `MOVED` to the node named (`follow_redirect` in link.rs).
/// redis-rs's own `ASK` handling sends `ASKING` and the command as two
/// requests: under load another call's command consumes the one-shot flag,
/// the importing node answers `MOVED`, and every `MOVED` makes redis-rs
/// refresh its slot map inside its one polling loop, where no call in
/// flight is polled; under mixed traffic during a slot move that refresh
/// was seen to never complete (see `watch_cluster` in link.rs). Its other
/// retries (`TRYAGAIN`, `CLUSTERDOWN`) sleep at least 1.28 s, past any
/// deadline of ours. It still refreshes its slot map after a `MOVED` and
/// reconnects a lost node. The response timeout is the floor of the
/// supervisor's work (SCRIPT LOAD, probe), as for a single connection.
fn cluster_client(c: &ClusterConfig, cfg: &RedisConfig, secrets: &RedisSecrets) -> Result<ClusterClient, RedisError> {
    let scheme = if c.tls { "rediss" } else { "redis" };
    let seeds: Vec<String> = c.seeds.iter().map(|hp| format!("{scheme}://{hp}")).collect();
    let mut b = ClusterClient::builder(seeds)
        .connection_timeout(cfg.connect_timeout)
        .response_timeout(cfg.timeout.max(std::time::Duration::from_secs(1)))
        .retries(0)
        .tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
    if let Some(u) = &cfg.username {
        b = b.username(u);
    }
    if let Some(p) = &secrets.password {
        b = b.password(p);
    }
    if let Some(tls) = &secrets.tls {
        let client_tls = tls.client.clone().map(|(client_cert, client_key)| redis::ClientTlsConfig { client_cert, client_key });
        b = b.certs(redis::TlsCertificates { client_tls, root_cert: tls.ca.clone() });
    }
    b.build()
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
