//! One file per op: its request struct, its parse (the body after the
//! head, in the validation order of docs/PROTOCOL.md) and its encode.

pub mod check;
pub mod check_policy;
pub mod describe;
pub mod lease;
pub mod lease_share;
pub mod policy_lease;
pub mod refund;
pub mod settle;
