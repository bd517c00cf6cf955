//! The admin API: HTTP/JSON on a listener of its own (`[admin] listen`, a
//! Unix socket by default; TCP only with a bearer token), to peek at a
//! policy's key without recording anything, reset it, and set, list and
//! delete overrides with an expiry that every daemon sharing the Redis
//! applies (`store`). docs/ADMIN.md is the reference. `client` is the
//! command line's side (`ratelimitd inspect|reset|override`).

pub mod bans;
pub mod changes;
pub mod client;
mod server;
pub mod store;
pub mod time;
pub mod tls;

pub use server::{bind, serve, AdminListener, BindError, View};
