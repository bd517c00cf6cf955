//! `resty.ratelimitd.client_key` through real nginx (realip trusting the
//! loopback proxy, X-Forwarded-For), the real daemon and Redis: an IPv6
//! client rotating through its /64 hits one limit, an IPv4 client is the
//! same client as its mapped IPv6 form, and another /64 has its own.

mod common;

use common::http::{agent, get};
use common::{is_root, Daemon, Nginx, RedisServer, WORKER_GROUP};

const SNIPPET: &str = include_str!("../nginx/ratelimitd.conf");

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

#[test]
fn an_ipv6_client_rotating_through_its_64_hits_one_limit_and_mapped_ipv4_is_its_ipv4_self() {
    let redis = RedisServer::start_unix();
    let server = if is_root() { format!("socket_mode = \"0660\"\nsocket_group = \"{WORKER_GROUP}\"") } else { "socket_mode = \"0660\"".into() };
    let d = Daemon::start_config(&format!("{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n[[policy]]\nname = \"per_client\"\nlimit = 3\nwindow = \"60s\"\n", redis.url()));
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1).replacen("read_timeout = 50,", "read_timeout = 1000,", 1);
    let nginx = Nginx::start(&format!("{snippet}\n{SITE}"));
    let http = agent();
    let url = nginx.url("/");
    let from = |addr: &str| get(&http, &url, &[("X-Forwarded-For", addr)]);

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
