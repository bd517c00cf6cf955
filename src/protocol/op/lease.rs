//! ACQUIRE and RELEASE (ops 5 and 6, docs/PROTOCOL.md section 4d): a
//! concurrency lease of an inline limit, named by the client. RELEASE is
//! checked as ACQUIRE is: a client sends the same fields to release as it
//! sent to acquire.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::protocol::header::{check_cost, check_key, check_limit, check_lease_id, check_local_limit, exactly_one, opening, refused, Bounds, Head, Header, LimitEntry, Refused};
use crate::protocol::wire::{ErrorCode, FailPolicy, LEASE_HEADER_LEN};

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
    let (_, on_error) = opening(&body, LEASE_HEADER_LEN, "lease", |flags| flags == 0, |flags| format!("flags 0x{flags:04x} are not supported for op {op}"))?;
    exactly_one(&body, "limits in one request")?;
    let LimitEntry { limit, window_ms: lease_ms, cost, local_limit, key_len } = LimitEntry::parse(&body);
    let lease_len = body[LimitEntry::END] as usize;
    if body.len() != LEASE_HEADER_LEN + key_len + lease_len {
        let why = format!("key length {key_len} and lease length {lease_len} do not match the {} bytes left in the frame", body.len() - LEASE_HEADER_LEN);
        return Err(refused(ErrorCode::Malformed, why));
    }
    let lease_at = LEASE_HEADER_LEN + key_len;
    check_key(&body[LEASE_HEADER_LEN..lease_at], bounds)?;
    check_lease_id(&body[lease_at..])?;
    check_limit(limit, bounds)?;
    if lease_ms == 0 || lease_ms > bounds.max_window_ms {
        return Err(refused(ErrorCode::InvalidLease, format!("lease length {lease_ms} ms is outside 1..={} ms", bounds.max_window_ms)));
    }
    check_cost(cost, limit, bounds)?;
    check_local_limit(on_error, local_limit, bounds)?;
    body.advance(LEASE_HEADER_LEN);
    let lease = body.split_off(key_len);
    Ok(LeaseRequest { header: Header { id: head.id, on_error, local_limit }, op, limit, lease_ms, cost, key: body, lease })
}

/// Appends one ACQUIRE (`op` 5) or RELEASE (`op` 6) frame to `dst`.
pub fn encode_lease_request(id: u32, op: u8, a: &LeaseArgs<'_>, dst: &mut BytesMut) {
    Head { op, id }.put(LEASE_HEADER_LEN + a.key.len() + a.lease.len(), 0, dst);
    LimitEntry { limit: a.limit, window_ms: a.lease_ms, cost: a.cost, local_limit: a.local_limit, key_len: a.key.len() }.put(a.on_error, dst);
    dst.put_u8(a.lease.len() as u8);
    dst.put_slice(a.key);
    dst.put_slice(a.lease);
}
