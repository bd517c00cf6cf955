//! ACQUIRE_POLICY (op 7, docs/PROTOCOL.md section 4e; with `FLAG_RELEASE`,
//! its release): a lease of a named concurrency policy. CHECK_POLICY's
//! header and one item, with the lease id's length before the item and the
//! lease id after it. The policy is named, not yet resolved: the daemon
//! takes the limit and lease length from it.

use bytes::{BufMut, Bytes, BytesMut};

use crate::protocol::header::{check_lease_id, check_local_limit, exactly_one, opening, Bounds, Head, Header, Refused};
use crate::protocol::item::{one_item, PolicyItem};
use crate::protocol::op::check_policy::PolicyCheckArgs;
use crate::protocol::wire::{be32, FLAG_RELEASE, OP_ACQUIRE_POLICY, POLICY_HEADER_LEN, POLICY_LEASE_HEADER_LEN};

/// One validated ACQUIRE_POLICY or its release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyLeaseRequest {
    /// The location's fail policy and local quota; the policy's own fail
    /// policy takes precedence.
    pub header: Header,
    pub release: bool,
    /// The policy, the key and the cost, as CHECK_POLICY's.
    pub item: PolicyItem,
    /// The client's name for this lease, as in ACQUIRE.
    pub lease: Bytes,
}

/// An ACQUIRE_POLICY as the client builds it (no validation): a
/// CHECK_POLICY of one item and the client's name for the lease, as its
/// frame is.
#[derive(Clone, Copy, Debug)]
pub struct PolicyLeaseArgs<'a> {
    pub check: PolicyCheckArgs<'a>,
    pub lease: &'a [u8],
}

/// Parses and validates an ACQUIRE_POLICY body, in the validation order of
/// docs/PROTOCOL.md section 4e.
pub(crate) fn parse(head: Head, mut body: Bytes, bounds: &Bounds) -> Result<PolicyLeaseRequest, Refused> {
    let op = head.op;
    let unsupported = |flags| format!("flags 0x{flags:04x}: only 0x0001 (release) is defined for op {op}");
    let (flags, on_error) = opening(&body, POLICY_LEASE_HEADER_LEN, "acquire-policy", |flags| flags & !FLAG_RELEASE == 0, unsupported)?;
    exactly_one(&body, "items in one acquire-policy request")?;
    let local_limit = be32(&body, 10);
    let lease_len = body[POLICY_HEADER_LEN] as usize;
    let (item, end) = one_item(&body, POLICY_HEADER_LEN + 1, Some(lease_len), bounds)?;
    check_lease_id(&body[end..])?;
    check_local_limit(on_error, local_limit, bounds)?;
    let lease = body.split_off(end);
    Ok(PolicyLeaseRequest { header: Header { id: head.id, on_error, local_limit }, release: flags & FLAG_RELEASE != 0, item, lease })
}

/// Appends one ACQUIRE_POLICY frame (op 7; with `release`, the release) to `dst`.
pub fn encode_policy_lease_request(id: u32, release: bool, a: &PolicyLeaseArgs<'_>, dst: &mut BytesMut) {
    let item = a.check.item();
    Head { op: OP_ACQUIRE_POLICY, id }.put(POLICY_HEADER_LEN + 1 + item.len() + a.lease.len(), if release { FLAG_RELEASE } else { 0 }, dst);
    dst.put_u8(a.check.on_error.to_wire());
    dst.put_u8(1);
    dst.put_u32(a.check.local_limit);
    dst.put_u8(a.lease.len() as u8);
    item.put(dst);
    dst.put_slice(a.lease);
}
