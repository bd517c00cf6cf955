//! The wire vocabulary is defined once, in `src/protocol/wire.rs`; the Lua
//! client's tables and docs/PROTOCOL.md repeat it for their readers. These
//! tests hold both to the daemon's lists, value by value and name by name,
//! so a code added on one side and not the others fails here.

use std::collections::BTreeMap;

use ratelimitd::protocol::{Algorithm, Decision, ErrorCode, FailPolicy, Source};

#[path = "common/repo.rs"]
mod repo;
use repo::read;

/// value -> name, for one wire enum.
type Table = BTreeMap<u16, String>;

fn daemon_table<T: Copy>(all: &[T], wire: impl Fn(T) -> u16, name: impl Fn(T) -> &'static str) -> Table {
    all.iter().map(|&v| (wire(v), name(v).to_string())).collect()
}

/// The entries of `local NAME = { ... }` in the Lua module: `[N] = "name"`,
/// `name = N` or `["name"] = N`.
fn lua_table(lua: &str, table: &str) -> Table {
    let start = lua.find(&format!("local {table} = {{")).unwrap_or_else(|| panic!("lua/resty/ratelimitd/wire.lua has no `local {table} = {{`"));
    let body = &lua[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find('}').unwrap()];
    let mut out = Table::new();
    for entry in body.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (k, v) = entry.split_once('=').unwrap_or_else(|| panic!("{table}: cannot read entry `{entry}`"));
        let (k, v) = (k.trim(), v.trim());
        let unquote = |s: &str| s.trim_matches(|c| c == '[' || c == ']').trim_matches('"').to_string();
        let (value, name) = if k.starts_with("[\"") || !k.starts_with('[') { (v.to_string(), unquote(k)) } else { (unquote(k), unquote(v)) };
        let value: u16 = value.parse().unwrap_or_else(|_| panic!("{table}: `{entry}` has no numeric wire value"));
        assert!(out.insert(value, name).is_none(), "{table}: value {value} twice");
    }
    out
}

/// The `| Value | Name | ...` (or `| Code | Name | ...`) table of the
/// section whose heading starts with `heading` in docs/PROTOCOL.md.
fn doc_table(doc: &str, heading: &str) -> Table {
    let section = doc.split("\n### ").find(|s| s.starts_with(heading)).unwrap_or_else(|| panic!("docs/PROTOCOL.md has no section `### {heading}`"));
    let mut lines = section.lines().skip_while(|l| !(l.starts_with("| Value | Name |") || l.starts_with("| Code | Name |")));
    assert!(lines.next().is_some(), "docs/PROTOCOL.md `{heading}`: no `| Value | Name |` table");
    let mut out = Table::new();
    for row in lines.skip(1).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let value: u16 = cells[1].parse().unwrap_or_else(|_| panic!("docs/PROTOCOL.md `{heading}`: `{}` is not a value", cells[1]));
        assert!(out.insert(value, cells[2].to_string()).is_none(), "docs/PROTOCOL.md `{heading}`: value {value} twice");
    }
    out
}

/// Every wire enum: its table's name in wire.lua, its section in
/// docs/PROTOCOL.md, and the daemon's table.
fn vocabularies() -> [(&'static str, &'static str, Table); 5] {
    [
        ("POLICY", "Fail policy", daemon_table(FailPolicy::ALL, |v| v.to_wire().into(), FailPolicy::as_str)),
        ("DECISION", "Decision", daemon_table(Decision::ALL, |v| v.to_wire().into(), Decision::as_str)),
        ("SOURCE", "Source", daemon_table(Source::ALL, |v| v.to_wire().into(), Source::as_str)),
        ("ALGORITHM", "Algorithm", daemon_table(Algorithm::ALL, |v| v.to_wire().into(), Algorithm::as_str)),
        ("ERROR_NAME", "Error codes", daemon_table(ErrorCode::ALL, ErrorCode::to_wire, ErrorCode::as_str)),
    ]
}

#[test]
fn the_lua_client_speaks_the_daemons_vocabulary() {
    let lua = read("lua/resty/ratelimitd/wire.lua");
    for (table, _, daemon) in vocabularies() {
        assert_eq!(lua_table(&lua, table), daemon, "{table}");
    }
}

#[test]
fn the_protocol_document_lists_the_daemons_vocabulary() {
    let doc = read("docs/PROTOCOL.md");
    for (_, section, daemon) in vocabularies() {
        assert_eq!(doc_table(&doc, section), daemon, "{section}");
    }
}

#[test]
fn the_readers_fail_on_a_missing_entry() {
    let lua = "local SOURCE = { [0] = \"redis\", [1] = \"local\" }\nlocal POLICY = { open = 0, [\"local\"] = 2 }\n";
    assert_eq!(lua_table(lua, "SOURCE"), Table::from([(0, "redis".into()), (1, "local".into())]));
    assert_eq!(lua_table(lua, "POLICY"), Table::from([(0, "open".into()), (2, "local".into())]));
    assert_ne!(lua_table(lua, "SOURCE"), daemon_table(Source::ALL, |v| v.to_wire().into(), Source::as_str));
    let doc = "x\n### Source (offset 7)\n\n| Value | Name | Meaning |\n|---|---|---|\n| 0 | redis | r |\n| 255 | none | n |\n\nafter\n";
    assert_eq!(doc_table(doc, "Source"), Table::from([(0, "redis".into()), (255, "none".into())]));
}
