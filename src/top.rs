//! `ratelimitd top`: reads `GET /top.json` from the daemon's metrics
//! endpoint, turns two documents an interval apart into rates, and prints
//! them as a live terminal view, plain text snapshots or JSON.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde::Serialize;

use crate::terminal::{escape, json_ascii_safe};
use crate::top_snapshot::{Gauges, KeyLists, TopDoc, FORMAT};

/// Connect, send and read deadlines of one fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(3);
/// A document larger than this is not one of ours.
const MAX_RESPONSE: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TopError {
    /// The io error is in the message, not a source: it would be printed twice.
    #[error("cannot reach the daemon's metrics endpoint at {addr}: {error}; is ratelimitd running, with [metrics] listen = \"{addr}\"?")]
    Unreachable { addr: String, error: std::io::Error },
    #[error("{addr}: {what}")]
    BadAnswer { addr: String, what: String },
}

fn bad(addr: &str, what: impl Into<String>) -> TopError {
    TopError::BadAnswer { addr: addr.to_string(), what: what.into() }
}

/// One `GET /top.json` from `addr` (host:port) over plain HTTP/1.1.
pub fn fetch(addr: &str) -> Result<TopDoc, TopError> {
    let unreachable = |error| TopError::Unreachable { addr: addr.to_string(), error };
    let sockaddrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(unreachable)?.collect();
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    let mut stream = None;
    for a in sockaddrs {
        match TcpStream::connect_timeout(&a, FETCH_TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let mut stream = stream.ok_or_else(|| unreachable(last))?;
    let io = |e: std::io::Error| bad(addr, format!("reading /top.json: {e}"));
    stream.set_read_timeout(Some(FETCH_TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(FETCH_TIMEOUT)).map_err(io)?;
    stream.write_all(format!("GET /top.json HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).map_err(io)?;
    let mut raw = Vec::new();
    stream.take(MAX_RESPONSE).read_to_end(&mut raw).map_err(io)?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad(addr, "not an HTTP response"))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status = head.split(' ').nth(1).unwrap_or("");
    match status {
        "200" => {}
        "404" => return Err(bad(addr, "no /top.json here: not a ratelimitd metrics endpoint, or a daemon older than this command")),
        s => return Err(bad(addr, format!("GET /top.json answered HTTP {}", escape(s)))),
    }
    let doc: TopDoc = serde_json::from_slice(&raw[split + 4..]).map_err(|e| bad(addr, format!("/top.json is not a document this command reads: {e}")))?;
    if doc.format != FORMAT {
        return Err(bad(addr, format!("/top.json has format {}, this command reads {FORMAT}", doc.format)));
    }
    Ok(doc)
}

/// One policy over an interval.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRates {
    pub name: String,
    pub limit: u32,
    pub window_ms: u32,
    pub shadow: bool,
    /// Requests per second by outcome, over the interval.
    pub per_s: BTreeMap<String, f64>,
    /// Requests by outcome since the daemon started.
    pub total: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RedisRates {
    pub calls_per_s: f64,
    /// Quantiles of the calls of the interval, from the histogram (linear
    /// within a bucket; the last bound when above it); null without calls.
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
}

/// What `top` shows: rates over the interval between two documents, and
/// the newer document's gauges and refused keys.
#[derive(Debug, Clone, Serialize)]
pub struct View {
    pub interval_s: f64,
    #[serde(flatten)]
    pub gauges: Gauges,
    /// All responses per second by decision (both ops).
    pub decisions_per_s: BTreeMap<String, f64>,
    pub redis: RedisRates,
    pub policies: Vec<PolicyRates>,
    pub unknown_policy_per_s: f64,
    pub unknown_policy_total: u64,
    #[serde(flatten)]
    pub keys: KeyLists,
}

/// The quantile `q` of the calls counted in `delta` (per bucket).
fn quantile(bounds_us: &[u64], delta: &[u64], q: f64) -> Option<f64> {
    let total: u64 = delta.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut seen = 0u64;
    for (i, &n) in delta.iter().enumerate() {
        if n > 0 && (seen + n) as f64 >= rank {
            let Some(&upper) = bounds_us.get(i) else {
                return bounds_us.last().map(|&b| b as f64);
            };
            let lower = if i == 0 { 0 } else { bounds_us[i - 1] };
            return Some(lower as f64 + (upper - lower) as f64 * ((rank - seen as f64) / n as f64));
        }
        seen += n;
    }
    bounds_us.last().map(|&b| b as f64)
}

/// The outcome `top` adds to a policy's: requests nginx admitted from
/// worker shares (never sent to the daemon), in the "admit" column.
pub const FROM_SHARES: &str = "admitted_from_shares";

impl View {
    /// The rates between `old` and `new`; if the daemon restarted in
    /// between, since its start.
    pub fn between(old: &TopDoc, new: &TopDoc) -> Self {
        let restarted = new.uptime_ms < old.uptime_ms;
        let ms = if restarted { new.uptime_ms } else { new.uptime_ms - old.uptime_ms };
        let secs = (ms as f64 / 1000.0).max(0.001);
        let rate = |a: u64, b: u64| if restarted || b < a { b as f64 / secs } else { (b - a) as f64 / secs };
        let mut decisions_per_s: BTreeMap<String, f64> = BTreeMap::new();
        for d in &new.decisions {
            let before = old.decisions.iter().find(|o| o.decision == d.decision && o.source == d.source).map_or(0, |o| o.count);
            *decisions_per_s.entry(d.decision.clone()).or_default() += rate(before, d.count);
        }
        let before = |i: usize| if restarted { 0 } else { old.redis_latency.counts.get(i).copied().unwrap_or(0) };
        let delta: Vec<u64> = new.redis_latency.counts.iter().enumerate().map(|(i, &n)| n.saturating_sub(before(i))).collect();
        let bounds = &new.redis_latency.bounds_us;
        let policies = new
            .policies
            .iter()
            .map(|p| {
                let before = old.policies.iter().find(|o| o.name == p.name);
                let mut per_s: BTreeMap<String, f64> = p.outcomes.iter().map(|(o, &n)| (o.clone(), rate(before.and_then(|b| b.outcomes.get(o)).copied().unwrap_or(0), n))).collect();
                let mut total = p.outcomes.clone();
                // nginx's admissions from worker shares: units handed less
                // units given back (two counters, each rising).
                let handed = rate(before.map_or(0, |b| b.share_units), p.share_units);
                let given_back = rate(before.map_or(0, |b| b.share_units_given_back), p.share_units_given_back);
                per_s.insert(FROM_SHARES.into(), (handed - given_back).max(0.0));
                total.insert(FROM_SHARES.into(), p.share_units.saturating_sub(p.share_units_given_back));
                PolicyRates { name: p.name.clone(), limit: p.limit, window_ms: p.window_ms, shadow: p.shadow, per_s, total }
            })
            .collect();
        View {
            interval_s: secs,
            gauges: new.gauges,
            decisions_per_s,
            redis: RedisRates { calls_per_s: delta.iter().sum::<u64>() as f64 / secs, p50_us: quantile(bounds, &delta, 0.5), p99_us: quantile(bounds, &delta, 0.99) },
            policies,
            unknown_policy_per_s: rate(old.unknown_policy_requests, new.unknown_policy_requests),
            unknown_policy_total: new.unknown_policy_requests,
            keys: new.keys.clone(),
        }
    }

    /// The view as text: `keys` refused keys at most, lines cut at `width`.
    pub fn render(&self, addr: &str, keys: usize, width: usize) -> String {
        let mut out = String::new();
        let mut line = |s: String| {
            let cut: String = s.chars().take(width).collect();
            out.push_str(cut.trim_end());
            out.push('\n');
        };
        let r = |v: f64| if v >= 100.0 || v == 0.0 { format!("{v:.0}") } else { format!("{v:.1}") };
        let d = |name: &str| self.decisions_per_s.get(name).copied().unwrap_or(0.0);
        let all: f64 = self.decisions_per_s.values().sum();
        line(format!("ratelimitd top - {addr} - rates over {:.1} s", self.interval_s));
        line(format!(
            "decisions/s {}: allowed {}  denied {}  shadow_denied {}  error {}   in flight {}  connections {}",
            r(all),
            // A shadow policy with room admitted the request like any other.
            r(d("allowed") + d("shadow_allowed")),
            r(d("denied")),
            r(d("shadow_denied")),
            r(d("error")),
            self.gauges.requests_in_flight,
            self.gauges.connections_open
        ));
        let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0} us"));
        let breaker = match self.gauges.breaker_open {
            Some(true) => "OPEN",
            Some(false) => "closed",
            None => "- (no redis)",
        };
        line(format!(
            "redis: {} calls/s  p50 {}  p99 {}  breaker {breaker}  in-flight limit {}",
            r(self.redis.calls_per_s),
            us(self.redis.p50_us),
            us(self.redis.p99_us),
            self.gauges.redis_in_flight_limit
        ));
        line(String::new());
        // The outcomes, per second; local = the fallback quota's decisions.
        const COLS: [(&str, &[&str]); 9] = [
            ("admit", &["admitted", FROM_SHARES]),
            ("refuse", &["refused"]),
            ("cached", &["refused_from_cache"]),
            ("shadow", &["shadow_refused"]),
            ("exempt", &["exempt"]),
            ("f_open", &["fail_open"]),
            ("f_closed", &["fail_closed"]),
            ("local", &["fail_local_admitted", "fail_local_refused"]),
            ("error", &["error"]),
        ];
        // As wide as the longest name (shadow marked), at least 16. Names
        // and keys come from the endpoint, keys from clients: escaped
        // (src/terminal.rs), so no control or bidi override reaches the
        // terminal.
        let label = |p: &PolicyRates| if p.shadow { format!("{} (shadow)", escape(&p.name)) } else { escape(&p.name).into_owned() };
        let w = self.policies.iter().map(|p| label(p).len() + 1).max().unwrap_or(0).max(16);
        let mut head = format!("{:<w$}{:>9}", "POLICY (/s)", "total");
        for (c, _) in COLS {
            head += &format!("{c:>9}");
        }
        line(head);
        for p in &self.policies {
            let name = label(p);
            let mut row = format!("{name:<w$}{:>9}", r(p.per_s.values().sum()));
            for (_, outcomes) in COLS {
                row += &format!("{:>9}", r(outcomes.iter().map(|o| p.per_s.get(*o).copied().unwrap_or(0.0)).sum()));
            }
            line(row);
        }
        if self.policies.is_empty() {
            line("(no [[policy]] configured)".into());
        }
        if self.unknown_policy_total > 0 {
            line(format!("unknown policy names: {}/s ({} since start): a location names a policy the daemon does not have", r(self.unknown_policy_per_s), self.unknown_policy_total));
        }
        line(String::new());
        let t = &self.keys.top_refused;
        line(format!(
            "TOP REFUSED KEYS, last {} s: {} refusals recorded{}; REFUSED may count up to ERROR too many",
            t.window_ms / 1000,
            t.recorded,
            if t.skipped > 0 { format!(" ({} skipped since start)", t.skipped) } else { String::new() }
        ));
        line(format!("{:>9}{:>7}  {:<16}KEY", "REFUSED", "ERROR", "POLICY"));
        for k in t.keys.iter().take(keys) {
            let key = escape(&k.key);
            let key = if k.key_truncated { format!("{key}...") } else { key.into_owned() };
            let policy = k.policy.as_deref().map_or(Cow::Borrowed("(inline)"), escape);
            line(format!("{:>9}{:>7}  {policy:<16}{key}", k.refused, k.error));
        }
        if t.keys.is_empty() {
            line("(none)".into());
        }
        // The penalty box and the admin API's overrides: shown when there are any.
        if self.keys.bans_known > 0 {
            line(String::new());
            line(format!("BANNED KEYS (penalty box), known to this daemon: {}", self.keys.bans_known));
            line(format!("{:>9}  {:<16}KEY", "ENDS IN", "POLICY"));
            for b in self.keys.bans.iter().take(keys) {
                line(format!("{:>8}s  {:<16}{}", b.ends_in_ms.div_ceil(1000), escape(&b.policy), escape(&b.key)));
            }
        }
        if self.keys.overrides_in_force > 0 {
            line(String::new());
            line(format!("OVERRIDES IN FORCE (admin API): {}", self.keys.overrides_in_force));
            line(format!("{:>11}  {:<24}  {:<16}KEY", "LIMIT", "UNTIL (UTC)", "POLICY"));
            for o in self.keys.overrides.iter().take(keys) {
                let limit = o.limit.map_or("unlimited".to_string(), |l| l.to_string());
                line(format!("{limit:>11}  {:<24}  {:<16}{}", crate::admin_api::time::format_utc(o.expires_at_ms), escape(&o.policy), escape(&o.key)));
            }
        }
        out
    }
}

/// How `run` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Redraw the terminal in place.
    Live,
    /// One text snapshot after another (no terminal).
    Plain,
    /// One JSON object per line.
    Json,
}

/// Fetches, waits `interval`, fetches again, prints the view; `count` times
/// (None: until interrupted). The first fetch failing is an error; with
/// `Live`, a later one is shown in place and retried.
pub fn run(addr: &str, output: Output, interval: Duration, count: Option<u64>, keys: usize, out: &mut dyn Write) -> Result<(), TopError> {
    let mut old = fetch(addr)?;
    let mut shown = 0u64;
    while count.map_or(true, |c| shown < c) {
        std::thread::sleep(interval);
        let new = match fetch(addr) {
            Ok(d) => d,
            Err(e) if output == Output::Live => {
                let _ = write!(out, "\x1b[H\x1b[2Jratelimitd top - {addr}\n\n{e}\n(retrying every {:.1} s)\n", interval.as_secs_f64());
                let _ = out.flush();
                continue;
            }
            Err(e) => return Err(e),
        };
        let view = View::between(&old, &new);
        let written = match output {
            Output::Json => writeln!(out, "{}", json_ascii_safe(&serde_json::to_string(&view).expect("plain data serializes"))),
            Output::Plain => writeln!(out, "{}", view.render(addr, keys, usize::MAX)),
            Output::Live => {
                let width = std::env::var("COLUMNS").ok().and_then(|c| c.parse().ok()).unwrap_or(160);
                write!(out, "\x1b[H\x1b[2J{}", view.render(addr, keys, width))
            }
        };
        // A closed pipe (`top | head`) ends the command quietly.
        if written.and_then(|()| out.flush()).is_err() {
            return Ok(());
        }
        old = new;
        shown += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::top_snapshot::{BanDoc, OverrideDoc};

    fn doc(uptime_ms: u64, admitted: u64, allowed: u64, calls: [u64; 3]) -> TopDoc {
        use crate::top_snapshot::{DecisionCount, Histogram, PolicyCounts, TopRefusedDoc};
        TopDoc {
            format: FORMAT,
            uptime_ms,
            gauges: Gauges { breaker_open: Some(false), requests_in_flight: 1, connections_open: 2, redis_in_flight_limit: 64 },
            decisions: vec![DecisionCount { decision: "allowed".into(), source: "redis".into(), count: allowed }],
            redis_latency: Histogram { bounds_us: vec![100, 250], counts: calls.to_vec(), sum_us: 0 },
            policies: vec![PolicyCounts { name: "order".into(), limit: 5, window_ms: 1000, shadow: false, outcomes: BTreeMap::from([("admitted".into(), admitted)]), share_units: 0, share_units_given_back: 0 }],
            unknown_policy_requests: 0,
            keys: KeyLists { top_refused: TopRefusedDoc { window_ms: 0, recorded: 0, skipped: 0, k: 64, keys: vec![] }, bans: vec![], bans_known: 0, overrides: vec![], overrides_in_force: 0 },
        }
    }

    #[test]
    fn bans_and_overrides_in_force_are_shown_escaped_and_only_when_there_are_any() {
        let plain = View::between(&doc(1000, 1, 1, [0, 0, 0]), &doc(2000, 2, 2, [0, 0, 0])).render("a", 10, usize::MAX);
        assert!(!plain.contains("BANNED") && !plain.contains("OVERRIDES"), "{plain}");
        let mut new = doc(2000, 2, 2, [0, 0, 0]);
        new.keys.bans = vec![BanDoc { policy: "login".into(), key: "1.2.3.4\u{1b}[2J".into(), ends_in_ms: 59_001 }];
        new.keys.bans_known = 1;
        new.keys.overrides = vec![OverrideDoc { policy: "per_tenant".into(), key: "tenant-x".into(), limit: Some(5000), expires_at_ms: 1_796_547_600_000 }, OverrideDoc { policy: "per_tenant".into(), key: "vip".into(), limit: None, expires_at_ms: 1_796_547_600_000 }];
        new.keys.overrides_in_force = 2;
        let text = View::between(&doc(1000, 1, 1, [0, 0, 0]), &new).render("a", 10, usize::MAX);
        assert!(text.contains("BANNED KEYS (penalty box), known to this daemon: 1"), "{text}");
        assert!(text.contains("60s  login"), "{text}");
        assert!(!text.contains('\u{1b}'), "a client's key never reaches the terminal raw: {text}");
        assert!(text.contains("OVERRIDES IN FORCE (admin API): 2"), "{text}");
        assert!(text.contains("5000  2026-12-06T09:00:00.000Z  per_tenant      tenant-x"), "{text}");
        assert!(text.contains("unlimited  2026-12-06T09:00:00.000Z  per_tenant      vip"), "{text}");
    }

    #[test]
    fn rates_between_two_documents_and_after_a_restart() {
        let v = View::between(&doc(1000, 10, 10, [0, 0, 0]), &doc(3000, 30, 50, [10, 10, 0]));
        assert_eq!(v.interval_s, 2.0);
        assert_eq!(v.decisions_per_s["allowed"], 20.0);
        assert_eq!(v.policies[0].per_s["admitted"], 10.0);
        assert_eq!(v.policies[0].total["admitted"], 30);
        assert_eq!((v.redis.calls_per_s, v.redis.p50_us), (10.0, Some(100.0)));
        // The daemon restarted: its counters start again from 0.
        let v = View::between(&doc(9000, 30, 50, [10, 10, 0]), &doc(1000, 4, 4, [0, 0, 0]));
        assert_eq!(v.policies[0].per_s["admitted"], 4.0);
        assert_eq!(v.redis.p99_us, None);
        let text = v.render("127.0.0.1:9464", 20, 200);
        assert!(text.contains("\norder ") && text.contains("breaker closed") && text.contains("(none)"), "{text}");
    }

    #[test]
    fn client_chosen_keys_never_reach_the_terminal_raw() {
        use crate::top_snapshot::RefusedKey;
        // A CSI (U+009B) that would clear the screen, ESC, a right-to-left
        // override and an isolate that would show the key reversed.
        let hostile = "t\u{9b}2J\x1b[31m\u{202e}nimda\u{2066}x\u{2069}\u{200f}";
        let mut new = doc(2000, 1, 1, [0, 0, 0]);
        new.policies[0].name = "ord\u{85}er".into();
        new.keys.top_refused.keys = vec![
            RefusedKey { policy: Some("per\u{202e}tenant".into()), key: hostile.into(), key_truncated: true, refused: 3, error: 0 },
            RefusedKey { policy: None, key: hostile.into(), key_truncated: false, refused: 2, error: 0 },
        ];
        let v = View::between(&doc(1000, 0, 0, [0, 0, 0]), &new);
        let text = v.render("127.0.0.1:9464", 20, 500);
        assert!(!text.chars().any(|c| crate::terminal::is_unsafe(c) && c != '\n'), "{text:?}");
        assert!(text.contains("t\\u{009b}2J\\x1b[31m\\u{202e}nimda\\u{2066}x\\u{2069}\\u{200f}..."), "shown, escaped: {text}");
        assert!(text.contains("per\\u{202e}tenant") && text.contains("ord\\u{0085}er"), "{text}");
        // `--json` (what `run` prints): the same key once parsed, no raw control.
        let line = json_ascii_safe(&serde_json::to_string(&v).unwrap()).into_owned();
        assert!(!line.chars().any(crate::terminal::is_unsafe), "{line}");
        let back: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(back["top_refused"]["keys"][0]["key"], hostile, "the JSON still carries the key itself");
    }

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let bounds = [100, 250, 500];
        assert_eq!(quantile(&bounds, &[0, 0, 0, 0], 0.5), None);
        assert_eq!(quantile(&bounds, &[10, 0, 0, 0], 0.5), Some(50.0));
        assert_eq!(quantile(&bounds, &[0, 10, 0, 0], 0.5), Some(175.0));
        assert_eq!(quantile(&bounds, &[98, 0, 0, 2], 0.99), Some(500.0));
        assert_eq!(quantile(&bounds, &[50, 50, 0, 0], 0.99), Some(100.0 + 150.0 * 0.98));
    }
}
