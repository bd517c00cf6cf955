//! DESCRIBE_POLICY's answer (op 8, docs/PROTOCOL.md section 4g; the
//! request is `request::DescribeRequest`): what the configuration in force
//! says of a policy name. Not a decision: the answer reuses the response's
//! fixed fields (so every client's decoder reads it unchanged), with the
//! meanings `PolicyDescription` gives them.

use std::borrow::Cow;

use super::response::Response;
use super::wire::{Algorithm, Decision, ErrorCode, FailPolicy, PolicyKind, OP_DESCRIBE_POLICY};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::request::{encode_describe, encode_describe_uses, parse_request, Bounds, Inbound, PolicyUse, PolicyUses, Request};
    use crate::protocol::response::{decode_response, encode_response};
    use crate::protocol::wire::MAX_POLICY_NAME_LEN;
    use bytes::{Bytes, BytesMut};

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn parse(frame: &[u8]) -> Inbound {
        parse_request(Bytes::copy_from_slice(&frame[4..]), &Bounds::default())
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
