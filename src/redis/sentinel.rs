//! Finding the master through Redis Sentinel.
//!
//! On every (re)connect the sentinels are asked for the master's address;
//! the new connection is used only once `ROLE` confirms it is a master (a
//! sentinel's view can lag a failover by a moment). A watcher subscribed to
//! `+switch-master` on the sentinels makes the link reconnect as soon as a
//! failover is announced, rather than when the old master starts refusing
//! writes.
//!
//! Replication to the replicas is asynchronous: admissions the old master
//! had not yet replicated are lost at failover, so a few extra requests may
//! pass in the current window. See docs/FAILURES.md.

use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, ConnectionAddr, RedisError};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::config::{HostPort, SentinelConfig};

pub struct SentinelConnector {
    client: Mutex<SentinelClient>,
    master_name: String,
    addresses: Vec<HostPort>,
    sentinel_auth: (Option<String>, Option<String>),
}

impl SentinelConnector {
    /// `master_auth` is (username, password) for the master itself.
    pub fn new(cfg: &SentinelConfig, master_auth: (Option<String>, Option<String>), sentinel_password: Option<String>) -> Result<Self, RedisError> {
        let addresses = cfg.addresses.clone();
        let addrs = addresses.iter().map(|a| ConnectionAddr::Tcp(a.host.clone(), a.port));
        let mut b = SentinelClientBuilder::new(addrs, &cfg.master_name, SentinelServerType::Master)?
            // Nagle off, as for a direct URL (connector.rs).
            .set_client_to_redis_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
        if let Some(u) = &master_auth.0 {
            b = b.set_client_to_redis_username(u);
        }
        if let Some(p) = &master_auth.1 {
            b = b.set_client_to_redis_password(p);
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
        })
    }

    pub fn describe(&self) -> String {
        let list: Vec<String> = self.addresses.iter().map(HostPort::to_string).collect();
        format!("master '{}' via sentinels {}", self.master_name, list.join(","))
    }

    /// Asks the sentinels for the master and connects (the connector then
    /// checks its role: a sentinel's view can lag a failover).
    pub async fn connect_master(&self, cfg: &AsyncConnectionConfig) -> Result<MultiplexedConnection, RedisError> {
        let client = self.client.lock().await.async_get_client().await?;
        let conn = client.get_multiplexed_async_connection_with_config(cfg).await?;
        tracing::info!(master = %client.get_connection_info().addr(), name = %self.master_name, "connected to the server the sentinels name as master");
        Ok(conn)
    }

    /// Subscribes to `+switch-master` on each sentinel in turn and calls
    /// `on_switch` when our master switches; runs until shutdown, or until
    /// `on_switch` returns false (nobody to tell any more).
    pub async fn watch_switches(watch: SwitchWatch, on_switch: impl Fn() -> bool, shutdown: CancellationToken) {
        let SwitchWatch { addresses, auth, master_name } = watch;
        let mut next = 0usize;
        loop {
            let sentinel = &addresses[next % addresses.len()];
            next += 1;
            let mut info = redis::RedisConnectionInfo::default();
            if let Some(u) = &auth.0 {
                info = info.set_username(u);
            }
            if let Some(p) = &auth.1 {
                info = info.set_password(p);
            }
            let addr = ConnectionAddr::Tcp(sentinel.host.clone(), sentinel.port);
            let watch = async {
                let client = redis::Client::open(redis::IntoConnectionInfo::into_connection_info(addr)?.set_redis_settings(info))?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe("+switch-master").await?;
                tracing::debug!(%sentinel, "watching +switch-master");
                let mut messages = pubsub.on_message();
                while let Some(msg) = messages.next().await {
                    let payload: String = msg.get_payload().unwrap_or_default();
                    // "<master name> <old ip> <old port> <new ip> <new port>"
                    if payload.split_whitespace().next() == Some(master_name.as_str()) {
                        tracing::warn!(%payload, "sentinel announced a failover; reconnecting to the new master");
                        if !on_switch() {
                            return Ok(false);
                        }
                    }
                }
                Ok::<_, RedisError>(true)
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = watch => match r {
                    Ok(false) => return,
                    Ok(true) => tracing::debug!(%sentinel, "sentinel closed the subscription; trying the next sentinel"),
                    Err(e) => tracing::debug!(%sentinel, error = %e, "sentinel watch ended; trying the next sentinel"),
                },
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    }

    /// What `watch_switches` needs, so it can run apart from the connector.
    pub fn switch_watch(&self) -> SwitchWatch {
        SwitchWatch { addresses: self.addresses.clone(), auth: self.sentinel_auth.clone(), master_name: self.master_name.clone() }
    }
}

/// The sentinels to watch for `+switch-master`, and the master's name.
pub struct SwitchWatch {
    addresses: Vec<HostPort>,
    /// (username, password) for the sentinels.
    auth: (Option<String>, Option<String>),
    master_name: String,
}
