//! The framer: a 4-byte big-endian body length, then the body. The one
//! place a byte stream is cut into frames; the server reads with
//! `next_frame` and `truncated`, clients and tests with `RequestCodec`.

use std::borrow::Cow;
use std::io;

use bytes::{Buf, Bytes, BytesMut};
use tokio_util::codec::Decoder;

use super::header::{Bounds, HEAD_LEN};
use super::request::{parse_request, Inbound};
use super::response::Response;
use super::wire::{be32, ErrorCode, LEN_PREFIX, MAX_FRAME_LEN};

/// One frame split off the read buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    Body(Bytes),
    /// The length prefix is beyond `MAX_FRAME_LEN`; the buffer was cleared.
    TooLarge(usize),
}

/// The next whole frame in `buf`, if any. Never buffers beyond one
/// maximal frame: room for the rest of a frame is reserved once its
/// length is known to be within `MAX_FRAME_LEN`.
pub fn next_frame(buf: &mut BytesMut) -> Option<Frame> {
    if buf.len() < LEN_PREFIX {
        return None;
    }
    let len = be32(buf, 0) as usize;
    if len > MAX_FRAME_LEN {
        buf.clear();
        return Some(Frame::TooLarge(len));
    }
    if buf.len() < LEN_PREFIX + len {
        buf.reserve(LEN_PREFIX + len - buf.len());
        return None;
    }
    buf.advance(LEN_PREFIX);
    Some(Frame::Body(buf.split_to(len).freeze()))
}

/// The answer to a frame whose length prefix is beyond `MAX_FRAME_LEN`,
/// after which the connection is closed (its request id was not read).
pub fn too_large(len: usize) -> Response {
    Response::error(0, 0, ErrorCode::FrameTooLarge, format!("frame of {len} bytes exceeds the maximum of {MAX_FRAME_LEN}").into())
}

/// At the end of the stream: the answer to a frame it cut off (MALFORMED,
/// with the request id when its bytes arrived), if `buf` holds one; the
/// buffer is cleared.
pub fn truncated(buf: &mut BytesMut) -> Option<Inbound> {
    if buf.is_empty() {
        return None;
    }
    let id = if buf.len() >= LEN_PREFIX + HEAD_LEN { be32(buf, LEN_PREFIX + 2) } else { 0 };
    buf.clear();
    Some(Inbound::Invalid { id, op: 0, code: ErrorCode::Malformed, message: Cow::Borrowed("truncated frame: the stream ended inside a frame") })
}

/// Decodes requests from a byte stream: `next_frame`, then
/// `parse_request` against `Bounds`.
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
        Ok(next_frame(src).map(|frame| match frame {
            Frame::Body(body) => parse_request(body, &self.bounds),
            Frame::TooLarge(len) => Inbound::TooLarge { len },
        }))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> io::Result<Option<Inbound>> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None => Ok(truncated(src)),
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::{BufMut, BytesMut};

    use super::*;
    use crate::protocol::op::check::{encode_request, CheckArgs};
    use crate::protocol::op::check_policy::{encode_policy_request, MultiCheckRequest, PolicyCheckArgs};
    use crate::protocol::op::refund::RefundRequest;
    use crate::protocol::request::{LoggedKey, Request};
    use crate::protocol::wire::*;

    fn args(key: &[u8]) -> CheckArgs<'_> {
        CheckArgs { key, limit: 1000, window_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
    }

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn frames_are_split_and_their_keys_logged() {
        let mut buf = BytesMut::new();
        let args = CheckArgs { key: b"k\x01y", limit: 2, window_ms: 60_000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
        encode_request(9, &args, &mut buf);
        let whole = buf.clone();
        buf.extend_from_slice(&whole[..7]);
        let Some(Frame::Body(body)) = next_frame(&mut buf) else { panic!("one whole frame") };
        assert_eq!(body.len(), whole.len() - LEN_PREFIX);
        assert_eq!(LoggedKey(&body).to_string(), "k\\x01y");
        assert!(next_frame(&mut buf).is_none(), "7 bytes of the next one stay buffered");
        assert_eq!(buf.len(), 7);
        assert_eq!(LoggedKey(&body[..20]).to_string(), "-");
        let mut p = BytesMut::new();
        let pargs = PolicyCheckArgs { policy: b"order", key: b"t\x7f1", cost: 1, on_error: FailPolicy::Open, local_limit: 0 };
        encode_policy_request(1, &pargs, &mut p);
        assert_eq!(LoggedKey(&p[LEN_PREFIX..]).to_string(), "order/t\\x7f1");
        assert_eq!(LoggedKey(&p[LEN_PREFIX..p.len() - 1]).to_string(), "-");
        let long = [b'a'; 200];
        let mut l = BytesMut::new();
        encode_request(1, &CheckArgs { key: &long, ..args }, &mut l);
        assert_eq!(LoggedKey(&l[LEN_PREFIX..]).to_string(), format!("{}... (200 bytes)", "a".repeat(128)));
        let mut big = BytesMut::from(&(MAX_FRAME_LEN as u32 + 1).to_be_bytes()[..]);
        assert_eq!(next_frame(&mut big), Some(Frame::TooLarge(MAX_FRAME_LEN + 1)));
        assert!(big.is_empty());
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
                            Some(Inbound::Request(Request::PolicyCheck(c))) => prop_assert!(!c.item.key().is_empty() && !c.item.name().is_empty()),
                            Some(Inbound::Request(Request::MultiCheck(MultiCheckRequest { items, .. })) | Inbound::Request(Request::Refund(RefundRequest { items, .. }))) => {
                                prop_assert!((1..=MAX_POLICY_ITEMS).contains(&items.len()) && items.iter().all(|i| !i.key().is_empty() && !i.name().is_empty()))
                            }
                            Some(Inbound::Request(Request::Lease(c))) => prop_assert!(c.cost <= c.limit && !c.key.is_empty() && !c.lease.is_empty()),
                            Some(Inbound::Request(Request::PolicyLease(c))) => prop_assert!(!c.item.key().is_empty() && !c.item.name().is_empty() && !c.lease.is_empty() && c.item.scoped_key.len() == 1 + c.item.name().len() + c.item.key().len()),
                            Some(Inbound::Request(Request::Reserve(c))) => prop_assert!((1..=MAX_POLICY_ITEMS).contains(&c.items.len()) && c.items.iter().all(|i| !i.key().is_empty() && !i.name().is_empty() && i.cost >= 1 && i.cost <= MAX_O1_COST)),
                            Some(Inbound::Request(Request::Settle(c))) => prop_assert!((1..=MAX_POLICY_ITEMS).contains(&c.items.len()) && c.items.iter().all(|i| !i.key().is_empty() && !i.name().is_empty() && i.cost <= MAX_O1_COST)),
                            Some(Inbound::Request(Request::LeaseShare(c))) => prop_assert!(!c.item.key().is_empty() && !c.item.name().is_empty() && (1..=MAX_SHARE_UNITS).contains(&c.item.cost)),
                            Some(Inbound::Request(Request::InlineShare(c))) => prop_assert!(!c.key.is_empty() && (1..=MAX_SHARE_UNITS).contains(&c.cost)),
                            Some(Inbound::Request(Request::GiveBack(c))) => prop_assert!(!c.item.key().is_empty() && !c.item.name().is_empty() && (1..=MAX_GIVE_BACK_UNITS).contains(&c.item.cost)),
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
                        prop_assert_eq!((c.header.id, c.limit, c.window_ms, c.cost, &c.key[..]), (id, limit, window_ms, cost, &key[..]));
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

