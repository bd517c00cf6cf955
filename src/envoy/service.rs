//! `ShouldRateLimit`: plan the request, decide its items through the one
//! pipeline (`Limiter::decide`, as the socket's requests are), answer.

use std::sync::Arc;

use futures_util::future::join_all;
use tokio::sync::watch;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

use crate::config::{DescriptorMode, EnvoyConfig};
use crate::decision::Limiter;
use crate::metrics::EnvoyOutcome;
use crate::protocol::{Decision, ErrorCode, Response};
use crate::server::Reloadable;

use super::pb::{RateLimitRequest, RateLimitResponse, RateLimitService};
use super::plan::{plan, Plan};
use super::reply::{response, Outcome};

/// The service: what is in force is read per request, so a reload applies
/// to the next request as on the socket.
pub struct Front {
    pub(super) reloadable: watch::Receiver<Reloadable>,
}

#[tonic::async_trait]
impl RateLimitService for Front {
    async fn should_rate_limit(&self, request: GrpcRequest<RateLimitRequest>) -> Result<GrpcResponse<RateLimitResponse>, Status> {
        let Reloadable { bounds, limiter, envoy } = self.reloadable.borrow().clone();
        let Some(envoy) = envoy else { return Err(Status::unavailable("the [envoy] section was removed by a reload; this listener stops at restart")) };
        let r = request.into_inner();
        let plan = plan(&r, &envoy, &bounds).inspect_err(|_| count(EnvoyOutcome::Refused))?;
        let outcomes = match decide(&plan, &envoy, &bounds, &limiter).await {
            Ok(o) => o,
            Err(status) => {
                count(EnvoyOutcome::Refused);
                return Err(status);
            }
        };
        let answer = response(&plan.slots, &outcomes, envoy.header_style);
        count(if answer.overall_code == super::pb::rate_limit_response::Code::OverLimit as i32 { EnvoyOutcome::OverLimit } else { EnvoyOutcome::Ok });
        Ok(GrpcResponse::new(answer))
    }
}

fn count(outcome: EnvoyOutcome) {
    crate::metrics::METRICS.envoy_request(outcome);
}

/// Every item decided: all or nothing in one multi-item check, or each
/// alone, concurrently.
async fn decide(plan: &Plan, envoy: &EnvoyConfig, bounds: &crate::protocol::Bounds, limiter: &Arc<Limiter>) -> Result<Vec<Outcome>, Status> {
    match plan.items.len() {
        0 => Ok(Vec::new()),
        n if n > 1 && envoy.descriptors == DescriptorMode::AllOrNothing => {
            let req = plan.all_or_nothing(envoy.on_error, bounds)?;
            let answer = limiter.clone().decide(req).await;
            let ext = checked(&answer)?.extension.as_ref().ok_or_else(|| Status::internal("a multi-item answer without its items"))?;
            Ok(plan.items.iter().zip(&ext.items).map(|(i, it)| Outcome {
                policy: i.policy.clone(),
                shown_name: i.shown_name.clone(),
                decision: it.decision,
                source: it.source,
                remaining: it.remaining,
                reset_ms: it.reset_ms,
                retry_after_ms: it.retry_after_ms,
                limit: (it.limit > 0).then_some(it.limit),
                window_ms: it.window_ms,
            })
            .collect())
        }
        n => {
            let requests = (0..n).map(|i| plan.one(i, envoy.on_error, bounds)).collect::<Result<Vec<_>, _>>()?;
            let answers = join_all(requests.into_iter().map(|req| limiter.clone().decide(req))).await;
            plan.items.iter().zip(&answers).map(|(i, a)| one_outcome(limiter, i, a)).collect()
        }
    }
}

/// A single check's answer with the key's limit in force (the answer
/// carries the count and what remains, not the limit).
fn one_outcome(limiter: &Limiter, item: &super::plan::Item, answer: &Response) -> Result<Outcome, Status> {
    let a = checked(answer)?;
    let policy = limiter.policies().get(item.policy.as_bytes());
    let (limit, window_ms) = match policy {
        Some(p) => {
            let mut scoped = Vec::with_capacity(1 + item.policy.len() + item.key.len());
            scoped.push(item.policy.len() as u8);
            scoped.extend_from_slice(item.policy.as_bytes());
            scoped.extend_from_slice(&item.key);
            (limiter.limit_in_force(p, &item.key, &scoped), p.rule.window_ms)
        }
        None => (None, 0),
    };
    Ok(Outcome { policy: item.policy.clone(), shown_name: item.shown_name.clone(), decision: a.decision, source: a.source, remaining: a.remaining, reset_ms: a.reset_ms, retry_after_ms: a.retry_after_ms, limit, window_ms })
}

/// An answer that decided, or the gRPC status of one that did not: a
/// request Envoy should not have sent is INVALID_ARGUMENT; a configuration
/// reloaded under it FAILED_PRECONDITION; the daemon's own limits
/// UNAVAILABLE (Envoy's `failure_mode_deny` decides).
fn checked(a: &Response) -> Result<&Response, Status> {
    if a.decision != Decision::Error {
        return Ok(a);
    }
    let message = format!("{}: {}", a.error.as_str(), a.message);
    Err(match a.error {
        ErrorCode::UnknownPolicy | ErrorCode::WrongPolicyKind | ErrorCode::UnsupportedCombination => Status::failed_precondition(message),
        ErrorCode::LocalCapacity | ErrorCode::Overloaded | ErrorCode::RedisTimeout | ErrorCode::RedisUnavailable | ErrorCode::RedisError | ErrorCode::CircuitOpen => Status::unavailable(message),
        _ => Status::invalid_argument(message),
    })
}
