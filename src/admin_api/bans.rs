//! The penalty box's bans in Redis, as the admin API lists and lifts them.
//!
//! A ban is one key in its key's slot, `<stem>:penalty:ban` (value: its end,
//! Unix ms on the script's clock; PTTL: what is left), set by
//! src/redis/scripts/penalized_check.lua. So that they can be listed without a SCAN of
//! every node, the daemon whose request engaged a ban adds it to the
//! index `<key_prefix>admin:bans` (a ZSET: scoped key, scored by its end),
//! once per ban; every daemon's refresher deletes the ended ones at each
//! refresh (`prune_ended`: one ZREMRANGEBYSCORE, O(log n) when none has
//! ended), so the index holds the bans in force and those ended within the
//! last refresh, whether anyone lists them or not. A lift
//! deletes the ban and the key's strikes, takes it out of the index and
//! appends it to the fleet's change log (`changes`): every daemon reads the
//! log with its overrides (`store::refresh`) and drops the lifted keys from
//! its ban cache, or drops its whole cache when it may have missed entries.

use redis::AsyncCommands;

use super::changes::{self, Kind, Written};
use crate::redis::{LinkConnection, WindowKey};

/// The index of the fleet's bans.
pub fn index_key(key_prefix: &str) -> String {
    format!("{key_prefix}admin:bans")
}

/// Deletes the bans ended by `now_ms` (Redis's clock) from the index.
pub async fn prune_ended(conn: &mut LinkConnection, key_prefix: &str, now_ms: u64) -> Result<u64, redis::RedisError> {
    conn.zrembyscore(index_key(key_prefix), "-inf", now_ms).await
}

fn stem<'a>(key_prefix: &'a str, scoped: &'a [u8]) -> WindowKey<'a> {
    WindowKey { prefix: key_prefix.as_bytes(), key: scoped, window_ms: 0, algorithm: crate::protocol::Algorithm::Log }
}

/// Redis's clock, in Unix ms (as `store`'s; this module is below it:
/// `store::refresh` applies the lifts).
async fn redis_now_ms(conn: &mut LinkConnection) -> Result<u64, redis::RedisError> {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    Ok(secs * 1000 + micros / 1000)
}

/// One ban in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ban {
    /// Unix ms (Redis's clock) at which it ends.
    pub ends_at_ms: u64,
    pub left_ms: u64,
}

/// `scoped`'s ban, if one is in force.
pub async fn get(conn: &mut LinkConnection, key_prefix: &str, scoped: &[u8]) -> Result<Option<Ban>, redis::RedisError> {
    let key = stem(key_prefix, scoped).ban_key();
    let left: i64 = conn.pttl(&key).await?;
    if left <= 0 {
        return Ok(None);
    }
    let end: Option<u64> = conn.get(&key).await?;
    let now = redis_now_ms(conn).await?;
    Ok(Some(Ban { ends_at_ms: end.unwrap_or(now + left as u64), left_ms: left as u64 }))
}

/// The key's refusals counted towards a ban within `within_ms` of now.
pub async fn strikes(conn: &mut LinkConnection, key_prefix: &str, scoped: &[u8], within_ms: u32) -> Result<u64, redis::RedisError> {
    let now = redis_now_ms(conn).await?;
    conn.zcount(stem(key_prefix, scoped).strikes_key(), format!("({}", now.saturating_sub(u64::from(within_ms))), "+inf").await
}

/// The bans in the index not ended by Redis's clock (ended ones are
/// deleted from it), each as (scoped key, end in Unix ms), and the time.
pub async fn list(conn: &mut LinkConnection, key_prefix: &str) -> Result<(u64, Vec<(Vec<u8>, u64)>), redis::RedisError> {
    let now = redis_now_ms(conn).await?;
    let index = index_key(key_prefix);
    let _: u64 = conn.zrembyscore(&index, "-inf", now).await?;
    let entries: Vec<(Vec<u8>, f64)> = conn.zrangebyscore_withscores(&index, format!("({now}"), "+inf").await?;
    Ok((now, entries.into_iter().map(|(k, s)| (k, s as u64)).collect()))
}

/// Lifts `scoped`'s ban: deletes it and its strikes, takes it out of the
/// index and logs the lift for the fleet. Returns the ban it lifted. Done
/// again by a retry whatever the first try did (a key not banned is still
/// logged), so a lift whose log entry failed is repaired by its retry.
pub async fn lift(conn: &mut LinkConnection, key_prefix: &str, scoped: &[u8]) -> Result<Written<Option<Ban>>, redis::RedisError> {
    let before = get(conn, key_prefix, scoped).await?;
    let k = stem(key_prefix, scoped);
    // Both in the key's slot: one DEL.
    let _: u64 = conn.del(&[k.ban_key(), k.strikes_key()]).await?;
    let logged = changes::append(conn, key_prefix, Kind::Lift, scoped).await.map(drop);
    // Last: an index entry left behind is pruned at the ban's end.
    if let Err(e) = conn.zrem::<_, _, u64>(index_key(key_prefix), scoped).await {
        tracing::debug!(error = %e, "could not take a lifted ban out of the index");
    }
    Ok(Written { done: before, logged })
}
