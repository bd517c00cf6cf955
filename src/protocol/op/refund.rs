//! REFUND (op 3, docs/PROTOCOL.md section 4c): the handle a refundable
//! CHECK_POLICY was answered with, and that check's items, to take its
//! admissions back. SETTLE (`settle.rs`) has the same layout.

use bytes::{Bytes, BytesMut};

use crate::protocol::header::{fixed_len, flags, refused, Bounds, Head, Refused};
use crate::protocol::item::{item_count, parse_items, put_frame, ItemArgs, PolicyItem};
use crate::protocol::wire::{ErrorCode, HANDLE_LEN, OP_REFUND, POLICY_ITEM_LEN, REFUND_HEADER_LEN};

/// A REFUND request: the handle a refundable check was answered with, and
/// that check's items.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundRequest {
    pub id: u32,
    pub handle: [u8; HANDLE_LEN],
    pub items: Vec<PolicyItem>,
}

/// Parses and validates a REFUND body, in the validation order of
/// docs/PROTOCOL.md section 4c.
pub(crate) fn parse(head: Head, body: Bytes, bounds: &Bounds) -> Result<RefundRequest, Refused> {
    let (handle, items) = parse_handled(&body, "refund", bounds, 1)?;
    Ok(RefundRequest { id: head.id, handle, items })
}

/// A body of REFUND's layout (`what`: "refund" or "settle"): no flags, a
/// handle, 1..=`MAX_POLICY_ITEMS` items of costs `min_cost..=max_cost`.
pub(crate) fn parse_handled(body: &Bytes, what: &str, bounds: &Bounds, min_cost: u32) -> Result<([u8; HANDLE_LEN], Vec<PolicyItem>), Refused> {
    fixed_len(body, REFUND_HEADER_LEN + POLICY_ITEM_LEN, what)?;
    let flags = flags(body);
    if flags != 0 {
        return Err(refused(ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x}: a {what} takes none")));
    }
    let n_items = item_count(body, what)?;
    let mut handle = [0u8; HANDLE_LEN];
    handle.copy_from_slice(&body[10..REFUND_HEADER_LEN]);
    Ok((handle, parse_items(body, REFUND_HEADER_LEN, n_items, bounds, min_cost)?))
}

/// Appends one REFUND frame to `dst`: the handle of a refundable check and
/// its items, as they were sent.
pub fn encode_refund(id: u32, handle: &[u8; HANDLE_LEN], items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    put_frame(Head { op: OP_REFUND, id }, 0, 0, handle, items, dst);
}
