//! CHECK (op 1, docs/PROTOCOL.md section 4): an inline limit, its window
//! and algorithm, a cost and a key; with `FLAG_SHARE`, units of the
//! inline limit's quota lease for a worker (section 4h), and with
//! `FLAG_SHARE_GIVE_BACK` too, units of such a share given back. The hot path:
//! decoded without an allocation, the key left where it lies in the frame.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::protocol::header::{check_cost, check_key, check_limit, check_local_limit, fail_policy, fixed_len, flags, refused, Bounds, Head, Header, LimitEntry, Refused};
use crate::protocol::wire::{be16, Algorithm, ErrorCode, FailPolicy, ALGORITHM_FLAGS, FLAG_SHARE, FLAG_SHARE_GIVE_BACK, MAX_GIVE_BACK_UNITS, MAX_SHARE_UNITS, OP_CHECK, VERSION};

/// One validated rate-limit check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckRequest {
    pub header: Header,
    pub limit: u32,
    pub window_ms: u32,
    /// The cost; of a share, the units wanted (1..=`MAX_SHARE_UNITS`).
    pub cost: u32,
    /// The client's key, before the daemon adds its namespace prefix.
    pub key: Bytes,
    /// How the limit counts (flag bits `ALGORITHM_FLAGS`; the log when 0).
    pub algorithm: Algorithm,
}

/// A request as the client builds it (no validation); used by `query`, `bench` and tests.
#[derive(Clone, Debug)]
pub struct CheckArgs<'a> {
    pub key: &'a [u8],
    pub limit: u32,
    pub window_ms: u32,
    pub cost: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
}

/// What a CHECK frame asks.
pub(crate) enum Check {
    Check(CheckRequest),
    /// With `FLAG_SHARE`: units of the inline limit's lease.
    Share(CheckRequest),
    /// With `FLAG_SHARE | FLAG_SHARE_GIVE_BACK`: units of such a share
    /// that no worker used.
    GiveBack(CheckRequest),
}

/// Where the key starts: after the header and the one limit entry.
const KEY_AT: usize = LimitEntry::END;

/// Parses and validates a CHECK body, in the validation order of
/// docs/PROTOCOL.md section 4.
#[inline]
pub(crate) fn parse(head: Head, mut body: Bytes, bounds: &Bounds) -> Result<Check, Refused> {
    fixed_len(&body, KEY_AT, "check")?;
    let flags = flags(&body);
    if flags & !(ALGORITHM_FLAGS | FLAG_SHARE | FLAG_SHARE_GIVE_BACK) != 0 || flags & (FLAG_SHARE | FLAG_SHARE_GIVE_BACK) == FLAG_SHARE_GIVE_BACK {
        return Err(refused(ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x} are not supported in version {VERSION}")));
    }
    let share = flags & FLAG_SHARE != 0;
    let give_back = flags & FLAG_SHARE_GIVE_BACK != 0;
    let algorithm = Algorithm::from_flags(flags).map_err(|bits| refused(ErrorCode::UnknownAlgorithm, format!("algorithm {bits} (flags 0x{flags:04x}) is not one this daemon has")))?;
    let on_error = fail_policy(&body)?;
    let n_limits = body[9];
    if n_limits != 1 {
        return Err(refused(ErrorCode::UnsupportedLimitCount, format!("{n_limits} limits in one request; version {VERSION} takes exactly 1")));
    }
    let LimitEntry { limit, window_ms, cost, local_limit, key_len } = LimitEntry::parse(&body);
    if body.len() != KEY_AT + key_len {
        return Err(refused(ErrorCode::Malformed, format!("key length {key_len} does not match the {} bytes left in the frame", body.len() - KEY_AT)));
    }
    check_key(&body[KEY_AT..], bounds)?;
    check_limit(limit, bounds)?;
    if window_ms == 0 || window_ms > bounds.max_window_ms {
        return Err(refused(ErrorCode::InvalidWindow, format!("window {window_ms} ms is outside 1..={} ms", bounds.max_window_ms)));
    }
    if give_back && (cost == 0 || cost > MAX_GIVE_BACK_UNITS) {
        return Err(refused(ErrorCode::InvalidCost, format!("{cost} units given back; a give-back is 1..={MAX_GIVE_BACK_UNITS}")));
    }
    if share && !give_back && (cost == 0 || cost > MAX_SHARE_UNITS) {
        return Err(refused(ErrorCode::InvalidCost, format!("{cost} units wanted; a share is 1..={MAX_SHARE_UNITS}")));
    }
    if !share {
        check_cost(cost, limit, bounds)?;
    }
    check_local_limit(on_error, local_limit, bounds)?;
    body.advance(KEY_AT);
    let r = CheckRequest { header: Header { id: head.id, on_error, local_limit }, limit, window_ms, cost, key: body, algorithm };
    Ok(match (share, give_back) {
        (_, true) => Check::GiveBack(r),
        (true, false) => Check::Share(r),
        (false, false) => Check::Check(r),
    })
}

/// The key of a CHECK body, for logs; `None` when the body does not hold
/// a key of the length it says.
pub(crate) fn logged_key(body: &[u8]) -> Option<&[u8]> {
    (body.len() > KEY_AT && be16(body, KEY_AT - 2) as usize == body.len() - KEY_AT).then(|| &body[KEY_AT..])
}

/// Appends one check request frame to `dst` (the log algorithm).
pub fn encode_request(id: u32, a: &CheckArgs<'_>, dst: &mut BytesMut) {
    encode_request_with(id, a, Algorithm::Log, dst);
}

/// Appends one check request frame for `algorithm` to `dst`.
pub fn encode_request_with(id: u32, a: &CheckArgs<'_>, algorithm: Algorithm, dst: &mut BytesMut) {
    put(id, a, algorithm.to_flags(), dst);
}

/// Appends one worker-share frame of an inline limit (CHECK with
/// `FLAG_SHARE`) to `dst`: `a.cost` is the units wanted.
pub fn encode_inline_share(id: u32, a: &CheckArgs<'_>, dst: &mut BytesMut) {
    put(id, a, Algorithm::Log.to_flags() | FLAG_SHARE, dst);
}

/// Appends one give-back frame of an inline limit's share (CHECK with
/// `FLAG_SHARE | FLAG_SHARE_GIVE_BACK`) to `dst`: `a.cost` is the units
/// given back.
pub fn encode_inline_give_back(id: u32, a: &CheckArgs<'_>, dst: &mut BytesMut) {
    put(id, a, Algorithm::Log.to_flags() | FLAG_SHARE | FLAG_SHARE_GIVE_BACK, dst);
}

fn put(id: u32, a: &CheckArgs<'_>, flags: u16, dst: &mut BytesMut) {
    Head { op: OP_CHECK, id }.put(KEY_AT + a.key.len(), flags, dst);
    LimitEntry { limit: a.limit, window_ms: a.window_ms, cost: a.cost, local_limit: a.local_limit, key_len: a.key.len() }.put(a.on_error, dst);
    dst.put_slice(a.key);
}
