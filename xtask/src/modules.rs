//! No module cycles in any crate, run as a test: within each crate of the workspace the top-level
//! modules, with an edge from each module to every other one its code names, form no cycle.
//!
//! Read from the sources: a module names another through a `crate::other` path, a `super::` chain
//! that reaches the crate root, or a name the crate root re-exports from `other` (`crate::Name`).
//! Unit tests (`#[cfg(test)] mod tests` at the end of a file) and a macro's `$crate::` paths, which
//! expand in the calling crate, are no edges. `ir-core` states its order as well
//! (`crates/ir-core/tests/module_layers.rs`); this test holds every crate to the weaker rule.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::project_root;

/// The code of a file without comments and without its unit tests.
pub(crate) fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
    text.lines().map(|line| line.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

fn is_identifier_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn identifiers(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !is_identifier_char(c)).filter(|word| !word.is_empty())
}

/// A crate's source root and its top-level modules, each with its `.rs` files and the number of
/// `super::` that lead from each file to the crate root.
struct CrateSources {
    root_file: PathBuf,
    modules: BTreeMap<String, Vec<(PathBuf, usize)>>,
}

fn rust_files(folder: &Path, depth: usize, out: &mut Vec<(PathBuf, usize)>) {
    let entries = std::fs::read_dir(folder).unwrap_or_else(|e| panic!("reading {}: {e}", folder.display()));
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, depth + 1, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            // `x/mod.rs` is module `x` itself, one level below the root; `x/y.rs` is one further.
            let is_mod = path.file_name().is_some_and(|name| name == "mod.rs");
            out.push((path, if is_mod { depth } else { depth + 1 }));
        }
    }
}

fn crate_sources(src: &Path) -> Option<CrateSources> {
    let root_file = ["lib.rs", "main.rs"].iter().map(|name| src.join(name)).find(|path| path.exists())?;
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(src).ok()?.flatten() {
        let path = entry.path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned) else { continue };
        if path == root_file {
            continue;
        }
        let files: &mut Vec<(PathBuf, usize)> = modules.entry(stem).or_default();
        if path.is_dir() {
            rust_files(&path, 1, files);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push((path, 1));
        }
    }
    modules.retain(|_, files| !files.is_empty());
    Some(CrateSources { root_file, modules })
}

/// The names the crate root re-exports, with the top-level module each comes from.
fn reexports(root: &str, modules: &BTreeMap<String, Vec<(PathBuf, usize)>>) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for item in root.split("pub use ").skip(1) {
        let item = item.split(';').next().unwrap_or_default();
        let item = item.trim_start_matches("crate::").trim_start_matches("self::");
        let Some((module, rest)) = item.split_once("::") else { continue };
        let module = module.trim();
        if !modules.contains_key(module) {
            continue;
        }
        for name in identifiers(rest) {
            names.insert(name.to_owned(), module.to_owned());
        }
    }
    names
}

/// The first identifier of each path in `rest` (which follows a path prefix): `name` or a group
/// `{a, b::c}`.
fn first_segments(rest: &str) -> Vec<&str> {
    match rest.strip_prefix('{') {
        Some(inner) => {
            inner.split('}').next().unwrap_or_default().split(',').filter_map(|path| identifiers(path).next()).collect()
        }
        None => identifiers(rest).next().into_iter().collect(),
    }
}

/// The top-level modules a file's code names, given how many `super::` reach the crate root.
fn named_modules(
    code: &str,
    depth: usize,
    modules: &BTreeMap<String, Vec<(PathBuf, usize)>>,
    reexports: &BTreeMap<String, String>,
) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    let mut resolve = |segment: &str| {
        if modules.contains_key(segment) {
            named.insert(segment.to_owned());
        } else if let Some(module) = reexports.get(segment) {
            named.insert(module.clone());
        }
    };
    let to_root = "super::".repeat(depth);
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = &rest[..at];
        let escaped = before.ends_with('$') || before.chars().next_back().is_some_and(is_identifier_char);
        rest = &rest[at + "crate::".len()..];
        if !escaped {
            first_segments(rest).into_iter().for_each(&mut resolve);
        }
    }
    let mut rest = code;
    while let Some(at) = rest.find(&to_root) {
        let before = &rest[..at];
        rest = &rest[at + to_root.len()..];
        if before.ends_with("super::") || before.chars().next_back().is_some_and(is_identifier_char) {
            continue;
        }
        if rest.starts_with("super::") {
            continue;
        }
        first_segments(rest).into_iter().for_each(&mut resolve);
    }
    named
}

/// The module graph of one crate: each top-level module and the others it names.
fn module_graph(src: &Path) -> Option<BTreeMap<String, BTreeSet<String>>> {
    let sources = crate_sources(src)?;
    let root = code(&sources.root_file);
    let reexports = reexports(&root, &sources.modules);
    let mut graph = BTreeMap::new();
    for (module, files) in &sources.modules {
        let mut named = BTreeSet::new();
        for (file, depth) in files {
            named.extend(named_modules(&code(file), *depth, &sources.modules, &reexports));
        }
        named.remove(module);
        graph.insert(module.clone(), named);
    }
    Some(graph)
}

/// The cycles of `graph`: its strongly connected components of more than one module.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let reaches = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.to_owned()];
        while let Some(module) = stack.pop() {
            for next in graph.get(&module).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reach: BTreeMap<&String, BTreeSet<String>> = graph.keys().map(|m| (m, reaches(m))).collect();
    let mut components: Vec<BTreeSet<String>> = Vec::new();
    for module in graph.keys() {
        if components.iter().any(|c| c.contains(module)) {
            continue;
        }
        let component: BTreeSet<String> = graph
            .keys()
            .filter(|other| reach[module].contains(*other) && reach[other].contains(module))
            .cloned()
            .collect();
        if component.len() > 1 {
            components.push(component);
        }
    }
    components
}

/// Every crate's `src` folder: the workspace members' and the examples'.
fn crate_source_folders() -> Vec<PathBuf> {
    let root = project_root();
    let mut folders = Vec::new();
    for parent in ["crates", "examples"] {
        let Ok(entries) = std::fs::read_dir(root.join(parent)) else { continue };
        for entry in entries.flatten() {
            folders.push(entry.path().join("src"));
        }
    }
    folders.extend([root.join("tests/src"), root.join("xtask/src")]);
    folders.retain(|folder| folder.is_dir());
    folders.sort();
    folders
}

#[test]
fn no_crate_has_a_module_cycle() {
    let folders = crate_source_folders();
    assert!(folders.len() >= 12, "the crates are found: {folders:?}");
    let mut found = Vec::new();
    for folder in &folders {
        let Some(graph) = module_graph(folder) else { continue };
        for cycle in cycles(&graph) {
            let edges: Vec<String> = cycle
                .iter()
                .flat_map(|from| {
                    graph[from].iter().filter(|to| cycle.contains(*to)).map(move |to| format!("{from} -> {to}"))
                })
                .collect();
            let crate_dir = folder.parent().unwrap_or(folder).strip_prefix(project_root()).unwrap_or(folder);
            found.push(format!("{}: {}", crate_dir.display(), edges.join(", ")));
        }
    }
    assert!(found.is_empty(), "module cycles (move what both sides need below them):\n{}", found.join("\n"));
}

#[test]
fn the_reader_finds_paths_and_cycles() {
    let modules: BTreeMap<String, Vec<(PathBuf, usize)>> =
        ["a", "b", "c", "d"].iter().map(|m| ((*m).to_owned(), vec![])).collect();
    let reexports = BTreeMap::from([("Thing".to_owned(), "c".to_owned())]);
    let code = "use crate::{a::X, Thing};\nuse super::super::b::Y;\nfn f() { $crate::d::z(); super::e(); }";
    let named = named_modules(code, 2, &modules, &reexports);
    assert_eq!(named, BTreeSet::from(["a".to_owned(), "b".to_owned(), "c".to_owned()]));
    let graph = BTreeMap::from([
        ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
        ("b".to_owned(), BTreeSet::from(["c".to_owned()])),
        ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
        ("d".to_owned(), BTreeSet::from(["a".to_owned()])),
    ]);
    assert_eq!(cycles(&graph), vec![BTreeSet::from(["a".to_owned(), "b".to_owned(), "c".to_owned()])]);
}
