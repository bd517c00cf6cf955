//! What the nginx matrices share (tests/nginx_matrix.rs,
//! nginx_matrix_wave2.rs): every case is a limiter kind crossed with every
//! header style and every redirect kind, one location each; and what Redis
//! recorded of a case's key.

use super::RedisServer;

pub const STYLES: [&str; 3] = ["ratelimit", "draft", "x"];

/// How a case's request leaves the location whose access phase decided it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Redirect {
    None,
    ErrorPage,
    TryFiles,
    Exec,
}

pub const REDIRECTS: [Redirect; 4] = [Redirect::None, Redirect::ErrorPage, Redirect::TryFiles, Redirect::Exec];

impl Redirect {
    /// The location's lines after its access phase: the answer "ok", or an
    /// internal redirect to the server's `@ok` or `/ok`.
    pub fn then(self) -> &'static str {
        match self {
            Redirect::None => "content_by_lua_block { ngx.say(\"ok\") }",
            // The static file is missing: 404, served by @ok.
            Redirect::ErrorPage => "error_page 404 = @ok;",
            Redirect::TryFiles => "try_files $uri /ok;",
            Redirect::Exec => "content_by_lua_block { return ngx.exec(\"/ok\") }",
        }
    }
}

/// One location of a matrix: a limiter kind of the matrix's own, a header
/// style and a redirect kind.
#[derive(Clone, Debug)]
pub struct Case<K> {
    pub id: usize,
    pub kind: K,
    pub style: &'static str,
    pub redirect: Redirect,
}

/// Every kind x every style x every redirect kind, numbered from 0.
pub fn cases<K: Clone>(kinds: &[K]) -> Vec<Case<K>> {
    let mut out = Vec::new();
    for kind in kinds {
        for style in STYLES {
            for redirect in REDIRECTS {
                out.push(Case { id: out.len(), kind: kind.clone(), style, redirect });
            }
        }
    }
    out
}

/// The members of every sorted set of client key `key` in Redis (one per
/// admission the log recorded).
pub fn recorded(redis: &RedisServer, key: &str) -> u64 {
    let mut conn = redis.conn();
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg(format!("*{key}}}*")).query(&mut conn).unwrap();
    let mut members = 0;
    for k in &keys {
        if redis::cmd("TYPE").arg(k.as_slice()).query::<String>(&mut conn).unwrap() == "zset" {
            members += redis::cmd("ZCARD").arg(k.as_slice()).query::<u64>(&mut conn).unwrap();
        }
    }
    members
}
