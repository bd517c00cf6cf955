//! The Prometheus endpoint: `GET /metrics` over HTTP/1.1 on a loopback
//! address (`[metrics] listen`), rendering the process's counters; and
//! `GET /top.json`, what `ratelimitd top` shows (`top_snapshot`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

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
    pub policies: Arc<Policies>,
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
pub async fn serve(listener: TcpListener, breaker_state: BreakerState, shutdown: CancellationToken) {
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
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let live = breaker_state();
                async move {
                    let path = req.uri().path();
                    let resp = if path == "/top.json" {
                        let doc = crate::top_snapshot::build(live.breaker_open, &live.policies);
                        Response::builder().header("content-type", "application/json").body(Full::new(Bytes::from(serde_json::to_vec(&doc).expect("plain data serializes"))))
                    } else if path == "/metrics" {
                        Response::builder()
                            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
                            .body(Full::new(Bytes::from({
                                let mut text = METRICS.render(live.breaker_open);
                                live.policies.render(&mut text);
                                text
                            })))
                    } else {
                        Response::builder().status(StatusCode::NOT_FOUND).body(Full::new(Bytes::from_static(b"see /metrics or /top.json\n")))
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
