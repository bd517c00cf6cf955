//! `ratelimitd inspect` and `ratelimitd reset`: look at or clear one key's
//! window in Redis, with the daemon's own key derivation and connection
//! settings (including Sentinel, AUTH and TLS).

use std::time::Duration;

use redis::AsyncConnectionConfig;
use serde::Serialize;

use crate::config::{RedisConfig, RedisSecrets};
use crate::protocol::Algorithm;
use crate::redis::{Connector, ConnectorError, LinkConnection, WindowKey};

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(transparent)]
    Config(#[from] ConnectorError),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// One window of a key as Redis holds it.
#[derive(Debug, Serialize, PartialEq)]
pub struct Inspection {
    pub redis_key: String,
    /// The window length this key is for.
    pub window_ms: u32,
    /// The algorithm that counts in this key ("log": a ZSET; "ring": a string).
    pub algorithm: &'static str,
    /// Admissions stored (members of the ZSET; the ring's non-empty slots).
    pub members: u64,
    /// Admissions within the last `window_ms`: what the next check counts.
    pub in_window: u64,
    /// Age in ms of the oldest and newest admission, on Redis's clock.
    pub oldest_age_ms: Option<i64>,
    pub newest_age_ms: Option<i64>,
    /// Time to live of the key in ms (-2: no such key).
    pub ttl_ms: i64,
}

fn window_key<'a>(cfg: &'a RedisConfig, key: &'a str, window_ms: u32, algorithm: Algorithm) -> WindowKey<'a> {
    WindowKey { prefix: cfg.key_prefix.as_bytes(), key: key.as_bytes(), window_ms, algorithm }
}

async fn connect(cfg: &RedisConfig, secrets: &RedisSecrets) -> Result<LinkConnection, AdminError> {
    let connector = Connector::new(cfg, secrets)?;
    let conn_cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(cfg.connect_timeout.max(Duration::from_secs(1))))
        .set_response_timeout(Some(Duration::from_secs(5)));
    Ok(connector.connect(&conn_cfg).await?)
}

/// The Redis keys of `key`'s windows, of every algorithm: those of
/// `window_ms`, or every one that exists (found with SCAN: its cost grows
/// with the keyspace), with their window lengths, shortest first.
async fn windows_of(conn: &mut LinkConnection, cfg: &RedisConfig, key: &str, window_ms: Option<u32>) -> Result<Vec<(Vec<u8>, u32, Algorithm)>, AdminError> {
    if let Some(w) = window_ms {
        return Ok(Algorithm::ALL.iter().map(|&a| (window_key(cfg, key, w, a).to_vec(), w, a)).collect());
    }
    let pattern = window_key(cfg, key, 0, Algorithm::Log).all_windows_pattern();
    let stem_len = window_key(cfg, key, 0, Algorithm::Log).to_vec().len() - ":0ms".len();
    let mut found = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let scan = redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(1000).to_owned();
        let (next, keys): (u64, Vec<Vec<u8>>) = match conn {
            LinkConnection::Single(c) => scan.query_async(c).await?,
            // Every window of a key is in the key's slot: scan the primary
            // that holds it (SCAN is per node in a cluster).
            LinkConnection::Cluster(c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_key(window_key(cfg, key, 0, Algorithm::Log).to_vec(), SlotAddr::Master)));
                redis::FromRedisValue::from_redis_value(c.route_command(scan, route).await?).map_err(redis::RedisError::from)?
            }
        };
        for k in keys {
            // The pattern's `*` could also match a longer key that merely
            // starts like ours: keep only "<stem>:<digits>ms[:<algorithm>]",
            // checked by deriving the key again.
            let window = k.get(stem_len..).and_then(|t| t.strip_prefix(b":")).and_then(|t| t.iter().position(|&b| b == b'm').map(|m| &t[..m])).and_then(|d| std::str::from_utf8(d).ok()).and_then(|d| d.parse::<u32>().ok());
            if let Some(w) = window {
                if let Some(&a) = Algorithm::ALL.iter().find(|&&a| window_key(cfg, key, w, a).to_vec() == k) {
                    found.push((k, w, a));
                }
            }
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    found.sort_by_key(|&(_, w, a)| (w, a.to_wire()));
    found.dedup();
    Ok(found)
}

/// Every window of `key` (or the one of `window_ms`), as Redis holds it.
pub async fn inspect(cfg: &RedisConfig, secrets: &RedisSecrets, key: &str, window_ms: Option<u32>) -> Result<Vec<Inspection>, AdminError> {
    let mut conn = connect(cfg, secrets).await?;
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let now_ms = secs * 1000 + micros / 1000;
    let mut out = Vec::new();
    for (redis_key, w, algorithm) in windows_of(&mut conn, cfg, key, window_ms).await? {
        if algorithm != Algorithm::Log {
            let (bytes, ttl_ms): (Vec<u8>, i64) = redis::pipe().get(&redis_key).pttl(&redis_key).query_async(&mut conn).await?;
            if ttl_ms == -2 && window_ms.is_some() {
                continue; // asked by window: the log's key always, others when they exist
            }
            out.push(match algorithm {
                Algorithm::Gcra => inspect_gcra(redis_key, w, &bytes, now_ms, ttl_ms),
                Algorithm::Fixed | Algorithm::SlidingCounter => inspect_counter(redis_key, w, algorithm, &bytes, ttl_ms),
                Algorithm::Ring | Algorithm::Log => inspect_ring(redis_key, w, &bytes, now_ms, ttl_ms),
            });
            continue;
        }
        let mut pipe = redis::pipe();
        pipe.zcard(&redis_key)
            .zcount(&redis_key, format!("({}", now_ms - i64::from(w)), "+inf")
            .zrange_withscores(&redis_key, 0, 0)
            .zrange_withscores(&redis_key, -1, -1)
            .pttl(&redis_key);
        type Scored = Vec<(String, i64)>;
        let (members, in_window, oldest, newest, ttl_ms): (u64, u64, Scored, Scored, i64) = pipe.query_async(&mut conn).await?;
        out.push(Inspection {
            redis_key: String::from_utf8_lossy(&redis_key).into_owned(),
            window_ms: w,
            algorithm: algorithm.as_str(),
            members,
            in_window,
            oldest_age_ms: oldest.first().map(|(_, t)| now_ms - t),
            newest_age_ms: newest.first().map(|(_, t)| now_ms - t),
            ttl_ms,
        });
    }
    Ok(out)
}

/// A GCRA key (src/redis/gcra.lua): one number, the theoretical arrival
/// time in ms. `newest_age_ms` is now − TAT: negative while the bucket is
/// not full (by as many ms as it needs to fill); members and in_window are
/// 1 while it is not full, else 0.
fn inspect_gcra(redis_key: Vec<u8>, window_ms: u32, bytes: &[u8], now_ms: i64, ttl_ms: i64) -> Inspection {
    let tat = std::str::from_utf8(bytes).ok().and_then(|s| s.parse::<f64>().ok()).map(|t| t.ceil() as i64);
    let busy = u64::from(tat.is_some_and(|t| t > now_ms));
    Inspection {
        redis_key: String::from_utf8_lossy(&redis_key).into_owned(),
        window_ms,
        algorithm: Algorithm::Gcra.as_str(),
        members: busy,
        in_window: busy,
        oldest_age_ms: None,
        newest_age_ms: tat.map(|t| now_ms - t),
        ttl_ms,
    }
}

/// A fixed window or sliding counter ("<window start> <count>[ <previous
/// count>]", src/redis/fixed_window.lua, sliding_counter.lua): members and
/// in_window are the current fixed window's count.
fn inspect_counter(redis_key: Vec<u8>, window_ms: u32, algorithm: Algorithm, bytes: &[u8], ttl_ms: i64) -> Inspection {
    let count = std::str::from_utf8(bytes).ok().and_then(|s| s.split(' ').nth(1)).and_then(|c| c.parse::<u64>().ok()).unwrap_or(0);
    Inspection {
        redis_key: String::from_utf8_lossy(&redis_key).into_owned(),
        window_ms,
        algorithm: algorithm.as_str(),
        members: count,
        in_window: count,
        oldest_age_ms: None,
        newest_age_ms: None,
        ttl_ms,
    }
}

/// A ring (src/redis/ring.lua): an 8-byte header, then slots of 8-byte
/// little-endian doubles, each an admission unit's time in ms (0: empty).
fn inspect_ring(redis_key: Vec<u8>, window_ms: u32, bytes: &[u8], now_ms: i64, ttl_ms: i64) -> Inspection {
    let times: Vec<i64> = bytes.get(8..).unwrap_or_default().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as i64).filter(|&t| t > 0).collect();
    Inspection {
        redis_key: String::from_utf8_lossy(&redis_key).into_owned(),
        window_ms,
        algorithm: Algorithm::Ring.as_str(),
        members: times.len() as u64,
        in_window: times.iter().filter(|&&t| t > now_ms - i64::from(window_ms)).count() as u64,
        oldest_age_ms: times.iter().min().map(|t| now_ms - t),
        newest_age_ms: times.iter().max().map(|t| now_ms - t),
        ttl_ms,
    }
}

/// Deletes every window of `key` (or the one of `window_ms`): its quota is
/// whole again. Returns the Redis keys deleted.
pub async fn reset(cfg: &RedisConfig, secrets: &RedisSecrets, key: &str, window_ms: Option<u32>) -> Result<Vec<String>, AdminError> {
    let mut conn = connect(cfg, secrets).await?;
    let mut deleted = Vec::new();
    for (redis_key, _, _) in windows_of(&mut conn, cfg, key, window_ms).await? {
        let removed: u64 = redis::cmd("DEL").arg(&redis_key).query_async(&mut conn).await?;
        if removed > 0 {
            deleted.push(String::from_utf8_lossy(&redis_key).into_owned());
        }
    }
    Ok(deleted)
}
