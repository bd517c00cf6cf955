//! The feature matrix under Cluster faults (issue 26, brief item c): random
//! sequences of policy checks, multi-item checks over several slots,
//! refundable checks and refunds, through the real daemon on a real
//! six-node Redis Cluster, with faults injected between operations:
//!
//! - a primary killed (SIGKILL, once its replica has every write) and its
//!   replica promoted (`cluster-require-full-coverage yes`, the default:
//!   every primary answers CLUSTERDOWN until then);
//! - a slot of one of the case's keys moved to another primary (IMPORTING,
//!   MIGRATING, MIGRATE, SETSLOT NODE) while the operations go on, so they
//!   meet `ASK` and `MOVED`;
//! - `SCRIPT FLUSH` on every primary;
//! - a client that sends a multi-item check and closes at once.
//!
//! Every answer cannot be foretold under faults (a call cut by its deadline
//! may still have run; a dropped client's check goes on without it), so the
//! serial model (tests/common/model.rs: its policy tables and items) is kept
//! here as bounds: per window, `lo` units certainly recorded (admissions
//! answered, less refunds answered) and `hi` units maybe recorded (plus
//! atomic one-slot calls that failed, dropped checks, refunds that failed).
//! The invariants that still hold:
//!
//! 1. no over-admission: an admission is answered only if `lo` + cost fits
//!    the limit, and Redis's own record never holds more than the limit;
//! 2. no member left behind: once the reservations' life is over, Redis's
//!    record of every window is within [`lo`, `hi`] (a refused or failed
//!    check over several slots adds nothing to `hi`: its reservations must
//!    be gone by then);
//! 3. no refusal, from Redis or the denial cache (on), while the window had
//!    room: a refusal with `hi` + cost within the limit is a fault, unless
//!    a failed or dropped check over that window may still hold a
//!    reservation (for its life, `R` = 2 s).
//!
//! Environment: `MATRIX_FAULTS_SEED=<n>` one case; `MATRIX_FAULTS_LONG=1`
//! 12 cases of 150 operations (default 4 of 70: about 1.5 min on 2 cores);
//! every seed is printed.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::BytesMut;
use common::model::{Config, Item, Kind, PolicySpec};
use common::redis_cluster::{key_slot, RedisCluster};
use common::rng::Rng;
use common::Daemon;
use ratelimitd::client::Client;
use ratelimitd::protocol::{encode_multi_request, Algorithm, Decision, ErrorCode, FailPolicy, ItemArgs, PolicyCheckArgs, Response, Source, HANDLE_LEN};
use tokio::io::AsyncWriteExt;

const WINDOW_MS: u64 = 3_600_000;
/// A reservation's life (src/redis/multi.rs `RESERVATION_LIFE`), and a
/// margin for the take-backs' retries.
const RESERVATION_LIFE: Duration = Duration::from_secs(2);
const SETTLE: Duration = Duration::from_millis(2600);

/// The case's policies: log, small limits, so refusals are common.
fn draw_config(rng: &mut Rng) -> Config {
    let policies = (0..4)
        .map(|i| PolicySpec {
            name: format!("p{i}"),
            kind: Kind::Rate { algorithm: Algorithm::Log, shards: 1 },
            limit: 2 + rng.below(5) as u32,
            shadow: false,
            overrides: Vec::new(),
            allowlist: Vec::new(),
            fail_policy: None,
            removed: false,
        })
        .collect();
    Config { policies, inline: Vec::new(), inline_leases: Vec::new(), denial_cache: true }
}

/// The window key of `key` under policy `name` (docs/POLICIES.md).
fn redis_key(name: &str, key: &str) -> String {
    format!("ratelimitd:{{{}{name}{key}}}:{WINDOW_MS}ms", name.len() as u8 as char)
}

fn slot_of(name: &str, key: &str) -> u16 {
    key_slot(redis_key(name, key).as_bytes())
}

/// What the model knows of one window.
#[derive(Clone, Copy, Debug, Default)]
struct Bounds {
    lo: u32,
    hi: u32,
    /// A failed or dropped check over several slots may hold a reservation
    /// here until then.
    reserved_until: Option<Instant>,
}

impl Bounds {
    fn may_hold_reservation(&self) -> bool {
        self.reserved_until.is_some_and(|t| Instant::now() < t)
    }
}

type Win = (String, String);

struct Case {
    cfg: Config,
    windows: BTreeMap<Win, Bounds>,
    /// Refundable admissions not refunded yet.
    handles: Vec<([u8; HANDLE_LEN], Vec<Item>)>,
    /// What was seen, for the figures.
    counts: BTreeMap<&'static str, u64>,
    faults: Vec<String>,
}

impl Case {
    fn limit(&self, policy: &str) -> u32 {
        self.cfg.policy(policy).expect("drawn policy").limit
    }

    fn win(&mut self, it: &Item) -> &mut Bounds {
        self.windows.entry((it.policy.clone(), it.key.clone())).or_default()
    }

    fn count(&mut self, what: &'static str) {
        *self.counts.entry(what).or_default() += 1;
    }

    /// Invariant 1 for an admitted item.
    fn admitted(&mut self, it: &Item) -> Result<(), String> {
        let limit = self.limit(&it.policy);
        let w = self.win(it);
        if w.lo + it.cost > limit {
            return Err(format!("over-admission: {}/{} admitted at cost {} with {} certainly recorded, limit {limit}", it.policy, it.key, it.cost, w.lo));
        }
        w.lo += it.cost;
        w.hi += it.cost;
        Ok(())
    }

    /// Invariant 3 for a refusing item.
    fn refused(&mut self, it: &Item, source: Source) -> Result<(), String> {
        let limit = self.limit(&it.policy);
        let w = *self.win(it);
        if w.hi + it.cost <= limit && !w.may_hold_reservation() {
            return Err(format!("refused with room ({source:?}): {}/{} at cost {} with at most {} recorded, limit {limit}", it.policy, it.key, it.cost, w.hi));
        }
        Ok(())
    }

    /// A call that may have recorded `it` (an atomic call that failed).
    fn maybe(&mut self, it: &Item) {
        self.win(it).hi += it.cost;
    }

    /// A check over several slots that failed or was dropped: its
    /// reservations may stand for their life.
    fn may_reserve(&mut self, it: &Item) {
        self.win(it).reserved_until = Some(Instant::now() + RESERVATION_LIFE + Duration::from_millis(300));
    }
}

enum Op {
    Single(Item),
    Multi { items: Vec<Item>, refundable: bool },
    Refund(usize),
    Drop(Vec<Item>),
}

enum Fault {
    Kill,
    Move,
    ScriptFlush,
}

fn draw_item(rng: &mut Rng, cfg: &Config, keys: &[String], taken: &[Item]) -> Item {
    loop {
        let p = &cfg.policies[rng.below(cfg.policies.len() as u64) as usize];
        let key = keys[rng.below(keys.len() as u64) as usize].clone();
        if taken.iter().any(|t| t.policy == p.name && t.key == key) {
            continue;
        }
        let cost = if rng.below(4) == 0 { 2 } else { 1 };
        return Item { policy: p.name.clone(), key, cost };
    }
}

fn draw_op(rng: &mut Rng, case: &Case, keys: &[String]) -> Op {
    let items = |rng: &mut Rng| {
        let n = 2 + rng.below(3) as usize;
        let mut items: Vec<Item> = Vec::new();
        for _ in 0..n {
            let it = draw_item(rng, &case.cfg, keys, &items);
            items.push(it);
        }
        items
    };
    match rng.below(20) {
        0..=5 => Op::Single(draw_item(rng, &case.cfg, keys, &[])),
        6..=14 => Op::Multi { items: items(rng), refundable: rng.below(3) == 0 },
        15..=17 if !case.handles.is_empty() => Op::Refund(rng.below(case.handles.len() as u64) as usize),
        18 => Op::Drop(items(rng)),
        _ => Op::Multi { items: items(rng), refundable: false },
    }
}

fn args(items: &[Item]) -> Vec<ItemArgs<'_>> {
    items.iter().map(|i| ItemArgs { policy: i.policy.as_bytes(), key: i.key.as_bytes(), cost: i.cost }).collect()
}

fn one_slot(items: &[Item]) -> bool {
    items.windows(2).all(|w| slot_of(&w[0].policy, &w[0].key) == slot_of(&w[1].policy, &w[1].key))
}

/// Runs `op` and checks its answer against the bounds.
async fn run_op(c: &mut Client, d: &Daemon, case: &mut Case, op: Op) -> Result<(), String> {
    match op {
        Op::Single(it) => {
            let r = c.check_policy(&PolicyCheckArgs { policy: it.policy.as_bytes(), key: it.key.as_bytes(), cost: it.cost, on_error: FailPolicy::Closed, local_limit: 0 }).await.map_err(|e| e.to_string())?;
            match (r.decision, r.error) {
                (Decision::Allowed, ErrorCode::None) => {
                    case.count("admitted");
                    case.admitted(&it)
                }
                (Decision::Denied, ErrorCode::None) => {
                    case.count(if r.source == Source::DenialCache { "refused_from_cache" } else { "refused" });
                    case.refused(&it, r.source)
                }
                _ => {
                    case.count("failed");
                    case.maybe(&it);
                    Ok(())
                }
            }
        }
        Op::Multi { items, refundable } => {
            let r = c.check_multi(FailPolicy::Closed, 0, refundable, &args(&items)).await.map_err(|e| e.to_string())?;
            multi_answer(case, &items, refundable, &r)
        }
        Op::Refund(i) => {
            let (handle, items) = case.handles.remove(i);
            let r = c.refund(&handle, &args(&items)).await.map_err(|e| e.to_string())?;
            let total: u32 = items.iter().map(|i| i.cost).sum();
            if r.error == ErrorCode::None && r.count == total {
                case.count("refunded");
                for it in &items {
                    let w = case.win(it);
                    w.lo -= it.cost;
                    w.hi -= it.cost;
                }
            } else if r.error == ErrorCode::None {
                return Err(format!("a refund of an admission answered OK with {} of {total} units: {r:?}", r.count));
            } else {
                // Some slots may have taken theirs back.
                case.count("refund_failed");
                for it in &items {
                    case.win(it).lo -= it.cost;
                }
            }
            Ok(())
        }
        Op::Drop(items) => {
            let mut frames = BytesMut::new();
            encode_multi_request(1, FailPolicy::Closed, 0, false, &args(&items), &mut frames);
            let mut s = tokio::net::UnixStream::connect(&d.socket).await.map_err(|e| e.to_string())?;
            s.write_all(&frames).await.map_err(|e| e.to_string())?;
            drop(s);
            case.count("dropped");
            for it in &items {
                case.maybe(it);
                case.may_reserve(it);
            }
            Ok(())
        }
    }
}

fn multi_answer(case: &mut Case, items: &[Item], refundable: bool, r: &Response) -> Result<(), String> {
    match (r.decision, r.error) {
        (Decision::Allowed, ErrorCode::None) => {
            case.count("admitted");
            for it in items {
                case.admitted(it)?;
            }
            if refundable {
                let handle = r.extension.as_ref().and_then(|e| e.handle).ok_or("an admitted refundable check without a handle")?;
                case.handles.push((handle, items.to_vec()));
            }
            Ok(())
        }
        (Decision::Denied, ErrorCode::None) => {
            let ext = r.extension.as_ref().ok_or("a multi-item answer without its extension")?;
            let i = usize::from(ext.refused).checked_sub(1).ok_or_else(|| format!("refused, no refusing item named: {r:?}"))?;
            case.count(if ext.items[i].source == Source::DenialCache { "refused_from_cache" } else { "refused" });
            case.refused(&items[i], ext.items[i].source)
        }
        _ => {
            case.count("failed");
            let atomic = one_slot(items);
            for it in items {
                if atomic {
                    case.maybe(it);
                } else {
                    case.may_reserve(it);
                }
            }
            Ok(())
        }
    }
}

/// Redis's record of a window: the members that count now, on the slot's
/// primary, by its clock.
fn recorded(cluster: &RedisCluster, w: &Win) -> u64 {
    let rk = redis_key(&w.0, &w.1);
    let p = cluster.owner(key_slot(rk.as_bytes()));
    let time = cluster.cli(p, &["TIME"]);
    let mut t = time.lines().map(|l| l.trim().parse::<u64>().unwrap());
    let now_ms = t.next().unwrap() * 1000 + t.next().unwrap() / 1000;
    cluster.cli(p, &["ZCOUNT", &rk, &format!("({}", now_ms - WINDOW_MS), "+inf"]).trim().parse().unwrap()
}

async fn run_case(seed: u64, ops: usize) -> Result<String, String> {
    let mut rng = Rng(seed | 1);
    let cfg = draw_config(&mut rng);
    let cluster = std::sync::Arc::new(std::sync::Mutex::new(RedisCluster::start()));
    let seeds: Vec<String> = cluster.lock().unwrap().seeds().iter().map(|s| format!("\"{s}\"")).collect();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 200\n[denial_cache]\nenabled = true\n{}", seeds.join(", "), cfg.policies_toml()));
    // Keys of the case: six, spread over slots (and so primaries).
    let keys: Vec<String> = (0..6).map(|i| format!("s{seed}k{i}")).collect();
    let mut case = Case { cfg, windows: BTreeMap::new(), handles: Vec::new(), counts: BTreeMap::new(), faults: Vec::new() };
    let mut c = d.client().await;
    let mut killed = false;
    // A slot move runs in a thread of its own, holding the cluster, while
    // the operations go on; it is joined before the next fault.
    let mut mover: Option<std::thread::JoinHandle<()>> = None;
    let t0 = Instant::now();
    for n in 0..ops {
        if rng.below(10) == 0 {
            let fault = match rng.below(4) {
                0 if !killed => Fault::Kill,
                0..=2 => Fault::Move,
                _ => Fault::ScriptFlush,
            };
            if let Some(m) = mover.take() {
                m.join().map_err(|_| "the slot move failed")?;
            }
            let mut cl = cluster.lock().unwrap();
            match fault {
                Fault::Kill => {
                    if !cl.wait_ok(Duration::from_secs(20)) || !cl.wait_replicated(Duration::from_secs(5)) {
                        return Err("the cluster did not settle before a kill".into());
                    }
                    let prim = cl.primaries();
                    let victim = prim[rng.below(prim.len() as u64) as usize];
                    cl.kill(victim);
                    killed = true;
                    case.faults.push(format!("op {n}: killed primary {victim}"));
                }
                Fault::Move => {
                    if !cl.wait_ok(Duration::from_secs(20)) {
                        return Err("the cluster did not settle before a slot move".into());
                    }
                    let it = draw_item(&mut rng, &case.cfg, &keys, &[]);
                    let slot = slot_of(&it.policy, &it.key);
                    let from = cl.owner(slot);
                    let others: Vec<u16> = cl.primaries().into_iter().filter(|&p| p != from).collect();
                    let to = others[rng.below(others.len() as u64) as usize];
                    case.faults.push(format!("op {n}: slot {slot} moving from {from} to {to}"));
                    let moving = cluster.clone();
                    mover = Some(std::thread::spawn(move || moving.lock().unwrap().move_slot(slot, from, to, 300)));
                }
                Fault::ScriptFlush => {
                    for p in cl.primaries() {
                        cl.cli(p, &["SCRIPT", "FLUSH"]);
                    }
                    case.faults.push(format!("op {n}: SCRIPT FLUSH on every primary"));
                }
            }
        }
        let op = draw_op(&mut rng, &case, &keys);
        run_op(&mut c, &d, &mut case, op).await.map_err(|e| format!("op {n}: {e}\nfaults: {:?}\n{}", case.faults, d.log()))?;
    }
    if let Some(m) = mover.take() {
        m.join().map_err(|_| "the slot move failed")?;
    }
    let cluster = std::sync::Arc::try_unwrap(cluster).map_err(|_| "the cluster is still shared")?.into_inner().unwrap();
    if !cluster.wait_ok(Duration::from_secs(20)) {
        return Err("the cluster did not settle at the end".into());
    }
    // Past every reservation's life (and its take-backs' retries).
    tokio::time::sleep(SETTLE).await;
    let mut bad = Vec::new();
    let mut left_behind = 0u64;
    for (w, b) in &case.windows {
        let r = recorded(&cluster, w);
        let limit = u64::from(case.limit(&w.0));
        if r > limit {
            bad.push(format!("{w:?}: Redis holds {r} over the limit {limit}"));
        }
        if r > u64::from(b.hi) {
            left_behind += r - u64::from(b.hi);
            bad.push(format!("{w:?}: Redis holds {r}, at most {} may have been recorded (members left behind)", b.hi));
        }
        if r < u64::from(b.lo) {
            bad.push(format!("{w:?}: Redis holds {r}, {} admissions were answered (lost)", b.lo));
        }
    }
    let summary = format!("seed {seed}: {ops} ops in {:?}, {} windows, {:?}, faults {:?}, members left behind {left_behind}", t0.elapsed(), case.windows.len(), case.counts, case.faults);
    drop(c);
    drop(d);
    drop(cluster);
    if bad.is_empty() {
        Ok(summary)
    } else {
        Err(format!("{summary}\n{}", bad.join("\n")))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_faults_keep_the_serial_models_invariants() {
    let long = std::env::var("MATRIX_FAULTS_LONG").is_ok_and(|v| v == "1");
    let (cases, ops) = if long { (12, 150) } else { (4, 70) };
    let seeds: Vec<u64> = match std::env::var("MATRIX_FAULTS_SEED") {
        Ok(s) => vec![s.parse().expect("MATRIX_FAULTS_SEED is a number")],
        Err(_) => {
            let base = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
            (0..cases).map(|i| base.wrapping_add(i * 7919) % 1_000_000_000_000).collect()
        }
    };
    let mut failed = Vec::new();
    for seed in seeds {
        match run_case(seed, ops).await {
            Ok(summary) => eprintln!("{summary}"),
            Err(e) => {
                eprintln!("FAILED {e}");
                failed.push(seed);
            }
        }
    }
    assert!(failed.is_empty(), "cases failed (MATRIX_FAULTS_SEED=<seed> to replay): {failed:?}");
}
