//! The crate's layout, checked: the `crate::`, `super::` and `self::` paths
//! of every file under `src/` form no cycle, no top-level module imports
//! from its own layer or one above (the layers are the table in `lib.rs`'s
//! doc, which must list every module), and a package's `mod.rs` is only its
//! facade (its children never import it back).
//!
//! A node is one file's module: `decision::plan`, `redis::link`,
//! `redis::link::breaker`; a directory's `mod.rs` is the package itself
//! (`redis`). A path resolves to the longest node it names. Inline test
//! modules belong to their file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One file's module path (empty for lib.rs) and its source.
fn modules() -> Vec<(Vec<String>, String)> {
    fn walk(dir: &Path, prefix: &[String], out: &mut Vec<(Vec<String>, String)>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for path in entries {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                let mut p = prefix.to_vec();
                p.push(name);
                walk(&path, &p, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let module = match name.as_str() {
                    "main" if prefix.is_empty() => continue, // the binary: an edge above all
                    "lib" if prefix.is_empty() => vec![],
                    "mod" => prefix.to_vec(),
                    _ => {
                        let mut p = prefix.to_vec();
                        p.push(name);
                        p
                    }
                };
                out.push((module, text));
            }
        }
    }
    let mut out = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &[], &mut out);
    out
}

/// The source without comments, and with string and char literals emptied,
/// so that only code is left to read paths and braces from.
fn code_chars(src: &str) -> Vec<char> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::with_capacity(c.len());
    let mut i = 0;
    while i < c.len() {
        match c[i] {
            '/' if c.get(i + 1) == Some(&'/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '/' if c.get(i + 1) == Some(&'*') => {
                i += 2;
                while i + 1 < c.len() && !(c[i] == '*' && c[i + 1] == '/') {
                    i += 1;
                }
                i += 2;
            }
            'r' if c.get(i + 1) == Some(&'#') || (c.get(i + 1) == Some(&'"') && (i == 0 || !c[i - 1].is_alphanumeric())) => {
                // A raw string: r"..." or r#"..."#.
                let mut j = i + 1;
                let mut hashes = 0;
                while c.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if c.get(j) != Some(&'"') {
                    out.push(c[i]);
                    i += 1;
                    continue;
                }
                j += 1;
                loop {
                    if j >= c.len() {
                        break;
                    }
                    if c[j] == '"' && (0..hashes).all(|h| c.get(j + 1 + h) == Some(&'#')) {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                out.push('"');
                out.push('"');
                i = j;
            }
            '"' => {
                i += 1;
                while i < c.len() && c[i] != '"' {
                    if c[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                out.push('"');
                out.push('"');
            }
            '\'' => {
                // A char literal ('{', '\n', '\u{7f}') or a lifetime ('a).
                if c.get(i + 1) == Some(&'\\') {
                    i += 2;
                    while i < c.len() && c[i] != '\'' {
                        i += 1;
                    }
                    i += 1;
                    out.push('_');
                } else if c.get(i + 2) == Some(&'\'') {
                    i += 3;
                    out.push('_');
                } else {
                    out.push('\'');
                    i += 1;
                }
            }
            ch => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out
}

/// Every `crate::`, `super::` and `self::` path of a file, resolved to
/// absolute segments; paths inside inline modules (tests) count for the file.
fn paths_of(module: &[String], src: &str) -> Vec<Vec<String>> {
    let code: String = code_chars(src).into_iter().collect();
    assert!(!code.contains("crate::{"), "{}: write one `use crate::module::...` per module, not `crate::{{...}}`, so this check can read it", module.join("::"));
    // The stack of inline modules at each brace depth.
    let mut inline: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    let ident = |s: &[char], mut j: usize| {
        let start = j;
        while j < s.len() && (s[j].is_alphanumeric() || s[j] == '_') {
            j += 1;
        }
        (s[start..j].iter().collect::<String>(), j)
    };
    while i < bytes.len() {
        let ch = bytes[i];
        if ch == '{' {
            depth += 1;
            i += 1;
            continue;
        }
        if ch == '}' {
            if inline.last() == Some(&depth) {
                inline.pop();
            }
            depth = depth.saturating_sub(1);
            i += 1;
            continue;
        }
        let word_start = i == 0 || !(bytes[i - 1].is_alphanumeric() || bytes[i - 1] == '_' || bytes[i - 1] == ':');
        if !(ch.is_alphabetic() || ch == '_') || !word_start {
            i += 1;
            continue;
        }
        let (word, end) = ident(&bytes, i);
        if word == "mod" {
            // `mod name {`: an inline module opens at the next brace.
            let (_, after) = ident(&bytes, end + 1);
            let rest: String = bytes[after..bytes.len().min(after + 3)].iter().collect();
            if rest.trim_start().starts_with('{') {
                inline.push(depth + 1);
            }
            i = end;
            continue;
        }
        if !matches!(word.as_str(), "crate" | "super" | "self") || bytes.get(end) != Some(&':') || bytes.get(end + 1) != Some(&':') {
            i = end;
            continue;
        }
        // Read the whole path: a::b::c
        let mut segs = vec![word];
        let mut j = end;
        while bytes.get(j) == Some(&':') && bytes.get(j + 1) == Some(&':') {
            let (s, e) = ident(&bytes, j + 2);
            if s.is_empty() {
                break;
            }
            segs.push(s);
            j = e;
        }
        i = j;
        // The module the path is written in: the file's, plus inline ones.
        let here_extra = inline.len();
        let mut base: Vec<String> = module.to_vec();
        for _ in 0..here_extra {
            base.push("<inline>".into());
        }
        let mut resolved = match segs[0].as_str() {
            "crate" => vec![],
            "self" => base.clone(),
            _ => base.clone(),
        };
        let mut k = usize::from(segs[0] == "crate" || segs[0] == "self");
        while k < segs.len() && segs[k] == "super" {
            resolved.pop();
            k += 1;
        }
        resolved.extend(segs[k..].iter().cloned());
        // Inline modules resolve to their file.
        resolved.retain(|s| s != "<inline>");
        out.push(resolved);
    }
    out
}

/// The longest node a path names.
fn node_of(path: &[String], nodes: &BTreeSet<Vec<String>>) -> Vec<String> {
    (0..=path.len()).rev().map(|n| path[..n].to_vec()).find(|p| nodes.contains(p)).unwrap_or_default()
}

fn name(n: &[String]) -> String {
    if n.is_empty() {
        "lib".into()
    } else {
        n.join("::")
    }
}

/// Top-level modules and their layer, as `lib.rs`'s layout table lists them.
fn layers(lib: &str) -> BTreeMap<String, usize> {
    let mut layer_names: Vec<String> = Vec::new();
    let mut out = BTreeMap::new();
    for line in lib.lines().filter_map(|l| l.strip_prefix("//! |")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 3 || cells[0] == "layer" || cells[0].starts_with("---") {
            continue;
        }
        if layer_names.last().map(String::as_str) != Some(cells[0]) {
            layer_names.push(cells[0].to_string());
        }
        for m in cells[1].split(',') {
            out.insert(m.trim().trim_matches('`').to_string(), layer_names.len() - 1);
        }
    }
    out
}

#[test]
fn src_has_no_import_cycle_and_no_upward_import() {
    let modules = modules();
    let nodes: BTreeSet<Vec<String>> = modules.iter().map(|(m, _)| m.clone()).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (m, src) in &modules {
        let e = edges.entry(m.clone()).or_default();
        for p in paths_of(m, src) {
            let to = node_of(&p, &nodes);
            if &to != m {
                e.insert(to);
            }
        }
    }
    let mut problems = Vec::new();

    // 1. No cycle (depth-first search with colours).
    fn visit(n: &Vec<String>, edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>, state: &mut BTreeMap<Vec<String>, u8>, stack: &mut Vec<Vec<String>>, problems: &mut Vec<String>) {
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for to in edges.get(n).into_iter().flatten() {
            match state.get(to).copied().unwrap_or(0) {
                0 => visit(to, edges, state, stack, problems),
                1 => {
                    let at = stack.iter().position(|s| s == to).unwrap();
                    let cycle: Vec<String> = stack[at..].iter().chain(std::iter::once(to)).map(|s| name(s)).collect();
                    problems.push(format!("import cycle: {}", cycle.join(" -> ")));
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
    }
    let mut state = BTreeMap::new();
    for n in &nodes {
        if state.get(n).copied().unwrap_or(0) == 0 {
            visit(n, &edges, &mut state, &mut Vec::new(), &mut problems);
        }
    }

    // 2. Top-level modules import only from layers below their own.
    let lib = &modules.iter().find(|(m, _)| m.is_empty()).unwrap().1;
    let layer = layers(lib);
    let top: BTreeSet<String> = nodes.iter().filter(|n| !n.is_empty()).map(|n| n[0].clone()).collect();
    let listed: BTreeSet<String> = layer.keys().cloned().collect();
    for m in top.difference(&listed) {
        problems.push(format!("module `{m}` is missing from the layout table in src/lib.rs"));
    }
    for m in listed.difference(&top) {
        problems.push(format!("the layout table in src/lib.rs lists `{m}`, which does not exist"));
    }
    for (from, tos) in &edges {
        let Some(f) = from.first() else { continue };
        for to in tos {
            let Some(t) = to.first() else {
                problems.push(format!("{} imports from the crate root", name(from)));
                continue;
            };
            if f != t {
                if let (Some(lf), Some(lt)) = (layer.get(f), layer.get(t)) {
                    if lt >= lf {
                        problems.push(format!("upward import: {} (layer {lf}) uses {} (layer {lt})", name(from), name(to)));
                    }
                }
            } else if to.len() < from.len() && from.starts_with(to) {
                // 3. A child never imports its own package's facade.
                problems.push(format!("{} imports its package facade {}; import the sibling that defines the item", name(from), name(to)));
            }
        }
    }
    assert!(problems.is_empty(), "src/ layout problems:\n  {}", problems.join("\n  "));
    // The graph is not trivially empty: the check reads the paths.
    assert!(edges[&vec!["decision".to_string(), "execute".to_string()]].contains(&vec!["redis".to_string()]), "{edges:?}");
    assert!(edges[&vec!["redis".to_string(), "link".to_string()]].contains(&vec!["window".to_string()]), "{edges:?}");
}

#[test]
fn the_checker_finds_cycles_upward_imports_and_nested_paths() {
    let m = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    let p = paths_of(&m("redis::window"), "use super::link::RedisLink;\nuse crate::config::RedisConfig;\nfn f() { let c = '{'; let s = \"crate::limiter\"; }\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::client::Client;\n}\n");
    assert_eq!(p, vec![m("redis::link::RedisLink"), m("config::RedisConfig"), m("redis::window"), m("client::Client")]);
    let lib = "//! | layer | module | concern |\n//! |---|---|---|\n//! | a | `window`, `protocol` | x |\n//! | b | `limiter` | y |\n";
    let l = layers(lib);
    assert_eq!((l["window"], l["protocol"], l["limiter"]), (0, 0, 1));
}
