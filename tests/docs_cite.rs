//! Docs that cannot drift: every file a document or a comment cites
//! exists, every section it cites (`docs/X.md "Section"`, `X.md §N`,
//! `PROTOCOL.md 4f`, `SEMANTICS S3`) is a heading of that document, and the
//! module tables (README's layout, src/lib.rs's layers, the Lua client's
//! two module lists) name every module there is.
//!
//! What is read: README.md, docs/*.md, nginx/*.conf, ratelimitd.example.toml,
//! the code's comments and strings (src/, lua/, tests/, scripts/), the Redis
//! scripts. A citation is read only in the forms above, so prose is free to
//! talk of "section 4" of something else.

#[path = "common/repo.rs"]
mod repo;

use std::collections::BTreeSet;

use repo::{files_under, read, root};

/// Every file whose citations are held to what exists, with its text.
fn citing() -> Vec<(String, String)> {
    let mut files: Vec<String> = vec!["README.md".into(), "ratelimitd.example.toml".into(), "scripts/README.md".into()];
    files.extend(files_under("docs", ".md").into_iter().filter(|f| !f.starts_with("docs/bench/")));
    files.extend(files_under("nginx", ".conf"));
    for (dir, ext) in [("src", ".rs"), ("src", ".lua"), ("lua", ".lua"), ("tests", ".rs"), ("build.rs", "")] {
        if dir == "build.rs" {
            if root().join(dir).is_file() {
                files.push(dir.into());
            }
            continue;
        }
        files.extend(files_under(dir, ext));
    }
    for f in files_under("scripts", "") {
        if !f.contains(".d/") || f.ends_with(".py") || f.ends_with(".lua") {
            files.push(f);
        }
    }
    files.sort();
    files.dedup();
    // This file's own readers are tested on made-up citations.
    files.retain(|f| f != "tests/docs_cite.rs");
    files
        .into_iter()
        .map(|f| {
            let text = read(&f);
            // Code cites in its comments; its strings name files of its own
            // making (a test's temporary `lua/a.lua`).
            let comment = if f.ends_with(".rs") { Some("//") } else if f.ends_with(".lua") { Some("--") } else if f.starts_with("scripts/") && !f.ends_with(".md") { Some("#") } else { None };
            let text = match comment {
                Some(c) => text.lines().filter_map(|l| l.trim_start().strip_prefix(c)).collect::<Vec<_>>().join("\n"),
                None => text,
            };
            (f, text)
        })
        .collect()
}

const TOP: [&str; 11] = ["src", "docs", "tests", "scripts", "lua", "nginx", "examples", "debian", "systemd", "grafana", "tools"];

/// The paths `text` cites: words that begin with one of the checkout's
/// top-level folders and a slash, up to the first character a path here
/// never holds; placeholders and globs (`docs/X.md`, `src/*.rs`,
/// `<dir>`) are not citations of one file.
fn cited_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    for top in TOP {
        let needle = format!("{top}/");
        let mut from = 0;
        while let Some(at) = text[from..].find(&needle) {
            let start = from + at;
            from = start + needle.len();
            // The path must begin there: not inside another path or word.
            if start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || b"_/.-$~{".contains(&bytes[start - 1])) {
                continue;
            }
            let end = text[start..].find(|c: char| !(c.is_ascii_alphanumeric() || "_./-*<>{}$".contains(c))).map_or(text.len(), |e| start + e);
            let path = text[start..end].trim_end_matches(['.', '-', '/']);
            if path.contains(['*', '<', '>', '{', '}', '$']) || path.len() == top.len() + 1 {
                continue;
            }
            // A placeholder as a name: docs/X.md, src/redis/scripts/NAME.lua.
            let name = path.rsplit('/').next().unwrap_or("");
            if name.split('.').next().is_some_and(|n| (n.len() == 1 && n.chars().all(|c| c.is_ascii_uppercase())) || ["NAME", "FILE", "PATH", "DIR"].contains(&n)) {
                continue;
            }
            out.push(path.to_string());
        }
    }
    out
}

#[test]
fn every_file_cited_exists() {
    let mut missing = Vec::new();
    for (file, text) in citing() {
        for path in cited_paths(&text) {
            let p = root().join(&path);
            // `docs/METRICS` names the document docs/METRICS.md.
            let doc = path.starts_with("docs/") && !path.contains('.') && root().join(format!("{path}.md")).is_file();
            if !p.exists() && !doc {
                missing.push(format!("{file}: {path}"));
            }
        }
        // A document named alone (`SEMANTICS.md`): one of docs/ or the root's.
        for name in cited_documents(&text) {
            if !root().join("docs").join(&name).is_file() && !root().join(&name).is_file() {
                missing.push(format!("{file}: {name}"));
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(missing.is_empty(), "cited, and no such file:\n{}", missing.join("\n"));
}

/// The documents `text` names by file name alone: `NAME.md`, NAME in
/// capitals (the project's documents), not preceded by a folder.
fn cited_documents(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices(".md") {
        let start = text[..at].rfind(|c: char| !(c.is_ascii_uppercase() || c == '_')).map_or(0, |s| s + 1);
        let name = &text[start..at];
        let before = text[..start].chars().next_back();
        let after = text[at + 3..].chars().next();
        if name.len() >= 2 && name.chars().next().unwrap().is_ascii_uppercase() && !before.is_some_and(|c| c.is_ascii_alphanumeric() || "/._-".contains(c)) && !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.push(format!("{name}.md"));
        }
    }
    out
}

/// A document's headings, each as written and without its number
/// (`4f. Reserve and settle: ...` is also `Reserve and settle: ...`), and
/// the numbers (`4f`) its numbered headings carry.
struct Headings {
    titles: BTreeSet<String>,
    numbers: BTreeSet<String>,
}

fn headings(doc: &str) -> Headings {
    let mut titles = BTreeSet::new();
    let mut numbers = BTreeSet::new();
    let mut fenced = false;
    for line in doc.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        if fenced {
            continue;
        }
        // A paragraph's or a bullet's bold run-in title is a section too:
        // `**Windows above 24.8 days.** ...`, `- **Connection.** ...`.
        if let Some(bold) = line.trim_start_matches("- ").strip_prefix("**") {
            if let Some((title, _)) = bold.split_once("**") {
                titles.insert(title.trim_end_matches(['.', ':']).replace('`', ""));
            }
            continue;
        }
        if !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim().replace('`', "");
        // "`on_error`: the fail policy" is cited as "on_error" too.
        if let Some((head, _)) = title.split_once(": ") {
            titles.insert(head.to_string());
        }
        if let Some((n, rest)) = title.split_once(". ") {
            if !n.is_empty() && n.chars().next().unwrap().is_ascii_digit() && n.chars().all(|c| c.is_ascii_alphanumeric()) {
                numbers.insert(n.to_string());
                titles.insert(rest.to_string());
            }
        }
        titles.insert(title);
    }
    Headings { titles, numbers }
}

/// The section citations of `text`: (document, section), the section a
/// quoted title or a number.
fn cited_sections(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find(".md") {
        let end = from + at + 3;
        let start = text[..end - 3].rfind(|c: char| !(c.is_ascii_uppercase() || c == '_')).map_or(0, |s| s + 1);
        from = end;
        let name = &text[start..end];
        if name.len() <= 3 || !name.chars().next().unwrap().is_ascii_uppercase() {
            continue;
        }
        let rest = text[end..].strip_prefix(',').unwrap_or(&text[end..]);
        let Some(rest) = rest.strip_prefix(' ') else { continue };
        let section = if let Some(q) = rest.strip_prefix('"') {
            match q.find('"') {
                Some(e) if !q[..e].contains('\n') => q[..e].replace('`', ""),
                _ => continue,
            }
        } else {
            let r = rest.strip_prefix('§').or_else(|| rest.strip_prefix("section ")).unwrap_or(rest);
            let n: String = r.chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
            // A number, with at most one letter after it: 4, 4f, 10.
            let digits = n.chars().take_while(|c| c.is_ascii_digit()).count();
            if digits == 0 || n.len() > digits + 1 || (n.len() == digits && r.len() == rest.len()) {
                continue;
            }
            n
        };
        out.push((name.to_string(), section));
    }
    out
}

#[test]
fn every_section_cited_is_a_heading_of_its_document() {
    let docs: Vec<(String, Headings)> = files_under("docs", ".md").into_iter().chain(["README.md".to_string(), "scripts/README.md".to_string()]).map(|d| {
        let h = headings(&read(&d));
        (d, h)
    }).collect();
    let mut wrong = Vec::new();
    for (file, text) in citing() {
        for (doc, section) in cited_sections(&text) {
            let Some((_, h)) = docs.iter().find(|(d, _)| d.rsplit('/').next() == Some(&doc)) else {
                wrong.push(format!("{file}: {doc} (no such document)"));
                continue;
            };
            let found = if section.chars().next().unwrap().is_ascii_digit() && section.len() <= 3 { h.numbers.contains(&section) } else { h.titles.contains(&section) };
            if !found {
                wrong.push(format!("{file}: {doc} \"{section}\""));
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    assert!(wrong.is_empty(), "sections cited that their document does not have:\n{}", wrong.join("\n"));
}

#[test]
fn every_semantics_rule_cited_is_written_down() {
    let rules = headings(&read("docs/SEMANTICS.md"));
    let mut wrong = Vec::new();
    for (file, text) in citing() {
        for (i, _) in text.match_indices("SEMANTICS") {
            let after = &text[i + "SEMANTICS".len()..];
            let after = after.strip_prefix(".md").unwrap_or(after);
            let rule: String = after.trim_start_matches([' ', ',']).chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
            if rule.starts_with('S') && rule.len() == 2 && !rules.titles.iter().any(|t| t.starts_with(&format!("{rule}:")) || t.starts_with(&format!("{rule} "))) {
                wrong.push(format!("{file}: SEMANTICS {rule}"));
            }
        }
    }
    assert!(wrong.is_empty(), "rules cited that docs/SEMANTICS.md does not have:\n{}", wrong.join("\n"));
    for n in 1..=9 {
        assert!(rules.titles.iter().any(|t| t.starts_with(&format!("S{n}:"))), "docs/SEMANTICS.md: no rule S{n}");
    }
}

/// The source files of the crate: (package dir under src/ or "", stem).
fn modules() -> Vec<(String, String)> {
    files_under("src", ".rs")
        .into_iter()
        .filter_map(|f| {
            let rel = f.strip_prefix("src/").unwrap();
            let (dir, file) = rel.rsplit_once('/').unwrap_or(("", rel));
            let stem = file.trim_end_matches(".rs");
            (!(dir.is_empty() && stem == "lib") && stem != "mod").then(|| (dir.to_string(), stem.to_string()))
        })
        .collect()
}

#[test]
fn the_readmes_layout_table_names_every_module() {
    let readme = read("README.md");
    let layout = &readme[readme.find("## Layout").expect("README: ## Layout")..];
    let layout = &layout[..layout[3..].find("\n## ").map_or(layout.len(), |e| e + 3)];
    let mut missing = Vec::new();
    for (dir, stem) in modules() {
        let named = if dir.is_empty() {
            layout.contains(&format!("`src/{stem}.rs`"))
        } else {
            // A package's row: `src/redis/` with its files in the row.
            let package = dir.split('/').next().unwrap();
            let inner = dir.split_once('/').map_or(String::new(), |(_, d)| format!("{d}/"));
            layout.lines().filter(|l| l.contains(&format!("`src/{package}/`"))).any(|row| row.contains(&format!("`{inner}{stem}.rs`")) || row.contains(&format!(" {inner}{stem}.rs`")) || row.contains(&format!("+ `{inner}{stem}.rs`")))
        };
        if !named {
            missing.push(if dir.is_empty() { format!("src/{stem}.rs") } else { format!("src/{dir}/{stem}.rs") });
        }
    }
    assert!(missing.is_empty(), "README.md's layout table misses:\n{}", missing.join("\n"));
}

#[test]
fn the_library_layer_table_names_every_module_of_each_package() {
    let lib = read("src/lib.rs");
    let table: Vec<&str> = lib.lines().filter(|l| l.starts_with("//! |")).collect();
    let mut missing = Vec::new();
    for (dir, stem) in modules() {
        if dir.is_empty() {
            continue; // tests/layout.rs holds the top-level modules to the table
        }
        let package = dir.split('/').next().unwrap();
        let row = table.iter().find(|r| r.split('|').nth(2).is_some_and(|m| m.contains(&format!("`{package}`"))));
        let named = row.is_some_and(|r| r.contains(&format!("`{stem}`")));
        if !named {
            missing.push(format!("{package}: `{stem}` (src/{dir}/{stem}.rs)"));
        }
    }
    assert!(missing.is_empty(), "src/lib.rs's layer table misses, in its package's row:\n{}", missing.join("\n"));
}

#[test]
fn both_lists_of_the_lua_clients_modules_name_every_module() {
    let modules: Vec<String> = files_under("lua/resty/ratelimitd", ".lua").iter().map(|f| f.rsplit('/').next().unwrap().trim_end_matches(".lua").to_string()).collect();
    assert!(modules.len() > 10, "{modules:?}");
    let nginx = read("docs/NGINX.md");
    let table = &nginx[nginx.find("### The client's modules").expect("NGINX.md: The client's modules")..];
    let table = &table[..table[4..].find("\n### ").map_or(table.len(), |e| e + 4)];
    let facade = read("lua/resty/ratelimitd.lua");
    let list: Vec<&str> = facade.lines().skip_while(|l| !l.contains("\"The client's modules\"")).skip(1).take_while(|l| l.starts_with("--")).collect();
    let mut missing = Vec::new();
    for m in &modules {
        if !table.contains(&format!("`{m}.lua`")) {
            missing.push(format!("docs/NGINX.md \"The client's modules\": {m}.lua"));
        }
        if !list.iter().any(|l| l.trim_start_matches('-').split_whitespace().next() == Some(m.as_str())) {
            missing.push(format!("lua/resty/ratelimitd.lua's module list: {m}"));
        }
    }
    assert!(missing.is_empty(), "module lists missing a module of lua/resty/ratelimitd/:\n{}", missing.join("\n"));
}

#[test]
fn the_readers_find_what_they_read() {
    assert_eq!(cited_paths("see src/redis/window.rs, docs/X.md and `tests/common/`."), vec!["src/redis/window.rs", "tests/common"]);
    assert_eq!(cited_paths("(docs/METRICS: x) a/src/b.rs"), vec!["docs/METRICS"]);
    assert_eq!(cited_documents("SEMANTICS.md, docs/ADMIN.md, X.md, x.md, README.mdx"), vec!["SEMANTICS.md"]);
    assert_eq!(
        cited_sections("PROTOCOL.md 4f, OPERATIONS.md §6, NGINX.md section 8, CONFIG.md, \"Connection\", POLICIES.md \"Penalty box\", PROTOCOL.md 2024 PROTOCOL.md is"),
        [("PROTOCOL.md", "4f"), ("OPERATIONS.md", "6"), ("NGINX.md", "8"), ("CONFIG.md", "Connection"), ("POLICIES.md", "Penalty box")].map(|(a, b)| (a.to_string(), b.to_string()))
    );
    let h = headings("# T\n## 4f. Reserve and settle\n### `on_error`: the fail policy\n```\n# not a heading\n```\n- **Connection.** One\n**Keys** x\n");
    assert!(h.numbers.contains("4f") && h.titles.contains("Reserve and settle") && h.titles.contains("on_error") && !h.titles.contains("not a heading"));
    assert!(h.titles.contains("Connection") && h.titles.contains("Keys"));
}

/// The inputs of the sample outputs docs/CONFIG.md shows, by the name the
/// page gives each (`/tmp/rl-doc/NAME.toml`). `DIR` stands for the folder
/// the test writes them to, shown as /tmp/rl-doc.
const CONFIG_SAMPLES: [(&str, &str); 21] = [
    ("several", "[server]\nmax_connections = \"5\"\nsocket_mod = \"0660\"\n\n[[policy]]\nname = \"login\"\nlimt = 5\nwindow = \"60s\"\n\n[redis]\nclock = \"redsi\"\n[sever]\n"),
    ("sentinel_ok", "[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [\"10.0.0.1:26379\", \"10.0.0.2:26379\"]\n"),
    ("many", "[server]\nsocket_mode = \"0999\"\nmax_connections = 0\n[redis]\ntimeout_ms = 0\nkey_prefix = \"{x}\"\n[limits]\nmax_local_keys = 10\n[log]\nlevel = \"infoo\"\n"),
    ("outside", "[server]\nsocket_group = \"no-such-group\"\n[redis]\npassword_file = \"/nonexistent/pw\"\n[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [\"10.0.0.1:26379\"]\npassword_env = \"RATELIMITD_SENTINEL_PW\"\n"),
    ("typo", "[redis]\nurl = \"redis://127.0.0.1:6379\"\ntimout = \"20ms\"\n"),
    ("range", "[redis]\ntimeout_ms = 0\n"),
    ("breaker", "[redis]\nbreaker_failures = 0\n"),
    ("idle", "[server]\nidle_timeout_ms = 0\n"),
    ("localkeys", "[limits]\nmax_local_keys = 10\n"),
    ("sentinel_url", "[redis]\nurl = \"redis://10.0.0.1:6379\"\n[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [\"10.0.0.1:26379\"]\n"),
    ("sentinel_addr", "[redis.sentinel]\nmaster_name = \"mymaster\"\naddresses = [\"10.0.0.1\"]\n"),
    ("sentinel_missing", "[redis.sentinel]\nmaster_name = \"mymaster\"\n"),
    ("tls_plain", "[redis]\nurl = \"redis://10.0.0.1:6379\"\ntls_ca_file = \"/nonexistent/ca.pem\"\n"),
    ("tls_missing", "[redis]\nurl = \"rediss://10.0.0.1:6379\"\ntls_ca_file = \"/nonexistent/ca.pem\"\n"),
    ("tls_halfpair", "[redis]\nurl = \"rediss://10.0.0.1:6379\"\ntls_key_file = \"/nonexistent/key.pem\"\n"),
    ("pwenv", "[redis]\npassword_env = \"RATELIMITD_REDIS_PASSWORD\"\n"),
    ("pwboth", "[redis]\npassword_file = \"DIR/emptypw\"\npassword_env = \"RATELIMITD_REDIS_PASSWORD\"\n"),
    ("pwempty", "[redis]\npassword_file = \"DIR/emptypw\"\n"),
    ("metrics", "[metrics]\nlisten = \"0.0.0.0:9464\"\n"),
    ("mode", "[server]\nsocket_mode = 432\n"),
    ("clock", "[redis]\nclock = \"ntp\"\n"),
];

/// What `ratelimitd ARGS` prints (stdout, then stderr), `DIR` shown as
/// /tmp/rl-doc, and its exit status; a `serve` that has not exited within
/// 10 s is killed (it is meant to stop at its configuration).
fn ratelimitd_says(dir: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(args)
        .current_dir(root())
        .env_remove("RATELIMITD_REDIS_PASSWORD")
        .env_remove("RATELIMITD_SENTINEL_PW")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text.replace(dir.to_str().unwrap(), "/tmp/rl-doc"))
}

#[test]
fn every_sample_output_in_config_md_is_what_the_binary_prints() {
    let dir = std::env::temp_dir().join(format!("rl-doc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("emptypw"), "").unwrap();
    for (name, toml) in CONFIG_SAMPLES {
        std::fs::write(dir.join(format!("{name}.toml")), toml.replace("DIR", dir.to_str().unwrap())).unwrap();
    }
    let page = read("docs/CONFIG.md");
    let mut wrong = Vec::new();
    let mut fenced = false;
    let mut command: Option<(Option<i32>, String)> = None;
    let mut runs = 0;
    let mut skip_answer = false;
    for line in page.lines() {
        let line = line.trim_start();
        if line.starts_with("```") {
            fenced = !fenced;
            command = None;
            continue;
        }
        if !fenced {
            continue;
        }
        if let Some(cmd) = line.strip_prefix("$ ratelimitd ") {
            // A command the page shows with its output: run it.
            let args: Vec<String> = cmd.split_whitespace().map(|a| a.replace("/tmp/rl-doc", dir.to_str().unwrap())).collect();
            command = Some(ratelimitd_says(&dir, &args.iter().map(String::as_str).collect::<Vec<_>>()));
            runs += 1;
            continue;
        }
        if line.starts_with("$ ") {
            // Another command (`echo $?`): its answer is not the binary's.
            command = Some((None, String::new()));
            skip_answer = true;
            continue;
        }
        if std::mem::take(&mut skip_answer) {
            continue;
        }
        let said = match &command {
            Some((_, said)) => said.clone(),
            // A line alone names its file: `ratelimitd: /tmp/rl-doc/NAME.toml: ...`.
            None => match line.strip_prefix("ratelimitd: /tmp/rl-doc/").and_then(|r| r.split_once(".toml")) {
                Some((name, _)) => {
                    if !CONFIG_SAMPLES.iter().any(|(n, _)| *n == name) {
                        wrong.push(format!("{name}.toml: no input in CONFIG_SAMPLES for this sample: add it"));
                        continue;
                    }
                    runs += 1;
                    ratelimitd_says(&dir, &["check-config", "--config", dir.join(format!("{name}.toml")).to_str().unwrap()]).1
                }
                None => continue,
            },
        };
        if line.is_empty() {
            continue;
        }
        if !said.lines().any(|l| l.trim_end() == line.trim_end()) {
            wrong.push(format!("the page shows:\n  {line}\nthe binary prints:\n  {}", said.trim_end().replace('\n', "\n  ")));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(runs >= 20, "{runs} samples read: the reader lost them");
    assert!(wrong.is_empty(), "docs/CONFIG.md's sample outputs are not the binary's:\n{}", wrong.join("\n"));
}

/// The metrics the daemon exports: every name a string of src/ starts
/// with, or a `# TYPE` line names (a histogram's series by its own name).
fn exported_metrics() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for file in files_under("src", ".rs") {
        let text = read(&file);
        for pat in ["\"ratelimitd_", "# TYPE ratelimitd_"] {
            for (at, _) in text.match_indices(pat) {
                let from = at + pat.len() - "ratelimitd_".len();
                let name: String = text[from..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
                let name = name.trim_end_matches('_');
                let name = ["_bucket", "_sum", "_count"].iter().fold(name, |n, s| n.strip_suffix(s).unwrap_or(n));
                if name.len() > "ratelimitd_".len() {
                    names.insert(name.to_string());
                }
            }
        }
    }
    names
}

#[test]
fn every_metric_is_documented_once_in_its_home() {
    let metrics = exported_metrics();
    assert!(metrics.len() >= 40 && metrics.contains("ratelimitd_decisions_total"), "{metrics:?}");
    let ops = read("docs/OPERATIONS.md");
    let home = &ops[ops.find("## 6. Metrics").expect("OPERATIONS.md: ## 6. Metrics")..];
    let home = &home[..home[3..].find("\n## ").map_or(home.len(), |e| e + 3)];
    let mut wrong = Vec::new();
    for m in &metrics {
        if !home.contains(&format!("`{m}`")) && !home.contains(&format!("`{m}{{")) {
            wrong.push(format!("{m}: not in its home, docs/OPERATIONS.md \"6. Metrics\""));
        }
    }
    // A metric's table row (its description) is written once, there.
    let mut rows: Vec<(String, String)> = Vec::new();
    for doc in files_under("docs", ".md").into_iter().chain(["README.md".to_string()]) {
        for line in read(&doc).lines().filter(|l| l.starts_with("| `ratelimitd_")) {
            let cell = line.split('|').nth(1).unwrap();
            for name in cell.split('`').filter(|n| n.starts_with("ratelimitd_")) {
                let name = name.split('{').next().unwrap();
                rows.push((name.to_string(), doc.clone()));
                if !home.contains(line) {
                    wrong.push(format!("{doc}: a row for {name} outside docs/OPERATIONS.md \"6. Metrics\": link there instead"));
                }
            }
        }
    }
    for m in &metrics {
        let n = rows.iter().filter(|(r, _)| r == m).count();
        if n > 1 {
            wrong.push(format!("{m}: {n} table rows"));
        }
    }
    for (r, doc) in &rows {
        if !metrics.contains(r) {
            wrong.push(format!("{doc}: a row for {r}, which the daemon does not export"));
        }
    }
    assert!(wrong.is_empty(), "metrics and their one home:\n{}", wrong.join("\n"));
}

/// The ops PROTOCOL.md's code-4 row names and the flag bits it says each
/// takes: "CHECK, a bit outside 0x0F00; CHECK_POLICY, a bit other than
/// `0x0001` ...; REFUND, ACQUIRE: any".
fn documented_flags(protocol: &str) -> Vec<(String, u16)> {
    let row = protocol.lines().find(|l| l.starts_with("| 4 | UNSUPPORTED_FLAGS |")).expect("PROTOCOL.md: the code-4 row");
    let when = row.split(" | ").nth(2).expect("the row's When cell");
    let (_, clauses) = when.split_once(": ").expect("the op clauses after a colon");
    let mut out = Vec::new();
    for clause in clauses.trim_end_matches(" |").split("; ") {
        let mut ops = Vec::new();
        let mut rest = String::new();
        let tokens: Vec<&str> = clause.split(", ").collect();
        for (i, t) in tokens.iter().enumerate() {
            let op_like = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_uppercase() || c == '_');
            if op_like(t) {
                ops.push(t.to_string());
            } else if let Some((op, r)) = t.split_once(": ").filter(|(op, _)| op_like(op)) {
                ops.push(op.to_string());
                rest = std::iter::once(r).chain(tokens[i + 1..].iter().copied()).collect::<Vec<_>>().join(", ");
                break;
            } else {
                rest = tokens[i..].join(", ");
                break;
            }
        }
        let hex: Vec<u16> = rest.split("0x").skip(1).filter_map(|h| u16::from_str_radix(h.get(..4)?, 16).ok()).collect();
        let bits = hex.iter().fold(0, |a, h| a | h);
        for op in ops {
            out.push((op, bits));
        }
    }
    out
}

#[test]
fn the_flags_each_op_takes_are_the_protocols_code_4_row() {
    use bytes::{Bytes, BytesMut};
    use ratelimitd::protocol::*;
    let policy = PolicyCheckArgs { policy: b"p", key: b"k", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
    let item = [ItemArgs { policy: b"p", key: b"k", cost: 1 }];
    let lease = LeaseArgs { key: b"k", lease: b"l", limit: 5, lease_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
    let policy_lease = PolicyLeaseArgs { check: PolicyCheckArgs { policy: b"p", key: b"k", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }, lease: b"l" };
    let frame = |encode: &dyn Fn(&mut BytesMut)| {
        let mut b = BytesMut::new();
        encode(&mut b);
        b.split_off(LEN_PREFIX).to_vec()
    };
    let ops: Vec<(&str, Vec<u8>)> = vec![
        ("CHECK", frame(&|b| encode_request(1, &CheckArgs { key: b"k", limit: 5, window_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }, b))),
        ("CHECK_POLICY", frame(&|b| encode_policy_request(1, &policy, b))),
        ("REFUND", frame(&|b| encode_refund(1, &[7; HANDLE_LEN], &item, b))),
        ("ACQUIRE", frame(&|b| encode_lease_request(1, OP_ACQUIRE, &lease, b))),
        ("RELEASE", frame(&|b| encode_lease_request(1, OP_RELEASE, &lease, b))),
        ("ACQUIRE_POLICY", frame(&|b| encode_policy_lease_request(1, false, &policy_lease, b))),
        ("DESCRIBE_POLICY", frame(&|b| encode_describe(1, b"p", b))),
        ("SETTLE", frame(&|b| encode_settle(1, &[7; HANDLE_LEN], &item, b))),
        ("LEASE_SHARE", frame(&|b| encode_lease_share(1, &policy, b))),
    ];
    let doc = documented_flags(&read("docs/PROTOCOL.md"));
    let mut wrong = Vec::new();
    for (name, body) in &ops {
        assert!(!matches!(parse_request(Bytes::from(body.clone()), &Bounds::default()), Inbound::Invalid { .. }), "{name}: the frame built here is valid");
        // The bits the decoder takes (anything but UNSUPPORTED_FLAGS: the
        // frame may then fail a later check), one at a time.
        let taken = (0..16).map(|bit| 1u16 << bit).filter(|&flag| {
            let mut b = body.clone();
            b[6..8].copy_from_slice(&flag.to_be_bytes());
            !matches!(parse_request(Bytes::from(b), &Bounds::default()), Inbound::Invalid { code: ErrorCode::UnsupportedFlags, .. })
        });
        let taken = taken.fold(0, |a, f| a | f);
        match doc.iter().find(|(op, _)| op == name) {
            None => wrong.push(format!("{name}: not in the row")),
            Some((_, said)) if *said != taken => wrong.push(format!("{name}: the row says flags {said:#06x}, the decoder takes {taken:#06x}")),
            Some(_) => {}
        }
    }
    assert!(wrong.is_empty(), "PROTOCOL.md's UNSUPPORTED_FLAGS (4) row against the decoder:\n{}", wrong.join("\n"));
}
