//! What the docs say the daemon sends and logs, held to the code: the error
//! codes and ops of docs/PROTOCOL.md beyond its tables (tests/vocabulary.rs
//! checks those), every `NAME` (N) error code quoted in a doc, and the log
//! lines docs quote (docs/OPERATIONS.md's table of lines worth alerting on,
//! sample lines in text and JSON, messages quoted in prose): each must be a
//! message the daemon logs, at that level, in that module, with those
//! fields.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use ratelimitd::protocol::ErrorCode;

#[path = "common/repo.rs"]
mod repo;
use repo::{read, root};

/// The docs a reader reads: README.md, docs/*.md, the example config and
/// the nginx snippets, as (path, text).
fn docs() -> Vec<(String, String)> {
    let mut out = vec![("README.md".to_string(), read("README.md")), ("ratelimitd.example.toml".to_string(), read("ratelimitd.example.toml"))];
    for dir in ["docs", "nginx"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(root().join(dir)).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
        files.sort();
        for f in files {
            let rel = f.strip_prefix(root()).unwrap().display().to_string();
            out.push((rel, std::fs::read_to_string(&f).unwrap()));
        }
    }
    out
}

fn codes() -> BTreeMap<u16, &'static str> {
    ErrorCode::ALL.iter().map(|&c| (c.to_wire(), c.as_str())).collect()
}

/// "15, 19, 21-29 and 36-49" as the set of numbers it names.
fn number_list(text: &str) -> BTreeSet<u16> {
    let mut out = BTreeSet::new();
    for part in text.replace(" and ", ", ").replace(" or ", ", ").split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (u16, u16) = (lo.trim().parse().unwrap_or_else(|_| panic!("`{part}` is not a number or range")), hi.trim().parse().unwrap_or_else(|_| panic!("`{part}` is not a number or range")));
        out.extend(lo..=hi);
    }
    out
}

/// The section of docs/PROTOCOL.md under `### Error codes`.
fn error_section(doc: &str) -> &str {
    let at = doc.find("### Error codes").expect("docs/PROTOCOL.md: ### Error codes");
    let s = &doc[at..];
    &s[..s[4..].find("\n## ").map_or(s.len(), |e| e + 4)]
}

/// "Codes ... are not assigned in v1." of the error codes section.
fn unassigned(section: &str) -> BTreeSet<u16> {
    let flat = section.replace('\n', " ");
    let start = flat.find("Codes ").expect("PROTOCOL.md error codes: no `Codes ... are not assigned` sentence") + "Codes ".len();
    let end = start + flat[start..].find(" are not assigned").expect("PROTOCOL.md error codes: `are not assigned`");
    number_list(&flat[start..end])
}

#[test]
fn the_protocol_says_which_codes_are_unassigned_and_ranges_every_code() {
    let doc = read("docs/PROTOCOL.md");
    let section = error_section(&doc);
    let assigned: BTreeSet<u16> = codes().keys().copied().collect();
    let expected: BTreeSet<u16> = (0..=49).filter(|c| !assigned.contains(c)).collect();
    assert_eq!(unassigned(section), expected, "docs/PROTOCOL.md `Codes ... are not assigned in v1` against ErrorCode");
    // The range table: every code in one row.
    let ranges: Vec<BTreeSet<u16>> = section
        .lines()
        .skip_while(|l| !l.starts_with("| Range |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| number_list(l.split('|').nth(1).unwrap()))
        .collect();
    assert!(!ranges.is_empty(), "PROTOCOL.md: no `| Range |` table");
    for code in &assigned {
        assert_eq!(ranges.iter().filter(|r| r.contains(code)).count(), 1, "code {code} in exactly one row of the range table");
    }
}

/// `pub const OP_NAME: u8 = N;` of src/protocol/wire.rs.
fn ops() -> BTreeMap<u8, String> {
    read("src/protocol/wire.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("pub const OP_"))
        .filter_map(|l| {
            let (name, value) = l.split_once(": u8 = ")?;
            Some((value.trim_end_matches(';').parse().ok()?, name.to_string()))
        })
        .collect()
}

#[test]
fn the_protocol_lists_the_ops_the_daemon_knows() {
    let ops = ops();
    assert!(ops.len() >= 6, "{ops:?}");
    let doc = read("docs/PROTOCOL.md");
    // Section 3: "knows N ops: **`1` = CHECK**, ...".
    let versioning = &doc[doc.find("## 3. Versioning").unwrap()..doc.find("## 4. ").unwrap()];
    let mut listed = BTreeMap::new();
    for piece in versioning.split("**`").skip(1) {
        let (value, rest) = piece.split_once("` = ").expect("**`N` = NAME**");
        let name: String = rest.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_').collect();
        listed.insert(value.parse::<u8>().unwrap(), name);
    }
    assert_eq!(listed, ops, "docs/PROTOCOL.md section 3 against the OP_ constants of src/protocol/wire.rs");
    const WORDS: [&str; 11] = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"];
    assert!(versioning.replace('\n', " ").contains(&format!("knows {} ops", WORDS[ops.len()])), "section 3 says how many ops: {}", ops.len());
    // The UNKNOWN_OP row: "`op` not 1, 2, 3, 5 or 6".
    let row = doc.lines().find(|l| l.starts_with("| 3 | UNKNOWN_OP |")).expect("the UNKNOWN_OP row");
    let list = row.split("`op` not ").nth(1).expect("UNKNOWN_OP: `op` not ...").split(" |").next().unwrap();
    let known: BTreeSet<u16> = ops.keys().map(|&v| u16::from(v)).collect();
    assert_eq!(number_list(list), known, "the UNKNOWN_OP row of docs/PROTOCOL.md");
}

/// Every `NAME` (N) in `text` where NAME is all capitals and underscores.
fn quoted_codes(text: &str) -> Vec<(String, u16)> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices(" (") {
        let Some(close) = text[i + 2..].find(')') else { continue };
        let Ok(n) = text[i + 2..i + 2 + close].parse::<u16>() else { continue };
        let before = text[..i].trim_end_matches('`');
        let start = before.rfind(|c: char| !(c.is_ascii_uppercase() || c == '_')).map_or(0, |s| s + 1);
        let name = &before[start..];
        if name.len() >= 4 && name.contains('_') || codes().values().any(|c| *c == name) {
            out.push((name.to_string(), n));
        }
    }
    out
}

#[test]
fn every_error_code_the_docs_quote_with_its_number_has_that_number() {
    let by_name: BTreeMap<&str, u16> = codes().into_iter().map(|(v, n)| (n, v)).collect();
    let mut wrong = Vec::new();
    let mut seen = 0;
    for (path, text) in docs() {
        for (name, n) in quoted_codes(&text) {
            if let Some(&code) = by_name.get(name.as_str()) {
                seen += 1;
                if code != n {
                    wrong.push(format!("{path}: `{name}` ({n}), the daemon's is {code}"));
                }
            }
        }
    }
    assert!(seen > 20, "the reader finds the docs' codes: {seen}");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// One `tracing` macro call in src/: the module it is in, its level, where
/// it starts in its file, and its text from the macro's name to the `;`
/// that ends the statement (a `;` inside a string literal does not).
struct LogCall {
    file: usize,
    module: String,
    level: &'static str,
    start: usize,
    text: String,
}

/// The one reader of the daemon's log calls: every `error!(` ... `trace!(`
/// in every `.rs` file under src/.
fn log_calls() -> Vec<LogCall> {
    let files: Vec<PathBuf> = repo::files_under("src", ".rs").iter().map(|f| root().join(f)).collect();
    let mut out = Vec::new();
    for (file, f) in files.iter().enumerate() {
        let text = std::fs::read_to_string(f).unwrap();
        let module = f.strip_prefix(root().join("src")).unwrap().with_extension("").display().to_string().replace('/', "::");
        for level in ["error", "warn", "info", "debug", "trace"] {
            for (start, _) in text.match_indices(&format!("{level}!(")) {
                let (mut inside, mut escaped, mut end) = (false, false, text.len());
                for (i, c) in text[start..].char_indices() {
                    match (inside, c) {
                        (true, _) if escaped => escaped = false,
                        (true, '\\') => escaped = true,
                        (true, '"') => inside = false,
                        (false, '"') => inside = true,
                        (false, ';') => {
                            end = start + i;
                            break;
                        }
                        _ => {}
                    }
                }
                out.push(LogCall { file, module: module.clone(), level, start, text: text[start..end].to_string() });
            }
        }
    }
    out
}

/// Where and at which level a message is logged: (module, level, the macro
/// call's text up to the message), for every `"message"` in src/ inside a
/// `tracing` macro call (the nearest call before it, when one statement
/// holds several).
fn logged(message: &str) -> Vec<(String, String, String)> {
    let calls = log_calls();
    let quoted = format!("\"{message}\"");
    let mut out = Vec::new();
    for call in &calls {
        for (at, _) in call.text.match_indices(&quoted) {
            let nearer = calls.iter().any(|c| c.file == call.file && c.start > call.start && c.start < call.start + at);
            if !nearer {
                out.push((call.module.clone(), call.level.to_uppercase(), call.text[..at].to_string()));
            }
        }
    }
    out
}

/// Whether a macro call's text names `field` (`field = ...`, `%field`,
/// `?field`, or a bare `field,`).
fn has_field(call: &str, field: &str) -> bool {
    let words: Vec<&str> = call.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '%' || c == '?')).filter(|w| !w.is_empty()).collect();
    words.iter().any(|w| w.trim_start_matches(['%', '?']) == field)
}

/// Checks one quoted line: `message` logged at `level`, in `module` if
/// given (a prefix of the file's module path), with `fields`.
fn check_line(level: &str, message: &str, module: Option<&str>, fields: &[&str]) -> Result<(), String> {
    let sites = logged(message);
    if sites.is_empty() {
        return Err(format!("`{message}`: no tracing macro in src/ logs this message"));
    }
    let fits = |(m, l, call): &(String, String, String)| {
        l == level && module.map_or(true, |want| format!("ratelimitd::{m}").starts_with(want) || want.starts_with(&format!("ratelimitd::{m}"))) && fields.iter().all(|f| has_field(call, f))
    };
    if sites.iter().any(fits) {
        Ok(())
    } else {
        Err(format!("`{message}` quoted as {level}{} with fields {fields:?}; the daemon logs it as {:?}", module.map_or(String::new(), |m| format!(" in {m}")), sites.iter().map(|(m, l, _)| format!("{l} in {m}")).collect::<Vec<_>>()))
    }
}

/// The backticked lowercase identifiers after "fields" in a table cell.
fn fields_of(meaning: &str) -> Vec<&str> {
    let Some(at) = meaning.find("fields ") else { return vec![] };
    let rest = &meaning[at..];
    let rest = &rest[..rest.find(". ").unwrap_or(rest.len())];
    rest.split('`').skip(1).step_by(2).filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '_')).collect()
}

#[test]
fn the_log_lines_the_docs_quote_are_the_daemons() {
    let mut wrong = Vec::new();
    let mut seen = 0;
    // docs/OPERATIONS.md: | Level | Message | Meaning |.
    let ops = read("docs/OPERATIONS.md");
    let table = ops.lines().skip_while(|l| !l.starts_with("| Level | Message |")).skip(2).take_while(|l| l.starts_with('|'));
    for row in table {
        let cells: Vec<&str> = row.split(" | ").collect();
        let level = cells[0].trim_start_matches("| ").trim();
        let meaning = cells.get(2).copied().unwrap_or("");
        for message in cells[1].split(" / ").map(|m| m.trim().trim_matches('`')) {
            seen += 1;
            if let Err(why) = check_line(level, message, None, &fields_of(meaning)) {
                wrong.push(format!("docs/OPERATIONS.md log table: {why}"));
            }
        }
    }
    assert!(seen >= 10, "the reader finds docs/OPERATIONS.md's table of log lines: {seen}");
    // Sample lines in any doc: " WARN ratelimitd::module: message k=v ..."
    // and JSON lines with "level", "fields" and "target".
    for (path, text) in docs() {
        for line in text.lines() {
            let l = line.trim();
            if let Some((level, rest)) = l.split_once(' ').filter(|(lv, r)| ["ERROR", "WARN", "INFO", "DEBUG"].contains(lv) && r.starts_with("ratelimitd::")) {
                let (target, rest) = rest.split_once(": ").unwrap();
                let words: Vec<&str> = rest.split(' ').collect();
                let n = words.iter().rposition(|w| !w.contains('=')).map_or(0, |p| p + 1);
                let fields: Vec<&str> = words[n..].iter().map(|w| w.split('=').next().unwrap()).collect();
                seen += 1;
                if let Err(why) = check_line(level, &words[..n].join(" "), Some(target), &fields) {
                    wrong.push(format!("{path}: {why}"));
                }
            } else if l.starts_with("{\"timestamp\"") && l.contains("\"fields\"") {
                let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{path}: a JSON log line that does not parse ({e}): {l}"));
                let fields: Vec<&str> = v["fields"].as_object().unwrap().keys().map(String::as_str).filter(|k| *k != "message").collect();
                seen += 1;
                if let Err(why) = check_line(v["level"].as_str().unwrap(), v["fields"]["message"].as_str().unwrap(), v["target"].as_str(), &fields) {
                    wrong.push(format!("{path}: {why}"));
                }
            }
        }
    }
    assert!(seen >= 12, "{seen}");
    assert!(wrong.is_empty(), "log lines in the docs that the daemon does not write:\n{}", wrong.join("\n"));
}

/// Every string literal of 20 characters or more inside a `tracing` macro
/// call in src/: the messages the daemon logs.
fn all_messages() -> Vec<String> {
    let mut out = Vec::new();
    for call in log_calls() {
        let (mut literal, mut inside, mut escaped) = (String::new(), false, false);
        for c in call.text.chars() {
            match (inside, c) {
                (true, _) if escaped => {
                    literal.push(c);
                    escaped = false;
                }
                (true, '\\') => escaped = true,
                (true, '"') => {
                    inside = false;
                    if literal.len() >= 20 {
                        out.push(std::mem::take(&mut literal));
                    }
                    literal.clear();
                }
                (true, c) => literal.push(c),
                (false, '"') => inside = true,
                _ => {}
            }
        }
    }
    out
}

/// The parts of backticked spans in `text` that quote a logged message
/// (their first 20 characters are in one) but are not part of it: a
/// message the code changed and the doc kept. A span may elide with `...`.
fn misquoted(text: &str, messages: &[String]) -> Vec<String> {
    // Fenced blocks hold whole lines (checked by
    // `the_log_lines_the_docs_quote_are_the_daemons`), not spans.
    let prose: String = text.split("```").step_by(2).collect::<Vec<_>>().join("\n");
    let mut out = Vec::new();
    for span in prose.split('`').skip(1).step_by(2) {
        let span = span.split_whitespace().collect::<Vec<_>>().join(" ");
        // "ERROR ratelimitd::daemon: message": the message.
        let span = span.split_once(": ").filter(|(head, _)| head.contains("ratelimitd::") || head.ends_with("...")).map_or(span.as_str(), |(_, m)| m);
        for part in span.split("...").map(str::trim) {
            let Some(head) = part.get(..20) else { continue };
            if messages.iter().any(|m| m.contains(head)) && !messages.iter().any(|m| within(part, m)) {
                out.push(part.to_string());
            }
        }
    }
    out
}

/// Whether `part` is a substring of `message`, where a `{...}` of the
/// message (a formatted value) stands for one word.
fn within(part: &str, message: &str) -> bool {
    // The message as pieces: Some(char) literal, None a placeholder.
    let mut pattern = Vec::new();
    let mut chars = message.chars();
    while let Some(c) = chars.next() {
        if c == '{' {
            for d in chars.by_ref() {
                if d == '}' {
                    break;
                }
            }
            pattern.push(None);
        } else {
            pattern.push(Some(c));
        }
    }
    // at[j]: the text so far matches the pattern from some start up to j.
    let mut at = vec![true; pattern.len() + 1];
    for c in part.chars() {
        let mut next = vec![false; pattern.len() + 1];
        for (j, p) in pattern.iter().enumerate().filter(|&(j, _)| at[j]) {
            match p {
                Some(p) if *p == c => next[j + 1] = true,
                // A placeholder (a number, a name: one word) takes this
                // character, and may take more.
                None if !c.is_whitespace() => {
                    next[j] = true;
                    next[j + 1] = true;
                }
                _ => {}
            }
        }
        if !next.contains(&true) {
            return false;
        }
        at = next;
    }
    true
}

#[test]
fn every_log_message_quoted_in_prose_is_one_the_daemon_logs() {
    let messages = all_messages();
    assert!(messages.iter().any(|m| m == "redis failed; the request's fail policy decides"), "the reader finds the daemon's messages");
    let mut wrong = Vec::new();
    let mut placed = 0;
    for (path, text) in docs() {
        wrong.extend(misquoted(&text, &messages).into_iter().map(|p| format!("{path}: `{p}`")));
        // `LEVEL ratelimitd::module: message` spans: that level, that module.
        let prose: String = text.split("```").step_by(2).collect::<Vec<_>>().join("\n");
        for span in prose.split('`').skip(1).step_by(2) {
            let span = span.split_whitespace().collect::<Vec<_>>().join(" ");
            let Some((level, rest)) = span.split_once(' ').filter(|(l, r)| ["ERROR", "WARN", "INFO", "DEBUG"].contains(l) && r.starts_with("ratelimitd::")) else { continue };
            let Some((target, message)) = rest.split_once(": ") else { continue };
            if message.contains("...") || message.len() < 20 {
                continue;
            }
            placed += 1;
            if let Err(why) = check_line(level, message, Some(target), &[]) {
                wrong.push(format!("{path}: {why}"));
            }
        }
    }
    assert!(placed >= 10, "the reader finds `LEVEL ratelimitd::module: message` quotes: {placed}");
    assert!(wrong.is_empty(), "quoted as log messages, but not what the daemon logs:\n{}", wrong.join("\n"));
}

/// GitHub's anchor of a heading: lower case, punctuation dropped (but
/// `-` and `_`), spaces as `-`.
fn slug(heading: &str) -> String {
    heading.trim().to_lowercase().chars().filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_')).map(|c| if c == ' ' { '-' } else { c }).collect()
}

/// The anchors of a markdown file's headings (outside fenced blocks).
fn anchors(text: &str) -> BTreeSet<String> {
    text.split("```").step_by(2).flat_map(|prose| prose.lines()).filter(|l| l.starts_with('#')).map(|l| slug(l.trim_start_matches('#'))).collect()
}

/// The `[text](target)` links of a markdown file, outside fenced blocks.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for prose in text.split("```").step_by(2) {
        for (at, _) in prose.match_indices("](") {
            let rest = &prose[at + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_string());
            }
        }
    }
    out
}

#[test]
fn every_link_between_the_docs_resolves() {
    let mut pages = vec!["README.md".to_string(), "scripts/README.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "md")).map(|p| p.strip_prefix(root()).unwrap().display().to_string()).collect();
    docs.sort();
    pages.extend(docs);
    let (mut broken, mut anchored) = (Vec::new(), 0);
    for page in &pages {
        let text = read(page);
        let dir = Path::new(page).parent().unwrap();
        for link in links(&text) {
            if link.starts_with("http") || link.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() { PathBuf::from(page) } else { dir.join(file) };
            let path = root().join(&target);
            if !path.exists() {
                broken.push(format!("{page}: ({link}): no file {}", target.display()));
            } else if !anchor.is_empty() && path.is_file() {
                anchored += 1;
                if !anchors(&std::fs::read_to_string(&path).unwrap()).contains(anchor) {
                    broken.push(format!("{page}: ({link}): no heading #{anchor} in {}", target.display()));
                }
            }
        }
    }
    assert!(anchored > 40, "the reader finds the links to headings: {anchored}");
    assert!(broken.is_empty(), "links that lead nowhere:\n{}", broken.join("\n"));
}

#[test]
fn scripts_readme_names_every_script() {
    let readme = read("scripts/README.md");
    let mut missing = Vec::new();
    for e in std::fs::read_dir(root().join("scripts")).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let named = if p.is_dir() { format!("`scripts/{name}/`") } else { format!("`scripts/{name}") };
        if name != "README.md" && !readme.contains(&named) {
            missing.push(named);
        }
    }
    assert!(missing.is_empty(), "scripts/README.md does not say what these are: {missing:?}");
}

#[test]
fn the_readers_fail_on_drift() {
    assert_eq!(number_list("15, 19, 21-29 and 36-49").len(), 1 + 1 + 9 + 14);
    assert_eq!(unassigned("x\nCodes 15, 18-19 are not\nassigned in v1"), BTreeSet::from([15, 18, 19]));
    assert_eq!(quoted_codes("with `UNKNOWN_OP` (4) and UNKNOWN_POLICY (12), not (7)"), vec![("UNKNOWN_OP".into(), 4), ("UNKNOWN_POLICY".into(), 12)]);
    assert!(check_line("WARN", "redis too slow; breaker open, requests follow their fail policy until a probe succeeds", Some("ratelimitd::redis::link"), &["failures"]).is_ok());
    assert!(check_line("INFO", "redis too slow; breaker open, requests follow their fail policy until a probe succeeds", None, &[]).is_err(), "another level");
    assert!(check_line("WARN", "redis too slow; breaker open, requests follow their fail policy until a probe succeeds", Some("ratelimitd::daemon"), &[]).is_err(), "another module");
    assert!(check_line("WARN", "redis too slow; breaker open, requests follow their fail policy until a probe succeeds", None, &["latency"]).is_err(), "a field it does not have");
    assert!(check_line("WARN", "redis too slow", None, &[]).is_err(), "a message it does not log");
    assert_eq!(fields_of("fields `error`, `policy` (`Open`, `Closed`), `key`. At most"), ["error", "policy", "key"]);
    let messages = ["the new [redis] settings cannot be used; keeping the running backend".to_string()];
    assert_eq!(misquoted("or `ERROR ... the new [redis] settings cannot be used; keeping the running link` and `redis.url`", &messages), ["the new [redis] settings cannot be used; keeping the running link"]);
    assert_eq!(misquoted("`... cannot be used; keeping the running link` or `... cannot be used; keeping the running backend`", &messages), ["cannot be used; keeping the running link"]);
    assert_eq!(slug(" 2. `nginx/ratelimitd.conf`, line by line"), "2-nginxratelimitdconf-line-by-line");
    assert_eq!(slug("What `shards = S` does"), "what-shards--s-does");
    assert!(within("keeping N of them", "limits: keeping {} of them") && within("keeping 5 of", "keeping {} of them") && !within("keeping N of theirs", "keeping {} of them"));
}
