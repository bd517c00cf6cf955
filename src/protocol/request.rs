//! The one request model: `Request`, what the decoder yields and the
//! decision pipeline takes (no other enum of the ops exists), and
//! `parse_request`, which hands a body to its op's file under `op/` and
//! turns a refusal into an `Inbound::Invalid` that echoes the request id.

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;

use super::header::{refused, Bounds, Head, Refused};
use super::item;
use super::op::check::{self, Check, CheckRequest};
use super::op::check_policy::{self, MultiCheckRequest, PolicyCheck, PolicyCheckRequest};
use super::op::describe::{self, DescribeRequest};
use super::op::lease::{self, LeaseRequest};
use super::op::lease_share::{self, LeaseShare};
use super::op::policy_lease::{self, PolicyLeaseRequest};
use super::op::refund::{self, RefundRequest};
use super::op::settle::{self, ReserveRequest, SettleRequest};
use super::wire::{ErrorCode, OP_ACQUIRE, OP_ACQUIRE_POLICY, OP_CHECK, OP_CHECK_POLICY, OP_DESCRIBE_POLICY, OP_LEASE_SHARE, OP_REFUND, OP_RELEASE, OP_SETTLE};

/// One validated request: what the daemon decides (src/decision/).
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// CHECK (op 1): an inline limit.
    Check(CheckRequest),
    /// CHECK_POLICY (op 2) of one item without flags.
    PolicyCheck(PolicyCheckRequest),
    /// CHECK_POLICY (op 2) of several items, or of one refundable.
    MultiCheck(MultiCheckRequest),
    /// REFUND (op 3).
    Refund(RefundRequest),
    /// ACQUIRE or RELEASE (ops 5, 6) of an inline concurrency limit.
    Lease(LeaseRequest),
    /// ACQUIRE_POLICY (op 7), or its release.
    PolicyLease(PolicyLeaseRequest),
    /// CHECK_POLICY (op 2) with the settle flag: reserve estimates.
    Reserve(ReserveRequest),
    /// SETTLE (op 9): a reserve's actual cost.
    Settle(SettleRequest),
    /// LEASE_SHARE (op 10): units of the daemon's quota lease on a policy's
    /// key for an nginx worker's shared dict; `cost` is the units wanted
    /// (1..=`MAX_SHARE_UNITS`).
    LeaseShare(PolicyCheckRequest),
    /// CHECK (op 1) with `FLAG_SHARE`: the same for an inline limit;
    /// `cost` is the units wanted (1..=`MAX_SHARE_UNITS`).
    InlineShare(CheckRequest),
    /// LEASE_SHARE with `FLAG_GIVE_BACK`: `cost` units of the host's share
    /// of the policy's key given back, unused (1..=`MAX_GIVE_BACK_UNITS`).
    GiveBack(PolicyCheckRequest),
    /// CHECK with `FLAG_SHARE | FLAG_SHARE_GIVE_BACK`: the same for an
    /// inline limit.
    InlineGiveBack(CheckRequest),
    /// DESCRIBE_POLICY (op 8): what the configuration says of a name; not a decision.
    Describe(DescribeRequest),
}

/// What the decoder yields for each complete frame: a request, or a frame
/// that is none.
#[derive(Debug, PartialEq, Eq)]
pub enum Inbound {
    Request(Request),
    /// The frame was read whole but is not a valid request; the stream is in sync.
    Invalid { id: u32, op: u8, code: ErrorCode, message: Cow<'static, str> },
    /// The length prefix is beyond `MAX_FRAME_LEN`: answer, then close.
    TooLarge { len: usize },
}

impl Inbound {
    fn refused(id: u32, op: u8, r: Refused) -> Self {
        Self::Invalid { id, op, code: r.code, message: r.message }
    }
}

/// Parses and validates one request body. Never panics: every index is
/// checked against the body length first.
pub fn parse_request(body: Bytes, bounds: &Bounds) -> Inbound {
    let head = match Head::parse(&body) {
        Ok(head) => head,
        Err((id, op, r)) => return Inbound::refused(id, op, r),
    };
    // Each arm builds the `Inbound` from its op's own result: no larger
    // value is moved on the way (this is the request path).
    match head.op {
        OP_CHECK => inbound(head, check::parse(head, body, bounds), |c| match c {
            Check::Check(r) => Request::Check(r),
            Check::Share(r) => Request::InlineShare(r),
            Check::GiveBack(r) => Request::InlineGiveBack(r),
        }),
        OP_CHECK_POLICY => inbound(head, check_policy::parse(head, body, bounds), |c| match c {
            PolicyCheck::One(r) => Request::PolicyCheck(r),
            PolicyCheck::Many(r) => Request::MultiCheck(r),
            PolicyCheck::Reserve(r) => Request::Reserve(r),
        }),
        OP_REFUND => inbound(head, refund::parse(head, body, bounds), Request::Refund),
        OP_ACQUIRE | OP_RELEASE => inbound(head, lease::parse(head, body, bounds), Request::Lease),
        OP_ACQUIRE_POLICY => inbound(head, policy_lease::parse(head, body, bounds), Request::PolicyLease),
        OP_DESCRIBE_POLICY => inbound(head, describe::parse(head, body), Request::Describe),
        OP_SETTLE => inbound(head, settle::parse(head, body, bounds), Request::Settle),
        OP_LEASE_SHARE => inbound(head, lease_share::parse(head, body, bounds), |s| match s {
            LeaseShare::Share(r) => Request::LeaseShare(r),
            LeaseShare::GiveBack(r) => Request::GiveBack(r),
        }),
        op => Inbound::refused(head.id, op, refused(ErrorCode::UnknownOp, format!("unknown op {op}"))),
    }
}

#[inline(always)]
fn inbound<T>(head: Head, parsed: Result<T, Refused>, request: impl FnOnce(T) -> Request) -> Inbound {
    match parsed {
        Ok(r) => Inbound::Request(request(r)),
        Err(r) => Inbound::refused(head.id, head.op, r),
    }
}

/// The key of a request body, for logs: the policy's name and its key of
/// a one-item CHECK_POLICY or LEASE_SHARE, a CHECK's key; escaped, at most
/// 128 bytes shown; `-` when the body does not hold a key of the length it
/// says, or is of another op.
pub struct LoggedKey<'a>(pub &'a [u8]);

impl fmt::Display for LoggedKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        let found = match b.get(1).copied() {
            Some(OP_CHECK_POLICY | OP_LEASE_SHARE) => item::logged(b).map(|(name, key)| (Some(name), key)),
            Some(OP_CHECK) => check::logged_key(b).map(|key| (None, key)),
            _ => None,
        };
        let Some((name, key)) = found else { return f.write_str("-") };
        if let Some(name) = name {
            write!(f, "{}/", name.escape_ascii())?;
        }
        if key.len() > 128 {
            write!(f, "{}... ({} bytes)", key[..128].escape_ascii(), key.len())
        } else {
            write!(f, "{}", key.escape_ascii())
        }
    }
}


#[cfg(test)]
mod tests {
    use bytes::BytesMut;

    use super::*;
    use crate::protocol::op::check::{encode_inline_share, encode_request, encode_request_with, CheckArgs};
    use crate::protocol::op::check_policy::{encode_multi_request, encode_policy_request, PolicyCheckArgs};
    use crate::protocol::op::describe::{encode_describe, encode_describe_uses, PolicyUse, PolicyUses};
    use crate::protocol::op::lease::{encode_lease_request, LeaseArgs};
    use crate::protocol::op::refund::encode_refund;
    use crate::protocol::op::settle::{encode_reserve, encode_settle};
    use crate::protocol::item::ItemArgs;
    use crate::protocol::wire::*;

    fn args(key: &[u8]) -> CheckArgs<'_> {
        CheckArgs { key, limit: 1000, window_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
    }

    /// The request of one whole frame (its length prefix is the body's).
    fn decode_one(bytes: &[u8]) -> Inbound {
        assert_eq!(be32(bytes, 0) as usize, bytes.len() - LEN_PREFIX, "one whole frame");
        parse_request(Bytes::copy_from_slice(&bytes[LEN_PREFIX..]), &Bounds::default())
    }

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    fn code_of(i: Inbound) -> ErrorCode {
        match i {
            Inbound::Invalid { code, .. } => code,
            other => panic!("expected an invalid frame, got {other:?}"),
        }
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn parse(frame: &[u8]) -> Inbound {
        decode_one(frame)
    }

    #[test]
    fn request_round_trip_matches_documented_hex() {
        let mut buf = BytesMut::new();
        encode_request(7, &args(b"t1"), &mut buf);
        // The same bytes are shown in docs/PROTOCOL.md.
        let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "0000001e01010000000700000101000003e8000003e8000000010000000000027431");
        match decode_one(&buf) {
            Inbound::Request(Request::Check(c)) => {
                assert_eq!((c.header.id, c.limit, c.window_ms, c.cost, &c.key[..]), (7, 1000, 1000, 1, &b"t1"[..]));
                assert_eq!(c.header.on_error, FailPolicy::Closed);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_algorithm_rides_in_flag_bits_0x0f00() {
        let mut buf = BytesMut::new();
        encode_request_with(7, &args(b"t1"), Algorithm::Ring, &mut buf);
        assert_eq!(&buf[10..12], &[0x01, 0x00], "flags 0x0100");
        match decode_one(&buf) {
            Inbound::Request(Request::Check(c)) => assert_eq!(c.algorithm, Algorithm::Ring),
            other => panic!("{other:?}"),
        }
        let mut log = BytesMut::new();
        encode_request(7, &args(b"t1"), &mut log);
        assert!(matches!(decode_one(&log), Inbound::Request(Request::Check(CheckRequest { algorithm: Algorithm::Log, .. }))));
        let with_flags = |hi: u8, lo: u8| {
            let mut b = buf.clone();
            b[10] = hi;
            b[11] = lo;
            code_of(decode_one(&b))
        };
        assert_eq!(with_flags(0x0F, 0), ErrorCode::UnknownAlgorithm);
        assert_eq!(with_flags(0x01, 0x10), ErrorCode::UnsupportedFlags);
        assert_eq!(with_flags(0x20, 0), ErrorCode::UnsupportedFlags);
    }

    #[test]
    fn a_check_with_the_share_flag_asks_for_units_of_an_inline_lease() {
        let mut buf = BytesMut::new();
        encode_inline_share(7, &CheckArgs { cost: 64, ..args(b"t1") }, &mut buf);
        assert_eq!(&buf[10..12], &[0x10, 0x00], "flags 0x1000");
        match decode_one(&buf) {
            Inbound::Request(Request::InlineShare(c)) => assert_eq!((c.limit, c.window_ms, c.cost, &c.key[..]), (1000, 1000, 64, &b"t1"[..])),
            other => panic!("{other:?}"),
        }
        // Units, not a cost: above the limit is fine, above a share's most is not.
        let mut small = BytesMut::new();
        encode_inline_share(7, &CheckArgs { cost: 200, limit: 10, ..args(b"t1") }, &mut small);
        assert!(matches!(decode_one(&small), Inbound::Request(Request::InlineShare(_))));
        for units in [0, MAX_SHARE_UNITS + 1] {
            let mut bad = BytesMut::new();
            encode_inline_share(7, &CheckArgs { cost: units, ..args(b"t1") }, &mut bad);
            assert_eq!(code_of(decode_one(&bad)), ErrorCode::InvalidCost, "{units} units");
        }
    }

    #[test]
    fn a_give_back_returns_units_of_a_share_and_has_the_documented_bytes() {
        use crate::protocol::op::check::encode_inline_give_back;
        use crate::protocol::op::lease_share::encode_give_back;
        let mut inline = BytesMut::new();
        encode_inline_give_back(7, &CheckArgs { cost: 16, ..args(b"t1") }, &mut inline);
        // docs/PROTOCOL.md section 4h.
        assert_eq!(hex(&inline), "0000001e01010000000730000101000003e8000003e8000000100000000000027431");
        match decode_one(&inline) {
            Inbound::Request(Request::InlineGiveBack(c)) => assert_eq!((c.cost, &c.key[..]), (16, &b"t1"[..])),
            other => panic!("{other:?}"),
        }
        let mut policy = BytesMut::new();
        encode_give_back(7, &PolicyCheckArgs { policy: b"order", key: b"t1", cost: 16, on_error: FailPolicy::Open, local_limit: 0 }, &mut policy);
        assert_eq!(hex(&policy), "0000001c010a000000070001000100000000000000100002056f726465727431");
        match decode_one(&policy) {
            Inbound::Request(Request::GiveBack(c)) => assert_eq!((c.item.cost, c.item.name(), c.item.key()), (16, &b"order"[..], &b"t1"[..])),
            other => panic!("{other:?}"),
        }
        // Units given back go up to what a worker's entry holds, not a share's most.
        for (units, ok) in [(MAX_SHARE_UNITS + 1, true), (MAX_GIVE_BACK_UNITS, true), (0, false), (MAX_GIVE_BACK_UNITS + 1, false)] {
            let mut b = BytesMut::new();
            encode_inline_give_back(7, &CheckArgs { cost: units, ..args(b"t1") }, &mut b);
            assert_eq!(matches!(decode_one(&b), Inbound::Request(Request::InlineGiveBack(_))), ok, "{units} units");
        }
        // The give-back bit without the share bit.
        inline[10] = 0x20;
        assert_eq!(code_of(decode_one(&inline)), ErrorCode::UnsupportedFlags);
    }

    #[test]
    fn lease_frames_round_trip_and_bad_leases_get_their_code() {
        let a = LeaseArgs { key: b"t1", lease: b"0123abcd", limit: 10, lease_ms: 30_000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
        for op in [OP_ACQUIRE, OP_RELEASE] {
            let mut buf = BytesMut::new();
            encode_lease_request(3, op, &a, &mut buf);
            match decode_one(&buf) {
                Inbound::Request(Request::Lease(l)) => assert_eq!((l.op, l.limit, l.lease_ms, &l.key[..], &l.lease[..]), (op, 10, 30_000, &b"t1"[..], &b"0123abcd"[..])),
                other => panic!("{other:?}"),
            }
        }
        let code = |a: &LeaseArgs<'_>| {
            let mut buf = BytesMut::new();
            encode_lease_request(3, OP_ACQUIRE, a, &mut buf);
            code_of(decode_one(&buf))
        };
        assert_eq!(code(&LeaseArgs { lease: b"", ..a.clone() }), ErrorCode::InvalidLease);
        assert_eq!(code(&LeaseArgs { lease: b"a#2", ..a.clone() }), ErrorCode::InvalidLease, "'#' names a lease's further slots");
        assert_eq!(code(&LeaseArgs { lease: &[b'x'; 65], ..a.clone() }), ErrorCode::InvalidLease);
        assert_eq!(code(&LeaseArgs { lease_ms: 0, ..a.clone() }), ErrorCode::InvalidLease);
        assert_eq!(code(&LeaseArgs { cost: 11, ..a.clone() }), ErrorCode::InvalidCost);
        assert_eq!(code(&LeaseArgs { key: b"", ..a.clone() }), ErrorCode::InvalidKey);
    }

    fn policy_args<'a>(policy: &'a [u8], key: &'a [u8]) -> PolicyCheckArgs<'a> {
        PolicyCheckArgs { policy, key, cost: 1, on_error: FailPolicy::Open, local_limit: 0 }
    }

    #[test]
    fn policy_request_round_trip_matches_documented_hex() {
        let mut buf = BytesMut::new();
        encode_policy_request(7, &policy_args(b"order", b"t1"), &mut buf);
        // The same bytes are shown in docs/PROTOCOL.md.
        let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "0000001c0102000000070000000100000000000000010002056f726465727431");
        match decode_one(&buf) {
            Inbound::Request(Request::PolicyCheck(c)) => {
                assert_eq!((c.header.id, c.item.cost, c.item.name(), c.item.key()), (7, 1, &b"order"[..], &b"t1"[..]));
                assert_eq!(&c.item.scoped_key[..], b"\x05ordert1");
                assert_eq!(c.header.on_error, FailPolicy::Open);
            }
            other => panic!("{other:?}"),
        }
    }

    /// Reserve (flag 0x0002) and SETTLE (op 9) as docs/PROTOCOL.md 4f lays
    /// them out: costs up to 10^9, an actual of 0, several items (the
    /// minute's and the month's policy) in one reserve and one settle.
    #[test]
    fn reserve_and_settle_frames_match_their_documented_hex() {
        let hex = |b: &[u8]| -> String { b.iter().map(|b| format!("{b:02x}")).collect() };
        let item = ItemArgs { policy: b"tok", key: b"t1", cost: 1_000_000_000 };
        let mut r = BytesMut::new();
        encode_reserve(7, FailPolicy::Closed, 0, &[item], &mut r);
        assert_eq!(hex(&r), "0000001a 01 02 00000007 0002 01 01 00000000 3b9aca00 0002 03 746f6b 7431".replace(' ', ""));
        let Inbound::Request(Request::Reserve(req)) = decode_one(&r) else { panic!("not a reserve") };
        assert_eq!((req.items.len(), req.items[0].cost, req.items[0].name(), req.items[0].key()), (1, 1_000_000_000, &b"tok"[..], &b"t1"[..]));
        let mut s = BytesMut::new();
        encode_settle(8, &[0xab; HANDLE_LEN], &[ItemArgs { cost: 0, ..item }], &mut s);
        assert_eq!(hex(&s), format!("00000026 01 09 00000008 0000 00 01 {} 00000000 0002 03 746f6b 7431", "ab".repeat(16)).replace(' ', ""));
        let Inbound::Request(Request::Settle(req)) = decode_one(&s) else { panic!("not a settle") };
        assert_eq!((req.handle, req.items.len(), req.items[0].cost), ([0xab; HANDLE_LEN], 1, 0));
        let over = ItemArgs { cost: MAX_O1_COST + 1, ..item };
        let mut b = BytesMut::new();
        encode_reserve(1, FailPolicy::Closed, 0, &[over], &mut b);
        assert_eq!(code_of(decode_one(&b)), ErrorCode::InvalidCost);
        let mut b = BytesMut::new();
        encode_settle(1, &[0; HANDLE_LEN], &[over], &mut b);
        assert_eq!(code_of(decode_one(&b)), ErrorCode::InvalidCost);
        // Two policies, one key: one reserve, one settle.
        let two = [ItemArgs { policy: b"m", key: b"t1", cost: 500 }, ItemArgs { policy: b"mo", key: b"t1", cost: 500 }];
        let mut b = BytesMut::new();
        encode_reserve(9, FailPolicy::Closed, 0, &two, &mut b);
        assert_eq!(hex(&b), "00000023 01 02 00000009 0002 01 02 00000000 000001f4 0002 01 6d 7431 000001f4 0002 02 6d6f 7431".replace(' ', ""));
        let Inbound::Request(Request::Reserve(req)) = decode_one(&b) else { panic!("not a reserve") };
        assert_eq!(req.items.iter().map(|i| &i.scoped_key[..]).collect::<Vec<_>>(), [&b"\x01mt1"[..], &b"\x02mot1"[..]]);
        let mut b = BytesMut::new();
        encode_settle(10, &[0xab; HANDLE_LEN], &[ItemArgs { cost: 700, ..two[0] }, ItemArgs { cost: 700, ..two[1] }], &mut b);
        // lua/spec/settle_spec.lua builds the same bytes from a reserve's handle.
        assert_eq!(hex(&b), format!("0000002f 01 09 0000000a 0000 00 02 {} 000002bc 0002 01 6d 7431 000002bc 0002 02 6d6f 7431", "ab".repeat(16)).replace(' ', ""));
        let Inbound::Request(Request::Settle(req)) = decode_one(&b) else { panic!("not a settle") };
        assert_eq!(req.items.iter().map(|i| i.cost).collect::<Vec<_>>(), [700, 700]);
        let mut b = BytesMut::new();
        encode_reserve(1, FailPolicy::Closed, 0, &[item, item], &mut b);
        assert_eq!(code_of(decode_one(&b)), ErrorCode::DuplicateItem, "one policy and key twice");
        let mut b = BytesMut::new();
        encode_multi_request(1, FailPolicy::Closed, 0, false, &[item, ItemArgs { key: b"t2", ..item }], &mut b);
        b[LEN_PREFIX + 7] = 3;
        assert_eq!(code_of(decode_one(&b)), ErrorCode::UnsupportedFlags, "settle and refundable together");
    }

    #[test]
    fn multi_item_request_round_trip_matches_documented_hex() {
        let items = [ItemArgs { policy: b"ip", key: b"a", cost: 1 }, ItemArgs { policy: b"tenant", key: b"t1", cost: 2 }];
        let mut buf = BytesMut::new();
        encode_multi_request(7, FailPolicy::Closed, 0, true, &items, &mut buf);
        // The same bytes are shown in docs/PROTOCOL.md, section 4b.
        let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "000000270102000000070001010200000000000000010001026970610000000200020674656e616e747431");
        let Inbound::Request(Request::MultiCheck(m)) = decode_one(&buf) else { panic!("not a multi check") };
        assert_eq!((m.header.id, m.header.on_error, m.refundable, m.items.len()), (7, FailPolicy::Closed, true, 2));
        assert_eq!((m.items[1].name(), m.items[1].key(), m.items[1].cost), (&b"tenant"[..], &b"t1"[..], 2));
        assert_eq!(&m.items[0].scoped_key[..], b"\x02ipa");
        // One item with the flag is a multi check too; without, the single one.
        let mut one = BytesMut::new();
        encode_multi_request(8, FailPolicy::Open, 0, true, &items[..1], &mut one);
        assert!(matches!(decode_one(&one), Inbound::Request(Request::MultiCheck(m)) if m.items.len() == 1 && m.refundable));
        let mut one = BytesMut::new();
        encode_multi_request(8, FailPolicy::Open, 0, false, &items[..1], &mut one);
        let mut same = BytesMut::new();
        encode_policy_request(8, &PolicyCheckArgs { policy: b"ip", key: b"a", cost: 1, on_error: FailPolicy::Open, local_limit: 0 }, &mut same);
        assert_eq!(one, same);
        assert!(matches!(decode_one(&one), Inbound::Request(Request::PolicyCheck(_))));
    }

    #[test]
    fn multi_item_and_refund_errors_get_their_codes() {
        let item = ItemArgs { policy: b"p", key: b"k", cost: 1 };
        let enc = |items: &[ItemArgs<'_>]| {
            let mut b = BytesMut::new();
            encode_multi_request(1, FailPolicy::Open, 0, false, items, &mut b);
            code_of(decode_one(&b))
        };
        assert_eq!(enc(&[item, item]), ErrorCode::DuplicateItem);
        assert_eq!(enc(&[item; 9]), ErrorCode::UnsupportedLimitCount);
        assert_eq!(enc(&[item, ItemArgs { key: b"", ..item }]), ErrorCode::InvalidKey);
        assert_eq!(enc(&[item, ItemArgs { cost: 0, key: b"x", ..item }]), ErrorCode::InvalidCost);
        assert_eq!(enc(&[item, ItemArgs { policy: b"", key: b"x", ..item }]), ErrorCode::UnknownPolicy);
        let mut b = BytesMut::new();
        encode_multi_request(1, FailPolicy::Open, 0, false, &[item, ItemArgs { key: b"x", ..item }], &mut b);
        let mut cut = b[4..b.len() - 1].to_vec();
        assert_eq!(code_of(decode_one(&frame(&cut))), ErrorCode::Malformed);
        cut.push(b'x');
        cut.push(b'y');
        assert_eq!(code_of(decode_one(&frame(&cut))), ErrorCode::Malformed);

        let handle = [0xab; HANDLE_LEN];
        let mut r = BytesMut::new();
        encode_refund(5, &handle, &[item, ItemArgs { key: b"x", cost: 3, ..item }], &mut r);
        let Inbound::Request(Request::Refund(req)) = decode_one(&r) else { panic!("not a refund") };
        assert_eq!((req.id, req.handle, req.items.len(), req.items[1].cost), (5, handle, 2, 3));
        let mut bad = r[4..].to_vec();
        bad[7] = 1;
        assert_eq!(code_of(decode_one(&frame(&bad))), ErrorCode::UnsupportedFlags);
        assert_eq!(code_of(decode_one(&frame(&r[4..30]))), ErrorCode::Malformed);
    }

    #[test]
    fn invalid_policy_fields_get_their_codes() {
        let good = {
            let mut b = BytesMut::new();
            encode_policy_request(9, &policy_args(b"order", b"key"), &mut b);
            b[4..].to_vec()
        };
        let with = |at: usize, bytes: &[u8]| {
            let mut b = good.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            code_of(decode_one(&frame(&b)))
        };
        assert_eq!(with(6, &[0, 4]), ErrorCode::UnsupportedFlags);
        assert_eq!(with(8, &[3]), ErrorCode::InvalidPolicy);
        assert_eq!(with(9, &[9]), ErrorCode::UnsupportedLimitCount);
        assert_eq!(with(9, &[2]), ErrorCode::Malformed, "two items announced, one sent");
        assert_eq!(with(9, &[0]), ErrorCode::UnsupportedLimitCount);
        assert_eq!(with(8, &[2]), ErrorCode::InvalidLocalLimit);
        assert_eq!(with(14, &[0, 0, 0, 0]), ErrorCode::InvalidCost);
        assert_eq!(with(14, &1001u32.to_be_bytes()), ErrorCode::InvalidCost);
        assert_eq!(with(18, &[0, 9]), ErrorCode::Malformed);
        assert_eq!(with(20, &[6]), ErrorCode::Malformed);
        assert_eq!(with(26, b"\n"), ErrorCode::InvalidKey);
        let mut b = BytesMut::new();
        encode_policy_request(1, &policy_args(&[b'a'; 32], b"k"), &mut b);
        assert_eq!(code_of(decode_one(&b)), ErrorCode::UnknownPolicy);
        let mut b = BytesMut::new();
        encode_policy_request(1, &policy_args(b"", b"k"), &mut b);
        assert_eq!(code_of(decode_one(&b)), ErrorCode::UnknownPolicy);
        assert_eq!(code_of(decode_one(&frame(&good[..20]))), ErrorCode::Malformed);
    }


    #[test]
    fn invalid_fields_get_their_codes() {
        let good = {
            let mut b = BytesMut::new();
            encode_request(9, &args(b"key"), &mut b);
            b[4..].to_vec()
        };
        let with = |at: usize, bytes: &[u8]| {
            let mut b = good.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            code_of(decode_one(&frame(&b)))
        };
        assert_eq!(with(0, &[2]), ErrorCode::UnsupportedVersion);
        assert_eq!(with(1, &[0xee]), ErrorCode::UnknownOp);
        assert_eq!(with(6, &[0, 1]), ErrorCode::UnsupportedFlags);
        assert_eq!(with(8, &[3]), ErrorCode::InvalidPolicy);
        assert_eq!(with(9, &[2]), ErrorCode::UnsupportedLimitCount);
        assert_eq!(with(10, &[0, 0, 0, 0]), ErrorCode::InvalidLimit);
        assert_eq!(with(10, &0x7fff_ffffu32.to_be_bytes()), ErrorCode::InvalidLimit);
        assert_eq!(with(14, &[0, 0, 0, 0]), ErrorCode::InvalidWindow);
        assert_eq!(with(14, &u32::MAX.to_be_bytes()), ErrorCode::InvalidWindow);
        assert_eq!(with(18, &[0, 0, 0, 0]), ErrorCode::InvalidCost);
        assert_eq!(with(18, &1001u32.to_be_bytes()), ErrorCode::InvalidCost);
        let mut big = BytesMut::new();
        encode_request(1, &CheckArgs { limit: 5000, cost: 1001, ..args(b"k") }, &mut big);
        assert_eq!(code_of(decode_one(&big)), ErrorCode::InvalidCost);
        assert_eq!(with(8, &[2]), ErrorCode::InvalidLocalLimit);
        assert_eq!(with(26, &[0, 9]), ErrorCode::Malformed);
        assert_eq!(with(28, b"\n"), ErrorCode::InvalidKey);
        // Each error echoes the request id.
        let mut b = good.clone();
        b[0] = 9;
        match decode_one(&frame(&b)) {
            Inbound::Invalid { id, .. } => assert_eq!(id, 9),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn empty_and_short_bodies_are_malformed() {
        assert_eq!(code_of(decode_one(&frame(&[]))), ErrorCode::Malformed);
        assert_eq!(code_of(decode_one(&frame(&[1, 1, 0, 0, 0, 1, 0]))), ErrorCode::Malformed);
        let mut key = BytesMut::new();
        encode_request(1, &CheckArgs { key: &[], ..args(b"") }, &mut key);
        assert_eq!(code_of(decode_one(&key)), ErrorCode::InvalidKey);
        let long = vec![b'a'; 513];
        let mut buf = BytesMut::new();
        encode_request(1, &args(&long), &mut buf);
        assert_eq!(code_of(decode_one(&buf)), ErrorCode::InvalidKey);
    }


    #[test]
    fn describe_request_matches_documented_hex() {
        let mut buf = BytesMut::new();
        encode_describe(7, b"order", &mut buf);
        // docs/PROTOCOL.md section 4g.
        assert_eq!(hex(&buf), "0000000e" .to_owned() + "0108" + "00000007" + "0000" + "05" + "6f72646572");
        let Inbound::Request(Request::Describe(r)) = parse(&buf) else { panic!("{:?}", parse(&buf)) };
        // A client of an earlier release sends no uses: a single check.
        assert_eq!((r.id, &r.name[..], r.uses), (7, &b"order"[..], PolicyUses::SINGLE));
    }

    #[test]
    fn describe_request_with_uses_matches_documented_hex() {
        let mut buf = BytesMut::new();
        let uses = PolicyUses::default().with(PolicyUse::Multi).with(PolicyUse::Refundable);
        encode_describe_uses(7, b"login", uses, &mut buf);
        // docs/PROTOCOL.md section 4g: flags 0x0001, then the uses byte 0x06 (multi-item, refundable).
        assert_eq!(hex(&buf), "0000000f".to_owned() + "0108" + "00000007" + "0001" + "05" + "6c6f67696e" + "06");
        let Inbound::Request(Request::Describe(r)) = parse(&buf) else { panic!("{:?}", parse(&buf)) };
        assert_eq!((r.id, &r.name[..], r.uses), (7, &b"login"[..], uses));
        assert_eq!(r.uses.iter().collect::<Vec<_>>(), [PolicyUse::Multi, PolicyUse::Refundable]);
        // Every use's bit, as the table of section 4g numbers them.
        let bits: Vec<u8> = PolicyUse::ALL.iter().map(|u| u.bit()).collect();
        assert_eq!(bits, [0x01, 0x02, 0x04, 0x08, 0x10, 0x20]);
        // A later client's bits are dropped, not refused; none at all is a description of no use.
        let mut buf = BytesMut::new();
        encode_describe_uses(8, b"login", PolicyUses::from_wire(0xC1), &mut buf);
        assert_eq!(&buf[buf.len() - 1..], [0x01]);
        let mut raw = BytesMut::new();
        encode_describe(9, b"login", &mut raw);
        let mut raw = raw.to_vec();
        raw[3] += 1;
        raw[11] = 1;
        raw.push(0xC0);
        let Inbound::Request(Request::Describe(r)) = parse(&raw) else { panic!("{:?}", parse(&raw)) };
        assert_eq!(r.uses, PolicyUses::default());
    }

    #[test]
    fn hostile_describe_frames_get_the_code_of_what_is_wrong() {
        let cases: &[(&[u8], ErrorCode)] = &[
            // shorter than the header and one name byte
            (b"\x00\x00\x00\x08\x01\x08\x00\x00\x00\x01\x00\x00", ErrorCode::Malformed),
            (b"\x00\x00\x00\x09\x01\x08\x00\x00\x00\x01\x00\x00\x00", ErrorCode::Malformed),
            // flags other than 0x0001; 0x0001 without its uses byte
            (b"\x00\x00\x00\x0a\x01\x08\x00\x00\x00\x01\x00\x02\x01a", ErrorCode::UnsupportedFlags),
            (b"\x00\x00\x00\x0a\x01\x08\x00\x00\x00\x01\x80\x01\x01a", ErrorCode::UnsupportedFlags),
            (b"\x00\x00\x00\x0a\x01\x08\x00\x00\x00\x01\x00\x01\x01a", ErrorCode::Malformed),
            // a uses byte without the flag
            (b"\x00\x00\x00\x0b\x01\x08\x00\x00\x00\x01\x00\x00\x01a\x01", ErrorCode::Malformed),
            // name length 0 with a byte after it; 32
            (b"\x00\x00\x00\x0a\x01\x08\x00\x00\x00\x01\x00\x00\x00a", ErrorCode::UnknownPolicy),
            (b"\x00\x00\x00\x0a\x01\x08\x00\x00\x00\x01\x00\x00\x20a", ErrorCode::UnknownPolicy),
            // name length beyond, and short of, the body
            (b"\x00\x00\x00\x0a\x01\x08\x00\x00\x00\x01\x00\x00\x02a", ErrorCode::Malformed),
            (b"\x00\x00\x00\x0b\x01\x08\x00\x00\x00\x01\x00\x00\x01ab", ErrorCode::Malformed),
            // control byte, non-ASCII, a space
            (b"\x00\x00\x00\x0b\x01\x08\x00\x00\x00\x01\x00\x00\x02a\x1f", ErrorCode::UnknownPolicy),
            (b"\x00\x00\x00\x0b\x01\x08\x00\x00\x00\x01\x00\x00\x02\xc3\xa9", ErrorCode::UnknownPolicy),
            (b"\x00\x00\x00\x0b\x01\x08\x00\x00\x00\x01\x00\x00\x02a ", ErrorCode::UnknownPolicy),
        ];
        for (frame, want) in cases {
            match parse(frame) {
                Inbound::Invalid { id, op, code, .. } => assert_eq!((id, op, code), (1, OP_DESCRIBE_POLICY, *want), "{}", hex(frame)),
                other => panic!("{} parsed as {other:?}", hex(frame)),
            }
        }
        let mut longest = BytesMut::new();
        encode_describe(1, &[b'a'; MAX_POLICY_NAME_LEN], &mut longest);
        assert!(matches!(parse(&longest), Inbound::Request(Request::Describe(_))));
    }
}
