//! The policy names an nginx configuration asks ratelimitd for, for
//! `ratelimitd check-config --nginx`: `nginx -t` cannot see the daemon's
//! TOML, and a name missing from it is an outage of that location.
//!
//! A reader of the Lua client's calls, not a Lua parser: it finds the
//! literal names of `new("name")`, `new "name"`, `policy = "name"` and
//! `policies = { "a", "b" }` in the file, in the files it `include`s (a `*`
//! in the last part of the path is expanded) and in `*_by_lua_file` files.
//! A name built at run time (a variable) is not seen: `describe` at worker
//! start (the Lua client) covers those.

use std::path::{Path, PathBuf};

/// One literal policy name and where it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPolicy {
    pub name: String,
    pub file: PathBuf,
    pub line: usize,
}

/// Why the nginx configuration could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {err}")]
pub struct NginxReadError {
    pub path: PathBuf,
    pub err: std::io::Error,
}

/// Every literal policy name in `conf` and the files it includes.
pub fn nginx_policy_names(conf: &Path) -> Result<Vec<NamedPolicy>, NginxReadError> {
    read_all(conf, names_in)
}

/// The literal policy names of the limiters built with `settle = true` in
/// `conf` and the files it includes: each must be one a reserve can name
/// (`reserve_refusal`).
pub fn nginx_settle_policy_names(conf: &Path) -> Result<Vec<NamedPolicy>, NginxReadError> {
    read_all(conf, settle_names_in)
}

/// The names in the constructor tables (`new{ ... }`, `new({ ... })`) of
/// one file that hold `settle = true`, with their line numbers.
pub fn settle_names_in(text: &str) -> Vec<(String, usize)> {
    names_in_constructors(text, |table, _| is_true(table, "settle"))
}

/// The literal policy names of the limiters that check several policies in
/// one request or refundably (`new{ policies = { two or more } }` without
/// `settle = true`, or `new{ ..., refundable = true }`) in `conf` and the
/// files it includes: each must be one such a check can name
/// (`multi_refusal`).
pub fn nginx_multi_policy_names(conf: &Path) -> Result<Vec<NamedPolicy>, NginxReadError> {
    read_all(conf, multi_names_in)
}

/// The names in the constructor tables (`new{ ... }`, `new({ ... })`) of
/// one file that make multi-item or refundable checks, with their lines.
pub fn multi_names_in(text: &str) -> Vec<(String, usize)> {
    names_in_constructors(text, |table, names| (names >= 2 && !is_true(table, "settle")) || is_true(table, "refundable"))
}

/// The names in the constructor tables of one file that `wanted` accepts
/// (given the table's text and how many names it holds), with their lines.
fn names_in_constructors(text: &str, wanted: impl Fn(&str, usize) -> bool) -> Vec<(String, usize)> {
    let b = text.as_bytes();
    let mut out: Vec<(String, usize)> = Vec::new();
    for at in words(text, "new") {
        let Some(open) = table_after(b, at + "new".len()) else { continue };
        let table = &text[open..table_end(b, open)];
        let names = names_in(table);
        if !wanted(table, names.len()) {
            continue;
        }
        let offset = line_of(b, open) - 1;
        out.extend(names.into_iter().map(|(name, line)| (name, line + offset)));
    }
    out
}

/// Whether `table` sets `word = true` (outside comments).
fn is_true(table: &str, word: &str) -> bool {
    let b = table.as_bytes();
    let mut i = 0;
    while let Some(at) = table[i..].find(word).map(|k| k + i) {
        i = at + word.len();
        let line_start = b[..at].iter().rposition(|&c| c == b'\n').map_or(0, |p| p + 1);
        if table[line_start..at].contains("--") || (at > 0 && is_ident(b[at - 1])) || b.get(i).copied().is_some_and(is_ident) {
            continue;
        }
        let j = skip_space(b, i);
        if b.get(j) == Some(&b'=') && table[skip_space(b, j + 1)..].starts_with("true") {
            return true;
        }
    }
    false
}

/// A limiter made from a literal table of options in an nginx
/// configuration: `ratelimitd.new{ ... }`, `new({ ... })` or
/// `concurrency{ ... }`, for `check_limiter_options`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimiterTable {
    /// "new" or "concurrency".
    pub constructor: String,
    /// The table's text, braces included.
    pub table: String,
    pub file: PathBuf,
    pub line: usize,
}

/// Every limiter built from a table in `conf` and the files it includes.
pub fn nginx_limiter_tables(conf: &Path) -> Result<Vec<LimiterTable>, NginxReadError> {
    Ok(read_all(conf, limiter_tables_in)?
        .into_iter()
        .map(|n| {
            let (constructor, table) = n.name.split_once('\t').unwrap_or(("new", &n.name));
            LimiterTable { constructor: constructor.into(), table: table.into(), file: n.file, line: n.line }
        })
        .collect())
}

/// The `new{...}` / `concurrency({...})` calls of one file, as
/// "CONSTRUCTOR\tTABLE" with the line they start on.
pub fn limiter_tables_in(text: &str) -> Vec<(String, usize)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    for constructor in ["new", "concurrency"] {
        // A method or field of a module (`ratelimitd.new`, `rl.new`).
        for at in words(text, constructor).filter(|&at| at > 0 && matches!(b[at - 1], b'.' | b':')) {
            let Some(j) = table_after(b, at + constructor.len()) else { continue };
            let end = table_end(b, j);
            out.push((format!("{constructor}\t{}", &text[j..end]), line_of(b, j)));
        }
    }
    out.sort_by_key(|(_, line)| *line);
    out
}

/// Why the limiter options could not be checked at all.
#[derive(Debug, thiserror::Error)]
pub enum LimiterCheckError {
    #[error("luajit cannot be run ({0}): limiter options not checked (install luajit: the check runs the Lua client's own validation)")]
    NoLuajit(std::io::Error),
    #[error("the Lua client's resty.ratelimitd.options is not on luajit's path ({0}): limiter options not checked (set LUA_PATH to the directory holding resty/, e.g. LUA_PATH='/usr/share/lua/5.1/?.lua;;')")]
    NoModule(String),
    #[error("luajit: {0}")]
    Failed(String),
}

/// The Lua that checks each table as `new()` and `concurrency()` do: the
/// client's own `options.check` (lua/resty/ratelimitd/options.lua) on the
/// kind `new()` dispatches the table to, so check-config and nginx cannot
/// disagree. A table whose values are not all literals (a variable, a
/// call) is skipped: only nginx knows it.
const CHECK_LUA: &str = r#"
ngx = { shared = setmetatable({}, { __index = function() return true end }) }
local found, options = pcall(require, "resty.ratelimitd.options")
if not found then
    io.write("NOMODULE\t", (tostring(options):gsub("%s+", " ")), "\n")
    return
end
local literal = setmetatable({}, { __index = function(_, k) error("not a literal: " .. tostring(k), 0) end })
-- The kind new() and concurrency() build (resty/ratelimitd.lua).
local function kind(constructor, opts)
    if constructor == "concurrency" then
        return opts.policy ~= nil and "concurrency_policy" or "concurrency"
    end
    if opts.policies ~= nil or (opts.policy ~= nil and (opts.refundable ~= nil or opts.settle ~= nil)) then
        return "multi"
    end
    return opts.policy ~= nil and "policy" or "inline"
end
function check(constructor, text)
    local chunk = loadstring("return " .. text)
    if not chunk then
        return io.write("SKIP\n")
    end
    setfenv(chunk, literal)
    local ok, opts = pcall(chunk)
    if not ok or type(opts) ~= "table" then
        return io.write("SKIP\n")
    end
    local on_error, err = options.check(kind(constructor, opts), opts)
    if on_error then
        return io.write("OK\n")
    end
    io.write("ERR\t", (tostring(err):gsub("%s+", " ")), "\n")
end
"#;

/// Checks each table with luajit: `None` when `new()` would build the
/// limiter (or the table is not all literals), `Some(message)` when it
/// would return nil and that message.
pub fn check_limiter_options(tables: &[LimiterTable]) -> Result<Vec<Option<String>>, LimiterCheckError> {
    use std::io::Write;
    let mut script = String::from(CHECK_LUA);
    for t in tables {
        // A long bracket no table text can close.
        let mut level = String::from("=");
        while t.table.contains(&format!("]{level}]")) {
            level.push('=');
        }
        script += &format!("check(\"{}\", [{level}[{}]{level}])\n", t.constructor, t.table);
    }
    let mut child = std::process::Command::new("luajit")
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(LimiterCheckError::NoLuajit)?;
    child.stdin.take().expect("piped").write_all(script.as_bytes()).map_err(LimiterCheckError::NoLuajit)?;
    let out = child.wait_with_output().map_err(LimiterCheckError::NoLuajit)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if let Some(why) = stdout.strip_prefix("NOMODULE\t") {
        return Err(LimiterCheckError::NoModule(why.trim().to_string()));
    }
    let answers: Vec<Option<String>> = stdout.lines().map(|l| l.strip_prefix("ERR\t").map(str::to_string)).collect();
    if !out.status.success() || answers.len() != tables.len() {
        return Err(LimiterCheckError::Failed(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(answers)
}

/// `names` of every file of `conf` (it and the files it includes).
fn read_all(conf: &Path, names: fn(&str) -> Vec<(String, usize)>) -> Result<Vec<NamedPolicy>, NginxReadError> {
    let mut seen = Vec::new();
    let mut out = Vec::new();
    read(conf, conf.parent().unwrap_or(Path::new(".")), &mut seen, &mut out, names)?;
    Ok(out)
}

/// Whether the line holding `at` is commented out before it (Lua `--`,
/// nginx `#`).
fn commented(text: &str, at: usize) -> bool {
    let line_start = text.as_bytes()[..at].iter().rposition(|&c| c == b'\n').map_or(0, |p| p + 1);
    text[line_start..at].contains("--") || text[line_start..at].contains('#')
}

/// Where `word` stands in `text` as a word of its own (no identifier
/// character either side), outside comments.
fn words<'t>(text: &'t str, word: &'t str) -> impl Iterator<Item = usize> + 't {
    let b = text.as_bytes();
    let mut i = 0;
    std::iter::from_fn(move || {
        while let Some(at) = text[i..].find(word).map(|k| k + i) {
            i = at + word.len();
            if !commented(text, at) && !(at > 0 && is_ident(b[at - 1])) && !b.get(i).copied().is_some_and(is_ident) {
                return Some(at);
            }
        }
        None
    })
}

/// The `{` of a table that a constructor's name ending at `i` is called
/// with (`{ ... }` or `({ ... })`), if it is.
fn table_after(b: &[u8], i: usize) -> Option<usize> {
    let mut open = skip_space(b, i);
    if b.get(open) == Some(&b'(') {
        open = skip_space(b, open + 1);
    }
    (b.get(open) == Some(&b'{')).then_some(open)
}

/// The end (exclusive) of the brace-balanced table that opens at `open`;
/// the end of `b` for an unclosed one.
fn table_end(b: &[u8], open: usize) -> usize {
    let mut depth = 0i32;
    (open..b.len())
        .find(|&k| {
            match b[k] {
                b'{' => depth += 1,
                b'}' => depth -= 1,
                _ => {}
            }
            depth == 0
        })
        .map_or(b.len(), |c| c + 1)
}

fn read(path: &Path, base: &Path, seen: &mut Vec<PathBuf>, out: &mut Vec<NamedPolicy>, names: fn(&str) -> Vec<(String, usize)>) -> Result<(), NginxReadError> {
    if seen.iter().any(|p| p == path) || seen.len() > 256 {
        return Ok(());
    }
    seen.push(path.to_path_buf());
    let text = std::fs::read_to_string(path).map_err(|err| NginxReadError { path: path.into(), err })?;
    out.extend(names(&text).into_iter().map(|(name, line)| NamedPolicy { name, file: path.into(), line }));
    for target in referenced_files(&text) {
        let full = if Path::new(&target).is_absolute() { PathBuf::from(&target) } else { base.join(&target) };
        for f in expand(&full) {
            read(&f, base, seen, out, names)?;
        }
    }
    Ok(())
}

/// The arguments of `include` and `*_by_lua_file` directives.
fn referenced_files(text: &str) -> Vec<String> {
    let mut files = Vec::new();
    for statement in text.lines().flat_map(|l| l.split('#').next().unwrap_or("").split(['{', '}', ';'])) {
        let mut words = statement.split_whitespace();
        let Some(directive) = words.next() else { continue };
        if directive == "include" || directive.ends_with("_by_lua_file") {
            if let Some(arg) = words.next() {
                let arg = arg.trim_matches(|c| c == '"' || c == '\'');
                // A path with nginx variables is decided per request: not followed.
                if !arg.is_empty() && !arg.contains('$') {
                    files.push(arg.to_string());
                }
            }
        }
    }
    files
}

/// `dir/prefix*suffix` to the matching files, sorted; a path without `*` to itself.
fn expand(path: &Path) -> Vec<PathBuf> {
    let Some(pattern) = path.file_name().and_then(|f| f.to_str()) else { return vec![path.into()] };
    let Some((prefix, suffix)) = pattern.split_once('*') else { return vec![path.into()] };
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|f| f.to_str()).is_some_and(|f| f.len() >= prefix.len() + suffix.len() && f.starts_with(prefix) && f.ends_with(suffix)))
        .collect();
    found.sort();
    found
}

/// The literal names in one file, with their line numbers (1-based).
pub fn names_in(text: &str) -> Vec<(String, usize)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        // Lua and nginx comments: to the end of the line.
        if b[i] == b'#' || (b[i] == b'-' && b.get(i + 1) == Some(&b'-')) {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        let word_start = i == 0 || !is_ident(b[i - 1]);
        if word_start {
            for (word, list) in [("policies", true), ("policy", false), ("new", false)] {
                if b[i..].starts_with(word.as_bytes()) && !b.get(i + word.len()).copied().is_some_and(is_ident) {
                    let mut j = skip_space(b, i + word.len());
                    if word == "new" {
                        // new("name"), new "name"
                        if b.get(j) == Some(&b'(') {
                            j = skip_space(b, j + 1);
                        }
                        if let Some((name, _)) = string_at(b, j) {
                            out.push((name, line_of(b, j)));
                        }
                    } else if b.get(j) == Some(&b'=') {
                        j = skip_space(b, j + 1);
                        if list && b.get(j) == Some(&b'{') {
                            j += 1;
                            loop {
                                j = skip_space(b, j);
                                match string_at(b, j) {
                                    Some((name, end)) => {
                                        out.push((name, line_of(b, j)));
                                        j = skip_space(b, end);
                                        if b.get(j) == Some(&b',') {
                                            j += 1;
                                        }
                                    }
                                    None => break,
                                }
                            }
                        } else if let Some((name, _)) = string_at(b, j) {
                            out.push((name, line_of(b, j)));
                        }
                    }
                    break;
                }
            }
        }
        i += 1;
    }
    out
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn skip_space(b: &[u8], mut j: usize) -> usize {
    while j < b.len() && b[j].is_ascii_whitespace() {
        j += 1;
    }
    j
}

/// A Lua string literal without escapes at `j`: its text and the index after it.
fn string_at(b: &[u8], j: usize) -> Option<(String, usize)> {
    let quote = *b.get(j)?;
    if quote != b'"' && quote != b'\'' {
        return None;
    }
    let end = b[j + 1..].iter().position(|&c| c == quote || c == b'\n' || c == b'\\')? + j + 1;
    if b[end] != quote {
        return None;
    }
    Some((String::from_utf8_lossy(&b[j + 1..end]).into_owned(), end + 1))
}

fn line_of(b: &[u8], j: usize) -> usize {
    b[..j].iter().filter(|&&c| c == b'\n').count() + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_form_the_lua_client_takes_and_skips_comments_and_variables() {
        let text = r#"
            a = assert(ratelimitd.new("order"))
            b = ratelimitd.new "search"
            c = ratelimitd.new{ policy = "login_failures", refundable = true }
            d = ratelimitd.new{ policies = { "per_ip", 'per_tenant',
                                             "global" }, on_error = "closed" }
            -- e = ratelimitd.new("commented")
            # f = ratelimitd.new("nginx comment")
            g = ratelimitd.new(name_from_a_variable)
            h = ratelimitd.new{ key = "not a policy", limit = 3, window_ms = 1000 }
            renew("not_ours") ; policy_x = "no"
        "#;
        let names: Vec<String> = names_in(text).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["order", "search", "login_failures", "per_ip", "per_tenant", "global"]);
        assert_eq!(names_in(text)[2].1, 4, "line numbers are 1-based");
    }

    #[test]
    fn finds_the_names_of_settle_limiters_only() {
        let text = r#"
            a = ratelimitd.new{ policy = "plain" }
            b = ratelimitd.new{ policies = { "tokens_minute",
                                             "tokens_month" }, settle = true, on_error = "closed" }
            c = ratelimitd.new{ settle = true, policy = "one" }
            -- d = ratelimitd.new{ policy = "commented", settle = true }
            e = ratelimitd.new{ policy = "off", settle = false }
            access_by_lua_block { local settle = true; x = new{ policy = "not_a_reserve" } }
        "#;
        let found = settle_names_in(text);
        assert_eq!(found, [("tokens_minute".to_string(), 3), ("tokens_month".to_string(), 4), ("one".to_string(), 5)]);
    }

    #[test]
    fn finds_the_names_of_multi_item_and_refundable_limiters_only() {
        let text = r#"
            a = ratelimitd.new{ policy = "plain" }
            b = ratelimitd.new{ policies = { "per_ip",
                                             "per_tenant" }, on_error = "closed" }
            c = ratelimitd.new({ policy = "login", refundable = true })
            d = ratelimitd.new{ policies = { "tok_min", "tok_day" }, settle = true }
            e = ratelimitd.new{ policies = { "alone" } }
            -- f = ratelimitd.new{ policy = "commented", refundable = true }
            g = ratelimitd.new{ policy = "off", refundable = false }
            h = renew{ policy = "not_ours", refundable = true }
        "#;
        let found = multi_names_in(text);
        assert_eq!(found, [("per_ip".to_string(), 3), ("per_tenant".to_string(), 4), ("login".to_string(), 5)]);
    }

    #[test]
    fn finds_the_tables_limiters_are_made_from_and_checks_them_as_new_does() {
        let text = "init_worker_by_lua_block {\n  a = rl.new{ policy = \"login\", on_error = \"close\" }\n  b = ratelimitd.concurrency({ limit = 4, lease_ms = 30000 })\n  -- c = rl.new{ bad = 1 }\n  d = rl.new{ policy = name }\n  e = renew{ x = 1 }\n}\n";
        let found = limiter_tables_in(text);
        assert_eq!(found.iter().map(|(t, l)| (t.as_str(), *l)).collect::<Vec<_>>(), [
            ("new\t{ policy = \"login\", on_error = \"close\" }", 2),
            ("concurrency\t{ limit = 4, lease_ms = 30000 }", 3),
            ("new\t{ policy = name }", 5),
        ]);
        let tables: Vec<LimiterTable> = found
            .into_iter()
            .map(|(t, line)| {
                let (c, table) = t.split_once('\t').unwrap();
                LimiterTable { constructor: c.into(), table: table.into(), file: "x".into(), line }
            })
            .collect();
        std::env::set_var("LUA_PATH", concat!(env!("CARGO_MANIFEST_DIR"), "/lua/?.lua;;"));
        let answers = check_limiter_options(&tables).unwrap();
        assert_eq!(answers, [Some("on_error must be 'open', 'closed' or 'local'".to_string()), None, None]);
    }

    #[test]
    fn follows_includes_with_a_star_and_lua_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("conf.d")).unwrap();
        std::fs::write(dir.path().join("nginx.conf"), "http {\n include conf.d/*.conf;\n include missing-ok-only-with-star/*.conf;\n}\n").unwrap();
        std::fs::write(dir.path().join("conf.d/a.conf"), "location / { access_by_lua_file lua/a.lua; }\n").unwrap();
        std::fs::write(dir.path().join("conf.d/b.txt"), "new('ignored')\n").unwrap();
        std::fs::create_dir(dir.path().join("lua")).unwrap();
        std::fs::write(dir.path().join("lua/a.lua"), "\nlocal l = require('resty.ratelimitd').new('from_lua')\n").unwrap();
        let found = nginx_policy_names(&dir.path().join("nginx.conf")).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!((found[0].name.as_str(), found[0].line), ("from_lua", 2));
        assert!(found[0].file.ends_with("lua/a.lua"));
    }
}
