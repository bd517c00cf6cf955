//! Finding the master through Redis Sentinel, and staying off a master
//! that a failover is demoting.
//!
//! On every (re)connect the sentinels are asked for the master's address;
//! the new connection is used only once `ROLE` confirms it is a master (a
//! sentinel's view can lag a failover by a moment).
//!
//! A planned failover (`SENTINEL FAILOVER`) leaves the old master writable
//! until the sentinels convert it, about 10 s after the switch, and the
//! sentinels announce `+switch-master` about a second after the replica was
//! promoted (the leader waits for the replica's `INFO`, polled once a
//! second, to show it promoted): every admission the old master recorded in
//! between is missing from the new master, and was counted twice (issue 33:
//! 7056-7266 admitted at limit 6000). So every sentinel is watched at once
//! (only the leader of a failover announces its steps, and any sentinel may
//! lead), and the first step that names the replica to promote
//! (`+elected-leader`, `+failover-state-select-slave`, `+selected-slave`,
//! sent one sentinel tick, 50-100 ms, before the replica is told `REPLICAOF
//! NO ONE`) *fences* the old master: the link leaves it at once (its
//! requests get their fail policy meanwhile) and connects to no server but
//! the promoted replica, once that replica answers `ROLE` as a master; not
//! to the old master, whatever the sentinels still name. The fence ends at
//! `+switch-master`, when the failover aborts (`-failover-abort-*`), or
//! after `FENCE_LIMIT`. See docs/FAILURES.md for the bound that remains.
//!
//! Replication to the replicas is asynchronous: admissions the old master
//! had not yet replicated when the replica was promoted are lost. See
//! docs/FAILURES.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, ConnectionAddr, RedisConnectionInfo, RedisError};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::config::{HostPort, SentinelConfig};

/// Longest a fence holds without `+switch-master` or an abort heard: a
/// missed announcement (every sentinel connection lost) must not keep the
/// link off Redis for the sentinels' `failover-timeout` (3 min by
/// default). A promotion takes about a second (`tests/sentinel.rs`).
const FENCE_LIMIT: Duration = Duration::from_secs(10);

/// The steps of a failover that fence the old master: sent by the leading
/// sentinel only, in this order; from `+selected-slave` on they name the
/// replica to promote. (`+try-failover` is left out: every sentinel that
/// sees the master down tries, and the losers' tries end in
/// `-failover-abort-not-elected` while the winner goes on. `-role-change`
/// is left out too: it is also sent for the old master still reporting
/// `master` after the switch.)
const FENCING: [&str; 7] = [
    "+elected-leader",
    "+failover-state-select-slave",
    "+selected-slave",
    "+failover-state-send-slaveof-noone",
    "+failover-state-wait-promotion",
    "+promoted-slave",
    "+failover-state-reconf-slaves",
];
/// A failover given up after its replica was chosen: the old master stays.
const ABORTS: [&str; 2] = ["-failover-abort-no-good-slave", "-failover-abort-slave-timeout"];
const SWITCH: &str = "+switch-master";

type Addr = (String, u16);

/// What the sentinels' announcements tell about our master.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// A failover of the master at `old` is under way; `candidate`, once
    /// chosen, is the replica being promoted.
    Fencing { old: Addr, candidate: Option<Addr> },
    /// The failover ended: `new` is the master.
    Switched { new: Addr },
    /// The failover was given up.
    Aborted,
}

/// Reads one announcement of `channel`, if it is about `master_name`.
/// Payloads: `+switch-master`: `<name> <old ip> <old port> <new ip> <new
/// port>`; a master's event: `master <name> <ip> <port>`; a replica's:
/// `slave <ip:port> <ip> <port> @ <name> <master ip> <master port>`.
fn parse_step(channel: &str, payload: &str, master_name: &str) -> Option<Step> {
    let t: Vec<&str> = payload.split_whitespace().collect();
    let addr = |ip: usize, port: usize| -> Option<Addr> { Some((t.get(ip)?.to_string(), t.get(port)?.parse().ok()?)) };
    if channel == SWITCH {
        return (t.first() == Some(&master_name)).then(|| addr(3, 4).map(|new| Step::Switched { new })).flatten();
    }
    let (old, candidate) = match t.first() {
        Some(&"master") if t.get(1) == Some(&master_name) => (addr(2, 3)?, None),
        Some(&"slave") if t.get(4) == Some(&"@") && t.get(5) == Some(&master_name) => (addr(6, 7)?, Some(addr(2, 3)?)),
        _ => return None,
    };
    if ABORTS.contains(&channel) {
        Some(Step::Aborted)
    } else if FENCING.contains(&channel) {
        Some(Step::Fencing { old, candidate })
    } else {
        None
    }
}

/// A failover in progress: the old master is not to be used.
#[derive(Debug)]
struct Fence {
    old: Addr,
    candidate: Option<Addr>,
    since: Instant,
}

/// Shared by the connector and the watch.
#[derive(Debug, Default)]
struct FailoverState {
    /// The server the link last connected to.
    current: Option<Addr>,
    fence: Option<Fence>,
}

/// Where the next connection goes.
enum Target {
    /// Where the sentinels say.
    AskSentinels,
    /// To the replica being promoted (its `ROLE` is checked as always).
    Candidate(Addr),
    /// Nowhere yet: a failover is under way, no replica chosen.
    Wait(Addr),
}

impl FailoverState {
    /// Takes in a step; whether the link must leave its server now.
    fn note(&mut self, step: Step) -> bool {
        match step {
            Step::Fencing { old, candidate } => {
                let (candidate, since) = match self.fence.take() {
                    Some(f) if f.old == old => (candidate.or(f.candidate), f.since),
                    _ => (candidate, Instant::now()),
                };
                let leave = candidate.is_none() || self.current != candidate;
                self.fence = Some(Fence { old, candidate, since });
                leave
            }
            Step::Switched { new } => {
                self.fence = None;
                self.current.as_ref() != Some(&new)
            }
            Step::Aborted => match self.fence.take() {
                // Back to the sentinels' word if the link followed the
                // candidate.
                Some(f) => f.candidate.is_some() && self.current == f.candidate,
                None => false,
            },
        }
    }

    fn target(&mut self) -> Target {
        if self.fence.as_ref().is_some_and(|f| f.since.elapsed() > FENCE_LIMIT) {
            self.fence = None;
        }
        match &self.fence {
            None => Target::AskSentinels,
            Some(Fence { candidate: Some(c), .. }) => Target::Candidate(c.clone()),
            Some(Fence { old, .. }) => Target::Wait(old.clone()),
        }
    }
}

pub struct SentinelConnector {
    client: Mutex<SentinelClient>,
    master_name: String,
    addresses: Vec<HostPort>,
    sentinel_auth: (Option<String>, Option<String>),
    /// The master's credentials, for a connection to a promoted replica.
    master_auth: RedisConnectionInfo,
    failover: Arc<std::sync::Mutex<FailoverState>>,
}

impl SentinelConnector {
    /// `master_auth` is (username, password) for the master itself.
    pub fn new(cfg: &SentinelConfig, master_auth: (Option<String>, Option<String>), sentinel_password: Option<String>) -> Result<Self, RedisError> {
        let addresses = cfg.addresses.clone();
        let addrs = addresses.iter().map(|a| ConnectionAddr::Tcp(a.host.clone(), a.port));
        let mut b = SentinelClientBuilder::new(addrs, &cfg.master_name, SentinelServerType::Master)?
            // Nagle off, as for a direct URL (connector.rs).
            .set_client_to_redis_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
        let mut master_info = RedisConnectionInfo::default();
        if let Some(u) = &master_auth.0 {
            b = b.set_client_to_redis_username(u);
            master_info = master_info.set_username(u);
        }
        if let Some(p) = &master_auth.1 {
            b = b.set_client_to_redis_password(p);
            master_info = master_info.set_password(p);
        }
        if let Some(u) = &cfg.username {
            b = b.set_client_to_sentinel_username(u);
        }
        if let Some(p) = &sentinel_password {
            b = b.set_client_to_sentinel_password(p);
        }
        Ok(Self {
            client: Mutex::new(b.build()?),
            master_name: cfg.master_name.clone(),
            addresses,
            sentinel_auth: (cfg.username.clone(), sentinel_password),
            master_auth: master_info,
            failover: Arc::default(),
        })
    }

    pub fn describe(&self) -> String {
        let list: Vec<String> = self.addresses.iter().map(HostPort::to_string).collect();
        format!("master '{}' via sentinels {}", self.master_name, list.join(","))
    }

    /// Asks the sentinels for the master and connects (the connector then
    /// checks its role: a sentinel's view can lag a failover). While a
    /// failover is fenced: the replica being promoted, or nothing.
    pub async fn connect_master(&self, cfg: &AsyncConnectionConfig) -> Result<MultiplexedConnection, RedisError> {
        let target = self.failover.lock().unwrap_or_else(|e| e.into_inner()).target();
        let client = match target {
            Target::AskSentinels => self.client.lock().await.async_get_client().await?,
            Target::Candidate((host, port)) => {
                let info = redis::IntoConnectionInfo::into_connection_info(ConnectionAddr::Tcp(host, port))?
                    .set_redis_settings(self.master_auth.clone())
                    .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
                redis::Client::open(info)?
            }
            Target::Wait((host, port)) => {
                return Err(RedisError::from(std::io::Error::other(format!(
                    "a failover of '{}' is under way and no replica is chosen yet: the old master {host}:{port} is not used",
                    self.master_name
                ))));
            }
        };
        let conn = client.get_multiplexed_async_connection_with_config(cfg).await?;
        let addr = client.get_connection_info().addr();
        if let ConnectionAddr::Tcp(host, port) = addr {
            self.failover.lock().unwrap_or_else(|e| e.into_inner()).current = Some((host.clone(), *port));
        }
        tracing::info!(master = %addr, name = %self.master_name, "connected to the server the sentinels name as master");
        Ok(conn)
    }

    /// Subscribes on every sentinel at once to the steps of a failover and
    /// calls `on_leave` when the link must leave its server (a failover of
    /// its master began, or ended on another); runs until shutdown, or
    /// until `on_leave` returns false (nobody to tell any more). A sentinel
    /// whose subscription fails is tried again 500 ms later.
    pub async fn watch_failovers(watch: FailoverWatch, on_leave: impl Fn() -> bool, shutdown: CancellationToken) {
        let watch = &watch;
        let on_leave = &on_leave;
        // The link is gone (one watch learnt it): every watch stops.
        let gone = &shutdown.child_token();
        let each = watch.addresses.iter().map(|sentinel| async move {
            loop {
                match watch.one(sentinel, on_leave).await {
                    Ok(false) => return gone.cancel(),
                    Ok(true) => tracing::debug!(%sentinel, "sentinel closed the subscription; subscribing again"),
                    Err(e) => tracing::debug!(%sentinel, error = %e, "sentinel watch ended; subscribing again"),
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        tokio::select! {
            _ = gone.cancelled() => {}
            _ = futures_util::future::join_all(each) => {}
        }
    }

    /// What `watch_failovers` needs, so it can run apart from the connector.
    pub fn failover_watch(&self) -> FailoverWatch {
        FailoverWatch {
            addresses: self.addresses.clone(),
            auth: self.sentinel_auth.clone(),
            master_name: self.master_name.clone(),
            state: self.failover.clone(),
        }
    }
}

/// The sentinels to watch, the master's name, and the state the connector
/// reads.
pub struct FailoverWatch {
    addresses: Vec<HostPort>,
    /// (username, password) for the sentinels.
    auth: (Option<String>, Option<String>),
    master_name: String,
    state: Arc<std::sync::Mutex<FailoverState>>,
}

impl FailoverWatch {
    /// Watches one sentinel until its subscription ends (`Ok(true)`), or
    /// nobody is told any more (`Ok(false)`).
    async fn one(&self, sentinel: &HostPort, on_leave: &impl Fn() -> bool) -> Result<bool, RedisError> {
        let mut info = RedisConnectionInfo::default();
        if let Some(u) = &self.auth.0 {
            info = info.set_username(u);
        }
        if let Some(p) = &self.auth.1 {
            info = info.set_password(p);
        }
        let addr = ConnectionAddr::Tcp(sentinel.host.clone(), sentinel.port);
        let client = redis::Client::open(redis::IntoConnectionInfo::into_connection_info(addr)?.set_redis_settings(info))?;
        let mut pubsub = client.get_async_pubsub().await?;
        let channels: Vec<&str> = FENCING.iter().chain(ABORTS.iter()).chain([SWITCH].iter()).copied().collect();
        pubsub.subscribe(channels).await?;
        tracing::debug!(%sentinel, "watching the steps of a failover");
        let mut messages = pubsub.on_message();
        while let Some(msg) = messages.next().await {
            let payload: String = msg.get_payload().unwrap_or_default();
            let Some(step) = parse_step(msg.get_channel_name(), &payload, &self.master_name) else { continue };
            let (leave, fenced_before, fenced) = {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let before = state.fence.is_some();
                let leave = state.note(step.clone());
                (leave, before, state.fence.is_some())
            };
            // One line per failover and change, however many sentinels repeat it.
            match step {
                Step::Fencing { .. } if !fenced_before => {
                    tracing::warn!(%sentinel, channel = msg.get_channel_name(), %payload, "sentinel announced a failover; leaving the old master, requests follow their fail policy until the promoted replica answers as master")
                }
                Step::Switched { .. } if fenced_before || leave => tracing::warn!(%sentinel, %payload, "sentinel announced a failover; reconnecting to the new master"),
                Step::Aborted if fenced_before && !fenced => tracing::warn!(%sentinel, %payload, "sentinel gave up a failover; back to the master the sentinels name"),
                _ => {}
            }
            if leave && !on_leave() {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(port: u16) -> Addr {
        ("127.0.0.1".into(), port)
    }

    #[test]
    fn steps_are_read_from_the_payloads_sentinel_sends() {
        // Payloads as Redis 7.0's sentinels sent them (tests/sentinel.rs).
        let slave = "slave 127.0.0.1:17602 127.0.0.1 17602 @ mymaster 127.0.0.1 17601";
        assert_eq!(parse_step("+selected-slave", slave, "mymaster"), Some(Step::Fencing { old: a(17601), candidate: Some(a(17602)) }));
        assert_eq!(parse_step("+elected-leader", "master mymaster 127.0.0.1 17601", "mymaster"), Some(Step::Fencing { old: a(17601), candidate: None }));
        assert_eq!(parse_step("+switch-master", "mymaster 127.0.0.1 17601 127.0.0.1 17602", "mymaster"), Some(Step::Switched { new: a(17602) }));
        assert_eq!(parse_step("-failover-abort-slave-timeout", "master mymaster 127.0.0.1 17601", "mymaster"), Some(Step::Aborted));
        assert_eq!(parse_step("+selected-slave", slave, "other"), None);
        assert_eq!(parse_step("+switch-master", "other 127.0.0.1 1 127.0.0.1 2", "mymaster"), None);
        for hostile in ["", "slave", "slave x y z @", "master mymaster 127.0.0.1 notaport", "mymaster 1 2 3"] {
            assert_eq!(parse_step("+selected-slave", hostile, "mymaster"), None, "{hostile:?}");
            let _ = parse_step("+switch-master", hostile, "mymaster");
        }
    }

    #[test]
    fn a_fence_keeps_the_link_off_the_old_master_until_the_switch() {
        let mut s = FailoverState { current: Some(a(1)), fence: None };
        assert!(s.note(Step::Fencing { old: a(1), candidate: None }), "leave the old master at the first step");
        assert!(matches!(s.target(), Target::Wait(_)));
        assert!(s.note(Step::Fencing { old: a(1), candidate: Some(a(2)) }));
        assert!(matches!(s.target(), Target::Candidate(c) if c == a(2)));
        s.current = Some(a(2));
        assert!(!s.note(Step::Fencing { old: a(1), candidate: None }), "a later step keeps the candidate, and the link on it");
        assert!(!s.note(Step::Switched { new: a(2) }), "already on the new master");
        assert!(matches!(s.target(), Target::AskSentinels));
        s.current = Some(a(1));
        assert!(s.note(Step::Switched { new: a(2) }));
    }

    #[test]
    fn an_abort_or_the_limit_ends_a_fence() {
        let mut s = FailoverState { current: Some(a(2)), fence: None };
        s.note(Step::Fencing { old: a(1), candidate: Some(a(2)) });
        assert!(s.note(Step::Aborted), "the link followed the candidate: back to the sentinels' word");
        assert!(matches!(s.target(), Target::AskSentinels));
        s.note(Step::Fencing { old: a(1), candidate: None });
        let fence = s.fence.as_mut().unwrap();
        fence.since = fence.since.checked_sub(FENCE_LIMIT + Duration::from_millis(1)).unwrap_or(fence.since);
        if s.fence.as_ref().is_some_and(|f| f.since.elapsed() > FENCE_LIMIT) {
            assert!(matches!(s.target(), Target::AskSentinels));
        }
    }
}
