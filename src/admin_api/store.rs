//! The overrides in Redis: one hash, `<key_prefix>admin:overrides`, whose
//! fields are scoped keys (length byte, policy name, key) and whose values
//! are JSON (`Stored`). Every daemon reads the whole hash in the background
//! (`refresh`) and puts the entries not yet expired, on Redis's clock, in
//! its `LiveOverrides`; it wakes again at the next expiry if that comes
//! before the next refresh, so an override leaves the table within one
//! Redis round trip of its expiry, and a new one enters within one refresh
//! interval plus a round trip. Expired fields are deleted by the next write.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::admin::{connect, AdminError};
use crate::config::{PolicyLimit, RedisConfig, RedisSecrets};
use crate::live_overrides::{split_scoped, LiveOverride, LiveOverrides, Table};
use crate::log_limit::RateLimitedLog;
use crate::metrics::METRICS;
use crate::redis::LinkConnection;

/// At most this many overrides are kept (a write beyond it is refused):
/// every daemon reads them all at each refresh.
pub const MAX_OVERRIDES: usize = 10_000;

/// One override as Redis keeps it and the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stored {
    pub policy: String,
    pub key: String,
    /// `None`: unlimited (exempt).
    pub limit: Option<u32>,
    /// Unix ms, Redis's clock.
    pub expires_at_ms: u64,
    /// Who set it (the API's record of the caller).
    pub set_by: String,
    pub set_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Stored {
    pub fn policy_limit(&self) -> PolicyLimit {
        self.limit.map_or(PolicyLimit::Unlimited, PolicyLimit::Limit)
    }
}

/// The hash holding every override of the fleet sharing `key_prefix`.
pub fn hash_key(key_prefix: &str) -> String {
    format!("{key_prefix}admin:overrides")
}

/// Redis's clock, in Unix ms.
pub async fn redis_now_ms(conn: &mut LinkConnection) -> Result<u64, redis::RedisError> {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    Ok(secs * 1000 + micros / 1000)
}

/// Every stored override, expired ones included, and Redis's time.
pub async fn read_all(conn: &mut LinkConnection, key_prefix: &str) -> Result<(u64, Vec<(Vec<u8>, Option<Stored>)>), redis::RedisError> {
    let now = redis_now_ms(conn).await?;
    let fields: Vec<(Vec<u8>, Vec<u8>)> = conn.hgetall(hash_key(key_prefix)).await?;
    Ok((now, fields.into_iter().map(|(f, v)| (f, serde_json::from_slice(&v).ok())).collect()))
}

/// The overrides in force at `now_ms`, as the request path looks them up.
pub fn table_at(now_ms: u64, stored: &[(Vec<u8>, Option<Stored>)]) -> Table {
    stored
        .iter()
        .filter_map(|(field, s)| {
            let s = s.as_ref()?;
            // A field must be the scoped key of its own record.
            let (policy, key) = split_scoped(field)?;
            (policy == s.policy && key == s.key.as_bytes() && s.expires_at_ms > now_ms).then(|| (field.clone().into_boxed_slice(), LiveOverride { limit: s.policy_limit(), expires_at_ms: s.expires_at_ms }))
        })
        .collect()
}

/// The record stored for `scoped`, if any (expired or not).
pub async fn get(conn: &mut LinkConnection, key_prefix: &str, scoped: &[u8]) -> Result<Option<Stored>, redis::RedisError> {
    let v: Option<Vec<u8>> = conn.hget(hash_key(key_prefix), scoped).await?;
    Ok(v.and_then(|v| serde_json::from_slice(&v).ok()))
}

/// Stores `s` under `scoped` and deletes expired fields; returns how many
/// overrides are stored now.
pub async fn put(conn: &mut LinkConnection, key_prefix: &str, scoped: &[u8], s: &Stored) -> Result<(), redis::RedisError> {
    let value = serde_json::to_vec(s).expect("plain data serializes");
    let _: () = conn.hset(hash_key(key_prefix), scoped, value).await?;
    Ok(())
}

/// Deletes `scoped`'s override; whether there was one.
pub async fn delete(conn: &mut LinkConnection, key_prefix: &str, scoped: &[u8]) -> Result<bool, redis::RedisError> {
    let n: u64 = conn.hdel(hash_key(key_prefix), scoped).await?;
    Ok(n > 0)
}

/// Deletes the fields of `stored` expired at `now_ms` (and unreadable ones).
pub async fn purge_expired(conn: &mut LinkConnection, key_prefix: &str, now_ms: u64, stored: &[(Vec<u8>, Option<Stored>)]) -> Result<(), redis::RedisError> {
    let dead: Vec<&Vec<u8>> = stored.iter().filter(|(_, s)| s.as_ref().map_or(true, |s| s.expires_at_ms <= now_ms)).map(|(f, _)| f).collect();
    if !dead.is_empty() {
        let _: u64 = conn.hdel(hash_key(key_prefix), dead).await?;
    }
    Ok(())
}

/// Keeps `live` equal to the overrides in Redis until `token` is cancelled:
/// reads them every `every`, and at the next expiry when it is sooner. When
/// Redis cannot be read, the table in force is kept, less the entries whose
/// expiry has passed by this host's clock since the last read.
pub async fn refresh(cfg: RedisConfig, secrets: RedisSecrets, live: Arc<LiveOverrides>, every: Duration, token: CancellationToken) {
    let failure_log = RateLimitedLog::new(Duration::from_secs(10));
    let mut conn: Option<LinkConnection> = None;
    // Redis's time at the last read, and this host's then.
    let mut last: Option<(u64, Instant)> = None;
    // The last lift of a ban seen (`admin_api::bans`); `None` until read.
    let mut last_lift: Option<u64> = None;
    loop {
        let read = async {
            if conn.is_none() {
                conn = Some(connect(&cfg, &secrets).await?);
            }
            let c = conn.as_mut().expect("just connected");
            let mark = live.write_mark();
            let overrides = read_all(c, &cfg.key_prefix).await?;
            // Bans lifted since the last read leave this daemon's cache.
            let (lifted, seq) = super::bans::lifts_after(c, &cfg.key_prefix, last_lift).await?;
            for scoped in lifted {
                crate::penalty_box::BANS.lift(&scoped);
            }
            last_lift = Some(seq);
            crate::penalty_box::BANS.sweep();
            Ok::<_, AdminError>((mark, overrides))
        }
        .await;
        let wait = match read {
            Ok((mark, (now, stored))) => {
                let table = table_at(now, &stored);
                let next_expiry = table.values().map(|o| o.expires_at_ms).min();
                live.replace_read_after(table, mark);
                METRICS.live_overrides(live.len());
                last = Some((now, Instant::now()));
                // Wake at the next expiry (1 ms after: Redis's ms floor) if sooner.
                next_expiry.map_or(every, |e| every.min(Duration::from_millis(e - now + 1)))
            }
            Err(e) => {
                conn = None;
                METRICS.live_overrides_refresh_failed();
                if let Some(suppressed) = failure_log.permit() {
                    tracing::warn!(error = %e, suppressed, "cannot read the admin overrides from redis: keeping those in force until their expiry");
                }
                if let Some((then, at)) = last {
                    let now = then + at.elapsed().as_millis() as u64;
                    let kept: Table = live.entries().into_iter().filter(|(_, o)| o.expires_at_ms > now).collect();
                    METRICS.live_overrides(kept.len());
                    live.replace(kept);
                }
                every.min(Duration::from_secs(1))
            }
        };
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
