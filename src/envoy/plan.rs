//! A `ShouldRateLimit` request, resolved to what the pipeline decides:
//! each descriptor's target in the configuration's tree, and the items
//! (policy, key, cost) to check, as frames of the socket's own protocol
//! (op 2), decoded by the socket's own decoder. So a request from Envoy is
//! validated and decided exactly as one from nginx: the same bounds, the
//! same errors, the same windows.

use std::borrow::Cow;

use bytes::{Buf, BytesMut};
use md5::{Digest, Md5};
use tonic::Status;

use crate::config::{EnvoyConfig, MAX_ENVOY_DEPTH};
use crate::protocol::{encode_multi_request, encode_policy_request, parse_request, Bounds, Inbound, ItemArgs, PolicyCheckArgs, Request, LEN_PREFIX};

use super::pb::RateLimitRequest;

/// Most descriptors in one request: Envoy sends one per rate limit action
/// that produced one (a handful); thousands are an attack, answered with
/// INVALID_ARGUMENT before any lookup.
pub const MAX_DESCRIPTORS: usize = 64;

/// What the Lua client prefixes a hashed key with, and no key sent as it is
/// begins with (lua/resty/ratelimitd/kind.lua `wire_key`): the same rule here, so a
/// tenant limited through nginx and through Envoy shares one window
/// whatever its id looks like.
const HASHED: &[u8] = b"md5:";

/// What one descriptor resolved to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// No limit in the configuration matches (or another replaces it):
    /// OK, nothing counted.
    NoLimit,
    /// `unlimited: true`: OK, nothing counted.
    Unlimited,
    /// The `n`th item decided.
    Item(usize),
}

/// One item to decide: a policy, the wire key, the cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub policy: String,
    /// What `current_limit.name` says: the YAML limit's `name` (empty
    /// without one, as envoyproxy/ratelimit answers), or a routed policy's name.
    pub shown_name: String,
    pub key: Vec<u8>,
    pub cost: u32,
}

/// A request, resolved: one slot per descriptor, the items in first-seen
/// order (a policy and key named twice is one item of the summed cost).
#[derive(Debug, Default)]
pub struct Plan {
    pub slots: Vec<Slot>,
    pub items: Vec<Item>,
}

/// Resolves `r` against `envoy`'s tree. Errors are the caller's
/// INVALID_ARGUMENT: nothing was counted.
pub fn plan(r: &RateLimitRequest, envoy: &EnvoyConfig, bounds: &Bounds) -> Result<Plan, Status> {
    if r.domain.is_empty() {
        return Err(Status::invalid_argument("rate limit domain must not be empty"));
    }
    if r.descriptors.is_empty() {
        return Err(Status::invalid_argument("rate limit descriptor list must not be empty"));
    }
    if r.descriptors.len() > MAX_DESCRIPTORS {
        return Err(Status::invalid_argument(format!("{} descriptors: at most {MAX_DESCRIPTORS} in one request", r.descriptors.len())));
    }
    let mut found = Vec::with_capacity(r.descriptors.len());
    for (i, d) in r.descriptors.iter().enumerate() {
        if d.entries.len() > MAX_ENVOY_DEPTH {
            return Err(Status::invalid_argument(format!("descriptor {i}: {} entries, at most {MAX_ENVOY_DEPTH}", d.entries.len())));
        }
        if d.limit.is_some() {
            return Err(Status::invalid_argument(format!("descriptor {i}: a limit override from Envoy is not supported: the limit is ratelimitd's configuration (docs/ENVOY.md)")));
        }
        if d.is_negative_hits {
            return Err(Status::invalid_argument(format!("descriptor {i}: is_negative_hits (giving quota back) is not supported")));
        }
        found.push(envoy.routes.find(&r.domain, d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()))));
    }
    // envoyproxy/ratelimit's `replaces`: a named limit another matched
    // limit replaces is not applied.
    let replaced = |name: &Option<String>| name.as_ref().is_some_and(|n| found.iter().flatten().any(|f| f.target.replaces.contains(n)));
    let mut plan = Plan { slots: Vec::with_capacity(found.len()), items: Vec::new() };
    for (d, f) in r.descriptors.iter().zip(&found) {
        let slot = match f {
            None => Slot::NoLimit,
            Some(f) if replaced(&f.target.name) => Slot::NoLimit,
            Some(f) => match &f.target.policy {
                None => Slot::Unlimited,
                Some(policy) => {
                    let raw = policy_key(d.entries.iter().map(|e| e.value.as_bytes()), f.varying);
                    let key = wire_key(raw, bounds.max_key_len).into_owned();
                    // hits_addend 0 is 1 (envoyproxy/ratelimit's rule); a
                    // cost the decoder refuses (above max_cost) is refused
                    // there, by its error, not clamped here.
                    let hits = d.hits_addend.map_or(u64::from(r.hits_addend), |h| h.value).max(1);
                    let cost = u32::try_from(hits).unwrap_or(u32::MAX);
                    let shown = f.target.name.as_deref().unwrap_or(if f.target.routed { policy.as_str() } else { "" });
                    Slot::Item(plan.add(policy, shown, key, cost))
                }
            },
        };
        plan.slots.push(slot);
    }
    Ok(plan)
}

impl Plan {
    fn add(&mut self, policy: &str, shown_name: &str, key: Vec<u8>, cost: u32) -> usize {
        match self.items.iter().position(|i| i.policy == policy && i.key == key) {
            Some(n) => {
                self.items[n].cost = self.items[n].cost.saturating_add(cost);
                n
            }
            None => {
                self.items.push(Item { policy: policy.to_owned(), shown_name: shown_name.to_owned(), key, cost });
                self.items.len() - 1
            }
        }
    }

    /// The items as one CHECK_POLICY of several (all or nothing), decoded
    /// by the socket's decoder; or its refusal (too many items, a cost or
    /// key out of bounds).
    pub fn all_or_nothing(&self, on_error: crate::protocol::FailPolicy, bounds: &Bounds) -> Result<Request, Status> {
        let args: Vec<ItemArgs<'_>> = self.items.iter().map(|i| ItemArgs { policy: i.policy.as_bytes(), key: &i.key, cost: i.cost }).collect();
        let mut frame = BytesMut::new();
        encode_multi_request(0, on_error, 0, false, &args, &mut frame);
        decoded(frame, bounds)
    }

    /// Item `n` alone, as one CHECK_POLICY.
    pub fn one(&self, n: usize, on_error: crate::protocol::FailPolicy, bounds: &Bounds) -> Result<Request, Status> {
        let i = &self.items[n];
        let mut frame = BytesMut::new();
        encode_policy_request(0, &PolicyCheckArgs { policy: i.policy.as_bytes(), key: &i.key, cost: i.cost, on_error, local_limit: 0 }, &mut frame);
        decoded(frame, bounds)
    }
}

fn decoded(mut frame: BytesMut, bounds: &Bounds) -> Result<Request, Status> {
    frame.advance(LEN_PREFIX);
    match parse_request(frame.freeze(), bounds) {
        Inbound::Request(r) => Ok(r),
        Inbound::Invalid { code, message, .. } => Err(Status::invalid_argument(format!("{}: {message}", code.as_str()))),
        Inbound::TooLarge { len } => Err(Status::invalid_argument(format!("{len} bytes of items: too large"))),
    }
}

/// The key a descriptor counts under: the values of the entries matched
/// by a key without a fixed value (bit i of `varying`), in order. One such
/// value is the key as it is (what nginx sends for the same tenant);
/// several are joined by ':' with '\' and ':' escaped, so no two lists of
/// values give one key.
fn policy_key<'a>(values: impl Iterator<Item = &'a [u8]>, varying: u32) -> Cow<'a, [u8]> {
    let mut picked = values.enumerate().filter(|(i, _)| varying & (1 << i) != 0).map(|(_, v)| v);
    let Some(first) = picked.next() else { return Cow::Borrowed(b"") };
    let Some(second) = picked.next() else { return Cow::Borrowed(first) };
    let mut out = Vec::with_capacity(first.len() + second.len() + 8);
    for (n, v) in [first, second].into_iter().chain(picked).enumerate() {
        if n > 0 {
            out.push(b':');
        }
        for &b in v {
            if b == b':' || b == b'\\' {
                out.push(b'\\');
            }
            out.push(b);
        }
    }
    Cow::Owned(out)
}

/// The Lua client's rule (kind.lua `wire_key`): a key empty, longer than
/// `max_key_len`, holding a control byte or beginning with "md5:" is sent
/// as "md5:" and the hex md5 of it.
fn wire_key(raw: Cow<'_, [u8]>, max_key_len: usize) -> Cow<'_, [u8]> {
    if !raw.is_empty() && raw.len() <= max_key_len && !raw.iter().any(|&b| b < 0x20 || b == 0x7f) && !raw.starts_with(HASHED) {
        return raw;
    }
    let digest = Md5::digest(&raw);
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = Vec::with_capacity(HASHED.len() + 32);
    out.extend_from_slice(HASHED);
    for b in digest {
        out.extend_from_slice(&[HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(values: &[&str], varying: u32) -> Vec<u8> {
        policy_key(values.iter().map(|v| v.as_bytes()), varying).into_owned()
    }

    #[test]
    fn one_varying_value_is_the_key_as_nginx_sends_it() {
        assert_eq!(key(&["/login", "t1"], 0b10), b"t1");
        assert_eq!(key(&["/login"], 0), b"");
    }

    #[test]
    fn several_values_never_join_to_one_key() {
        assert_eq!(key(&["a:b", "c"], 0b11), b"a\\:b:c");
        assert_ne!(key(&["a:b", "c"], 0b11), key(&["a", "b:c"], 0b11));
        assert_ne!(key(&["a\\", "b"], 0b11), key(&["a", "\\b"], 0b11));
    }

    #[test]
    fn keys_are_hashed_as_the_lua_client_hashes_them() {
        let hashed = |s: &str| String::from_utf8(wire_key(Cow::Borrowed(s.as_bytes()), 512).into_owned()).unwrap();
        assert_eq!(hashed(""), "md5:d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(hashed("t1"), "t1");
        assert!(hashed(&"x".repeat(513)).starts_with("md5:"));
        assert!(hashed("a\u{1}b").starts_with("md5:"));
        assert_eq!(hashed("md5:d41d8cd98f00b204e9800998ecf8427e").len(), 36);
        assert_ne!(hashed("md5:d41d8cd98f00b204e9800998ecf8427e"), hashed(""));
    }
}
