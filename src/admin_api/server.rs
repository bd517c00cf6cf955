//! The admin API's listener and routes (docs/ADMIN.md).
//!
//! Scopes: with `token_file` or `read_token_file` set, every request needs
//! `Authorization: Bearer <token>`; the write token may do everything, the
//! read token only GETs. Without tokens (a Unix socket only), whoever can
//! open the socket (its mode, 0600 by default) has the write scope. Token
//! files are read at each request, so a rotated token applies at once.
//!
//! Every write is logged at info (who, what, before, after) and every
//! request counted (`ratelimitd_admin_requests_total`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use redis::AsyncCommands;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::bans;
use super::changes::{self, Kind, NotLogged, Written};
use super::store::{self, Stored, MAX_OVERRIDES};
use super::time::{format_utc, parse_utc};
use crate::admin::{self, AdminError, Inspection, Target};
use crate::config::{parse_duration, sendable_key, AdminListen, AdminTls, Config, PolicyConfig, PolicyLimit, RedisSecrets};
use crate::log_limit::RateLimitedLog;
use crate::redis::LinkConnection;
use crate::live_overrides::{scoped_key, split_scoped, LiveOverride, LiveOverrides};
use crate::server::Reloadable;
use crate::metrics::{AdminOp, AdminResult, METRICS};
use crate::policies::shard_limit;
use crate::socket::{BoundSocket, SocketError};
use crate::terminal::escape_bytes;

/// Largest request body (an override is a few hundred bytes).
const MAX_BODY: usize = 64 * 1024;
/// Longest an override may last.
const MAX_OVERRIDE_MS: u64 = 366 * 86_400_000;

/// What the API works with: the configuration in force (replaced on reload)
/// and its Redis secrets.
pub struct View {
    pub config: Config,
    pub secrets: RedisSecrets,
}

/// A bound admin listener.
pub enum AdminListener {
    /// `file` removes the socket file on drop, if it is still the one bound.
    Unix { listener: tokio::net::UnixListener, file: BoundSocket },
    /// With `tls`, every connection is a TLS one (handshake in its task).
    Tcp { listener: tokio::net::TcpListener, tls: Option<tokio_rustls::TlsAcceptor> },
}

/// Why the admin listener could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error(transparent)]
    Tls(#[from] super::tls::TlsFileError),
    #[error("{addr}: {err}")]
    Tcp { addr: std::net::SocketAddr, err: std::io::Error },
}

/// Binds `listen`: a socket file of its mode, with the request socket's
/// checks (a live one is refused, a stale one replaced, never another
/// process's removed), or a TCP address, with `tls` when given (its files
/// read now).
pub async fn bind(listen: &AdminListen, tls: Option<&AdminTls>) -> Result<AdminListener, BindError> {
    match listen {
        AdminListen::Unix { path, mode } => {
            let mut file = BoundSocket::bind(path, *mode, None)?;
            let listener = file.take_listener().expect("a fresh socket has its listener");
            Ok(AdminListener::Unix { listener, file })
        }
        AdminListen::Tcp(addr) => {
            let tls = match tls {
                Some(t) => Some(tokio_rustls::TlsAcceptor::from(super::tls::server_config(t)?)),
                None => None,
            };
            let listener = tokio::net::TcpListener::bind(addr).await.map_err(|err| BindError::Tcp { addr: *addr, err })?;
            Ok(AdminListener::Tcp { listener, tls })
        }
    }
}

struct State {
    view: watch::Receiver<Arc<View>>,
    live: Arc<LiveOverrides>,
    /// The decision engine in force, whose cache layers an admin write
    /// tells of what it changed before the write is answered.
    reloadable: watch::Receiver<Reloadable>,
}

/// The admin listener's share of the process's descriptors: it never holds
/// more than this fraction of RLIMIT_NOFILE, so the data plane (nginx
/// workers' connections, Redis) keeps the rest whatever admin peers do.
const DESCRIPTOR_SHARE: u64 = 4;

/// How many connections the admin listener may hold now: `[admin]
/// max_connections`, and at most a quarter of the descriptor limit (read
/// at each accept: an admin connection is rare, and a limit raised with
/// prlimit applies at once).
fn connection_cap(max_connections: usize) -> usize {
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) => max_connections.min(usize::try_from(soft / DESCRIPTOR_SHARE).unwrap_or(usize::MAX)).max(1),
        Err(_) => max_connections,
    }
}

/// The admin connections open now; the slot is given back on drop.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(open: &Arc<AtomicUsize>, cap: usize) -> Option<Self> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1)).ok()?;
        METRICS.admin_connection_opened();
        Some(Self(open.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        METRICS.admin_connection_closed();
    }
}

/// A connection may last at most this many read timeouts in all (head,
/// body, the handler's Redis calls and writing the answer): a backstop for
/// a peer that reads the answer slowly.
const LIFETIME_READ_TIMEOUTS: u32 = 6;

/// Serves the API on `listener` until `shutdown`.
pub async fn serve(listener: AdminListener, view: watch::Receiver<Arc<View>>, live: Arc<LiveOverrides>, reloadable: watch::Receiver<Reloadable>, shutdown: CancellationToken) {
    let state = Arc::new(State { view, live, reloadable });
    let open = Arc::new(AtomicUsize::new(0));
    let refused_log = RateLimitedLog::new(Duration::from_secs(1));
    let accept_log = RateLimitedLog::new(Duration::from_secs(1));
    loop {
        let accepted: std::io::Result<(Box<dyn Stream>, String)> = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = accept(&listener) => r,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors (EMFILE) comes back at once: one line a
                // second, not one per try.
                if let Some(suppressed) = accept_log.permit() {
                    tracing::warn!(error = %e, suppressed, "admin accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (max_connections, read_timeout) = {
            let view = state.view.borrow();
            (view.config.admin.max_connections, view.config.admin.read_timeout)
        };
        let cap = connection_cap(max_connections);
        // Over the cap the connection is closed at once (its descriptor
        // given back), not left in the accept queue: a flood of idle peers
        // then holds `cap` descriptors at most, and is counted and logged.
        let Some(slot) = Slot::take(&open, cap) else {
            METRICS.admin_connection_refused();
            if let Some(suppressed) = refused_log.permit() {
                tracing::warn!(peer, cap, max_connections, suppressed, "admin connection refused: the admin listener holds its cap of connections (admin.max_connections, at most a quarter of RLIMIT_NOFILE)");
            }
            continue;
        };
        let state = state.clone();
        let tls = match &listener {
            AdminListener::Tcp { tls, .. } => tls.clone(),
            AdminListener::Unix { .. } => None,
        };
        tokio::spawn(async move {
            let _slot = slot;
            let lifetime = read_timeout * LIFETIME_READ_TIMEOUTS;
            if tokio::time::timeout(lifetime, connection(state, stream, peer.clone(), tls, read_timeout)).await.is_err() {
                tracing::debug!(peer, lifetime_ms = lifetime.as_millis() as u64, "admin connection closed at the end of its lifetime");
            }
        });
    }
}

/// One admin connection: its TLS handshake, then one request (no
/// keep-alive: an idle connection holds no slot), each phase bounded by
/// `read_timeout`.
async fn connection(state: Arc<State>, stream: Box<dyn Stream>, peer: String, tls: Option<tokio_rustls::TlsAcceptor>, read_timeout: Duration) {
    // The handshake here, not in the accept loop: a slow or silent peer
    // holds only its own task, for `read_timeout` at most.
    let stream: Box<dyn Stream> = match tls {
        None => stream,
        Some(acceptor) => match tokio::time::timeout(read_timeout, acceptor.accept(stream)).await {
            Ok(Ok(s)) => Box::new(s),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, peer, "admin TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(peer, "admin TLS handshake timed out");
                return;
            }
        },
    };
    let service = service_fn(move |req| {
        let state = state.clone();
        let peer = peer.clone();
        async move { Ok::<_, std::convert::Infallible>(handle(&state, &peer, req, read_timeout).await) }
    });
    let conn = http1::Builder::new().timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(read_timeout).keep_alive(false).serve_connection(TokioIo::new(stream), service);
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "admin connection ended");
    }
}

trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}

/// A connection and who is at the other end (for the audit log).
async fn accept(listener: &AdminListener) -> std::io::Result<(Box<dyn Stream>, String)> {
    match listener {
        AdminListener::Unix { listener, .. } => {
            let (s, _) = listener.accept().await?;
            let peer = s.peer_cred().map(|c| format!("uid:{}/pid:{}", c.uid(), c.pid().unwrap_or(0))).unwrap_or_else(|_| "unix-peer".into());
            Ok((Box::new(s), peer))
        }
        AdminListener::Tcp { listener, .. } => {
            let (s, addr) = listener.accept().await?;
            Ok((Box::new(s), addr.to_string()))
        }
    }
}

/// An answer: status and JSON body.
struct Answer {
    status: StatusCode,
    body: Value,
    result: AdminResult,
}

impl Answer {
    fn ok(body: Value) -> Self {
        Self { status: StatusCode::OK, body, result: AdminResult::Done }
    }

    fn err(status: StatusCode, message: impl Into<String>) -> Self {
        let result = match status {
            StatusCode::UNAUTHORIZED => AdminResult::Unauthorized,
            StatusCode::FORBIDDEN => AdminResult::Forbidden,
            s if s.is_server_error() => AdminResult::Failed,
            _ => AdminResult::Rejected,
        };
        Self { status, body: json!({ "error": message.into() }), result }
    }

    fn redis(e: impl std::fmt::Display) -> Self {
        Self::err(StatusCode::SERVICE_UNAVAILABLE, format!("redis: {e}"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Read,
    Write,
}

/// The caller's scope, or why it has none.
fn scope(cfg: &Config, req: &Request<hyper::body::Incoming>) -> Result<Scope, Answer> {
    let admin = &cfg.admin;
    if admin.token_file.is_none() && admin.read_token_file.is_none() {
        return Ok(Scope::Write); // a Unix socket without tokens: its mode decides
    }
    let sent = req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
    let Some(sent) = sent.filter(|s| !s.is_empty()) else {
        return Err(Answer::err(StatusCode::UNAUTHORIZED, "this admin API needs 'Authorization: Bearer <token>'"));
    };
    let matches = |file: &Option<PathBuf>| {
        file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()).map(|t| t.trim().to_string()).is_some_and(|t| !t.is_empty() && same(t.as_bytes(), sent.as_bytes()))
    };
    if matches(&admin.token_file) {
        Ok(Scope::Write)
    } else if matches(&admin.read_token_file) {
        Ok(Scope::Read)
    } else {
        Err(Answer::err(StatusCode::UNAUTHORIZED, "wrong token"))
    }
}

/// Compares in time that depends on the lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The decoded query parameters (the last of a repeated name wins).
fn query(req: &Request<hyper::body::Incoming>) -> Result<HashMap<String, String>, Answer> {
    let mut out = HashMap::new();
    for pair in req.uri().query().unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (k, v) = (percent_decode(k)?, percent_decode(v)?);
        out.insert(k, v);
    }
    Ok(out)
}

fn percent_decode(s: &str) -> Result<String, Answer> {
    let bad = || Answer::err(StatusCode::BAD_REQUEST, "the query is not valid percent-encoded UTF-8");
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = s.get(i + 1..i + 3).ok_or_else(bad)?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

async fn handle(state: &State, peer: &str, req: Request<hyper::body::Incoming>, read_timeout: Duration) -> Response<Full<Bytes>> {
    let view = state.view.borrow().clone();
    let op = match (req.method(), req.uri().path()) {
        (&Method::GET, "/v1/keys") => Some(AdminOp::Peek),
        (&Method::DELETE, "/v1/keys") => Some(AdminOp::Reset),
        (&Method::GET, "/v1/overrides") => Some(AdminOp::OverrideList),
        (&Method::PUT, "/v1/overrides") => Some(AdminOp::OverrideSet),
        (&Method::DELETE, "/v1/overrides") => Some(AdminOp::OverrideDelete),
        (&Method::GET, "/v1/bans") => Some(AdminOp::BanList),
        (&Method::DELETE, "/v1/bans") => Some(AdminOp::BanLift),
        _ => None,
    };
    let answer = match op {
        None => Answer::err(StatusCode::NOT_FOUND, "no such endpoint: GET|DELETE /v1/keys, GET|PUT|DELETE /v1/overrides, GET|DELETE /v1/bans (docs/ADMIN.md)"),
        Some(op) => {
            let answer = match scope(&view.config, &req) {
                Err(a) => a,
                Ok(Scope::Read) if !matches!(op, AdminOp::Peek | AdminOp::OverrideList | AdminOp::BanList) => Answer::err(StatusCode::FORBIDDEN, "this token has the read scope only"),
                Ok(scope) => {
                    // One word (no spaces): the peer and how it was let in.
                    let how = if view.config.admin.token_file.is_none() && view.config.admin.read_token_file.is_none() { "socket" } else if scope == Scope::Write { "write-token" } else { "read-token" };
                    let who = format!("{peer}/{how}");
                    route(state, &view, op, &who, req, read_timeout).await
                }
            };
            METRICS.admin_request(op, answer.result);
            answer
        }
    };
    let body = serde_json::to_vec_pretty(&answer.body).expect("plain data serializes");
    Response::builder().status(answer.status).header("content-type", "application/json").body(Full::new(Bytes::from(body))).expect("static response parts")
}

async fn route(state: &State, view: &View, op: AdminOp, who: &str, req: Request<hyper::body::Incoming>, read_timeout: Duration) -> Answer {
    let q = match query(&req) {
        Ok(q) => q,
        Err(a) => return a,
    };
    let result = match op {
        AdminOp::Peek => peek(state, view, &q).await,
        AdminOp::Reset => reset(state, view, &q, who).await,
        AdminOp::OverrideList => list(view, &q).await,
        // The whole body within one read timeout: a peer that sends it a
        // byte at a time holds its slot no longer than one that sends none.
        AdminOp::OverrideSet => match tokio::time::timeout(read_timeout, Limited::new(req.into_body(), MAX_BODY).collect()).await {
            Ok(Ok(body)) => set(state, view, &body.to_bytes(), who).await,
            Ok(Err(_)) => Err(Answer::err(StatusCode::PAYLOAD_TOO_LARGE, format!("the body is larger than {MAX_BODY} bytes, or was cut"))),
            Err(_) => Err(Answer::err(StatusCode::REQUEST_TIMEOUT, format!("the body did not arrive within admin.read_timeout ({} ms)", read_timeout.as_millis()))),
        },
        AdminOp::OverrideDelete => delete(state, view, &q, who).await,
        AdminOp::BanList => ban_list(view, &q).await,
        AdminOp::BanLift => ban_lift(view, &q, who).await,
    };
    result.unwrap_or_else(|a| a)
}

/// How long a write whose change-log entry failed keeps trying to log it,
/// on fresh connections, before it answers 503: a Cluster failover's
/// election or a Sentinel switch takes about this long.
const LOG_RETRY: Duration = Duration::from_secs(5);

/// `written`'s outcome (made on `conn`), with its log entry retried when
/// only that failed: 200 only once the change is in Redis, logged for every
/// daemon and acknowledged as on the current master (`changes::acknowledge`);
/// a 503 says how far it got.
async fn logged<T>(view: &View, conn: &mut LinkConnection, kind: Kind, scoped: &[u8], written: Result<Written<T>, redis::RedisError>) -> Result<T, Answer> {
    let redis = redis_of(view)?;
    let Written { done, logged } = written.map_err(|e| Answer::err(StatusCode::SERVICE_UNAVAILABLE, format!("redis: {e} (nothing was changed, or the retry of this request will find it done)")))?;
    let mut last = match logged {
        Ok(()) => return acknowledged(view, conn, done).await,
        Err(e) => e,
    };
    tracing::warn!(error = %last, "an admin write is in redis but not yet in the change log: retrying the log");
    let start = std::time::Instant::now();
    while start.elapsed() < LOG_RETRY {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut conn = match admin::connect(redis, &view.secrets).await {
            Ok(c) => c,
            Err(AdminError::Redis(e)) => {
                last = e;
                continue;
            }
            Err(e) => return Err(Answer::redis(e)),
        };
        match changes::append(&mut conn, &redis.key_prefix, kind, scoped).await {
            Ok(_) => return acknowledged(view, &mut conn, done).await,
            Err(e) => last = e,
        }
    }
    Err(Answer::err(StatusCode::SERVICE_UNAVAILABLE, NotLogged(last).to_string()))
}

/// `done`, once `changes::acknowledge` holds for the write made on `conn`.
async fn acknowledged<T>(view: &View, conn: &mut LinkConnection, done: T) -> Result<T, Answer> {
    let redis = redis_of(view)?;
    match changes::acknowledge(conn, redis, &view.secrets).await {
        Ok(()) => Ok(done),
        Err(e) => Err(Answer::err(StatusCode::SERVICE_UNAVAILABLE, format!("the change was written but is not acknowledged: {e}"))),
    }
}

/// The Redis configuration, or why there is none.
fn redis_of(view: &View) -> Result<&crate::config::RedisConfig, Answer> {
    view.config.redis.as_ref().ok_or_else(|| Answer::err(StatusCode::CONFLICT, "this daemon has no [redis]: its windows are in memory and overrides need Redis"))
}

/// The policy named `name`, or a 404 listing the known ones.
fn policy<'a>(cfg: &'a Config, name: &str) -> Result<&'a PolicyConfig, Answer> {
    cfg.policies.iter().find(|p| p.name == name).ok_or_else(|| {
        let known: Vec<&str> = cfg.policies.iter().map(|p| p.name.as_str()).collect();
        Answer::err(StatusCode::NOT_FOUND, format!("no [[policy]] named {:?} in the configuration (known: {})", name, if known.is_empty() { "none".into() } else { known.join(", ") }))
    })
}

/// A key the daemon could be sent (`sendable_key`).
fn checked_key<'a>(cfg: &Config, q: &'a HashMap<String, String>) -> Result<&'a str, Answer> {
    let key = q.get("key").ok_or_else(|| Answer::err(StatusCode::BAD_REQUEST, "missing parameter 'key'"))?;
    key_ok(cfg, key)?;
    Ok(key)
}

fn key_ok(cfg: &Config, key: &str) -> Result<(), Answer> {
    // check-config's rule, not a copy: a key no request can carry is never stored.
    sendable_key(key.as_bytes(), cfg.limits.bounds.max_key_len).map_err(|e| Answer::err(StatusCode::BAD_REQUEST, format!("{e}: no request can name it")))
}

/// The limit a policy's key has now on this daemon, and where it comes from.
fn limit_now(state: &State, p: &PolicyConfig, key: &str) -> (PolicyLimit, &'static str) {
    if let Some(l) = state.live.limit_for(&scoped_key(&p.name, key.as_bytes())) {
        return (l, "api_override");
    }
    match p.overrides.get(key) {
        Some(&l) => (l, "file_override"),
        None => (PolicyLimit::Limit(p.rule.limit), "policy"),
    }
}

fn limit_json(l: PolicyLimit) -> Value {
    match l {
        PolicyLimit::Limit(n) => json!(n),
        PolicyLimit::Unlimited => json!("unlimited"),
    }
}

/// The window of an inline key's peek or reset: `window_ms`, or (None)
/// every window of the key, found by SCAN over the whole Redis (its cost
/// grows with the keyspace), only when the query asks for it with
/// `scan=1`, as the CLI's --scan. A 400 says what to give.
fn inline_window(key: &str, q: &HashMap<String, String>) -> Result<Option<u32>, Answer> {
    match (q.get("window_ms"), q.get("scan").map(String::as_str)) {
        (Some(_), Some(_)) => Err(Answer::err(StatusCode::BAD_REQUEST, "give window_ms or scan=1, not both")),
        (Some(w), None) => Ok(Some(w.parse::<u32>().map_err(|_| Answer::err(StatusCode::BAD_REQUEST, format!("window_ms {w:?} is not a number of ms")))?)),
        (None, Some("1")) => Ok(None),
        (None, Some(v)) => Err(Answer::err(StatusCode::BAD_REQUEST, format!("scan {v:?}: scan=1 asks for every window of the key (SCAN over the whole Redis)"))),
        (None, None) => Err(Answer::err(
            StatusCode::BAD_REQUEST,
            format!(
                "key {} names no window: give policy=NAME (the policy's window), or window_ms=MS (the inline window's length); scan=1 finds every window of the key by scanning the whole Redis",
                escape_bytes(key.as_bytes())
            ),
        )),
    }
}

/// GET /v1/keys: the key's windows, read with read-only commands (ZCOUNT,
/// ZRANGE, GET, PTTL): nothing is recorded, no key is created.
async fn peek(state: &State, view: &View, q: &HashMap<String, String>) -> Result<Answer, Answer> {
    let redis = redis_of(view)?;
    let cfg = &view.config;
    let key = checked_key(cfg, q)?;
    let Some(name) = q.get("policy") else {
        let window_ms = inline_window(key, q)?;
        let windows = admin::inspect(redis, &view.secrets, &cfg.policies, Target::Inline { key, window_ms }).await.map_err(admin_error)?;
        return Ok(Answer::ok(json!({ "key": key, "windows": windows })));
    };
    let p = policy(cfg, name)?;
    let (limit, from) = limit_now(state, p, key);
    let windows = admin::inspect(redis, &view.secrets, &cfg.policies, Target::Policy { policy: name, key }).await.map_err(admin_error)?;
    let shards = windows.len().max(1) as u32;
    let windows: Vec<Value> = windows.iter().map(|w| window_json(w, limit, shards)).collect();
    let total = |f: &str| windows.iter().filter_map(|w| w.get(f).and_then(Value::as_u64)).sum::<u64>();
    let mut answer = json!({
        "policy": name,
        "key": key,
        "limit": limit_json(limit),
        "limit_from": from,
        "count": total("count"),
        "remaining": if limit == PolicyLimit::Unlimited { Value::Null } else { json!(total("remaining")) },
        "windows": windows,
    });
    // A penalty box's key: its ban too (read-only: GET, PTTL).
    if p.rule.penalty.is_some() {
        let mut conn = admin::connect(redis, &view.secrets).await.map_err(Answer::redis)?;
        let ban = bans::get(&mut conn, &redis.key_prefix, &scoped_key(name, key.as_bytes())).await.map_err(Answer::redis)?;
        answer["banned_for_ms"] = json!(ban.map(|b| b.left_ms));
    }
    Ok(Answer::ok(answer))
}

/// One window with what it means for the key: counted, remaining, and in
/// how many ms the next unit frees up (0: nothing counted).
fn window_json(w: &Inspection, limit: PolicyLimit, shards: u32) -> Value {
    let mut v = serde_json::to_value(w).expect("plain data serializes");
    let PolicyLimit::Limit(limit) = limit else { return v };
    let limit = if w.shard.is_some() { shard_limit(limit, w.shard.unwrap_or(0), shards) } else { limit };
    let (count, reset_in_ms) = match w.algorithm {
        "gcra" => {
            // newest_age_ms is now − TAT: negative by as many ms as the
            // bucket needs to empty; each unit is window/limit ms of it.
            let ahead = w.newest_age_ms.map_or(0, |a| (-a).max(0)) as u64;
            let interval = (u64::from(w.window_ms) / u64::from(limit.max(1))).max(1);
            (ahead.div_ceil(interval).min(u64::from(limit)), ahead.min(interval))
        }
        "fixed" | "sliding_counter" => (w.in_window, if w.in_window > 0 { w.ttl_ms.max(0) as u64 } else { 0 }),
        "concurrency" => (w.in_window, 0),
        // log, ring: the oldest counted admission leaves at its age + window.
        _ => (w.in_window, if w.in_window > 0 { w.oldest_age_ms.map_or(0, |a| (i64::from(w.window_ms) - a).max(0)) as u64 } else { 0 }),
    };
    v["limit"] = json!(limit);
    v["count"] = json!(count);
    v["remaining"] = json!(u64::from(limit).saturating_sub(count));
    v["reset_in_ms"] = json!(reset_in_ms);
    v
}

fn admin_error(e: AdminError) -> Answer {
    match e {
        AdminError::UnknownPolicy { .. } => Answer::err(StatusCode::NOT_FOUND, e.to_string()),
        e => Answer::redis(e),
    }
}

/// DELETE /v1/keys: every window of the key (policy: every shard's, its
/// leases; inline: every window or the one of `window_ms`).
async fn reset(state: &State, view: &View, q: &HashMap<String, String>, who: &str) -> Result<Answer, Answer> {
    let redis = redis_of(view)?;
    let cfg = &view.config;
    let key = checked_key(cfg, q)?;
    let target = match q.get("policy") {
        Some(name) => {
            policy(cfg, name)?;
            Target::Policy { policy: name, key }
        }
        None => {
            let window_ms = inline_window(key, q)?;
            Target::Inline { key, window_ms }
        }
    };
    let before = admin::inspect(redis, &view.secrets, &cfg.policies, target).await.map_err(admin_error)?;
    let before_count: u64 = before.iter().map(|w| w.in_window).sum();
    let windows = admin::reset(redis, &view.secrets, &cfg.policies, target).await.map_err(admin_error)?;
    let limiter = state.reloadable.borrow().limiter.clone();
    for w in &windows {
        limiter.window_reset(&w.key, w.window_ms, w.at_ms);
    }
    // The other daemons hear of it from the change log. The reset is done
    // either way: a failure here is said, not a 503 (their leases then
    // keep counting the admissions it removed until they settle).
    let announced = changes::announce_resets(redis, &view.secrets, &windows).await;
    if let Err(e) = &announced {
        tracing::warn!(error = %e, "a reset was made but not written to the change log: other daemons' quota leases count the admissions it removed until they settle");
    }
    let kept: u64 = windows.iter().map(|w| w.kept_outstanding).sum();
    let deleted: Vec<String> = windows.iter().filter(|w| w.kept_outstanding == 0).map(|w| String::from_utf8_lossy(&w.redis_key).into_owned()).collect();
    tracing::info!(who, op = "reset", policy = q.get("policy").map(String::as_str).unwrap_or("-"), key = %escape_bytes(key.as_bytes()), before_in_window = before_count, after_in_window = kept, deleted = deleted.len(), "admin write");
    Ok(Answer::ok(json!({
        "deleted": deleted,
        "reset": windows.iter().map(|w| String::from_utf8_lossy(&w.redis_key).into_owned()).collect::<Vec<_>>(),
        "before_in_window": before_count,
        "kept_outstanding": kept,
        "announced": announced.is_ok(),
    })))
}

fn stored_json(s: &Stored, now_ms: u64) -> Value {
    let mut v = serde_json::to_value(s).expect("plain data serializes");
    v["limit"] = limit_json(s.policy_limit());
    v["expires_at"] = json!(format_utc(s.expires_at_ms));
    v["set_at"] = json!(format_utc(s.set_at_ms));
    v["expires_in_ms"] = json!(s.expires_at_ms.saturating_sub(now_ms));
    v
}

/// GET /v1/overrides[?policy=]: the overrides in Redis not expired.
async fn list(view: &View, q: &HashMap<String, String>) -> Result<Answer, Answer> {
    let redis = redis_of(view)?;
    let mut conn = admin::connect(redis, &view.secrets).await.map_err(Answer::redis)?;
    let (now, stored) = store::read_all(&mut conn, &redis.key_prefix).await.map_err(Answer::redis)?;
    let mut live: Vec<&Stored> = stored.iter().filter_map(|(_, s)| s.as_ref()).filter(|s| s.expires_at_ms > now && q.get("policy").map_or(true, |p| *p == s.policy)).collect();
    live.sort_by(|a, b| (&a.policy, &a.key).cmp(&(&b.policy, &b.key)));
    Ok(Answer::ok(json!({ "now": format_utc(now), "overrides": live.iter().map(|s| stored_json(s, now)).collect::<Vec<_>>() })))
}

/// PUT /v1/overrides's body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetBody {
    policy: String,
    key: String,
    limit: Value,
    /// RFC 3339 UTC, or:
    expires_at: Option<String>,
    /// a duration from now ("90m", "1d").
    ttl: Option<String>,
    note: Option<String>,
}

/// PUT /v1/overrides: validated whole before anything is written.
async fn set(state: &State, view: &View, body: &[u8], who: &str) -> Result<Answer, Answer> {
    let redis = redis_of(view)?;
    let cfg = &view.config;
    let b: SetBody = serde_json::from_slice(body).map_err(|e| Answer::err(StatusCode::BAD_REQUEST, format!("malformed override: {e}; expected {{\"policy\", \"key\", \"limit\": N or \"unlimited\", \"expires_at\": \"2026-12-06T09:00:00Z\" or \"ttl\": \"1d\", \"note\"?}}")))?;
    let p = policy(cfg, &b.policy)?;
    key_ok(cfg, &b.key)?;
    let max = cfg.limits.bounds.max_limit;
    let limit = match &b.limit {
        Value::String(s) if s == "unlimited" => None,
        Value::Number(n) => match n.as_u64() {
            Some(n) if n >= 1 && n <= u64::from(max) => Some(n as u32),
            _ => return Err(Answer::err(StatusCode::BAD_REQUEST, format!("limit {n} is not between 1 and limits.max_limit ({max})"))),
        },
        other => return Err(Answer::err(StatusCode::BAD_REQUEST, format!("limit {other} is not a number or \"unlimited\""))),
    };
    if let Some(l) = limit {
        if p.rule.shards > 1 && l < p.rule.shards {
            return Err(Answer::err(StatusCode::BAD_REQUEST, format!("limit {l} is below the {} shards of policy '{}': every shard needs at least 1", p.rule.shards, p.name)));
        }
    }
    if b.note.as_ref().is_some_and(|n| n.len() > 1024) {
        return Err(Answer::err(StatusCode::BAD_REQUEST, "the note is longer than 1024 bytes"));
    }
    let mut conn = admin::connect(redis, &view.secrets).await.map_err(Answer::redis)?;
    let now = store::redis_now_ms(&mut conn).await.map_err(Answer::redis)?;
    let expires_at_ms = match (&b.expires_at, &b.ttl) {
        (Some(at), None) => parse_utc(at).map_err(|e| Answer::err(StatusCode::BAD_REQUEST, format!("expires_at: {e}")))?,
        (None, Some(ttl)) => now + parse_duration(ttl).map_err(|e| Answer::err(StatusCode::BAD_REQUEST, format!("ttl: {e}")))?.as_millis() as u64,
        _ => return Err(Answer::err(StatusCode::BAD_REQUEST, "give exactly one of expires_at (\"2026-12-06T09:00:00Z\") and ttl (\"1d\"): an override always ends")),
    };
    if expires_at_ms <= now {
        return Err(Answer::err(StatusCode::BAD_REQUEST, format!("the expiry {} is not in the future (Redis's time is {})", format_utc(expires_at_ms), format_utc(now))));
    }
    if expires_at_ms - now > MAX_OVERRIDE_MS {
        return Err(Answer::err(StatusCode::BAD_REQUEST, format!("the expiry {} is more than 366 days away: change the file for a lasting limit", format_utc(expires_at_ms))));
    }
    let scoped = scoped_key(&p.name, b.key.as_bytes());
    let before = store::get(&mut conn, &redis.key_prefix, &scoped).await.map_err(Answer::redis)?.filter(|s| s.expires_at_ms > now);
    // The cap, by the hash's length (HLEN): the whole hash (24.7 MB at the
    // cap) is read only when that many fields are stored; then the expired
    // ones are deleted and those in force counted. Below it, a write reads
    // one field.
    let fields: usize = conn.hlen(store::hash_key(&redis.key_prefix)).await.map_err(Answer::redis)?;
    if fields >= MAX_OVERRIDES {
        let (now, stored) = store::read_all(&mut conn, &redis.key_prefix).await.map_err(Answer::redis)?;
        // Expired fields go first: one of them may be this key's, written again now.
        if let Err(e) = store::purge_expired(&mut conn, &redis.key_prefix, now, &stored).await {
            tracing::debug!(error = %e, "could not delete expired overrides");
        }
        let in_force = stored.iter().filter(|(f, s)| s.as_ref().is_some_and(|s| s.expires_at_ms > now) && *f != scoped).count();
        if in_force >= MAX_OVERRIDES {
            return Err(Answer::err(StatusCode::BAD_REQUEST, format!("{MAX_OVERRIDES} overrides are in force already; delete some first")));
        }
    }
    let file_limit = match p.overrides.get(&b.key) {
        Some(&l) => l,
        None => PolicyLimit::Limit(p.rule.limit),
    };
    let after = Stored { policy: p.name.clone(), key: b.key.clone(), limit, expires_at_ms, set_by: who.to_string(), set_at_ms: now, note: b.note };
    let written = store::put(&mut conn, &redis.key_prefix, &scoped, &after).await;
    logged(view, &mut conn, Kind::Override, &scoped, written).await?;
    // In force on this daemon before the answer; the others at their refresh.
    state.live.write(&scoped, Some(LiveOverride { limit: after.policy_limit(), expires_at_ms }));
    let before_limit = before.as_ref().map_or(file_limit, Stored::policy_limit);
    tracing::info!(who, op = "override_set", policy = %p.name, key = %escape_bytes(b.key.as_bytes()), before = ?before_limit, after = ?after.policy_limit(), expires_at = %format_utc(expires_at_ms), "admin write");
    Ok(Answer::ok(json!({
        "before": before.as_ref().map(|s| stored_json(s, now)),
        "before_limit": limit_json(before_limit),
        "after": stored_json(&after, now),
        "applies_within_ms": view.config.admin.overrides_refresh.as_millis() as u64,
    })))
}

/// DELETE /v1/overrides?policy=&key=: the file's value applies again.
async fn delete(state: &State, view: &View, q: &HashMap<String, String>, who: &str) -> Result<Answer, Answer> {
    let redis = redis_of(view)?;
    let cfg = &view.config;
    let name = q.get("policy").ok_or_else(|| Answer::err(StatusCode::BAD_REQUEST, "missing parameter 'policy'"))?;
    let key = checked_key(cfg, q)?;
    // An override of a policy since removed from the file can still be deleted.
    let scoped = scoped_key(name, key.as_bytes());
    if split_scoped(&scoped).map(|(n, _)| n) != Some(name.as_str()) {
        return Err(Answer::err(StatusCode::BAD_REQUEST, "the policy name is longer than 255 bytes"));
    }
    let mut conn = admin::connect(redis, &view.secrets).await.map_err(Answer::redis)?;
    let now = store::redis_now_ms(&mut conn).await.map_err(Answer::redis)?;
    let before = store::get(&mut conn, &redis.key_prefix, &scoped).await.map_err(Answer::redis)?;
    let written = store::delete(&mut conn, &redis.key_prefix, &scoped).await;
    if !logged(view, &mut conn, Kind::Override, &scoped, written).await? {
        return Err(Answer::err(StatusCode::NOT_FOUND, format!("no override of policy {name:?} key {key:?}")));
    }
    state.live.write(&scoped, None);
    let after_limit = cfg.policies.iter().find(|p| p.name == *name).map(|p| p.overrides.get(key).copied().unwrap_or(PolicyLimit::Limit(p.rule.limit)));
    tracing::info!(who, op = "override_delete", policy = %name, key = %escape_bytes(key.as_bytes()), before = ?before.as_ref().map(Stored::policy_limit), after = ?after_limit, "admin write");
    Ok(Answer::ok(json!({ "deleted": before.as_ref().map(|s| stored_json(s, now)), "limit_now": after_limit.map(limit_json) })))
}

/// A policy with a penalty box, or why not.
fn penalized<'a>(cfg: &'a Config, name: &str) -> Result<(&'a PolicyConfig, crate::config::Penalty), Answer> {
    let p = policy(cfg, name)?;
    let penalty = p.rule.penalty.ok_or_else(|| Answer::err(StatusCode::BAD_REQUEST, format!("policy {name:?} has no penalty box (penalty = {{ after, within, ban }})")))?;
    Ok((p, penalty))
}

fn ban_json(policy: &str, key: &[u8], ends_at_ms: u64, now_ms: u64) -> Value {
    json!({ "policy": policy, "key": String::from_utf8_lossy(key), "ends_at": format_utc(ends_at_ms), "ends_in_ms": ends_at_ms.saturating_sub(now_ms) })
}

/// GET /v1/bans[?policy=][&key=]: with a key, its ban (or none) and its
/// strikes; else every ban in force (the fleet's index in Redis; without
/// Redis, the memory backend's).
async fn ban_list(view: &View, q: &HashMap<String, String>) -> Result<Answer, Answer> {
    let cfg = &view.config;
    if let Some(name) = q.get("policy") {
        penalized(cfg, name)?;
    }
    let Some(redis) = cfg.redis.as_ref() else {
        let bans: Vec<Value> = crate::penalty_box::BANS
            .entries()
            .into_iter()
            .filter_map(|(scoped, left)| {
                let (policy, key) = split_scoped(&scoped)?;
                let wanted = q.get("policy").map_or(true, |p| p == policy) && q.get("key").map_or(true, |k| k.as_bytes() == key);
                wanted.then(|| json!({ "policy": policy, "key": String::from_utf8_lossy(key), "ends_in_ms": left }))
            })
            .collect();
        return Ok(Answer::ok(json!({ "bans": bans, "scope": "this daemon (memory backend)" })));
    };
    let mut conn = admin::connect(redis, &view.secrets).await.map_err(Answer::redis)?;
    if let Some(key) = q.get("key") {
        let name = q.get("policy").ok_or_else(|| Answer::err(StatusCode::BAD_REQUEST, "a key needs its 'policy'"))?;
        key_ok(cfg, key)?;
        let (_, penalty) = penalized(cfg, name)?;
        let scoped = scoped_key(name, key.as_bytes());
        let ban = bans::get(&mut conn, &redis.key_prefix, &scoped).await.map_err(Answer::redis)?;
        let strikes = bans::strikes(&mut conn, &redis.key_prefix, &scoped, penalty.within_ms).await.map_err(Answer::redis)?;
        let now = store::redis_now_ms(&mut conn).await.map_err(Answer::redis)?;
        return Ok(Answer::ok(json!({
            "policy": name,
            "key": key,
            "banned": ban.is_some(),
            "ban": ban.map(|b| ban_json(name, key.as_bytes(), b.ends_at_ms, now)),
            "strikes": strikes,
            "after": penalty.after,
            "within_ms": penalty.within_ms,
            "ban_ms": penalty.ban_ms,
        })));
    }
    let (now, listed) = bans::list(&mut conn, &redis.key_prefix).await.map_err(Answer::redis)?;
    let bans: Vec<Value> = listed
        .iter()
        .filter_map(|(scoped, end)| {
            let (policy, key) = split_scoped(scoped)?;
            q.get("policy").map_or(true, |p| p == policy).then(|| ban_json(policy, key, *end, now))
        })
        .collect();
    Ok(Answer::ok(json!({ "now": format_utc(now), "bans": bans })))
}

/// DELETE /v1/bans?policy=&key=: the ban and the key's strikes deleted,
/// and every daemon's cache of it dropped within one refresh.
async fn ban_lift(view: &View, q: &HashMap<String, String>, who: &str) -> Result<Answer, Answer> {
    let cfg = &view.config;
    let name = q.get("policy").ok_or_else(|| Answer::err(StatusCode::BAD_REQUEST, "missing parameter 'policy'"))?;
    let key = checked_key(cfg, q)?;
    penalized(cfg, name)?;
    let scoped = scoped_key(name, key.as_bytes());
    let Some(redis) = cfg.redis.as_ref() else {
        let was = crate::penalty_box::BANS.banned_ms(&scoped);
        crate::penalty_box::BANS.lift(&scoped);
        tracing::info!(who, op = "ban_lift", policy = %name, key = %escape_bytes(key.as_bytes()), before_ends_in_ms = ?was, after = "not banned", "admin write");
        return match was {
            Some(left) => Ok(Answer::ok(json!({ "lifted": { "policy": name, "key": key, "ends_in_ms": left } }))),
            None => Err(Answer::err(StatusCode::NOT_FOUND, format!("policy {name:?} key {key:?} is not banned"))),
        };
    };
    let mut conn = admin::connect(redis, &view.secrets).await.map_err(Answer::redis)?;
    let now = store::redis_now_ms(&mut conn).await.map_err(Answer::redis)?;
    let written = bans::lift(&mut conn, &redis.key_prefix, &scoped).await;
    // This daemon at once, once the ban is deleted in Redis, even if the
    // lift cannot be logged (its cache would refuse a key Redis no longer
    // bans); the others at their next refresh.
    if written.is_ok() {
        crate::penalty_box::BANS.lift(&scoped);
    }
    let before = logged(view, &mut conn, Kind::Lift, &scoped, written).await?;
    tracing::info!(who, op = "ban_lift", policy = %name, key = %escape_bytes(key.as_bytes()), before_ends_at = ?before.as_ref().map(|b| format_utc(b.ends_at_ms)), after = "not banned", "admin write");
    match before {
        Some(b) => Ok(Answer::ok(json!({ "lifted": ban_json(name, key.as_bytes(), b.ends_at_ms, now), "applies_within_ms": cfg.admin.overrides_refresh.as_millis() as u64 }))),
        None => Err(Answer::err(StatusCode::NOT_FOUND, format!("policy {name:?} key {key:?} is not banned (its strikes, if any, were cleared, and the lift logged for every daemon)"))),
    }
}
