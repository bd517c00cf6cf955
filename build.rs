//! Assembles the Redis scripts (src/redis/scripts.rs) from their parts:
//! each top-level src/redis/scripts/<name>.lua, with every line
//! `--@include <file>` replaced by that file (relative to
//! src/redis/scripts/, itself expanded the same way), is written to
//! $OUT_DIR/scripts/<name>.lua. scripts/lib.sh `redis_script` does the same
//! for the shell scripts; tests/redis_scripts.rs holds the two to one text.

use std::fs;
use std::path::{Path, PathBuf};

const DIR: &str = "src/redis/scripts";
const INCLUDE: &str = "--@include ";

fn expand(dir: &Path, file: &Path, out: &mut String, depth: usize) {
    assert!(depth < 8, "{}: includes nested 8 deep (a loop?)", file.display());
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    for line in text.lines() {
        match line.strip_prefix(INCLUDE) {
            Some(part) => expand(dir, &dir.join(part.trim()), out, depth + 1),
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

fn main() {
    // A directory: cargo rebuilds when any file below it changes.
    println!("cargo:rerun-if-changed={DIR}");
    let dir = Path::new(DIR);
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("scripts");
    fs::create_dir_all(&out_dir).expect("create $OUT_DIR/scripts");
    for entry in fs::read_dir(dir).expect("read src/redis/scripts") {
        let path = entry.expect("src/redis/scripts entry").path();
        if path.extension().is_some_and(|e| e == "lua") {
            let mut text = String::new();
            expand(dir, &path, &mut text, 0);
            fs::write(out_dir.join(path.file_name().expect("a file name")), text).expect("write an assembled script");
        }
    }
}
