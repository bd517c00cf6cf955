//! `ratelimitd inspect` and `ratelimitd reset`: look at or clear one key's
//! window in Redis, with the daemon's own key derivation and connection
//! settings (including Sentinel, AUTH and TLS).

use std::time::Duration;

use redis::AsyncConnectionConfig;
use serde::Serialize;

use crate::config::{RedisConfig, RedisSecrets};
use crate::redis::{Connector, ConnectorError, WindowKey};

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(transparent)]
    Config(#[from] ConnectorError),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// One key's window as Redis holds it.
#[derive(Debug, Serialize, PartialEq)]
pub struct Inspection {
    pub redis_key: String,
    /// Admissions stored (members of the ZSET).
    pub members: u64,
    /// Admissions within the last `window_ms`, if one was given.
    pub in_window: Option<u64>,
    /// Age in ms of the oldest and newest admission, on Redis's clock.
    pub oldest_age_ms: Option<i64>,
    pub newest_age_ms: Option<i64>,
    /// Time to live of the key in ms (-2: no such key).
    pub ttl_ms: i64,
}

fn key_string(cfg: &RedisConfig, key: &str) -> String {
    String::from_utf8_lossy(&WindowKey { prefix: cfg.key_prefix.as_bytes(), key: key.as_bytes() }.to_vec()).into_owned()
}

async fn connect(cfg: &RedisConfig, secrets: &RedisSecrets) -> Result<redis::aio::MultiplexedConnection, AdminError> {
    let connector = Connector::new(cfg, secrets)?;
    let conn_cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(cfg.connect_timeout.max(Duration::from_secs(1))))
        .set_response_timeout(Some(Duration::from_secs(5)));
    Ok(connector.connect(&conn_cfg).await?)
}

pub async fn inspect(cfg: &RedisConfig, secrets: &RedisSecrets, key: &str, window_ms: Option<u32>) -> Result<Inspection, AdminError> {
    let mut conn = connect(cfg, secrets).await?;
    let redis_key = key_string(cfg, key);
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let now_ms = secs * 1000 + micros / 1000;
    let mut pipe = redis::pipe();
    pipe.zcard(&redis_key).zrange_withscores(&redis_key, 0, 0).zrange_withscores(&redis_key, -1, -1).pttl(&redis_key);
    type Scored = Vec<(String, i64)>;
    let (members, oldest, newest, ttl_ms): (u64, Scored, Scored, i64) = pipe.query_async(&mut conn).await?;
    let in_window = match window_ms {
        Some(w) => Some(redis::cmd("ZCOUNT").arg(&redis_key).arg(format!("({}", now_ms - w as i64)).arg("+inf").query_async(&mut conn).await?),
        None => None,
    };
    Ok(Inspection {
        redis_key,
        members,
        in_window,
        oldest_age_ms: oldest.first().map(|(_, t)| now_ms - t),
        newest_age_ms: newest.first().map(|(_, t)| now_ms - t),
        ttl_ms,
    })
}

/// Deletes the key's window; returns whether there was one.
pub async fn reset(cfg: &RedisConfig, secrets: &RedisSecrets, key: &str) -> Result<(String, bool), AdminError> {
    let mut conn = connect(cfg, secrets).await?;
    let redis_key = key_string(cfg, key);
    let removed: u64 = redis::cmd("DEL").arg(&redis_key).query_async(&mut conn).await?;
    Ok((redis_key, removed > 0))
}
