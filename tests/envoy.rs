//! The Envoy rate limit service (docs/ENVOY.md) through the real daemon and
//! real Redis, driven by a client generated from Envoy's published protos
//! (envoy-types): the behaviours envoyproxy/ratelimit's integration tests
//! assert, written against this server, every response field checked;
//! the socket (what nginx speaks) and gRPC sharing one window; hostile
//! requests answered with an error and never another key's quota.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{Daemon, RedisServer};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{rate_limit_descriptor::Entry, RateLimitDescriptor};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{rate_limit::Unit, Code, DescriptorStatus, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ratelimitd::protocol::{Decision, FailPolicy, PolicyCheckArgs};
use tempfile::TempDir;
use tonic::transport::Channel;

/// A daemon with `[envoy]` on a Unix socket in `dir`, reading `yaml` (one
/// file) and `envoy_extra` lines, and `rest` (policies, ...).
struct Front {
    daemon: Daemon,
    socket: PathBuf,
    dir: TempDir,
    _redis: Option<RedisServer>,
}

impl Front {
    fn start(redis: Option<RedisServer>, yaml: &str, envoy_extra: &str, rest: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("envoy.sock");
        let file = dir.path().join("config.yaml");
        std::fs::write(&file, yaml).unwrap();
        // A generous Redis timeout: a loaded test machine must not turn a
        // decision into the fail policy's.
        let redis_table = redis.as_ref().map(|r| format!("[redis]\nurl = \"{}\"\ntimeout = \"2s\"\n", r.url())).unwrap_or_default();
        // [server] lines first: a socket nginx's workers may use too.
        let config = format!("{}\n{redis_table}[envoy]\nsocket = \"{}\"\nconfig = [\"{}\"]\n{envoy_extra}\n{rest}", common::ops::socket_access(), socket.display(), file.display());
        let daemon = Daemon::start_config(&config);
        Self { daemon, socket, dir, _redis: redis }
    }

    async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::new(channel(&self.socket).await)
    }

    fn yaml_path(&self) -> PathBuf {
        self.dir.path().join("config.yaml")
    }
}

/// A gRPC channel over the Unix socket at `path`.
async fn channel(path: &std::path::Path) -> Channel {
    ratelimitd::bench::envoy_channel(&ratelimitd::bench::EnvoyTarget::Unix(path.to_owned())).await.unwrap()
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor { entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(), ..Default::default() }
}

fn request(domain: &str, descriptors: &[&[(&str, &str)]], hits: u32) -> RateLimitRequest {
    RateLimitRequest { domain: domain.into(), descriptors: descriptors.iter().map(|d| descriptor(d)).collect(), hits_addend: hits }
}

async fn ask(c: &mut RateLimitServiceClient<Channel>, domain: &str, descriptors: &[&[(&str, &str)]]) -> RateLimitResponse {
    c.should_rate_limit(request(domain, descriptors, 0)).await.unwrap().into_inner()
}

fn code(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).unwrap()
}

/// A status that counted: its code, limit and remaining, and a reset
/// within the window.
fn assert_counted(s: &DescriptorStatus, code: Code, limit: RateLimit, remaining: u32, window: Duration) {
    assert_eq!(Code::try_from(s.code).unwrap(), code, "{s:?}");
    assert_eq!(s.current_limit.as_ref(), Some(&limit), "{s:?}");
    assert_eq!(s.limit_remaining, remaining, "{s:?}");
    let reset = s.duration_until_reset.expect("a counted status says when it resets");
    let reset = Duration::new(reset.seconds as u64, reset.nanos as u32);
    assert!(reset > Duration::ZERO && reset <= window, "{s:?}");
    assert!(s.quota.is_none(), "{s:?}");
}

/// envoyproxy/ratelimit's answer to a descriptor no limit matches.
fn assert_no_limit(s: &DescriptorStatus) {
    assert_eq!(s, &DescriptorStatus { code: Code::Ok as i32, ..Default::default() });
}

fn limit(name: &str, n: u32, unit: Unit) -> RateLimit {
    RateLimit { name: name.into(), requests_per_unit: n, unit: unit as i32 }
}

const BASIC: &str = r#"
domain: edge
descriptors:
  - key: tenant
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: path
    value: /login
    descriptors:
      - key: tenant
        rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: internal
    rate_limit: { unlimited: true }
  - key: shadowed
    shadow_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: plan
    value: free
    rate_limit: { unit: second, requests_per_unit: 5 }
"#;

#[tokio::test]
async fn under_the_limit_then_over_with_every_field_of_the_answer() {
    let front = Front::start(Some(RedisServer::start()), BASIC, "", "");
    let mut c = front.client().await;
    for remaining in [2, 1, 0] {
        let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
        assert_eq!(code(&r), Code::Ok, "{r:?}");
        assert_eq!(r.statuses.len(), 1);
        assert_counted(&r.statuses[0], Code::Ok, limit("", 3, Unit::Minute), remaining, Duration::from_secs(60));
        assert!(r.response_headers_to_add.is_empty() && r.request_headers_to_add.is_empty() && r.raw_body.is_empty());
        assert!(r.dynamic_metadata.is_none() && r.quota.is_none());
    }
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_eq!(code(&r), Code::OverLimit, "{r:?}");
    assert_counted(&r.statuses[0], Code::OverLimit, limit("", 3, Unit::Minute), 0, Duration::from_secs(60));
    // Another tenant has its own window.
    let r = ask(&mut c, "edge", &[&[("tenant", "t2")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("", 3, Unit::Minute), 2, Duration::from_secs(60));
}

#[tokio::test]
async fn unknown_domains_and_descriptors_are_ok_and_count_nothing() {
    let front = Front::start(Some(RedisServer::start()), BASIC, "", "");
    let mut c = front.client().await;
    for _ in 0..5 {
        let r = ask(&mut c, "nowhere", &[&[("tenant", "t1")]]).await;
        assert_eq!(code(&r), Code::Ok);
        assert_no_limit(&r.statuses[0]);
        let r = ask(&mut c, "edge", &[&[("unknown", "x")], &[("plan", "paid")]]).await;
        assert_eq!(code(&r), Code::Ok);
        assert_no_limit(&r.statuses[0]);
        assert_no_limit(&r.statuses[1]);
    }
}

#[tokio::test]
async fn nested_descriptors_apply_at_their_depth_only() {
    let front = Front::start(Some(RedisServer::start()), BASIC, "", "");
    let mut c = front.client().await;
    let login = limit("", 2, Unit::Minute);
    for remaining in [1, 0] {
        let r = ask(&mut c, "edge", &[&[("path", "/login"), ("tenant", "t1")]]).await;
        assert_counted(&r.statuses[0], Code::Ok, login.clone(), remaining, Duration::from_secs(60));
    }
    let r = ask(&mut c, "edge", &[&[("path", "/login"), ("tenant", "t1")]]).await;
    assert_eq!(code(&r), Code::OverLimit);
    // Another path, or the path alone (the limit is one level deeper), or
    // one entry too many: no limit.
    for d in [&[("path", "/other"), ("tenant", "t1")][..], &[("path", "/login")], &[("path", "/login"), ("tenant", "t1"), ("x", "y")]] {
        let r = ask(&mut c, "edge", &[d]).await;
        assert_eq!(code(&r), Code::Ok, "{d:?}");
        assert_no_limit(&r.statuses[0]);
    }
    // The nested limit's window is its own: the top-level tenant limit of t1 is untouched.
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("", 3, Unit::Minute), 2, Duration::from_secs(60));
}

#[tokio::test]
async fn unlimited_and_shadow_mode_admit_and_say_so() {
    let front = Front::start(Some(RedisServer::start()), BASIC, "", "");
    let mut c = front.client().await;
    for _ in 0..4 {
        let r = ask(&mut c, "edge", &[&[("internal", "batch")], &[("shadowed", "k")]]).await;
        assert_eq!(code(&r), Code::Ok, "{r:?}");
        assert_eq!(r.statuses[0], DescriptorStatus { code: Code::Ok as i32, limit_remaining: u32::MAX, ..Default::default() });
        // A shadow limit refuses nothing and, as in nginx, shows no quota.
        assert_no_limit(&r.statuses[1]);
    }
}

#[tokio::test]
async fn replaces_drops_the_named_limit_it_replaces() {
    let yaml = r#"
domain: edge
descriptors:
  - key: tenant
    rate_limit: { name: per_tenant, unit: minute, requests_per_unit: 1 }
  - key: premium
    rate_limit: { name: premium, unit: minute, requests_per_unit: 3, replaces: [ { name: per_tenant } ] }
"#;
    let front = Front::start(Some(RedisServer::start()), yaml, "", "");
    let mut c = front.client().await;
    for remaining in [2, 1, 0] {
        let r = ask(&mut c, "edge", &[&[("tenant", "t1")], &[("premium", "t1")]]).await;
        assert_eq!(code(&r), Code::Ok, "{r:?}");
        assert_no_limit(&r.statuses[0]);
        assert_counted(&r.statuses[1], Code::Ok, limit("premium", 3, Unit::Minute), remaining, Duration::from_secs(60));
    }
    // Without the replacing descriptor the tenant limit applies: t1 has
    // not been counted under it.
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("per_tenant", 1, Unit::Minute), 0, Duration::from_secs(60));
}

#[tokio::test]
async fn hits_addend_is_the_cost_and_a_descriptor_s_own_wins() {
    let front = Front::start(Some(RedisServer::start()), BASIC, "", "");
    let mut c = front.client().await;
    let r = c.should_rate_limit(request("edge", &[&[("plan", "free")]], 3)).await.unwrap().into_inner();
    assert_counted(&r.statuses[0], Code::Ok, limit("", 5, Unit::Second), 2, Duration::from_secs(1));
    let r = c.should_rate_limit(request("edge", &[&[("plan", "free")]], 3)).await.unwrap().into_inner();
    assert_eq!(code(&r), Code::OverLimit, "3 more do not fit in the 2 left: {r:?}");
    let mut req = request("edge", &[&[("plan", "free")]], 3);
    req.descriptors[0].hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 2 });
    let r = c.should_rate_limit(req).await.unwrap().into_inner();
    assert_counted(&r.statuses[0], Code::Ok, limit("", 5, Unit::Second), 0, Duration::from_secs(1));
}

const TWO_LIMITS: &str = r#"
domain: edge
descriptors:
  - key: tenant
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: ip
    rate_limit: { unit: minute, requests_per_unit: 2 }
"#;

#[tokio::test]
async fn all_or_nothing_charges_no_descriptor_of_a_refused_request() {
    let front = Front::start(Some(RedisServer::start()), TWO_LIMITS, "", "");
    let mut c = front.client().await;
    for _ in 0..2 {
        assert_eq!(code(&ask(&mut c, "edge", &[&[("tenant", "t1")], &[("ip", "1.2.3.4")]]).await), Code::Ok);
    }
    for _ in 0..3 {
        let r = ask(&mut c, "edge", &[&[("tenant", "t1")], &[("ip", "1.2.3.4")]]).await;
        assert_eq!(code(&r), Code::OverLimit);
        assert_eq!(Code::try_from(r.statuses[0].code).unwrap(), Code::Ok, "the tenant had room: {r:?}");
        assert_eq!(Code::try_from(r.statuses[1].code).unwrap(), Code::OverLimit);
    }
    // The tenant was charged for the 2 admitted requests only.
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("", 5, Unit::Minute), 2, Duration::from_secs(60));
}

#[tokio::test]
async fn each_mode_decides_descriptors_alone_as_envoyproxy_ratelimit_does() {
    let front = Front::start(Some(RedisServer::start()), TWO_LIMITS, "descriptors = \"each\"", "");
    let mut c = front.client().await;
    for _ in 0..4 {
        ask(&mut c, "edge", &[&[("tenant", "t1")], &[("ip", "1.2.3.4")]]).await;
    }
    // Every request spent the tenant's quota, refused or not.
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("", 5, Unit::Minute), 0, Duration::from_secs(60));
}

#[tokio::test]
async fn nginx_s_socket_and_envoy_share_one_window_exactly() {
    let rest = "[[policy]]\nname = \"per_tenant\"\nlimit = 10\nwindow = \"1m\"\n\n[[envoy.route]]\ndomain = \"edge\"\ndescriptor = [\"tenant\"]\npolicy = \"per_tenant\"\n";
    let front = Front::start(Some(RedisServer::start()), "domain: other\n", "", rest);
    let mut grpc = front.client().await;
    let mut socket = front.daemon.client().await;
    let long_tenant = "t".repeat(600);
    for tenant in ["acme", long_tenant.as_str(), ""] {
        // The Lua client's wire key (lua/resty/ratelimitd/kind.lua, wire_key): long
        // and empty ids hashed.
        let wire = if tenant.is_empty() || tenant.len() > 512 { format!("md5:{:x}", md5_of(tenant)) } else { tenant.to_owned() };
        let mut admitted = 0;
        for i in 0..16 {
            let ok = if i % 2 == 0 {
                let r = socket.check_policy(&PolicyCheckArgs { policy: b"per_tenant", key: wire.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }).await.unwrap();
                r.decision == Decision::Allowed
            } else {
                code(&ask(&mut grpc, "edge", &[&[("tenant", tenant)]]).await) == Code::Ok
            };
            admitted += usize::from(ok);
        }
        assert_eq!(admitted, 10, "tenant of {} bytes: one window of 10 across both fronts", tenant.len());
    }
}

fn md5_of(s: &str) -> u128 {
    use md5::{Digest, Md5};
    u128::from_be_bytes(Md5::digest(s.as_bytes()).into())
}

#[tokio::test]
async fn redis_down_is_decided_by_the_fail_policy() {
    let yaml = "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n";
    for (on_error, expected) in [("open", Code::Ok), ("closed", Code::OverLimit)] {
        let front = Front::start(Some(RedisServer::start()), yaml, &format!("on_error = \"{on_error}\""), "");
        let mut c = front.client().await;
        assert_eq!(code(&ask(&mut c, "edge", &[&[("tenant", "t1")]]).await), Code::Ok);
        let mut front = front;
        front._redis.as_mut().unwrap().kill();
        let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
        assert_eq!(code(&r), expected, "on_error = {on_error}: {r:?}");
        // Nothing was counted: no quota is promised.
        assert!(r.statuses[0].current_limit.is_none(), "{r:?}");
    }
}

#[tokio::test]
async fn headers_in_each_style() {
    for (style, names) in [("ratelimit", ["RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"]), ("x", ["X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"])] {
        let front = Front::start(Some(RedisServer::start()), TWO_LIMITS, &format!("header_style = \"{style}\""), "");
        let mut c = front.client().await;
        let r = ask(&mut c, "edge", &[&[("tenant", "t1")], &[("ip", "1.2.3.4")]]).await;
        let h: Vec<(&str, &str)> = r.response_headers_to_add.iter().map(|h| (h.key.as_str(), h.value.as_str())).collect();
        // The descriptor closest to its limit: ip, 1 of 2 left.
        assert_eq!(h.len(), 3, "{h:?}");
        assert_eq!(h[0], (names[0], "2"));
        assert_eq!(h[1], (names[1], "1"));
        assert!(h[2].0 == names[2] && (1..=60).contains(&h[2].1.parse::<u32>().unwrap()), "{h:?}");
    }
    let front = Front::start(Some(RedisServer::start()), TWO_LIMITS, "header_style = \"draft\"", "");
    let mut c = front.client().await;
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")], &[("ip", "1.2.3.4")]]).await;
    let h: Vec<(&str, &str)> = r.response_headers_to_add.iter().map(|h| (h.key.as_str(), h.value.as_str())).collect();
    assert_eq!(h[0], ("RateLimit-Policy", "\"edge.tenant\";q=5;w=60, \"edge.ip\";q=2;w=60"));
    assert_eq!(h[1].0, "RateLimit");
    assert!(h[1].1.starts_with("\"edge.tenant\";r=4;t=") && h[1].1.contains(", \"edge.ip\";r=1;t="), "{h:?}");
}

#[tokio::test]
async fn hostile_requests_get_an_error_and_touch_no_other_key() {
    let front = Front::start(Some(RedisServer::start()), BASIC, "", "");
    let mut c = front.client().await;
    let invalid = |r: Result<tonic::Response<RateLimitResponse>, tonic::Status>| r.expect_err("refused").code();
    assert_eq!(invalid(c.should_rate_limit(request("", &[&[("tenant", "t1")]], 0)).await), tonic::Code::InvalidArgument);
    assert_eq!(invalid(c.should_rate_limit(request("edge", &[], 0)).await), tonic::Code::InvalidArgument);
    // Thousands of descriptors, thousands of entries, a descriptor limit
    // override: refused before any lookup.
    let many: Vec<&[(&str, &str)]> = vec![&[("tenant", "x")]; 5000];
    assert_eq!(invalid(c.should_rate_limit(request("edge", &many, 0)).await), tonic::Code::InvalidArgument);
    let deep: Vec<(&str, &str)> = vec![("tenant", "x"); 5000];
    assert_eq!(invalid(c.should_rate_limit(request("edge", &[&deep], 0)).await), tonic::Code::InvalidArgument);
    let mut overridden = request("edge", &[&[("tenant", "t1")]], 0);
    overridden.descriptors[0].limit = Some(Default::default());
    assert_eq!(invalid(c.should_rate_limit(overridden).await), tonic::Code::InvalidArgument);
    // A cost above limits.max_cost: the socket's own error.
    let e = c.should_rate_limit(request("edge", &[&[("tenant", "t1")]], 1_000_000)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("INVALID_COST"), "{e:?}");
    // A message over 256 KB: refused by size, not decoded.
    let huge = "v".repeat(300 * 1024);
    let e = c.should_rate_limit(request("edge", &[&[("tenant", huge.as_str())]], 0)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e:?}");
    // A 100 KB value, an empty one, control bytes and one that looks like
    // a hash are keys of their own (hashed as the Lua client does).
    let long = "v".repeat(100 * 1024);
    for v in [long.as_str(), "", "a\u{0}b", "md5:d41d8cd98f00b204e9800998ecf8427e"] {
        for remaining in [2, 1, 0] {
            let r = ask(&mut c, "edge", &[&[("tenant", v)]]).await;
            assert_counted(&r.statuses[0], Code::Ok, limit("", 3, Unit::Minute), remaining, Duration::from_secs(60));
        }
    }
    // Nothing above spent t1's quota.
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("", 3, Unit::Minute), 2, Duration::from_secs(60));
}

#[tokio::test]
async fn invalid_utf8_and_garbage_frames_never_stop_the_service() {
    use tokio::io::AsyncWriteExt;
    let front = Front::start(Some(RedisServer::start()), BASIC, "", "");
    // Not HTTP/2 at all.
    let mut raw = tokio::net::UnixStream::connect(&front.socket).await.unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\xff\x00\xff garbage").await.unwrap();
    drop(raw);
    // A ShouldRateLimit whose domain is not UTF-8 (a message the generated
    // types cannot write): tonic refuses it as INTERNAL, nothing counted.
    let mut grpc = tonic::client::Grpc::new(channel(&front.socket).await);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
    let bad = RawRequest { domain: vec![0xff, 0xfe, b'e'], descriptors: vec![] };
    let e = grpc.unary::<RawRequest, RateLimitResponse, _>(tonic::Request::new(bad), path, tonic_prost::ProstCodec::default()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
    // Still serving.
    let mut c = front.client().await;
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("", 3, Unit::Minute), 2, Duration::from_secs(60));
}

/// `RateLimitRequest` with its string field as bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct RawRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(bytes = "vec", repeated, tag = "2")]
    descriptors: Vec<Vec<u8>>,
}

#[tokio::test]
async fn a_reload_changes_the_limits_the_next_request_sees() {
    let front = Front::start(Some(RedisServer::start()), BASIC, "", "");
    let mut c = front.client().await;
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("", 3, Unit::Minute), 2, Duration::from_secs(60));
    std::fs::write(front.yaml_path(), BASIC.replace("requests_per_unit: 3", "requests_per_unit: 7")).unwrap();
    front.daemon.signal(nix::sys::signal::Signal::SIGHUP);
    common::wait_until("the reload", Duration::from_secs(10), || front.daemon.log().contains("configuration reloaded"));
    let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
    assert_counted(&r.statuses[0], Code::Ok, limit("", 7, Unit::Minute), 5, Duration::from_secs(60));
}

fn check_config(toml: &str, yaml: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rl.yaml"), yaml).unwrap();
    let path = dir.path().join("ratelimitd.toml");
    std::fs::write(&path, format!("[envoy]\nlisten = \"127.0.0.1:8081\"\nconfig = [\"rl.yaml\"]\n{toml}")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(["check-config", "--config"]).arg(&path).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

#[test]
fn misconfigurations_are_refused_at_load_each_named() {
    let (ok, out) = check_config("", BASIC);
    assert!(ok, "{out}");
    let bad = r#"
domain: edge
descriptors:
  - key: tenant
    rate_limit: { unit: fortnight, requests_per_unit: 3 }
  - key: tenant
    rate_limit: { unit: second, requests_per_unit: 3 }
  - key: ip
    rate_limit: { unlimited: true, unit: second }
  - key: q
    quota_mode: true
    rate_limit: { unit: second, requests_per_unit: 3 }
  - key: big
    rate_limit: { unit: second, requests_per_unit: 99999999 }
"#;
    let (ok, out) = check_config("", bad);
    assert!(!ok, "{out}");
    for needle in ["unit 'fortnight'", "a duplicate descriptor", "unlimited takes no unit", "quota_mode is not supported", "edge.big"] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }
    let (ok, out) = check_config("", "domain: edge\ndescriptors:\n  - key: a\n    ratelimit: { unit: second }\n");
    assert!(!ok && out.contains("ratelimit"), "an unknown field is named:\n{out}");
    let (ok, out) = check_config("[[envoy.route]]\ndomain = \"edge\"\ndescriptor = [\"tenant\"]\npolicy = \"nope\"\n", "domain: other\n");
    assert!(!ok && out.contains("policy 'nope' is not a [[policy]]"), "{out}");
    let (ok, out) = check_config("algorithm = \"fixed\"", TWO_LIMITS);
    assert!(!ok && out.contains("all or nothing"), "{out}");
    let (ok, out) = check_config("algorithm = \"fixed\"\ndescriptors = \"each\"", TWO_LIMITS);
    assert!(ok, "{out}");
}

/// Real nginx (the shipped Lua client, a policy limiter) and Envoy's API
/// counting one tenant's requests in one window: exactly the limit
/// admitted, alternating fronts, for a plain id and a 600-byte one (hashed
/// by the Lua client and by the front alike).
#[tokio::test]
async fn nginx_and_the_envoy_api_share_one_limit_exactly() {
    let rest = "[[policy]]\nname = \"per_tenant\"\nlimit = 10\nwindow = \"1m\"\n\n[[envoy.route]]\ndomain = \"edge\"\ndescriptor = [\"tenant\"]\npolicy = \"per_tenant\"\n";
    let front = Front::start(Some(RedisServer::start()), "domain: other\n", "", rest);
    let location = r#"
    location /api {
        access_by_lua_block {
            local lim = assert(require("resty.ratelimitd").new("per_tenant"))
            lim:limit(ngx.var.http_x_tenant)
        }
        content_by_lua_block { ngx.say("ok") }
    }"#;
    let nginx = common::ops::gateway(&front.daemon.socket, "", location);
    let agent = common::http::agent();
    let mut grpc = front.client().await;
    let long_tenant = "t".repeat(600);
    for tenant in ["acme", long_tenant.as_str()] {
        let mut admitted = 0;
        for i in 0..16 {
            let ok = if i % 2 == 0 {
                let url = nginx.url("/api");
                let tenant = tenant.to_owned();
                let status = tokio::task::spawn_blocking({
                    let agent = agent.clone();
                    move || common::http::get(&agent, &url, &[("X-Tenant", tenant.as_str())]).status
                })
                .await
                .unwrap();
                assert!(status == 200 || status == 429, "{status}");
                status == 200
            } else {
                code(&ask(&mut grpc, "edge", &[&[("tenant", tenant)]]).await) == Code::Ok
            };
            admitted += usize::from(ok);
        }
        assert_eq!(admitted, 10, "tenant of {} bytes: one window of 10 across nginx and Envoy", tenant.len());
    }
}

/// The TCP listener (what Envoy's cluster usually names), on a port of
/// the daemon's own: the same answers as the Unix socket's.
#[tokio::test]
async fn the_tcp_listener_answers_as_the_socket_does() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, BASIC).unwrap();
    let redis = RedisServer::start();
    let (daemon, port) = common::ports::on_own_port("ratelimitd envoy.listen", |port| {
        let config = format!("[redis]\nurl = \"{}\"\ntimeout = \"2s\"\n[envoy]\nlisten = \"127.0.0.1:{port}\"\nconfig = [\"{}\"]\n", redis.url(), file.display());
        // A port taken as the daemon binds: it exits 2 (envoy.listen ...).
        Daemon::try_start_config(&config).and_then(|d| if common::ports::listens_on(d.pid(), port) { Ok((d, port)) } else { Err(format!("port {port} is not the daemon's")) })
    });
    let mut c = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}")).await.unwrap();
    for remaining in [2, 1, 0] {
        let r = ask(&mut c, "edge", &[&[("tenant", "t1")]]).await;
        assert_counted(&r.statuses[0], Code::Ok, limit("", 3, Unit::Minute), remaining, Duration::from_secs(60));
    }
    assert_eq!(code(&ask(&mut c, "edge", &[&[("tenant", "t1")]]).await), Code::OverLimit);
    drop(daemon);
}
