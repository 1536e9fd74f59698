//! Documentation that cannot drift, run as tests: the crate dependency list and the dependency
//! invariants of `docs/architecture.md` are checked against `cargo metadata`.
//!
//! A crate is named as the workspace's crates name it when they depend on it (the key of
//! `[workspace.dependencies]`, `ir-core` for `vllm-ir-core`), else by its package name.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use crate::project_root;

/// Each workspace crate with the workspace crates its normal (not dev, not build) dependencies
/// name, all by their documentation names.
fn workspace_dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(project_root())
        .output()
        .expect("running cargo metadata");
    assert!(output.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&output.stderr));
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).expect("cargo metadata's JSON");
    let packages = metadata["packages"].as_array().expect("a package list");
    let package_names: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    // The name the workspace gives each package where it depends on it.
    let mut doc_name: BTreeMap<&str, &str> = package_names.iter().map(|name| (*name, *name)).collect();
    for package in packages {
        for dependency in package["dependencies"].as_array().into_iter().flatten() {
            let (Some(name), Some(rename)) = (dependency["name"].as_str(), dependency["rename"].as_str()) else {
                continue;
            };
            if package_names.contains(name) {
                doc_name.insert(name, rename);
            }
        }
    }
    let mut graph = BTreeMap::new();
    for package in packages {
        let name = package["name"].as_str().expect("a package name");
        let dependencies = package["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|dependency| dependency["kind"].is_null())
            .filter_map(|dependency| dependency["name"].as_str())
            .filter_map(|dependency| doc_name.get(dependency).map(|name| (*name).to_owned()))
            .collect();
        graph.insert(doc_name[name].to_owned(), dependencies);
    }
    graph
}

fn architecture() -> String {
    let path = project_root().join("docs/architecture.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// `text` without what parentheses enclose (commentary, which may name other crates).
fn outside_parentheses(text: &str) -> String {
    let mut depth = 0usize;
    text.chars()
        .filter(|c| match c {
            '(' => {
                depth += 1;
                false
            }
            ')' => {
                depth = depth.saturating_sub(1);
                false
            }
            _ => depth == 0,
        })
        .collect()
}

/// The names written in backticks in `text`.
fn quoted(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

/// The list under "Crate dependencies": each bullet names crates, a colon, and what they depend on
/// (`none`, or crate names in backticks); text in parentheses is commentary.
fn documented_dependencies(doc: &str) -> BTreeMap<String, BTreeSet<String>> {
    let start = doc.find("Crate dependencies").expect("docs/architecture.md has a `Crate dependencies` list");
    let mut listed = BTreeMap::new();
    for line in doc[start..].lines().skip(1).skip_while(|line| line.trim().is_empty()) {
        let Some(item) = line.strip_prefix("- ") else { break };
        let item = outside_parentheses(item);
        let (crates, dependencies) =
            item.split_once(':').unwrap_or_else(|| panic!("a dependency bullet without a colon: {line}"));
        let dependencies: BTreeSet<String> = quoted(dependencies).into_iter().collect();
        assert!(
            !dependencies.is_empty() || item.contains("none"),
            "a bullet names its dependencies, or says `none`: {line}"
        );
        for name in quoted(crates) {
            let previous = listed.insert(name.clone(), dependencies.clone());
            assert!(previous.is_none(), "`{name}` is listed twice");
        }
    }
    listed
}

#[test]
fn the_dependency_list_is_cargos() {
    let actual = workspace_dependencies();
    let listed = documented_dependencies(&architecture());
    let mut wrong = Vec::new();
    for (name, dependencies) in &actual {
        match listed.get(name) {
            None => wrong.push(format!("`{name}` is missing (it depends on {dependencies:?})")),
            Some(documented) if documented != dependencies => {
                wrong.push(format!("`{name}`: the list says {documented:?}, Cargo.toml says {dependencies:?}"))
            }
            Some(_) => {}
        }
    }
    for name in listed.keys().filter(|name| !actual.contains_key(*name)) {
        wrong.push(format!("`{name}` is listed but is no workspace crate"));
    }
    assert!(wrong.is_empty(), "docs/architecture.md's crate dependencies disagree with cargo:\n{}", wrong.join("\n"));
}

/// The crates that depend on `crate_name`.
fn dependents(graph: &BTreeMap<String, BTreeSet<String>>, crate_name: &str) -> BTreeSet<String> {
    graph.iter().filter(|(_, dependencies)| dependencies.contains(crate_name)).map(|(name, _)| name.clone()).collect()
}

/// Every invariant sentence `**Architecture invariant:** `A` depends on `X`, `Y` and `Z` only` holds
/// exactly, and the invariants about who may depend on a crate are stated and hold.
#[test]
fn the_dependency_invariants_hold() {
    let doc = architecture();
    let graph = workspace_dependencies();
    let mut checked = 0;
    for sentence in doc.split("**Architecture invariant:** ").skip(1) {
        let sentence = sentence.split(';').next().unwrap_or_default().split(". ").next().unwrap_or_default();
        let Some((subject, rest)) = sentence.split_once(" depends on ") else { continue };
        let Some(list) = rest.strip_suffix(" only") else { continue };
        let names = quoted(subject);
        let [subject] = names.as_slice() else { continue };
        let actual = graph.get(subject).unwrap_or_else(|| panic!("`{subject}` is no workspace crate"));
        let stated: BTreeSet<String> = quoted(list).into_iter().collect();
        assert_eq!(&stated, actual, "docs/architecture.md: `{subject}` depends on {stated:?} only");
        checked += 1;
    }
    assert!(checked >= 3, "the `depends on … only` invariants were found ({checked})");

    let kernel_crates = ["kernels-cpu", "kernels-cuda", "kernels-rocm", "kernels-xpu"];
    let stated = |text: &str| assert!(doc.contains(text), "docs/architecture.md states: {text}");
    stated("only kernel crates depend on `kernel-support` among the crates an engine builds");
    let allowed: BTreeSet<String> =
        kernel_crates.iter().map(|c| (*c).to_owned()).chain(["vllm-ir-bench".into(), "vllm-ir-tests".into()]).collect();
    let users = dependents(&graph, "kernel-support");
    assert!(users.is_subset(&allowed), "kernel-support's dependents: {users:?}");

    stated("`ir-core`, `layers` and the kernel crates never depend on it");
    for name in ["ir-core", "layers"].into_iter().chain(kernel_crates) {
        assert!(!graph[name].contains("ir-graph"), "`{name}` depends on ir-graph");
    }
    for name in kernel_crates {
        let expected: BTreeSet<String> = ["ir-core", "ir-ops", "kernel-support"].map(str::to_owned).into();
        assert_eq!(graph[name], expected, "every kernel crate depends on ir-core, ir-ops and kernel-support");
    }
    stated("nothing depends on `vllm-ir-bench`");
    assert!(dependents(&graph, "vllm-ir-bench").is_empty());
    stated("no dependency on the workspace crates");
    assert!(graph["xtask"].is_empty(), "xtask depends on {:?}", graph["xtask"]);
}

#[test]
fn parentheses_and_bullets_parse() {
    assert_eq!(outside_parentheses("a (b (c) d) e"), "a  e");
    let doc = "Crate dependencies (x):\n\n- `a`, `b` (see `c`): `d`, `e`;\n- `f`: none.\n\nafter\n- `g`: `h`";
    let listed = documented_dependencies(doc);
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert_eq!(listed["b"], BTreeSet::from(["d".to_owned(), "e".to_owned()]));
    assert!(listed["f"].is_empty());
}
