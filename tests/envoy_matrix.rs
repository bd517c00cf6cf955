//! The feature matrix crossed with the Envoy front (docs/ENVOY.md):
//! generated configurations (every algorithm, hot-key shards, shadow,
//! overrides, `unlimited`, the allowlist, the denial cache on or off) and
//! operations on one real daemon and redis-server, each request sent
//! either on the socket (nginx's CHECK_POLICY) or through gRPC (one
//! descriptor, or several all or nothing), with reloads that change
//! limits between them. Every answer is compared with the serial reference
//! model (tests/common/model.rs), the socket's field by field, gRPC's as
//! Envoy reads it: the code of each descriptor and of the whole, the limit
//! shown and what remains; and the same windows serve both fronts.
//!
//! `ENVOY_MATRIX_SEED=<n>` replays one case; `ENVOY_MATRIX_CASES`,
//! `ENVOY_MATRIX_OPS` (default 12 x 80). Seeds are drawn from the clock and
//! printed.

mod common;

use std::fmt::Write as _;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::model::{Clock, Config, Expect, Item, Kind, Limit, Model, Num, PolicySpec, Store, Want, DAY};
use common::rng::Rng;
use common::{Daemon, RedisServer};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{rate_limit_descriptor::Entry, RateLimitDescriptor};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{rate_limit::Unit, Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ratelimitd::protocol::{Algorithm, Decision, FailPolicy, PolicyCheckArgs, Source};
use tonic::transport::Channel;

const KEYS: [&str; 5] = ["a", "b", "k1", "k2", "k3"];

fn to_midnight_ms() -> u32 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    (u64::from(DAY) - now % u64::from(DAY)) as u32
}

fn draw_config(rng: &mut Rng, day_ok: bool) -> Config {
    let algorithms: &[Algorithm] = if day_ok { &[Algorithm::Log, Algorithm::Ring, Algorithm::Gcra, Algorithm::SlidingCounter, Algorithm::Fixed] } else { &[Algorithm::Log, Algorithm::Ring, Algorithm::Gcra] };
    let n = 3 + rng.below(2) as usize;
    let policies = (0..n)
        .map(|i| {
            // p0 and p1 are logs: the all-or-nothing domain always has two.
            let algorithm = if i < 2 { Algorithm::Log } else { algorithms[rng.below(algorithms.len() as u64) as usize] };
            let limit = 2 + rng.below(6) as u32;
            let shards = if algorithm == Algorithm::Log && i > 0 && rng.below(5) == 0 { 3 } else { 1 };
            // Every limit of a sharded policy gives each shard at least 1.
            let mut overrides = vec![("k1".to_string(), Limit::N((1 + rng.below(8) as u32).max(shards)))];
            if rng.below(2) == 0 {
                overrides.push(("k2".into(), Limit::Unlimited));
            }
            let allowlist = if rng.below(2) == 0 { vec!["k3".to_string()] } else { vec![] };
            PolicySpec { name: format!("p{i}"), kind: Kind::Rate { algorithm, shards }, limit: limit.max(shards), shadow: rng.below(5) == 0, overrides, allowlist, fail_policy: None, removed: false }
        })
        .collect();
    Config { policies, inline: Vec::new(), inline_leases: Vec::new(), denial_cache: rng.below(2) == 0 }
}

/// One domain per policy (`d_<name>`, descriptor `[("k", key)]`), and the
/// logs together in domain `multi` (descriptor `[("<name>", key)]`).
fn routes_toml(cfg: &Config) -> String {
    let mut out = String::new();
    for p in &cfg.policies {
        let _ = writeln!(out, "[[envoy.route]]\ndomain = \"d_{0}\"\ndescriptor = [\"k\"]\npolicy = \"{0}\"", p.name);
        if p.algorithm() == Some(Algorithm::Log) {
            let _ = writeln!(out, "[[envoy.route]]\ndomain = \"multi\"\ndescriptor = [\"{0}\"]\npolicy = \"{0}\"", p.name);
        }
    }
    out
}

fn config_text(redis: &RedisServer, cfg: &Config, socket: &std::path::Path) -> String {
    format!(
        "[redis]\nurl = \"{}\"\ntimeout = \"2s\"\n[denial_cache]\nenabled = {}\n[envoy]\nsocket = \"{}\"\non_error = \"closed\"\n{}\n{}",
        redis.url(),
        cfg.denial_cache,
        socket.display(),
        routes_toml(cfg),
        cfg.policies_toml()
    )
}

/// A gRPC channel over the Unix socket at `path`.
async fn channel(path: &std::path::Path) -> Channel {
    ratelimitd::bench::envoy_channel(&ratelimitd::bench::EnvoyTarget::Unix(path.to_owned())).await.unwrap()
}

/// Counted sources: what a client is shown a limit from.
fn counted(w: &Want) -> bool {
    w.sources.iter().all(|s| matches!(s, Source::Redis | Source::DenialCache)) && matches!(w.decision, Decision::Allowed | Decision::Denied)
}

fn unit_of(window_ms: u32) -> i32 {
    (if window_ms == DAY { Unit::Day } else { Unit::Hour }) as i32
}

/// One descriptor's status against the model's verdict on its item.
/// `numbers`: compare what remains (an admitted request's items; a
/// refusal's own numbers may come from the denial cache's remembered one).
fn check_status(w: &Want, s: &DescriptorStatus, numbers: bool) -> Result<(), String> {
    let code = if w.decision == Decision::Denied && w.sources != [Source::None] { Code::OverLimit } else { Code::Ok };
    if s.code != code as i32 {
        return Err(format!("code {:?} (want {code:?})", Code::try_from(s.code)));
    }
    if w.sources == [Source::Exempt] {
        return if s.current_limit.is_none() && s.limit_remaining == u32::MAX { Ok(()) } else { Err(format!("an exempt key shows {s:?}")) };
    }
    if !counted(w) {
        return if s.current_limit.is_none() { Ok(()) } else { Err(format!("nothing counted yet a limit is shown: {s:?}")) };
    }
    let Some(l) = &s.current_limit else { return Err(format!("no limit shown (want {})", w.limit)) };
    if l.requests_per_unit != w.limit || l.unit != unit_of(w.window_ms) {
        return Err(format!("limit {} unit {} (want {} per {})", l.requests_per_unit, l.unit, w.limit, w.window_ms));
    }
    let stale = w.decision == Decision::Denied && w.sources.contains(&Source::DenialCache);
    if let (true, Num::Is(r), false) = (numbers, w.remaining, stale) {
        if s.limit_remaining != r {
            return Err(format!("limit_remaining {} (want {r})", s.limit_remaining));
        }
    }
    if s.duration_until_reset.is_none() {
        return Err("no duration_until_reset".into());
    }
    Ok(())
}

/// A gRPC answer against what the model expects of the same request.
fn check_envoy(want: &Expect, got: &Result<RateLimitResponse, tonic::Status>) -> Result<(), String> {
    let r = match (want, got) {
        (Expect::One(w), Err(e)) if w.decision == Decision::Error => {
            return if matches!(e.code(), tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition) { Ok(()) } else { Err(format!("{e:?} (want the code {})", w.error)) };
        }
        (_, Err(e)) => return Err(format!("a gRPC error {e:?} where the model decides")),
        (Expect::One(w), Ok(_)) if w.decision == Decision::Error => return Err(format!("answered where the model refuses with code {}", w.error)),
        (_, Ok(r)) => r,
    };
    match want {
        Expect::One(w) => {
            let [s] = &r.statuses[..] else { return Err(format!("{} statuses for one descriptor", r.statuses.len())) };
            check_status(w, s, true).map_err(|e| format!("descriptor: {e}"))?;
            if r.overall_code != s.code {
                return Err("overall_code is not the descriptor's".into());
            }
        }
        Expect::Multi(m) => {
            if r.statuses.len() != m.items.len() {
                return Err(format!("{} statuses for {} items", r.statuses.len(), m.items.len()));
            }
            let refused = !m.refusing.is_empty();
            let overall = if refused { Code::OverLimit } else { Code::Ok };
            if r.overall_code != overall as i32 {
                return Err(format!("overall_code {:?} (want {overall:?})", Code::try_from(r.overall_code)));
            }
            if refused && !r.statuses.iter().any(|s| s.code == Code::OverLimit as i32) {
                return Err("refused with no descriptor over its limit".into());
            }
            for (i, (w, s)) in m.items.iter().zip(&r.statuses).enumerate() {
                if refused {
                    // A refused request: which items refused (their numbers
                    // are the socket's, compared there). An item the refusal
                    // left unevaluated (the denial cache answered another
                    // first, a shard untried) shows OK and nothing counted.
                    let over = s.code == Code::OverLimit as i32;
                    let want_over = m.refusing.contains(&(i as u8 + 1));
                    let not_evaluated = !over && s.current_limit.is_none() && s.limit_remaining == 0;
                    if over && !want_over {
                        return Err(format!("item {}: over limit, the model's items that refuse are {:?}", i + 1, m.refusing));
                    }
                    if want_over && !over && !not_evaluated {
                        return Err(format!("item {}: evaluated and not over limit (want over)", i + 1));
                    }
                } else {
                    check_status(w, s, true).map_err(|e| format!("item {}: {e}", i + 1))?;
                }
            }
        }
    }
    Ok(())
}

enum Op {
    Socket(Item),
    Grpc(Item),
    GrpcMulti(Vec<Item>),
    Reload { policy: usize, limit: u32 },
}

fn draw_op(rng: &mut Rng, cfg: &Config) -> Op {
    let p = rng.below(cfg.policies.len() as u64) as usize;
    // A sharded key's items cost 1, as in tests/matrix.rs (the model's
    // numbers for a larger cost depend on which shard has room).
    let item = |rng: &mut Rng, p: usize| {
        let key = KEYS[rng.below(KEYS.len() as u64) as usize].into();
        let cost = if cfg.policies[p].shards() == 1 && rng.below(6) == 0 { 2 } else { 1 };
        Item { policy: cfg.policies[p].name.clone(), key, cost }
    };
    match rng.below(20) {
        0 => {
            // Limits of unsharded logs, fixed windows and sliding counters
            // change both ways, as in tests/matrix.rs.
            let p = &cfg.policies[p];
            let ok = p.shards() == 1 && matches!(p.algorithm(), Some(Algorithm::Log | Algorithm::Fixed | Algorithm::SlidingCounter));
            if ok {
                return Op::Reload { policy: cfg.policies.iter().position(|q| q.name == p.name).unwrap(), limit: 1 + rng.below(8) as u32 };
            }
            Op::Socket(item(rng, 0))
        }
        1..=7 => Op::Socket(item(rng, p)),
        8..=15 => Op::Grpc(item(rng, p)),
        _ => {
            let logs: Vec<usize> = (0..cfg.policies.len()).filter(|&i| cfg.policies[i].algorithm() == Some(Algorithm::Log)).collect();
            let mut items: Vec<Item> = Vec::new();
            for _ in 0..2 + rng.below(2) {
                let which = logs[rng.below(logs.len() as u64) as usize];
                let it = item(rng, which);
                if !items.iter().any(|o| o.policy == it.policy && o.key == it.key) {
                    items.push(it);
                }
            }
            if items.len() < 2 {
                return Op::Grpc(items.remove(0));
            }
            Op::GrpcMulti(items)
        }
    }
}

fn request(domain: String, descriptors: Vec<Vec<(String, String)>>, hits: Vec<u32>) -> RateLimitRequest {
    let descriptors = descriptors
        .into_iter()
        .zip(hits)
        .map(|(d, h)| RateLimitDescriptor { entries: d.into_iter().map(|(key, value)| Entry { key, value }).collect(), hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: u64::from(h) }), ..Default::default() })
        .collect();
    RateLimitRequest { domain, descriptors, hits_addend: 0 }
}

fn run_case(seed: u64, ops: usize, redis: &RedisServer) -> Result<(), String> {
    let day_ok = to_midnight_ms() > 10 * 60 * 1000;
    let mut rng = Rng(seed | 1);
    let mut cfg = draw_config(&mut rng, day_ok);
    let mut model = Model::new(Store::Redis, cfg.clone());
    redis::cmd("FLUSHALL").exec(&mut redis.conn()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("envoy.sock");
    let d = Daemon::start_config(&config_text(redis, &cfg, &socket));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut trace = format!("seed {seed}\n--- configuration\n{}--- operations\n", d.config_text());
    let mut reloads = 0;
    rt.block_on(async {
        let mut sock = d.client().await;
        let mut grpc = RateLimitServiceClient::new(channel(&socket).await);
        let start = Instant::now();
        for n in 0..ops {
            let op = draw_op(&mut rng, &cfg);
            let sent_midnight = to_midnight_ms();
            let clock = |sent| Clock { elapsed_ms: start.elapsed().as_millis() as u32, to_midnight_ms: to_midnight_ms(), to_midnight_sent_ms: sent };
            let result = match &op {
                Op::Reload { policy, limit } => {
                    cfg.policies[*policy].limit = *limit;
                    model.config.policies[*policy].limit = *limit;
                    let text = d.config_text();
                    let head = &text[..text.find("[redis]").unwrap()];
                    d.rewrite_config(&format!("{head}{}", config_text(redis, &cfg, &socket)));
                    reloads += 1;
                    d.signal(nix::sys::signal::Signal::SIGHUP);
                    common::wait_until("configuration reloaded", Duration::from_secs(10), || d.log().matches("configuration reloaded").count() >= reloads);
                    let _ = writeln!(trace, "{n:3} RELOAD {} limit {limit}", cfg.policies[*policy].name);
                    continue;
                }
                Op::Socket(it) => {
                    let r = sock.check_policy(&PolicyCheckArgs { policy: it.policy.as_bytes(), key: it.key.as_bytes(), cost: it.cost, on_error: FailPolicy::Closed, local_limit: 0 }).await.unwrap();
                    let want = model.check_policy(it, (FailPolicy::Closed, 0), clock(sent_midnight));
                    let _ = writeln!(trace, "{n:3} socket {}/{} cost {} -> {:?} {:?} count {} remaining {}", it.policy, it.key, it.cost, r.decision, r.source, r.count, r.remaining);
                    want.check(&r)
                }
                Op::Grpc(it) => {
                    let req = request(format!("d_{}", it.policy), vec![vec![("k".into(), it.key.clone())]], vec![it.cost]);
                    let r = grpc.should_rate_limit(req).await.map(tonic::Response::into_inner);
                    let want = model.check_policy(it, (FailPolicy::Closed, 0), clock(sent_midnight));
                    let _ = writeln!(trace, "{n:3} gRPC {}/{} cost {} -> {}", it.policy, it.key, it.cost, short(&r));
                    check_envoy(&want, &r)
                }
                Op::GrpcMulti(items) => {
                    let req = request("multi".into(), items.iter().map(|it| vec![(it.policy.clone(), it.key.clone())]).collect(), items.iter().map(|it| it.cost).collect());
                    let r = grpc.should_rate_limit(req).await.map(tonic::Response::into_inner);
                    let want = model.check_multi(items, false, (FailPolicy::Closed, 0), clock(sent_midnight));
                    let names: Vec<String> = items.iter().map(|it| format!("{}/{} cost {}", it.policy, it.key, it.cost)).collect();
                    let _ = writeln!(trace, "{n:3} gRPC all or nothing [{}] -> {}", names.join(", "), short(&r));
                    check_envoy(&want, &r)
                }
            };
            if let Err(why) = result {
                return Err(format!("{trace}--- op {n} disagrees with the model: {why}\nreplay: ENVOY_MATRIX_SEED={seed} cargo test --test envoy_matrix\n{}", d.log()));
            }
        }
        Ok(())
    })
}

fn short(r: &Result<RateLimitResponse, tonic::Status>) -> String {
    match r {
        Ok(r) => {
            let s: Vec<String> = r.statuses.iter().map(|s| format!("{:?} {:?} left {}", Code::try_from(s.code).unwrap_or(Code::Unknown), s.current_limit.as_ref().map(|l| l.requests_per_unit), s.limit_remaining)).collect();
            format!("{:?} [{}]", Code::try_from(r.overall_code).unwrap_or(Code::Unknown), s.join("; "))
        }
        Err(e) => format!("error {:?}: {}", e.code(), e.message()),
    }
}

#[test]
fn the_envoy_front_and_the_socket_agree_with_the_model() {
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (cases, ops) = (env("ENVOY_MATRIX_CASES", 12), env("ENVOY_MATRIX_OPS", 80));
    let seeds: Vec<u64> = match std::env::var("ENVOY_MATRIX_SEED") {
        Ok(s) => vec![s.parse().unwrap()],
        Err(_) => {
            let base = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
            (0..cases as u64).map(|i| base.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect()
        }
    };
    let redis = RedisServer::start();
    for seed in seeds {
        println!("envoy matrix: seed {seed}");
        if let Err(e) = run_case(seed, ops, &redis) {
            panic!("{e}");
        }
    }
}
