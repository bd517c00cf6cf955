//! Real processes for the integration tests: `redis-server`, Sentinel, the
//! `ratelimitd` binary and nginx, each stopped when dropped, each on an
//! address no other test can take: a Unix socket in a temp dir, or a TCP
//! port confirmed to be served by the very process started (see `ports`).
//!
//! Every integration test file has `mod common;` and uses part of this, so
//! what one file does not use is not dead code.
#![allow(dead_code, unused_imports)]

pub mod admin;
pub mod backend;
pub mod clock;
pub mod daemon;
pub mod http;
pub mod keys;
pub mod model;
pub mod nginx;
pub mod nginx_cases;
pub mod ops;
pub mod ports;
pub mod process;
pub mod rng;
pub mod scripts;
pub mod redis_cluster;
pub mod redis_server;
pub mod repo;
pub mod sentinel;
pub mod tls;
pub mod wait;

pub use daemon::Daemon;
pub use nginx::Nginx;
pub use process::ChildGuard;
pub use redis_server::RedisServer;
pub use sentinel::Sentinel;
pub use tls::Certs;
pub use wait::{wait_until, Deadline};

use ratelimitd::protocol::{CheckArgs, FailPolicy, Source};

/// Check arguments with the defaults most tests use.
pub fn args(key: &str, limit: u32, window_ms: u32) -> CheckArgs<'_> {
    CheckArgs { key: key.as_bytes(), limit, window_ms, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// Redis-backed or in-memory daemon, for cases both backends must pass.
#[allow(clippy::large_enum_variant)] // one per test
pub enum Setup {
    Redis(RedisServer, Daemon),
    Memory(Daemon),
}

impl Setup {
    pub fn redis() -> Self {
        // These cases need no TCP: a Unix socket no other test can reach.
        let r = RedisServer::start_unix();
        // A generous deadline: these tests are about semantics, not latency.
        let d = Daemon::start(Some(&r.url()), "timeout_ms = 500");
        Self::Redis(r, d)
    }

    pub fn memory() -> Self {
        Self::Memory(Daemon::start(None, ""))
    }

    pub fn daemon(&self) -> &Daemon {
        match self {
            Self::Redis(_, d) | Self::Memory(d) => d,
        }
    }

    /// A connection to the Redis of `Setup::redis()`.
    pub fn redis_conn(&self) -> redis::Connection {
        match self {
            Self::Redis(r, _) => r.conn(),
            Self::Memory(_) => panic!("a Setup::memory() has no Redis"),
        }
    }

    pub fn source(&self) -> Source {
        match self {
            Self::Redis(..) => Source::Redis,
            Self::Memory(_) => Source::Memory,
        }
    }
}

/// `[[policy]]` tables of rate policies, one per (name, limit, window),
/// in order: what most tests' configurations start with.
pub fn rate_policies(list: &[(&str, u32, &str)]) -> String {
    list.iter().map(|&(name, limit, window)| rate_policy(name, limit, window, &[])).collect()
}

/// One `[[policy]]` table of a rate policy: its name, limit and window,
/// then the lines `more` (`on_error = "local"`, `shadow = true`, ...).
pub fn rate_policy(name: &str, limit: u32, window: &str, more: &[&str]) -> String {
    let mut table = format!("[[policy]]\nname = \"{name}\"\nlimit = {limit}\nwindow = \"{window}\"\n");
    for line in more {
        table += line;
        table.push('\n');
    }
    table
}

/// One `[[policy]]` table of a concurrency policy: at most `limit` leases
/// held at once, each for at most `lease`.
pub fn concurrency_policy(name: &str, limit: u32, lease: &str) -> String {
    format!("[[policy]]\nname = \"{name}\"\nalgorithm = \"concurrency\"\nlimit = {limit}\nlease = \"{lease}\"\n")
}

/// True when the tests run as root, so nginx workers can run as `nobody`.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The group unprivileged nginx workers run as (Debian: nogroup).
pub const WORKER_GROUP: &str = "nogroup";
