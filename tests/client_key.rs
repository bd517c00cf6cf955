//! `resty.ratelimitd.client_key` through real nginx (realip trusting the
//! loopback proxy, X-Forwarded-For), the real daemon and Redis: an IPv6
//! client rotating through its /64 hits one limit, an IPv4 client is the
//! same client as its mapped IPv6 form, and another /64 has its own.

mod common;

use common::http::{agent, get};
use common::{Daemon, Nginx, RedisServer};


const SITE: &str = r#"
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    local client_key = require "resty.ratelimitd.client_key"
    per_net = assert(ratelimitd.new{ policy = "per_client" })
    by_net = assert(client_key.new{ ipv4_prefix = 32, ipv6_prefix = 64 })
}
server {
    listen 127.0.0.1:{PORT};
    # The proxy in front of this server is trusted; what it says the
    # client is, is the client ($remote_addr).
    set_real_ip_from 127.0.0.1;
    real_ip_header X-Forwarded-For;
    real_ip_recursive on;
    location / {
        access_by_lua_block {
            local key, err = by_net:key()
            if not key then
                ngx.log(ngx.WARN, "client key: ", err)
                return ngx.exit(400)
            end
            ngx.header["X-Client-Key"] = key
            return per_net:limit(key)
        }
        content_by_lua_block { ngx.say("ok") }
    }
}
"#;

/// `from(addr)`: a request to `nginx` from the client address `addr`, as
/// the trusted proxy in front says it (X-Forwarded-For); one agent for all.
fn as_client(nginx: &Nginx) -> impl Fn(&str) -> common::http::Reply {
    let http = agent();
    let url = nginx.url("/");
    move |addr| get(&http, &url, &[("X-Forwarded-For", addr)])
}

/// A daemon (limit 3 per key) and nginx with `SITE`.
fn gateway() -> (RedisServer, Daemon, Nginx) {
    let redis = RedisServer::start_unix();
    let d = common::ops::daemon(&redis, &common::rate_policies(&[("per_client", 3, "60s")]));
    let snippet = common::ops::snippet(&d.socket);
    let nginx = Nginx::start(&format!("{snippet}\n{SITE}"));
    (redis, d, nginx)
}

#[test]
fn ipv4_clients_in_their_ipv6_forms_are_their_ipv4_selves_not_one_shared_64() {
    let (_redis, _d, nginx) = gateway();
    let from = as_client(&nginx);
    // One IPv4 client natively, through NAT64/SIIT (RFC 6052's 64:ff9b::/96)
    // and IPv4-translated (::ffff:0:a.b.c.d): one key, one limit.
    let native = from("198.51.100.20");
    assert_eq!((native.status, native.header("x-client-key")), (200, "ip4:198.51.100.20/32"));
    let nat64 = from("64:ff9b::198.51.100.20");
    assert_eq!((nat64.status, nat64.header("x-client-key")), (200, "ip4:198.51.100.20/32"));
    let translated = from("::ffff:0:198.51.100.20");
    assert_eq!((translated.status, translated.header("x-client-key")), (200, "ip4:198.51.100.20/32"));
    assert_eq!(from("64:ff9b::c633:6414").status, 429, "the fourth from the same IPv4 client");
    // Behind SIIT-DC every IPv4 client is its own, not one /64.
    for i in 1..=4 {
        let r = from(&format!("64:ff9b::203.0.113.{i}"));
        assert_eq!((r.status, r.header("x-client-key")), (200, format!("ip4:203.0.113.{i}/32").as_str()));
    }
    // IPv4-compatible ::a.b.c.d is not ::1's key.
    let compat = from("::192.0.2.9");
    assert_eq!((compat.status, compat.header("x-client-key")), (200, "ip4:192.0.2.9/32"));
    assert_eq!(from("::1").header("x-client-key"), "ip6:0:0:0:0::/64");
    // Two Teredo clients of one relay (RFC 4380's example server): each its
    // NAT's public IPv4 (the last 32 bits inverted), not the relay's /64.
    let a = from("2001:0:4136:e378:8000:63bf:3fff:fdd2");
    let b = from("2001:0:4136:e378:8000:63bf:3fff:fdd1");
    assert_eq!((a.header("x-client-key"), b.header("x-client-key")), ("ip4:192.0.2.45/32", "ip4:192.0.2.46/32"));
    assert!(!nginx.error_log().contains("[error]"), "{}", nginx.error_log());
}

#[test]
fn an_ipv6_client_rotating_through_its_64_hits_one_limit_and_mapped_ipv4_is_its_ipv4_self() {
    let (_redis, _d, nginx) = gateway();
    let from = as_client(&nginx);

    // Four addresses of one /64: three pass, the fourth is refused.
    let statuses: Vec<u16> = ["2001:db8:0:1::1", "2001:db8:0:1::2", "2001:db8:0:1:dead:beef:0:1", "2001:db8:0:1:ffff:ffff:ffff:ffff"].iter().map(|a| from(a).status).collect();
    assert_eq!(statuses, vec![200, 200, 200, 429]);
    assert_eq!(from("2001:db8:0:1::77").status, 429, "any other address of the /64 too");
    let other = from("2001:db8:0:2::1");
    assert_eq!((other.status, other.header("x-client-key")), (200, "ip6:2001:db8:0:2::/64"), "another /64 is another client");

    // IPv4 and its mapped IPv6 form: one client.
    let v4 = from("203.0.113.7");
    assert_eq!((v4.status, v4.header("x-client-key")), (200, "ip4:203.0.113.7/32"));
    assert_eq!(from("::ffff:203.0.113.7").status, 200);
    assert_eq!(from("203.0.113.7").status, 200);
    assert_eq!(from("::ffff:203.0.113.7").status, 429, "the fourth from the same IPv4 client");

    // What realip does not take stays the proxy's address: a key, not a 500.
    let garbage = from("not-an-address");
    assert_eq!((garbage.status, garbage.header("x-client-key")), (200, "ip4:127.0.0.1/32"));
    assert!(!nginx.error_log().contains("[error]"), "{}", nginx.error_log());
}
