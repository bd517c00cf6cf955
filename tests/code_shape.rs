//! The code's shape, held: no file under `src/` over `MAX_FILE_LINES` lines
//! of code and no function over `MAX_FN_LINES` (issue 36: a newcomer reads
//! a file in a sitting and a function on a screen or two). Lines of code
//! are the lines with something besides a comment on them: blank lines,
//! comment lines and `#[cfg(test)] mod` blocks are not counted. A
//! function's lines run from its `fn` to its closing brace.

#[path = "common/repo.rs"]
mod repo;
use repo::{files_under, read};

const MAX_FILE_LINES: usize = 800;
const MAX_FN_LINES: usize = 120;

/// Over the bounds, for a while: an entry names a file under src/ or a
/// function (the file, a space, its name) and says when it will be split.
/// An entry that is no longer over its bound fails the test, so the list
/// cannot outlive its reason. Empty since `protocol` split
/// src/protocol/request.rs into a file per op and server.rs `serve` by
/// step (issue 36).
const ALLOWED: &[&str] = &[];

/// One line of a source file as the counts read it.
struct Line {
    /// The line without its comments, string and char literals emptied
    /// (`"{"` is `""`), so that braces and words are only code's.
    code: String,
    /// Something besides a comment and blanks on the line (a line inside
    /// a multi-line string literal is code).
    is_code: bool,
}

/// Splits `src` into lines, reading comments (nested block comments too),
/// strings, raw strings, char literals and lifetimes as Rust does.
fn lines_of(src: &str) -> Vec<Line> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut line = Line { code: String::new(), is_code: false };
    let mut i = 0;
    // What the scanner is inside of, across lines.
    let mut block_depth = 0usize;
    let mut string: Option<usize> = None; // Some(hashes) of a raw string; usize::MAX for "..."
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            out.push(std::mem::replace(&mut line, Line { code: String::new(), is_code: false }));
            i += 1;
            continue;
        }
        if block_depth > 0 {
            if ch == '*' && c.get(i + 1) == Some(&'/') {
                block_depth -= 1;
                i += 2;
            } else if ch == '/' && c.get(i + 1) == Some(&'*') {
                block_depth += 1;
                i += 2;
            } else {
                i += 1;
            }
            continue;
        }
        if let Some(hashes) = string {
            if !ch.is_whitespace() {
                line.is_code = true;
            }
            if hashes == usize::MAX {
                if ch == '\\' {
                    // An escape; a line-continuation's newline still ends the line.
                    i += if c.get(i + 1) == Some(&'\n') { 1 } else { 2 };
                    continue;
                }
                if ch == '"' {
                    line.code.push('"');
                    string = None;
                }
            } else if ch == '"' && (0..hashes).all(|h| c.get(i + 1 + h) == Some(&'#')) {
                line.code.push('"');
                string = None;
                i += hashes;
            }
            i += 1;
            continue;
        }
        match ch {
            '/' if c.get(i + 1) == Some(&'/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            '/' if c.get(i + 1) == Some(&'*') => {
                block_depth = 1;
                i += 2;
                continue;
            }
            '"' => {
                line.code.push('"');
                string = Some(usize::MAX);
            }
            'r' | 'b' if !c.get(i.wrapping_sub(1)).is_some_and(|p| p.is_alphanumeric() || *p == '_') && raw_string_start(&c[i..]).is_some() => {
                let (skip, hashes) = raw_string_start(&c[i..]).unwrap();
                line.code.push('"');
                string = Some(hashes);
                i += skip;
            }
            '\'' => {
                // A char literal ('{', '\n', '\u{7f}') or a lifetime ('a).
                if c.get(i + 1) == Some(&'\\') {
                    i += 2;
                    while i < c.len() && c[i] != '\'' {
                        i += 1;
                    }
                    line.code.push_str("' '");
                } else if c.get(i + 2) == Some(&'\'') {
                    i += 2;
                    line.code.push_str("' '");
                } else {
                    line.code.push('\'');
                }
            }
            _ => line.code.push(ch),
        }
        if !ch.is_whitespace() {
            line.is_code = true;
        }
        i += 1;
    }
    out.push(line);
    out
}

/// `r"`, `r#"`, `br"`...: the characters up to and including the quote,
/// and the number of `#`.
fn raw_string_start(c: &[char]) -> Option<(usize, usize)> {
    let mut j = usize::from(c.first() == Some(&'b'));
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = c[j..].iter().take_while(|&&h| h == '#').count();
    (c.get(j + hashes) == Some(&'"')).then_some((j + hashes + 1, hashes))
}

fn braces(s: &str) -> i64 {
    s.chars().map(|ch| i64::from(ch == '{') - i64::from(ch == '}')).sum()
}

/// The lines the counts read: `#[cfg(test)] mod name { ... }` blocks left out.
fn counted(lines: Vec<Line>) -> Vec<Line> {
    let mut out = Vec::with_capacity(lines.len());
    let mut it = lines.into_iter().peekable();
    while let Some(line) = it.next() {
        let opens_test_module = line.code.trim() == "#[cfg(test)]" && it.peek().is_some_and(|next| {
            let t = next.code.trim_start();
            (t.starts_with("mod ") || t.starts_with("pub mod ")) && t.contains('{')
        });
        if !opens_test_module {
            out.push(line);
            continue;
        }
        let mut depth = 0;
        for inner in it.by_ref() {
            depth += braces(&inner.code);
            if depth <= 0 {
                break;
            }
        }
    }
    out
}

/// Each function with a body: (name, first line's index, its lines of code).
fn functions(lines: &[Line]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let words: Vec<&str> = line.code.split(|ch: char| !(ch.is_alphanumeric() || ch == '_')).collect();
        for name in words.windows(2).filter(|w| w[0] == "fn" && !w[1].is_empty()).map(|w| w[1]) {
            // The body: from the first `{` after the name, unless a `;`
            // ends a declaration before it.
            let after_name = &line.code[line.code.find(&format!("fn {name}")).map_or(0, |at| at + 3 + name.len())..];
            let mut depth = 0i64;
            let mut opened = false;
            let mut end = None;
            'lines: for (n, l) in lines.iter().enumerate().skip(start) {
                let text = if n == start { after_name } else { l.code.as_str() };
                for ch in text.chars() {
                    match ch {
                        ';' if !opened => break 'lines,
                        '{' => {
                            opened = true;
                            depth += 1;
                        }
                        '}' => depth -= 1,
                        _ => {}
                    }
                    if opened && depth == 0 {
                        end = Some(n);
                        break 'lines;
                    }
                }
            }
            if let Some(end) = end {
                out.push((name.to_string(), start, lines[start..=end].iter().filter(|l| l.is_code).count()));
            }
        }
    }
    out
}

/// `(file's lines of code, [(function, its lines of code)])` of a source.
fn shape(src: &str) -> (usize, Vec<(String, usize)>) {
    let lines = counted(lines_of(src));
    let code = lines.iter().filter(|l| l.is_code).count();
    (code, functions(&lines).into_iter().map(|(name, _, n)| (name, n)).collect())
}

#[test]
fn no_file_or_function_in_src_is_over_its_bound() {
    let mut over = Vec::new();
    let mut seen = 0;
    for file in files_under("src", ".rs") {
        let (code, fns) = shape(&read(&file));
        seen += fns.len();
        if code > MAX_FILE_LINES {
            over.push((file.clone(), format!("{file}: {code} lines of code (at most {MAX_FILE_LINES})")));
        }
        for (name, n) in fns.into_iter().filter(|(_, n)| *n > MAX_FN_LINES) {
            over.push((format!("{file} {name}"), format!("{file}: fn {name}: {n} lines of code (at most {MAX_FN_LINES})")));
        }
    }
    assert!(seen > 500, "the functions of src/ were not found ({seen})");
    let problems: Vec<&String> = over.iter().filter(|(id, _)| !ALLOWED.contains(&id.as_str())).map(|(_, why)| why).collect();
    assert!(problems.is_empty(), "split these by step (one function per step, one file per concern):\n  {}", problems.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n  "));
    let stale: Vec<&&str> = ALLOWED.iter().filter(|a| !over.iter().any(|(id, _)| id == **a)).collect();
    assert!(stale.is_empty(), "no longer over its bound: take it out of ALLOWED in tests/code_shape.rs: {stale:?}");
}

#[test]
fn the_counts_skip_comments_strings_and_test_modules() {
    let src = r###"//! A module.
/* a block /* nested */
   comment { */
fn short(x: &str) -> usize {
    // a comment with a brace {
    let s = "}{ \" }";
    let r = r#"a "raw" string } "#;
    let c = '{';

    x.len() + s.len() + r.len() + usize::from(c == '}')
}

fn takes<'a>(t: &'a str) -> &'a str {
    t
}

trait T {
    fn declared(&self);
}

fn outer() {
    fn inner() {}
    let text = "line one
line two {";
}

#[cfg(test)]
mod tests {
    fn a_test() {
        let x = 1;
    }
}
"###;
    let (code, fns) = shape(src);
    assert_eq!(code, 17, "{fns:?}");
    assert_eq!(fns, vec![("short".into(), 6), ("takes".into(), 3), ("outer".into(), 5), ("inner".into(), 1)]);
}
