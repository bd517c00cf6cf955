//! DESCRIBE_POLICY (op 8, docs/PROTOCOL.md section 4g): what the
//! configuration in force says of a policy name, and how the client uses
//! it. Not a decision: the answer reuses the response's fixed fields (so
//! every client's decoder reads it unchanged), with the meanings
//! `PolicyDescription` gives them.

use std::borrow::Cow;

use bytes::{BufMut, Bytes, BytesMut};

use crate::protocol::header::{flags, refused, Head, Refused};
use crate::protocol::response::Response;
use crate::protocol::wire::{Algorithm, Decision, ErrorCode, FailPolicy, PolicyKind, DESCRIBE_HEADER_LEN, MAX_POLICY_NAME_LEN, OP_DESCRIBE_POLICY};

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


/// What the daemon says of a policy that exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyDescription {
    pub kind: PolicyKind,
    pub algorithm: Algorithm,
    /// The policy's limit (an override may give a key another).
    pub limit: u32,
    /// A rate policy's window (a calendar window's code, as CHECK_POLICY's
    /// item results carry it); a concurrency policy's `lease_ms`.
    pub window_ms: u32,
    /// The policy's own `on_error`; `None`: each location's applies.
    pub on_error: Option<FailPolicy>,
    /// The policy's `local_limit` (with `on_error = "local"`), else 0.
    pub local_limit: u32,
    pub shadow: bool,
}

/// `reset_ms`'s byte 2 when the policy has no `on_error` of its own.
const NO_ON_ERROR: u8 = 0xFF;
/// `reset_ms`'s byte 3: the policy is in shadow mode.
const SHADOW_BIT: u8 = 0x01;

impl PolicyDescription {
    /// The answer to request `id`: decision allowed, source none, error OK,
    /// `count` the limit, `remaining` the local quota, `retry_after_ms` the
    /// window, `reset_ms` four bytes: kind, algorithm, on_error (0xFF:
    /// none), flags (0x01 shadow).
    pub fn to_response(&self, id: u32) -> Response {
        let packed = u32::from_be_bytes([
            self.kind.to_wire(),
            self.algorithm.to_wire(),
            self.on_error.map_or(NO_ON_ERROR, FailPolicy::to_wire),
            if self.shadow { SHADOW_BIT } else { 0 },
        ]);
        Response {
            decision: Decision::Allowed,
            count: self.limit,
            remaining: self.local_limit,
            retry_after_ms: self.window_ms,
            reset_ms: packed,
            error: ErrorCode::None,
            message: Cow::Borrowed(""),
            ..Response::error(id, OP_DESCRIBE_POLICY, ErrorCode::None, Cow::Borrowed(""))
        }
    }

    /// The description in an answer to DESCRIBE_POLICY (client side):
    /// `Ok(None)` for a name the daemon does not have (UNKNOWN_POLICY),
    /// `Err` for any other answer.
    pub fn from_response(r: &Response) -> Result<Option<Self>, String> {
        if r.op != OP_DESCRIBE_POLICY {
            return Err(format!("answer of op {}, not DESCRIBE_POLICY", r.op));
        }
        if r.error == ErrorCode::UnknownPolicy {
            return Ok(None);
        }
        if r.decision != Decision::Allowed || r.error != ErrorCode::None {
            return Err(format!("{}: {}", r.error, r.message));
        }
        let [kind, algorithm, on_error, flags] = r.reset_ms.to_be_bytes();
        Ok(Some(Self {
            kind: PolicyKind::from_wire(kind).ok_or_else(|| format!("unknown policy kind {kind}"))?,
            algorithm: Algorithm::from_wire(algorithm).ok_or_else(|| format!("unknown algorithm {algorithm}"))?,
            limit: r.count,
            window_ms: r.retry_after_ms,
            on_error: if on_error == NO_ON_ERROR { None } else { Some(FailPolicy::from_wire(on_error).ok_or_else(|| format!("unknown on_error {on_error}"))?) },
            local_limit: r.remaining,
            shadow: flags & SHADOW_BIT != 0,
        }))
    }
}

/// The answer for a name no policy has: decision error, UNKNOWN_POLICY
/// (as CHECK_POLICY answers it). The name is not echoed: the client
/// knows what it sent, and nothing it sends is repeated back or logged.
pub fn unknown_policy_response(id: u32) -> Response {
    Response::error(id, OP_DESCRIBE_POLICY, ErrorCode::UnknownPolicy, Cow::Borrowed("no policy of this name in the configuration in force"))
}

/// Parses and validates a DESCRIBE_POLICY body, in the validation order of
/// docs/PROTOCOL.md section 4g.
pub(crate) fn parse(head: Head, body: Bytes) -> Result<DescribeRequest, Refused> {
    if body.len() < DESCRIBE_HEADER_LEN + 1 {
        let why = format!("describe body of {} bytes is shorter than the {DESCRIBE_HEADER_LEN} fixed bytes and a name", body.len());
        return Err(refused(ErrorCode::Malformed, why));
    }
    let flags = flags(&body);
    if flags & !FLAG_DESCRIBE_USES != 0 {
        return Err(refused(ErrorCode::UnsupportedFlags, format!("flags 0x{flags:04x}: DESCRIBE_POLICY takes 0x0001 (a uses byte follows the name) only")));
    }
    // The uses byte, when the flag says one follows the name.
    let trailer = usize::from(flags & FLAG_DESCRIBE_USES != 0);
    let name_len = body[8] as usize;
    if name_len == 0 || name_len > MAX_POLICY_NAME_LEN {
        return Err(refused(ErrorCode::UnknownPolicy, format!("policy name length {name_len} is outside 1..={MAX_POLICY_NAME_LEN}")));
    }
    if body.len() != DESCRIBE_HEADER_LEN + name_len + trailer {
        let why = format!("name length {name_len} and {trailer} uses byte do not match the {} bytes left in the frame", body.len() - DESCRIBE_HEADER_LEN);
        return Err(refused(ErrorCode::Malformed, why));
    }
    let name = body.slice(DESCRIBE_HEADER_LEN..DESCRIBE_HEADER_LEN + name_len);
    if !name.iter().all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')) {
        return Err(refused(ErrorCode::UnknownPolicy, "a policy name is of A-Z a-z 0-9 _ . - only"));
    }
    let uses = if trailer == 1 { PolicyUses::from_wire(body[body.len() - 1]) } else { PolicyUses::SINGLE };
    Ok(DescribeRequest { id: head.id, name, uses })
}

/// Appends a DESCRIBE_POLICY frame for `name` (not validated: tests send
/// hostile names with it), as a client of an earlier release sends it:
/// without a uses byte.
pub fn encode_describe(id: u32, name: &[u8], dst: &mut BytesMut) {
    put(id, name, None, dst);
}

/// Appends a DESCRIBE_POLICY frame for `name` saying how the client uses
/// the policy (flag 0x0001 and the uses byte), as the Lua client sends it.
pub fn encode_describe_uses(id: u32, name: &[u8], uses: PolicyUses, dst: &mut BytesMut) {
    put(id, name, Some(uses), dst);
}

fn put(id: u32, name: &[u8], uses: Option<PolicyUses>, dst: &mut BytesMut) {
    let trailer = usize::from(uses.is_some());
    Head { op: OP_DESCRIBE_POLICY, id }.put(DESCRIBE_HEADER_LEN + name.len() + trailer, if uses.is_some() { FLAG_DESCRIBE_USES } else { 0 }, dst);
    dst.put_u8(name.len() as u8);
    dst.put_slice(name);
    if let Some(u) = uses {
        dst.put_u8(u.to_wire());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::response::{decode_response, encode_response};

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }


    #[test]
    fn description_response_matches_documented_hex_and_round_trips() {
        let d = PolicyDescription { kind: PolicyKind::Rate, algorithm: Algorithm::Log, limit: 1000, window_ms: 60_000, on_error: Some(FailPolicy::Local), local_limit: 100, shadow: false };
        let mut buf = BytesMut::new();
        encode_response(&d.to_response(7), &mut buf);
        // docs/PROTOCOL.md section 4g: limit 1000, local quota 100, window 60000 ms, rate/log/local/not shadow.
        assert_eq!(hex(&buf), "0000001c".to_owned() + "0108" + "00000007" + "00ff" + "000003e8" + "00000064" + "0000ea60" + "00000200" + "0000" + "0000");
        let r = decode_response(&mut buf).unwrap().unwrap();
        assert_eq!(PolicyDescription::from_response(&r), Ok(Some(d)));
        let shadow_lease = PolicyDescription { kind: PolicyKind::Concurrency, algorithm: Algorithm::Log, limit: 5, window_ms: 30_000, on_error: None, local_limit: 0, shadow: true };
        let mut buf = BytesMut::new();
        encode_response(&shadow_lease.to_response(9), &mut buf);
        let r = decode_response(&mut buf).unwrap().unwrap();
        assert_eq!(r.reset_ms, 0x0100_ff01);
        assert_eq!(PolicyDescription::from_response(&r), Ok(Some(shadow_lease)));
    }

    #[test]
    fn unknown_policy_answer_matches_documented_hex() {
        let mut buf = BytesMut::new();
        encode_response(&unknown_policy_response(7), &mut buf);
        let r = decode_response(&mut buf.clone()).unwrap().unwrap();
        assert_eq!(PolicyDescription::from_response(&r), Ok(None));
        assert_eq!(hex(&buf[..32]), "00000050".to_owned() + "0108" + "00000007" + "02ff" + "00000000".repeat(4).as_str() + "000c" + "0034");
    }
}
