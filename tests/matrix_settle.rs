//! The feature matrix of reserve and settle (docs/PROTOCOL.md 4f) against
//! the serial model (tests/common/model.rs, `Model::reserve`,
//! `Model::settle`), through the real daemon on one Redis and on the memory
//! backend: random sequences of reserves of one to three policies (GCRA,
//! fixed, sliding counter; shadow; overrides, `unlimited` and allowlisted
//! keys; policies with their own fail policy), settles of each reserve
//! with actuals from -90 % to +300 % of the estimate (replayed, forged and
//! a refundable check's handles too), REFUNDs naming a reserve's items,
//! SETTLEs naming a log policy, reserves naming a sharded, a log, a
//! concurrency or an unknown policy (refused loudly, the whole request),
//! reloads (a limit changed; a policy removed) and, on one Redis, an
//! outage (redis-server killed: the fail policies decide, no handle; a
//! settle answers the Redis error; back empty, nothing is left to
//! settle). Every answer is compared with the model's; at the end the
//! fixed windows and counters in Redis (every primary of a Cluster) hold
//! the model's units.
//!
//! A failing case prints its seed and trace: `SETTLE_MATRIX_SEED=<seed>
//! cargo test --test matrix_settle`.

mod common;

use std::fmt::Write as _;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::model::{short, Clock, Config, Item, Kind, Limit, Model, PolicySpec, Reserved, Scope, Store};
use common::rng::Rng;
use common::redis_cluster::RedisCluster;
use common::{wait_until, Daemon, RedisServer};
use common::clock::to_midnight_ms;
use ratelimitd::client::Client;
use ratelimitd::protocol::{Algorithm, Decision, FailPolicy, ItemArgs, Response, Source, HANDLE_LEN};

fn rate(name: &str, algorithm: Algorithm, limit: u32) -> PolicySpec {
    PolicySpec { name: name.into(), kind: Kind::Rate { algorithm, shards: 1 }, limit, shadow: false, overrides: Vec::new(), allowlist: Vec::new(), fail_policy: None, removed: false }
}

/// The policies every case draws from: the O(1) ones reserves take, and
/// those they refuse (sharded, log, concurrency).
fn config() -> Config {
    let mut g = rate("g", Algorithm::Gcra, 40);
    g.overrides = vec![("vip".into(), Limit::N(70)), ("free".into(), Limit::Unlimited)];
    g.allowlist = vec!["ok".into()];
    let mut f = rate("f", Algorithm::Fixed, 60);
    f.overrides = vec![("vip".into(), Limit::N(90))];
    let c = rate("c", Algorithm::SlidingCounter, 50);
    let mut s = rate("s", Algorithm::Fixed, 30);
    s.shadow = true;
    let mut fo = rate("fo", Algorithm::Fixed, 25);
    fo.fail_policy = Some((FailPolicy::Open, 0));
    let mut fl = rate("fl", Algorithm::Gcra, 35);
    fl.fail_policy = Some((FailPolicy::Local, 6));
    let sh = PolicySpec { kind: Kind::Rate { algorithm: Algorithm::Gcra, shards: 2 }, ..rate("sh", Algorithm::Gcra, 40) };
    let l = rate("l", Algorithm::Log, 10);
    let cc = PolicySpec { kind: Kind::Concurrency, ..rate("cc", Algorithm::Log, 2) };
    Config { policies: vec![g, f, c, s, fo, fl, sh, l, cc], inline: Vec::new(), inline_leases: Vec::new(), denial_cache: true }
}

const O1: [&str; 6] = ["g", "f", "c", "s", "fo", "fl"];
const REFUSED: [&str; 4] = ["sh", "l", "cc", "zz"];
const KEYS: [&str; 5] = ["a", "b", "vip", "free", "ok"];

fn args(items: &[Item]) -> Vec<ItemArgs<'_>> {
    items.iter().map(|i| ItemArgs { policy: i.policy.as_bytes(), key: i.key.as_bytes(), cost: i.cost }).collect()
}

/// A reserve the case holds: the model's record (`None`: the model
/// recorded nothing) and the daemon's handle.
struct Held {
    model: Option<Reserved>,
    handle: Option<[u8; HANDLE_LEN]>,
    items: Vec<Item>,
}

enum Backend {
    Redis(Box<RedisServer>),
    Cluster(Box<RedisCluster>),
    Memory,
}

impl Backend {
    /// Connections to every server that holds windows, each answering
    /// PING (retried for a while: a server restarted by the outage step
    /// may still be starting).
    fn connections(&self) -> Vec<redis::Connection> {
        match self {
            Backend::Redis(r) => vec![answering(&r.url())],
            Backend::Cluster(c) => c.primaries().iter().map(|p| answering(&format!("redis://127.0.0.1:{p}/"))).collect(),
            Backend::Memory => Vec::new(),
        }
    }

    /// After an outage step: the one Redis started again (if it is down)
    /// and answering, so that the next case finds it.
    fn recover(&mut self) {
        if let Backend::Redis(r) = self {
            r.restart();
            drop(answering(&r.url()));
        }
    }
}

/// A connection to `url` that has answered PING; retried for up to 15 s.
fn answering(url: &str) -> redis::Connection {
    let start = Instant::now();
    loop {
        let attempt = redis::Client::open(url).and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2))).and_then(|mut c| {
            let _: String = redis::cmd("PING").query(&mut c)?;
            Ok(c)
        });
        match attempt {
            Ok(c) => return c,
            Err(e) if start.elapsed() > Duration::from_secs(15) => panic!("{url} does not answer PING after 15 s: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn run_case(backend: &mut Backend, seed: u64) -> Result<(), String> {
    let store = match backend {
        Backend::Redis(_) => Store::Redis,
        Backend::Cluster(_) => Store::Cluster,
        Backend::Memory => Store::Memory,
    };
    let mut rng = Rng(seed | 1);
    let mut model = Model::new(store, config());
    for mut c in backend.connections() {
        let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    }
    let redis_toml = match backend {
        Backend::Redis(r) => format!("[redis]\nurl = \"{}\"\ntimeout_ms = 300\n", r.url()),
        Backend::Cluster(c) => {
            let seeds: Vec<String> = c.seeds().iter().map(|s| format!("\"{s}\"")).collect();
            format!("[redis]\ncluster = [{}]\ntimeout_ms = 2000\n", seeds.join(", "))
        }
        Backend::Memory => String::new(),
    };
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n{redis_toml}{}", model.config.policies_toml()));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut trace = format!("seed {seed} on {store:?}\n");
    let mut held: Vec<Held> = Vec::new();
    let mut refund_handle: Option<[u8; HANDLE_LEN]> = None;
    let mut reloads = 0;
    let mut outage_done = store != Store::Redis;
    let start = Instant::now();
    let result = rt.block_on(async {
        let mut c: Client = d.client().await;
        for n in 0..70 {
            let roll = rng.below(100);
            // Outage and recovery (one Redis, once a case).
            if !outage_done && !model.outage && roll < 4 {
                let Backend::Redis(r) = &mut *backend else { unreachable!() };
                r.kill();
                model.outage();
                let _ = writeln!(trace, "{n:3} OUTAGE");
                continue;
            }
            if model.outage && roll < 25 {
                backend.recover();
                model.recover();
                // Redis came back empty: no record is left to settle.
                for h in &mut held {
                    if let Some(m) = &mut h.model {
                        m.settled = true;
                    }
                }
                outage_done = true;
                wait_until("the daemon reaches redis again", Duration::from_secs(15), || {
                    let r = rt_probe(&d);
                    r.decision == Decision::Allowed && r.source == Source::Redis
                });
                let _ = writeln!(trace, "{n:3} RECOVER");
                continue;
            }
            // A reload: a limit changed, or (once) a policy removed.
            if !model.outage && roll >= 97 {
                let what = if rng.below(2) == 0 && model.config.policy("c").is_some() {
                    model.config.policies.iter_mut().find(|p| p.name == "c").unwrap().removed = true;
                    "c removed"
                } else {
                    let p = model.config.policies.iter_mut().find(|p| p.name == "f").unwrap();
                    p.limit = if p.limit == 60 { 45 } else { 60 };
                    "f limit changed"
                };
                let text = d.config_text();
                d.rewrite_config(&format!("{}{}", &text[..text.find("[[policy]]").unwrap()], model.config.policies_toml()));
                reloads += 1;
                d.signal(if what == "c removed" { nix::sys::signal::Signal::SIGUSR1 } else { nix::sys::signal::Signal::SIGHUP });
                wait_until("configuration reloaded", Duration::from_secs(10), || d.log().matches("configuration reloaded").count() >= reloads);
                let _ = writeln!(trace, "{n:3} RELOAD {what}");
                continue;
            }
            let to_midnight_sent_ms = to_midnight_ms();
            let (expect, got, what) = if roll < 45 || held.is_empty() {
                // A reserve of one to three policies, now and then one that cannot compose.
                let k = 1 + rng.below(3) as usize;
                let mut items = Vec::new();
                let key = KEYS[rng.below(KEYS.len() as u64) as usize];
                for _ in 0..k {
                    let policy = if rng.below(12) == 0 { REFUSED[rng.below(4) as usize] } else { O1[rng.below(O1.len() as u64) as usize] };
                    // Mostly one key for every policy (a tenant), sometimes another.
                    let key = if rng.below(4) == 0 { KEYS[rng.below(KEYS.len() as u64) as usize] } else { key };
                    items.push(Item { policy: policy.into(), key: key.into(), cost: 1 + rng.below(20) as u32 });
                }
                let fail = match rng.below(3) {
                    0 => (FailPolicy::Open, 0),
                    1 => (FailPolicy::Closed, 0),
                    _ => (FailPolicy::Local, 8),
                };
                let r = c.reserve_items(fail.0, fail.1, &args(&items)).await.unwrap();
                let clock = Clock { elapsed_ms: start.elapsed().as_millis() as u32, to_midnight_ms: to_midnight_ms(), to_midnight_sent_ms };
                let (expect, reserved) = model.reserve(&items, fail, clock);
                let handle = r.extension.as_ref().and_then(|e| e.handle);
                let what = format!("RESERVE {items:?} {fail:?}");
                if reserved.is_some() || handle.is_some() {
                    held.push(Held { model: reserved, handle, items: items.clone() });
                }
                (expect, r, what)
            } else if roll < 85 {
                // A settle: of a held reserve (maybe again: a replay), with the
                // actual -90 %..+300 % of the first estimate; or forged.
                let forged = rng.below(10) == 0;
                let i = rng.below(held.len() as u64) as usize;
                let actual = (u64::from(held[i].items[0].cost) * (1 + rng.below(40))).div_ceil(10) as u32;
                let items: Vec<Item> = held[i].items.iter().map(|it| Item { cost: actual, ..it.clone() }).collect();
                let handle = if forged { [0x5a; HANDLE_LEN] } else { held[i].handle.unwrap_or([0x5b; HANDLE_LEN]) };
                let r = c.settle_items(&handle, &args(&items)).await.unwrap();
                let reserved = if forged || held[i].handle.is_none() { None } else { held[i].model.as_mut() };
                let expect = model.settle(&items, reserved);
                (expect, r, format!("SETTLE{} {items:?}", if forged { " forged" } else { "" }))
            } else if roll < 90 {
                // A REFUND naming a reserve's items: no refund of an O(1)
                // policy (UNSUPPORTED_COMBINATION), nothing moves.
                let i = rng.below(held.len() as u64) as usize;
                let items = held[i].items.clone();
                let r = c.refund(&held[i].handle.unwrap_or([1; HANDLE_LEN]), &args(&items)).await.unwrap();
                (model.refund(&items, None), r, format!("REFUND of a reserve {items:?}"))
            } else {
                // A refundable check of the log, then a SETTLE of it (the
                // log: refused loudly) or of an O(1) policy with its handle
                // (no record: count 0).
                // After the outage, another key: the daemon's denial cache
                // outlives a Redis restarted empty, and would still refuse
                // a key refused before it (a refusal too many, until the
                // refusal's retry time) where the model's windows start over.
                let lkey = if outage_done && store == Store::Redis { "a-after-outage" } else { "a" };
                let items = vec![Item { policy: "l".into(), key: lkey.into(), cost: 1 }];
                let clock = Clock { elapsed_ms: start.elapsed().as_millis() as u32, to_midnight_ms: to_midnight_ms(), to_midnight_sent_ms };
                let r = c.check_multi(FailPolicy::Closed, 0, true, &args(&items)).await.unwrap();
                let expect = model.check_multi(&items, true, (FailPolicy::Closed, 0), clock);
                expect.check(&r).map_err(|e| format!("{trace}{n:3} CHECK refundable {items:?}\n    got {}\n    {e}", short(&r)))?;
                if let Some(h) = r.extension.as_ref().and_then(|e| e.handle) {
                    refund_handle = Some(h);
                }
                let h = refund_handle.unwrap_or([2; HANDLE_LEN]);
                let items = if rng.below(2) == 0 { items } else { vec![Item { policy: "f".into(), key: "a".into(), cost: 5 }] };
                let r = c.settle_items(&h, &args(&items)).await.unwrap();
                (model.settle(&items, None), r, format!("SETTLE with a refund handle {items:?}"))
            };
            let _ = writeln!(trace, "{n:3} {what}\n    got {}", short(&got));
            if let Err(e) = expect.check(&got) {
                return Err(format!("{trace}    want: {e}\n    ({expect:?})"));
            }
        }
        Ok(())
    });
    if model.outage {
        // The case ended during its outage: the next one needs Redis back.
        backend.recover();
    }
    result?;
    let count = |what: &str| trace.lines().filter(|l| l.contains(what)).count();
    eprintln!(
        "seed {seed} on {store:?}: {} reserves ({} admitted with a handle, {} refused loudly), {} settles ({} matched), {} refunds, {} reloads, outage: {}",
        count(" RESERVE "),
        held.iter().filter(|h| h.handle.is_some()).count(),
        trace.lines().filter(|l| l.contains("got Error Redis Unsupported") || l.contains("got Error None")).count(),
        count(" SETTLE"),
        trace.lines().zip(trace.lines().skip(1)).filter(|(a, b)| a.contains(" SETTLE") && b.contains("got Allowed") && !b.contains("count 0 ")).count(),
        count(" REFUND "),
        reloads,
        trace.contains("OUTAGE"),
    );
    // The fixed windows and counters in Redis hold the model's units.
    let mut conns = backend.connections();
    if !conns.is_empty() {
        if model.outage {
            // Redis came back empty (recover above): nothing to compare.
            return Ok(());
        }
        for ((scope, key), &units) in &model.windows {
            let Scope::Policy(name) = scope else { continue };
            let Some(p) = model.config.any_policy(name) else { continue };
            if !matches!(p.algorithm(), Some(Algorithm::Fixed | Algorithm::SlidingCounter)) {
                continue;
            }
            let pattern = format!("ratelimitd:{{{}{name}{key}}}:*", name.len() as u8 as char);
            let mut stored = 0;
            for c in &mut conns {
                let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg(pattern.as_bytes()).query(c).unwrap();
                if let Some(k) = keys.iter().find(|k| !k.windows(8).any(|w| w == b":settle:")) {
                    let v: String = redis::cmd("GET").arg(k.as_slice()).query(c).unwrap();
                    stored = v.split(' ').nth(1).unwrap().parse().unwrap();
                }
            }
            if stored != units {
                return Err(format!("{trace}--- final state: {name} {key}: Redis holds {stored}, the model {units}"));
            }
        }
    }
    Ok(())
}

/// One CHECK on a key no case uses, on a connection of its own: whether
/// Redis answers again.
fn rt_probe(d: &Daemon) -> Response {
    let socket = d.socket.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let mut c = Client::connect(&socket).await.unwrap();
            let probe = ratelimitd::protocol::CheckArgs { key: b"probe", limit: 1_000_000, window_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
            c.check(&probe).await.unwrap()
        })
    })
    .join()
    .unwrap()
}

fn seeds(base: u64, n: usize) -> Vec<u64> {
    if let Ok(s) = std::env::var("SETTLE_MATRIX_SEED") {
        return vec![s.parse().expect("a seed")];
    }
    let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut r = Rng(base ^ t | 1);
    (0..n).map(|_| r.next() % 1_000_000_000_000).collect()
}

fn run(mut backend: Backend, base: u64) {
    // Day-aligned windows (fixed, sliding counter) must not end mid-case.
    if to_midnight_ms() < 120_000 {
        std::thread::sleep(Duration::from_millis(u64::from(to_midnight_ms()) + 1000));
    }
    for seed in seeds(base, 6) {
        if let Err(e) = run_case(&mut backend, seed) {
            panic!("{e}\nreplay: SETTLE_MATRIX_SEED={seed} cargo test --test matrix_settle");
        }
    }
}

#[test]
fn every_reserve_and_settle_on_one_redis_matches_the_model() {
    run(Backend::Redis(Box::new(RedisServer::start())), 0x5e77_1e01);
}

#[test]
fn every_reserve_and_settle_on_a_cluster_matches_the_model() {
    run(Backend::Cluster(Box::new(RedisCluster::start())), 0x5e77_1e03);
}

#[test]
fn every_reserve_and_settle_in_memory_matches_the_model() {
    run(Backend::Memory, 0x5e77_1e02);
}
