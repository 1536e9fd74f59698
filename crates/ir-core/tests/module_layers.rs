//! `ir-core`'s modules form no cycle: each top-level module names (through `crate::` paths, or a
//! name the crate root re-exports) only modules below it in one order, the one
//! `docs/architecture.md` states. Read from the sources, so a new edge upward fails here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Bottom up: the tensor model, built-ins, the op model, what a provider registers, the registry,
/// platforms, contexts, and `define_op!` above all of them.
const LAYERS: &[&str] = &[
    "dtype",
    "device",
    "layout",
    "stream",
    "meta",
    "storage",
    "tensor",
    "testing",
    "interop",
    "builtin",
    "op",
    "implementation",
    "registry",
    "platform",
    "context",
    "define",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The code of a file without comments and without its unit tests.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
    text.lines().map(|line| line.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

/// Identifiers: letters, digits and underscores.
fn identifiers(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|word| !word.is_empty())
}

/// The names the crate root re-exports, with the module each comes from.
fn reexports() -> BTreeMap<String, String> {
    let lib = code(&src().join("lib.rs"));
    let mut names = BTreeMap::new();
    for item in lib.split("pub use crate::").skip(1) {
        let item = item.split(';').next().unwrap_or_default();
        let Some((module, rest)) = item.split_once("::") else { continue };
        for name in identifiers(rest) {
            names.insert(name.to_owned(), module.trim().to_owned());
        }
    }
    names
}

/// The `.rs` files of a top-level module (`x.rs`, or `x/` with its files).
fn files(module: &str) -> Vec<PathBuf> {
    let file = src().join(format!("{module}.rs"));
    if file.exists() {
        return vec![file];
    }
    let mut found = Vec::new();
    let mut folders = vec![src().join(module)];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).unwrap_or_else(|e| panic!("reading {}: {e}", folder.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                found.push(path);
            }
        }
    }
    found
}

/// The other modules a file's code names: `crate::module`, or `crate::Name` / `use crate::{Name}`
/// of a re-exported name. A macro's `$crate::` paths expand in the calling crate and are not edges.
fn named_modules(code: &str, reexports: &BTreeMap<String, String>) -> Vec<String> {
    let mut modules = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let escaped = rest[..at].ends_with('$');
        rest = &rest[at + "crate::".len()..];
        if escaped {
            continue;
        }
        // `crate::name` or `crate::{a, b::c}`: the first identifier of each path.
        let group = match rest.strip_prefix('{') {
            Some(inner) => inner.split('}').next().unwrap_or_default(),
            None => rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or_default(),
        };
        for path in group.split(',') {
            let Some(first) = identifiers(path).next() else { continue };
            if LAYERS.contains(&first) {
                modules.push(first.to_owned());
            } else if let Some(module) = reexports.get(first) {
                modules.push(module.clone());
            }
        }
    }
    modules
}

#[test]
fn every_module_names_only_modules_below_it() {
    let reexports = reexports();
    let layer = |module: &str| LAYERS.iter().position(|m| *m == module);
    // Every top-level module is placed in the order.
    for entry in std::fs::read_dir(src()).expect("the source folder") {
        let path = entry.expect("a directory entry").path();
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_owned();
        if name != "lib" {
            assert!(layer(&name).is_some(), "module `{name}` is not in LAYERS: place it in the order");
        }
    }
    let mut upward = Vec::new();
    for (index, module) in LAYERS.iter().enumerate() {
        for file in files(module) {
            for named in named_modules(&code(&file), &reexports) {
                let below = layer(&named).is_some_and(|named_layer| named_layer <= index);
                if !below {
                    upward.push(format!("{} names `{named}`, above `{module}`", file.display()));
                }
            }
        }
    }
    upward.sort();
    upward.dedup();
    assert!(upward.is_empty(), "edges upward (a module cycle in the making):\n{}", upward.join("\n"));
}

#[test]
fn the_scan_sees_paths_groups_and_reexports() {
    let reexports = reexports();
    assert_eq!(reexports.get("Registry").map(String::as_str), Some("registry"));
    assert_eq!(reexports.get("KernelError").map(String::as_str), Some("op"));
    let code = "use crate::{Registry, op::Value};\nfn f() -> crate::tensor::Tensor { $crate::context::x }";
    assert_eq!(named_modules(code, &reexports), ["registry", "op", "tensor"]);
}
