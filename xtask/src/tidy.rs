//! Tidy rules, run as tests: module docs, no `dbg!`, no trailing whitespace, no tabs in Rust files.

use std::fs;
use std::path::{Path, PathBuf};

use crate::project_root;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn all_rust_files() -> Vec<PathBuf> {
    let root = project_root();
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "tests"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 10, "found the sources");
    files
}

#[test]
fn every_rust_file_opens_with_a_module_doc() {
    let missing: Vec<_> = all_rust_files()
        .into_iter()
        .filter(|path| !fs::read_to_string(path).unwrap_or_default().starts_with("//!"))
        .collect();
    assert!(missing.is_empty(), "files without a leading `//!` doc: {missing:?}");
}

#[test]
fn no_dbg_trailing_whitespace_or_tabs() {
    let dbg_macro = ["dbg", "!("].concat();
    let mut problems = Vec::new();
    for path in all_rust_files() {
        let text = fs::read_to_string(&path).unwrap_or_default();
        for (index, line) in text.lines().enumerate() {
            let location = format!("{}:{}", path.display(), index + 1);
            if line.contains(&dbg_macro) {
                problems.push(format!("{location}: dbg macro"));
            }
            if line.ends_with(' ') || line.ends_with('\t') {
                problems.push(format!("{location}: trailing whitespace"));
            }
            if line.contains('\t') {
                problems.push(format!("{location}: tab"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn cargo_run_in_the_root_runs_the_cli() {
    // The README's quick start is `cargo run --release -- demo`, which needs the CLI as the only default member.
    let manifest = fs::read_to_string(project_root().join("Cargo.toml")).expect("root manifest");
    assert!(manifest.contains("\ndefault-members = [\"crates/ir-cli\"]\n"), "default-members must be the CLI alone");
}
