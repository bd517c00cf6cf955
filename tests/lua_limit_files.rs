//! Issue 36, "a Lua client readable in a sitting": a policy limiter's
//! `limit()` runs code of 8 Lua files or fewer. Counted at run time, not by
//! reading requires: real nginx (the shipped snippet, its shared dict for
//! worker shares), a real daemon with quota leases and a real Redis; in
//! access_by_lua, `lim:limit(key)` is wrapped in a call hook
//! (`debug.sethook(fn, "c")`) that collects the source file of every Lua
//! function called, in the request's own coroutine, under resty/ratelimitd.
//! The union is taken over the request paths a reader must follow: a cold
//! key asked of the daemon, a hot key admitted from a worker share, a
//! refusal (limit() ends the request: the files are read in the header
//! filter), and the daemon down with on_error = "local" (the client's own
//! local quota). The policies are described by the worker-start verifier
//! (verify_policies(), in a timer: not inside limit()), as a shipped
//! configuration does. JIT compilation is off in this nginx: a call inlined
//! into a compiled trace would run no hook.

mod common;

use std::collections::BTreeSet;

use common::http::{agent, get};
use common::{ops, RedisServer};

/// The bound the issue sets.
const MAX_FILES: usize = 8;

const POLICIES: &str = "[[policy]]\nname = \"hot\"\nlimit = 100000\nwindow = \"1m\"\n\
[[policy]]\nname = \"tight\"\nlimit = 2\nwindow = \"1m\"\n";

const HTTP: &str = r#"
init_worker_by_lua_block {
    -- Every call runs in the interpreter, so the hook sees it.
    require("jit").off()
    require("jit").flush()
    local ratelimitd = require "resty.ratelimitd"
    counted = {
        hot = assert(ratelimitd.new{ policy = "hot", on_error = "local", local_limit = 1000 }),
        tight = assert(ratelimitd.new{ policy = "tight", on_error = "local", local_limit = 1000 }),
    }
    assert(ratelimitd.verify_policies())
    -- The files of resty/ratelimitd a call hook saw, in the coroutine `co`.
    function files_hook(co, files)
        local running, getinfo, match = coroutine.running, debug.getinfo, string.match
        return function()
            if running() ~= co then
                return
            end
            local info = getinfo(2, "S")
            local file = info and match(info.source, "(resty/ratelimitd[%w_/]*%.lua)$")
            if file then
                files[file] = true
            end
        end
    end
    function files_header(files)
        local list = {}
        for file in pairs(files) do
            list[#list + 1] = file
        end
        table.sort(list)
        return table.concat(list, " ")
    end
}
"#;

const LOCATIONS: &str = r#"
    location / {
        access_by_lua_block {
            local lim = counted[ngx.var.arg_p]
            local files = {}
            ngx.ctx.files = files
            debug.sethook(files_hook(coroutine.running(), files), "c")
            local res = lim:limit(ngx.var.arg_k)
            debug.sethook()
            ngx.header["X-Source"] = res and res.source or "-"
            ngx.header["X-Shared"] = res and res.shared and "1" or "0"
        }
        header_filter_by_lua_block {
            -- After a refusal limit() never returned: the hook is still set.
            debug.sethook()
            if ngx.ctx.files then
                ngx.header["X-Files"] = files_header(ngx.ctx.files)
            end
        }
        content_by_lua_block { ngx.say("ok") }
    }
"#;

/// One request of limiter `p` for key `k`: its status, the decision's
/// source, whether a worker share admitted it, and the files limit() ran.
fn ask(a: &ureq::Agent, nginx: &common::Nginx, p: &str, k: &str) -> (u16, String, bool, Vec<String>) {
    let r = get(a, &nginx.url(&format!("/?p={p}&k={k}")), &[]);
    let files = r.header("X-Files").split(' ').filter(|f| !f.is_empty()).map(str::to_string).collect();
    (r.status, r.header("X-Source").to_string(), r.header("X-Shared") == "1", files)
}

#[test]
fn a_policy_limiters_limit_runs_code_of_eight_lua_files_or_fewer() {
    let redis = RedisServer::start();
    let server = ops::socket_access();
    let mut d = common::Daemon::start_config(&format!("{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\nquota_leases = true\n{POLICIES}", redis.url()));
    let nginx = ops::gateway(&d.socket, HTTP, LOCATIONS);
    let a = agent();
    let mut union = BTreeSet::new();
    let mut paths = Vec::new();

    // A cold key, asked of the daemon.
    let (status, source, shared, files) = ask(&a, &nginx, "hot", "cold");
    assert_eq!((status, source.as_str(), shared), (200, "redis", false), "a cold key: {files:?}");
    paths.push(("cold key, asked of the daemon", files.clone()));
    union.extend(files);

    // A hot key, until a worker share admits it (both workers' requests
    // count; the ones before it ask the daemon and top the share up).
    let mut from_share = None;
    for _ in 0..400 {
        let (status, _, shared, files) = ask(&a, &nginx, "hot", "hot");
        assert_eq!(status, 200);
        union.extend(files.iter().cloned());
        if shared {
            from_share = Some(files);
            break;
        }
    }
    let from_share = from_share.expect("a hot key admitted from a worker share within 400 requests");
    paths.push(("hot key, from a worker share", from_share));

    // A refusal: the daemon's, past the limit of 2.
    let mut refused = None;
    for _ in 0..4 {
        let (status, _, _, files) = ask(&a, &nginx, "tight", "t");
        union.extend(files.iter().cloned());
        if status == 429 {
            refused = Some(files);
            break;
        }
    }
    paths.push(("refused", refused.expect("a refusal after the limit of 2")));

    // The daemon down: on_error = "local", the client's own quota.
    d.terminate();
    let (status, source, _, files) = ask(&a, &nginx, "hot", "down");
    assert_eq!((status, source.as_str()), (200, "lua_local"), "daemon down, on_error local: {files:?}");
    paths.push(("daemon down, on_error = \"local\"", files.clone()));
    union.extend(files);

    for (path, files) in &paths {
        eprintln!("{path}: {} files: {}", files.len(), files.join(" "));
    }
    eprintln!("limit() of a policy limiter, all paths: {} files: {}", union.len(), union.iter().cloned().collect::<Vec<_>>().join(" "));
    for (path, files) in &paths {
        assert!(!files.is_empty(), "the hook saw no file on the path '{path}'");
    }
    assert!(union.len() <= MAX_FILES, "limit() of a policy limiter runs code of {} files, more than {MAX_FILES}: {union:?}", union.len());
}
