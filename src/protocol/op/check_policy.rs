//! CHECK_POLICY (op 2, docs/PROTOCOL.md section 4b): named policies from
//! the daemon's configuration, each item a policy's name, a key and a
//! cost. One item without flags is the single check the fast path
//! decides; several items, or the refundable flag, are all or nothing;
//! the settle flag makes a reserve (`settle.rs`).

use bytes::{Bytes, BytesMut};

use crate::protocol::header::{check_local_limit, opening, Bounds, Head, Header, Refused};
use crate::protocol::item::{item_count, one_item, parse_items, put_frame, ItemArgs, PolicyItem};
use crate::protocol::op::settle::{parse_reserve, ReserveRequest};
use crate::protocol::wire::{be32, FailPolicy, FLAG_REFUNDABLE, FLAG_SETTLE, OP_CHECK_POLICY, POLICY_HEADER_LEN, POLICY_ITEM_LEN};

/// One validated CHECK_POLICY request (one item): the policy is named, not
/// yet resolved; the daemon looks it up in its configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyCheckRequest {
    /// The location's fail policy and local quota; a policy's own
    /// `fail_policy` takes precedence.
    pub header: Header,
    pub item: PolicyItem,
}

/// A CHECK_POLICY request as the client builds it (no validation).
#[derive(Clone, Copy, Debug)]
pub struct PolicyCheckArgs<'a> {
    pub policy: &'a [u8],
    pub key: &'a [u8],
    pub cost: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
}

impl<'a> PolicyCheckArgs<'a> {
    pub(crate) fn item(&self) -> ItemArgs<'a> {
        ItemArgs { policy: self.policy, key: self.key, cost: self.cost }
    }
}

/// A CHECK_POLICY request of several items (all or nothing), or of one
/// with the refundable flag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultiCheckRequest {
    pub header: Header,
    /// Answer with a refund handle.
    pub refundable: bool,
    /// 1..=`MAX_POLICY_ITEMS`, no (name, key) twice.
    pub items: Vec<PolicyItem>,
}

/// What a CHECK_POLICY frame asks.
pub(crate) enum PolicyCheck {
    One(PolicyCheckRequest),
    Many(MultiCheckRequest),
    Reserve(ReserveRequest),
}

/// The fixed bytes of CHECK_POLICY and LEASE_SHARE: the header and one item's.
pub(crate) const FIXED: usize = POLICY_HEADER_LEN + POLICY_ITEM_LEN;

/// Parses and validates a CHECK_POLICY body, in the validation order of
/// docs/PROTOCOL.md section 4b.
#[inline]
pub(crate) fn parse(head: Head, body: Bytes, bounds: &Bounds) -> Result<PolicyCheck, Refused> {
    let allowed = |flags| flags & !FLAG_REFUNDABLE == 0 || flags == FLAG_SETTLE;
    let unsupported = |flags| format!("flags 0x{flags:04x}: only 0x0001 (refundable) or 0x0002 (settle, alone) is defined");
    let (flags, on_error) = opening(&body, FIXED, "check-policy", allowed, unsupported)?;
    let n_items = item_count(&body, "check-policy request")?;
    let header = Header { id: head.id, on_error, local_limit: be32(&body, 10) };
    if flags == FLAG_SETTLE {
        return parse_reserve(header, &body, n_items, bounds).map(PolicyCheck::Reserve);
    }
    if n_items == 1 && flags == 0 {
        let (item, _) = one_item(&body, POLICY_HEADER_LEN, None, bounds)?;
        check_local_limit(on_error, header.local_limit, bounds)?;
        return Ok(PolicyCheck::One(PolicyCheckRequest { header, item }));
    }
    let items = parse_items(&body, POLICY_HEADER_LEN, n_items, bounds, 1)?;
    check_local_limit(on_error, header.local_limit, bounds)?;
    Ok(PolicyCheck::Many(MultiCheckRequest { header, refundable: flags & FLAG_REFUNDABLE != 0, items }))
}

/// Appends one check-policy request frame (one item) to `dst`.
pub fn encode_policy_request(id: u32, a: &PolicyCheckArgs<'_>, dst: &mut BytesMut) {
    put_frame(Head { op: OP_CHECK_POLICY, id }, 0, a.on_error.to_wire(), &a.local_limit.to_be_bytes(), &[a.item()], dst);
}

/// Appends one CHECK_POLICY frame of several items (or one, refundable) to `dst`.
pub fn encode_multi_request(id: u32, on_error: FailPolicy, local_limit: u32, refundable: bool, items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    let flags = if refundable { FLAG_REFUNDABLE } else { 0 };
    put_frame(Head { op: OP_CHECK_POLICY, id }, flags, on_error.to_wire(), &local_limit.to_be_bytes(), items, dst);
}
