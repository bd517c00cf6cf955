//! The wire protocol between Nginx workers and the daemon (docs/PROTOCOL.md).
//!
//! Every frame is a 4-byte big-endian body length followed by the body. The
//! first six body bytes (version, op, request id) keep their place in every
//! protocol version, so an error can always echo the request id. All integers
//! are big-endian and unsigned, so LuaJIT can build and parse frames with
//! `string.char`/`string.byte` and the `bit` library alone.
//!
//! Frame -> request -> decision -> response -> frame, as mini-redis's
//! `cmd/`:
//! - `wire`: the vocabulary (fail policy, decision, source, error code) and
//!   the frame constants, each written once;
//! - `header`: what the ops share: `Header` (id, fail policy, local quota),
//!   `Bounds`, `Refused`, and the rules of a key, a fail policy, a local
//!   quota and a lease id;
//! - `item`: a policy item (name, key, cost), decoded and encoded;
//! - `op/`: one file per op, its struct, parse and encode (`check`,
//!   `check_policy`, `refund`, `settle` with the reserve, `lease`,
//!   `policy_lease`, `lease_share`, `describe` with its answer);
//! - `request`: the `Request` model and `parse_request`, which hands a
//!   body to its op;
//! - `frame`: the one framer (`next_frame`, `truncated`, `too_large`,
//!   `RequestCodec`);
//! - `response`: a response to bytes (daemon) and back (clients).

mod frame;
mod header;
mod item;
mod op;
mod request;
mod response;
mod wire;

pub use frame::{next_frame, too_large, truncated, Frame, RequestCodec};
pub use header::{Bounds, Header, Refused};
pub use item::{ItemArgs, PolicyItem};
pub use op::check::{encode_inline_give_back, encode_inline_share, encode_request, encode_request_with, CheckArgs, CheckRequest};
pub use op::check_policy::{encode_multi_request, encode_policy_request, MultiCheckRequest, PolicyCheckArgs, PolicyCheckRequest};
pub use op::describe::{encode_describe, encode_describe_uses, unknown_policy_response, DescribeRequest, PolicyDescription, PolicyUse, PolicyUses, FLAG_DESCRIBE_USES};
pub use op::lease::{encode_lease_request, LeaseArgs, LeaseRequest};
pub use op::lease_share::{encode_give_back, encode_lease_share};
pub use op::policy_lease::{encode_policy_lease_request, PolicyLeaseArgs, PolicyLeaseRequest};
pub use op::refund::{encode_refund, RefundRequest};
pub use op::settle::{encode_reserve, encode_settle, ReserveRequest, SettleRequest};
pub use request::{parse_request, Inbound, LoggedKey, Request};
pub use response::{decode_response, encode_response, Extension, ItemResult, Response, ResponseError};
pub use wire::{
    Algorithm, Decision, ErrorCode, FailPolicy, PolicyKind, Source, OP_DESCRIBE_POLICY, FLAG_REFUNDABLE, FLAG_SETTLE, MAX_O1_COST, OP_SETTLE, HANDLE_LEN, ITEM_RESULT_LEN, LEN_PREFIX, LIMIT_ENTRY_LEN, MAX_EXTENSION_LEN, MAX_FRAME_LEN, MAX_MESSAGE_LEN, MAX_POLICY_ITEMS,
    MAX_POLICY_NAME_LEN, OP_ACQUIRE, OP_CHECK, OP_CHECK_POLICY, OP_REFUND, OP_RELEASE, POLICY_HEADER_LEN, POLICY_ITEM_LEN, REFUND_HEADER_LEN, REQUEST_HEADER_LEN, RESPONSE_FIXED_LEN, VERSION,
    FLAG_RELEASE, OP_ACQUIRE_POLICY, POLICY_LEASE_HEADER_LEN, MAX_SHARE_UNITS, OP_LEASE_SHARE, FLAG_SHARE,
    FLAG_GIVE_BACK, FLAG_SHARE_GIVE_BACK, MAX_GIVE_BACK_UNITS,
};
