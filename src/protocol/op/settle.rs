//! Reserve and settle (docs/PROTOCOL.md section 4f): a reserve is a
//! CHECK_POLICY with the settle flag, every item's cost an estimate,
//! reserved all or nothing; SETTLE (op 9) has REFUND's layout, the
//! reserve's handle and items with the actual cost in place of the
//! estimate. Costs go up to `MAX_O1_COST` (the policies' algorithms and
//! limits are checked once they are resolved).

use bytes::{Bytes, BytesMut};

use crate::protocol::header::{check_local_limit, Bounds, Head, Header, Refused};
use crate::protocol::item::{parse_items, put_frame, ItemArgs, PolicyItem};
use crate::protocol::op::refund::parse_handled;
use crate::protocol::wire::{FailPolicy, FLAG_SETTLE, HANDLE_LEN, MAX_O1_COST, OP_CHECK_POLICY, OP_SETTLE, POLICY_HEADER_LEN};

/// A reserve (CHECK_POLICY with the settle flag): every item's cost, an
/// estimate, reserved all or nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReserveRequest {
    pub header: Header,
    /// 1..=`MAX_POLICY_ITEMS`, no (name, key) twice; costs 1..=`MAX_O1_COST`.
    pub items: Vec<PolicyItem>,
}

/// A SETTLE request (op 9): the handle a reserve was answered with, and
/// its items with the actual cost in place of the estimate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettleRequest {
    pub id: u32,
    pub handle: [u8; HANDLE_LEN],
    /// The reserve's items; each `cost` is the actual: 0..=`MAX_O1_COST`.
    pub items: Vec<PolicyItem>,
}

/// The bounds of a reserve's or settle's costs.
fn o1(bounds: &Bounds) -> Bounds {
    Bounds { max_cost: bounds.max_cost.max(MAX_O1_COST), ..*bounds }
}

/// The rest of a CHECK_POLICY with the settle flag, after its header and
/// item count (checked by `check_policy::parse`).
pub(crate) fn parse_reserve(header: Header, body: &Bytes, n_items: usize, bounds: &Bounds) -> Result<ReserveRequest, Refused> {
    let items = parse_items(body, POLICY_HEADER_LEN, n_items, &o1(bounds), 1)?;
    check_local_limit(header.on_error, header.local_limit, bounds)?;
    Ok(ReserveRequest { header, items })
}

/// Parses and validates a SETTLE body: REFUND's checks, each cost the
/// actual (0..=`MAX_O1_COST`).
pub(crate) fn parse(head: Head, body: Bytes, bounds: &Bounds) -> Result<SettleRequest, Refused> {
    let (handle, items) = parse_handled(&body, "settle", &o1(bounds), 0)?;
    Ok(SettleRequest { id: head.id, handle, items })
}

/// Appends one CHECK_POLICY frame with the settle flag: reserve each
/// item's cost, an estimate, all or nothing.
pub fn encode_reserve(id: u32, on_error: FailPolicy, local_limit: u32, items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    put_frame(Head { op: OP_CHECK_POLICY, id }, FLAG_SETTLE, on_error.to_wire(), &local_limit.to_be_bytes(), items, dst);
}

/// Appends one SETTLE frame (op 9): the reserve's handle and items, each
/// item's cost being the actual.
pub fn encode_settle(id: u32, handle: &[u8; HANDLE_LEN], items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    put_frame(Head { op: OP_SETTLE, id }, 0, 0, handle, items, dst);
}
