//! Several limits in one request, all or nothing, and refunds
//! (docs/PROTOCOL.md 4b, 4c; docs/POLICIES.md): the real daemon against a
//! serial reference model, with a real redis-server and with the in-memory
//! backend; the fail policies of a multi-item check with Redis unreachable.

mod common;

use std::collections::HashMap;

use common::rng::Rng;
use common::{Daemon, RedisServer};
use ratelimitd::protocol::{Decision, ErrorCode, FailPolicy, ItemArgs, Response, Source, HANDLE_LEN};

fn policies() -> String {
    use common::rate_policy;
    [
        rate_policy("ip", 5, "60s", &[]),
        rate_policy("tenant", 8, "60s", &["[policy.overrides]", r#""premium" = 12"#, r#""free" = "unlimited""#]),
        rate_policy("global", 20, "60s", &[]),
        rate_policy("shadow", 3, "60s", &["shadow = true"]),
    ]
    .concat()
}

const NAMES: [&str; 4] = ["ip", "tenant", "global", "shadow"];
const KEYS: [&str; 4] = ["a", "b", "premium", "free"];

/// 1 to `most` distinct items (policy, key, cost): a policy among the
/// first `policies` of NAMES, a key among the first `keys` of KEYS, a cost
/// of 1 to `max_cost`.
fn draw_items(rng: &mut Rng, most: u64, policies: u64, keys: u64, max_cost: u64) -> Vec<(usize, usize, u32)> {
    let n = 1 + rng.below(most) as usize;
    let mut items: Vec<(usize, usize, u32)> = Vec::new();
    while items.len() < n {
        let (p, k) = (rng.below(policies) as usize, rng.below(keys) as usize);
        if !items.iter().any(|&(q, j, _)| (q, j) == (p, k)) {
            items.push((p, k, 1 + rng.below(max_cost) as u32));
        }
    }
    items
}

/// The serial reference: admissions per (policy, key); the windows (60 s)
/// outlast the run, so nothing expires.
#[derive(Default)]
struct Model {
    counts: HashMap<(usize, usize), u32>,
}

impl Model {
    /// The key's limit under the policy; `None`: unlimited.
    fn limit(p: usize, k: usize) -> Option<u32> {
        match (NAMES[p], KEYS[k]) {
            ("tenant", "premium") => Some(12),
            ("tenant", "free") => None,
            ("ip", _) => Some(5),
            ("tenant", _) => Some(8),
            ("global", _) => Some(20),
            _ => Some(3),
        }
    }
}

/// One expected item: fits, count and remaining after the request.
struct Expect {
    exempt: bool,
    fits: bool,
    count: u32,
    remaining: u32,
}

struct Issued {
    handle: [u8; HANDLE_LEN],
    items: Vec<(usize, usize, u32)>,
    /// The costs recorded per item (0: not recorded).
    recorded: Vec<u32>,
    refunded: bool,
}

fn run_against_model(redis: bool, seed: u64, ops: usize) {
    let server = redis.then(RedisServer::start_unix);
    let d = match &server {
        Some(r) => Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 1000\n{}", r.url(), policies())),
        None => Daemon::start_config(&format!("socket_mode = \"0600\"\n{}", policies())),
    };
    let store_source = if redis { Source::Redis } else { Source::Memory };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = d.client().await;
        let mut rng = Rng(seed);
        let mut model = Model::default();
        let mut issued: Vec<Issued> = Vec::new();
        let mut mismatches = Vec::new();
        let (mut admitted, mut refused, mut refunds) = (0, 0, 0);
        for op in 0..ops {
            if redis && !issued.is_empty() && rng.below(5) == 0 {
                // A refund of an earlier admission, maybe one already refunded.
                let i = rng.below(issued.len() as u64) as usize;
                let h = &mut issued[i];
                let handle = h.handle;
                let items: Vec<ItemArgs<'_>> = h.items.iter().map(|&(p, k, cost)| ItemArgs { policy: NAMES[p].as_bytes(), key: KEYS[k].as_bytes(), cost }).collect();
                let r = c.refund(&handle, &items).await.unwrap();
                let want: u32 = if h.refunded { 0 } else { h.recorded.iter().sum() };
                if !h.refunded {
                    for (&(p, k, _), &cost) in h.items.iter().zip(&h.recorded) {
                        *model.counts.entry((p, k)).or_default() -= cost;
                    }
                    h.refunded = true;
                    refunds += 1;
                }
                if (r.decision, r.error, r.count) != (Decision::Allowed, ErrorCode::None, want) {
                    mismatches.push(format!("op {op}: refund of #{i}: want {want} removed, got {r:?}"));
                }
                continue;
            }
            // 1 to 4 distinct items.
            let items = draw_items(&mut rng, 4, 4, 4, 3);
            let n = items.len();
            let refundable = redis && rng.below(2) == 0;
            // What the serial model decides.
            let mut expect: Vec<Expect> = items
                .iter()
                .map(|&(p, k, cost)| {
                    let count = model.counts.get(&(p, k)).copied().unwrap_or(0);
                    match Model::limit(p, k) {
                        None => Expect { exempt: true, fits: true, count: 0, remaining: 0 },
                        Some(l) => Expect { exempt: false, fits: count + cost <= l, count, remaining: l.saturating_sub(count) },
                    }
                })
                .collect();
            let committed = items.iter().zip(&expect).all(|(&(p, _, _), e)| e.fits || NAMES[p] == "shadow");
            let refused_at = items.iter().zip(&expect).position(|(&(p, _, _), e)| !e.fits && NAMES[p] != "shadow").map_or(0, |i| i + 1);
            let mut recorded = vec![0; n];
            if committed {
                for (i, (&(p, k, cost), e)) in items.iter().zip(expect.iter_mut()).enumerate() {
                    if e.fits && !e.exempt {
                        let l = Model::limit(p, k).unwrap();
                        *model.counts.entry((p, k)).or_default() += cost;
                        e.count += cost;
                        e.remaining = l - e.count;
                        recorded[i] = cost;
                    }
                }
            }
            let args: Vec<ItemArgs<'_>> = items.iter().map(|&(p, k, cost)| ItemArgs { policy: NAMES[p].as_bytes(), key: KEYS[k].as_bytes(), cost }).collect();
            let r = c.check_multi(FailPolicy::Closed, 0, refundable, &args).await.unwrap();
            let want_decision = if committed { Decision::Allowed } else { Decision::Denied };
            if committed {
                admitted += 1;
            } else {
                refused += 1;
            }
            let mut bad = |what: String| mismatches.push(format!("op {op} {items:?} refundable={refundable}: {what}; response {r:?}"));
            if n == 1 && !refundable {
                // The single-item frame: the fast path, no extension.
                let e = &expect[0];
                let shadow = NAMES[items[0].0] == "shadow";
                let want = match (e.exempt, e.fits, shadow) {
                    (true, _, true) => (Decision::ShadowAllowed, Source::Exempt),
                    (true, ..) => (Decision::Allowed, Source::Exempt),
                    (_, true, true) => (Decision::ShadowAllowed, store_source),
                    (_, true, false) => (Decision::Allowed, store_source),
                    (_, false, true) => (Decision::ShadowDenied, r.source),
                    (_, false, false) => (Decision::Denied, r.source),
                };
                if (r.decision, r.source) != want || r.extension.is_some() {
                    bad(format!("want {want:?}"));
                } else if r.source == store_source && (r.count, r.remaining) != (e.count, e.remaining) {
                    bad(format!("want count {} remaining {}", e.count, e.remaining));
                } else if r.source == Source::DenialCache && e.fits {
                    bad("a cached refusal of a request that fits".into());
                }
                continue;
            }
            let Some(ext) = r.extension.as_deref() else {
                bad("no extension".into());
                continue;
            };
            // Redis names the first item that refused; the denial cache the
            // first it finds refused, which must be one that refuses.
            let refused_ok = match (usize::from(ext.refused), r.source) {
                (i, Source::DenialCache) if i > 0 && i <= n => !expect[i - 1].fits && NAMES[items[i - 1].0] != "shadow",
                (i, _) => i == refused_at,
            };
            if r.decision != want_decision || !refused_ok || ext.items.len() != n {
                bad(format!("want {want_decision:?}, refused item {refused_at}"));
                continue;
            }
            let stored = expect.iter().any(|e| !e.exempt);
            if ext.handle.is_some() != (committed && refundable && stored) {
                bad("a handle iff admitted, refundable and a store was asked".into());
            }
            for (i, (got, e)) in ext.items.iter().zip(&expect).enumerate() {
                let shadow = NAMES[items[i].0] == "shadow";
                let ok = match got.source {
                    Source::Exempt => e.exempt && got.decision == if shadow { Decision::ShadowAllowed } else { Decision::Allowed },
                    s if s == store_source => {
                        let want = match (e.fits, shadow) {
                            (true, false) => Decision::Allowed,
                            (true, true) => Decision::ShadowAllowed,
                            (false, true) => Decision::ShadowDenied,
                            (false, false) => Decision::Denied,
                        };
                        got.decision == want && (got.count, got.remaining) == (e.count, e.remaining)
                    }
                    // Exact: the cache refuses only what Redis would.
                    Source::DenialCache => !e.fits && !committed && got.decision == Decision::Denied,
                    // Not evaluated: another item's cached refusal decided.
                    Source::None => !committed && got.decision == Decision::Denied,
                    _ => false,
                };
                if !ok {
                    bad(format!("item {i}: want fits={} count={} remaining={} exempt={}", e.fits, e.count, e.remaining, e.exempt));
                }
            }
            if let (true, Some(h)) = (refundable, ext.handle) {
                issued.push(Issued { handle: h, items: items.clone(), recorded, refunded: false });
            }
        }
        assert!(mismatches.is_empty(), "seed {seed}: {} mismatches with the serial model:\n{}", mismatches.len(), mismatches.join("\n"));
        assert!(admitted > ops / 10 && refused > ops / 10, "the run must exercise both outcomes: {admitted} admitted, {refused} refused");
        if redis {
            assert!(refunds > ops / 40, "{refunds} refunds");
        }
        // The windows hold what the model says: nothing more was recorded.
        if let Some(server) = &server {
            let mut conn = server.conn();
            for ((p, k), count) in &model.counts {
                let key = format!("ratelimitd:{{{}{}{}}}:60000ms", NAMES[*p].len() as u8 as char, NAMES[*p], KEYS[*k]);
                let members: u32 = redis::Commands::zcard(&mut conn, key.as_bytes()).unwrap();
                assert_eq!(members, *count, "seed {seed}: window of {}/{}", NAMES[*p], KEYS[*k]);
            }
        }
    });
}

#[test]
fn multi_item_checks_and_refunds_match_a_serial_model_with_redis() {
    for seed in [0x9e37_79b9_7f4a_7c15, 0x1234_5678_9abc_def1, 42] {
        run_against_model(true, seed, 600);
    }
}

#[test]
fn multi_item_checks_match_a_serial_model_in_memory() {
    run_against_model(false, 7, 600);
}

fn first(r: &Response) -> (Decision, Source) {
    let e = r.extension.as_deref().expect("an extension");
    (e.items[0].decision, e.items[0].source)
}

/// Redis unreachable (the breaker starts open): each item's fail policy
/// decides, all or nothing; nothing is refundable.
#[test]
fn fail_policies_decide_multi_item_checks_all_or_nothing() {
    let nowhere = tempfile::tempdir().unwrap();
    let policies = format!("{}\n[[policy]]\nname = \"strict\"\nlimit = 5\nwindow = \"60s\"\nfail_policy = \"closed\"\n", policies());
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"redis+unix://{}/none.sock\"\ntimeout_ms = 50\n{policies}", nowhere.path().display()));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = d.client().await;
        let ip = ItemArgs { policy: b"ip", key: b"a", cost: 1 };
        let tenant = ItemArgs { policy: b"tenant", key: b"a", cost: 1 };
        let strict = ItemArgs { policy: b"strict", key: b"a", cost: 1 };
        // open: admitted, nothing to refund.
        let r = c.check_multi(FailPolicy::Open, 0, true, &[ip, tenant]).await.unwrap();
        assert_eq!((r.decision, r.error, first(&r)), (Decision::Allowed, ErrorCode::CircuitOpen, (Decision::Allowed, Source::FailOpen)));
        assert!(r.extension.as_deref().unwrap().handle.is_none(), "nothing was recorded in Redis");
        // A policy's own fail policy (closed) refuses the whole request.
        let r = c.check_multi(FailPolicy::Open, 0, false, &[ip, strict]).await.unwrap();
        assert_eq!((r.decision, r.source, r.extension.as_deref().unwrap().refused), (Decision::Denied, Source::FailClosed, 2));
        // local: the per-host windows, all or nothing, with the local quota.
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(c.check_multi(FailPolicy::Local, 2, false, &[ip, tenant]).await.unwrap().decision);
        }
        assert_eq!(got, [Decision::Allowed, Decision::Allowed, Decision::Denied, Decision::Denied]);
        // A refused local check charged nothing: another key of ip still has room,
        // and the tenant window of "a" holds 2.
        let r = c.check_multi(FailPolicy::Local, 2, false, &[ItemArgs { key: b"b", ..ip }, tenant]).await.unwrap();
        assert_eq!((r.decision, r.extension.as_deref().unwrap().refused), (Decision::Denied, 2));
        let r = c.check_multi(FailPolicy::Local, 2, false, &[ItemArgs { key: b"b", ..ip }, ItemArgs { key: b"b", ..tenant }]).await.unwrap();
        assert_eq!(r.decision, Decision::Allowed);
    });
}

#[test]
fn refunds_need_the_redis_backend_and_unknown_policies_are_errors() {
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n{}", policies()));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = d.client().await;
        let ip = ItemArgs { policy: b"ip", key: b"a", cost: 1 };
        let r = c.check_multi(FailPolicy::Closed, 0, true, &[ip]).await.unwrap();
        assert_eq!((r.decision, r.source), (Decision::Allowed, Source::Memory));
        assert!(r.extension.as_deref().unwrap().handle.is_none(), "the memory backend issues no handle");
        let r = c.refund(&[0; HANDLE_LEN], &[ip]).await.unwrap();
        assert_eq!((r.decision, r.error), (Decision::Error, ErrorCode::RefundUnsupported));
        let r = c.check_multi(FailPolicy::Closed, 0, false, &[ip, ItemArgs { policy: b"nope", ..ip }]).await.unwrap();
        assert_eq!((r.decision, r.error), (Decision::Error, ErrorCode::UnknownPolicy));
        let r = c.check_multi(FailPolicy::Closed, 0, false, &[ip, ItemArgs { policy: b"global", cost: 21, ..ip }]).await.unwrap();
        assert_eq!((r.decision, r.error), (Decision::Error, ErrorCode::InvalidCost));
    });
}

/// Concurrent multi-item checks and single checks of the same windows (the
/// single ones coalesced): no window ever holds more than its limit, and
/// each holds exactly what the responses say was recorded.
#[test]
fn concurrent_multi_and_single_checks_record_exactly_what_they_answer() {
    let server = RedisServer::start_unix();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n{}", server.url(), policies()));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let recorded: HashMap<(usize, usize), u32> = rt.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..6u64 {
            let mut c = d.client().await;
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng(0x5eed ^ ((t + 1) * 0x9e37_79b9));
                let mut got: HashMap<(usize, usize), u32> = HashMap::new();
                for _ in 0..150 {
                    // Keys a and b only, no shadow policy: every item is enforced.
                    let items = draw_items(&mut rng, 3, 3, 2, 2);
                    let n = items.len();
                    let args: Vec<ItemArgs<'_>> = items.iter().map(|&(p, k, cost)| ItemArgs { policy: NAMES[p].as_bytes(), key: KEYS[k].as_bytes(), cost }).collect();
                    let r = c.check_multi(FailPolicy::Closed, 0, n == 1 && rng.below(2) == 0, &args).await.unwrap();
                    assert_eq!(r.error, ErrorCode::None, "{r:?}");
                    if r.decision == Decision::Allowed {
                        for &(p, k, cost) in &items {
                            *got.entry((p, k)).or_default() += cost;
                        }
                    }
                }
                got
            }));
        }
        let mut total: HashMap<(usize, usize), u32> = HashMap::new();
        for t in tasks {
            for (k, v) in t.await.unwrap() {
                *total.entry(k).or_default() += v;
            }
        }
        total
    });
    let mut conn = server.conn();
    let mut full = 0;
    for (p, name) in NAMES.iter().enumerate().take(3) {
        for (k, key) in KEYS.iter().enumerate().take(2) {
            let rk = format!("ratelimitd:{{{}{name}{key}}}:60000ms", name.len() as u8 as char);
            let members: u32 = redis::Commands::zcard(&mut conn, rk.as_bytes()).unwrap();
            let want = recorded.get(&(p, k)).copied().unwrap_or(0);
            assert_eq!(members, want, "{name}/{key}: the window holds what was answered admitted");
            assert!(members <= Model::limit(p, k).unwrap(), "{name}/{key} over its limit");
            full += u32::from(members + 1 > Model::limit(p, k).unwrap());
        }
    }
    assert!(full >= 2, "the run must fill some windows ({full} full)");
}
