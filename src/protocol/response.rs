//! Responses: the encoder the daemon answers with, and the decoder clients
//! read them with.

use std::borrow::Cow;

use bytes::{Buf, BufMut, BytesMut};

use super::wire::{be32, Decision, ErrorCode, Source, HANDLE_LEN, ITEM_RESULT_LEN, LEN_PREFIX, MAX_EXTENSION_LEN, MAX_MESSAGE_LEN, RESPONSE_FIXED_LEN, VERSION};

/// A response, as encoded by the daemon and decoded by clients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub id: u32,
    pub op: u8,
    pub decision: Decision,
    pub source: Source,
    pub count: u32,
    pub remaining: u32,
    pub retry_after_ms: u32,
    pub reset_ms: u32,
    pub error: ErrorCode,
    pub message: Cow<'static, str>,
    /// Per-item results and the refund handle: only in answers to a
    /// CHECK_POLICY of several items or with the refundable flag
    /// (docs/PROTOCOL.md, section 5b). Boxed: the single check's response
    /// stays small and allocates nothing.
    pub extension: Option<Box<Extension>>,
}

/// The response extension of a multi-item or refundable CHECK_POLICY.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Extension {
    /// 1-based index of the first item that refused the request (0: none).
    pub refused: u8,
    /// Present when the request asked for one and something may have been
    /// recorded in Redis.
    pub handle: Option<[u8; HANDLE_LEN]>,
    /// One per request item, in request order.
    pub items: Vec<ItemResult>,
}

/// One item's own verdict within a multi-item answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ItemResult {
    /// Allowed: this item had room (recorded if the request was admitted).
    /// Denied: this item refused. ShadowDenied: a shadow policy's refusal;
    /// ShadowAllowed: a shadow policy that had room (neither is ever shown).
    /// Denied with source none: not evaluated (another item's cached
    /// refusal decided).
    pub decision: Decision,
    pub source: Source,
    pub count: u32,
    pub remaining: u32,
    pub retry_after_ms: u32,
    pub reset_ms: u32,
    /// The key's limit under the policy (0: exempt or not resolved).
    pub limit: u32,
    pub window_ms: u32,
}

impl ItemResult {
    pub const NOT_EVALUATED: Self = Self { decision: Decision::Denied, source: Source::None, count: 0, remaining: 0, retry_after_ms: 0, reset_ms: 0, limit: 0, window_ms: 0 };
}

impl Response {
    /// A response for a request that was not decided at all.
    pub fn error(id: u32, op: u8, code: ErrorCode, message: Cow<'static, str>) -> Self {
        Self {
            id,
            op,
            decision: Decision::Error,
            source: Source::None,
            count: 0,
            remaining: 0,
            retry_after_ms: 0,
            reset_ms: 0,
            error: code,
            message,
            extension: None,
        }
    }
}

/// Appends one response frame to `dst`.
pub fn encode_response(r: &Response, dst: &mut BytesMut) {
    let msg = truncate_utf8(&r.message, MAX_MESSAGE_LEN);
    let ext_len = r.extension.as_deref().map_or(0, Extension::encoded_len);
    dst.reserve(LEN_PREFIX + RESPONSE_FIXED_LEN + msg.len() + ext_len);
    dst.put_u32((RESPONSE_FIXED_LEN + msg.len() + ext_len) as u32);
    dst.put_u8(VERSION);
    dst.put_u8(r.op);
    dst.put_u32(r.id);
    dst.put_u8(r.decision.to_wire());
    dst.put_u8(r.source.to_wire());
    dst.put_u32(r.count);
    dst.put_u32(r.remaining);
    dst.put_u32(r.retry_after_ms);
    dst.put_u32(r.reset_ms);
    dst.put_u16(r.error as u16);
    dst.put_u16(msg.len() as u16);
    dst.put_slice(msg.as_bytes());
    if let Some(e) = r.extension.as_deref() {
        e.put(dst);
    }
}

impl Extension {
    fn encoded_len(&self) -> usize {
        3 + self.handle.map_or(0, |h| h.len()) + self.items.len() * ITEM_RESULT_LEN
    }

    fn put(&self, dst: &mut BytesMut) {
        dst.put_u8(self.items.len() as u8);
        dst.put_u8(self.refused);
        match &self.handle {
            Some(h) => {
                dst.put_u8(h.len() as u8);
                dst.put_slice(h);
            }
            None => dst.put_u8(0),
        }
        for i in &self.items {
            dst.put_u8(i.decision.to_wire());
            dst.put_u8(i.source.to_wire());
            for v in [i.count, i.remaining, i.retry_after_ms, i.reset_ms, i.limit, i.window_ms] {
                dst.put_u32(v);
            }
        }
    }

    fn parse(b: &[u8]) -> Result<Self, ResponseError> {
        let bad = ResponseError::Malformed("bad extension");
        if b.len() < 3 {
            return Err(bad);
        }
        let (n, refused, handle_len) = (b[0] as usize, b[1], b[2] as usize);
        if (handle_len != 0 && handle_len != HANDLE_LEN) || b.len() != 3 + handle_len + n * ITEM_RESULT_LEN {
            return Err(bad);
        }
        let handle = (handle_len == HANDLE_LEN).then(|| {
            let mut h = [0u8; HANDLE_LEN];
            h.copy_from_slice(&b[3..3 + HANDLE_LEN]);
            h
        });
        let mut items = Vec::with_capacity(n);
        for c in b[3 + handle_len..].chunks_exact(ITEM_RESULT_LEN) {
            items.push(ItemResult {
                decision: Decision::from_wire(c[0]).ok_or(ResponseError::Malformed("unknown item decision"))?,
                source: Source::from_wire(c[1]).ok_or(ResponseError::Malformed("unknown item source"))?,
                count: be32(c, 2),
                remaining: be32(c, 6),
                retry_after_ms: be32(c, 10),
                reset_ms: be32(c, 14),
                limit: be32(c, 18),
                window_ms: be32(c, 22),
            });
        }
        Ok(Self { refused, handle, items })
    }
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Why a response frame could not be decoded (client side).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ResponseError {
    #[error("response frame of {0} bytes is too large")]
    TooLarge(usize),
    #[error("response body is malformed: {0}")]
    Malformed(&'static str),
}

/// Decodes one response frame from `src` if it holds a whole one.
pub fn decode_response(src: &mut BytesMut) -> Result<Option<Response>, ResponseError> {
    if src.len() < LEN_PREFIX {
        return Ok(None);
    }
    let len = be32(src, 0) as usize;
    if len > RESPONSE_FIXED_LEN + MAX_MESSAGE_LEN + MAX_EXTENSION_LEN {
        return Err(ResponseError::TooLarge(len));
    }
    if src.len() < LEN_PREFIX + len {
        return Ok(None);
    }
    src.advance(LEN_PREFIX);
    let b = src.split_to(len);
    if len < RESPONSE_FIXED_LEN {
        return Err(ResponseError::Malformed("shorter than the fixed fields"));
    }
    if b[0] != VERSION {
        return Err(ResponseError::Malformed("unknown version"));
    }
    let decision = Decision::from_wire(b[6]).ok_or(ResponseError::Malformed("unknown decision"))?;
    let source = Source::from_wire(b[7]).ok_or(ResponseError::Malformed("unknown source"))?;
    let error = ErrorCode::from_wire(u16::from_be_bytes([b[24], b[25]])).ok_or(ResponseError::Malformed("unknown error code"))?;
    let msg_len = u16::from_be_bytes([b[26], b[27]]) as usize;
    if RESPONSE_FIXED_LEN + msg_len > len {
        return Err(ResponseError::Malformed("message length does not match the frame"));
    }
    let msg_end = RESPONSE_FIXED_LEN + msg_len;
    let message = String::from_utf8_lossy(&b[RESPONSE_FIXED_LEN..msg_end]).into_owned();
    // Bytes after the message: the extension of section 5b.
    let extension = if msg_end < len { Some(Box::new(Extension::parse(&b[msg_end..])?)) } else { None };
    Ok(Some(Response {
        id: be32(&b, 2),
        op: b[1],
        decision,
        source,
        count: be32(&b, 8),
        remaining: be32(&b, 12),
        retry_after_ms: be32(&b, 16),
        reset_ms: be32(&b, 20),
        error,
        message: Cow::Owned(message),
        extension,
    }))
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::wire::OP_CHECK;

    #[test]
    fn response_round_trip_matches_documented_hex() {
        let r = Response {
            id: 7,
            op: OP_CHECK,
            decision: Decision::Denied,
            source: Source::Redis,
            count: 1000,
            remaining: 0,
            retry_after_ms: 250,
            reset_ms: 999,
            error: ErrorCode::None,
            message: Cow::Borrowed(""),
            extension: None,
        };
        let mut buf = BytesMut::new();
        encode_response(&r, &mut buf);
        let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "0000001c0101000000070100000003e800000000000000fa000003e700000000");
        assert_eq!(decode_response(&mut buf).unwrap().unwrap(), r);
        assert!(buf.is_empty());
    }

    #[test]
    fn extension_round_trip_matches_documented_hex() {
        let item = |decision, count, remaining, retry_after_ms| ItemResult { decision, source: Source::Redis, count, remaining, retry_after_ms, reset_ms: 1000, limit: 2, window_ms: 1000 };
        let r = Response {
            id: 7,
            op: crate::protocol::wire::OP_CHECK_POLICY,
            decision: Decision::Denied,
            source: Source::Redis,
            count: 2,
            remaining: 0,
            retry_after_ms: 400,
            reset_ms: 1000,
            error: ErrorCode::None,
            message: Cow::Borrowed(""),
            extension: Some(Box::new(Extension { refused: 2, handle: None, items: vec![item(Decision::Allowed, 1, 9, 0), item(Decision::Denied, 2, 0, 400)] })),
        };
        let mut buf = BytesMut::new();
        encode_response(&r, &mut buf);
        let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
        // The same bytes are shown in docs/PROTOCOL.md, section 5b.
        assert_eq!(
            hex,
            "000000530102000000070100000000020000000000000190000003e8000000000202000000000000010000000900000000000003e800000002000003e80100000000020000000000000190000003e800000002000003e8"
        );
        assert_eq!(decode_response(&mut buf).unwrap().unwrap(), r);
        let with_handle = Response { extension: Some(Box::new(Extension { refused: 0, handle: Some([9; HANDLE_LEN]), items: vec![item(Decision::Allowed, 1, 1, 0)] })), ..r };
        encode_response(&with_handle, &mut buf);
        assert_eq!(decode_response(&mut buf).unwrap().unwrap(), with_handle);
    }

    #[test]
    fn long_messages_are_cut_at_a_char_boundary() {
        let msg = "é".repeat(MAX_MESSAGE_LEN);
        let r = Response::error(1, OP_CHECK, ErrorCode::Malformed, Cow::Owned(msg));
        let mut buf = BytesMut::new();
        encode_response(&r, &mut buf);
        let back = decode_response(&mut buf).unwrap().unwrap();
        assert_eq!(back.message.len(), MAX_MESSAGE_LEN);
    }
}
