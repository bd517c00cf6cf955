//! `ratelimitd inspect` and `ratelimitd reset`: look at or clear one key's
//! window in Redis, with the daemon's own key derivation and connection
//! settings (including Sentinel, AUTH and TLS). A key of inline checks is
//! named as sent; a `[[policy]]`'s key by the policy's name and the key, as
//! `ratelimitd top` shows them: its window, algorithm and shards come from
//! the configuration, through the same code the daemon uses (`Policies`,
//! `shard_key`), never formatted here.

use std::time::Duration;

use redis::AsyncConnectionConfig;
use serde::Serialize;

use crate::config::{PolicyConfig, RedisConfig, RedisSecrets};
use crate::policies::Policies;
use crate::protocol::Algorithm;
use crate::redis::{scripts, shard_key, Connector, ConnectorError, LinkConnection, WindowKey};

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(transparent)]
    Config(#[from] ConnectorError),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("no [[policy]] named '{name}' in the configuration ({})", if known.is_empty() { "it has none".to_string() } else { format!("its policies: {}", known.join(", ")) })]
    UnknownPolicy { name: String, known: Vec<String> },
}

/// Which windows to look at or clear.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// A key of inline checks (CHECK, ACQUIRE): every window it has in
    /// Redis, or the one of `window_ms`.
    Inline { key: &'a str, window_ms: Option<u32> },
    /// A key of the policy named `policy` (CHECK_POLICY, ACQUIRE_POLICY):
    /// its window under the policy, every shard's for a sharded policy, or
    /// its leases for a concurrency policy.
    Policy { policy: &'a str, key: &'a str },
}

/// One window of a key as Redis holds it.
#[derive(Debug, Serialize, PartialEq)]
pub struct Inspection {
    pub redis_key: String,
    /// The window length this key is for (a concurrency policy: its lease).
    pub window_ms: u32,
    /// The algorithm that counts in this key ("log": a ZSET; "ring": a
    /// string; "concurrency": a ZSET of leases scored by their expiry).
    pub algorithm: &'static str,
    /// Which of a sharded policy's windows (0-based), if it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    /// Admissions stored (members of the ZSET; the ring's non-empty slots;
    /// slots of leases, expired ones not yet swept included).
    pub members: u64,
    /// Admissions within the last `window_ms`: what the next check counts
    /// (leases: slots of leases not yet expired).
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

/// A connection of its own to `cfg`'s Redis, for admin work (never the request path's link).
pub async fn connect(cfg: &RedisConfig, secrets: &RedisSecrets) -> Result<LinkConnection, AdminError> {
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
    for k in scan_slot(conn, &window_key(cfg, key, 0, Algorithm::Log).to_vec(), &pattern).await? {
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
    found.sort_by_key(|&(_, w, a)| (w, a.to_wire()));
    found.dedup();
    Ok(found)
}

/// Every key matching `pattern` on the primary that holds `slot_key`'s
/// slot (SCAN is per node in a Cluster; every window of a key, and every
/// settle record of a window, is in the key's slot). Its cost grows with
/// the node's keyspace: admin tools only.
async fn scan_slot(conn: &mut LinkConnection, slot_key: &[u8], pattern: &[u8]) -> Result<Vec<Vec<u8>>, AdminError> {
    let mut found = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let scan = redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000).to_owned();
        let (next, keys): (u64, Vec<Vec<u8>>) = match conn {
            LinkConnection::Single(c) => scan.query_async(c).await?,
            LinkConnection::Cluster(c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_key(slot_key, SlotAddr::Master)));
                redis::FromRedisValue::from_redis_value(c.route_command(scan, route).await?).map_err(redis::RedisError::from)?
            }
        };
        found.extend(keys);
        if next == 0 {
            return Ok(found);
        }
        cursor = next;
    }
}

/// The key the daemon counts a policy's key under: the name's length
/// byte, the name and the key, as a CHECK_POLICY frame carries them
/// (`PolicyItem::scoped_key`; a unit test holds the two together).
fn scoped_key(name: &str, key: &str) -> Vec<u8> {
    let mut scoped = Vec::with_capacity(1 + name.len() + key.len());
    scoped.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
    scoped.extend_from_slice(name.as_bytes());
    scoped.extend_from_slice(key.as_bytes());
    scoped
}

/// What one Redis key of a target holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counter {
    Window(Algorithm),
    Leases,
}

/// One Redis key of a target.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Found {
    /// The key the daemon decides (scoped to the policy, or a shard's).
    key: Vec<u8>,
    redis_key: Vec<u8>,
    window_ms: u32,
    counter: Counter,
    shard: Option<u32>,
}

/// The policy named `name` in `policies`, resolved as the daemon resolves
/// it (its window, a calendar window's code included), alone in a table.
fn policy_named(policies: &[PolicyConfig], name: &str) -> Result<Policies, AdminError> {
    let unknown = || AdminError::UnknownPolicy { name: name.to_string(), known: policies.iter().map(|p| p.name.clone()).collect() };
    let one = policies.iter().find(|p| p.name == name).ok_or_else(unknown)?;
    Ok(Policies::build(std::slice::from_ref(one), None))
}

/// The Redis keys of `key` under the policy `name`: its one window, each
/// shard's window, or its leases.
fn policy_windows(cfg: &RedisConfig, policies: &[PolicyConfig], name: &str, key: &str) -> Result<Vec<Found>, AdminError> {
    let table = policy_named(policies, name)?;
    let policy = table.get(name.as_bytes()).expect("the table was built from this policy");
    let scoped = scoped_key(name, key);
    let prefix = cfg.key_prefix.as_bytes();
    if let Some(lease_ms) = policy.rule.lease_ms {
        let redis_key = WindowKey { prefix, key: &scoped, window_ms: 0, algorithm: Algorithm::Log }.lease_key();
        return Ok(vec![Found { key: scoped, redis_key, window_ms: lease_ms, counter: Counter::Leases, shard: None }]);
    }
    let window = |k: &[u8], shard| Found {
        key: k.to_vec(),
        redis_key: WindowKey { prefix, key: k, window_ms: policy.rule.window_ms, algorithm: policy.rule.algorithm }.to_vec(),
        window_ms: policy.rule.window_ms,
        counter: Counter::Window(policy.rule.algorithm),
        shard,
    };
    if policy.rule.shards <= 1 {
        return Ok(vec![window(&scoped, None)]);
    }
    Ok((0..policy.rule.shards).map(|i| window(&shard_key(&scoped, i, policy.rule.shards), Some(i))).collect())
}

/// The Redis keys of `target`.
async fn found(conn: &mut LinkConnection, cfg: &RedisConfig, policies: &[PolicyConfig], target: Target<'_>) -> Result<Vec<Found>, AdminError> {
    match target {
        Target::Inline { key, window_ms } => Ok(windows_of(conn, cfg, key, window_ms)
            .await?
            .into_iter()
            .map(|(redis_key, window_ms, a)| Found { key: key.as_bytes().to_vec(), redis_key, window_ms, counter: Counter::Window(a), shard: None })
            .collect()),
        Target::Policy { policy, key } => policy_windows(cfg, policies, policy, key),
    }
}

/// Every window of `target`, as Redis holds it. A policy's windows are all
/// listed, those not in Redis with `ttl_ms` -2.
pub async fn inspect(cfg: &RedisConfig, secrets: &RedisSecrets, policies: &[PolicyConfig], target: Target<'_>) -> Result<Vec<Inspection>, AdminError> {
    if let Target::Policy { policy, .. } = target {
        policy_named(policies, policy)?; // before connecting: a typo is not a Redis problem
    }
    let mut conn = connect(cfg, secrets).await?;
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let now_ms = secs * 1000 + micros / 1000;
    let by_window = matches!(target, Target::Inline { window_ms: Some(_), .. });
    let mut out = Vec::new();
    for Found { redis_key, window_ms: w, counter, shard, .. } in found(&mut conn, cfg, policies, target).await? {
        let algorithm = match counter {
            Counter::Window(a) => a,
            Counter::Leases => {
                let (members, live, ttl_ms): (u64, u64, i64) =
                    redis::pipe().zcard(&redis_key).zcount(&redis_key, format!("({now_ms}"), "+inf").pttl(&redis_key).query_async(&mut conn).await?;
                out.push(Inspection {
                    redis_key: String::from_utf8_lossy(&redis_key).into_owned(),
                    window_ms: w,
                    algorithm: "concurrency",
                    shard,
                    members,
                    in_window: live,
                    oldest_age_ms: None,
                    newest_age_ms: None,
                    ttl_ms,
                });
                continue;
            }
        };
        if algorithm != Algorithm::Log {
            let (bytes, ttl_ms): (Vec<u8>, i64) = redis::pipe().get(&redis_key).pttl(&redis_key).query_async(&mut conn).await?;
            if ttl_ms == -2 && by_window {
                continue; // asked by window: the log's key always, others when they exist
            }
            let mut inspection = match algorithm {
                Algorithm::Gcra => inspect_gcra(redis_key, w, &bytes, now_ms, ttl_ms),
                Algorithm::Fixed | Algorithm::SlidingCounter => inspect_counter(redis_key, w, algorithm, &bytes, ttl_ms),
                Algorithm::Ring | Algorithm::Log => inspect_ring(redis_key, w, &bytes, now_ms, ttl_ms),
            };
            inspection.shard = shard;
            out.push(inspection);
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
            shard,
            members,
            in_window,
            oldest_age_ms: oldest.first().map(|(_, t)| now_ms - t),
            newest_age_ms: newest.first().map(|(_, t)| now_ms - t),
            ttl_ms,
        });
    }
    Ok(out)
}

/// A GCRA key (src/redis/scripts/gcra.lua): the theoretical arrival time in ms
/// (then, on a key a reserve touched, what settles need). `newest_age_ms` is now − TAT: negative while the bucket is
/// not full (by as many ms as it needs to fill); members and in_window are
/// 1 while it is not full, else 0.
fn inspect_gcra(redis_key: Vec<u8>, window_ms: u32, bytes: &[u8], now_ms: i64, ttl_ms: i64) -> Inspection {
    // "<TAT>", or "<TAT> <charged> <born>" once a reserve touched it.
    let tat = std::str::from_utf8(bytes).ok().and_then(|s| s.split(' ').next()?.parse::<f64>().ok()).map(|t| t.ceil() as i64);
    let busy = u64::from(tat.is_some_and(|t| t > now_ms));
    Inspection {
        redis_key: String::from_utf8_lossy(&redis_key).into_owned(),
        window_ms,
        algorithm: Algorithm::Gcra.as_str(),
        shard: None,
        members: busy,
        in_window: busy,
        oldest_age_ms: None,
        newest_age_ms: tat.map(|t| now_ms - t),
        ttl_ms,
    }
}

/// A fixed window or sliding counter ("<window start> <count>[ <previous
/// count>]", src/redis/scripts/fixed_window.lua, sliding_counter.lua): members and
/// in_window are the current fixed window's count.
fn inspect_counter(redis_key: Vec<u8>, window_ms: u32, algorithm: Algorithm, bytes: &[u8], ttl_ms: i64) -> Inspection {
    let count = std::str::from_utf8(bytes).ok().and_then(|s| s.split(' ').nth(1)).and_then(|c| c.parse::<u64>().ok()).unwrap_or(0);
    Inspection {
        redis_key: String::from_utf8_lossy(&redis_key).into_owned(),
        window_ms,
        algorithm: algorithm.as_str(),
        shard: None,
        members: count,
        in_window: count,
        oldest_age_ms: None,
        newest_age_ms: None,
        ttl_ms,
    }
}

/// A ring (src/redis/scripts/ring.lua): an 8-byte header, then slots of 8-byte
/// little-endian doubles, each an admission unit's time in ms (0: empty).
fn inspect_ring(redis_key: Vec<u8>, window_ms: u32, bytes: &[u8], now_ms: i64, ttl_ms: i64) -> Inspection {
    let times: Vec<i64> = bytes.get(8..).unwrap_or_default().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as i64).filter(|&t| t > 0).collect();
    Inspection {
        redis_key: String::from_utf8_lossy(&redis_key).into_owned(),
        window_ms,
        algorithm: Algorithm::Ring.as_str(),
        shard: None,
        members: times.len() as u64,
        in_window: times.iter().filter(|&&t| t > now_ms - i64::from(window_ms)).count() as u64,
        oldest_age_ms: times.iter().min().map(|t| now_ms - t),
        newest_age_ms: times.iter().max().map(|t| now_ms - t),
        ttl_ms,
    }
}

/// The settle records of `window` (its Redis key) outstanding now.
async fn settle_records(conn: &mut LinkConnection, window: &[u8]) -> Result<Vec<Vec<u8>>, AdminError> {
    let mut pattern = crate::redis::glob_escaped(window);
    pattern.extend_from_slice(b":settle:*");
    let mut prefix = window.to_vec();
    prefix.extend_from_slice(b":settle:");
    // The `*` could match a longer window key's records: keep exact ones.
    Ok(scan_slot(conn, window, &pattern).await?.into_iter().filter(|k| k.strip_prefix(&prefix[..]).is_some_and(|h| h.len() == 32 && h.iter().all(u8::is_ascii_hexdigit))).collect())
}

/// Resets a counter window (src/redis/scripts/reset_counter.lua): its records read,
/// the count set, then the records that appeared meanwhile added (a
/// reservation made between the scan and the script would otherwise be
/// forgotten while its holder admits from it). Returns (touched, kept).
async fn reset_counter(conn: &mut LinkConnection, window: &[u8], window_ms: u32, algorithm: Algorithm) -> Result<(u64, u64), AdminError> {
    let layout = if algorithm == Algorithm::SlidingCounter { "s" } else { "f" };
    let run = |records: &[Vec<u8>], pass: &'static str| {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(scripts::RESET_COUNTER).arg(1 + records.len()).arg(window).arg(records).arg(window_ms).arg(layout).arg(pass);
        cmd
    };
    let before = settle_records(conn, window).await?;
    let (touched, mut kept): (u64, u64) = run(&before, "set").query_async(conn).await?;
    let late: Vec<Vec<u8>> = settle_records(conn, window).await?.into_iter().filter(|k| !before.contains(k)).collect();
    if touched > 0 && !late.is_empty() {
        let (_, more): (u64, u64) = run(&late, "add").query_async(conn).await?;
        kept += more;
    }
    Ok((touched, kept))
}

/// What a reset did to one window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetWindow {
    /// The key the daemon decides (a policy's scoped key, or a shard's).
    pub key: Vec<u8>,
    pub redis_key: Vec<u8>,
    pub window_ms: u32,
    /// Whether anything was removed.
    pub removed: bool,
    /// Units of quota leases, worker shares or reservations outstanding,
    /// kept counting (a log window only).
    pub kept_outstanding: u64,
    /// When it ran, on the clock of the Redis holding the window (ms): the
    /// quota leases forget the admissions before it (a log window; 0 for
    /// the others, whose leases carry no Redis time).
    pub at_ms: u64,
}

/// Resets every window of `target` (every shard's of a sharded policy, a
/// concurrency policy's leases): its quota is whole again, less the units
/// outstanding in quota leases, worker shares and reservations (a log
/// window's, src/redis/scripts/reset_log.lua; a fixed window's or sliding counter's,
/// `reset_counter`). A GCRA, ring or concurrency window is deleted (none
/// is leased; a GCRA reservation outstanding settles to nothing).
pub async fn reset(cfg: &RedisConfig, secrets: &RedisSecrets, policies: &[PolicyConfig], target: Target<'_>) -> Result<Vec<ResetWindow>, AdminError> {
    if let Target::Policy { policy, .. } = target {
        policy_named(policies, policy)?;
    }
    let mut conn = connect(cfg, secrets).await?;
    let mut out = Vec::new();
    for Found { key, redis_key, window_ms, counter, .. } in found(&mut conn, cfg, policies, target).await? {
        let (removed, kept_outstanding, at_ms) = match counter {
            Counter::Window(Algorithm::Log) => redis::cmd("EVAL").arg(scripts::RESET_LOG).arg(1).arg(&redis_key).query_async(&mut conn).await?,
            Counter::Window(a @ (Algorithm::Fixed | Algorithm::SlidingCounter)) => {
                let (removed, kept) = reset_counter(&mut conn, &redis_key, window_ms, a).await?;
                (removed, kept, 0)
            }
            _ => (redis::cmd("DEL").arg(&redis_key).query_async(&mut conn).await?, 0, 0),
        };
        if removed > 0 || kept_outstanding > 0 {
            out.push(ResetWindow { key, redis_key, window_ms, removed: removed > 0, kept_outstanding, at_ms });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{encode_policy_request, parse_request, Bounds, FailPolicy, Inbound, PolicyCheckArgs, Request};

    #[test]
    fn a_policys_key_is_the_one_the_daemon_decodes_from_a_frame() {
        let mut frame = bytes::BytesMut::new();
        encode_policy_request(1, &PolicyCheckArgs { policy: b"per_tenant", key: b"tenant-a", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }, &mut frame);
        let body = frame.freeze().slice(4..);
        let Inbound::Request(Request::PolicyCheck(req)) = parse_request(body, &Bounds::default()) else { panic!("not a CHECK_POLICY") };
        assert_eq!(&req.item.scoped_key[..], &scoped_key("per_tenant", "tenant-a")[..]);
    }
}
