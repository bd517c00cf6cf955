//! Requests: the decoder the daemon reads frames with (bytes to one
//! validated `Request`, or a coded error that keeps the stream in sync), and
//! the encoder clients write them with.

use std::borrow::Cow;
use std::io;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::Decoder;

use super::wire::{
    be32, Algorithm, ErrorCode, FailPolicy, ALGORITHM_FLAGS, FLAG_REFUNDABLE, FLAG_SETTLE, MAX_O1_COST, OP_SETTLE, HANDLE_LEN, LEASE_HEADER_LEN, LEN_PREFIX, LIMIT_ENTRY_LEN, MAX_FRAME_LEN, MAX_LEASE_ID_LEN, MAX_POLICY_ITEMS,
    MAX_POLICY_NAME_LEN, OP_ACQUIRE, OP_CHECK, OP_CHECK_POLICY, OP_REFUND, OP_RELEASE, POLICY_HEADER_LEN, POLICY_ITEM_LEN, REFUND_HEADER_LEN, REQUEST_HEADER_LEN, VERSION,
    FLAG_RELEASE, OP_ACQUIRE_POLICY, OP_DESCRIBE_POLICY, POLICY_LEASE_HEADER_LEN, DESCRIBE_HEADER_LEN, MAX_SHARE_UNITS, OP_LEASE_SHARE, FLAG_SHARE,
    FLAG_GIVE_BACK, FLAG_SHARE_GIVE_BACK, MAX_GIVE_BACK_UNITS,
};

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

/// One validated rate-limit check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckRequest {
    pub id: u32,
    pub on_error: FailPolicy,
    pub limit: u32,
    pub window_ms: u32,
    pub cost: u32,
    /// Quota of the per-host fallback window; meaningful with `FailPolicy::Local`.
    pub local_limit: u32,
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

/// One validated CHECK_POLICY request (one item): the policy is named, not
/// yet resolved; the daemon looks it up in its configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyCheckRequest {
    pub id: u32,
    /// The location's fail policy; a policy's own `fail_policy` takes precedence.
    pub on_error: FailPolicy,
    /// The location's local quota, for `on_error` local.
    pub local_limit: u32,
    pub cost: u32,
    /// The policy's name as sent: 1..=`MAX_POLICY_NAME_LEN` bytes, not yet looked up.
    pub name: Bytes,
    /// The client's key (what overrides and the allowlist are matched against).
    pub key: Bytes,
    /// The key the stores count under: the name's length byte, the name and
    /// the key, as they lie in the frame (no copy). The first byte is a
    /// control byte, which no inline key may hold, and the name is
    /// length-prefixed: two policies, or a policy and an inline check, never
    /// share a window.
    pub scoped_key: Bytes,
}

/// A CHECK_POLICY request as the client builds it (no validation).
#[derive(Clone, Debug)]
pub struct PolicyCheckArgs<'a> {
    pub policy: &'a [u8],
    pub key: &'a [u8],
    pub cost: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
}

/// One item of a CHECK_POLICY or REFUND request: a policy's name, a key
/// and a cost, not yet resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyItem {
    pub cost: u32,
    pub name: Bytes,
    pub key: Bytes,
    /// The name's length byte, the name and the key (see `PolicyCheckRequest`).
    pub scoped_key: Bytes,
}

/// A CHECK_POLICY request of several items (all or nothing), or of one
/// with the refundable flag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultiCheckRequest {
    pub id: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
    /// Answer with a refund handle.
    pub refundable: bool,
    /// 1..=`MAX_POLICY_ITEMS`, no (name, key) twice.
    pub items: Vec<PolicyItem>,
}

/// A REFUND request: the handle a refundable check was answered with, and
/// that check's items.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundRequest {
    pub id: u32,
    pub handle: [u8; HANDLE_LEN],
    pub items: Vec<PolicyItem>,
}

/// A reserve (CHECK_POLICY with the settle flag): every item's cost, an
/// estimate, reserved all or nothing (docs/PROTOCOL.md 4f).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReserveRequest {
    pub id: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
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

/// One item as the client builds it (no validation).
#[derive(Clone, Copy, Debug)]
pub struct ItemArgs<'a> {
    pub policy: &'a [u8],
    pub key: &'a [u8],
    pub cost: u32,
}

impl ItemArgs<'_> {
    fn len(&self) -> usize {
        POLICY_ITEM_LEN + self.policy.len() + self.key.len()
    }

    fn put(&self, dst: &mut BytesMut) {
        dst.put_u32(self.cost);
        dst.put_u16(self.key.len() as u16);
        dst.put_u8(self.policy.len() as u8);
        dst.put_slice(self.policy);
        dst.put_slice(self.key);
    }
}

/// One validated ACQUIRE or RELEASE of a concurrency lease (section 4d).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRequest {
    pub id: u32,
    /// `OP_ACQUIRE` or `OP_RELEASE`.
    pub op: u8,
    pub on_error: FailPolicy,
    /// Requests in flight at most (ACQUIRE).
    pub limit: u32,
    /// How long a lease holds its slots if never released (ACQUIRE).
    pub lease_ms: u32,
    pub cost: u32,
    pub local_limit: u32,
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

/// One validated ACQUIRE_POLICY (op 7; with `FLAG_RELEASE`, its release):
/// a lease of a named concurrency policy (section 4e). The policy is named,
/// not yet resolved: the daemon takes the limit and lease length from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyLeaseRequest {
    pub id: u32,
    pub release: bool,
    /// The location's fail policy; the policy's own takes precedence.
    pub on_error: FailPolicy,
    pub local_limit: u32,
    pub cost: u32,
    pub name: Bytes,
    /// The client's key (what overrides and the allowlist are matched against).
    pub key: Bytes,
    /// The name's length byte, the name and the key, as CHECK_POLICY's.
    pub scoped_key: Bytes,
    /// The client's name for this lease, as in ACQUIRE.
    pub lease: Bytes,
}

/// An ACQUIRE_POLICY as the client builds it (no validation).
#[derive(Clone, Debug)]
pub struct PolicyLeaseArgs<'a> {
    pub policy: &'a [u8],
    pub key: &'a [u8],
    pub lease: &'a [u8],
    pub cost: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
}

/// DESCRIBE_POLICY's flag: a uses byte (`PolicyUses`) follows the name.
/// A request without it (a client of an earlier release) describes a
/// single check.
pub const FLAG_DESCRIBE_USES: u16 = 0x0001;

/// One way a client's limiter uses a policy: each is its own kind of
/// request to the daemon, refused or not by the policy's settings
/// (src/decision/resolve.rs, `kind_refusal`), so a reload must keep every
/// use nginx described possible (docs/OPERATIONS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyUse {
    /// CHECK_POLICY of one item, without flags (`ratelimitd.new{ policy = ... }`).
    Single = 0,
    /// CHECK_POLICY of several items, all or nothing (`policies = { ... }`).
    Multi = 1,
    /// CHECK_POLICY with the refundable flag, and its REFUND (`refundable = true`).
    Refundable = 2,
    /// CHECK_POLICY with the settle flag, and its SETTLE (`settle = true`).
    Reserve = 3,
    /// LEASE_SHARE: units of the daemon's lease kept by a worker (`share_dict`).
    Share = 4,
    /// ACQUIRE_POLICY and its release (`ratelimitd.concurrency{ policy = ... }`).
    Acquire = 5,
}

impl PolicyUse {
    pub const ALL: [PolicyUse; 6] = [Self::Single, Self::Multi, Self::Refundable, Self::Reserve, Self::Share, Self::Acquire];

    /// Its bit in the uses byte.
    pub const fn bit(self) -> u8 {
        1 << self as u8
    }

    /// As logs and check-config name it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Single => "single check",
            Self::Multi => "multi-item check",
            Self::Refundable => "refundable check",
            Self::Reserve => "reserve and settle",
            Self::Share => "worker share",
            Self::Acquire => "concurrency acquire",
        }
    }
}

/// The uses byte of a DESCRIBE_POLICY: a set of `PolicyUse` bits. Bits
/// this daemon does not know (a later client's uses) are dropped, so such
/// a client is still answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyUses(u8);

impl PolicyUses {
    /// What a request without the uses byte describes.
    pub const SINGLE: Self = Self(PolicyUse::Single.bit());
    const KNOWN: u8 = (1 << PolicyUse::ALL.len()) - 1;

    pub const fn from_wire(b: u8) -> Self {
        Self(b & Self::KNOWN)
    }

    pub const fn to_wire(self) -> u8 {
        self.0
    }

    #[must_use]
    pub const fn with(self, u: PolicyUse) -> Self {
        Self(self.0 | u.bit())
    }

    pub const fn contains(self, u: PolicyUse) -> bool {
        self.0 & u.bit() != 0
    }

    /// The uses in the set, in `PolicyUse::ALL`'s order.
    pub fn iter(self) -> impl Iterator<Item = PolicyUse> {
        PolicyUse::ALL.into_iter().filter(move |u| self.contains(*u))
    }
}

/// A validated DESCRIBE_POLICY: the name as sent (not yet looked up).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescribeRequest {
    pub id: u32,
    /// 1..=`MAX_POLICY_NAME_LEN` bytes of `[A-Za-z0-9_.-]`.
    pub name: Bytes,
    /// How the client uses the policy: its uses byte, or a single check
    /// when it sent none (`FLAG_DESCRIBE_USES`).
    pub uses: PolicyUses,
}

/// One validated request: what the daemon decides (src/decision/). The
/// one request model: the decoder yields it, the decision pipeline takes
/// it; no other enum of the ops exists.
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
    /// of the policy's key given back, unused.
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

/// Decodes requests from a byte stream; validates them against `Bounds`.
#[derive(Debug, Clone)]
pub struct RequestCodec {
    bounds: Bounds,
}

impl RequestCodec {
    pub fn new(bounds: Bounds) -> Self {
        Self { bounds }
    }

    /// New bounds for the frames still to come (configuration reload).
    pub fn set_bounds(&mut self, bounds: Bounds) {
        self.bounds = bounds;
    }
}

impl Decoder for RequestCodec {
    type Item = Inbound;
    type Error = io::Error;

    fn decode(&mut self, src: &mut BytesMut) -> io::Result<Option<Inbound>> {
        if src.len() < LEN_PREFIX {
            return Ok(None);
        }
        let len = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
        if len > MAX_FRAME_LEN {
            src.clear();
            return Ok(Some(Inbound::TooLarge { len }));
        }
        if src.len() < LEN_PREFIX + len {
            src.reserve(LEN_PREFIX + len - src.len());
            return Ok(None);
        }
        src.advance(LEN_PREFIX);
        let body = src.split_to(len).freeze();
        Ok(Some(parse_request(body, &self.bounds)))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> io::Result<Option<Inbound>> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None if src.is_empty() => Ok(None),
            None => {
                let id = if src.len() >= LEN_PREFIX + 6 {
                    u32::from_be_bytes([src[6], src[7], src[8], src[9]])
                } else {
                    0
                };
                src.clear();
                Ok(Some(Inbound::Invalid {
                    id,
                    op: 0,
                    code: ErrorCode::Malformed,
                    message: Cow::Borrowed("truncated frame: the stream ended inside a frame"),
                }))
            }
        }
    }
}

fn invalid(id: u32, op: u8, code: ErrorCode, message: impl Into<Cow<'static, str>>) -> Inbound {
    Inbound::Invalid { id, op, code, message: message.into() }
}

/// Parses and validates one request body. Never panics: every index is
/// checked against the body length first.
pub fn parse_request(mut body: Bytes, bounds: &Bounds) -> Inbound {
    if body.len() < 6 {
        return invalid(0, 0, ErrorCode::Malformed, format!("frame body of {} bytes is shorter than the 6-byte header", body.len()));
    }
    let (version, op, id) = (body[0], body[1], be32(&body, 2));
    if version != VERSION {
        return invalid(id, op, ErrorCode::UnsupportedVersion, format!("protocol version {version} is not supported (this daemon speaks {VERSION})"));
    }
    if op == OP_CHECK_POLICY {
        return parse_policy_check(body, id, bounds);
    }
    if op == OP_REFUND {
        return parse_refund(body, id, bounds);
    }
    if op == OP_SETTLE {
        return parse_settle(body, id, bounds);
    }
    if op == OP_ACQUIRE || op == OP_RELEASE {
        return parse_lease(body, op, id, bounds);
    }
    if op == OP_ACQUIRE_POLICY {
        return parse_policy_lease(body, id, bounds);
    }
    if op == OP_LEASE_SHARE {
        return parse_lease_share(body, id, bounds);
    }
    if op == OP_DESCRIBE_POLICY {
        return parse_describe(body, id);
    }
    if op != OP_CHECK {
        return invalid(id, op, ErrorCode::UnknownOp, format!("unknown op {op}"));
    }
    if body.len() < REQUEST_HEADER_LEN + LIMIT_ENTRY_LEN {
        return invalid(id, op, ErrorCode::Malformed, format!("check body of {} bytes is shorter than the {} fixed bytes", body.len(), REQUEST_HEADER_LEN + LIMIT_ENTRY_LEN));
    }
    let flags = u16::from_be_bytes([body[6], body[7]]);
    if flags & !(ALGORITHM_FLAGS | FLAG_SHARE | FLAG_SHARE_GIVE_BACK) != 0 || (flags & FLAG_SHARE_GIVE_BACK != 0 && flags & FLAG_SHARE == 0) {
        return invalid(id, op, ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x} are not supported in version {VERSION}"));
    }
    let share = flags & FLAG_SHARE != 0;
    let give_back = flags & FLAG_SHARE_GIVE_BACK != 0;
    let algorithm = match Algorithm::from_flags(flags) {
        Ok(a) => a,
        Err(bits) => return invalid(id, op, ErrorCode::UnknownAlgorithm, format!("algorithm {bits} (flags 0x{flags:04x}) is not one this daemon has")),
    };
    let Some(on_error) = FailPolicy::from_wire(body[8]) else {
        return invalid(id, op, ErrorCode::InvalidPolicy, format!("fail policy {} is not 0 (open), 1 (closed) or 2 (local)", body[8]));
    };
    let n_limits = body[9];
    if n_limits != 1 {
        return invalid(id, op, ErrorCode::UnsupportedLimitCount, format!("{n_limits} limits in one request; version {VERSION} takes exactly 1"));
    }
    let e = REQUEST_HEADER_LEN;
    let limit = be32(&body, e);
    let window_ms = be32(&body, e + 4);
    let cost = be32(&body, e + 8);
    let local_limit = be32(&body, e + 12);
    let key_len = u16::from_be_bytes([body[e + 16], body[e + 17]]) as usize;
    let key_at = e + LIMIT_ENTRY_LEN;
    if body.len() != key_at + key_len {
        return invalid(id, op, ErrorCode::Malformed, format!("key length {key_len} does not match the {} bytes left in the frame", body.len() - key_at));
    }
    if key_len == 0 || key_len > bounds.max_key_len {
        return invalid(id, op, ErrorCode::InvalidKey, format!("key length {key_len} is outside 1..={}", bounds.max_key_len));
    }
    if let Some(pos) = body[key_at..].iter().position(|&b| b < 0x20 || b == 0x7f) {
        return invalid(id, op, ErrorCode::InvalidKey, format!("key byte {pos} is a control character"));
    }
    if limit == 0 || limit > bounds.max_limit {
        return invalid(id, op, ErrorCode::InvalidLimit, format!("limit {limit} is outside 1..={}", bounds.max_limit));
    }
    if window_ms == 0 || window_ms > bounds.max_window_ms {
        return invalid(id, op, ErrorCode::InvalidWindow, format!("window {window_ms} ms is outside 1..={} ms", bounds.max_window_ms));
    }
    if give_back && (cost == 0 || cost > MAX_GIVE_BACK_UNITS) {
        return invalid(id, op, ErrorCode::InvalidCost, format!("{cost} units given back; a give-back is 1..={MAX_GIVE_BACK_UNITS}"));
    }
    if share && !give_back && (cost == 0 || cost > MAX_SHARE_UNITS) {
        return invalid(id, op, ErrorCode::InvalidCost, format!("{cost} units wanted; a share is 1..={MAX_SHARE_UNITS}"));
    }
    if !share && (cost == 0 || cost > limit || cost > bounds.max_cost) {
        return invalid(id, op, ErrorCode::InvalidCost, format!("cost {cost} is outside 1..=min(limit {limit}, max_cost {})", bounds.max_cost));
    }
    if on_error == FailPolicy::Local && (local_limit == 0 || local_limit > bounds.max_limit) {
        return invalid(id, op, ErrorCode::InvalidLocalLimit, format!("fail policy local needs a local limit in 1..={}, got {local_limit}", bounds.max_limit));
    }
    body.advance(key_at);
    let r = CheckRequest { id, on_error, limit, window_ms, cost, local_limit, key: body, algorithm };
    Inbound::Request(match (share, give_back) {
        (_, true) => Request::InlineGiveBack(r),
        (true, false) => Request::InlineShare(r),
        (false, false) => Request::Check(r),
    })
}

/// The rest of `parse_request` for op 2 (docs/PROTOCOL.md, section 4b, in
/// its validation order). One item without flags is the single check the
/// fast path decides; several items, or the refundable flag, make a
/// `MultiCheck`.
fn parse_policy_check(body: Bytes, id: u32, bounds: &Bounds) -> Inbound {
    let op = OP_CHECK_POLICY;
    let fixed = POLICY_HEADER_LEN + POLICY_ITEM_LEN;
    if body.len() < fixed {
        return invalid(id, op, ErrorCode::Malformed, format!("check-policy body of {} bytes is shorter than the {fixed} fixed bytes", body.len()));
    }
    let flags = u16::from_be_bytes([body[6], body[7]]);
    if flags & !FLAG_REFUNDABLE != 0 && flags != FLAG_SETTLE {
        return invalid(id, op, ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x}: only 0x0001 (refundable) or 0x0002 (settle, alone) is defined"));
    }
    let Some(on_error) = FailPolicy::from_wire(body[8]) else {
        return invalid(id, op, ErrorCode::InvalidPolicy, format!("fail policy {} is not 0 (open), 1 (closed) or 2 (local)", body[8]));
    };
    let n_items = body[9] as usize;
    if n_items == 0 || n_items > MAX_POLICY_ITEMS {
        return invalid(id, op, ErrorCode::UnsupportedLimitCount, format!("{n_items} items in one check-policy request; 1..={MAX_POLICY_ITEMS} are accepted"));
    }
    let local_limit = be32(&body, 10);
    if flags == FLAG_SETTLE {
        return parse_reserve(body, id, on_error, n_items, local_limit, bounds);
    }
    if n_items == 1 && flags == 0 {
        return match one_item(&body, id, op, on_error, local_limit, bounds, |_| None) {
            Ok(r) => Inbound::Request(Request::PolicyCheck(r)),
            Err(invalid) => invalid,
        };
    }
    let items = match parse_items(&body, POLICY_HEADER_LEN, n_items, bounds, 1) {
        Ok(items) => items,
        Err((code, message)) => return invalid(id, op, code, message),
    };
    if let Some(e) = local_limit_error(on_error, local_limit, bounds) {
        return invalid(id, op, ErrorCode::InvalidLocalLimit, e);
    }
    Inbound::Request(Request::MultiCheck(MultiCheckRequest { id, on_error, local_limit, refundable: flags & FLAG_REFUNDABLE != 0, items }))
}

fn local_limit_error(on_error: FailPolicy, local_limit: u32, bounds: &Bounds) -> Option<String> {
    (on_error == FailPolicy::Local && (local_limit == 0 || local_limit > bounds.max_limit))
        .then(|| format!("fail policy local needs a local limit in 1..={}, got {local_limit}", bounds.max_limit))
}

type ItemError = (ErrorCode, String);

/// `n` items from `at` to the end of the body, which they must fill
/// exactly; no (name, key) twice.
fn parse_items(body: &Bytes, at: usize, n: usize, bounds: &Bounds, min_cost: u32) -> Result<Vec<PolicyItem>, ItemError> {
    // Lengths first, so that a frame whose items do not add up is
    // MALFORMED whatever its fields hold.
    let mut end = at;
    for i in 0..n {
        if body.len() < end + POLICY_ITEM_LEN {
            return Err((ErrorCode::Malformed, format!("item {} of {n} does not fit the {}-byte frame", i + 1, body.len())));
        }
        let key_len = u16::from_be_bytes([body[end + 4], body[end + 5]]) as usize;
        end += POLICY_ITEM_LEN + body[end + 6] as usize + key_len;
    }
    if end != body.len() {
        return Err((ErrorCode::Malformed, format!("the {n} items take {} bytes, the frame has {}", end - at, body.len() - at)));
    }
    let mut items: Vec<PolicyItem> = Vec::with_capacity(n);
    let mut next = at;
    for _ in 0..n {
        let (item, after) = parse_item(body, next, bounds, min_cost)?;
        if items.iter().any(|i| i.scoped_key == item.scoped_key) {
            return Err((ErrorCode::DuplicateItem, format!("policy '{}' and key '{}' appear twice", item.name.escape_ascii(), item.key.escape_ascii())));
        }
        items.push(item);
        next = after;
    }
    Ok(items)
}

/// One item at `at` (its lengths already match the body): the item and
/// the offset after it.
fn parse_item(body: &Bytes, at: usize, bounds: &Bounds, min_cost: u32) -> Result<(PolicyItem, usize), ItemError> {
    let cost = be32(body, at);
    let key_len = u16::from_be_bytes([body[at + 4], body[at + 5]]) as usize;
    let name_len = body[at + 6] as usize;
    if name_len == 0 || name_len > MAX_POLICY_NAME_LEN {
        return Err((ErrorCode::UnknownPolicy, format!("policy name length {name_len} is outside 1..={MAX_POLICY_NAME_LEN}")));
    }
    let name_at = at + POLICY_ITEM_LEN;
    let key_at = name_at + name_len;
    let end = key_at + key_len;
    if key_len == 0 || key_len > bounds.max_key_len {
        return Err((ErrorCode::InvalidKey, format!("key length {key_len} is outside 1..={}", bounds.max_key_len)));
    }
    if let Some(pos) = body[key_at..end].iter().position(|&b| b < 0x20 || b == 0x7f) {
        return Err((ErrorCode::InvalidKey, format!("key byte {pos} is a control character")));
    }
    // The limit comes from the policy: the daemon checks cost against it
    // once the policy is resolved.
    if cost < min_cost || cost > bounds.max_cost {
        return Err((ErrorCode::InvalidCost, format!("cost {cost} is outside {min_cost}..=max_cost {}", bounds.max_cost)));
    }
    // The name's length byte, the name and the key, as they lie in the
    // frame (no copy).
    let scoped_key = body.slice(name_at - 1..end);
    let name = scoped_key.slice(1..1 + name_len);
    let key = scoped_key.slice(1 + name_len..);
    Ok((PolicyItem { cost, name, key, scoped_key }, end))
}

/// The rest of `parse_request` for op 3 (docs/PROTOCOL.md, section 4c).
fn parse_refund(body: Bytes, id: u32, bounds: &Bounds) -> Inbound {
    let op = OP_REFUND;
    if body.len() < REFUND_HEADER_LEN + POLICY_ITEM_LEN {
        return invalid(id, op, ErrorCode::Malformed, format!("refund body of {} bytes is shorter than the {} fixed bytes", body.len(), REFUND_HEADER_LEN + POLICY_ITEM_LEN));
    }
    let flags = u16::from_be_bytes([body[6], body[7]]);
    if flags != 0 {
        return invalid(id, op, ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x}: a refund takes none"));
    }
    let n_items = body[9] as usize;
    if n_items == 0 || n_items > MAX_POLICY_ITEMS {
        return invalid(id, op, ErrorCode::UnsupportedLimitCount, format!("{n_items} items in one refund; 1..={MAX_POLICY_ITEMS} are accepted"));
    }
    let mut handle = [0u8; HANDLE_LEN];
    handle.copy_from_slice(&body[10..REFUND_HEADER_LEN]);
    match parse_items(&body, REFUND_HEADER_LEN, n_items, bounds, 1) {
        Ok(items) => Inbound::Request(Request::Refund(RefundRequest { id, handle, items })),
        Err((code, message)) => invalid(id, op, code, message),
    }
}

/// The rest of `parse_request` for op 8, in the validation order of
/// docs/PROTOCOL.md section 4g.
fn parse_describe(body: Bytes, id: u32) -> Inbound {
    let op = OP_DESCRIBE_POLICY;
    if body.len() < DESCRIBE_HEADER_LEN + 1 {
        return invalid(id, op, ErrorCode::Malformed, format!("describe body of {} bytes is shorter than the {} fixed bytes and a name", body.len(), DESCRIBE_HEADER_LEN));
    }
    let flags = u16::from_be_bytes([body[6], body[7]]);
    if flags & !FLAG_DESCRIBE_USES != 0 {
        return invalid(id, op, ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x}: DESCRIBE_POLICY takes 0x0001 (a uses byte follows the name) only"));
    }
    // The uses byte, when the flag says one follows the name.
    let trailer = usize::from(flags & FLAG_DESCRIBE_USES != 0);
    let name_len = body[8] as usize;
    if name_len == 0 || name_len > MAX_POLICY_NAME_LEN {
        return invalid(id, op, ErrorCode::UnknownPolicy, format!("policy name length {name_len} is outside 1..={MAX_POLICY_NAME_LEN}"));
    }
    if body.len() != DESCRIBE_HEADER_LEN + name_len + trailer {
        return invalid(id, op, ErrorCode::Malformed, format!("name length {name_len} and {trailer} uses byte do not match the {} bytes left in the frame", body.len() - DESCRIBE_HEADER_LEN));
    }
    let name = body.slice(DESCRIBE_HEADER_LEN..DESCRIBE_HEADER_LEN + name_len);
    if !name.iter().all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')) {
        return invalid(id, op, ErrorCode::UnknownPolicy, "a policy name is of A-Z a-z 0-9 _ . - only");
    }
    let uses = if trailer == 1 { PolicyUses::from_wire(body[body.len() - 1]) } else { PolicyUses::SINGLE };
    Inbound::Request(Request::Describe(DescribeRequest { id, name, uses }))
}

/// Appends a DESCRIBE_POLICY frame for `name` (not validated: tests send
/// hostile names with it), as a client of an earlier release sends it:
/// without a uses byte.
pub fn encode_describe(id: u32, name: &[u8], dst: &mut BytesMut) {
    encode_describe_frame(id, name, None, dst);
}

/// Appends a DESCRIBE_POLICY frame for `name` saying how the client uses
/// the policy (flag 0x0001 and the uses byte), as the Lua client sends it.
pub fn encode_describe_uses(id: u32, name: &[u8], uses: PolicyUses, dst: &mut BytesMut) {
    encode_describe_frame(id, name, Some(uses), dst);
}

fn encode_describe_frame(id: u32, name: &[u8], uses: Option<PolicyUses>, dst: &mut BytesMut) {
    let trailer = usize::from(uses.is_some());
    dst.reserve(4 + DESCRIBE_HEADER_LEN + name.len() + trailer);
    dst.put_u32((DESCRIBE_HEADER_LEN + name.len() + trailer) as u32);
    dst.put_u8(VERSION);
    dst.put_u8(OP_DESCRIBE_POLICY);
    dst.put_u32(id);
    dst.put_u16(if uses.is_some() { FLAG_DESCRIBE_USES } else { 0 });
    dst.put_u8(name.len() as u8);
    dst.put_slice(name);
    if let Some(u) = uses {
        dst.put_u8(u.to_wire());
    }
}

/// A CHECK_POLICY with the settle flag (docs/PROTOCOL.md 4f): 1..=
/// `MAX_POLICY_ITEMS` items (the caller checked the count), each cost (an
/// estimate) up to `MAX_O1_COST` (the policies' algorithms and limits are
/// checked once they are resolved).
fn parse_reserve(body: Bytes, id: u32, on_error: FailPolicy, n_items: usize, local_limit: u32, bounds: &Bounds) -> Inbound {
    let op = OP_CHECK_POLICY;
    let o1 = Bounds { max_cost: bounds.max_cost.max(MAX_O1_COST), ..*bounds };
    let items = match parse_items(&body, POLICY_HEADER_LEN, n_items, &o1, 1) {
        Ok(items) => items,
        Err((code, message)) => return invalid(id, op, code, message),
    };
    if let Some(e) = local_limit_error(on_error, local_limit, bounds) {
        return invalid(id, op, ErrorCode::InvalidLocalLimit, e);
    }
    Inbound::Request(Request::Reserve(ReserveRequest { id, on_error, local_limit, items }))
}

/// The rest of `parse_request` for op 9 (docs/PROTOCOL.md, section 4f):
/// REFUND's layout: the reserve's items, each cost the actual (0..=`MAX_O1_COST`).
fn parse_settle(body: Bytes, id: u32, bounds: &Bounds) -> Inbound {
    let op = OP_SETTLE;
    if body.len() < REFUND_HEADER_LEN + POLICY_ITEM_LEN {
        return invalid(id, op, ErrorCode::Malformed, format!("settle body of {} bytes is shorter than the {} fixed bytes", body.len(), REFUND_HEADER_LEN + POLICY_ITEM_LEN));
    }
    let flags = u16::from_be_bytes([body[6], body[7]]);
    if flags != 0 {
        return invalid(id, op, ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x}: a settle takes none"));
    }
    let n_items = body[9] as usize;
    if n_items == 0 || n_items > MAX_POLICY_ITEMS {
        return invalid(id, op, ErrorCode::UnsupportedLimitCount, format!("{n_items} items in one settle; 1..={MAX_POLICY_ITEMS} are accepted"));
    }
    let mut handle = [0u8; HANDLE_LEN];
    handle.copy_from_slice(&body[10..REFUND_HEADER_LEN]);
    let o1 = Bounds { max_cost: bounds.max_cost.max(MAX_O1_COST), ..*bounds };
    match parse_items(&body, REFUND_HEADER_LEN, n_items, &o1, 0) {
        Ok(items) => Inbound::Request(Request::Settle(SettleRequest { id, handle, items })),
        Err((code, message)) => invalid(id, op, code, message),
    }
}

/// Appends one CHECK_POLICY frame with the settle flag: reserve each
/// item's cost, an estimate, all or nothing (docs/PROTOCOL.md 4f).
pub fn encode_reserve(id: u32, on_error: FailPolicy, local_limit: u32, items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    let start = dst.len();
    encode_multi_request(id, on_error, local_limit, false, items, dst);
    dst[start + LEN_PREFIX + 6..start + LEN_PREFIX + 8].copy_from_slice(&FLAG_SETTLE.to_be_bytes());
}

/// Appends one SETTLE frame (op 9): the reserve's handle and items, each
/// item's cost being the actual.
pub fn encode_settle(id: u32, handle: &[u8; HANDLE_LEN], items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    let start = dst.len();
    encode_refund(id, handle, items, dst);
    dst[start + LEN_PREFIX + 1] = OP_SETTLE;
}

/// Appends one CHECK_POLICY frame of several items (or one, refundable) to `dst`.
pub fn encode_multi_request(id: u32, on_error: FailPolicy, local_limit: u32, refundable: bool, items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    let body_len = POLICY_HEADER_LEN + items.iter().map(ItemArgs::len).sum::<usize>();
    dst.reserve(LEN_PREFIX + body_len);
    dst.put_u32(body_len as u32);
    dst.put_u8(VERSION);
    dst.put_u8(OP_CHECK_POLICY);
    dst.put_u32(id);
    dst.put_u16(if refundable { FLAG_REFUNDABLE } else { 0 });
    dst.put_u8(on_error.to_wire());
    dst.put_u8(items.len() as u8);
    dst.put_u32(local_limit);
    for i in items {
        i.put(dst);
    }
}

/// Appends one REFUND frame to `dst`: the handle of a refundable check and
/// its items, as they were sent.
pub fn encode_refund(id: u32, handle: &[u8; HANDLE_LEN], items: &[ItemArgs<'_>], dst: &mut BytesMut) {
    let body_len = REFUND_HEADER_LEN + items.iter().map(ItemArgs::len).sum::<usize>();
    dst.reserve(LEN_PREFIX + body_len);
    dst.put_u32(body_len as u32);
    dst.put_u8(VERSION);
    dst.put_u8(OP_REFUND);
    dst.put_u32(id);
    dst.put_u16(0);
    dst.put_u8(0);
    dst.put_u8(items.len() as u8);
    dst.put_slice(handle);
    for i in items {
        i.put(dst);
    }
}

/// The rest of `parse_request` for ops 5 and 6 (docs/PROTOCOL.md, section
/// 4c, in its validation order). RELEASE is checked as ACQUIRE is: a client
/// sends the same fields to release as it sent to acquire.
fn parse_lease(mut body: Bytes, op: u8, id: u32, bounds: &Bounds) -> Inbound {
    if body.len() < LEASE_HEADER_LEN {
        return invalid(id, op, ErrorCode::Malformed, format!("lease body of {} bytes is shorter than the {LEASE_HEADER_LEN} fixed bytes", body.len()));
    }
    let flags = u16::from_be_bytes([body[6], body[7]]);
    if flags != 0 {
        return invalid(id, op, ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x} are not supported for op {op}"));
    }
    let Some(on_error) = FailPolicy::from_wire(body[8]) else {
        return invalid(id, op, ErrorCode::InvalidPolicy, format!("fail policy {} is not 0 (open), 1 (closed) or 2 (local)", body[8]));
    };
    if body[9] != 1 {
        return invalid(id, op, ErrorCode::UnsupportedLimitCount, format!("{} limits in one request; exactly 1", body[9]));
    }
    let (limit, lease_ms, cost, local_limit) = (be32(&body, 10), be32(&body, 14), be32(&body, 18), be32(&body, 22));
    let key_len = u16::from_be_bytes([body[26], body[27]]) as usize;
    let lease_len = body[28] as usize;
    if body.len() != LEASE_HEADER_LEN + key_len + lease_len {
        return invalid(id, op, ErrorCode::Malformed, format!("key length {key_len} and lease length {lease_len} do not match the {} bytes left in the frame", body.len() - LEASE_HEADER_LEN));
    }
    let key_at = LEASE_HEADER_LEN;
    if key_len == 0 || key_len > bounds.max_key_len {
        return invalid(id, op, ErrorCode::InvalidKey, format!("key length {key_len} is outside 1..={}", bounds.max_key_len));
    }
    if let Some(pos) = body[key_at..key_at + key_len].iter().position(|&b| b < 0x20 || b == 0x7f) {
        return invalid(id, op, ErrorCode::InvalidKey, format!("key byte {pos} is a control character"));
    }
    let lease_at = key_at + key_len;
    if lease_len == 0 || lease_len > MAX_LEASE_ID_LEN || body[lease_at..].iter().any(|&b| b <= 0x20 || b == 0x7f || b == b'#') {
        return invalid(id, op, ErrorCode::InvalidLease, format!("lease id of {lease_len} bytes is not 1..={MAX_LEASE_ID_LEN} printable bytes without spaces or '#'"));
    }
    if limit == 0 || limit > bounds.max_limit {
        return invalid(id, op, ErrorCode::InvalidLimit, format!("limit {limit} is outside 1..={}", bounds.max_limit));
    }
    if lease_ms == 0 || lease_ms > bounds.max_window_ms {
        return invalid(id, op, ErrorCode::InvalidLease, format!("lease length {lease_ms} ms is outside 1..={} ms", bounds.max_window_ms));
    }
    if cost == 0 || cost > limit || cost > bounds.max_cost {
        return invalid(id, op, ErrorCode::InvalidCost, format!("cost {cost} is outside 1..=min(limit {limit}, max_cost {})", bounds.max_cost));
    }
    if on_error == FailPolicy::Local && (local_limit == 0 || local_limit > bounds.max_limit) {
        return invalid(id, op, ErrorCode::InvalidLocalLimit, format!("fail policy local needs a local limit in 1..={}, got {local_limit}", bounds.max_limit));
    }
    body.advance(key_at);
    let lease = body.split_off(key_len);
    Inbound::Request(Request::Lease(LeaseRequest { id, op, on_error, limit, lease_ms, cost, local_limit, key: body, lease }))
}

/// The lease id's rule (section 4d): 1..=`MAX_LEASE_ID_LEN` printable
/// bytes without spaces or '#' (which names a lease's further slots).
fn lease_id_error(lease: &[u8]) -> Option<String> {
    (lease.is_empty() || lease.len() > MAX_LEASE_ID_LEN || lease.iter().any(|&b| b <= 0x20 || b == 0x7f || b == b'#'))
        .then(|| format!("lease id of {} bytes is not 1..={MAX_LEASE_ID_LEN} printable bytes without spaces or '#'", lease.len()))
}

/// The rest of `parse_request` for op 7 (docs/PROTOCOL.md, section 4e, in
/// its validation order): CHECK_POLICY's header and one item, with the
/// lease id's length before the item and the lease id after it.
fn parse_policy_lease(mut body: Bytes, id: u32, bounds: &Bounds) -> Inbound {
    let op = OP_ACQUIRE_POLICY;
    if body.len() < POLICY_LEASE_HEADER_LEN {
        return invalid(id, op, ErrorCode::Malformed, format!("acquire-policy body of {} bytes is shorter than the {POLICY_LEASE_HEADER_LEN} fixed bytes", body.len()));
    }
    let flags = u16::from_be_bytes([body[6], body[7]]);
    if flags & !FLAG_RELEASE != 0 {
        return invalid(id, op, ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x}: only 0x0001 (release) is defined for op {op}"));
    }
    let Some(on_error) = FailPolicy::from_wire(body[8]) else {
        return invalid(id, op, ErrorCode::InvalidPolicy, format!("fail policy {} is not 0 (open), 1 (closed) or 2 (local)", body[8]));
    };
    if body[9] != 1 {
        return invalid(id, op, ErrorCode::UnsupportedLimitCount, format!("{} items in one acquire-policy request; exactly 1", body[9]));
    }
    let local_limit = be32(&body, 10);
    let lease_len = body[14] as usize;
    let item_at = POLICY_HEADER_LEN + 1;
    let key_len = u16::from_be_bytes([body[item_at + 4], body[item_at + 5]]) as usize;
    let name_len = body[item_at + 6] as usize;
    if body.len() != POLICY_LEASE_HEADER_LEN + name_len + key_len + lease_len {
        return invalid(
            id,
            op,
            ErrorCode::Malformed,
            format!("name length {name_len}, key length {key_len} and lease length {lease_len} do not match the {} bytes left in the frame", body.len() - POLICY_LEASE_HEADER_LEN),
        );
    }
    let (item, end) = match parse_item(&body, item_at, bounds, 1) {
        Ok(item) => item,
        Err((code, message)) => return invalid(id, op, code, message),
    };
    if let Some(e) = lease_id_error(&body[end..]) {
        return invalid(id, op, ErrorCode::InvalidLease, e);
    }
    if let Some(e) = local_limit_error(on_error, local_limit, bounds) {
        return invalid(id, op, ErrorCode::InvalidLocalLimit, e);
    }
    let lease = body.split_off(end);
    let PolicyItem { cost, name, key, scoped_key } = item;
    Inbound::Request(Request::PolicyLease(PolicyLeaseRequest { id, release: flags & FLAG_RELEASE != 0, on_error, local_limit, cost, name, key, scoped_key, lease }))
}

/// Appends one ACQUIRE_POLICY frame (op 7; with `release`, the release) to `dst`.
pub fn encode_policy_lease_request(id: u32, release: bool, a: &PolicyLeaseArgs<'_>, dst: &mut BytesMut) {
    let body_len = POLICY_LEASE_HEADER_LEN + a.policy.len() + a.key.len() + a.lease.len();
    dst.reserve(LEN_PREFIX + body_len);
    dst.put_u32(body_len as u32);
    dst.put_u8(VERSION);
    dst.put_u8(OP_ACQUIRE_POLICY);
    dst.put_u32(id);
    dst.put_u16(if release { FLAG_RELEASE } else { 0 });
    dst.put_u8(a.on_error.to_wire());
    dst.put_u8(1);
    dst.put_u32(a.local_limit);
    dst.put_u8(a.lease.len() as u8);
    dst.put_u32(a.cost);
    dst.put_u16(a.key.len() as u16);
    dst.put_u8(a.policy.len() as u8);
    dst.put_slice(a.policy);
    dst.put_slice(a.key);
    dst.put_slice(a.lease);
}

/// Appends one ACQUIRE (`op` 5) or RELEASE (`op` 6) frame to `dst`.
pub fn encode_lease_request(id: u32, op: u8, a: &LeaseArgs<'_>, dst: &mut BytesMut) {
    let body_len = LEASE_HEADER_LEN + a.key.len() + a.lease.len();
    dst.reserve(LEN_PREFIX + body_len);
    dst.put_u32(body_len as u32);
    dst.put_u8(VERSION);
    dst.put_u8(op);
    dst.put_u32(id);
    dst.put_u16(0);
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

/// The rest of `parse_request` for op 10 (docs/PROTOCOL.md, section 4h, in
/// its validation order): CHECK_POLICY's header without flags and exactly
/// one item, whose cost is the units wanted.
fn parse_lease_share(body: Bytes, id: u32, bounds: &Bounds) -> Inbound {
    let op = OP_LEASE_SHARE;
    let fixed = POLICY_HEADER_LEN + POLICY_ITEM_LEN;
    if body.len() < fixed {
        return invalid(id, op, ErrorCode::Malformed, format!("lease-share body of {} bytes is shorter than the {fixed} fixed bytes", body.len()));
    }
    let flags = u16::from_be_bytes([body[6], body[7]]);
    if flags & !FLAG_GIVE_BACK != 0 {
        return invalid(id, op, ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x}: op {op} defines 0x0001 (give back) only"));
    }
    let give_back = flags == FLAG_GIVE_BACK;
    let Some(on_error) = FailPolicy::from_wire(body[8]) else {
        return invalid(id, op, ErrorCode::InvalidPolicy, format!("fail policy {} is not 0 (open), 1 (closed) or 2 (local)", body[8]));
    };
    if body[9] != 1 {
        return invalid(id, op, ErrorCode::UnsupportedLimitCount, format!("{} items in one lease-share request; exactly 1", body[9]));
    }
    let units = |item: &PolicyItem| match give_back {
        true => (item.cost > MAX_GIVE_BACK_UNITS).then(|| format!("{} units given back; a give-back is 1..={MAX_GIVE_BACK_UNITS}", item.cost)),
        false => (item.cost > MAX_SHARE_UNITS).then(|| format!("{} units wanted; a share is 1..={MAX_SHARE_UNITS}", item.cost)),
    };
    match one_item(&body, id, op, on_error, be32(&body, 10), bounds, units) {
        Ok(r) if give_back => Inbound::Request(Request::GiveBack(r)),
        Ok(r) => Inbound::Request(Request::LeaseShare(r)),
        Err(invalid) => invalid,
    }
}

/// The one item of a CHECK_POLICY-shaped body (ops 2 and 10) after its
/// header: the lengths, the item, `cost_error` (a bound of the op's own on
/// the cost, `INVALID_COST`), the local limit; in this order.
fn one_item(body: &Bytes, id: u32, op: u8, on_error: FailPolicy, local_limit: u32, bounds: &Bounds, cost_error: impl Fn(&PolicyItem) -> Option<String>) -> Result<PolicyCheckRequest, Inbound> {
    let (e, fixed) = (POLICY_HEADER_LEN, POLICY_HEADER_LEN + POLICY_ITEM_LEN);
    let key_len = u16::from_be_bytes([body[e + 4], body[e + 5]]) as usize;
    let name_len = body[e + 6] as usize;
    if body.len() != fixed + name_len + key_len {
        return Err(invalid(id, op, ErrorCode::Malformed, format!("name length {name_len} and key length {key_len} do not match the {} bytes left in the frame", body.len() - fixed)));
    }
    let item = parse_item(body, POLICY_HEADER_LEN, bounds, 1).map_err(|(code, message)| invalid(id, op, code, message))?.0;
    if let Some(e) = cost_error(&item) {
        return Err(invalid(id, op, ErrorCode::InvalidCost, e));
    }
    if let Some(e) = local_limit_error(on_error, local_limit, bounds) {
        return Err(invalid(id, op, ErrorCode::InvalidLocalLimit, e));
    }
    let PolicyItem { cost, name, key, scoped_key } = item;
    Ok(PolicyCheckRequest { id, on_error, local_limit, cost, name, key, scoped_key })
}

/// Appends one LEASE_SHARE frame (op 10) to `dst`: `a.cost` is the units wanted.
pub fn encode_lease_share(id: u32, a: &PolicyCheckArgs<'_>, dst: &mut BytesMut) {
    let start = dst.len();
    encode_policy_request(id, a, dst);
    dst[start + LEN_PREFIX + 1] = OP_LEASE_SHARE;
}

/// Appends one give-back frame (op 10 with `FLAG_GIVE_BACK`) to `dst`:
/// `a.cost` is the units given back.
pub fn encode_give_back(id: u32, a: &PolicyCheckArgs<'_>, dst: &mut BytesMut) {
    let start = dst.len();
    encode_lease_share(id, a, dst);
    dst[start + LEN_PREFIX + 7] |= FLAG_GIVE_BACK as u8;
}

/// Appends one give-back frame of an inline limit's share (CHECK with
/// `FLAG_SHARE | FLAG_SHARE_GIVE_BACK`) to `dst`: `a.cost` is the units
/// given back.
pub fn encode_inline_give_back(id: u32, a: &CheckArgs<'_>, dst: &mut BytesMut) {
    let start = dst.len();
    encode_inline_share(id, a, dst);
    dst[start + LEN_PREFIX + 6] |= (FLAG_SHARE_GIVE_BACK >> 8) as u8;
}

/// Appends one worker-share frame of an inline limit (CHECK with
/// `FLAG_SHARE`) to `dst`: `a.cost` is the units wanted.
pub fn encode_inline_share(id: u32, a: &CheckArgs<'_>, dst: &mut BytesMut) {
    let start = dst.len();
    encode_request_with(id, a, Algorithm::Log, dst);
    dst[start + LEN_PREFIX + 6] |= (FLAG_SHARE >> 8) as u8;
}

/// Appends one check-policy request frame (one item) to `dst`.
pub fn encode_policy_request(id: u32, a: &PolicyCheckArgs<'_>, dst: &mut BytesMut) {
    let body_len = POLICY_HEADER_LEN + POLICY_ITEM_LEN + a.policy.len() + a.key.len();
    dst.reserve(LEN_PREFIX + body_len);
    dst.put_u32(body_len as u32);
    dst.put_u8(VERSION);
    dst.put_u8(OP_CHECK_POLICY);
    dst.put_u32(id);
    dst.put_u16(0);
    dst.put_u8(a.on_error.to_wire());
    dst.put_u8(1);
    dst.put_u32(a.local_limit);
    dst.put_u32(a.cost);
    dst.put_u16(a.key.len() as u16);
    dst.put_u8(a.policy.len() as u8);
    dst.put_slice(a.policy);
    dst.put_slice(a.key);
}

/// Appends one check request frame to `dst` (the log algorithm).
pub fn encode_request(id: u32, a: &CheckArgs<'_>, dst: &mut BytesMut) {
    encode_request_with(id, a, Algorithm::Log, dst);
}

/// Appends one check request frame for `algorithm` to `dst`.
pub fn encode_request_with(id: u32, a: &CheckArgs<'_>, algorithm: Algorithm, dst: &mut BytesMut) {
    let body_len = REQUEST_HEADER_LEN + LIMIT_ENTRY_LEN + a.key.len();
    dst.reserve(LEN_PREFIX + body_len);
    dst.put_u32(body_len as u32);
    dst.put_u8(VERSION);
    dst.put_u8(OP_CHECK);
    dst.put_u32(id);
    dst.put_u16(algorithm.to_flags());
    dst.put_u8(a.on_error.to_wire());
    dst.put_u8(1);
    dst.put_u32(a.limit);
    dst.put_u32(a.window_ms);
    dst.put_u32(a.cost);
    dst.put_u32(a.local_limit);
    dst.put_u16(a.key.len() as u16);
    dst.put_slice(a.key);
}


#[cfg(test)]
mod tests {
    use super::*;

    fn args(key: &[u8]) -> CheckArgs<'_> {
        CheckArgs { key, limit: 1000, window_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
    }

    fn decode_one(bytes: &[u8]) -> Inbound {
        let mut buf = BytesMut::from(bytes);
        RequestCodec::new(Bounds::default()).decode(&mut buf).unwrap().expect("a whole frame")
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

    #[test]
    fn request_round_trip_matches_documented_hex() {
        let mut buf = BytesMut::new();
        encode_request(7, &args(b"t1"), &mut buf);
        // The same bytes are shown in docs/PROTOCOL.md.
        let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "0000001e01010000000700000101000003e8000003e8000000010000000000027431");
        match decode_one(&buf) {
            Inbound::Request(Request::Check(c)) => {
                assert_eq!((c.id, c.limit, c.window_ms, c.cost, &c.key[..]), (7, 1000, 1000, 1, &b"t1"[..]));
                assert_eq!(c.on_error, FailPolicy::Closed);
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
                assert_eq!((c.id, c.cost, &c.name[..], &c.key[..]), (7, 1, &b"order"[..], &b"t1"[..]));
                assert_eq!(&c.scoped_key[..], b"\x05ordert1");
                assert_eq!(c.on_error, FailPolicy::Open);
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
        assert_eq!((req.items.len(), req.items[0].cost, &req.items[0].name[..], &req.items[0].key[..]), (1, 1_000_000_000, &b"tok"[..], &b"t1"[..]));
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
        assert_eq!((m.id, m.on_error, m.refundable, m.items.len()), (7, FailPolicy::Closed, true, 2));
        assert_eq!((&m.items[1].name[..], &m.items[1].key[..], m.items[1].cost), (&b"tenant"[..], &b"t1"[..], 2));
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
    fn partial_frames_wait_for_more_bytes() {
        let mut whole = BytesMut::new();
        encode_request(1, &args(b"k"), &mut whole);
        let mut codec = RequestCodec::new(Bounds::default());
        let mut buf = BytesMut::new();
        for (i, b) in whole.iter().enumerate() {
            buf.put_u8(*b);
            let got = codec.decode(&mut buf).unwrap();
            assert_eq!(got.is_some(), i == whole.len() - 1);
        }
    }

    #[test]
    fn too_large_frame_is_fatal() {
        let mut buf = BytesMut::from(&((MAX_FRAME_LEN + 1) as u32).to_be_bytes()[..]);
        let got = RequestCodec::new(Bounds::default()).decode(&mut buf).unwrap();
        assert_eq!(got, Some(Inbound::TooLarge { len: MAX_FRAME_LEN + 1 }));
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
    fn truncated_stream_yields_malformed_at_eof() {
        let mut whole = BytesMut::new();
        encode_request(5, &args(b"key"), &mut whole);
        let mut buf = BytesMut::from(&whole[..whole.len() - 2]);
        let got = RequestCodec::new(Bounds::default()).decode_eof(&mut buf).unwrap().unwrap();
        match got {
            Inbound::Invalid { id, code, .. } => assert_eq!((id, code), (5, ErrorCode::Malformed)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap deterministic fuzz: xorshift bytes of every length up to 600.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut codec = RequestCodec::new(Bounds::default());
        for len in 0..600usize {
            let mut body = Vec::with_capacity(len);
            for _ in 0..len {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                body.push(x as u8);
            }
            if len > 0 {
                body[0] = VERSION;
            }
            if len > 1 {
                body[1] = OP_CHECK;
            }
            let mut buf = BytesMut::from(&frame(&body)[..]);
            let _ = codec.decode(&mut buf).unwrap();
            let mut raw = BytesMut::from(&body[..]);
            let _ = codec.decode(&mut raw);
            let _ = codec.decode_eof(&mut raw);
        }
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

            /// Any bytes at all, in any chunking: the decoder never panics,
            /// never buffers beyond one maximal frame, and every frame it
            /// yields is a valid request, a coded error, or too large.
            #[test]
            fn any_byte_stream_decodes_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..6000), chunk in 1usize..700) {
                let mut codec = RequestCodec::new(Bounds::default());
                let mut buf = BytesMut::new();
                for piece in bytes.chunks(chunk) {
                    buf.extend_from_slice(piece);
                    loop {
                        match codec.decode(&mut buf).unwrap() {
                            Some(Inbound::TooLarge { .. }) => { buf.clear(); break }
                            Some(Inbound::Invalid { code, .. }) => prop_assert!((code as u16) < 20),
                            Some(Inbound::Request(Request::Check(c))) => prop_assert!(c.cost <= c.limit && !c.key.is_empty()),
                            Some(Inbound::Request(Request::PolicyCheck(c))) => prop_assert!(!c.key.is_empty() && !c.name.is_empty()),
                            Some(Inbound::Request(Request::MultiCheck(MultiCheckRequest { items, .. })) | Inbound::Request(Request::Refund(RefundRequest { items, .. }))) => {
                                prop_assert!((1..=MAX_POLICY_ITEMS).contains(&items.len()) && items.iter().all(|i| !i.key.is_empty() && !i.name.is_empty()))
                            }
                            Some(Inbound::Request(Request::Lease(c))) => prop_assert!(c.cost <= c.limit && !c.key.is_empty() && !c.lease.is_empty()),
                            Some(Inbound::Request(Request::PolicyLease(c))) => prop_assert!(!c.key.is_empty() && !c.name.is_empty() && !c.lease.is_empty() && c.scoped_key.len() == 1 + c.name.len() + c.key.len()),
                            Some(Inbound::Request(Request::Reserve(c))) => prop_assert!((1..=MAX_POLICY_ITEMS).contains(&c.items.len()) && c.items.iter().all(|i| !i.key.is_empty() && !i.name.is_empty() && i.cost >= 1 && i.cost <= MAX_O1_COST)),
                            Some(Inbound::Request(Request::Settle(c))) => prop_assert!((1..=MAX_POLICY_ITEMS).contains(&c.items.len()) && c.items.iter().all(|i| !i.key.is_empty() && !i.name.is_empty() && i.cost <= MAX_O1_COST)),
                            Some(Inbound::Request(Request::LeaseShare(c))) => prop_assert!(!c.key.is_empty() && !c.name.is_empty() && (1..=MAX_SHARE_UNITS).contains(&c.cost)),
                            Some(Inbound::Request(Request::InlineShare(c))) => prop_assert!(!c.key.is_empty() && (1..=MAX_SHARE_UNITS).contains(&c.cost)),
                            Some(Inbound::Request(Request::GiveBack(c))) => prop_assert!(!c.key.is_empty() && !c.name.is_empty() && (1..=MAX_GIVE_BACK_UNITS).contains(&c.cost)),
                            Some(Inbound::Request(Request::InlineGiveBack(c))) => prop_assert!(!c.key.is_empty() && (1..=MAX_GIVE_BACK_UNITS).contains(&c.cost)),
                            // Hostile bytes never reach the lookup as a name a policy could not have.
                            Some(Inbound::Request(Request::Describe(d))) => prop_assert!((1..=MAX_POLICY_NAME_LEN).contains(&d.name.len()) && d.name.iter().all(|&b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))),
                            None => break,
                        }
                    }
                    prop_assert!(buf.len() <= LEN_PREFIX + MAX_FRAME_LEN);
                }
                let _ = codec.decode_eof(&mut buf).unwrap();
            }

            /// Requests with extreme field values are either valid and round
            /// trip exactly, or rejected with the code of the bad field.
            #[test]
            fn extreme_fields_round_trip_or_get_their_code(
                id: u32, limit: u32, window_ms: u32, cost: u32, local_limit: u32,
                policy in 0u8..3, key in proptest::collection::vec(any::<u8>(), 0..600),
            ) {
                let a = CheckArgs { key: &key, limit, window_ms, cost, on_error: FailPolicy::from_wire(policy).unwrap(), local_limit };
                let mut buf = BytesMut::new();
                encode_request(id, &a, &mut buf);
                let b = Bounds::default();
                match RequestCodec::new(b).decode(&mut buf).unwrap().unwrap() {
                    Inbound::Request(Request::Check(c)) => {
                        prop_assert_eq!((c.id, c.limit, c.window_ms, c.cost, &c.key[..]), (id, limit, window_ms, cost, &key[..]));
                    }
                    Inbound::Request(Request::InlineShare(_) | Request::InlineGiveBack(_)) => prop_assert!(false, "a CHECK without the share flag decoded as a share"),
                    Inbound::Invalid { id: got, code, .. } => {
                        prop_assert_eq!(got, id);
                        let expected_bad = match code {
                            ErrorCode::InvalidKey => key.is_empty() || key.len() > b.max_key_len || key.iter().any(|&k| k < 0x20 || k == 0x7f),
                            ErrorCode::InvalidLimit => limit == 0 || limit > b.max_limit,
                            ErrorCode::InvalidWindow => window_ms == 0 || window_ms > b.max_window_ms,
                            ErrorCode::InvalidCost => cost == 0 || cost > limit || cost > b.max_cost,
                            ErrorCode::InvalidLocalLimit => policy == 2 && (local_limit == 0 || local_limit > b.max_limit),
                            _ => false,
                        };
                        prop_assert!(expected_bad, "{:?} for a request that is valid there", code);
                    }
                    Inbound::TooLarge { .. } => prop_assert!(key.len() + REQUEST_HEADER_LEN + LIMIT_ENTRY_LEN > MAX_FRAME_LEN),
                    Inbound::Request(Request::PolicyCheck(_)) | Inbound::Request(Request::MultiCheck(_)) | Inbound::Request(Request::Refund(_)) => prop_assert!(false, "a CHECK decoded as another op"),
                    Inbound::Request(Request::Lease(_)) => prop_assert!(false, "a CHECK decoded as a lease"),
                    Inbound::Request(Request::PolicyLease(_)) => prop_assert!(false, "a CHECK decoded as a policy lease"),
                    Inbound::Request(Request::Reserve(_)) | Inbound::Request(Request::Settle(_)) => prop_assert!(false, "a CHECK decoded as a reserve or settle"),
                    Inbound::Request(Request::LeaseShare(_) | Request::GiveBack(_)) => prop_assert!(false, "a CHECK decoded as a lease share"),
                    Inbound::Request(Request::Describe(_)) => prop_assert!(false, "a CHECK decoded as a describe"),
                }
            }
        }
    }
}
