#![allow(dead_code)]
//! The checkout's own files, for the tests that hold docs, scripts and
//! code to one another.

use std::path::{Path, PathBuf};

/// The checkout's root: this one, or the one `RATELIMITD_CHECKOUT` names
/// (to hold another checkout's files, say an older commit's, to the same
/// tests).
pub fn root() -> PathBuf {
    std::env::var_os("RATELIMITD_CHECKOUT").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The text of a file of the checkout, by its path from the root.
pub fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every file below `dir` (a path from the root) whose name ends in `ext`,
/// as paths from the root, sorted.
pub fn files_under(dir: &str, ext: &str) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, ext: &str, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, ext, out);
            } else if path.to_string_lossy().ends_with(ext) {
                out.push(path.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let root = root();
    let mut out = Vec::new();
    walk(&root, &root.join(dir), ext, &mut out);
    out.sort();
    out
}
