//! A policy item: a policy's name, a key and a cost, as CHECK_POLICY,
//! REFUND, SETTLE, ACQUIRE_POLICY and LEASE_SHARE carry it (cost, key
//! length, name length, the name, the key); decoded into `PolicyItem`,
//! encoded from `ItemArgs`.

use bytes::{BufMut, Bytes, BytesMut};

use super::header::{check_key, refused, Bounds, Head, Refused};
use super::wire::{be16, be32, ErrorCode, MAX_POLICY_ITEMS, MAX_POLICY_NAME_LEN, POLICY_HEADER_LEN, POLICY_ITEM_LEN, REQUEST_HEADER_LEN};

/// One item of a request, not yet resolved: its cost and its scoped key,
/// from which the policy's name and the client's key are read (no copy,
/// and one reference to the frame, not three).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyItem {
    pub cost: u32,
    /// The key the stores count under: the name's length byte, the name and
    /// the key, as they lie in the frame. The first byte is a control byte,
    /// which no inline key may hold, and the name is length-prefixed: two
    /// policies, or a policy and an inline check, never share a window.
    pub scoped_key: Bytes,
}

impl PolicyItem {
    /// The policy's name as sent: 1..=`MAX_POLICY_NAME_LEN` bytes, not yet looked up.
    pub fn name(&self) -> &[u8] {
        &self.scoped_key[1..1 + self.scoped_key[0] as usize]
    }

    /// The client's key (what overrides and the allowlist are matched against).
    pub fn key(&self) -> &[u8] {
        &self.scoped_key[1 + self.scoped_key[0] as usize..]
    }
}

/// One item as the client builds it (no validation).
#[derive(Clone, Copy, Debug)]
pub struct ItemArgs<'a> {
    pub policy: &'a [u8],
    pub key: &'a [u8],
    pub cost: u32,
}

impl ItemArgs<'_> {
    pub(super) fn len(&self) -> usize {
        POLICY_ITEM_LEN + self.policy.len() + self.key.len()
    }

    pub(super) fn put(&self, dst: &mut BytesMut) {
        dst.put_u32(self.cost);
        dst.put_u16(self.key.len() as u16);
        dst.put_u8(self.policy.len() as u8);
        dst.put_slice(self.policy);
        dst.put_slice(self.key);
    }
}

/// Appends a frame of `items`: the head, `flags`, byte 8 (a fail policy,
/// or 0), the item count, `fixed` (CHECK_POLICY's local limit, REFUND's
/// handle), then the items.
pub(super) fn put_frame(head: Head, flags: u16, byte8: u8, fixed: &[u8], items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    head.put(REQUEST_HEADER_LEN + fixed.len() + items.iter().map(ItemArgs::len).sum::<usize>(), flags, dst);
    dst.put_u8(byte8);
    dst.put_u8(items.len() as u8);
    dst.put_slice(fixed);
    for i in items {
        i.put(dst);
    }
}

/// The item count at byte 9 of a request of several items: 1..=`MAX_POLICY_ITEMS`.
#[inline]
pub(super) fn item_count(body: &[u8], what: &str) -> Result<usize, Refused> {
    let n = body[9] as usize;
    if n == 0 || n > MAX_POLICY_ITEMS {
        return Err(too_many(n, what));
    }
    Ok(n)
}

#[cold]
fn too_many(n: usize, what: &str) -> Refused {
    refused(ErrorCode::UnsupportedLimitCount, format!("{n} items in one {what}; 1..={MAX_POLICY_ITEMS} are accepted"))
}

/// The name and key lengths of the item at `at`.
#[inline]
fn lengths(body: &[u8], at: usize) -> (usize, usize) {
    (body[at + 6] as usize, be16(body, at + 4) as usize)
}

/// `n` items from `at` to the end of the body, which they must fill
/// exactly; no (name, key) twice.
pub(super) fn parse_items(body: &Bytes, at: usize, n: usize, bounds: &Bounds, min_cost: u32) -> Result<Vec<PolicyItem>, Refused> {
    // Lengths first, so that a frame whose items do not add up is
    // MALFORMED whatever its fields hold.
    let mut end = at;
    for i in 0..n {
        if body.len() < end + POLICY_ITEM_LEN {
            return Err(refused(ErrorCode::Malformed, format!("item {} of {n} does not fit the {}-byte frame", i + 1, body.len())));
        }
        let (name_len, key_len) = lengths(body, end);
        end += POLICY_ITEM_LEN + name_len + key_len;
    }
    if end != body.len() {
        return Err(refused(ErrorCode::Malformed, format!("the {n} items take {} bytes, the frame has {}", end - at, body.len() - at)));
    }
    let mut items: Vec<PolicyItem> = Vec::with_capacity(n);
    let mut next = at;
    for _ in 0..n {
        let (item, after) = parse_item(body, next, bounds, min_cost)?;
        if items.iter().any(|i| i.scoped_key == item.scoped_key) {
            let why = format!("policy '{}' and key '{}' appear twice", item.name().escape_ascii(), item.key().escape_ascii());
            return Err(refused(ErrorCode::DuplicateItem, why));
        }
        items.push(item);
        next = after;
    }
    Ok(items)
}

/// The one item at `at` of a body laid out as CHECK_POLICY's (ACQUIRE_POLICY's
/// has a lease id of `lease_len` bytes after it), which its lengths must
/// fill exactly.
#[inline]
pub(super) fn one_item(body: &Bytes, at: usize, lease_len: Option<usize>, bounds: &Bounds) -> Result<(PolicyItem, usize), Refused> {
    let (name_len, key_len) = lengths(body, at);
    let fixed = at + POLICY_ITEM_LEN;
    if body.len() != fixed + name_len + key_len + lease_len.unwrap_or(0) {
        let left = body.len() - fixed;
        let why = match lease_len {
            None => format!("name length {name_len} and key length {key_len} do not match the {left} bytes left in the frame"),
            Some(lease_len) => format!("name length {name_len}, key length {key_len} and lease length {lease_len} do not match the {left} bytes left in the frame"),
        };
        return Err(refused(ErrorCode::Malformed, why));
    }
    parse_item(body, at, bounds, 1)
}

/// One item at `at` (its lengths already match the body): the item and
/// the offset after it.
fn parse_item(body: &Bytes, at: usize, bounds: &Bounds, min_cost: u32) -> Result<(PolicyItem, usize), Refused> {
    let cost = be32(body, at);
    let (name_len, key_len) = lengths(body, at);
    if name_len == 0 || name_len > MAX_POLICY_NAME_LEN {
        return Err(refused(ErrorCode::UnknownPolicy, format!("policy name length {name_len} is outside 1..={MAX_POLICY_NAME_LEN}")));
    }
    let name_at = at + POLICY_ITEM_LEN;
    let key_at = name_at + name_len;
    let end = key_at + key_len;
    check_key(&body[key_at..end], bounds)?;
    // The limit comes from the policy: the daemon checks cost against it
    // once the policy is resolved.
    if cost < min_cost || cost > bounds.max_cost {
        return Err(refused(ErrorCode::InvalidCost, format!("cost {cost} is outside {min_cost}..=max_cost {}", bounds.max_cost)));
    }
    Ok((PolicyItem { cost, scoped_key: body.slice(name_at - 1..end) }, end))
}

/// The name and key of the one item of a CHECK_POLICY-shaped body, for
/// logs; `None` when the body does not hold an item of the lengths it says.
pub(super) fn logged(body: &[u8]) -> Option<(&[u8], &[u8])> {
    let fixed = POLICY_HEADER_LEN + POLICY_ITEM_LEN;
    if body.len() <= fixed {
        return None;
    }
    let (name_len, key_len) = lengths(body, POLICY_HEADER_LEN);
    (fixed + name_len + key_len == body.len()).then(|| body[fixed..].split_at(name_len))
}
