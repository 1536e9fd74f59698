//! One execution path, every way to run an op documented, and one public path per item, run as
//! tests.
//!
//! Read from the library sources (comments and unit tests left out): an implementation's function
//! runs only in `ir-core`'s `registry/dispatch.rs`, through the `Dispatch` made there; the code
//! that calls that path directly lives only where a documented way to run an op lives; and the
//! ways listed in `docs/engine-integration.md` are at most four, each naming code that exists.

use std::path::{Path, PathBuf};

use crate::modules::code;
use crate::project_root;

fn rust_files(folder: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(folder) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// Every library source file of the workspace's crates (`crates/*/src`), as a path relative to
/// the workspace root, with its code.
fn library_code() -> Vec<(String, String)> {
    let root = project_root();
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).expect("crates/").flatten() {
        rust_files(&krate.path().join("src"), &mut files);
    }
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let relative = path.strip_prefix(&root).expect("under the root").to_string_lossy().replace('\\', "/");
            (relative, code(&path))
        })
        .collect()
}

/// The files whose code contains `needle` (not as the end of a longer name: `GatedCall::new(` is
/// no `Call::new(`), with how often.
fn containing<'a>(files: &'a [(String, String)], needle: &str) -> Vec<(&'a str, usize)> {
    let is_name = |c: char| c.is_alphanumeric() || c == '_';
    files
        .iter()
        .filter_map(|(path, code)| {
            let count = code
                .match_indices(needle)
                .filter(|(at, _)| !(needle.starts_with(is_name) && code[..*at].ends_with(is_name)))
                .count();
            (count > 0).then_some((path.as_str(), count))
        })
        .collect()
}

const DISPATCH: &str = "crates/ir-core/src/registry/dispatch.rs";
const SELECT: &str = "crates/ir-core/src/registry/select.rs";
const IMPLEMENTATION: &str = "crates/ir-core/src/implementation.rs";

#[test]
fn one_execution_path() {
    let files = library_code();
    // An implementation's stored function runs through `ImplFunc::run` or `ImplFunc::typed_as`,
    // called in the dispatch module only (`run` itself is `ImplFunc`'s, in `implementation.rs`).
    for (needle, allowed) in [
        (".func.run(", &[DISPATCH, IMPLEMENTATION][..]),
        (".func.typed_as", &[DISPATCH][..]),
        ("func.as_any()", &[IMPLEMENTATION][..]),
    ] {
        let found = containing(&files, needle);
        assert!(!found.is_empty(), "`{needle}` is how an implementation runs; the test must be updated with it");
        for (path, _) in found {
            assert!(
                allowed.contains(&path),
                "{path} runs an implementation's function (`{needle}`): a second execution path. Every way to run \
                 an op holds a `Dispatch` ({DISPATCH}) and runs the implementation through it"
            );
        }
    }
    // A `Dispatch` is made in one place, after the selection is held and recorded.
    assert_eq!(containing(&files, ".func.run(").iter().find(|(p, _)| *p == IMPLEMENTATION), Some(&(IMPLEMENTATION, 1)));
    let made = containing(&files, "Ok(Dispatch {");
    assert_eq!(made, vec![(DISPATCH, 1)], "a `Dispatch` is made by `Registry::dispatch_with` only");
    // Selection is held by the execution path and by lowering's `Registry::select` only.
    let held = containing(&files, "self.hold(");
    assert_eq!(held, vec![(DISPATCH, 1), (SELECT, 1)], "selection is held by `dispatch_with` and `select` only");
}

/// Where code that calls the execution path directly may live, and the words naming that way in
/// the documentation.
const WAYS: &[(&str, &str)] = &[
    // Way 1: the typed functions `define_op!` generates, on a registry or a context; the eager
    // context runs its calls as way 2 does.
    ("crates/ir-core/src/define.rs", "define_op!"),
    ("crates/ir-core/src/context.rs", "EagerContext"),
    // Way 2.
    (DISPATCH, "Registry::run"),
    // Way 3.
    ("crates/ir-graph/src/interp.rs", "ir_graph::interpret"),
    // Way 4.
    ("crates/ops/src/candle_ops.rs", "candle_ops"),
    // The benchmarks time the ways above against the kernels.
    ("crates/bench/src/kernels.rs", "Registry::implementation"),
];

/// The numbered list under the documentation's heading of the ways to run an op, one string per
/// item.
fn documented_ways() -> Vec<String> {
    let path = project_root().join("docs/engine-integration.md");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let section =
        text.split("\n## Four ways to run an op\n").nth(1).expect("docs/engine-integration.md has the section");
    let section = section.split("\n## ").next().unwrap_or_default();
    let mut ways: Vec<String> = Vec::new();
    for line in section.lines() {
        let numbered = line.split_once(". ").filter(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        if let Some((_, rest)) = numbered {
            ways.push(rest.to_owned());
        } else if line.starts_with("   ")
            && let Some(last) = ways.last_mut()
        {
            last.push(' ');
            last.push_str(line.trim());
        }
    }
    ways
}

#[test]
fn every_way_to_run_an_op_is_documented() {
    let docs = std::fs::read_to_string(project_root().join("docs/engine-integration.md")).expect("docs");
    let files = library_code();
    // Code that calls the execution path directly: a `Call` made, or a `Dispatch` taken.
    let mut callers: Vec<&str> = Vec::new();
    for needle in ["Call::new(", ".dispatch(&"] {
        callers.extend(containing(&files, needle).into_iter().map(|(path, _)| path));
    }
    callers.sort_unstable();
    callers.dedup();
    assert!(callers.contains(&DISPATCH) && callers.contains(&"crates/ops/src/candle_ops.rs"), "{callers:?}");
    for path in callers {
        let Some((_, named)) = WAYS.iter().find(|(home, _)| *home == path) else {
            panic!(
                "{path} calls the execution path directly, outside the documented ways to run an op: build on one of \
                 them, or document the new way in docs/engine-integration.md (at most four) and list its home here"
            );
        };
        assert!(docs.contains(named), "docs/engine-integration.md does not name `{named}` (the way {path} is)");
    }
    // The registry's public methods that run an op (they return its outputs): `run` only, which the
    // list names; a deprecated spelling says what replaces it.
    let mut running = Vec::new();
    for (path, code) in files.iter().filter(|(path, _)| path.starts_with("crates/ir-core/src/registry/")) {
        let lines: Vec<&str> = code.lines().collect();
        let mut in_registry = false;
        for (index, line) in lines.iter().enumerate() {
            if line.starts_with("impl") {
                in_registry = line.starts_with("impl Registry");
            }
            let Some(rest) = line.trim_start().strip_prefix("pub fn ").filter(|_| in_registry) else { continue };
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            let end = lines[index..].iter().position(|l| l.contains('{')).map_or(lines.len(), |p| index + p + 1);
            let signature = lines[index..end].join(" ");
            let mut attributes = lines[..index].iter().rev().take_while(|l| {
                let l = l.trim();
                l.starts_with("#[") || l.is_empty() || l.starts_with("since") || l.starts_with("note") || l == ")]"
            });
            let (deprecated, hidden) = attributes
                .clone()
                .fold((false, false), |(d, h), l| (d || l.contains("#[deprecated"), h || l.contains("doc(hidden)")));
            let _ = attributes.next();
            let returns_outputs = ["Result<Vec<Tensor>", "Result<Outputs"].iter().any(|r| signature.contains(r));
            if returns_outputs && !deprecated && !hidden {
                running.push(format!("{path}: Registry::{name}"));
            }
        }
    }
    assert_eq!(running, vec![format!("{DISPATCH}: Registry::run")], "the registry runs an op through `run` only");
}

#[test]
fn the_documented_list_reads_four_ways() {
    let ways = documented_ways();
    let expected = ["define_op!", "Registry::run", "ir_graph::interpret", "candle_ops"];
    assert_eq!(ways.len(), expected.len(), "at most four ways to run an op: {ways:#?}");
    for (way, name) in ways.iter().zip(expected) {
        assert!(way.contains(name), "the way `{way}` names `{name}`");
    }
}

/// Whether the module `segments` (below the crate root at `src`) is public all the way down: each
/// segment declared `pub mod` in its parent's file.
fn public_module(src: &Path, segments: &[&str]) -> bool {
    let parent_file = |parents: &[&str]| -> Option<PathBuf> {
        if parents.is_empty() {
            return Some(src.join("lib.rs"));
        }
        let folder = parents.iter().fold(src.to_path_buf(), |path, segment| path.join(segment));
        [folder.with_extension("rs"), folder.join("mod.rs")].into_iter().find(|path| path.exists())
    };
    (0..segments.len()).all(|depth| {
        let Some(file) = parent_file(&segments[..depth]) else { return false };
        let declared = format!("pub mod {}", segments[depth]);
        code(&file).lines().map(str::trim_start).any(|line| {
            line.strip_prefix(&declared).is_some_and(|rest| rest.starts_with(';') || rest.starts_with(" {"))
        })
    })
}

/// The re-exports of a crate (sources under `src`) that give an item a second public path: a
/// `pub use crate::m::…` in a public module (or the root) other than `m`, where `m` is public all
/// the way down, so the item is reachable both where it is defined and where it is re-exported.
fn second_paths(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut found = Vec::new();
    for file in files {
        let relative = file.strip_prefix(src).expect("under src").with_extension("");
        let mut module: Vec<String> = relative.iter().map(|part| part.to_string_lossy().into_owned()).collect();
        if module.last().is_some_and(|last| last == "mod" || last == "lib") {
            module.pop();
        }
        let module: Vec<&str> = module.iter().map(String::as_str).collect();
        if !module.is_empty() && !public_module(src, &module) {
            continue;
        }
        for line in code(&file).lines().map(str::trim_start) {
            let Some(path) = line.strip_prefix("pub use crate::") else { continue };
            let segments: Vec<&str> = path.split("::").collect();
            // The source module: every segment but the last (an item, a brace list or a glob).
            let source = &segments[..segments.len().saturating_sub(1)];
            if !source.is_empty() && source != module.as_slice() && public_module(src, source) {
                found.push(format!("{}: {line}", file.display()));
            }
        }
    }
    found
}

#[test]
fn every_public_item_has_one_path() {
    // The facade re-exports whole crates by design; the benchmarks and the CLI publish no API.
    let skipped = ["vllm-ir", "bench", "ir-cli"];
    for krate in std::fs::read_dir(project_root().join("crates")).expect("crates/").flatten() {
        let name = krate.file_name().to_string_lossy().into_owned();
        if skipped.contains(&name.as_str()) {
            continue;
        }
        let found = second_paths(&krate.path().join("src"));
        assert!(
            found.is_empty(),
            "{name}: items with a second public path (re-export them from a private module, or drop the \
             re-export):\n{}",
            found.join("\n")
        );
    }
}

#[test]
fn a_second_public_path_is_found() {
    let src = std::env::temp_dir().join(format!("vllm-ir-one-path-{}", std::process::id()));
    std::fs::create_dir_all(src.join("b")).expect("temporary crate");
    let write = |path: &str, text: &str| std::fs::write(src.join(path), text).expect("written");
    write("lib.rs", "pub mod a;\npub mod b;\nmod c;\npub use crate::a::Twice;\npub use crate::c::Once;\n");
    write("a.rs", "pub struct Twice;\n");
    write("c.rs", "pub struct Once;\n");
    write("b/mod.rs", "mod inner;\npub use crate::b::inner::Hidden;\npub use crate::a::Twice as Again;\n");
    write("b/inner.rs", "pub struct Hidden;\n");
    let found = second_paths(&src);
    std::fs::remove_dir_all(&src).expect("removed");
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(found[0].contains("b/mod.rs: pub use crate::a::Twice as Again"), "{found:#?}");
    assert!(found[1].contains("lib.rs: pub use crate::a::Twice"), "{found:#?}");
}
