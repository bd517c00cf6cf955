//! The pipeline's answers as Envoy reads them: `overall_code`, one
//! `DescriptorStatus` per descriptor in request order, and the quota
//! headers of the configured style. What is shown follows the Lua
//! client's headers (lua/resty/ratelimitd/http.lua): only a real count
//! binds a client, so a fail-open, an exempt key or a shadow policy shows
//! no limit.

use crate::config::{EnvoyHeaderStyle, EnvoyUnit};
use crate::protocol::{Decision, Source};

use super::pb::{rate_limit_response as rlr, HeaderValue, RateLimitResponse};
use super::plan::Slot;

/// One decided item, whatever answer carried it (a single check's
/// response, or a multi-item check's per-item result).
#[derive(Debug, Clone)]
pub struct Outcome {
    pub policy: String,
    /// `current_limit.name`.
    pub shown_name: String,
    pub decision: Decision,
    pub source: Source,
    pub remaining: u32,
    pub reset_ms: u32,
    pub retry_after_ms: u32,
    /// The key's limit (None: exempt or not resolved).
    pub limit: Option<u32>,
    pub window_ms: u32,
}

impl Outcome {
    fn refused(&self) -> bool {
        self.decision == Decision::Denied && self.source != Source::None
    }

    /// Counted, with a limit, not a shadow policy's: what a client is shown.
    fn shown(&self) -> bool {
        let counted = matches!(self.source, Source::Redis | Source::LocalFallback | Source::Memory | Source::DenialCache);
        counted && self.limit.is_some() && matches!(self.decision, Decision::Allowed | Decision::Denied)
    }

    /// When the client may expect room: a refusal's retry, else the reset.
    fn until_ms(&self) -> u32 {
        if self.refused() {
            self.retry_after_ms
        } else {
            self.reset_ms
        }
    }
}

/// The response to a request whose descriptors resolved to `slots` and
/// whose items were decided as `outcomes` (one per item).
pub fn response(slots: &[Slot], outcomes: &[Outcome], style: EnvoyHeaderStyle) -> RateLimitResponse {
    let statuses: Vec<rlr::DescriptorStatus> = slots.iter().map(|s| status(*s, outcomes)).collect();
    let over = outcomes.iter().any(|o| o.refused() || (o.decision == Decision::Denied && o.source == Source::FailClosed));
    let overall = if over { rlr::Code::OverLimit } else { rlr::Code::Ok };
    RateLimitResponse { overall_code: overall as i32, statuses, response_headers_to_add: headers(outcomes, style), ..Default::default() }
}

fn status(slot: Slot, outcomes: &[Outcome]) -> rlr::DescriptorStatus {
    let o = match slot {
        // envoyproxy/ratelimit's answers: no limit, and unlimited.
        Slot::NoLimit => return rlr::DescriptorStatus { code: rlr::Code::Ok as i32, ..Default::default() },
        Slot::Unlimited => return rlr::DescriptorStatus { code: rlr::Code::Ok as i32, limit_remaining: u32::MAX, ..Default::default() },
        Slot::Item(n) => &outcomes[n],
    };
    let code = if o.refused() || (o.decision == Decision::Denied && o.source == Source::FailClosed) { rlr::Code::OverLimit } else { rlr::Code::Ok };
    if o.source == Source::Exempt {
        return rlr::DescriptorStatus { code: code as i32, limit_remaining: u32::MAX, ..Default::default() };
    }
    if !o.shown() {
        return rlr::DescriptorStatus { code: code as i32, ..Default::default() };
    }
    let until = o.until_ms();
    rlr::DescriptorStatus {
        code: code as i32,
        current_limit: Some(rlr::RateLimit { name: o.shown_name.clone(), requests_per_unit: o.limit.unwrap_or(0), unit: unit(o.window_ms) as i32 }),
        limit_remaining: o.remaining,
        duration_until_reset: Some(super::pb::Duration { seconds: i64::from(until / 1000), nanos: (until % 1000) as i32 * 1_000_000 }),
        ..Default::default()
    }
}

fn unit(window_ms: u32) -> rlr::rate_limit::Unit {
    use rlr::rate_limit::Unit;
    match EnvoyUnit::of_window_ms(window_ms) {
        EnvoyUnit::Second => Unit::Second,
        EnvoyUnit::Minute => Unit::Minute,
        EnvoyUnit::Hour => Unit::Hour,
        EnvoyUnit::Day => Unit::Day,
        EnvoyUnit::Week => Unit::Week,
        EnvoyUnit::Month => Unit::Month,
    }
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue { key: key.to_owned(), value, ..Default::default() }
}

/// The quota headers: the legacy styles show one item (the refusing one,
/// else the one with the least remaining, as envoyproxy/ratelimit picks);
/// the draft shows every item shown, named by its policy.
fn headers(outcomes: &[Outcome], style: EnvoyHeaderStyle) -> Vec<HeaderValue> {
    let shown = || outcomes.iter().filter(|o| o.shown());
    let names = match style {
        EnvoyHeaderStyle::None => return Vec::new(),
        EnvoyHeaderStyle::Draft => {
            let policy: Vec<String> = shown()
                .map(|o| match o.window_ms {
                    w if w % 1000 == 0 && w < crate::window::CALENDAR => format!("{:?};q={};w={}", o.policy, o.limit.unwrap_or(0), w / 1000),
                    _ => format!("{:?};q={}", o.policy, o.limit.unwrap_or(0)),
                })
                .collect();
            if policy.is_empty() {
                return Vec::new();
            }
            let state: Vec<String> = shown().map(|o| format!("{:?};r={};t={}", o.policy, o.remaining, o.until_ms().div_ceil(1000))).collect();
            return vec![header("RateLimit-Policy", policy.join(", ")), header("RateLimit", state.join(", "))];
        }
        EnvoyHeaderStyle::Ratelimit => ["RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"],
        EnvoyHeaderStyle::X => ["X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"],
    };
    let Some(main) = shown().find(|o| o.refused()).or_else(|| shown().min_by_key(|o| o.remaining)) else { return Vec::new() };
    vec![header(names[0], main.limit.unwrap_or(0).to_string()), header(names[1], main.remaining.to_string()), header(names[2], main.reset_ms.div_ceil(1000).to_string())]
}
