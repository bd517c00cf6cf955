//! The OPM package metadata (dist.ini) checked the way `opm build` checks
//! it, since `opm` itself is not packaged for Debian (`apt-cache policy opm`
//! finds nothing) and is not installed here. The rules are those of
//! openresty/opm's bin/opm `do_build` (commit ac8eb99): the required keys
//! and their values, no key opm does not know (it stops on one), a valid
//! dist name, a GitHub repo_link whose project matches the name, parsable
//! `requires`, `exclude_files` patterns that match files, `lib_dir` and
//! `doc_dir` directories, a `main_module` file under lib_dir from which the
//! version is read (dist.ini has none), a README.md at the root, and every
//! module passing `luajit -bl`. What opm would package is then exactly the
//! rock's modules (tests/rock.rs installs those).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The keys `opm build` reads from the default section; any other stops it.
const KNOWN_KEYS: [&str; 12] = ["name", "abstract", "author", "is_original", "license", "repo_link", "version", "requires", "exclude_files", "lib_dir", "main_module", "doc_dir"];
/// The license values opm recognizes.
const LICENSES: [&str; 15] = ["apache2", "3bsd", "2bsd", "gpl", "gpl2", "gpl3", "lgpl", "mit", "mozilla2", "cddl", "eclipse", "public", "artistic", "artistic2", "proprietary"];

/// dist.ini's default section (opm's read_ini: `key = value`, `#` and `;`
/// comments, no sections here).
fn dist_ini() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(Path::new(ROOT).join("dist.ini")).unwrap();
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        assert!(!line.starts_with('['), "dist.ini line {}: opm's build reads the default section only: {line}", n + 1);
        let (k, v) = line.split_once('=').unwrap_or_else(|| panic!("dist.ini line {}: not `key = value`: {line}", n + 1));
        assert!(out.insert(k.trim().to_string(), v.trim().to_string()).is_none(), "dist.ini: {} given twice", k.trim());
    }
    out
}

fn lua_files(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            lua_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "lua") {
            out.insert(p);
        }
    }
}

/// The files a glob of opm's `exclude_files` names (`dir/*` or a file).
fn glob(pattern: &str) -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    match pattern.strip_suffix("/*") {
        Some(dir) => std::fs::read_dir(root.join(dir)).map(|d| d.map(|e| e.unwrap().path()).collect()).unwrap_or_default(),
        None => {
            assert!(!pattern.contains(['*', '?', '[']), "exclude_files: this test reads `dir/*` and plain paths only: {pattern}");
            let p = root.join(pattern);
            if p.exists() {
                vec![p]
            } else {
                vec![]
            }
        }
    }
}

#[test]
fn dist_ini_has_every_field_opm_build_requires_and_no_other() {
    let ini = dist_ini();
    let unknown: Vec<&String> = ini.keys().filter(|k| !KNOWN_KEYS.contains(&k.as_str())).collect();
    assert!(unknown.is_empty(), "opm build stops on unrecognized keys: {unknown:?}");
    let get = |k: &str| ini.get(k).unwrap_or_else(|| panic!("dist.ini: key \"{k}\" not found in the default section (opm requires it)"));

    let name = get("name");
    let bad_name = name.len() < 3 || name.chars().any(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == '-')) || ["nginx", "luajit", "resty", "openresty", "opm"].contains(&name.to_lowercase().as_str()) || name.starts_with("restydoc") || name.starts_with("ngx_") || name.ends_with("-nginx-module");
    assert!(!bad_name, "bad dist name: {name}");
    assert!(get("author").chars().any(|c| c.is_ascii_alphabetic()), "author");
    assert!(["yes", "no"].contains(&get("is_original").as_str()), "is_original is yes or no");
    for l in get("license").split(',').map(str::trim) {
        assert!(LICENSES.contains(&l), "license {l} is not one opm knows: {LICENSES:?}");
    }
    assert!(!get("abstract").is_empty());

    let link = get("repo_link");
    assert!(link.starts_with("https://") || link.starts_with("http://"), "repo_link must be http(s): {link}");
    assert!(!link.contains(['"', '\'', ' ', '<', '>', '{', '}']) && link.is_ascii(), "repo_link: {link}");
    let project = link.split("github.com/").nth(1).and_then(|rest| rest.split('/').nth(1)).unwrap_or_else(|| panic!("bad GitHub repo link: {link}"));
    assert!(project.to_lowercase().contains(&name.to_lowercase()) || name.to_lowercase().contains(&project.to_lowercase()), "project {project} in repo_link does not match name {name}");

    // requires: `account/name` or one of opm's special names, optionally `op version`.
    for dep in get("requires").split(',').map(str::trim) {
        let dep_name = dep.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '/')).next().unwrap();
        let ok = ["openresty", "luajit", "ngx_lua", "ngx_http_lua", "nginx"].contains(&dep_name) || dep_name.split_once('/').is_some_and(|(a, n)| !a.is_empty() && !n.is_empty() && !n.contains('/'));
        assert!(ok, "bad dependency name: {dep}");
    }

    let root = Path::new(ROOT);
    let lib_dir = root.join(get("lib_dir"));
    assert!(lib_dir.is_dir(), "lib_dir {} is not a directory", lib_dir.display());
    assert!(root.join(get("doc_dir")).is_dir(), "doc_dir");
    assert!(root.join("README.md").is_file(), "opm build: could not find README.md");

    let main_module = root.join(get("main_module"));
    assert!(main_module.is_file() && main_module.starts_with(&lib_dir), "main_module {} is a file under lib_dir", main_module.display());
    // No version in dist.ini: opm reads it from the main module (`_VERSION = ...`).
    assert!(!ini.contains_key("version"), "a version here must equal the main module's; keep one place");
    let text = std::fs::read_to_string(&main_module).unwrap();
    let version = text.lines().find_map(|l| l.split("_VERSION").nth(1)).and_then(|rest| rest.trim_start().strip_prefix('=')).map(|v| v.trim().trim_matches(|c: char| "\"',{}() ".contains(c)).to_string());
    let version = version.unwrap_or_else(|| panic!("no _VERSION in {}: opm would find no version", main_module.display()));
    assert!(version.chars().any(|c| c.is_ascii_digit()) && version.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_'), "bad version number: {version}");

    // What opm would package: lib_dir's .lua files less exclude_files.
    let mut excluded = BTreeSet::new();
    for pat in get("exclude_files").split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let files = glob(pat);
        assert!(!files.is_empty(), "exclude_files pattern {pat} does not match any files (opm stops)");
        excluded.extend(files);
    }
    let mut modules = BTreeSet::new();
    lua_files(&lib_dir, &mut modules);
    let packaged: BTreeSet<String> = modules.difference(&excluded).map(|p| p.strip_prefix(&lib_dir).unwrap().display().to_string()).collect();
    assert!(!packaged.is_empty(), "no Lua modules under lib_dir");
    let mut resty = BTreeSet::new();
    lua_files(&lib_dir.join("resty"), &mut resty);
    let rock: BTreeSet<String> = resty.iter().map(|p| p.strip_prefix(&lib_dir).unwrap().display().to_string()).collect();
    assert_eq!(packaged, rock, "opm would package other modules than the rock installs");

    // opm build byte-compiles every module with LuaJIT (`luajit -bl`).
    match Command::new("luajit").arg("-v").output() {
        Ok(_) => {
            for m in modules.difference(&excluded) {
                let out = Command::new("luajit").arg("-bl").arg(m).arg("/dev/null").output().unwrap();
                assert!(out.status.success(), "luajit -bl {}: {}", m.display(), String::from_utf8_lossy(&out.stderr));
            }
        }
        Err(_) => eprintln!("luajit not installed (Debian: luajit2): the modules' syntax was not checked"),
    }
}
