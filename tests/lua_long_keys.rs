//! The Lua client's hashed keys through real nginx, the real daemon and
//! Redis: a key too long to send (or empty, or with control bytes) is sent
//! as `md5:<hex>`, and no key a client sends can be that text: one that
//! begins with `md5:` is hashed too (docs/NGINX.md section 5), so a client
//! cannot spend another tenant's window, or every keyless request's, by
//! sending the hash it would be sent as.

mod common;

use common::http::{agent, get};
use common::ops::{daemon, gateway};
use common::RedisServer;

const POLICY: &str = "[[policy]]\nname = \"per_tenant\"\nlimit = 2\nwindow = \"60s\"\n";

const HTTP: &str = r#"
init_worker_by_lua_block {
    per_tenant = assert(require("resty.ratelimitd").new{ policy = "per_tenant", on_error = "closed" })
}
"#;

const LOCATIONS: &str = r#"
    location /t {
        access_by_lua_block { return per_tenant:limit(ngx.var.http_x_tenant) }
        content_by_lua_block { ngx.say("ok") }
    }
    location /md5 {
        content_by_lua_block { ngx.print(ngx.md5(ngx.var.http_x_tenant or "")) }
    }
"#;

#[test]
fn a_literal_md5_key_does_not_spend_the_window_of_the_key_it_is_the_hash_of() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis, POLICY);
    let nginx = gateway(&d.socket, HTTP, LOCATIONS);
    let http = agent();
    let (url, md5_url) = (nginx.url("/t"), nginx.url("/md5"));
    let as_tenant = |tenant: Option<&str>| {
        let headers: Vec<(&str, &str)> = tenant.map(|t| vec![("X-Tenant", t)]).unwrap_or_default();
        get(&http, &url, &headers).status
    };
    let long = "t".repeat(600);
    let empty_hash = format!("md5:{}", get(&http, &md5_url, &[]).body);
    let long_hash = format!("md5:{}", get(&http, &md5_url, &[("X-Tenant", &long)]).body);
    assert_eq!(empty_hash, "md5:d41d8cd98f00b204e9800998ecf8427e");

    // The 600-byte tenant and the keyless requests use their windows up.
    assert_eq!([as_tenant(Some(&long)), as_tenant(Some(&long)), as_tenant(Some(&long))], [200, 200, 429]);
    assert_eq!([as_tenant(None), as_tenant(None), as_tenant(None)], [200, 200, 429]);
    // Their hashes sent literally are windows of their own.
    assert_eq!([as_tenant(Some(&long_hash)), as_tenant(Some(&long_hash)), as_tenant(Some(&long_hash))], [200, 200, 429], "{long_hash} spent the long tenant's window");
    assert_eq!([as_tenant(Some(&empty_hash)), as_tenant(Some(&empty_hash)), as_tenant(Some(&empty_hash))], [200, 200, 429], "{empty_hash} spent the keyless window");
    assert!(!nginx.error_log().contains("[error]"), "{}", nginx.error_log());
}
