//! ratelimitd: a per-host daemon that answers "may this request pass?" for
//! Nginx workers over a Unix socket, with an exact sliding window in Redis.
//!
//! Modules, one concern each:
//! - `protocol`: frames, requests, responses, error codes (docs/PROTOCOL.md);
//! - `config`: the TOML configuration (docs/CONFIG.md);
//! - `limiter`: decisions and fail policies over a backend;
//! - `redis_window`, `memory`: the two exact sliding-window backends;
//! - `socket`, `server`, `daemon`: the listening socket, connections, `serve`;
//! - `client`, `bench`: the client side used by `query`, `bench` and tests.
#![forbid(unsafe_code)]

pub mod admin;
pub mod bench;
pub mod breaker;
pub mod client;
pub mod config;
pub mod daemon;
pub mod limiter;
pub mod memory;
pub mod metrics;
pub mod protocol;
pub mod redis_link;
pub mod redis_window;
pub mod sentinel;
pub mod server;
pub mod socket;
