//! The overrides in Redis: one hash, `<key_prefix>admin:overrides`, whose
//! fields are scoped keys (length byte, policy name, key) and whose values
//! are JSON (`Stored`). Every write also appends the key to the fleet's
//! change log (`changes`). Every daemon keeps its table in step in the
//! background (`refresh`): each `every` it reads the log entries after the
//! last one it applied and then only the fields they name (HMGET); the
//! whole hash (HGETALL) only when it starts or when its place in the log is
//! gone (it fell more than `changes::MAX_KEPT` changes behind, Redis
//! restarted, a failover lost entries). Building the table, JSON parsing
//! included, runs on a blocking thread, never on the request path's. It
//! drops the entries expired on Redis's clock at each read and wakes at the
//! next expiry if that comes before the next refresh, so an override leaves
//! the table within one Redis round trip of its expiry, and a new one
//! enters within one refresh interval plus a round trip. Expired fields
//! are deleted by a write that finds the hash at the cap.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::changes::{self, Change, Kind, Position, Read, WindowReset, Written};
use crate::admin::{connect, AdminError};
use crate::config::{PolicyLimit, RedisConfig, RedisSecrets, RedisTarget};
use crate::live_overrides::{split_scoped, LiveOverride, LiveOverrides, Table};
use crate::log_limit::RateLimitedLog;
use crate::metrics::METRICS;
use crate::redis::LinkConnection;

/// At most this many overrides are kept (a write beyond it is refused):
/// every daemon reads them all at each refresh.
pub const MAX_OVERRIDES: usize = 10_000;

/// How often a refresher on Sentinel asks the sentinels whether its server
/// is still the master (`changes::sentinels_disagree`), and reconnects to
/// the one they name when not: a planned failover leaves the old master
/// serving stale reads until the sentinels convert it, about 10 s after
/// the switch. A change written on a new master reaches the refresher
/// within this, the sentinels' switch and one refresh.
pub const SENTINEL_CHECK: Duration = Duration::from_secs(1);

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
    // Parsed on a blocking thread: 10,000 records of up to 1.5 KB take
    // tens of ms, not to be spent on the request path's threads. (The
    // closure cannot panic: unparsable records are None.)
    let parsed = tokio::task::spawn_blocking(move || fields.into_iter().map(|(f, v)| (f, serde_json::from_slice(&v).ok())).collect()).await.unwrap_or_default();
    Ok((now, parsed))
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

/// Stores `s` under `scoped` and logs the change for the fleet.
pub async fn put(conn: &mut LinkConnection, key_prefix: &str, scoped: &[u8], s: &Stored) -> Result<Written<()>, redis::RedisError> {
    let value = serde_json::to_vec(s).expect("plain data serializes");
    let _: () = conn.hset(hash_key(key_prefix), scoped, value).await?;
    let logged = changes::append(conn, key_prefix, Kind::Override, scoped).await.map(drop);
    Ok(Written { done: (), logged })
}

/// Deletes `scoped`'s override and logs the change; whether there was one.
/// A retry of a delete whose log failed logs it (there is nothing to
/// delete then, and it says so).
pub async fn delete(conn: &mut LinkConnection, key_prefix: &str, scoped: &[u8]) -> Result<Written<bool>, redis::RedisError> {
    let n: u64 = conn.hdel(hash_key(key_prefix), scoped).await?;
    let logged = changes::append(conn, key_prefix, Kind::Override, scoped).await.map(drop);
    Ok(Written { done: n > 0, logged })
}

/// Deletes the fields of `stored` expired at `now_ms` (and unreadable ones).
pub async fn purge_expired(conn: &mut LinkConnection, key_prefix: &str, now_ms: u64, stored: &[(Vec<u8>, Option<Stored>)]) -> Result<(), redis::RedisError> {
    let dead: Vec<&Vec<u8>> = stored.iter().filter(|(_, s)| s.as_ref().map_or(true, |s| s.expires_at_ms <= now_ms)).map(|(f, _)| f).collect();
    if !dead.is_empty() {
        let _: u64 = conn.hdel(hash_key(key_prefix), dead).await?;
    }
    Ok(())
}

/// The records of `fields` as stored now (None: none or unreadable).
async fn read_fields(conn: &mut LinkConnection, key_prefix: &str, fields: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, redis::RedisError> {
    if fields.is_empty() {
        return Ok(Vec::new());
    }
    let mut cmd = redis::cmd("HMGET");
    cmd.arg(hash_key(key_prefix)).arg(fields);
    cmd.query_async(conn).await
}

/// What one refresh read from Redis.
enum Step {
    /// Nothing changed since the last read.
    Nothing,
    /// The whole hash, read after the position was lost (or first).
    Whole(Vec<(Vec<u8>, Vec<u8>)>),
    /// The overrides that changed, as stored now (None: deleted).
    Changed(Vec<(Vec<u8>, Option<Vec<u8>>)>),
}

/// `table` with `step` applied and the entries expired at `now_ms`
/// dropped: JSON parsing, run on a blocking thread.
fn apply_step(mut table: Table, step: Step, now_ms: u64) -> Table {
    match step {
        Step::Nothing => {}
        Step::Whole(fields) => {
            let stored: Vec<(Vec<u8>, Option<Stored>)> = fields.into_iter().map(|(f, v)| (f, serde_json::from_slice(&v).ok())).collect();
            table = table_at(now_ms, &stored);
        }
        Step::Changed(fields) => {
            for (field, value) in fields {
                let stored = value.and_then(|v| serde_json::from_slice::<Stored>(&v).ok());
                match table_at(now_ms, &[(field.clone(), stored)]).into_iter().next() {
                    Some((k, o)) => {
                        table.insert(k, o);
                    }
                    None => {
                        table.remove(&field[..]);
                    }
                }
            }
        }
    }
    table.retain(|_, o| o.expires_at_ms > now_ms);
    table
}

/// Keeps `live` equal to the overrides in Redis, and the ban cache free of
/// lifted bans, and tells `on_reset` of every window reset, until `token`
/// is cancelled: reads the change log every
/// `every`, and at the next expiry when it is sooner (`changes`). When
/// Redis cannot be read, the table in force is kept, less the entries whose
/// expiry has passed by this host's clock since the last read.
pub async fn refresh(cfg: RedisConfig, secrets: RedisSecrets, live: Arc<LiveOverrides>, on_reset: impl Fn(&WindowReset) + Send + 'static, every: Duration, token: CancellationToken) {
    let failure_log = RateLimitedLog::new(Duration::from_secs(10));
    let mut conn: Option<LinkConnection> = None;
    // Redis's time at the last read, and this host's then.
    let mut last: Option<(u64, Instant)> = None;
    // The last change log entry applied; `None` until the first whole read.
    let mut position: Option<Position> = None;
    // Through Sentinel: the run id of the server connected to, and when
    // the sentinels were last asked about it (`SENTINEL_CHECK`).
    let mut ours = String::new();
    let mut checked = Instant::now();
    loop {
        let read = async {
            if let (RedisTarget::Sentinel(sentinel), Some(_)) = (&cfg.target, &conn) {
                if checked.elapsed() >= SENTINEL_CHECK {
                    checked = Instant::now();
                    if let Some(why) = changes::sentinels_disagree(sentinel, &secrets, &ours).await {
                        tracing::info!(reason = %why, "the admin refresher leaves its server for the master the sentinels name");
                        conn = None;
                    }
                }
            }
            if conn.is_none() {
                let mut c = connect(&cfg, &secrets).await?;
                if matches!(cfg.target, RedisTarget::Sentinel(_)) {
                    ours = changes::run_id(&mut c).await?;
                }
                conn = Some(c);
            }
            let c = conn.as_mut().expect("just connected");
            let mark = live.write_mark();
            let log = changes::read(c, &cfg.key_prefix, position.as_ref()).await?;
            let now = log.now_ms();
            let (step, at) = match log {
                Read::Lost { at, .. } => {
                    // Read after the log's top was taken: nothing written
                    // since is missed (it is read again next time).
                    let fields: Vec<(Vec<u8>, Vec<u8>)> = c.hgetall(hash_key(&cfg.key_prefix)).await?;
                    // Lifts may have been missed: every cached ban goes
                    // (Redis answers them again, once per key).
                    crate::penalty_box::BANS.forget_all();
                    (Step::Whole(fields), at)
                }
                Read::Since { changes, at, .. } => {
                    let mut overridden: Vec<&[u8]> = Vec::new();
                    for Change { kind, scoped } in &changes {
                        match kind {
                            Kind::Lift => {
                                crate::penalty_box::BANS.lift(scoped);
                            }
                            Kind::Override if !overridden.contains(&&scoped[..]) => overridden.push(scoped),
                            Kind::Override => {}
                            // A log lost (above) may have held resets too:
                            // their leases' admissions then count until
                            // their settle (under-admission only).
                            Kind::Reset => {
                                if let Some(r) = WindowReset::parse(scoped) {
                                    on_reset(&r);
                                }
                            }
                        }
                    }
                    let values = read_fields(c, &cfg.key_prefix, &overridden).await?;
                    let changed: Vec<(Vec<u8>, Option<Vec<u8>>)> = overridden.iter().map(|f| f.to_vec()).zip(values).collect();
                    (if changed.is_empty() { Step::Nothing } else { Step::Changed(changed) }, at)
                }
            };
            crate::penalty_box::BANS.sweep();
            super::bans::prune_ended(c, &cfg.key_prefix, now).await?;
            Ok::<_, AdminError>((mark, now, step, at))
        }
        .await;
        let wait = match read {
            Ok((mark, now, step, at)) => {
                position = Some(at);
                let current = live.table();
                // One pass over the table, on this thread: ~10 µs at the cap.
                let expired = current.values().map(|o| o.expires_at_ms).min().is_some_and(|e| e <= now);
                if !matches!(step, Step::Nothing) || expired {
                    let base = Table::clone(&current);
                    match tokio::task::spawn_blocking(move || apply_step(base, step, now)).await {
                        Ok(table) => live.replace_read_after(table, mark),
                        Err(e) => tracing::error!(error = %e, "building the overrides table failed"),
                    }
                }
                METRICS.live_overrides(live.len());
                last = Some((now, Instant::now()));
                let next_expiry = live.table().values().map(|o| o.expires_at_ms).min();
                // Wake at the next expiry (1 ms after: Redis's ms floor) if sooner.
                next_expiry.map_or(every, |e| every.min(Duration::from_millis(e.saturating_sub(now) + 1)))
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
