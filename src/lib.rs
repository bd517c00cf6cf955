//! ratelimitd: a per-host daemon that answers "may this request pass?" for
//! Nginx workers over a Unix socket, with an exact sliding window in Redis.
//!
//! Layout, from the bottom up; a module imports only from the rows above
//! its own (tests/layout.rs fails on a cycle or an upward import):
//!
//! | layer | module | concern |
//! |---|---|---|
//! | utilities | `log_limit` | bounded logging: one line per interval, with the count held back; the libraries' `log` lines under the same rule |
//! | utilities | `terminal` | client-chosen text escaped for a terminal: controls and bidi overrides shown, never obeyed |
//! | utilities | `park` | a background task that parks when it has nothing to do and is woken by the work: an idle daemon has no timer firing |
//! | utilities | `spin` | `server.spin_us`: the worker polls its sockets instead of sleeping for a while after frames, at low load only (off by default) |
//! | clocks | `use_clock` | the policies' coarse "last used" clock, read as an atomic; it stops while nobody reads it |
//! | vocabulary | `window` | what a store is asked and answers: `LimitSpec`, `Verdict`, `StoreError` |
//! | vocabulary | `protocol` | the wire: `wire` (enums and constants, written once), `header` (the fields and rules every op shares), `item` (a policy item), one file per op under `op`: `check`, `check_policy`, `refund`, `settle`, `lease`, `policy_lease`, `lease_share`, `describe`; `request` (the model, dispatch by op), `frame` (the one framer), `response` |
//! | client side | `client` | one connection to the daemon, as `query`, `bench` and the tests use it |
//! | counters | `metrics` | lock-free counters and their Prometheus text |
//! | counters | `top_refused` | the keys refused most in the last minute: sharded space-saving summaries, rotated every 10 s |
//! | settings | `config` | the file's schema (`file`), typed values (`model`) and pure validation (`validate`); `preflight` for secrets, TLS files, the group; `reserve` (which policies a reserve names), `nginx_names` (`check-config --nginx`), `show` (the configuration in force as TOML: `GET /config`, `config-show`), `envoy` (`[envoy]`'s YAML files and routes read into policies), `descriptors` (Envoy's descriptors matched as envoyproxy/ratelimit matches them) |
//! | refusals | `denial_cache` | recent refusals by Redis, answered again without a Redis call until Redis could admit; told by the store of what it removes |
//! | refusals | `penalty_box` | the penalty box's bans this daemon knows: Redis's cached until their end, the memory backend's own, lifted by the admin API |
//! | stores | `local_store` | the per-host exact windows (local backend and `local` fail policy) |
//! | stores | `redis` | `connector`, `sentinel`, `link` (shared connection, `eval`; `breaker`, `admission`: the breaker and the in-flight limit), `keys` (window keys, slots, replies), `window` (a script per algorithm), `scripts` (their text, assembled at build time from src/redis/scripts/), `multi` (all-or-nothing items, reservations across Cluster slots, refunds), `coalesce` (calls in flight per window; cold keys batched across keys), `shard` (hot-key shard keys) |
//! | retries | `settle_retry` | settles and reserve take-backs that met a Redis failure, retried in the background until Redis answers or their record's life ends |
//! | store interface | `window_store` | the one store interface the pipeline asks (check, check several, the penalty box's check, concurrency leases, refunds) with one Redis, a Cluster or the per-host windows behind it: the only module that knows which |
//! | policies | `policies`, `live_overrides` | the configured `[[policy]]` tables by name, overrides, per-policy counters; the admin API's overrides in force |
//! | decisions | `decision` | the one pipeline (state in `limiter`): `resolve` every item, `plan` its windows (shards), `execute` through the cache `layers` (a quota `lease`, the denial cache) to the `store`, with one `fail` policy function, the `penalty` box's step, `multi` items all or nothing, reserves to `settle`, `respond` and `count` once |
//! | live view | `top_snapshot` | the document of `GET /top.json`: counters, policies, top refused keys |
//! | serving | `socket`, `server`, `metrics_server` | the socket file, one `Handler` per connection, `GET /metrics` and `/top.json` |
//! | Envoy front | `envoy` | the Envoy rate limit service (gRPC): descriptors planned to policy items (`plan`), decided by the one pipeline as the socket's frames (`service`), answered as Envoy reads them (`reply`); Envoy's generated types (`pb`) |
//! | operations | `admin` | a key's windows in Redis: inspect, reset |
//! | admin service | `admin_api` | the admin API: listener and routes (`server`), overrides in Redis and their refresh (`store`), the fleet's change log of overrides and lifts (`changes`), the penalty box's bans (`bans`), its `client`, `tls`, RFC 3339 `time` |
//! | edges | `daemon`, `bench`, `top` | `serve` wiring and reloads; the load generator; `ratelimitd top` |
//! | command line | `cli` | the binary's (`main.rs`'s `mod cli`, over this library): one file per command, `serve` (+ `logging`), what they share (`common`), `check_config`, `config_show`, `query`, `keys` (inspect, reset), `overrides`, `bans`, `top`, `bench`; the admin API as they call it (`admin`) |
//!
//! `main.rs` and `cli/` are the command line over this library. Modules are private
//! unless the command line or the integration tests use them.
#![forbid(unsafe_code)]

pub mod admin;
pub mod admin_api;
pub mod bench;
pub mod client;
pub mod config;
pub mod daemon;
mod decision;
mod denial_cache;
mod envoy;
mod live_overrides;
mod local_store;
pub mod log_limit;
mod metrics;
mod metrics_server;
mod park;
mod penalty_box;
mod policies;
pub mod protocol;
mod redis;
mod server;
mod settle_retry;
mod socket;
mod spin;
mod window_store;
pub mod terminal;
pub mod top;
mod top_refused;
mod use_clock;
pub mod top_snapshot;
pub mod window;

pub use crate::decision::{lease_life_ms, leasable, reserved_life_ms, QuotaLease, WorkerShare, MAX_LEASE_UNITS, MAX_SHARE_MS};
pub use crate::redis::{BatchAsk, LeaseGrant, RedisWindow};
