//! The wire protocol between Nginx workers and the daemon (docs/PROTOCOL.md).
//!
//! Every frame is a 4-byte big-endian body length followed by the body. The
//! first six body bytes (version, op, request id) keep their place in every
//! protocol version, so an error can always echo the request id. All integers
//! are big-endian and unsigned, so LuaJIT can build and parse frames with
//! `string.char`/`string.byte` and the `bit` library alone.
//!
//! - `wire`: the vocabulary (fail policy, decision, source, error code) and
//!   the frame constants, each written once;
//! - `request`: bytes to a validated request (daemon) and back (clients);
//! - `response`: a response to bytes (daemon) and back (clients);
//! - `describe`: the answer to DESCRIBE_POLICY (op 8; its request is in `request`).

mod describe;
mod request;
mod response;
mod wire;

pub use request::{
    encode_describe, encode_describe_uses, DescribeRequest, PolicyUse, PolicyUses, FLAG_DESCRIBE_USES, encode_lease_request, encode_multi_request, encode_policy_request, encode_refund, encode_request, encode_reserve, encode_settle, SettleRequest, encode_request_with, parse_request, Bounds, CheckArgs, CheckRequest, Inbound, ItemArgs, LeaseArgs,
    LeaseRequest, MultiCheckRequest, PolicyCheckArgs, PolicyCheckRequest, PolicyItem, PolicyLeaseArgs, PolicyLeaseRequest, encode_policy_lease_request, encode_lease_share, encode_inline_share, encode_give_back, encode_inline_give_back, ReserveRequest, RefundRequest, Request, RequestCodec,
};
pub use describe::{unknown_policy_response, PolicyDescription};
pub use response::{decode_response, encode_response, Extension, ItemResult, Response, ResponseError};
pub use wire::{
    Algorithm, Decision, ErrorCode, FailPolicy, PolicyKind, Source, OP_DESCRIBE_POLICY, FLAG_REFUNDABLE, FLAG_SETTLE, MAX_O1_COST, OP_SETTLE, HANDLE_LEN, ITEM_RESULT_LEN, LEN_PREFIX, LIMIT_ENTRY_LEN, MAX_EXTENSION_LEN, MAX_FRAME_LEN, MAX_MESSAGE_LEN, MAX_POLICY_ITEMS,
    MAX_POLICY_NAME_LEN, OP_ACQUIRE, OP_CHECK, OP_CHECK_POLICY, OP_REFUND, OP_RELEASE, POLICY_HEADER_LEN, POLICY_ITEM_LEN, REFUND_HEADER_LEN, REQUEST_HEADER_LEN, RESPONSE_FIXED_LEN, VERSION,
    FLAG_RELEASE, OP_ACQUIRE_POLICY, POLICY_LEASE_HEADER_LEN, MAX_SHARE_UNITS, OP_LEASE_SHARE, FLAG_SHARE,
    FLAG_GIVE_BACK, FLAG_SHARE_GIVE_BACK, MAX_GIVE_BACK_UNITS,
};
