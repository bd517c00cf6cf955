//! What the ops share: the fields every decided request carries
//! (`Header`), the bounds a request is validated against (`Bounds`), the
//! refusal of a frame that is no valid request (`Refused`), and the rules
//! more than one op applies, each written once: the first bytes of a body,
//! a client's key, a fail policy, a local quota, a lease id.

use std::borrow::Cow;

use bytes::{BufMut, BytesMut};

use super::wire::{be16, be32, ErrorCode, FailPolicy, LEN_PREFIX, LIMIT_ENTRY_LEN, MAX_LEASE_ID_LEN, REQUEST_HEADER_LEN, VERSION};

/// Bounds a request must stay within; set from `[limits]` in the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub max_key_len: usize,
    pub max_limit: u32,
    pub max_window_ms: u32,
    /// Largest cost of one request: each unit is one ZSET member, written
    /// inside the atomic script, so a huge cost would stall Redis.
    pub max_cost: u32,
}

impl Default for Bounds {
    fn default() -> Self {
        Self { max_key_len: 512, max_limit: 1_000_000, max_window_ms: 86_400_000, max_cost: 1000 }
    }
}

/// The fields a decided request carries whatever its op: the id its
/// answer echoes, the location's fail policy, and the per-host quota the
/// `local` fail policy falls back to (0 unless `on_error` is local).
/// REFUND, SETTLE and DESCRIBE_POLICY have no fail policy: they carry the
/// id alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub id: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
}

/// A frame read whole that is not a valid request: the code its answer
/// carries and why. The stream stays in sync: the next frame is read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Refused {
    pub code: ErrorCode,
    pub message: Cow<'static, str>,
}

pub(super) fn refused(code: ErrorCode, message: impl Into<Cow<'static, str>>) -> Refused {
    Refused { code, message: message.into() }
}

/// The first bytes of every body, in every protocol version: version, op,
/// request id. An op's own fields follow, from its flags at bytes 6..8.
#[derive(Clone, Copy, Debug)]
pub(super) struct Head {
    pub op: u8,
    pub id: u32,
}

/// Bytes of `Head`.
pub(super) const HEAD_LEN: usize = 6;

impl Head {
    /// The head of `body`: `Err` with the id when it is known (0 when the
    /// body is shorter than the head).
    #[inline]
    pub fn parse(body: &[u8]) -> Result<Self, (u32, u8, Refused)> {
        if body.len() < HEAD_LEN {
            let why = format!("frame body of {} bytes is shorter than the {HEAD_LEN}-byte header", body.len());
            return Err((0, 0, refused(ErrorCode::Malformed, why)));
        }
        let (version, op, id) = (body[0], body[1], be32(body, 2));
        if version != VERSION {
            let why = format!("protocol version {version} is not supported (this daemon speaks {VERSION})");
            return Err((id, op, refused(ErrorCode::UnsupportedVersion, why)));
        }
        Ok(Self { op, id })
    }

    /// Appends the length prefix, the head and `flags` of a body of
    /// `body_len` bytes, with room reserved for all of it.
    pub fn put(self, body_len: usize, flags: u16, dst: &mut BytesMut) {
        dst.reserve(LEN_PREFIX + body_len);
        dst.put_u32(body_len as u32);
        dst.put_u8(VERSION);
        dst.put_u8(self.op);
        dst.put_u32(self.id);
        dst.put_u16(flags);
    }
}

// The checks below are on the request path and are inlined there; the
// refusals they build (a `format!` each) are cold and kept out of line.

/// MALFORMED unless `body` holds an op's `fixed` bytes.
#[inline]
pub(super) fn fixed_len(body: &[u8], fixed: usize, what: &str) -> Result<(), Refused> {
    if body.len() < fixed {
        return Err(too_short(body.len(), fixed, what));
    }
    Ok(())
}

#[cold]
fn too_short(len: usize, fixed: usize, what: &str) -> Refused {
    refused(ErrorCode::Malformed, format!("{what} body of {len} bytes is shorter than the {fixed} fixed bytes"))
}

/// The checks an op with a fail policy starts with, in docs/PROTOCOL.md's
/// order: the body holds the op's `fixed` bytes, `allowed` takes its flags
/// (else `unsupported` says why), its fail policy is one this daemon has.
#[inline]
pub(super) fn opening(body: &[u8], fixed: usize, what: &str, allowed: impl Fn(u16) -> bool, unsupported: impl Fn(u16) -> String) -> Result<(u16, FailPolicy), Refused> {
    fixed_len(body, fixed, what)?;
    let flags = flags(body);
    if !allowed(flags) {
        return Err(refused(ErrorCode::UnsupportedFlags, unsupported(flags)));
    }
    Ok((flags, fail_policy(body)?))
}

/// The count at byte 9 of an op that takes one limit or item: `what` is
/// what it counts ("limits in one request").
#[inline]
pub(super) fn exactly_one(body: &[u8], what: &str) -> Result<(), Refused> {
    if body[9] != 1 {
        return Err(not_one(body[9], what));
    }
    Ok(())
}

#[cold]
fn not_one(n: u8, what: &str) -> Refused {
    refused(ErrorCode::UnsupportedLimitCount, format!("{n} {what}; exactly 1"))
}

/// The limit entry CHECK and ACQUIRE/RELEASE carry at bytes 10..28, after
/// the header: limit, window (a lease's length), cost, local quota, key
/// length.
#[derive(Clone, Copy, Debug)]
pub(super) struct LimitEntry {
    pub limit: u32,
    pub window_ms: u32,
    pub cost: u32,
    pub local_limit: u32,
    pub key_len: usize,
}

impl LimitEntry {
    /// Bytes of the header and the entry.
    pub const END: usize = REQUEST_HEADER_LEN + LIMIT_ENTRY_LEN;

    /// The entry of a body of at least `END` bytes.
    #[inline]
    pub fn parse(body: &[u8]) -> Self {
        let e = REQUEST_HEADER_LEN;
        Self { limit: be32(body, e), window_ms: be32(body, e + 4), cost: be32(body, e + 8), local_limit: be32(body, e + 12), key_len: be16(body, e + 16) as usize }
    }

    /// Appends byte 8 (`on_error`), the count (1) and the entry.
    pub fn put(&self, on_error: FailPolicy, dst: &mut BytesMut) {
        dst.put_u8(on_error.to_wire());
        dst.put_u8(1);
        dst.put_u32(self.limit);
        dst.put_u32(self.window_ms);
        dst.put_u32(self.cost);
        dst.put_u32(self.local_limit);
        dst.put_u16(self.key_len as u16);
    }
}

/// The flags at bytes 6..8 (the body's length checked first).
#[inline]
pub(super) fn flags(body: &[u8]) -> u16 {
    be16(body, 6)
}

/// The fail policy at byte 8.
#[inline]
pub(super) fn fail_policy(body: &[u8]) -> Result<FailPolicy, Refused> {
    FailPolicy::from_wire(body[8]).ok_or_else(|| no_fail_policy(body[8]))
}

#[cold]
fn no_fail_policy(b: u8) -> Refused {
    refused(ErrorCode::InvalidPolicy, format!("fail policy {b} is not 0 (open), 1 (closed) or 2 (local)"))
}

/// A client's key: 1..=`max_key_len` bytes, none a control byte.
#[inline]
pub(super) fn check_key(key: &[u8], bounds: &Bounds) -> Result<(), Refused> {
    if key.is_empty() || key.len() > bounds.max_key_len || key.iter().any(|&b| b < 0x20 || b == 0x7f) {
        return Err(bad_key(key, bounds));
    }
    Ok(())
}

#[cold]
fn bad_key(key: &[u8], bounds: &Bounds) -> Refused {
    match key.iter().position(|&b| b < 0x20 || b == 0x7f) {
        Some(pos) if !key.is_empty() && key.len() <= bounds.max_key_len => refused(ErrorCode::InvalidKey, format!("key byte {pos} is a control character")),
        _ => refused(ErrorCode::InvalidKey, format!("key length {} is outside 1..={}", key.len(), bounds.max_key_len)),
    }
}

/// An inline limit: 1..=`max_limit`.
#[inline]
pub(super) fn check_limit(limit: u32, bounds: &Bounds) -> Result<(), Refused> {
    if limit == 0 || limit > bounds.max_limit {
        return Err(bad_limit(limit, bounds));
    }
    Ok(())
}

#[cold]
fn bad_limit(limit: u32, bounds: &Bounds) -> Refused {
    refused(ErrorCode::InvalidLimit, format!("limit {limit} is outside 1..={}", bounds.max_limit))
}

/// The cost against an inline limit: 1..=min(limit, `max_cost`).
#[inline]
pub(super) fn check_cost(cost: u32, limit: u32, bounds: &Bounds) -> Result<(), Refused> {
    if cost == 0 || cost > limit || cost > bounds.max_cost {
        return Err(bad_cost(cost, limit, bounds));
    }
    Ok(())
}

#[cold]
fn bad_cost(cost: u32, limit: u32, bounds: &Bounds) -> Refused {
    refused(ErrorCode::InvalidCost, format!("cost {cost} is outside 1..=min(limit {limit}, max_cost {})", bounds.max_cost))
}

/// The `local` fail policy needs a local quota within the bounds.
#[inline]
pub(super) fn check_local_limit(on_error: FailPolicy, local_limit: u32, bounds: &Bounds) -> Result<(), Refused> {
    if on_error == FailPolicy::Local && (local_limit == 0 || local_limit > bounds.max_limit) {
        return Err(no_local_limit(local_limit, bounds));
    }
    Ok(())
}

#[cold]
fn no_local_limit(local_limit: u32, bounds: &Bounds) -> Refused {
    refused(ErrorCode::InvalidLocalLimit, format!("fail policy local needs a local limit in 1..={}, got {local_limit}", bounds.max_limit))
}

/// The lease id's rule (section 4d): 1..=`MAX_LEASE_ID_LEN` printable
/// bytes without spaces or '#' (which names a lease's further slots).
pub(super) fn check_lease_id(lease: &[u8]) -> Result<(), Refused> {
    if lease.is_empty() || lease.len() > MAX_LEASE_ID_LEN || lease.iter().any(|&b| b <= 0x20 || b == 0x7f || b == b'#') {
        let why = format!("lease id of {} bytes is not 1..={MAX_LEASE_ID_LEN} printable bytes without spaces or '#'", lease.len());
        return Err(refused(ErrorCode::InvalidLease, why));
    }
    Ok(())
}
