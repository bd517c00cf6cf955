//! LEASE_SHARE (op 10, docs/PROTOCOL.md section 4h): units of the daemon's
//! quota lease on a policy's key, for an nginx worker's shared dict.
//! CHECK_POLICY's header without flags and exactly one item, whose cost is
//! the units wanted (1..=`MAX_SHARE_UNITS`); with `FLAG_GIVE_BACK`, the
//! units of a share given back unused (1..=`MAX_GIVE_BACK_UNITS`).

use bytes::{Bytes, BytesMut};

use crate::protocol::header::{check_local_limit, exactly_one, opening, refused, Bounds, Head, Header, Refused};
use crate::protocol::item::{one_item, put_frame};
use crate::protocol::op::check_policy::{PolicyCheckArgs, PolicyCheckRequest, FIXED};
use crate::protocol::wire::{be32, ErrorCode, FLAG_GIVE_BACK, MAX_GIVE_BACK_UNITS, MAX_SHARE_UNITS, OP_LEASE_SHARE, POLICY_HEADER_LEN};

/// What a LEASE_SHARE frame asks.
pub(crate) enum LeaseShare {
    /// Units wanted.
    Share(PolicyCheckRequest),
    /// With `FLAG_GIVE_BACK`: units of a share that no worker used.
    GiveBack(PolicyCheckRequest),
}

/// Parses and validates a LEASE_SHARE body, in the validation order of
/// docs/PROTOCOL.md section 4h.
#[inline]
pub(crate) fn parse(head: Head, body: Bytes, bounds: &Bounds) -> Result<LeaseShare, Refused> {
    let op = head.op;
    let (flags, on_error) = opening(&body, FIXED, "lease-share", |flags| flags & !FLAG_GIVE_BACK == 0, |flags| format!("flags 0x{flags:04x}: op {op} defines 0x0001 (give back) only"))?;
    let give_back = flags == FLAG_GIVE_BACK;
    exactly_one(&body, "items in one lease-share request")?;
    let local_limit = be32(&body, 10);
    let (item, _) = one_item(&body, POLICY_HEADER_LEN, None, bounds)?;
    if give_back && item.cost > MAX_GIVE_BACK_UNITS {
        return Err(refused(ErrorCode::InvalidCost, format!("{} units given back; a give-back is 1..={MAX_GIVE_BACK_UNITS}", item.cost)));
    }
    if !give_back && item.cost > MAX_SHARE_UNITS {
        return Err(refused(ErrorCode::InvalidCost, format!("{} units wanted; a share is 1..={MAX_SHARE_UNITS}", item.cost)));
    }
    check_local_limit(on_error, local_limit, bounds)?;
    let r = PolicyCheckRequest { header: Header { id: head.id, on_error, local_limit }, item };
    Ok(if give_back { LeaseShare::GiveBack(r) } else { LeaseShare::Share(r) })
}

/// Appends one LEASE_SHARE frame (op 10) to `dst`: `a.cost` is the units wanted.
pub fn encode_lease_share(id: u32, a: &PolicyCheckArgs<'_>, dst: &mut BytesMut) {
    put_frame(Head { op: OP_LEASE_SHARE, id }, 0, a.on_error.to_wire(), &a.local_limit.to_be_bytes(), &[a.item()], dst);
}

/// Appends one give-back frame (op 10 with `FLAG_GIVE_BACK`) to `dst`:
/// `a.cost` is the units given back.
pub fn encode_give_back(id: u32, a: &PolicyCheckArgs<'_>, dst: &mut BytesMut) {
    put_frame(Head { op: OP_LEASE_SHARE, id }, FLAG_GIVE_BACK, a.on_error.to_wire(), &a.local_limit.to_be_bytes(), &[a.item()], dst);
}
