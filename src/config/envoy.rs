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

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::descriptors::{entry_of, EnvoyRoutes, EnvoyUnit, Node, Target, MAX_ENVOY_DEPTH};
use super::file::{EnvoySection, PolicySection, RouteSection};
use super::model::{valid_policy_name, DescriptorMode, EnvoyConfig, EnvoyHeaderStyle, EnvoyWritten, PolicyConfig, Problems};
use super::reserve::multi_refusal;
use crate::protocol::{Algorithm, FailPolicy};

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
    value: Option<String>,
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
    quota_mode: Option<serde_yaml::Value>,
    share_threshold: Option<serde_yaml::Value>,
    metadata: Option<serde_yaml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    requests_per_unit: Option<u64>,
    unit: Option<String>,
    #[serde(default)]
    unlimited: bool,
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<YamlReplaces>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    name: String,
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
    let written = EnvoyWritten {
        config: s.config.clone(),
        algorithm: s.algorithm.clone(),
        on_error: s.on_error.clone(),
        routes: s.route.iter().map(|r| (r.domain.clone(), r.descriptor.clone(), r.policy.clone())).collect(),
        yaml_policies: policies.iter().map(|p| p.name.clone()).collect(),
    };
    Read { policies, envoy: EnvoyConfig { listen, socket: s.socket, socket_mode, descriptors, header_style, on_error: request_on_error, max_connections, routes, written } }
}

/// The files `config` names: each file, and each directory's `*.yaml` and
/// `*.yml` in name order.
fn yaml_files(config: &[PathBuf], base: &Path, p: &mut Problems) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for c in config {
        let path = base.join(c);
        // A file is read as one (its own errors are read_yaml's to name).
        if !path.is_dir() {
            out.push(path);
            continue;
        }
        match std::fs::read_dir(&path) {
            Ok(dir) => {
                let mut files: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).filter(|f| f.extension().is_some_and(|x| x == "yaml" || x == "yml")).collect();
                files.sort();
                out.extend(files);
            }
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
    if valid_policy_name(&readable) {
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
            Some(c) if c.rule.lease_ms.is_some() => p.add("envoy.route", format!("domain '{domain}': policy '{policy}' is a concurrency policy; Envoy's rate limit service asks for rate limits only")),
            Some(_) => {}
        }
    }
    if envoy.descriptors != DescriptorMode::AllOrNothing {
        return;
    }
    for (domain, ps) in per_domain.into_iter().filter(|(_, ps)| ps.len() > 1) {
        for name in ps {
            if let Some(why) = by_name.get(name).and_then(|c| multi_refusal(c.rule.algorithm, c.rule.penalty.is_some())) {
                p.add("envoy.descriptors", format!("domain '{domain}': policy '{name}' cannot be decided with the domain's other limits all or nothing ({why}): set its algorithm to log, or [envoy] descriptors = \"each\""));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_readable_when_they_can_be_and_stable_when_not() {
        assert_eq!(policy_name("edge", &["tenant".into()]), "edge.tenant");
        let long = policy_name("edge", &["path=/api/v1/orders".into()]);
        assert!(long.starts_with("envoy-") && long.len() == 22, "{long}");
        assert_eq!(long, policy_name("edge", &["path=/api/v1/orders".into()]));
    }
}
