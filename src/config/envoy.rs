//! `[envoy]`: the Envoy rate limit service front (docs/ENVOY.md). Envoy
//! asks with a domain and descriptors (lists of key/value entries); this
//! module turns the configuration that says which descriptor counts under
//! which limit into named policies and one lookup tree, once per load:
//!
//! - envoyproxy/ratelimit's YAML files, read as they are (`domain`,
//!   nested `descriptors` with `key`/`value`, `rate_limit` with `unit` and
//!   `requests_per_unit`, `unlimited`, `name`, `replaces`, `shadow_mode`,
//!   `detailed_metric`): each limit becomes a policy of its own;
//! - `[[envoy.route]]`: a descriptor counted under a `[[policy]]` of the
//!   TOML, so nginx and Envoy share one window per key.
//!
//! Nothing here knows gRPC: `src/envoy/` asks `EnvoyRoutes::find`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::file::PolicySection;
use super::model::{PolicyConfig, Problems};
use super::reserve::multi_refusal;
use crate::protocol::{Algorithm, FailPolicy};

/// Most entries in one descriptor, in the configuration and in a request:
/// deeper trees are not written by hand, and the lookup keeps which
/// entries vary in a bit mask.
pub const MAX_ENVOY_DEPTH: usize = 16;

/// `[envoy]` as serde reads it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EnvoySection {
    /// gRPC (HTTP/2 without TLS) on TCP, "host:port"; loopback or a private
    /// address, as Envoy's rate limit cluster names it.
    pub listen: Option<String>,
    /// gRPC on a Unix socket (Envoy: `pipe: { path: ... }`).
    pub socket: Option<PathBuf>,
    #[serde(default = "default_socket_mode")]
    pub socket_mode: String,
    /// envoyproxy/ratelimit YAML files, or directories whose `*.yaml` and
    /// `*.yml` files are read (as its `RUNTIME_ROOT/.../config`).
    #[serde(default)]
    pub config: Vec<PathBuf>,
    /// The algorithm of the limits read from those files.
    #[serde(default)]
    pub algorithm: Option<String>,
    /// "all_or_nothing" (default) or "each".
    #[serde(default)]
    pub descriptors: Option<String>,
    /// The fail policy of the limits read from those files.
    #[serde(default)]
    pub on_error: Option<String>,
    /// "none" (default), "ratelimit", "x" or "draft".
    #[serde(default)]
    pub header_style: Option<String>,
    /// Connections served at once on each listener.
    #[serde(default = "default_max_connections")]
    pub max_connections: u64,
    #[serde(default)]
    pub route: Vec<RouteSection>,
}

fn default_max_connections() -> u64 {
    1024
}

fn default_socket_mode() -> String {
    "0660".into()
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

/// One envoyproxy/ratelimit file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRoot {
    domain: String,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<YamlRateLimit>,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    /// Per-value metric names in envoyproxy/ratelimit: the daemon's
    /// per-key view is `ratelimitd top` instead (read, and said so).
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    /// Read only to refuse them by name: they change what is counted.
    #[serde(default)]
    quota_mode: Option<serde_yaml::Value>,
    #[serde(default)]
    share_threshold: Option<serde_yaml::Value>,
    #[serde(default)]
    metadata: Option<serde_yaml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    #[serde(default)]
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<YamlReplaces>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    name: String,
}

/// The time unit of a limit, as Envoy's `RateLimitResponse.RateLimit.Unit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyUnit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
}

impl EnvoyUnit {
    fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Self::Second,
            "minute" => Self::Minute,
            "hour" => Self::Hour,
            "day" => Self::Day,
            "week" => Self::Week,
            "month" => Self::Month,
            _ => return None,
        })
    }

    /// The policy `window` of this unit.
    fn window(self) -> &'static str {
        match self {
            Self::Second => "1s",
            Self::Minute => "1m",
            Self::Hour => "1h",
            Self::Day => "1d",
            Self::Week => "7d",
            Self::Month => "month",
        }
    }

    /// The unit a policy's window is shown as: the unit it is exactly, else
    /// the largest unit that divides it (a 30 s window shows as seconds).
    pub fn of_window_ms(ms: u32) -> Self {
        match ms {
            _ if ms >= crate::window::CALENDAR => Self::Month,
            604_800_000 => Self::Week,
            m if m % 86_400_000 == 0 => Self::Day,
            m if m % 3_600_000 == 0 => Self::Hour,
            m if m % 60_000 == 0 => Self::Minute,
            _ => Self::Second,
        }
    }
}

/// How a request's descriptors are decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DescriptorMode {
    /// One multi-item check: every limited descriptor admitted or none
    /// (nothing recorded for a refused request).
    AllOrNothing,
    /// Each descriptor alone, as envoyproxy/ratelimit does: a refused
    /// request may have spent the other descriptors' quota.
    Each,
}

/// The quota headers added to Envoy's response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyHeaderStyle {
    None,
    /// `RateLimit-Limit`, `-Remaining`, `-Reset` (envoyproxy/ratelimit's
    /// `LIMIT_RESPONSE_HEADERS_ENABLED`).
    Ratelimit,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    X,
    /// `RateLimit-Policy` and `RateLimit` of the IETF draft.
    Draft,
}

/// `[envoy]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyConfig {
    pub listen: Option<SocketAddr>,
    pub socket: Option<PathBuf>,
    pub socket_mode: u32,
    pub descriptors: DescriptorMode,
    pub header_style: EnvoyHeaderStyle,
    /// The fail policy of a routed `[[policy]]` without its own: open or
    /// closed (the YAML files' limits carry `on_error` themselves).
    pub on_error: FailPolicy,
    pub max_connections: usize,
    pub routes: EnvoyRoutes,
}

/// What a descriptor that matched counts under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The policy; None: `unlimited` (admitted, nothing counted).
    pub policy: Option<String>,
    /// The YAML limit's `name`, which other limits' `replaces` name.
    pub name: Option<String>,
    /// Limits of this request that this one replaces (not applied).
    pub replaces: Vec<String>,
    /// A `[[envoy.route]]` to a policy of the TOML (its name is shown).
    pub routed: bool,
}

/// One level of a domain's tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Node {
    /// `key`, then this exact value.
    exact: HashMap<String, HashMap<String, Node>>,
    /// `key` with a value matching a pattern of `*`s, in file order.
    wildcard: Vec<(String, Vec<String>, Node)>,
    /// `key` with any value.
    any: HashMap<String, Node>,
    target: Option<Target>,
}

/// Every domain's descriptors, as envoyproxy/ratelimit matches them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvoyRoutes {
    domains: HashMap<String, Node>,
}

/// A descriptor that matched: its target and which entries' values make
/// the policy's key (bit i: entry i matched by a key without a fixed value).
#[derive(Debug, Clone, Copy)]
pub struct Found<'a> {
    pub target: &'a Target,
    pub varying: u32,
}

impl EnvoyRoutes {
    /// The target of a request's descriptor, as envoyproxy/ratelimit's
    /// `GetLimit`: at each level the entry's key with its value, else a
    /// wildcard value, else the key alone; the limit applies when the last
    /// entry lands on a node that has one. None: no limit (the descriptor
    /// is answered OK and nothing is counted). `entries` is at most
    /// `MAX_ENVOY_DEPTH` long (the caller refuses longer).
    pub fn find<'a, 'e>(&'a self, domain: &str, entries: impl ExactSizeIterator<Item = (&'e str, &'e str)>) -> Option<Found<'a>> {
        let mut node = self.domains.get(domain)?;
        let last = entries.len().checked_sub(1)?;
        let mut varying = 0u32;
        for (i, (key, value)) in entries.enumerate() {
            let next = match node.exact.get(key).and_then(|values| values.get(value)) {
                Some(n) => Some(n),
                None => match node.wildcard.iter().find(|(k, parts, _)| k == key && wildcard_match(parts, value)) {
                    Some((_, _, n)) => {
                        varying |= 1 << i;
                        Some(n)
                    }
                    None => node.any.get(key).inspect(|_| varying |= 1 << i),
                },
            };
            let next = next?;
            if i == last {
                return next.target.as_ref().map(|target| Found { target, varying });
            }
            node = next;
        }
        None
    }

    /// Every policy a domain's descriptors count under.
    fn policies_of(&self) -> impl Iterator<Item = (&str, &str)> {
        fn walk<'a>(domain: &'a str, n: &'a Node, out: &mut Vec<(&'a str, &'a str)>) {
            if let Some(p) = n.target.as_ref().and_then(|t| t.policy.as_deref()) {
                out.push((domain, p));
            }
            n.exact.values().flat_map(HashMap::values).chain(n.any.values()).chain(n.wildcard.iter().map(|(_, _, n)| n)).for_each(|c| walk(domain, c, out));
        }
        let mut out = Vec::new();
        for (d, n) in &self.domains {
            walk(d, n, &mut out);
        }
        out.into_iter()
    }
}

/// envoyproxy/ratelimit's wildcard: each `*` matches any run of bytes.
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (first, rest) = match parts.split_first() {
        Some(p) => p,
        None => return value.is_empty(),
    };
    let Some(mut remaining) = value.strip_prefix(first.as_str()) else { return false };
    let Some((last, middle)) = rest.split_last() else { return remaining.is_empty() };
    for part in middle {
        match remaining.find(part.as_str()) {
            Some(i) => remaining = &remaining[i + part.len()..],
            None => return false,
        }
    }
    remaining.len() >= last.len() && remaining.ends_with(last.as_str())
}

/// One descriptor entry of the configuration.
enum Entry<'a> {
    Exact(&'a str, &'a str),
    Wildcard(&'a str, &'a str),
    Any(&'a str),
}

impl Node {
    /// The child for `entry`, and whether it was there already.
    fn child(&mut self, entry: Entry<'_>) -> (&mut Node, bool) {
        match entry {
            Entry::Exact(k, v) => {
                let values = self.exact.entry(k.into()).or_default();
                let existed = values.contains_key(v);
                (values.entry(v.into()).or_default(), existed)
            }
            Entry::Any(k) => {
                let existed = self.any.contains_key(k);
                (self.any.entry(k.into()).or_default(), existed)
            }
            Entry::Wildcard(k, v) => match self.wildcard.iter().position(|(wk, parts, _)| wk == k && parts.join("*") == v) {
                Some(i) => (&mut self.wildcard[i].2, true),
                None => {
                    self.wildcard.push((k.into(), v.split('*').map(String::from).collect(), Node::default()));
                    (&mut self.wildcard.last_mut().expect("just pushed").2, false)
                }
            },
        }
    }
}

fn entry_of<'a>(key: &'a str, value: Option<&'a str>) -> Entry<'a> {
    match value {
        None | Some("") => Entry::Any(key),
        Some(v) if v.contains('*') => Entry::Wildcard(key, v),
        Some(v) => Entry::Exact(key, v),
    }
}

/// What `[envoy]` adds to the configuration: its policies (validated with
/// the file's own) and the validated section, whose routes are checked
/// against every policy once those are known (`check_routes`).
pub(super) struct Read {
    pub policies: Vec<PolicySection>,
    pub envoy: EnvoyConfig,
}

/// Reads `[envoy]`: its YAML files (relative paths from the TOML file's
/// directory), every error reported.
pub(super) fn read(s: EnvoySection, toml_path: &Path, p: &mut Problems) -> Read {
    let listen = s.listen.as_deref().and_then(|l| match l.parse::<SocketAddr>() {
        Ok(a) => Some(a),
        Err(_) => {
            p.add("envoy.listen", format!("'{l}' is not an address such as \"127.0.0.1:8081\""));
            None
        }
    });
    if listen.is_none() && s.socket.is_none() && p.0.iter().all(|e| e.field != "envoy.listen") {
        p.add("envoy.listen", "[envoy] needs listen (host:port) or socket (a path), or both: where Envoy's rate limit cluster connects");
    }
    let socket_mode = match u32::from_str_radix(&s.socket_mode, 8) {
        Ok(m) if m <= 0o777 => m,
        _ => {
            p.add("envoy.socket_mode", format!("'{}' is not an octal mode such as \"0660\"", s.socket_mode));
            0o660
        }
    };
    let descriptors = match s.descriptors.as_deref() {
        None | Some("all_or_nothing") => DescriptorMode::AllOrNothing,
        Some("each") => DescriptorMode::Each,
        Some(o) => {
            p.add("envoy.descriptors", format!("'{o}' is not \"all_or_nothing\" or \"each\""));
            DescriptorMode::AllOrNothing
        }
    };
    let header_style = match s.header_style.as_deref() {
        None | Some("none") => EnvoyHeaderStyle::None,
        Some("ratelimit") => EnvoyHeaderStyle::Ratelimit,
        Some("x") => EnvoyHeaderStyle::X,
        Some("draft") => EnvoyHeaderStyle::Draft,
        Some(o) => {
            p.add("envoy.header_style", format!("'{o}' is not \"none\", \"ratelimit\", \"x\" or \"draft\""));
            EnvoyHeaderStyle::None
        }
    };
    let algorithm = s.algorithm.clone().unwrap_or_else(|| Algorithm::Log.as_str().to_owned());
    let on_error = s.on_error.clone().unwrap_or_else(|| "open".to_owned());
    let request_on_error = match on_error.parse::<FailPolicy>() {
        Ok(FailPolicy::Closed) => FailPolicy::Closed,
        Ok(_) => FailPolicy::Open,
        Err(_) => {
            p.add("envoy.on_error", format!("'{on_error}' is not \"open\", \"closed\" or \"local\""));
            FailPolicy::Open
        }
    };
    let max_connections = match s.max_connections {
        1..=65_536 => s.max_connections as usize,
        n => {
            p.add("envoy.max_connections", format!("{n} is outside 1..=65536"));
            1
        }
    };
    let mut routes = EnvoyRoutes::default();
    let mut policies = Vec::new();
    let base = toml_path.parent().unwrap_or(Path::new("."));
    for file in yaml_files(&s.config, base, p) {
        read_yaml(&file, &algorithm, &on_error, &mut routes, &mut policies, p);
    }
    for (i, r) in s.route.iter().enumerate() {
        route(i, r, &mut routes, p);
    }
    Read { policies, envoy: EnvoyConfig { listen, socket: s.socket, socket_mode, descriptors, header_style, on_error: request_on_error, max_connections, routes } }
}

/// The files `config` names: each file, and each directory's `*.yaml` and
/// `*.yml` in name order.
fn yaml_files(config: &[PathBuf], base: &Path, p: &mut Problems) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for c in config {
        let path = base.join(c);
        match std::fs::read_dir(&path) {
            Ok(dir) => {
                let mut files: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).filter(|f| f.extension().is_some_and(|x| x == "yaml" || x == "yml")).collect();
                files.sort();
                out.extend(files);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => out.push(path),
            Err(e) => p.add("envoy.config", format!("{}: cannot read: {e}", path.display())),
        }
    }
    out
}

/// One YAML file into the tree and the policy list.
fn read_yaml(file: &Path, algorithm: &str, on_error: &str, routes: &mut EnvoyRoutes, policies: &mut Vec<PolicySection>, p: &mut Problems) {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => return p.add("envoy.config", format!("{}: cannot read: {e}", file.display())),
    };
    let root: YamlRoot = match serde_yaml::from_str(&text) {
        Ok(r) => r,
        Err(e) => {
            let at = e.location().map(|l| format!("line {}: ", l.line())).unwrap_or_default();
            return p.add("envoy.config", format!("{}: {at}{}", file.display(), e.to_string().replace('\n', " ")));
        }
    };
    if root.domain.is_empty() {
        return p.add("envoy.config", format!("{}: the domain is empty", file.display()));
    }
    if routes.domains.contains_key(&root.domain) {
        return p.add("envoy.config", format!("{}: domain '{}' is already in an earlier file (one file per domain)", file.display(), root.domain));
    }
    let node = routes.domains.entry(root.domain.clone()).or_default();
    let mut ctx = YamlContext { file, domain: &root.domain, algorithm, on_error, policies, p };
    for d in &root.descriptors {
        ctx.descriptor(node, d, &mut Vec::new());
    }
}

struct YamlContext<'a> {
    file: &'a Path,
    domain: &'a str,
    algorithm: &'a str,
    on_error: &'a str,
    policies: &'a mut Vec<PolicySection>,
    p: &'a mut Problems,
}

impl YamlContext<'_> {
    fn error(&mut self, path: &[String], message: impl std::fmt::Display) {
        self.p.add("envoy.config", format!("{}: domain '{}', descriptor {}: {message}", self.file.display(), self.domain, path.join(" > ")));
    }

    fn descriptor(&mut self, parent: &mut Node, d: &YamlDescriptor, path: &mut Vec<String>) {
        path.push(match &d.value {
            Some(v) if !v.is_empty() => format!("{}={v}", d.key),
            _ => d.key.clone(),
        });
        if d.key.is_empty() {
            self.error(path, "the key is empty");
        }
        if path.len() > MAX_ENVOY_DEPTH {
            self.error(path, format!("deeper than {MAX_ENVOY_DEPTH} entries"));
            path.pop();
            return;
        }
        for (field, set) in [("quota_mode", d.quota_mode.is_some()), ("share_threshold", d.share_threshold.is_some()), ("metadata", d.metadata.is_some())] {
            if set {
                self.error(path, format!("{field} is not supported by ratelimitd (docs/ENVOY.md, \"Migrating\"): remove it"));
            }
        }
        let _ = (d.detailed_metric, d.value_to_metric);
        let (node, existed) = parent.child(entry_of(&d.key, d.value.as_deref()));
        if existed {
            self.error(path, "a duplicate descriptor: the same key and value twice at one level");
        }
        if let Some(r) = &d.rate_limit {
            node.target = self.limit(r, d.shadow_mode, path);
        } else if d.shadow_mode {
            self.error(path, "shadow_mode without a rate_limit");
        }
        for child in &d.descriptors {
            self.descriptor(node, child, path);
        }
        path.pop();
    }

    /// A YAML `rate_limit`: a policy of its own, or `unlimited`.
    fn limit(&mut self, r: &YamlRateLimit, shadow: bool, path: &[String]) -> Option<Target> {
        let replaces: Vec<String> = r.replaces.iter().map(|x| x.name.clone()).collect();
        if replaces.iter().any(String::is_empty) {
            self.error(path, "a replaces entry has an empty name");
        }
        if r.name.is_some() && replaces.iter().any(|x| Some(x) == r.name.as_ref()) {
            self.error(path, "replaces names the limit itself");
        }
        if r.unlimited {
            if r.unit.is_some() || r.requests_per_unit.is_some() {
                self.error(path, "unlimited takes no unit or requests_per_unit");
            }
            return Some(Target { policy: None, name: r.name.clone(), replaces, routed: false });
        }
        let unit = match r.unit.as_deref().map(|u| (u, EnvoyUnit::parse(u))) {
            Some((_, Some(u))) => u,
            Some((u, None)) => {
                self.error(path, format!("unit '{u}' is not second, minute, hour, day, week or month (year is not supported: the longest window is a month)"));
                return None;
            }
            None => {
                self.error(path, "rate_limit needs a unit (or unlimited: true)");
                return None;
            }
        };
        let Some(limit) = r.requests_per_unit else {
            self.error(path, "rate_limit needs requests_per_unit");
            return None;
        };
        let name = policy_name(self.domain, path);
        let algorithm = if unit == EnvoyUnit::Month { "fixed".to_owned() } else { self.algorithm.to_owned() };
        self.policies.push(PolicySection::synthesized(name.clone(), limit, unit.window().into(), algorithm, self.on_error.to_owned(), shadow));
        Some(Target { policy: Some(name), name: r.name.clone(), replaces, routed: false })
    }
}

/// The policy name of a YAML limit: "<domain>.<path>" when that is a valid
/// name, else "envoy-" and 16 hex digits of a hash of it (stable across
/// loads and hosts: it names the limit's Redis keys).
fn policy_name(domain: &str, path: &[String]) -> String {
    let readable = format!("{domain}.{}", path.join(".")).replace('=', "_");
    if super::validate::valid_policy_name(&readable) {
        return readable;
    }
    format!("envoy-{:016x}", fnv1a(readable.as_bytes()))
}

/// FNV-1a, 64 bits: a stable name, not a secret.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// One `[[envoy.route]]` into the tree.
fn route(i: usize, r: &RouteSection, routes: &mut EnvoyRoutes, p: &mut Problems) {
    let at = format!("[[envoy.route]] #{} (domain '{}')", i + 1, r.domain);
    if r.domain.is_empty() || r.descriptor.is_empty() || r.descriptor.len() > MAX_ENVOY_DEPTH {
        return p.add("envoy.route", format!("{at}: needs a domain and 1..={MAX_ENVOY_DEPTH} descriptor entries"));
    }
    let mut node = routes.domains.entry(r.domain.clone()).or_default();
    for e in &r.descriptor {
        let (key, value) = match e.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (e.as_str(), None),
        };
        if key.is_empty() {
            return p.add("envoy.route", format!("{at}: entry '{e}' has an empty key"));
        }
        node = node.child(entry_of(key, value)).0;
    }
    if node.target.is_some() {
        return p.add("envoy.route", format!("{at}: descriptor {} already has a limit (in a YAML file or an earlier route)", r.descriptor.join(" > ")));
    }
    node.target = Some(Target { policy: Some(r.policy.clone()), name: None, replaces: Vec::new(), routed: true });
}

/// Checks the tree against every policy of the configuration: each route
/// names a rate policy, and in `all_or_nothing` mode every policy of a
/// domain with several limits can be one item of several.
pub(super) fn check_routes(envoy: &EnvoyConfig, policies: &[PolicyConfig], p: &mut Problems) {
    let by_name: BTreeMap<&str, &PolicyConfig> = policies.iter().map(|c| (c.name.as_str(), c)).collect();
    let mut per_domain: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (domain, policy) in envoy.routes.policies_of() {
        per_domain.entry(domain).or_default().insert(policy);
        match by_name.get(policy) {
            None => p.add("envoy.route", format!("domain '{domain}': policy '{policy}' is not a [[policy]] of this file")),
            Some(c) if c.lease_ms.is_some() => p.add("envoy.route", format!("domain '{domain}': policy '{policy}' is a concurrency policy; Envoy's rate limit service asks for rate limits only")),
            Some(_) => {}
        }
    }
    if envoy.descriptors != DescriptorMode::AllOrNothing {
        return;
    }
    for (domain, ps) in per_domain.into_iter().filter(|(_, ps)| ps.len() > 1) {
        for name in ps {
            if let Some(why) = by_name.get(name).and_then(|c| multi_refusal(c.algorithm, c.penalty.is_some())) {
                p.add("envoy.descriptors", format!("domain '{domain}': policy '{name}' cannot be decided with the domain's other limits all or nothing ({why}): set its algorithm to log, or [envoy] descriptors = \"each\""));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(p: &str) -> Vec<String> {
        p.split('*').map(String::from).collect()
    }

    #[test]
    fn wildcards_match_as_envoyproxy_ratelimit_s() {
        assert!(wildcard_match(&parts("foo*"), "foobar"));
        assert!(wildcard_match(&parts("foo*"), "foo"));
        assert!(!wildcard_match(&parts("foo*"), "fo"));
        assert!(wildcard_match(&parts("a*b*c"), "aXbYc"));
        assert!(!wildcard_match(&parts("a*b*c"), "aXcYb"));
        assert!(!wildcard_match(&parts("ab*ba"), "aba"));
        assert!(wildcard_match(&parts("*"), ""));
    }

    #[test]
    fn names_are_readable_when_they_can_be_and_stable_when_not() {
        assert_eq!(policy_name("edge", &["tenant".into()]), "edge.tenant");
        let long = policy_name("edge", &["path=/api/v1/orders".into()]);
        assert!(long.starts_with("envoy-") && long.len() == 22, "{long}");
        assert_eq!(long, policy_name("edge", &["path=/api/v1/orders".into()]));
    }
}
