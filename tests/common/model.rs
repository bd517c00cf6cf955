//! The serial reference model of the whole feature matrix (tests/matrix.rs):
//! what the daemon must answer to every request, one at a time, following
//! docs/PROTOCOL.md, docs/POLICIES.md, docs/ALGORITHMS.md and the pipeline's
//! rules S1-S9 (docs/SEMANTICS.md).
//!
//! Time does not exist here: every window outlasts a run (an hour for the
//! log, the ring and GCRA, a UTC day for the fixed window and the sliding
//! counter, an hour for leases), so a window is a counter, a GCRA bucket
//! the tokens in use, a key's leases a map of lease id to slots. The time
//! fields of a response (retry-after, reset) are checked within bounds the
//! runner gives (`Clock`): how long the case has run, the time to the next
//! UTC midnight.
//!
//! While Redis is down (the runner killed it) the fail policies decide as
//! PROTOCOL.md section 7 and 4b say: open, closed, or the daemon's per-host
//! windows and leases with the local quota, which outlive the outage; a
//! fresh Redis comes back empty.
//!
//! Sharded items are drawn with cost 1 only (or a cost above the largest
//! shard's part, which is INVALID_COST): with cost 1 a sharded key admits
//! exactly its limit whatever the round robin does (S1), so the model keeps
//! one counter per key; with larger costs which shard admits depends on the
//! daemon's random round-robin start, which no serial model can know.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use ratelimitd::protocol::{Algorithm, Decision, FailPolicy, ItemResult, Response, Source};

pub const HOUR: u32 = 3_600_000;
pub const DAY: u32 = 86_400_000;

/// Wire values of the error codes the model names (numbers, so that a code
/// the daemon does not have yet, 19, still compiles).
pub mod code {
    pub const OK: u16 = 0;
    pub const INVALID_COST: u16 = 9;
    pub const UNKNOWN_POLICY: u16 = 12;
    pub const DUPLICATE_ITEM: u16 = 13;
    pub const REFUND_UNSUPPORTED: u16 = 14;
    pub const WRONG_POLICY_KIND: u16 = 18;
    /// S7: a policy of algorithm other than log in a multi-item or
    /// refundable check.
    pub const UNSUPPORTED_COMBINATION: u16 = 19;
}

/// The window length the matrix gives each algorithm: long enough that
/// nothing leaves a window during a case; the fixed window and the sliding
/// counter align to UTC days (the runner keeps cases away from midnight).
pub fn window_of(a: Algorithm) -> u32 {
    match a {
        Algorithm::Fixed | Algorithm::SlidingCounter => DAY,
        _ => HOUR,
    }
}

pub const LEASE_MS: u32 = HOUR;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Limit {
    N(u32),
    Unlimited,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Rate { algorithm: Algorithm, shards: u32 },
    Concurrency,
}

#[derive(Clone, Debug)]
pub struct PolicySpec {
    pub name: String,
    pub kind: Kind,
    pub limit: u32,
    pub shadow: bool,
    pub overrides: Vec<(String, Limit)>,
    pub allowlist: Vec<String>,
    pub fail_policy: Option<(FailPolicy, u32)>,
    /// Left out of the configuration (a reload removed it).
    pub removed: bool,
}

impl PolicySpec {
    /// The key's limit under the policy; `None`: exempt.
    pub fn limit_for(&self, key: &str) -> Option<u32> {
        if self.allowlist.iter().any(|k| k == key) {
            return None;
        }
        match self.overrides.iter().find(|(k, _)| k == key) {
            Some((_, Limit::N(n))) => Some(*n),
            Some((_, Limit::Unlimited)) => None,
            None => Some(self.limit),
        }
    }

    pub fn algorithm(&self) -> Option<Algorithm> {
        match self.kind {
            Kind::Rate { algorithm, .. } => Some(algorithm),
            Kind::Concurrency => None,
        }
    }

    pub fn shards(&self) -> u32 {
        match self.kind {
            Kind::Rate { shards, .. } => shards,
            Kind::Concurrency => 1,
        }
    }

    pub fn window_ms(&self) -> u32 {
        match self.kind {
            Kind::Rate { algorithm, .. } => window_of(algorithm),
            Kind::Concurrency => LEASE_MS,
        }
    }

    /// The most one request of this key may cost (S1: the largest shard's part).
    pub fn most(&self, limit: u32) -> u32 {
        let s = self.shards();
        if s > 1 {
            limit.div_ceil(s)
        } else {
            limit
        }
    }

    fn toml(&self, out: &mut String) {
        let _ = writeln!(out, "[[policy]]\nname = \"{}\"\nlimit = {}", self.name, self.limit);
        match self.kind {
            Kind::Rate { algorithm, shards } => {
                let w = if window_of(algorithm) == DAY { "1d" } else { "1h" };
                let _ = writeln!(out, "window = \"{w}\"\nalgorithm = \"{}\"", algorithm.as_str());
                if shards > 1 {
                    let _ = writeln!(out, "shards = {shards}");
                }
            }
            Kind::Concurrency => {
                let _ = writeln!(out, "algorithm = \"concurrency\"\nlease = \"1h\"");
            }
        }
        if self.shadow {
            out.push_str("shadow = true\n");
        }
        if let Some((f, local)) = self.fail_policy {
            let _ = writeln!(out, "fail_policy = \"{}\"", f.as_str());
            if f == FailPolicy::Local {
                let _ = writeln!(out, "local_limit = {local}");
            }
        }
        if !self.allowlist.is_empty() {
            let keys: Vec<String> = self.allowlist.iter().map(|k| format!("\"{k}\"")).collect();
            let _ = writeln!(out, "allowlist = [{}]", keys.join(", "));
        }
        if !self.overrides.is_empty() {
            out.push_str("[policy.overrides]\n");
            for (k, l) in &self.overrides {
                match l {
                    Limit::N(n) => {
                        let _ = writeln!(out, "\"{k}\" = {n}");
                    }
                    Limit::Unlimited => {
                        let _ = writeln!(out, "\"{k}\" = \"unlimited\"");
                    }
                }
            }
        }
        out.push('\n');
    }
}

/// The drawn `[[policy]]` tables and the inline limits of a case.
#[derive(Clone, Debug)]
pub struct Config {
    pub policies: Vec<PolicySpec>,
    /// Limit of each inline (key, algorithm) window: one (limit, window) per key.
    pub inline: Vec<(String, Algorithm, u32)>,
    /// Limit of each inline lease key.
    pub inline_leases: Vec<(String, u32)>,
    pub denial_cache: bool,
}

impl Config {
    pub fn policies_toml(&self) -> String {
        let mut out = String::new();
        for p in self.policies.iter().filter(|p| !p.removed) {
            p.toml(&mut out);
        }
        out
    }

    pub fn policy(&self, name: &str) -> Option<&PolicySpec> {
        self.policies.iter().find(|p| p.name == name && !p.removed)
    }

    /// Any policy of that name, removed or not (for reading Redis's keys).
    pub fn any_policy(&self, name: &str) -> Option<&PolicySpec> {
        self.policies.iter().find(|p| p.name == name)
    }

    pub fn inline_limit(&self, key: &str, a: Algorithm) -> u32 {
        self.inline.iter().find(|(k, b, _)| k == key && *b == a).map(|x| x.2).expect("drawn inline key")
    }

    pub fn inline_lease_limit(&self, key: &str) -> u32 {
        self.inline_leases.iter().find(|(k, _)| k == key).map(|x| x.1).expect("drawn lease key")
    }
}

/// Whose window: a policy's, an inline key's under an algorithm, or the
/// leases of a concurrency policy's key (`Some`) or an inline lease key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    Policy(String),
    Inline(u8),
    Leases(Option<String>),
}

pub type WinKey = (Scope, String);

/// What the runner knows of time when it asks the model.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    /// Upper bound of the age of any admission of the case, in ms.
    pub elapsed_ms: u32,
    /// Time to the next UTC midnight, in ms, when the answer came back...
    pub to_midnight_ms: u32,
    /// ...and when the request was sent (the daemon decided in between).
    pub to_midnight_sent_ms: u32,
}

/// An expected number: exactly, or anything (with `sum` checked instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Num {
    Is(u32),
    Any,
}

impl Num {
    fn ok(self, got: u32) -> bool {
        match self {
            Num::Is(n) => n == got,
            Num::Any => true,
        }
    }
}

/// One expected verdict (a response's fixed fields or one item's).
#[derive(Clone, Debug)]
pub struct Want {
    pub decision: Decision,
    pub sources: Vec<Source>,
    pub error: u16,
    pub count: Num,
    pub remaining: Num,
    /// count + remaining must be this (sharded keys: estimated numbers).
    pub sum: Option<u32>,
    pub retry: (u32, u32),
    pub reset: (u32, u32),
    /// Item results only: the key's limit (0 exempt) and the window.
    pub limit: u32,
    pub window_ms: u32,
    /// A shadow policy's item: never refuses, ignored by the fixed fields (S3).
    pub shadow: bool,
    /// Redis was down: the error is one of REDIS_TIMEOUT, REDIS_UNAVAILABLE,
    /// CIRCUIT_OPEN (which one depends on the breaker), not `error`.
    pub outage: bool,
}

/// The codes of a request decided while Redis was down.
pub const OUTAGE_CODES: [u16; 3] = [30, 31, 33];

impl Want {
    pub fn error(code: u16) -> Self {
        Want { decision: Decision::Error, sources: vec![Source::None], error: code, count: Num::Is(0), remaining: Num::Is(0), sum: None, retry: (0, 0), reset: (0, 0), limit: 0, window_ms: 0, shadow: false, outage: false }
    }

    fn exempt(window_ms: u32) -> Self {
        Want { decision: Decision::Allowed, sources: vec![Source::Exempt], window_ms, ..Want::error(code::OK) }
    }

    fn mismatch(&self, d: Decision, s: Source, count: u32, remaining: u32, retry: u32, reset: u32) -> Option<String> {
        let mut bad = Vec::new();
        if d != self.decision {
            bad.push(format!("decision {d:?} (want {:?})", self.decision));
        }
        if !self.sources.contains(&s) {
            bad.push(format!("source {s:?} (want one of {:?})", self.sources));
        }
        let stale = match self.count {
            // The denial cache answers with the numbers of the refusal it
            // remembers (PROTOCOL.md section 7): admissions of a smaller
            // cost since then are not in them.
            Num::Is(n) if s == Source::DenialCache && self.sum.is_none() => count <= n && remaining == self.limit.saturating_sub(count),
            _ => false,
        };
        if !self.count.ok(count) && !stale {
            bad.push(format!("count {count} (want {:?})", self.count));
        }
        if !self.remaining.ok(remaining) && !stale {
            bad.push(format!("remaining {remaining} (want {:?})", self.remaining));
        }
        if let Some(sum) = self.sum {
            if count + remaining != sum {
                bad.push(format!("count + remaining {} (want {sum})", count + remaining));
            }
        }
        // The cache's time fields count down from the remembered refusal,
        // which may be of a smaller cost: never later than Redis's answer.
        let lo = |b: (u32, u32)| if s == Source::DenialCache { 0 } else { b.0 };
        if retry < lo(self.retry) || retry > self.retry.1 {
            bad.push(format!("retry_after_ms {retry} (want {}..={})", self.retry.0, self.retry.1));
        }
        if reset < lo(self.reset) || reset > self.reset.1 {
            bad.push(format!("reset_ms {reset} (want {}..={})", self.reset.0, self.reset.1));
        }
        (!bad.is_empty()).then(|| bad.join(", "))
    }

    /// Compares a response's fixed fields.
    pub fn check(&self, r: &Response) -> Result<(), String> {
        let mut bad = self.mismatch(r.decision, r.source, r.count, r.remaining, r.retry_after_ms, r.reset_ms);
        let code_ok = if self.outage { OUTAGE_CODES.contains(&r.error.to_wire()) } else { r.error.to_wire() == self.error };
        if !code_ok {
            let e = format!("error {} {:?} (want {})", r.error.to_wire(), r.error, self.error);
            bad = Some(bad.map_or(e.clone(), |b| format!("{b}, {e}")));
        }
        bad.map_or(Ok(()), Err)
    }

    fn check_item(&self, r: &ItemResult) -> Result<(), String> {
        let mut bad = self.mismatch(r.decision, r.source, r.count, r.remaining, r.retry_after_ms, r.reset_ms).map_or(Vec::new(), |b| vec![b]);
        if r.limit != self.limit {
            bad.push(format!("limit {} (want {})", r.limit, self.limit));
        }
        if r.window_ms != self.window_ms {
            bad.push(format!("window_ms {} (want {})", r.window_ms, self.window_ms));
        }
        none_or_all(bad, ", ")
    }
}

/// Ok when nothing is `bad`, else every mismatch joined by `sep`.
fn none_or_all(bad: Vec<String>, sep: &str) -> Result<(), String> {
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join(sep))
    }
}

/// What a multi-item (or refundable) check must answer.
#[derive(Clone, Debug)]
pub struct WantMulti {
    pub items: Vec<Want>,
    /// 1-based indices of the enforced items that do not fit: the request
    /// is refused iff not empty.
    pub refusing: Vec<u8>,
    /// Whether the answer must carry a handle (`None`: either).
    pub handle: Option<bool>,
    /// Items another item's refusal left unevaluated are accepted (the
    /// denial cache's refusal; a Cluster's later slot groups).
    pub may_skip: bool,
    /// Compare the numbers of items of a refused request (S8); off: the
    /// decisions only.
    pub refused_numbers: bool,
    /// Hold the fixed fields of an admitted answer to enforced items (S3).
    pub shadow_fields: bool,
    /// Redis was down: the items' fail policies decided.
    pub outage: bool,
}

impl WantMulti {
    pub fn check(&self, r: &Response) -> Result<(), String> {
        let code_ok = if self.outage { OUTAGE_CODES.contains(&r.error.to_wire()) } else { r.error.to_wire() == code::OK };
        if !code_ok || r.decision == Decision::Error {
            return Err(format!("decision {:?} error {} {:?} (want a decided multi-item answer)", r.decision, r.error.to_wire(), r.error));
        }
        let Some(ext) = r.extension.as_deref() else { return Err("no extension (section 5b)".into()) };
        if ext.items.len() != self.items.len() {
            return Err(format!("{} item results for {} items", ext.items.len(), self.items.len()));
        }
        let mut bad = Vec::new();
        let refused = !self.refusing.is_empty();
        let not_evaluated = |it: &ItemResult| it.decision == Decision::Denied && it.source == Source::None;
        let cached = ext.refused > 0 && ext.items.get(ext.refused as usize - 1).is_some_and(|it| it.source == Source::DenialCache);
        for (i, (w, got)) in self.items.iter().zip(&ext.items).enumerate() {
            // A sharded item another item's refusal left with shards untried
            // is not evaluated (S1): its key may have room.
            if refused && not_evaluated(got) && (self.may_skip || cached || w.sum.is_some()) && w.sources != [Source::Exempt] {
                continue;
            }
            let w = if refused && !self.refused_numbers { Want { count: Num::Any, remaining: Num::Any, sum: None, retry: (0, u32::MAX), reset: (0, u32::MAX), ..w.clone() } } else { w.clone() };
            if let Err(e) = w.check_item(got) {
                bad.push(format!("item {}: {e}", i + 1));
            }
        }
        if refused {
            if !self.refusing.contains(&ext.refused) {
                bad.push(format!("refused = {} (want one of {:?})", ext.refused, self.refusing));
            } else if let Some(earlier) = self.refusing.iter().find(|&&i| i < ext.refused && !not_evaluated(&ext.items[i as usize - 1])) {
                bad.push(format!("refused = {} but item {earlier}, evaluated, refused before it", ext.refused));
            }
            if r.decision != Decision::Denied {
                bad.push(format!("decision {:?} (want Denied)", r.decision));
            }
            if let Some(it) = ext.items.get((ext.refused as usize).wrapping_sub(1)) {
                if (r.source, r.count, r.remaining) != (it.source, it.count, it.remaining) {
                    bad.push(format!("fixed fields source {:?} count {} remaining {} are not the refusing item's ({:?}, {}, {})", r.source, r.count, r.remaining, it.source, it.count, it.remaining));
                }
                let most = ext.items.iter().filter(|it| it.decision == Decision::Denied && it.source != Source::None).map(|it| it.retry_after_ms).max().unwrap_or(0);
                if r.retry_after_ms != most {
                    bad.push(format!("retry_after_ms {} (want {most}, the largest of the refusing items')", r.retry_after_ms));
                }
            }
            if ext.handle.is_some() {
                bad.push("a refused request carries a handle".into());
            }
        } else {
            if ext.refused != 0 || r.decision != Decision::Allowed {
                bad.push(format!("decision {:?} refused = {} (want Allowed, 0)", r.decision, ext.refused));
            }
            // S3: the fixed fields come from enforced items only: the stored
            // item with the least remaining, else an exempt item.
            let main = self
                .items
                .iter()
                .zip(&ext.items)
                .filter(|(w, _)| (!w.shadow || !self.shadow_fields) && w.sources != [Source::Exempt] && matches!(w.decision, Decision::Allowed | Decision::ShadowAllowed))
                .min_by_key(|(_, it)| it.remaining)
                .map(|(_, it)| *it)
                .or_else(|| self.items.iter().zip(&ext.items).find(|(w, _)| !w.shadow && self.shadow_fields).map(|(_, it)| *it));
            if let Some(m) = main {
                if (r.source, r.count, r.remaining, r.retry_after_ms, r.reset_ms) != (m.source, m.count, m.remaining, m.retry_after_ms, m.reset_ms) {
                    bad.push(format!(
                        "fixed fields ({:?}, count {}, remaining {}, retry {}, reset {}) are not those of the enforced item with the least remaining ({:?}, {}, {}, {}, {}) (S3)",
                        r.source, r.count, r.remaining, r.retry_after_ms, r.reset_ms, m.source, m.count, m.remaining, m.retry_after_ms, m.reset_ms
                    ));
                }
            }
            match (self.handle, ext.handle.is_some()) {
                (Some(true), false) => bad.push("no handle for an admitted refundable request".into()),
                (Some(false), true) => bad.push("a handle where none is due".into()),
                _ => {}
            }
        }
        none_or_all(bad, "; ")
    }
}

/// An answer the model expects.
#[derive(Clone, Debug)]
pub enum Expect {
    One(Want),
    Multi(WantMulti),
}

impl Expect {
    pub fn check(&self, r: &Response) -> Result<(), String> {
        match self {
            Expect::One(w) => w.check(r),
            Expect::Multi(m) => m.check(r),
        }
    }
}

/// One item of a check as the client sends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub policy: String,
    pub key: String,
    pub cost: u32,
}

/// A refundable admission the model issued a handle for.
#[derive(Clone, Debug)]
pub struct Issued {
    pub items: Vec<Item>,
    /// Units recorded per item (0: not recorded), in the model's windows.
    pub recorded: Vec<(WinKey, u32)>,
    pub refunded: bool,
}

/// An ACQUIRE or RELEASE as the client sends it: of a concurrency policy
/// (op 7) when `policy` is `Some`, of an inline lease key (ops 5, 6) else.
#[derive(Clone, Copy, Debug)]
pub struct LeaseOp<'a> {
    pub policy: Option<&'a str>,
    pub key: &'a str,
    pub lease: &'a str,
    pub cost: u32,
    pub release: bool,
}

/// Which backend the daemon decides with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    Redis,
    Cluster,
    Memory,
}

/// The serial reference.
#[derive(Debug)]
pub struct Model {
    pub store: Store,
    pub config: Config,
    /// Admission units per window (a sharded key: all its shards together;
    /// GCRA: tokens in use).
    pub windows: BTreeMap<WinKey, u32>,
    /// Slots held per lease id per key.
    pub leases: BTreeMap<WinKey, BTreeMap<String, u32>>,
    pub issued: Vec<Issued>,
    /// Compare the per-item numbers of refused multi-item checks (S8).
    pub refused_numbers: bool,
    pub shadow_fields: bool,
    /// Redis is down (killed): fail policies decide.
    pub outage: bool,
    /// The daemon's per-host fallback windows and leases (fail policy
    /// local), which outlive Redis outages.
    pub local: BTreeMap<WinKey, u32>,
    pub local_leases: BTreeMap<WinKey, BTreeMap<String, u32>>,
    /// Responses `ratelimitd_decisions_total` must have counted (S9).
    pub decisions: u64,
    /// REFUND requests carried out in Redis, and the units they removed.
    pub refunds: u64,
    pub refunded_units: u64,
}

fn policy_scope(p: &PolicySpec) -> Scope {
    match p.kind {
        Kind::Rate { .. } => Scope::Policy(p.name.clone()),
        Kind::Concurrency => Scope::Leases(Some(p.name.clone())),
    }
}

impl Model {
    pub fn new(store: Store, config: Config) -> Self {
        Model { store, config, windows: BTreeMap::new(), leases: BTreeMap::new(), issued: Vec::new(), refused_numbers: true, shadow_fields: true, outage: false, local: BTreeMap::new(), local_leases: BTreeMap::new(), decisions: 0, refunds: 0, refunded_units: 0 }
    }

    fn store_source(&self) -> Source {
        match self.store {
            Store::Memory => Source::Memory,
            _ => Source::Redis,
        }
    }

    /// Sources a refusal may come from: the store, or the denial cache
    /// (exact: same numbers).
    fn refusal_sources(&self) -> Vec<Source> {
        let mut s = vec![self.store_source()];
        if self.store != Store::Memory && self.config.denial_cache {
            s.push(Source::DenialCache);
        }
        s
    }

    /// The verdict on one window of `n` units: (fits, Want) for a request
    /// of `cost` under `limit`, the time fields from the algorithm.
    fn verdict(&self, a: Algorithm, n: u32, limit: u32, cost: u32, sharded: bool, clock: Clock) -> (bool, Want) {
        let w = window_of(a);
        let fits = n + cost <= limit;
        let e = clock.elapsed_ms + 5;
        let near = |x: u32| (x.saturating_sub(e), x + 1);
        let mid = clock.to_midnight_ms;
        // The day's end as seen from the decision, somewhere between the
        // request and its answer.
        let day_end = (mid.saturating_sub(1000), clock.to_midnight_sent_ms + 1000);
        let (retry, reset) = match (a, fits) {
            (Algorithm::Log | Algorithm::Ring, true) => ((0, 0), (w.saturating_sub(2), w)),
            (Algorithm::Log | Algorithm::Ring, false) => (near(w), near(w)),
            (Algorithm::Gcra, _) => {
                let t = f64::from(w) / f64::from(limit);
                let at = |units: u32| (f64::from(units) * t).ceil() as u32;
                if fits {
                    (near(at(n)), near(at(n + cost)))
                } else {
                    (near(at(n + cost).saturating_sub(w)), near(at(n)))
                }
            }
            (Algorithm::Fixed, true) => ((0, 0), day_end),
            (Algorithm::Fixed, false) => {
                // In debt (n past the limit, carried k windows on as n - k
                // limit): the first window with room for the cost.
                let k = if n > limit { (n + cost - limit).div_ceil(limit).max(1) } else { 1 };
                ((day_end.0 + (k - 1) * w, day_end.1 + (k - 1) * w), day_end)
            }
            (Algorithm::SlidingCounter, true) => ((0, 0), (day_end.0, day_end.1 + w)),
            (Algorithm::SlidingCounter, false) => ((day_end.0, day_end.1 + w), (day_end.0, day_end.1 + w)),
        };
        // A window holding more than the limit in force (counted under a
        // larger one) answers count = limit (docs/PROTOCOL.md section 7).
        let (count, remaining) = if fits { (n + cost, limit - n - cost) } else { (n.min(limit), limit.saturating_sub(n)) };
        let mut want = Want {
            decision: if fits { Decision::Allowed } else { Decision::Denied },
            sources: if fits { vec![self.store_source()] } else { self.refusal_sources() },
            error: code::OK,
            count: Num::Is(count),
            remaining: Num::Is(remaining),
            sum: None,
            retry,
            reset,
            limit,
            window_ms: w,
            shadow: false,
            outage: false,
        };
        if sharded {
            // S1 fixes which requests a sharded key admits; its numbers are
            // the documented estimate (SCALING.md, Hot keys): count +
            // remaining is the key's limit, a refusal of cost 1 is (limit, 0).
            // An admission's retry_after is 0, but GCRA's is the admitting
            // shard's pacing delay (ALGORITHMS.md), which depends on that
            // shard's tokens in use, unknown to the model: at most its
            // window (every token of its part in use).
            want.count = if fits { Num::Any } else { Num::Is(limit) };
            want.remaining = if fits { Num::Any } else { Num::Is(0) };
            want.sum = Some(limit);
            want.retry = match (fits, a) {
                (true, Algorithm::Gcra) => (0, w),
                (true, _) => (0, 0),
                (false, _) => (0, 2 * DAY),
            };
            want.reset = (0, 2 * DAY);
        }
        (fits, want)
    }

    /// Redis was killed: from now on the fail policies decide.
    pub fn outage(&mut self) {
        self.outage = true;
    }

    /// Redis is back, empty (nothing was saved): its windows and leases are
    /// gone, so is every member a handle names.
    pub fn recover(&mut self) {
        self.outage = false;
        self.windows.clear();
        self.leases.clear();
        for h in &mut self.issued {
            h.refunded = true;
        }
    }

    /// What the fail policy `fail` answers for one window while Redis is
    /// down (PROTOCOL.md section 7): open, closed, or the per-host window
    /// of the key with the local quota.
    fn fail_verdict(&mut self, wk: WinKey, a: Algorithm, limit: u32, cost: u32, fail: (FailPolicy, u32), clock: Clock) -> Want {
        let w = window_of(a);
        let base = Want { outage: true, window_ms: w, limit, ..Want::error(code::OK) };
        match fail {
            (FailPolicy::Open, _) => Want { decision: Decision::Allowed, sources: vec![Source::FailOpen], remaining: Num::Is(limit), ..base },
            (FailPolicy::Closed, _) => Want { decision: Decision::Denied, sources: vec![Source::FailClosed], retry: (w.min(1000), w.min(1000)), ..base },
            (FailPolicy::Local, local) if cost > local => Want { decision: Decision::Denied, sources: vec![Source::LocalFallback], remaining: Num::Is(local), retry: (w, w), ..base },
            (FailPolicy::Local, local) => {
                let n = self.local.get(&wk).copied().unwrap_or(0);
                let (fits, want) = self.verdict(a, n, local, cost, false, clock);
                if fits {
                    *self.local.entry(wk).or_default() += cost;
                }
                Want { sources: vec![Source::LocalFallback], outage: true, ..want }
            }
        }
    }

    /// CHECK (op 1) of an inline key.
    pub fn check(&mut self, key: &str, a: Algorithm, cost: u32, fail: (FailPolicy, u32), clock: Clock) -> Expect {
        self.decisions += 1;
        let limit = self.config.inline_limit(key, a);
        if cost > limit {
            return Expect::One(Want::error(code::INVALID_COST));
        }
        let wk = (Scope::Inline(a.to_wire()), key.to_string());
        if self.outage {
            return Expect::One(self.fail_verdict(wk, a, limit, cost, fail, clock));
        }
        let n = self.windows.get(&wk).copied().unwrap_or(0);
        let (fits, want) = self.verdict(a, n, limit, cost, false, clock);
        if fits {
            *self.windows.entry(wk).or_default() += cost;
        }
        Expect::One(want)
    }

    /// CHECK_POLICY of one item without flags.
    pub fn check_policy(&mut self, item: &Item, fail: (FailPolicy, u32), clock: Clock) -> Expect {
        self.decisions += 1;
        let Some(p) = self.config.policy(&item.policy).cloned() else {
            return Expect::One(Want::error(code::UNKNOWN_POLICY));
        };
        let Some(a) = p.algorithm() else {
            return Expect::One(Want::error(code::WRONG_POLICY_KIND));
        };
        let Some(limit) = p.limit_for(&item.key) else {
            let mut want = Want::exempt(0);
            if p.shadow {
                shadow_marked(&mut want);
            }
            return Expect::One(want);
        };
        if item.cost > p.most(limit) {
            return Expect::One(Want::error(code::INVALID_COST));
        }
        let wk = (policy_scope(&p), item.key.clone());
        if self.outage {
            // The policy's own fail policy replaces the request's; a sharded
            // key's local window is the key's own, not a shard's.
            let mut want = self.fail_verdict(wk, a, limit, item.cost, p.fail_policy.unwrap_or(fail), clock);
            if p.shadow {
                shadow_marked(&mut want);
            }
            return Expect::One(want);
        }
        let n = self.windows.get(&wk).copied().unwrap_or(0);
        let (fits, mut want) = self.verdict(a, n, limit, item.cost, p.shards() > 1, clock);
        if fits {
            *self.windows.entry(wk).or_default() += item.cost;
        }
        if p.shadow {
            shadow_marked(&mut want);
        }
        Expect::One(want)
    }

    /// Resolves the items of a multi-item check or a refund: the first
    /// failing item answers for the whole request.
    fn resolve(&self, items: &[Item], refund: bool) -> Result<Vec<(PolicySpec, Option<u32>)>, u16> {
        let mut out: Vec<(PolicySpec, Option<u32>)> = Vec::new();
        // The decoder's check (PROTOCOL.md 4b, validation step 9), before
        // any policy is looked up.
        for (i, it) in items.iter().enumerate() {
            if items[..i].iter().any(|o| o.policy == it.policy && o.key == it.key) {
                return Err(code::DUPLICATE_ITEM);
            }
        }
        for it in items {
            let Some(p) = self.config.policy(&it.policy) else { return Err(code::UNKNOWN_POLICY) };
            let Some(a) = p.algorithm() else { return Err(code::WRONG_POLICY_KIND) };
            if a != Algorithm::Log {
                return Err(code::UNSUPPORTED_COMBINATION);
            }
            let limit = p.limit_for(&it.key);
            if !refund && limit.is_some_and(|l| it.cost > p.most(l)) {
                return Err(code::INVALID_COST);
            }
            out.push((p.clone(), limit));
        }
        Ok(out)
    }

    /// The items of a multi-item check or a reserve before it is
    /// committed: each item's want (exempt without a limit, else what
    /// `decide(policy, count now, limit, cost)` says), each counted item's
    /// window and whether it fits, and the 1-based numbers of the enforced
    /// items that do not fit (the request is refused unless none).
    #[allow(clippy::type_complexity)]
    fn item_verdicts(&self, items: &[Item], resolved: &[(PolicySpec, Option<u32>)], decide: impl Fn(&PolicySpec, u32, u32, u32) -> (bool, Want)) -> (Vec<Want>, Vec<Option<(WinKey, bool)>>, Vec<u8>) {
        let mut wants = Vec::new();
        let mut fits_all = Vec::new();
        for (it, (p, limit)) in items.iter().zip(resolved) {
            let (fits, mut want) = match *limit {
                None => (None, Want { shadow: p.shadow, ..Want::exempt(p.window_ms()) }),
                Some(limit) => {
                    let wk = (policy_scope(p), it.key.clone());
                    let n = self.windows.get(&wk).copied().unwrap_or(0);
                    let (fits, want) = decide(p, n, limit, it.cost);
                    (Some((wk, fits)), Want { shadow: p.shadow, ..want })
                }
            };
            if p.shadow {
                shadow_marked(&mut want);
            }
            wants.push(want);
            fits_all.push(fits);
        }
        let refusing = resolved.iter().zip(&fits_all).enumerate().filter(|(_, ((p, _), f))| !p.shadow && matches!(f, Some((_, false)))).map(|(i, _)| (i + 1) as u8).collect();
        (wants, fits_all, refusing)
    }

    /// CHECK_POLICY of several items, or of one with the refundable flag.
    pub fn check_multi(&mut self, items: &[Item], refundable: bool, fail: (FailPolicy, u32), clock: Clock) -> Expect {
        self.decisions += 1;
        let resolved = match self.resolve(items, false) {
            Ok(r) => r,
            Err(c) => return Expect::One(Want::error(c)),
        };
        if self.outage {
            return self.multi_outage(items, &resolved, fail, clock);
        }
        let (mut wants, fits_all, refusing) = self.item_verdicts(items, &resolved, |p, n, limit, cost| self.verdict(Algorithm::Log, n, limit, cost, p.shards() > 1, clock));
        let committed = refusing.is_empty();
        let mut recorded = Vec::new();
        for ((it, f), w) in items.iter().zip(&fits_all).zip(wants.iter_mut()) {
            match f {
                Some((wk, true)) if committed => {
                    *self.windows.entry(wk.clone()).or_default() += it.cost;
                    recorded.push((wk.clone(), it.cost));
                }
                Some((wk, true)) => {
                    // S8: a refused request's items report the window as it
                    // stands without this request.
                    let n = self.windows.get(wk).copied().unwrap_or(0);
                    if w.sum.is_none() {
                        w.count = Num::Is(n);
                        w.remaining = Num::Is(w.limit.saturating_sub(n));
                    }
                    w.reset = (0, 2 * DAY);
                }
                _ => {}
            }
        }
        let stored = fits_all.iter().any(|f| f.is_some());
        let redis = self.store != Store::Memory;
        let units: u32 = recorded.iter().map(|r| r.1).sum();
        let handle = if !(refundable && committed && redis && stored) {
            Some(false)
        } else if units > 0 {
            Some(true)
        } else {
            None
        };
        if refundable && committed && redis && stored {
            self.issued.push(Issued { items: items.to_vec(), recorded, refunded: false });
        }
        Expect::Multi(WantMulti { items: wants, refusing, handle, may_skip: self.store == Store::Cluster, refused_numbers: self.refused_numbers, shadow_fields: self.shadow_fields, outage: false })
    }

    /// A multi-item check while Redis is down: each item's fail policy (its
    /// policy's own, else the request's); `closed` refuses, `open` admits
    /// its item, `local` items are decided together in the per-host
    /// windows, all or nothing, unless another item already refused (then
    /// they are not evaluated).
    fn multi_outage(&mut self, items: &[Item], resolved: &[(PolicySpec, Option<u32>)], fail: (FailPolicy, u32), clock: Clock) -> Expect {
        let mut wants = Vec::new();
        let mut refused = false;
        let mut local: Vec<(usize, WinKey, u32)> = Vec::new();
        for (i, (it, (p, limit))) in items.iter().zip(resolved).enumerate() {
            let w = p.window_ms();
            let Some(limit) = *limit else {
                let mut want = Want { shadow: p.shadow, outage: true, ..Want::exempt(w) };
                if p.shadow {
                    shadow_marked(&mut want);
                }
                wants.push(want);
                continue;
            };
            let base = Want { decision: Decision::Denied, sources: vec![Source::None], limit, window_ms: w, shadow: p.shadow, outage: true, ..Want::error(code::OK) };
            let want = match p.fail_policy.unwrap_or(fail) {
                (FailPolicy::Open, _) => Want { decision: Decision::Allowed, sources: vec![Source::FailOpen], remaining: Num::Is(limit), ..base },
                (FailPolicy::Closed, _) => {
                    refused |= !p.shadow;
                    Want { sources: vec![Source::FailClosed], retry: (w.min(1000), w.min(1000)), ..base }
                }
                (FailPolicy::Local, l) if it.cost > l => {
                    refused |= !p.shadow;
                    Want { sources: vec![Source::LocalFallback], remaining: Num::Is(l), retry: (w, w), limit: l, ..base }
                }
                (FailPolicy::Local, l) => {
                    local.push((i, (policy_scope(p), it.key.clone()), l));
                    base
                }
            };
            wants.push(want);
        }
        if !refused && !local.is_empty() {
            let fits: Vec<bool> = local.iter().map(|(i, wk, l)| self.local.get(wk).copied().unwrap_or(0) + items[*i].cost <= *l).collect();
            let committed = local.iter().zip(&fits).all(|((i, _, _), &f)| f || resolved[*i].0.shadow);
            for ((i, wk, l), &f) in local.iter().zip(&fits) {
                let n = self.local.get(wk).copied().unwrap_or(0);
                let (_, mut want) = self.verdict(Algorithm::Log, n, *l, items[*i].cost, false, clock);
                want.sources = vec![Source::LocalFallback];
                want.shadow = resolved[*i].0.shadow;
                want.outage = true;
                if f && committed {
                    *self.local.entry(wk.clone()).or_default() += items[*i].cost;
                } else if f {
                    want.count = Num::Is(n);
                    want.remaining = Num::Is(l - n);
                    want.reset = (0, 2 * DAY);
                }
                wants[*i] = want;
            }
        }
        for w in wants.iter_mut().filter(|w| w.shadow) {
            shadow_marked(w);
        }
        let refusing: Vec<u8> = wants.iter().enumerate().filter(|(_, w)| w.decision == Decision::Denied && w.sources != [Source::None]).map(|(i, _)| (i + 1) as u8).collect();
        // All items exempt: no store was asked, nothing failed.
        let outage = resolved.iter().any(|(_, l)| l.is_some());
        Expect::Multi(WantMulti { items: wants, refusing, handle: Some(false), may_skip: false, refused_numbers: self.refused_numbers, shadow_fields: self.shadow_fields, outage })
    }

    /// REFUND with the handle of `issued[valid]` (`None`: a forged,
    /// foreign or replayed handle, which removes nothing: S6).
    pub fn refund(&mut self, items: &[Item], valid: Option<usize>) -> Expect {
        if let Err(c) = self.resolve(items, true) {
            self.decisions += 1;
            return Expect::One(Want::error(c));
        }
        if self.store == Store::Memory {
            self.decisions += 1;
            return Expect::One(Want::error(code::REFUND_UNSUPPORTED));
        }
        if self.outage {
            // Nothing taken back, no fail policy: the Redis error (an error
            // response, so a decision in the metrics).
            self.decisions += 1;
            return Expect::One(Want { decision: Decision::Error, sources: vec![Source::Redis], outage: true, ..Want::error(code::OK) });
        }
        let mut removed = 0;
        if let Some(i) = valid {
            let h = &mut self.issued[i];
            if !h.refunded {
                h.refunded = true;
                for (wk, units) in h.recorded.clone() {
                    let w = self.windows.get_mut(&wk).expect("recorded window");
                    *w -= units;
                    removed += units;
                }
            }
        }
        self.refunds += 1;
        self.refunded_units += u64::from(removed);
        Expect::One(Want { decision: Decision::Allowed, sources: vec![Source::Redis], count: Num::Is(removed), ..Want::error(code::OK) })
    }

    /// ACQUIRE or RELEASE (S4): of a concurrency policy (op 7) when
    /// `policy` is `Some`, of an inline lease key (ops 5, 6) otherwise.
    pub fn lease(&mut self, op: LeaseOp<'_>, fail: (FailPolicy, u32), clock: Clock) -> Expect {
        let LeaseOp { policy, key, lease, cost, release } = op;
        self.decisions += 1;
        let mut fail = fail;
        let (limit, shadow, scope) = match policy {
            Some(name) => {
                let Some(p) = self.config.policy(name).cloned() else { return Expect::One(Want::error(code::UNKNOWN_POLICY)) };
                if p.algorithm().is_some() {
                    return Expect::One(Want::error(code::WRONG_POLICY_KIND));
                }
                let Some(limit) = p.limit_for(key) else {
                    let mut want = Want::exempt(0);
                    if p.shadow && !release {
                        shadow_marked(&mut want);
                    }
                    return Expect::One(want);
                };
                fail = p.fail_policy.unwrap_or(fail);
                (limit, p.shadow, Scope::Leases(Some(p.name.clone())))
            }
            None => (self.config.inline_lease_limit(key), false, Scope::Leases(None)),
        };
        // An inline RELEASE is validated as its ACQUIRE (same layout); a
        // policy's release is not held to the key's limit.
        if (policy.is_none() || !release) && cost > limit {
            return Expect::One(Want::error(code::INVALID_COST));
        }
        let wk = (scope, key.to_string());
        if self.outage {
            let mut want = match (release, fail) {
                (false, (FailPolicy::Open, _)) => Want { decision: Decision::Allowed, sources: vec![Source::FailOpen], remaining: Num::Is(limit), ..Want::error(code::OK) },
                (false, (FailPolicy::Closed, _)) => Want { decision: Decision::Denied, sources: vec![Source::FailClosed], retry: (1000, 1000), ..Want::error(code::OK) },
                (false, (FailPolicy::Local, l)) => Self::lease_in(self.local_leases.entry(wk).or_default(), lease, cost, l, false, shadow, Source::LocalFallback, clock),
                (true, _) => Self::lease_in(self.local_leases.entry(wk).or_default(), lease, cost, limit, true, shadow, Source::LocalFallback, clock),
            };
            want.outage = true;
            if shadow && !release {
                shadow_marked(&mut want);
            }
            return Expect::One(want);
        }
        if release {
            // A release Redis answered is also applied to the per-host
            // leases, which hold it if the fallback acquired it.
            self.local_leases.entry(wk.clone()).or_default().remove(lease);
        }
        let src = self.store_source();
        Expect::One(Self::lease_in(self.leases.entry(wk).or_default(), lease, cost, limit, release, shadow, src, clock))
    }

    /// ACQUIRE (S4: a held id is renewed) or RELEASE in one key's leases.
    #[allow(clippy::too_many_arguments)]
    fn lease_in(held: &mut BTreeMap<String, u32>, lease: &str, cost: u32, limit: u32, release: bool, shadow: bool, src: Source, clock: Clock) -> Want {
        let total: u32 = held.values().sum();
        let e = clock.elapsed_ms + 5;
        let want = if release {
            let had = held.remove(lease).is_some();
            let count = held.values().sum();
            // A release is never a shadow refusal (S5): one of a lease
            // not held answers Denied under a shadow policy too.
            let decision = if had { Decision::Allowed } else { Decision::Denied };
            Want { decision, sources: vec![src], count: Num::Is(count), ..Want::error(code::OK) }
        } else {
            let others = total - held.get(lease).copied().unwrap_or(0);
            if others + cost <= limit {
                held.insert(lease.to_string(), cost);
                let count = others + cost;
                let decision = if shadow { Decision::ShadowAllowed } else { Decision::Allowed };
                Want { decision, sources: vec![src], count: Num::Is(count), remaining: Num::Is(limit - count), reset: (LEASE_MS - 2, LEASE_MS), ..Want::error(code::OK) }
            } else {
                let decision = if shadow { Decision::ShadowDenied } else { Decision::Denied };
                // Until the earliest and the last lease expire; nothing held
                // (a cost above the local quota): 0.
                let near = if total == 0 { (0, 0) } else { (LEASE_MS - e, LEASE_MS) };
                Want { decision, sources: vec![src], count: Num::Is(total.min(limit)), remaining: Num::Is(limit.saturating_sub(total)), retry: near, reset: near, ..Want::error(code::OK) }
            }
        };
        want
    }

    /// An admin reset (`DELETE /v1/keys?policy=P&key=K`, docs/ADMIN.md
    /// "Reset") of a policy's key: every admission of its windows (every
    /// shard's) is forgotten, and its leases; a refundable admission's units
    /// in them too. Units outstanding in quota leases, worker shares or
    /// unsettled reservations are kept by the daemon; the model has none of
    /// them (tests/matrix_leases.rs checks those by bounds).
    pub fn reset(&mut self, policy: &str, key: &str) {
        let Some(p) = self.config.any_policy(policy) else { return };
        let wk = (policy_scope(p), key.to_string());
        self.windows.remove(&wk);
        self.leases.remove(&wk);
        // A refund after it finds none of the members it names there.
        for h in &mut self.issued {
            h.recorded.retain(|(k, _)| *k != wk);
        }
    }

    /// What an admin peek (`GET /v1/keys?policy=P&key=K`) must count: the
    /// units of the key's window (its shards summed; GCRA: tokens in use).
    /// A peek records nothing: the model does not change.
    pub fn peek(&self, policy: &str, key: &str) -> u32 {
        let Some(p) = self.config.any_policy(policy) else { return 0 };
        let wk = (policy_scope(p), key.to_string());
        match p.kind {
            Kind::Rate { .. } => self.windows.get(&wk).copied().unwrap_or(0),
            Kind::Concurrency => self.leases.get(&wk).map_or(0, |h| h.values().sum()),
        }
    }

    /// What Redis must hold at the end: units per window (sharded keys
    /// summed over their shards), slots per lease key; zeros left out.
    pub fn final_state(&self) -> BTreeMap<WinKey, u32> {
        let mut out: BTreeMap<WinKey, u32> = self.windows.iter().filter(|(_, &n)| n > 0).map(|(k, &n)| (k.clone(), n)).collect();
        for (k, held) in &self.leases {
            let n: u32 = held.values().sum();
            if n > 0 {
                out.insert(k.clone(), n);
            }
        }
        out
    }
}

/// The mark the daemon puts on a shadow policy's decision (S3): a refusal
/// is `ShadowDenied`, an admission (room, exempt, fail-open, the local
/// fallback's) `ShadowAllowed`; a not-evaluated item and an error stay.
pub fn shadow_marked(w: &mut Want) {
    if w.sources == [Source::None] {
        return;
    }
    match w.decision {
        Decision::Denied => w.decision = Decision::ShadowDenied,
        Decision::Allowed => w.decision = Decision::ShadowAllowed,
        _ => {}
    }
}

// ---------------------------------------------------------------------
// Reserve and settle (docs/PROTOCOL.md 4f; tests/matrix_settle.rs): the
// O(1) algorithms, several policies all or nothing, debt.

/// A reserve the model admitted: per item recorded, its window and the
/// estimate; settled at most once.
#[derive(Clone, Debug)]
pub struct Reserved {
    pub items: Vec<Item>,
    pub recorded: Vec<(usize, WinKey, u32)>,
    pub settled: bool,
}

impl Model {
    /// Resolves a reserve's or a settle's items (the decoder's duplicate
    /// check first, then per item in order: unknown, kind, combination
    /// (the log, shards: UNSUPPORTED_COMBINATION), cost (reserves only)).
    fn resolve_o1(&self, items: &[Item], settle: bool) -> Result<Vec<(PolicySpec, Option<u32>)>, u16> {
        for (i, it) in items.iter().enumerate() {
            if items[..i].iter().any(|o| o.policy == it.policy && o.key == it.key) {
                return Err(code::DUPLICATE_ITEM);
            }
        }
        let mut out = Vec::new();
        for it in items {
            let Some(p) = self.config.policy(&it.policy) else { return Err(code::UNKNOWN_POLICY) };
            let Some(a) = p.algorithm() else { return Err(code::WRONG_POLICY_KIND) };
            if matches!(a, Algorithm::Log | Algorithm::Ring) || p.shards() > 1 {
                return Err(code::UNSUPPORTED_COMBINATION);
            }
            let limit = p.limit_for(&it.key);
            if !settle && limit.is_some_and(|l| it.cost > l) {
                return Err(code::INVALID_COST);
            }
            out.push((p.clone(), limit));
        }
        Ok(out)
    }

    /// A reserve (CHECK_POLICY with the settle flag) of `items`: decided as
    /// a multi-item check of their estimates under each policy's own
    /// algorithm, all or nothing; admitted with something recorded, the
    /// record a SETTLE finds (and a handle). Redis down: the fail policies,
    /// no handle, nothing to settle.
    pub fn reserve(&mut self, items: &[Item], fail: (FailPolicy, u32), clock: Clock) -> (Expect, Option<Reserved>) {
        self.decisions += 1;
        let resolved = match self.resolve_o1(items, false) {
            Ok(r) => r,
            Err(c) => return (Expect::One(Want::error(c)), None),
        };
        if self.outage {
            return (self.reserve_outage(items, &resolved, fail, clock), None);
        }
        let (mut wants, fits_all, refusing) = self.item_verdicts(items, &resolved, |p, n, limit, cost| {
            let (fits, mut want) = self.verdict(p.algorithm().expect("a rate policy"), n, limit, cost, false, clock);
            // No denial cache for reserves: the store answers.
            want.sources = vec![self.store_source()];
            (fits, want)
        });
        let committed = refusing.is_empty();
        let mut recorded = Vec::new();
        for (i, ((it, f), w)) in items.iter().zip(&fits_all).zip(wants.iter_mut()).enumerate() {
            match f {
                Some((wk, true)) if committed => {
                    *self.windows.entry(wk.clone()).or_default() += it.cost;
                    recorded.push((i, wk.clone(), it.cost));
                }
                Some((wk, true)) => {
                    // S8: the window as it stands without this request (a
                    // reserve taken back: retry 0).
                    let n = self.windows.get(wk).copied().unwrap_or(0);
                    w.count = Num::Is(n);
                    w.remaining = Num::Is(w.limit.saturating_sub(n));
                    w.retry = (0, 0);
                    w.reset = (0, 2 * DAY);
                }
                _ => {}
            }
        }
        let handle = !recorded.is_empty();
        let want = Expect::Multi(WantMulti { items: wants, refusing, handle: Some(handle), may_skip: false, refused_numbers: self.refused_numbers, shadow_fields: self.shadow_fields, outage: false });
        (want, handle.then(|| Reserved { items: items.to_vec(), recorded, settled: false }))
    }

    /// A reserve while Redis is down: each item's fail policy, as a
    /// multi-item check's (the `local` items together in the per-host log
    /// windows of the policy's window length), never a handle.
    fn reserve_outage(&mut self, items: &[Item], resolved: &[(PolicySpec, Option<u32>)], fail: (FailPolicy, u32), clock: Clock) -> Expect {
        let Expect::Multi(mut m) = self.multi_outage(items, resolved, fail, clock) else { unreachable!("a multi-item answer") };
        let e = clock.elapsed_ms + 5;
        for (w, (p, _)) in m.items.iter_mut().zip(resolved) {
            if w.sources == [Source::LocalFallback] && w.window_ms != p.window_ms() {
                // multi_outage times the log's window: the per-host log
                // window here has the policy's length.
                let len = p.window_ms();
                let fitted = w.retry == (0, 0);
                w.window_ms = len;
                w.reset = if fitted { (len.saturating_sub(e), len) } else { (0, len + 1) };
                if !fitted {
                    w.retry = (0, len + 1);
                }
            }
        }
        Expect::Multi(m)
    }

    /// A SETTLE of `items` (each cost the actual) with the handle of
    /// `reserved` (`None`: forged or foreign): each item with a record
    /// moves its window by actual - estimate (never below 0; past the limit:
    /// debt), once. Answer: allowed, the enforced settled item with the
    /// least room's numbers, count 0 when nothing matched (its retry_after:
    /// a fixed window's debt may span many windows, up to 20 days here).
    pub fn settle(&mut self, items: &[Item], reserved: Option<&mut Reserved>) -> Expect {
        self.decisions += 1;
        let resolved = match self.resolve_o1(items, true) {
            Ok(r) => r,
            Err(c) => return Expect::One(Want::error(c)),
        };
        if resolved.iter().all(|(_, l)| l.is_none()) {
            return Expect::One(Want { decision: Decision::Allowed, sources: vec![Source::Exempt], ..Want::error(code::OK) });
        }
        if self.outage {
            return Expect::One(Want { decision: Decision::Error, sources: vec![self.store_source(), Source::None], outage: true, ..Want::error(code::OK) });
        }
        let mut main: Option<(bool, u32, u32)> = None;
        if let Some(r) = reserved.filter(|r| !r.settled) {
            r.settled = true;
            for (it, (p, limit)) in items.iter().zip(&resolved) {
                let Some(limit) = *limit else { continue };
                let wk = (policy_scope(p), it.key.clone());
                let Some(&(_, _, est)) = r.recorded.iter().find(|(_, k, _)| *k == wk) else { continue };
                let w = self.windows.entry(wk).or_default();
                *w = (*w + it.cost).saturating_sub(est);
                let (n, left) = (*w, limit.saturating_sub(*w));
                let better = match main {
                    None => true,
                    Some((shadow, _, l)) => (shadow && !p.shadow) || (shadow == p.shadow && left < l),
                };
                if better {
                    main = Some((p.shadow, n, left));
                }
            }
        }
        let (count, remaining) = main.map_or((0, 0), |(_, n, l)| (n, l));
        Expect::One(Want { decision: Decision::Allowed, sources: vec![self.store_source()], count: Num::Is(count), remaining: Num::Is(remaining), retry: (0, 20 * DAY), reset: (0, 2 * DAY), ..Want::error(code::OK) })
    }
}

/// A daemon's answer in one line, its items included, for a failure
/// message of the matrices.
pub fn short(r: &Response) -> String {
    let mut s = format!("{:?} {:?} count {} remaining {} retry {} reset {} error {:?}", r.decision, r.source, r.count, r.remaining, r.retry_after_ms, r.reset_ms, r.error);
    if let Some(e) = r.extension.as_deref() {
        let _ = write!(s, " refused {} handle {}", e.refused, e.handle.is_some());
        for it in &e.items {
            let _ = write!(s, " [{:?} {:?} {}/{} r{} t{} l{} w{}]", it.decision, it.source, it.count, it.remaining, it.retry_after_ms, it.reset_ms, it.limit, it.window_ms);
        }
    }
    s
}
