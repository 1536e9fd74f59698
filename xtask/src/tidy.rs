//! Tidy rules, run as tests: module docs, no `dbg!`, no trailing whitespace, no tabs in Rust files,
//! and no citation of a requirement number (`R` and one to three digits) from a specification the
//! repository does not hold.

use std::fs;
use std::path::{Path, PathBuf};

use crate::project_root;

/// Text files under `dir` with one of `extensions` (skipping `target` and hidden entries).
fn text_files(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            text_files(&path, extensions, out);
        } else if path.extension().is_some_and(|e| extensions.iter().any(|x| e == *x)) {
            out.push(path);
        }
    }
}

/// The requirement-number citations in `line`: `R` and one to three digits, standing alone.
fn requirement_citations(line: &str) -> Vec<String> {
    let bytes = line.as_bytes();
    let mut found = Vec::new();
    for (i, &b) in bytes.iter().enumerate() {
        if b != b'R' || (i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_')) {
            continue;
        }
        let digits = bytes[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        let end = i + 1 + digits;
        let standalone = bytes.get(end).is_none_or(|c| !(c.is_ascii_alphanumeric() || *c == b'_'));
        if (1..=3).contains(&digits) && standalone {
            found.push(line[i..end].to_owned());
        }
    }
    found
}

/// The issue numbers `line` cites (`issue 14`, `Issue 3`): the project's history, which belongs
/// in commit messages.
fn issue_citations(line: &str) -> Vec<String> {
    let lower = line.to_ascii_lowercase();
    let mut found = Vec::new();
    for (i, _) in lower.match_indices("issue ") {
        if lower[..i].bytes().next_back().is_some_and(|b| b.is_ascii_alphanumeric()) {
            continue;
        }
        let digits = lower[i + 6..].bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 {
            found.push(line[i..i + 6 + digits].to_owned());
        }
    }
    found
}

#[test]
fn issue_citations_are_recognized() {
    assert_eq!(issue_citations("fixed (issue 14 item 4), see Issue 3"), ["issue 14", "Issue 3"]);
    assert!(issue_citations("an issue with 14 bytes, tissue 5").is_empty());
}

#[test]
fn requirement_citations_are_recognized() {
    // Built from parts, so this file holds no citation itself.
    let cite = |n: u32| format!("R{n}");
    let line = format!("the rule ({}) and {}'s bytes, {};", cite(32), cite(95), cite(141));
    assert_eq!(requirement_citations(&line), [cite(32), cite(95), cite(141)]);
    assert!(requirement_citations("RISC-V, R1234, XR12, R_1, sm_80, BR2x").is_empty());
}

#[test]
fn no_requirement_number_is_cited() {
    // The specification the requirement numbers come from is not part of the repository: a comment
    // or document states the rule itself.
    let root = project_root();
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "tests", "kernels", "docs", "fuzz", "examples"] {
        text_files(&root.join(dir), &["rs", "md", "cu", "cuh", "hip", "h", "cl", "ir", "py", "toml"], &mut files);
    }
    files.push(root.join("README.md"));
    // This file spells citations to test the rule.
    files.retain(|path| !path.ends_with("xtask/src/tidy.rs"));
    assert!(files.len() > 100, "found the sources");
    let mut problems = Vec::new();
    for path in files {
        let text = fs::read_to_string(&path).unwrap_or_default();
        for (index, line) in text.lines().enumerate() {
            for citation in requirement_citations(line).into_iter().chain(issue_citations(line)) {
                problems.push(format!("{}:{}: cites {citation}", path.display(), index + 1));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "say the rule instead of its number (and leave history to commit messages):\n{}",
        problems.join("\n")
    );
}

fn all_rust_files() -> Vec<PathBuf> {
    let root = project_root();
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "tests"] {
        text_files(&root.join(dir), &["rs"], &mut files);
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
