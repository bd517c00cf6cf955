//! The descriptors Envoy sends, matched as envoyproxy/ratelimit matches
//! them: per domain, a tree of entries (a key with a fixed value, a
//! wildcard value, or any value) whose nodes may name a limit. Built once
//! per load by `envoy.rs`; asked per request by `src/envoy/`.

use std::collections::HashMap;

/// Most entries in one descriptor, in the configuration and in a request:
/// deeper trees are not written by hand, and the lookup keeps which
/// entries vary in a bit mask.
pub const MAX_ENVOY_DEPTH: usize = 16;

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
    pub(super) fn parse(s: &str) -> Option<Self> {
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
    pub(super) fn window(self) -> &'static str {
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
pub(super) struct Node {
    /// `key`, then this exact value.
    exact: HashMap<String, HashMap<String, Node>>,
    /// `key` with a value matching a pattern of `*`s, in file order.
    wildcard: Vec<(String, Vec<String>, Node)>,
    /// `key` with any value.
    any: HashMap<String, Node>,
    pub(super) target: Option<Target>,
}

/// Every domain's descriptors, as envoyproxy/ratelimit matches them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvoyRoutes {
    pub(super) domains: HashMap<String, Node>,
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
    pub(super) fn policies_of(&self) -> impl Iterator<Item = (&str, &str)> {
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
pub(super) enum Entry<'a> {
    Exact(&'a str, &'a str),
    Wildcard(&'a str, &'a str),
    Any(&'a str),
}

impl Node {
    /// The child for `entry`, and whether it was there already.
    pub(super) fn child(&mut self, entry: Entry<'_>) -> (&mut Node, bool) {
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

pub(super) fn entry_of<'a>(key: &'a str, value: Option<&'a str>) -> Entry<'a> {
    match value {
        None | Some("") => Entry::Any(key),
        Some(v) if v.contains('*') => Entry::Wildcard(key, v),
        Some(v) => Entry::Exact(key, v),
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
}
