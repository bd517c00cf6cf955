//! Where the matrices' windows live (tests/matrix.rs, matrix_admin.rs,
//! matrix_leases.rs): one Redis, a Redis Cluster, or the daemon's memory,
//! and what a case needs of it: the `[redis]` lines, a connection to every
//! server and a clean slate.

use super::model::Store;
use super::redis_cluster::RedisCluster;
use super::RedisServer;

/// A backend a matrix runs its cases on.
pub enum Backend {
    Redis(RedisServer),
    Cluster(RedisCluster),
    Memory,
}

impl Backend {
    /// The model's name for it.
    pub fn store(&self) -> Store {
        match self {
            Backend::Redis(_) => Store::Redis,
            Backend::Cluster(_) => Store::Cluster,
            Backend::Memory => Store::Memory,
        }
    }

    /// As a failure message names it.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Redis(_) => "one redis",
            Backend::Cluster(_) => "a cluster",
            Backend::Memory => "memory",
        }
    }

    /// The `[redis]` table's header and where Redis is (its URL, or the
    /// cluster's seeds), for more `[redis]` lines to follow; "" in memory.
    pub fn redis_table(&self) -> String {
        match self {
            Backend::Redis(r) => format!("[redis]\nurl = \"{}\"\n", r.url()),
            Backend::Cluster(c) => {
                let seeds: Vec<String> = c.seeds().iter().map(|s| format!("\"{s}\"")).collect();
                format!("[redis]\ncluster = [{}]\n", seeds.join(", "))
            }
            Backend::Memory => String::new(),
        }
    }

    /// A connection to every server that holds windows, with its port (0:
    /// one Redis on its Unix socket); none in memory.
    pub fn connections(&self) -> Vec<(u16, redis::Connection)> {
        match self {
            Backend::Redis(r) => vec![(0, r.conn())],
            Backend::Cluster(c) => c.primaries().into_iter().map(|p| (p, redis::Client::open(format!("redis://127.0.0.1:{p}/")).and_then(|c| c.get_connection()).unwrap())).collect(),
            Backend::Memory => Vec::new(),
        }
    }

    /// A clean slate for the next case: every server flushed.
    pub fn flush(&self) {
        for (_, mut c) in self.connections() {
            let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
        }
    }
}

/// Checks the key `probe` (a key no case uses) every 20 ms until the
/// daemon's store decides it (Redis or memory, not a fail policy): the
/// checks it took, each a decision the daemon counts. Panics after 15 s
/// with the daemon's log.
pub async fn until_store_answers(c: &mut ratelimitd::client::Client, d: &super::Daemon) -> u64 {
    use ratelimitd::protocol::{CheckArgs, Decision, FailPolicy, Source};
    let probe = CheckArgs { key: b"probe", limit: 1_000_000, window_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
    let deadline = super::Deadline::start("the daemon's store answering", std::time::Duration::from_secs(15));
    let mut checks = 0;
    loop {
        let r = c.check(&probe).await.unwrap();
        checks += 1;
        if r.decision == Decision::Allowed && matches!(r.source, Source::Redis | Source::Memory) {
            return checks;
        }
        deadline.retry_in(std::time::Duration::from_millis(20), || format!("{r:?}\n{}", d.log())).await;
    }
}
