//! The generated types this front speaks: Envoy's own protos, as
//! envoy-types publishes them (no hand-copied .proto).

pub use envoy_types::pb::envoy::config::core::v3::HeaderValue;
pub use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
pub use envoy_types::pb::envoy::service::ratelimit::v3::{rate_limit_response, RateLimitRequest, RateLimitResponse};
pub use envoy_types::pb::google::protobuf::Duration;
