//! The Redis scripts are assembled from shared parts at build time
//! (build.rs, src/redis/scripts/): these tests hold the assembled text to
//! that promise. Each part stands once in each script; the shell scripts'
//! assembler (scripts/lib.sh `redis_script`) gives the binary's text, so a
//! bench loads the SHA the daemon calls; every part is used; no script is
//! written inline in Rust; no script shares its stem with a Rust module.

mod common;

use common::repo::{files_under, read, root};
use common::scripts;

/// The parts and mode bodies (every file below a folder of
/// src/redis/scripts/), with the text each includes in its turn.
fn parts() -> Vec<(String, String)> {
    files_under("src/redis/scripts", ".lua").into_iter().filter(|p| p.matches('/').count() > 3).map(|p| {
        let text = read(&p);
        (p, text)
    }).collect()
}

/// A part's own lines, as they stand in a script that includes it (its
/// include lines are replaced there, so they are left out).
fn own_lines(text: &str) -> Vec<&str> {
    text.lines().filter(|l| !l.starts_with("--@include ")).collect()
}

#[test]
fn each_part_stands_once_in_each_assembled_script() {
    let parts = parts();
    assert!(parts.len() >= 10, "the parts and modes of src/redis/scripts/: {parts:?}");
    for (stem, text) in scripts::ALL {
        assert!(!text.contains("--@include"), "{stem}: an include line left in the assembled text");
        for (part, part_text) in &parts {
            let lines = own_lines(part_text);
            // Where the part's first line stands, its whole text must follow.
            let mut found = 0;
            let all: Vec<&str> = text.lines().collect();
            for i in 0..all.len() {
                if all[i..].starts_with(&lines) {
                    found += 1;
                }
            }
            assert!(found <= 1, "{stem}.lua holds {part} {found} times");
        }
        // What was written out several times before the parts: the clock,
        // the calendar, the settle record's life and its read.
        for once in ["redis.call('TIME')", "local function days_from_civil", "SETTLE_LIFE = ", "redis.call('GET', KEYS[2])", "local function units", "local function log_wait", "local function answer"] {
            let n = text.matches(once).count();
            assert!(n <= 1, "{stem}.lua has `{once}` {n} times: include the part once");
        }
    }
    // The log's modes all stand in it, each once.
    for mode in ["lease_settle", "confirm_refund", "all_or_nothing", "per_request"] {
        let body = read(&format!("src/redis/scripts/sliding_window/{mode}.lua"));
        assert!(scripts::LOG.contains(own_lines(&body).join("\n").as_str()), "sliding_window.lua lacks its mode {mode}");
    }
}

#[test]
fn every_part_is_included_by_some_script() {
    for (part, _) in parts() {
        let name = part.trim_start_matches("src/redis/scripts/");
        let included = files_under("src/redis/scripts", ".lua").iter().any(|f| read(f).lines().any(|l| l == format!("--@include {name}")));
        assert!(included, "{part} is included by no script");
    }
    // And every top-level script is one the daemon or its tests name.
    for top in files_under("src/redis/scripts", ".lua").iter().filter(|p| p.matches('/').count() == 3) {
        let stem = top.trim_start_matches("src/redis/scripts/").trim_end_matches(".lua");
        assert!(scripts::ALL.iter().any(|(s, _)| *s == stem), "{top}: not in tests/common/scripts.rs ALL");
        assert!(read("src/redis/scripts.rs").contains(&format!("assembled!(\"{stem}\")")), "{top}: not in src/redis/scripts.rs");
    }
}

#[test]
fn the_shell_assembler_gives_the_binarys_text() {
    for (stem, text) in scripts::ALL {
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!("source scripts/lib.sh && redis_script {stem}"))
            .current_dir(root())
            .output()
            .unwrap();
        assert!(out.status.success(), "redis_script {stem}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8(out.stdout).unwrap(), text, "scripts/lib.sh redis_script {stem} differs from the binary's text");
    }
}

#[test]
fn no_script_is_written_in_rust_and_none_shares_a_modules_stem() {
    let rust = files_under("src", ".rs");
    for file in &rust {
        // A script's text calls redis.call; Rust code and its comments never
        // need to (a comment names the script's file instead).
        for (i, line) in read(file).lines().enumerate() {
            let code = line.trim_start_matches([' ', '"']);
            let scripted = code.starts_with("redis.call(") || (code.starts_with("local ") && code.contains("redis.call("));
            assert!(!scripted, "{file}:{}: a script written in Rust: move it to src/redis/scripts/", i + 1);
        }
    }
    // A stem names one thing: the layering reads a script and a module of
    // one stem (a Rust module, or a module of the Lua client) as one file.
    let stem = |p: &str| p.rsplit('/').next().unwrap().split('.').next().unwrap().to_string();
    let modules: Vec<String> = rust.iter().chain(&files_under("lua", ".lua")).map(|p| stem(p)).collect();
    let mut seen = std::collections::BTreeSet::new();
    for script in files_under("src/redis/scripts", ".lua") {
        let s = stem(&script);
        assert!(!modules.contains(&s), "{script} shares its stem with a module: rename the script");
        assert!(seen.insert(s), "{script}: another script or part has its stem");
    }
}
