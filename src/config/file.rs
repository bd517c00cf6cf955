//! The configuration file's schema, as serde reads it: plain numbers and
//! strings with their defaults. `Config::from_file` turns it into typed
//! values once; nothing downstream sees this form.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::model::{ClockSource, ConfigError, LogFormat, ParseError};
use crate::protocol::Bounds;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub(super) struct File {
    pub server: ServerSection,
    pub redis: Option<RedisSection>,
    pub limits: LimitsSection,
    pub log: LogSection,
    pub metrics: Option<MetricsSection>,
    pub denial_cache: DenialCacheSection,
    pub admin: AdminSection,
    /// `[[policy]]` tables, in file order.
    pub policy: Vec<PolicySection>,
    /// The Envoy rate limit service front (docs/ENVOY.md).
    pub envoy: Option<EnvoySection>,
}

/// One `[[policy]]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PolicySection {
    // A field of type Option is None when the table leaves it out; the
    // others that may be left out say their default.
    pub name: String,
    pub limit: u64,
    /// A duration: "500ms", "1s", "1m", "1h", "1d"; or "month" (fixed only).
    /// Absent for algorithm = "concurrency" (which has a `lease` instead).
    #[serde(default, deserialize_with = "duration_text")]
    pub window: String,
    /// "+02:00": fixed windows aligned to this offset's midnight (fixed only).
    pub utc_offset: Option<String>,
    /// The fail policy, named as in Lua and the command line.
    pub on_error: Option<String>,
    /// The old name of `on_error`: accepted, with a deprecation line.
    pub fail_policy: Option<String>,
    pub local_limit: Option<u64>,
    #[serde(default)]
    pub shadow: bool,
    /// "log" (default), "ring", ...: how the policy's windows count.
    pub algorithm: Option<String>,
    /// A concurrency policy's lease: how long a slot is held if never released.
    pub lease: Option<String>,
    /// Hot-key shards: the key's quota split over this many windows.
    pub shards: Option<i64>,
    /// The penalty box: `{ after = N, within = "W", ban = "D" }`.
    pub penalty: Option<PenaltySection>,
    /// Exact key to a limit or "unlimited"; a BTreeMap so errors come in a
    /// stable order.
    #[serde(default)]
    pub overrides: std::collections::BTreeMap<String, OverrideValue>,
    #[serde(default)]
    pub allowlist: Vec<String>,
}

impl PolicySection {
    /// A policy written by another source (an envoyproxy/ratelimit YAML
    /// limit), validated as if the file held it. `on_error = "local"`
    /// takes the limit as the per-host quota.
    pub fn synthesized(name: String, limit: u64, window: String, algorithm: String, on_error: String, shadow: bool) -> Self {
        let local_limit = (on_error == "local").then_some(limit);
        Self {
            name,
            limit,
            window,
            utc_offset: None,
            on_error: Some(on_error),
            fail_policy: None,
            local_limit,
            shadow,
            algorithm: Some(algorithm),
            lease: None,
            shards: None,
            penalty: None,
            overrides: Default::default(),
            allowlist: Vec::new(),
        }
    }
}

/// A policy's `penalty = { after = N, within = "W", ban = "D" }` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PenaltySection {
    pub after: i64,
    pub within: String,
    pub ban: String,
}

/// An override as written: a number or a word (only "unlimited" is valid).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum OverrideValue {
    Limit(i64),
    Word(String),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct DenialCacheSection {
    pub enabled: bool,
    pub slots: usize,
    /// `max_age = "1s"`; `max_ms` is its old spelling.
    #[serde(deserialize_with = "optional_duration_text")]
    pub max_age: Option<String>,
    pub max_ms: Option<u64>,
}

impl Default for DenialCacheSection {
    fn default() -> Self {
        Self { enabled: true, slots: 16_384, max_age: None, max_ms: None }
    }
}

/// `[admin]`: the admin API's listener and the overrides' refresh.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct AdminSection {
    /// A socket path, or a host:port (then `token_file` is required).
    pub listen: Option<String>,
    pub socket_mode: String,
    pub token_file: Option<PathBuf>,
    pub read_token_file: Option<PathBuf>,
    pub overrides_refresh: String,
    /// TLS on a TCP listener: the certificate chain and its key (PEM).
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// The CA the command line trusts for the API (default: `tls_cert_file`).
    pub tls_ca_file: Option<PathBuf>,
    /// Connections the admin listener holds open at most.
    pub max_connections: u64,
    /// How long each phase of an admin request may wait for the peer.
    pub read_timeout: String,
}

impl Default for AdminSection {
    fn default() -> Self {
        Self {
            listen: None,
            socket_mode: "0600".into(),
            token_file: None,
            read_token_file: None,
            overrides_refresh: "1s".into(),
            tls_cert_file: None,
            tls_key_file: None,
            tls_ca_file: None,
            max_connections: super::model::ADMIN_MAX_CONNECTIONS_DEFAULT as u64,
            read_timeout: "10s".into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MetricsSection {
    pub listen: std::net::SocketAddr,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct ServerSection {
    pub listen: PathBuf,
    pub socket_mode: String,
    pub socket_group: Option<String>,
    pub max_connections: usize,
    pub max_in_flight_per_connection: usize,
    /// Durations with their unit ("5s"); the `*_ms` numbers are their old
    /// spelling, read with a deprecation line.
    #[serde(deserialize_with = "optional_duration_text")]
    pub shutdown_grace: Option<String>,
    #[serde(deserialize_with = "optional_duration_text")]
    pub idle_timeout: Option<String>,
    #[serde(deserialize_with = "optional_duration_text")]
    pub frame_timeout: Option<String>,
    #[serde(deserialize_with = "optional_duration_text")]
    pub write_timeout: Option<String>,
    pub shutdown_grace_ms: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
    pub frame_timeout_ms: Option<u64>,
    pub write_timeout_ms: Option<u64>,
    pub worker_threads: usize,
    /// µs the runtime's worker keeps polling after a frame before it
    /// parks (src/spin.rs); 0: never spins.
    pub spin_us: u64,
}

/// `server.spin_us` unset: no spin (src/spin.rs, docs/CONFIG.md).
pub(super) const DEFAULT_SPIN_US: u64 = 0;

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            listen: PathBuf::from("/run/ratelimitd/ratelimitd.sock"),
            socket_mode: "0660".into(),
            socket_group: None,
            max_connections: 4096,
            max_in_flight_per_connection: 128,
            shutdown_grace: None,
            idle_timeout: None,
            frame_timeout: None,
            write_timeout: None,
            shutdown_grace_ms: None,
            idle_timeout_ms: None,
            frame_timeout_ms: None,
            write_timeout_ms: None,
            worker_threads: 1,
            spin_us: DEFAULT_SPIN_US,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RedisSection {
    pub url: Option<String>,
    pub cluster: Option<Vec<String>>,
    pub cluster_tls: bool,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub password_env: Option<String>,
    pub tls_ca_file: Option<PathBuf>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// `timeout = "20ms"`; `timeout_ms` is its old spelling.
    #[serde(deserialize_with = "optional_duration_text")]
    pub timeout: Option<String>,
    #[serde(deserialize_with = "optional_duration_text")]
    pub connect_timeout: Option<String>,
    pub timeout_ms: Option<u64>,
    pub connect_timeout_ms: Option<u64>,
    pub breaker_failures: u32,
    pub min_in_flight: u32,
    pub max_in_flight: u32,
    pub key_prefix: String,
    pub clock: ClockSource,
    /// Unset: on, but off with a Cluster (docs/CONFIG.md, "Fast by default").
    pub quota_leases: Option<bool>,
    /// Unset: on where the topology allows (not a Cluster).
    pub batch_cold_keys: Option<bool>,
    pub sentinel: Option<SentinelSection>,
}

impl Default for RedisSection {
    fn default() -> Self {
        Self {
            url: None,
            cluster: None,
            cluster_tls: false,
            username: None,
            password_file: None,
            password_env: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            timeout: None,
            connect_timeout: None,
            timeout_ms: None,
            connect_timeout_ms: None,
            breaker_failures: 5,
            min_in_flight: 16,
            max_in_flight: 1024,
            key_prefix: "ratelimitd:".into(),
            clock: ClockSource::Redis,
            // On by default: docs/CONFIG.md says what each costs and why.
            quota_leases: None,
            batch_cold_keys: None,
            sentinel: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SentinelSection {
    pub master_name: String,
    pub addresses: Vec<String>,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub password_env: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct LimitsSection {
    pub max_key_len: usize,
    pub max_limit: u32,
    pub max_window_ms: u32,
    pub max_cost: u32,
    pub max_local_keys: usize,
}

impl Default for LimitsSection {
    fn default() -> Self {
        let b = Bounds::default();
        Self { max_key_len: b.max_key_len, max_limit: b.max_limit, max_window_ms: b.max_window_ms, max_cost: b.max_cost, max_local_keys: 1_000_000 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct LogSection {
    pub level: String,
    pub format: LogFormat,
}

impl Default for LogSection {
    fn default() -> Self {
        Self { level: "info".into(), format: LogFormat::Text }
    }
}

/// A duration's text; a bare number is kept as its digits, which the
/// validation refuses with a message naming the unit to write (a number
/// alone would leave the unit to a guess: `window = 60000`).
fn duration_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        Text(String),
        Number(i64),
    }
    Ok(match Text::deserialize(d)? {
        Text::Text(s) => s,
        Text::Number(n) => n.to_string(),
    })
}

/// `duration_text` of a field that may be absent.
fn optional_duration_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    duration_text(d).map(Some)
}

impl File {
    /// Every duration the file writes, by field path (`server.idle_timeout`,
    /// `policy.login.window`), as written: `GET /config` shows a duration
    /// as the file wrote it when it still holds that value (show.rs).
    pub(super) fn written_durations(&self) -> std::collections::BTreeMap<String, String> {
        let mut w = std::collections::BTreeMap::new();
        let mut put = |path: String, text: Option<&String>| {
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                w.insert(path, t.clone());
            }
        };
        let s = &self.server;
        put("server.shutdown_grace".into(), s.shutdown_grace.as_ref());
        put("server.idle_timeout".into(), s.idle_timeout.as_ref());
        put("server.frame_timeout".into(), s.frame_timeout.as_ref());
        put("server.write_timeout".into(), s.write_timeout.as_ref());
        if let Some(r) = &self.redis {
            put("redis.timeout".into(), r.timeout.as_ref());
            put("redis.connect_timeout".into(), r.connect_timeout.as_ref());
        }
        put("denial_cache.max_age".into(), self.denial_cache.max_age.as_ref());
        put("admin.overrides_refresh".into(), Some(&self.admin.overrides_refresh));
        put("admin.read_timeout".into(), Some(&self.admin.read_timeout));
        for p in &self.policy {
            put(format!("policy.{}.window", p.name), Some(&p.window));
            put(format!("policy.{}.lease", p.name), p.lease.as_ref());
            if let Some(pen) = &p.penalty {
                put(format!("policy.{}.penalty.within", p.name), Some(&pen.within));
                put(format!("policy.{}.penalty.ban", p.name), Some(&pen.ban));
            }
        }
        w
    }
}

/// Most errors one parse reports: each is found by parsing again without
/// the lines of the ones before.
const MAX_PARSE_ERRORS: usize = 32;

/// Parses the file's text into its schema, reporting every error serde
/// finds, not only the first: after each, the offending lines are blanked
/// (line numbers kept) and the text parsed again. Each error names its line
/// and its field (`server.socket_mode`, `policy.limit` with the policy's
/// name), and an unknown name comes with the nearest valid one. A syntax
/// error stops at once: what follows it cannot be read.
pub(super) fn parse(path: &Path, text: &str) -> Result<File, ConfigError> {
    if let Err(e) = text.parse::<toml::Table>() {
        let line = e.span().map_or(0, |s| line_of(text, s.start));
        return Err(ConfigError::Parse { path: path.into(), errors: vec![ParseError { line, message: flat(e.message()) }] });
    }
    let mut work = text.to_string();
    let mut errors = Vec::new();
    // Names taken out of a table (blanked, or misspelled with a nearest
    // valid name): a later "missing field" of one is a consequence.
    let mut gone: Vec<String> = Vec::new();
    while errors.len() < MAX_PARSE_ERRORS {
        let e = match toml::from_str::<File>(&work) {
            Ok(f) if errors.is_empty() => return Ok(f),
            Ok(_) => break,
            Err(e) => e,
        };
        let Some(span) = e.span() else {
            errors.push(ParseError { line: 0, message: flat(e.message()) });
            break;
        };
        let place = Place::of(&work, span.clone());
        let message = flat(e.message());
        let missing = message.strip_prefix("missing field `").and_then(|m| m.split('`').next()).map(str::to_string);
        // (By name alone: a missing field's error points at its table's
        // header, which names the table differently.)
        let consequence = missing.is_some_and(|m| gone.iter().any(|k| *k == m));
        if !consequence {
            let (message, nearest) = with_nearest(&message);
            gone.extend(nearest);
            gone.extend(place.keys.last().cloned());
            errors.push(ParseError { line: line_of(&work, span.start), message: format!("{}{message}", place.prefix()) });
        }
        if !blank_lines(&mut work, span) || work.parse::<toml::Table>().is_err() {
            break;
        }
    }
    // serde walks the tables in its own order, not the file's.
    errors.sort_by_key(|e| e.line);
    Err(ConfigError::Parse { path: path.into(), errors })
}

fn line_of(text: &str, at: usize) -> usize {
    text[..at.min(text.len())].matches('\n').count() + 1
}

/// serde's message on one line, with Rust's type names in the file's terms.
fn flat(message: &str) -> String {
    let mut m = message.trim().replace('\n', " ");
    for int in ["u8", "u16", "u32", "u64", "usize", "i8", "i16", "i32", "i64", "isize"] {
        if let Some(head) = m.strip_suffix(&format!("expected {int}")) {
            m = format!("{head}expected an integer");
        }
    }
    m
}

/// The message, with "did you mean" for an unknown field or value that is
/// near one serde lists as expected; and that nearest name.
fn with_nearest(message: &str) -> (String, Option<String>) {
    let Some(rest) = message.strip_prefix("unknown field `").or_else(|| message.strip_prefix("unknown variant `")) else {
        return (message.to_string(), None);
    };
    let Some((given, expected)) = rest.split_once('`') else { return (message.to_string(), None) };
    let nearest = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|name| (edit_distance(given, name), name))
        .filter(|&(d, name)| d <= (name.len().max(given.len()) / 3).max(1))
        .min_by_key(|&(d, _)| d)
        .map(|(_, name)| name.to_string());
    match nearest {
        Some(name) => {
            let what = if message.starts_with("unknown field") { "field" } else { "value" };
            (format!("unknown {what} `{given}`; did you mean `{name}`?"), Some(name))
        }
        None => (message.to_string(), None),
    }
}

/// Edit distance, by characters, with a swap of two neighbours as one
/// edit (optimal string alignment): typos are a letter or two, or two
/// letters swapped (`redsi`).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for j in 0..=b.len() {
        d[0][j] = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

/// Blanks (with spaces, keeping the line breaks) every line `span` touches;
/// false when nothing was left to blank.
fn blank_lines(text: &mut String, span: std::ops::Range<usize>) -> bool {
    let start = text[..span.start.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    let mut end = text[span.end.min(text.len())..].find('\n').map_or(text.len(), |i| span.end.min(text.len()) + i);
    // A table's header goes with its whole body: its keys left alone would
    // belong to the table above.
    if header_of(text[start..].lines().next().unwrap_or_default()).is_some() {
        end = line_starts(&text[start..]).skip(1).find(|(_, l)| header_of(l).is_some()).map_or(text.len(), |(i, _)| start + i);
    }
    if text[start..end].trim().is_empty() {
        return false;
    }
    let blanked: String = text[start..end].chars().map(|c| if c == '\n' { '\n' } else { ' ' }).collect();
    text.replace_range(start..end, &blanked);
    true
}

/// Where in the file an error is: its table (`server`, `policy`,
/// `redis.sentinel`), the policy it belongs to, and the keys down to the
/// value (`penalty`, `after`).
struct Place {
    table: String,
    policy: Option<String>,
    keys: Vec<String>,
}

impl Place {
    fn of(text: &str, span: std::ops::Range<usize>) -> Self {
        let line_start = text[..span.start].rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[span.start..].find('\n').map_or(text.len(), |i| span.start + i);
        let line = &text[line_start..line_end];
        // An unknown table: the span is in its header.
        if let Some(header) = header_of(line) {
            let table = header.rsplit_once('.').map_or(String::new(), |(t, _)| t.to_string());
            let key = header.rsplit('.').next().unwrap_or(header).to_string();
            return Self { policy: None, keys: vec![key], table };
        }
        // The last header above the line, and the policy it opens.
        let above = &text[..line_start];
        let mut table = String::new();
        let mut policy_at = None;
        for (at, l) in line_starts(above) {
            if let Some(h) = header_of(l) {
                table = h.to_string();
                if h == "policy" && l.trim_start().starts_with("[[") {
                    policy_at = Some((at, above[..at].matches("[[policy]]").count() + 1));
                } else if !h.starts_with("policy.") {
                    policy_at = None;
                }
            }
        }
        let policy = policy_at.map(|(at, n)| {
            let body_end = line_starts(&text[at..]).skip(1).find(|(_, l)| header_of(l).is_some()).map_or(text.len(), |(i, _)| at + i);
            let name = text[at..body_end].lines().find_map(|l| {
                let (k, v) = l.split_once('=')?;
                (k.trim() == "name").then(|| v.trim().trim_matches('"').to_string())
            });
            name.map_or(format!("[[policy]] #{n}"), |name| format!("policy '{name}'"))
        });
        let here = span.start - line_start;
        let token = &text[span.clone()];
        let is_key = !token.is_empty() && text[span.end.min(line_end)..line_end].trim_start().starts_with('=');
        let keys = keys_at(line, if is_key { (here + token.len()).min(line.len()) } else { here }, is_key);
        Self { table, policy, keys }
    }

    /// "server.socket_mode: ", "policy.limit: policy 'login': ".
    fn prefix(&self) -> String {
        let mut path: Vec<&str> = Vec::new();
        if !self.table.is_empty() {
            path.push(&self.table);
        }
        path.extend(self.keys.iter().map(String::as_str));
        let field = if path.is_empty() { String::new() } else { format!("{}: ", path.join(".")) };
        match &self.policy {
            Some(p) => format!("{field}{p}: "),
            None => field,
        }
    }
}

/// Each line of `text` with its byte offset.
fn line_starts(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.split_inclusive('\n').scan(0, |at, l| {
        let here = *at;
        *at += l.len();
        Some((here, l))
    })
}

/// The table a header line opens (`[server]`, `[[policy]]`, `[a.b]`).
fn header_of(line: &str) -> Option<&str> {
    let l = line.split('#').next()?.trim();
    let inner = l.strip_prefix("[[").and_then(|r| r.strip_suffix("]]")).or_else(|| l.strip_prefix('[').and_then(|r| r.strip_suffix(']')))?;
    Some(inner.trim())
}

/// The keys leading to the value at byte `at` of `line` (`a = { b = X }`:
/// `a`, `b`), from the line's text: the key before each `=` at the value's
/// depth, then the key of each inline table around it. With `is_key`, the
/// text just before `at` is itself the last key.
fn keys_at(line: &str, at: usize, is_key: bool) -> Vec<String> {
    let b = line.as_bytes();
    let mut keys = Vec::new();
    let mut need_key = true;
    let mut depth = 0usize;
    let mut i = at;
    if is_key {
        if let Some((k, start)) = key_ending(b, at) {
            keys.push(k);
            i = start;
            need_key = false;
        }
    }
    while i > 0 {
        i -= 1;
        match b[i] {
            b']' | b'}' => depth += 1,
            b'[' | b'{' if depth > 0 => depth -= 1,
            b'{' => need_key = true,
            b'=' if depth == 0 && need_key => {
                if let Some((k, start)) = key_ending(b, i) {
                    keys.push(k);
                    i = start;
                }
                need_key = false;
            }
            _ => {}
        }
    }
    keys.reverse();
    keys
}

/// The key that ends just before byte `end` (spaces skipped): bare, or
/// quoted; and where it starts.
fn key_ending(b: &[u8], end: usize) -> Option<(String, usize)> {
    let mut e = end;
    while e > 0 && b[e - 1].is_ascii_whitespace() {
        e -= 1;
    }
    if e > 0 && b[e - 1] == b'"' {
        let open = b[..e - 1].iter().rposition(|&c| c == b'"')?;
        return Some((String::from_utf8_lossy(&b[open + 1..e - 1]).into_owned(), open));
    }
    let start = b[..e].iter().rposition(|c| !(c.is_ascii_alphanumeric() || *c == b'_' || *c == b'-' || *c == b'.')).map_or(0, |p| p + 1);
    (start < e).then(|| (String::from_utf8_lossy(&b[start..e]).into_owned(), start))
}

/// `[envoy]` as serde reads it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct EnvoySection {
    /// gRPC (HTTP/2 without TLS) on TCP, "host:port"; loopback or a private
    /// address, as Envoy's rate limit cluster names it.
    pub listen: Option<String>,
    /// gRPC on a Unix socket (Envoy: `pipe: { path: ... }`).
    pub socket: Option<PathBuf>,
    /// The socket file's mode, octal ("0660").
    pub socket_mode: String,
    /// envoyproxy/ratelimit YAML files, or directories whose `*.yaml` and
    /// `*.yml` files are read (as its `RUNTIME_ROOT/.../config`).
    pub config: Vec<PathBuf>,
    /// The algorithm of the limits read from those files.
    pub algorithm: Option<String>,
    /// "all_or_nothing" (default) or "each".
    pub descriptors: Option<String>,
    /// The fail policy of the limits read from those files.
    pub on_error: Option<String>,
    /// "none" (default), "ratelimit", "x" or "draft".
    pub header_style: Option<String>,
    /// Connections served at once on each listener.
    pub max_connections: u64,
    pub route: Vec<RouteSection>,
}

impl Default for EnvoySection {
    fn default() -> Self {
        Self {
            listen: None,
            socket: None,
            socket_mode: "0660".into(),
            config: Vec::new(),
            algorithm: None,
            descriptors: None,
            on_error: None,
            header_style: None,
            max_connections: 1024,
            route: Vec::new(),
        }
    }
}

/// One `[[envoy.route]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RouteSection {
    pub domain: String,
    /// The descriptor's entries in order: "key" (any value, part of the
    /// policy's key) or "key=value" (that value only, not part of it).
    pub descriptor: Vec<String>,
    /// A rate `[[policy]]` of this file.
    pub policy: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// A hostile file never panics the error reporting (blanked lines,
        /// multi-byte characters, inline tables, headers), and every error
        /// it reports names a line of the file.
        #[test]
        fn any_text_gets_errors_not_a_panic(text in "(\\[\\[?[a-zé]{0,6}\\]\\]?\n|[a-zé_]{0,8} ?= ?(\"[a-zé5]{0,4}\"|[0-9]{1,3}|\\{ ?[a-z]{1,5} = [0-9\"]{1,3} ?\\}|\\[[0-9, \"]{0,6}\\]|true)\n|#é\n|\n){0,12}") {
            if let Err(ConfigError::Parse { errors, .. }) = parse(Path::new("t.toml"), &text) {
                let lines = text.lines().count().max(1);
                for e in &errors {
                    prop_assert!(e.line <= lines + 1, "{e:?} in\n{text}");
                }
            }
        }
    }

    #[test]
    fn nearest_names_and_paths() {
        assert_eq!(edit_distance("redsi", "redis"), 1);
        assert_eq!(edit_distance("limt", "limit"), 1);
        let e = parse(Path::new("t.toml"), "[[policy]]\nname = \"a\"\nlimit = 5\nwindow = \"1s\"\npenalty = { after = \"3\", within = \"1m\", ban = \"1m\" }\n").unwrap_err().to_string();
        assert_eq!(e, "t.toml: line 5: policy.penalty.after: policy 'a': invalid type: string \"3\", expected an integer");
        let e = parse(Path::new("t.toml"), "[[policy]]\nlimit = 5\nwindow = \"1s\"\n[[policy]]\nname = \"b\"\nlimit = 5\nwindo = \"1s\"\n").unwrap_err().to_string();
        assert!(e.contains("line 1: policy: missing field `name`") && e.contains("line 7: policy.windo: policy 'b': unknown field `windo`; did you mean `window`?"), "{e}");
    }
}
