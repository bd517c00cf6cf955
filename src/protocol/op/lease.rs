//! ACQUIRE and RELEASE (ops 5 and 6, docs/PROTOCOL.md section 4d): a
//! concurrency lease of an inline limit, named by the client. RELEASE is
//! checked as ACQUIRE is: a client sends the same fields to release as it
//! sent to acquire.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::protocol::header::{check_key, check_lease_id, check_local_limit, fail_policy, fixed_len, flags, refused, Bounds, Head, Header, Refused};
use crate::protocol::wire::{be16, be32, ErrorCode, FailPolicy, LEASE_HEADER_LEN};

/// One validated ACQUIRE or RELEASE of a concurrency lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRequest {
    pub header: Header,
    /// `OP_ACQUIRE` or `OP_RELEASE`.
    pub op: u8,
    /// Requests in flight at most (ACQUIRE).
    pub limit: u32,
    /// How long a lease holds its slots if never released (ACQUIRE).
    pub lease_ms: u32,
    pub cost: u32,
    pub key: Bytes,
    /// The client's name for this lease: unique among the key's leases.
    pub lease: Bytes,
}

/// An ACQUIRE or RELEASE as the client builds it (no validation).
#[derive(Clone, Debug)]
pub struct LeaseArgs<'a> {
    pub key: &'a [u8],
    pub lease: &'a [u8],
    pub limit: u32,
    pub lease_ms: u32,
    pub cost: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
}

/// Parses and validates an ACQUIRE or RELEASE body, in the validation
/// order of docs/PROTOCOL.md section 4d.
pub(crate) fn parse(head: Head, mut body: Bytes, bounds: &Bounds) -> Result<LeaseRequest, Refused> {
    let op = head.op;
    fixed_len(&body, LEASE_HEADER_LEN, "lease")?;
    let flags = flags(&body);
    if flags != 0 {
        return Err(refused(ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x} are not supported for op {op}")));
    }
    let on_error = fail_policy(&body)?;
    if body[9] != 1 {
        return Err(refused(ErrorCode::UnsupportedLimitCount, format!("{} limits in one request; exactly 1", body[9])));
    }
    let (limit, lease_ms, cost, local_limit) = (be32(&body, 10), be32(&body, 14), be32(&body, 18), be32(&body, 22));
    let key_len = be16(&body, 26) as usize;
    let lease_len = body[28] as usize;
    if body.len() != LEASE_HEADER_LEN + key_len + lease_len {
        let why = format!("key length {key_len} and lease length {lease_len} do not match the {} bytes left in the frame", body.len() - LEASE_HEADER_LEN);
        return Err(refused(ErrorCode::Malformed, why));
    }
    let lease_at = LEASE_HEADER_LEN + key_len;
    check_key(&body[LEASE_HEADER_LEN..lease_at], bounds)?;
    check_lease_id(&body[lease_at..])?;
    if limit == 0 || limit > bounds.max_limit {
        return Err(refused(ErrorCode::InvalidLimit, format!("limit {limit} is outside 1..={}", bounds.max_limit)));
    }
    if lease_ms == 0 || lease_ms > bounds.max_window_ms {
        return Err(refused(ErrorCode::InvalidLease, format!("lease length {lease_ms} ms is outside 1..={} ms", bounds.max_window_ms)));
    }
    if cost == 0 || cost > limit || cost > bounds.max_cost {
        return Err(refused(ErrorCode::InvalidCost, format!("cost {cost} is outside 1..=min(limit {limit}, max_cost {})", bounds.max_cost)));
    }
    check_local_limit(on_error, local_limit, bounds)?;
    body.advance(LEASE_HEADER_LEN);
    let lease = body.split_off(key_len);
    Ok(LeaseRequest { header: Header { id: head.id, on_error, local_limit }, op, limit, lease_ms, cost, key: body, lease })
}

/// Appends one ACQUIRE (`op` 5) or RELEASE (`op` 6) frame to `dst`.
pub fn encode_lease_request(id: u32, op: u8, a: &LeaseArgs<'_>, dst: &mut BytesMut) {
    Head { op, id }.put(LEASE_HEADER_LEN + a.key.len() + a.lease.len(), 0, dst);
    dst.put_u8(a.on_error.to_wire());
    dst.put_u8(1);
    dst.put_u32(a.limit);
    dst.put_u32(a.lease_ms);
    dst.put_u32(a.cost);
    dst.put_u32(a.local_limit);
    dst.put_u16(a.key.len() as u16);
    dst.put_u8(a.lease.len() as u8);
    dst.put_slice(a.key);
    dst.put_slice(a.lease);
}
