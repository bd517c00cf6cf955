//! The benchmark scripts call the daemon's Redis scripts themselves
//! (`redis-benchmark EVALSHA ...` as a baseline, replays in Python, the
//! direct path in Lua). When the daemon changes the scripts' arguments,
//! a script left behind measures error replies instead (scripts/bench-hop
//! did, after coalescing changed the order). These tests hold every
//! EVALSHA in scripts/ to one order, the one `src/redis/window.rs` sends and
//! the `.lua` headers document, and run the literal ones on a real Redis.

mod common;

use std::path::PathBuf;

use common::repo::{read, root};
use common::RedisServer;

/// The window scripts' arguments after KEYS[1], in order.
const ORDER: [Role; 5] = [Role::Window, Role::Now, Role::Member, Role::Limit, Role::Cost];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Window,
    Now,
    Member,
    Limit,
    Cost,
}

fn is_int(t: &str) -> bool {
    !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit())
}

/// Whether an argument as a script writes it (a literal, a variable, an
/// expression) can be `role`. Variables and expressions are read by name;
/// literals by kind (a member is never a bare number, `now` is 0 or a time).
fn fits(role: Role, token: &str) -> bool {
    let t = token.trim_matches(|c| c == '"' || c == '\'');
    let lower = t.to_ascii_lowercase();
    let named = |names: &[&str]| names.iter().any(|n| lower.contains(n));
    match role {
        Role::Window => is_int(t) && t != "0" || named(&["window"]),
        Role::Now => t == "0" || named(&["now", "t0", "10**12", "time"]),
        Role::Member => !t.contains('$') && !is_int(t) && !named(&["window", "limit", "cost"]) || named(&["member", "%d", "seq"]),
        Role::Limit => is_int(t) && t != "0" || named(&["limit"]),
        // A call may ask for cost = limit to read the count (bench-algorithms-redis).
        Role::Cost => is_int(t) && t != "0" || named(&["cost", "limit"]),
    }
}

/// One EVALSHA of a window script found in a script file.
#[derive(Debug)]
struct Call {
    at: String,
    /// A shell command line (its literals can be run as they are).
    shell: bool,
    /// Everything after `EVALSHA`: the SHA, numkeys, the key, the ARGV.
    args: Vec<String>,
}

/// What a character outside quotes and brackets does to the words.
enum Outside {
    Split,
    End,
    Keep,
}

/// The words of `text`, quotes kept: a quoted run, and anything between
/// an `open` bracket and its `close`, is part of its word; outside them
/// `outside` says whether a character splits two words, ends the text or
/// is part of its word. An unbalanced closing bracket ends the text.
fn words(text: &str, open: &[char], close: &[char], outside: impl Fn(char) -> Outside) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let (mut quote, mut depth) = (None::<char>, 0usize);
    fn end_word(word: &mut String, out: &mut Vec<String>) {
        let w = std::mem::take(word);
        if !w.trim().is_empty() {
            out.push(w.trim().to_string());
        }
    }
    for c in text.chars() {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
        } else if c == '"' || c == '\'' {
            quote = Some(c);
        } else if open.contains(&c) {
            depth += 1;
        } else if close.contains(&c) {
            if depth == 0 {
                break;
            }
            depth -= 1;
        } else if depth == 0 {
            match outside(c) {
                Outside::Split => {
                    end_word(&mut word, &mut out);
                    continue;
                }
                Outside::End => break,
                Outside::Keep => {}
            }
        }
        word.push(c);
    }
    end_word(&mut word, &mut out);
    out
}

/// Shell words of `line`, quotes kept, `$(( ... ))` and `$( ... )` one
/// word; ends at `|`, `;`, `>` or an unbalanced `)`.
fn shell_words(line: &str) -> Vec<String> {
    words(line, &['('], &[')'], |c| match c {
        '|' | ';' | '>' => Outside::End,
        c if c.is_whitespace() => Outside::Split,
        _ => Outside::Keep,
    })
}

/// The arguments of a Python call or tuple after `"EVALSHA",`, split at
/// the commas of its own level, up to its closing parenthesis.
fn python_args(rest: &str) -> Vec<String> {
    words(rest, &['(', '['], &[')', ']'], |c| if c == ',' { Outside::Split } else { Outside::Keep })
}

/// Every EVALSHA with one key in the shell and Python code of scripts/
/// (comments and strings that merely name EVALSHA are not calls: a call's
/// next word names a SHA).
fn calls() -> Vec<Call> {
    let files: Vec<PathBuf> = common::repo::files_under("scripts", "").iter().map(|f| root().join(f)).collect();
    let mut out = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        let rel = file.strip_prefix(root()).unwrap().display().to_string();
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with('#') || code.starts_with("--") {
                continue;
            }
            let at = format!("{rel}:{}", n + 1);
            if let Some(i) = line.find("\"EVALSHA\",") {
                let args = python_args(&line[i + "\"EVALSHA\",".len()..]);
                if args.first().is_some_and(|a| a.to_ascii_lowercase().contains("sha")) && args.get(1).map(String::as_str) == Some("1") {
                    out.push(Call { at, shell: false, args });
                }
            } else if let Some(i) = line.find("EVALSHA ") {
                let args = shell_words(&line[i + "EVALSHA ".len()..]);
                if args.first().is_some_and(|a| a.to_ascii_lowercase().contains("sha")) && args.get(1).map(String::as_str) == Some("1") {
                    out.push(Call { at, shell: true, args });
                }
            }
        }
    }
    out
}

/// Whether `args` (after EVALSHA) send the ARGV in `ORDER`; the reason if not.
fn check(args: &[String]) -> Result<(), String> {
    let argv = args.get(3..).ok_or("no arguments after the key")?;
    if argv.len() != ORDER.len() {
        return Err(format!("{} arguments after the key, the window scripts take {} (window, now, member, limit, cost)", argv.len(), ORDER.len()));
    }
    for (role, arg) in ORDER.iter().zip(argv) {
        if !fits(*role, arg) {
            return Err(format!("`{arg}` where the script reads {role:?} (order: window, now, member, limit, cost)"));
        }
    }
    Ok(())
}

#[test]
fn the_scripts_headers_and_code_read_their_arguments_in_the_order_the_daemon_sends() {
    // What the daemon sends: src/redis/window.rs, a single check.
    let rust = read("src/redis/window.rs");
    let body = &rust[rust.find("pub async fn check_at_with").expect("window.rs: fn check_at_with")..];
    let body = &body[body.find(".arg(\"EVALSHA\")").expect("check_at_with: EVALSHA")..];
    let body = &body[..body.find(';').unwrap()];
    let sent: Vec<&str> = body.split(".arg(").skip(1).map(|a| a.rsplit_once(')').map_or(a, |(x, _)| x).trim()).collect();
    assert_eq!(sent.len(), 9, "\"EVALSHA\", sha, numkeys, key, then 5: {sent:?}");
    let rust_role = |role: Role, expr: &str| match role {
        Role::Window => expr.contains("window_ms"),
        Role::Now => expr.contains("now"),
        Role::Member => expr.contains("member"),
        Role::Limit => expr.contains("limit"),
        Role::Cost => expr.contains("cost"),
    };
    for (role, expr) in ORDER.iter().zip(&sent[4..]) {
        assert!(rust_role(*role, expr), "src/redis/window.rs check_at_with sends `{expr}` where {role:?} is expected: update ORDER, the .lua headers and every script in scripts/");
    }
    // What the scripts document and read.
    for script in ["sliding_window", "ring", "gcra", "sliding_counter", "fixed_window"] {
        let lua = common::scripts::named(script);
        let doc = |prefix: &str| lua.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{script}.lua: no `{prefix}` line in its header")).to_string();
        for (prefix, what) in [("-- ARGV[1] ", "window"), ("-- ARGV[2] ", "now"), ("-- ARGV[3] ", "member"), ("-- ARGV[4], ARGV[5] ", "limit and cost")] {
            assert!(doc(prefix).contains(what), "{script}.lua documents `{}`, the daemon sends {what} there", doc(prefix));
        }
        // The log script reads request j's fields at an offset `o` (1 in
        // its mode 'L') and a stride `s` (3 in its mode 'B'); 0 and 2 for a
        // check, which gives the others' 2 + 2 * j and 3 + 2 * j, read by
        // parts/answer.lua's `request(j)` and handed to each algorithm's
        // decision of one request by parts/each_request.lua.
        let fields = if script == "sliding_window" {
            ["local limit = tonumber(ARGV[2 + o + s * j])", "local cost = tonumber(ARGV[3 + o + s * j])"]
        } else {
            ["return tonumber(ARGV[2 + 2 * j]), tonumber(ARGV[3 + 2 * j])", "answer(out, decide(request(j)))"]
        };
        if script == "sliding_window" {
            assert!(lua.contains("local lease, batch, o, s = ARGV[1] == 'L', ARGV[1] == 'B', 0, 2"), "sliding_window.lua: a check reads its fields at o = 0, s = 2");
        }
        // The log reads its clock at ARGV[3] in mode 'L' only.
        let now = if script == "sliding_window" { "local now = tonumber(ARGV[mode == 'L' and 3 or 2])" } else { "local now = tonumber(ARGV[2])" };
        for code in ["local window = tonumber(ARGV[1])", now, fields[0], fields[1]] {
            assert!(lua.contains(code), "{script}.lua does not read `{code}`");
        }
        if script != "sliding_window" {
            assert!(lua.contains("local out = each_request(n, function(limit, cost)"), "{script}.lua: its decision of one request takes (limit, cost) in that order");
        }
    }
}

#[test]
fn every_evalsha_in_the_scripts_sends_the_daemons_order() {
    let calls = calls();
    // The known callers, so that a reader that finds nothing fails too.
    for file in ["scripts/bench:", "scripts/bench-hop:", "scripts/bench-compare:", "scripts/bench-redis-cost:", "scripts/bench-algorithms-redis:", "scripts/bench-algorithms.d/replay.py:"] {
        assert!(calls.iter().any(|c| c.at.starts_with(file)), "no EVALSHA found in {file} {calls:#?}");
    }
    let wrong: Vec<String> = calls.iter().filter_map(|c| check(&c.args).err().map(|why| format!("{}: {why}", c.at))).collect();
    assert!(wrong.is_empty(), "scripts calling a window script with the arguments out of order:\n{}", wrong.join("\n"));
    // The direct path builds its command in pieces: window and now, then
    // the member, then limit and cost.
    let lua = read("scripts/bench-compare.d/direct.lua");
    assert!(lua.contains("args = bulk(window_ms) .. bulk(0),") && lua.contains("tail = bulk(limit) .. bulk(1),"), "scripts/bench-compare.d/direct.lua");
    let send = &lua[lua.find("sock:send({ self.head").expect("direct.lua: the EVALSHA send")..];
    let at = |piece: &str| send.find(piece).unwrap_or_else(|| panic!("direct.lua's send has no {piece}"));
    assert!(at("self.head") < at("self.key_tail") && at("self.key_tail") < at("self.args") && at("self.args") < at("member, ") && at("member, ") < at("self.tail"), "direct.lua sends its pieces out of order");
}

#[test]
fn the_reader_catches_the_order_bench_hop_used_before_coalescing() {
    let old = shell_words(r#""$SHA" 1 "ratelimitd:{rb-hop}:1000ms" 1000000 1000 1 "rb:__rand_int__" 0 |"#);
    let why = check(&old).unwrap_err();
    assert!(why.contains("`1000` where the script reads Now"), "{why}");
    assert!(check(&shell_words(r#""$SHA" 1 "k" 1000 0 "rb:__rand_int__" "$limit" 1"#)).is_ok());
    assert_eq!(python_args(r#" shas[algorithm], 1, key, WINDOW, t0 + t, "m%d" % i, LIMIT, cost) for i"#).len(), 8);
}

#[test]
fn the_literal_evalsha_calls_admit_on_a_real_redis_as_the_daemon_would() {
    let redis = RedisServer::start_unix();
    let mut conn = redis.conn();
    let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(common::scripts::LOG).query(&mut conn).unwrap();
    let mut ran = 0;
    for call in calls().into_iter().filter(|c| c.shell) {
        // The literal ones: no variable but the SHA (and a key's `$1`).
        let unquote = |a: &str| a.trim_matches(|c| c == '"' || c == '\'').replace("__rand_int__", "7").replace("$1", "x");
        let argv: Vec<String> = call.args[2..].iter().map(|a| unquote(a)).collect();
        if argv.iter().any(|a| a.contains('$') || a.contains('(')) {
            continue;
        }
        let (key, window, member) = (&argv[0], &argv[1], &argv[3]);
        let _: () = redis::cmd("DEL").arg(key).query(&mut conn).unwrap();
        let reply: Result<Vec<i64>, _> = redis::cmd("EVALSHA").arg(&sha).arg(1).arg(&argv).query(&mut conn);
        let reply = reply.unwrap_or_else(|e| panic!("{}: the script answered an error: {e}", call.at));
        assert_eq!(reply[..2], [1, 1], "{}: the first call on a fresh key admits, count 1: {reply:?}", call.at);
        let score: Option<f64> = redis::cmd("ZSCORE").arg(key).arg(member).query(&mut conn).unwrap();
        assert!(score.is_some(), "{}: member `{member}` recorded in `{key}`", call.at);
        let ttl: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).unwrap();
        let window: i64 = window.parse().unwrap();
        assert!(ttl > 0 && ttl <= window, "{}: the key expires with its window ({window} ms): PTTL {ttl}", call.at);
        assert!(key.ends_with(&format!(":{window}ms")), "{}: the key `{key}` names another window than {window} ms (the daemon's layout, src/redis/window.rs WindowKey)", call.at);
        ran += 1;
    }
    assert!(ran >= 4, "bench-hop, bench-compare and bench-redis-cost's two: {ran} run");
}

/// The commands Redis ran since the last `CONFIG RESETSTAT`, by name, from
/// `INFO commandstats` (which counts the commands scripts run too).
fn commands_run(conn: &mut redis::Connection) -> std::collections::BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let calls = rest.split(',').find_map(|f| f.strip_prefix("calls="))?.parse().ok()?;
            Some((name.to_string(), calls))
        })
        .filter(|(name, _)| !["evalsha", "info"].contains(&name.as_str()) && !name.starts_with("config"))
        .collect()
}

#[test]
fn an_admission_on_a_key_without_a_lease_issues_what_it_issued_before_leases() {
    // Before quota leases an admitting call ran ZREMRANGEBYSCORE, ZCARD,
    // ZADD and one PEXPIRE (and TIME); leases added a PTTL to every admission. Now it
    // is one PEXPIRE again (GT once the key exists), in every kind of call.
    let redis = RedisServer::start_unix();
    let mut conn = redis.conn();
    let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(common::scripts::LOG).query(&mut conn).unwrap();
    let run = |conn: &mut redis::Connection, keys: &[&str], argv: &[&str]| -> Vec<i64> {
        let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(conn).unwrap();
        let reply: Vec<i64> = redis::cmd("EVALSHA").arg(&sha).arg(keys.len()).arg(keys).arg(argv).query(conn).unwrap();
        reply
    };
    let counts = |pairs: &[(&str, u64)]| pairs.iter().map(|(n, c)| (n.to_string(), *c)).collect::<std::collections::BTreeMap<_, _>>();
    let admitted = counts(&[("time", 1), ("zremrangebyscore", 1), ("zcard", 1), ("zadd", 1), ("pexpire", 1)]);
    for (what, argv) in [("a new key", ["1000", "0", "a1", "10", "1"]), ("a key with admissions", ["1000", "0", "a2", "10", "1"])] {
        assert_eq!(run(&mut conn, &["w:{a}:1000ms"], &argv)[0], 1);
        assert_eq!(commands_run(&mut conn), admitted, "a single check on {what}");
    }
    let batch = run(&mut conn, &["w:{a}:1000ms"], &["1000", "0", "a3", "10", "1", "10", "2"]);
    assert_eq!(batch[0] + batch[5], 2);
    assert_eq!(commands_run(&mut conn), counts(&[("time", 1), ("zremrangebyscore", 1), ("zcard", 1), ("zadd", 2), ("pexpire", 1)]), "a coalesced batch: one clean-up and one PEXPIRE for the key, a ZADD per admission");
    let cold = run(&mut conn, &["w:{a}:1000ms", "w:{b}:1000ms"], &["B", "0", "b1", "1000", "10", "1", "1000", "10", "1"]);
    assert_eq!((cold[0], cold[5]), (1, 1));
    assert_eq!(commands_run(&mut conn), counts(&[("time", 1), ("zremrangebyscore", 2), ("zcard", 2), ("zadd", 2), ("pexpire", 2)]), "mode 'B': once per key");
    let all = run(&mut conn, &["w:{a}:1000ms", "w:{c}:1000ms"], &["m", "0", "m1", "0", "1000", "10", "1", "0", "1", "1000", "10", "1", "0", "2"]);
    assert_eq!(all[0], 1);
    assert_eq!(commands_run(&mut conn), counts(&[("time", 1), ("zremrangebyscore", 2), ("zcard", 2), ("zadd", 2), ("pexpire", 2)]), "mode 'm': once per key");
    // A key holding a lease keeps the lease's longer expiry through later
    // admissions on every path.
    let lease = run(&mut conn, &["w:{l}:1000ms"], &["L", "1000", "0", "l1", "100", "1", "16", "250"]);
    assert_eq!((lease[0], lease[5]), (1, 16));
    for argv in [&["1000", "0", "l2", "100", "1"][..], &["B", "0", "l3", "1000", "100", "1"], &["m", "0", "l4", "0", "1000", "100", "1", "0", "1"]] {
        assert_eq!(run(&mut conn, &["w:{l}:1000ms"], argv)[0], 1);
        let ttl: i64 = redis::cmd("PTTL").arg("w:{l}:1000ms").query(&mut conn).unwrap();
        assert!(ttl > 1000, "{argv:?} shortened the expiry of a key holding a lease to {ttl} ms (window 1000, life 250)");
    }
    let ttl: i64 = redis::cmd("PTTL").arg("w:{a}:1000ms").query(&mut conn).unwrap();
    assert!(ttl > 0 && ttl <= 1000, "a key without a lease expires with its window: {ttl}");
}
