//! The fleet's log of admin changes, `<key_prefix>admin:log`: every
//! override written or deleted and every ban lifted appends one entry, and
//! every daemon's refresher (`store::refresh`) reads only the entries after
//! the last one it applied, so a refresh with nothing changed costs one
//! small script call, not the whole overrides hash.
//!
//! A ZSET: each entry is a member `<kind><16 hex: a random nonce><scoped
//! key>` scored by its number (the top's + 1); the last `MAX_KEPT` are
//! kept. At score 0 lies the log's epoch marker (`e<nonce>`), created by
//! the writer that finds the log without one (readers write nothing). A reader remembers the last entry it
//! applied, nonce included: that pair cannot repeat, so when the entry is no
//! longer there (trimmed away: the reader fell more than `MAX_KEPT` changes
//! behind; Redis restarted empty; a failover lost it and the numbers were
//! taken again by other entries) the reader knows it may have missed
//! changes, and rereads the whole state (`Read::Lost`) instead of trusting
//! what is left of the log. No change is lost however many come in one
//! refresh, and no number is trusted across a Redis that forgot it.

use std::collections::HashMap;
use std::time::Duration;

use redis::{ConnectionAddr, RedisConnectionInfo};

use crate::config::{RedisConfig, RedisSecrets, RedisTarget, SentinelConfig};
use crate::redis::{scripts, LinkConnection};

/// Entries kept for readers to catch up with: a reader further behind
/// rereads everything. As many as the overrides' cap, so that writing every
/// override once, or lifting as many bans, between two refreshes is still
/// read incrementally.
pub const MAX_KEPT: usize = 10_000;

/// The log of the fleet sharing `key_prefix`.
pub fn log_key(key_prefix: &str) -> String {
    format!("{key_prefix}admin:log")
}

/// What an entry changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An override was written or deleted: the reader reads its record.
    Override,
    /// A ban was lifted: the reader drops it from its ban cache.
    Lift,
    /// A window was reset (`WindowReset`): the reader's caches and quota
    /// leases forget what the reset removed.
    Reset,
}

impl Kind {
    fn byte(self) -> u8 {
        match self {
            Self::Override => b'o',
            Self::Lift => b'l',
            Self::Reset => b'r',
        }
    }
}

const NONCE_LEN: usize = 16;

/// 16 hex digits from the OS's randomness: what makes an entry's identity
/// unrepeatable. Without randomness (never seen), the time and a per-process
/// random hasher's key stand in.
fn nonce() -> [u8; NONCE_LEN] {
    let mut raw = [0u8; 8];
    if getrandom::fill(&mut raw).is_err() {
        use std::hash::BuildHasher;
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        raw = std::hash::RandomState::new().hash_one(t).to_le_bytes();
    }
    let mut out = [0u8; NONCE_LEN];
    for (i, b) in raw.iter().enumerate() {
        out[2 * i] = b"0123456789abcdef"[usize::from(b >> 4)];
        out[2 * i + 1] = b"0123456789abcdef"[usize::from(b & 15)];
    }
    out
}

fn marker() -> Vec<u8> {
    let mut m = vec![b'e'];
    m.extend_from_slice(&nonce());
    m
}





/// Appends `kind`'s change of `scoped` for every reader.
pub async fn append(conn: &mut LinkConnection, key_prefix: &str, kind: Kind, scoped: &[u8]) -> Result<u64, redis::RedisError> {
    let mut entry = Vec::with_capacity(1 + NONCE_LEN + scoped.len());
    entry.push(kind.byte());
    entry.extend_from_slice(&nonce());
    entry.extend_from_slice(scoped);
    redis::cmd("EVAL").arg(scripts::CHANGE_LOG_APPEND).arg(1).arg(log_key(key_prefix)).arg(entry).arg(MAX_KEPT).arg(marker()).query_async(conn).await
}

/// An admin write made in Redis, and whether its change-log entry was
/// written too (the write is complete only then: until its entry is in the
/// log, the other daemons do not apply it).
#[derive(Debug)]
pub struct Written<T> {
    pub done: T,
    pub logged: Result<(), redis::RedisError>,
}

/// Why a write made in Redis is not complete (`Written::logged` failed
/// and retries too).
#[derive(Debug, thiserror::Error)]
#[error("redis: {0}: the change is in Redis, but it could not be logged for the other daemons, which may not apply it until they next reread everything: retry the request (a retry logs it)")]
pub struct NotLogged(pub redis::RedisError);

/// Longest an admin write waits for the master's replicas to acknowledge
/// it (`WAIT`): a hung replica costs each write this much, no more.
pub const ACK_TIMEOUT: Duration = Duration::from_millis(100);

/// Longest a sentinel is given to say what it knows of the master.
const SENTINEL_TIMEOUT: Duration = Duration::from_millis(300);

/// Why a write made on a master is not acknowledged.
#[derive(Debug, thiserror::Error)]
pub enum Unacknowledged {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("the server written to answers ROLE '{0}', not master")]
    NotMaster(String),
    #[error("sentinel {sentinel} reports a failover of the master under way (flags {flags}): the write may be lost with the old master; retry once the failover is over")]
    FailoverUnderWay { sentinel: String, flags: String },
    #[error("sentinel {sentinel} names another master (run id {named}, written to {ours}): the write went to a master being replaced; retry")]
    OtherMaster { sentinel: String, named: String, ours: String },
}

/// Makes sure an admin write made on `conn` is on the current master and
/// will survive a failover, before it is answered 200: a planned `SENTINEL
/// FAILOVER` leaves the old master writable, and writes it took after the
/// replica's promotion were lost (issue 35: 5 of 5 PUTs answered 200).
/// `WAIT` for every replica the master lists, at most `ACK_TIMEOUT` (a
/// hung replica costs that, not more); then, with Sentinel, every sentinel
/// is asked (at once, `SENTINEL_TIMEOUT` each): one that reports a failover
/// under way (unless the server written to is the replica it promoted), or
/// names a master of another run id, makes it unacknowledged.
/// On a Cluster nothing is checked here (redis-rs routes by slot; see
/// docs/ADMIN.md).
pub async fn acknowledge(conn: &mut LinkConnection, cfg: &RedisConfig, secrets: &RedisSecrets) -> Result<(), Unacknowledged> {
    if conn.is_cluster() {
        return Ok(());
    }
    let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(conn).await?;
    let name = match role.first() {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        other => format!("{other:?}"),
    };
    if name != "master" {
        return Err(Unacknowledged::NotMaster(name));
    }
    let replicas = match role.get(2) {
        Some(redis::Value::Array(r)) => r.len(),
        _ => 0,
    };
    if replicas > 0 {
        let _acked: u64 = redis::cmd("WAIT").arg(replicas).arg(ACK_TIMEOUT.as_millis() as u64).query_async(conn).await?;
    }
    let RedisTarget::Sentinel(sentinel) = &cfg.target else { return Ok(()) };
    let ours = run_id(conn).await?;
    match sentinels_disagree(sentinel, secrets, &ours).await {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

/// The run id of the server behind `conn` (`INFO server`).
pub async fn run_id(conn: &mut LinkConnection) -> Result<String, redis::RedisError> {
    let info: String = redis::cmd("INFO").arg("server").query_async(conn).await?;
    Ok(info.lines().find_map(|l| l.strip_prefix("run_id:")).unwrap_or("").trim().to_string())
}

/// Whether a sentinel says the server of run id `ours` is not (or soon no
/// longer) the master: one reports a failover under way (unless `ours` is
/// the replica it promoted) or names a master of another run id. Every
/// sentinel is asked at once, `SENTINEL_TIMEOUT` each; one that cannot be
/// asked says nothing (it may be down). No log line: the refresher asks
/// this every `store::SENTINEL_CHECK`.
pub async fn sentinels_disagree(sentinel: &SentinelConfig, secrets: &RedisSecrets, ours: &str) -> Option<Unacknowledged> {
    let asks = sentinel.addresses.iter().map(|addr| async move {
        let ask = async {
            let mut info = RedisConnectionInfo::default();
            if let Some(u) = &sentinel.username {
                info = info.set_username(u);
            }
            if let Some(p) = &secrets.sentinel_password {
                info = info.set_password(p);
            }
            let client = redis::Client::open(redis::IntoConnectionInfo::into_connection_info(ConnectionAddr::Tcp(addr.host.clone(), addr.port))?.set_redis_settings(info))?;
            let mut c = client.get_multiplexed_async_connection().await?;
            let fields: HashMap<String, String> = redis::cmd("SENTINEL").arg("MASTER").arg(&sentinel.master_name).query_async(&mut c).await?;
            // During a failover: the replica it promoted (written to it is
            // written to the new master, while the leader still
            // reconfigures the other replicas, for seconds).
            let mut promoted = None;
            if fields.get("flags").is_some_and(|f| f.contains("failover_in_progress")) {
                let replicas: Vec<HashMap<String, String>> = redis::cmd("SENTINEL").arg("REPLICAS").arg(&sentinel.master_name).query_async(&mut c).await?;
                promoted = replicas.into_iter().find(|r| r.get("flags").is_some_and(|f| f.split(',').any(|f| f == "promoted"))).and_then(|r| r.get("runid").cloned());
            }
            Ok::<_, redis::RedisError>((fields, promoted))
        };
        (addr.to_string(), tokio::time::timeout(SENTINEL_TIMEOUT, ask).await)
    });
    for (sentinel, answer) in futures_util::future::join_all(asks).await {
        let Ok(Ok((fields, promoted))) = answer else { continue };
        let flags = fields.get("flags").cloned().unwrap_or_default();
        if flags.contains("failover_in_progress") {
            if promoted.is_some_and(|p| !ours.is_empty() && p == ours) {
                continue;
            }
            return Some(Unacknowledged::FailoverUnderWay { sentinel, flags });
        }
        let named = fields.get("runid").cloned().unwrap_or_default();
        if !named.is_empty() && !ours.is_empty() && named != ours {
            return Some(Unacknowledged::OtherMaster { sentinel, named, ours: ours.to_string() });
        }
    }
    None
}

/// Where a reader stands: the last entry it applied, by number and whole
/// (its nonce makes the pair an identity no later entry repeats).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Position {
    seq: u64,
    entry: Vec<u8>,
}

/// One change read from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub kind: Kind,
    pub scoped: Vec<u8>,
}

/// What a reader learns.
#[derive(Debug)]
pub enum Read {
    /// Every change after the reader's position, in order, and the position
    /// after them.
    Since { now_ms: u64, changes: Vec<Change>, at: Position },
    /// The reader's position is no longer in the log (or it had none): it
    /// must reread the whole state, read after this answer, and then stand
    /// at `at`.
    Lost { now_ms: u64, at: Position },
}

impl Read {
    pub fn now_ms(&self) -> u64 {
        match self {
            Self::Since { now_ms, .. } | Self::Lost { now_ms, .. } => *now_ms,
        }
    }
}

fn change(entry: &[u8]) -> Option<Change> {
    let (&kind, rest) = entry.split_first()?;
    let kind = match kind {
        b'o' => Kind::Override,
        b'l' => Kind::Lift,
        b'r' => Kind::Reset,
        _ => return None,
    };
    Some(Change { kind, scoped: rest.get(NONCE_LEN..)?.to_vec() })
}

/// An admin reset of one window, as a `Kind::Reset` entry carries it:
/// `<window_ms>:<at_ms>:<key>` (decimal; the key last, any bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowReset {
    /// The key the daemon decides (`admin::ResetWindow::key`).
    pub key: Vec<u8>,
    pub window_ms: u32,
    /// When it ran on the window's Redis clock; 0: unknown.
    pub at_ms: u64,
}

impl WindowReset {
    fn entry(&self) -> Vec<u8> {
        let mut e = format!("{}:{}:", self.window_ms, self.at_ms).into_bytes();
        e.extend_from_slice(&self.key);
        e
    }

    /// The reset a `Kind::Reset` change's `scoped` carries; None for an
    /// entry this daemon cannot read (ignored, as an unknown kind is).
    pub fn parse(scoped: &[u8]) -> Option<Self> {
        let mut parts = scoped.splitn(3, |&b| b == b':');
        let mut number = || std::str::from_utf8(parts.next()?).ok()?.parse::<u64>().ok();
        let (window_ms, at_ms) = (u32::try_from(number()?).ok()?, number()?);
        Some(Self { key: parts.next()?.to_vec(), window_ms, at_ms })
    }
}

/// Tells every daemon of the resets in `windows` (one entry each), so that
/// they drop the admissions the reset removed from their caches and quota
/// leases (the daemon that made it was told at once).
pub async fn announce_resets(cfg: &RedisConfig, secrets: &RedisSecrets, windows: &[crate::admin::ResetWindow]) -> Result<(), crate::admin::AdminError> {
    if windows.is_empty() {
        return Ok(());
    }
    let mut conn = crate::admin::connect(cfg, secrets).await?;
    for w in windows {
        let reset = WindowReset { key: w.key.clone(), window_ms: w.window_ms, at_ms: w.at_ms };
        append(&mut conn, &cfg.key_prefix, Kind::Reset, &reset.entry()).await?;
    }
    Ok(())
}

/// The changes after `from` (`None`: a reader that knows nothing yet).
pub async fn read(conn: &mut LinkConnection, key_prefix: &str, from: Option<&Position>) -> Result<Read, redis::RedisError> {
    let (seq, entry) = from.map_or((0, &[][..]), |p| (p.seq, &p.entry[..]));
    let known = if from.is_some() { "1" } else { "0" };
    // EVAL, not EVALSHA: the request path's scripts are the EVALSHA calls
    // in Redis's commandstats, and the refreshers' reads stay apart from
    // them (the cost: the script's 600 bytes sent once a refresh).
    let (now_ms, found, entries): (u64, u8, Vec<(Vec<u8>, u64)>) = redis::cmd("EVAL").arg(scripts::CHANGE_LOG_READ).arg(1).arg(log_key(key_prefix)).arg(seq).arg(entry).arg(known).query_async(conn).await?;
    if found == 0 {
        // No top: there is no log (yet, or any more).
        let (entry, seq) = entries.into_iter().next_back().unwrap_or_default();
        return Ok(Read::Lost { now_ms, at: Position { seq, entry } });
    }
    let at = entries.last().map_or_else(|| Position { seq, entry: entry.to_vec() }, |(e, s)| Position { seq: *s, entry: e.clone() });
    Ok(Read::Since { now_ms, changes: entries.iter().filter_map(|(e, _)| change(e)).collect(), at })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_as_its_change_and_nonces_differ() {
        let mut e = vec![b'l'];
        e.extend_from_slice(&nonce());
        e.extend_from_slice(b"\x05loginu1");
        assert_eq!(change(&e), Some(Change { kind: Kind::Lift, scoped: b"\x05loginu1".to_vec() }));
        assert_eq!(change(b"e0123456789abcdef"), None, "the epoch marker is no change");
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn a_reset_entry_reads_back_whatever_its_key_holds() {
        let r = WindowReset { key: b"\x05login:a:b\x00\xff".to_vec(), window_ms: 60_000, at_ms: 1_765_000_000_123 };
        let mut e = vec![b'r'];
        e.extend_from_slice(&nonce());
        e.extend_from_slice(&r.entry());
        let c = change(&e).expect("a reset");
        assert_eq!(c.kind, Kind::Reset);
        assert_eq!(WindowReset::parse(&c.scoped), Some(r));
        for bad in [&b"60000:12"[..], b"x:1:k", b"4294967296:1:k", b""] {
            assert_eq!(WindowReset::parse(bad), None, "{bad:?}");
        }
    }
}
