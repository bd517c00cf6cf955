//! The Prometheus endpoint: `GET /metrics` over HTTP/1.1 on a loopback
//! address (`[metrics] listen`), rendering the process's counters;
//! `GET /top.json`, what `ratelimitd top` shows (`top_snapshot`);
//! `GET /healthz`, 200 when the daemon can decide from its backend, 503 with
//! the reason otherwise; and `GET /config`, the configuration in force
//! (secrets never: URLs redacted, secret sources named, not read).

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::METRICS;
use crate::policies::Policies;

/// What a scrape reads of the configuration in force: whether the breaker
/// to Redis is open (`None` without Redis) and the policies whose counters
/// are shown.
pub struct Live {
    pub breaker_open: Option<bool>,
    /// The backend can decide: Redis linked (script loaded) and the breaker
    /// closed, or the in-memory backend.
    pub backend_ready: bool,
    pub policies: Arc<Policies>,
    /// The admin API's overrides in force (`top` shows them).
    pub live_overrides: Arc<crate::live_overrides::LiveOverrides>,
}

/// The configuration in force and the outcome of the reloads, for
/// `/metrics` and `/config`; written by the daemon at start and at each
/// reload, read at scrapes (a lock held for a copy, never on the request path).
#[derive(Debug, Default)]
pub struct ConfigStatus {
    /// FNV-1a 64 of the configuration dump: equal on hosts with the same
    /// configuration, changed by any change that is in force.
    hash: AtomicU64,
    /// Unix time of the last successful load (start or reload), seconds.
    loaded_at: AtomicU64,
    last_reload_ok: AtomicBool,
    /// Reloads refused, by `RefusalReason` (one refused reload counts in
    /// each of its reasons).
    refused: [AtomicU64; RefusalReason::ALL.len()],
    dump: Mutex<String>,
}

/// Why a valid configuration was not put in force unforced (SIGUSR1
/// forces it): the `reason` label of `ratelimitd_config_reloads_refused_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalReason {
    /// It removes or renames a policy in use.
    PolicyInUse,
    /// It makes a policy refuse a use nginx described (UNSUPPORTED_COMBINATION, WRONG_POLICY_KIND).
    UseUnsupported,
    /// It changes the keys a policy in use counts under: its counts would restart from zero.
    CountsRestart,
}

impl RefusalReason {
    pub const ALL: [RefusalReason; 3] = [Self::PolicyInUse, Self::UseUnsupported, Self::CountsRestart];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PolicyInUse => "policy_in_use",
            Self::UseUnsupported => "use_unsupported",
            Self::CountsRestart => "counts_restart",
        }
    }
}

/// FNV-1a, 64 bits: a stable fingerprint (not a security hash).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

impl ConfigStatus {
    /// A configuration is in force (at start, or a reload applied).
    pub fn loaded(&self, dump: String) {
        self.hash.store(fnv1a64(dump.as_bytes()), Ordering::Relaxed);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.loaded_at.store(now, Ordering::Relaxed);
        self.last_reload_ok.store(true, Ordering::Relaxed);
        *self.dump.lock().unwrap_or_else(|e| e.into_inner()) = dump;
    }

    /// A reload failed (no reasons) or was refused for `reasons`; the
    /// previous configuration stays.
    pub fn reload_failed(&self, reasons: &[RefusalReason]) {
        self.last_reload_ok.store(false, Ordering::Relaxed);
        for r in reasons {
            self.refused[*r as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The hash as `/metrics` shows it (16 hex digits).
    pub fn hash_hex(&self) -> String {
        format!("{:016x}", self.hash.load(Ordering::Relaxed))
    }

    fn dump(&self) -> String {
        self.dump.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Build info, configuration hash, load time, reload outcome.
    pub fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP ratelimitd_build_info The running binary: version, protocol version; always 1.\n# TYPE ratelimitd_build_info gauge\nratelimitd_build_info{{version=\"{}\",protocol=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::protocol::VERSION
        );
        let _ = writeln!(
            out,
            "# HELP ratelimitd_config_info The configuration in force: hash is a fingerprint of GET /config; always 1.\n# TYPE ratelimitd_config_info gauge\nratelimitd_config_info{{hash=\"{}\"}} 1",
            self.hash_hex()
        );
        let _ = writeln!(
            out,
            "# HELP ratelimitd_config_last_reload_success_timestamp_seconds When the configuration in force was loaded (start or reload), Unix time.\n# TYPE ratelimitd_config_last_reload_success_timestamp_seconds gauge\nratelimitd_config_last_reload_success_timestamp_seconds {}",
            self.loaded_at.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP ratelimitd_config_last_reload_successful 1 if the last reload (or the start) put its file in force, 0 if it failed or was refused.\n# TYPE ratelimitd_config_last_reload_successful gauge\nratelimitd_config_last_reload_successful {}",
            u8::from(self.last_reload_ok.load(Ordering::Relaxed))
        );
        let _ = writeln!(
            out,
            "# HELP ratelimitd_config_reloads_refused_total Reloads refused (force: SIGUSR1), by reason: policy_in_use (removes or renames a policy in use), use_unsupported (a policy would refuse a use nginx described), counts_restart (a policy in use would restart its counts).\n# TYPE ratelimitd_config_reloads_refused_total counter"
        );
        for r in RefusalReason::ALL {
            let _ = writeln!(out, "ratelimitd_config_reloads_refused_total{{reason=\"{}\"}} {}", r.as_str(), self.refused[r as usize].load(Ordering::Relaxed));
        }
    }
}

/// Asked at each scrape, so the gauges and the per-policy counters follow
/// reloads without the metrics knowing about backends.
pub type BreakerState = Arc<dyn Fn() -> Live + Send + Sync>;

/// Binds the metrics address; only loopback addresses are accepted (checked
/// by the configuration).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves `GET /metrics` and `GET /top.json` on `listener` until `shutdown`.
pub async fn serve(listener: TcpListener, breaker_state: BreakerState, status: Arc<ConfigStatus>, shutdown: CancellationToken) {
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let breaker_state = breaker_state.clone();
        let status = status.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let live = breaker_state();
                let status = status.clone();
                async move {
                    let path = req.uri().path();
                    let resp = if path == "/top.json" {
                        let doc = crate::top_snapshot::build(live.breaker_open, &live.policies, &live.live_overrides);
                        Response::builder().header("content-type", "application/json").body(Full::new(Bytes::from(serde_json::to_vec(&doc).expect("plain data serializes"))))
                    } else if path == "/metrics" {
                        Response::builder()
                            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
                            .body(Full::new(Bytes::from({
                                let mut text = METRICS.render(live.breaker_open);
                                live.policies.render(&mut text);
                                status.render(&mut text);
                                text
                            })))
                    } else if path == "/healthz" {
                        // Served only once the socket is (the daemon binds it first).
                        let (code, body) = match (live.backend_ready, live.breaker_open) {
                            (true, _) => (StatusCode::OK, "ok\n"),
                            (false, Some(true)) => (StatusCode::SERVICE_UNAVAILABLE, "not ready: the breaker to Redis is open; requests get their fail policy\n"),
                            (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "not ready: Redis not reached yet (or its script not loaded); requests get their fail policy\n"),
                        };
                        Response::builder().status(code).header("content-type", "text/plain").body(Full::new(Bytes::from_static(body.as_bytes())))
                    } else if path == "/config" {
                        Response::builder().header("content-type", "text/plain; charset=utf-8").header("x-ratelimitd-config-hash", status.hash_hex()).body(Full::new(Bytes::from(status.dump())))
                    } else {
                        Response::builder().status(StatusCode::NOT_FOUND).body(Full::new(Bytes::from_static(b"see /metrics, /top.json, /healthz or /config\n")))
                    };
                    Ok::<_, hyper::http::Error>(resp.expect("static response parts"))
                }
            });
            if let Err(e) = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!(error = %e, "metrics connection ended");
            }
        });
    }
}
