//! The shared store: the exact sliding window in Redis.
//!
//! - `connector`: how to open a connection to the master (direct, TLS,
//!   through Sentinel, or a Redis Cluster connection), from `[redis]` and
//!   the resolved secrets;
//! - `sentinel`: master discovery and the `+switch-master` watch, which
//!   tells its owner through a callback;
//! - `link`: the one shared connection, its supervisor and its circuit
//!   breaker, and `eval`, the single entry point every call goes through;
//! - `keys`: a window's Redis key, its Cluster slot, a script's reply as
//!   a verdict;
//! - `scripts`: the Redis scripts' text, assembled at build time from
//!   src/redis/scripts/ (build.rs);
//! - `window`: the scripts' calls (one per algorithm: the log, the ring,
//!   GCRA, the sliding counter, the fixed window), their arguments;
//! - `multi`: several items all or nothing (reservations across Cluster
//!   slots, confirmed or taken back), refunds, and the tasks they leave;
//! - `coalesce`: the windows with a call in flight, and the requests that
//!   queue for their next call;
//! - `shard`: the keys of a hot key's shards, one per range of Cluster slots.

mod coalesce;
mod connector;
mod keys;
mod link;
mod multi;
pub(crate) mod scripts;
mod sentinel;
mod shard;
mod window;

pub use connector::{Connector, ConnectorError, LinkConnection};
pub use shard::shard_key;
pub use multi::{MultiAsk, RefundItem, RefundOutcome, RESERVATION_LIFE};
pub use keys::{glob_escaped, WindowKey};
pub use window::{BatchAsk, LeaseGrant, PenaltyState, RedisWindow, StartError};
