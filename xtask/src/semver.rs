//! `cargo xtask semver`: the public API of every published crate against its last release.
//!
//! The last release is the first `## [X.Y.Z]` section of `CHANGELOG.md`, whose line
//! ``Release commit: `<hash>` `` names the commit it was made from (a git tag may not travel with
//! the repository). Each published crate's API is read from rustdoc's JSON output (the pinned
//! toolchain's, with `RUSTC_BOOTSTRAP=1`) at that commit and now: every public path (items, their
//! re-exports, variants, fields, inherent methods, trait items and the traits a type implements)
//! with its signature, ids replaced by the paths they name. A path gone or a signature changed is a
//! breaking change, which needs a breaking version bump (`0.y` → `0.(y+1)`, `x.y` → `(x+1).0`).
//! Until a release is recorded, it reads the API now and says that nothing is compared.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};
use serde_json::Value;

use crate::tools::project_root;

/// A version: major, minor, patch.
type Version = (u64, u64, u64);

/// A release recorded in `CHANGELOG.md`.
#[derive(Debug, PartialEq, Eq)]
struct Release {
    version: Version,
    commit: String,
}

/// The last release `changelog` records, if any.
fn last_release(changelog: &str) -> anyhow::Result<Option<Release>> {
    let Some(section) = changelog.split("\n## [").skip(1).find(|s| !s.starts_with("Unreleased]")) else {
        return Ok(None);
    };
    let version = section.split(']').next().unwrap_or_default();
    let parsed = parse_version(version).with_context(|| format!("CHANGELOG.md: release `{version}`"))?;
    let section = section.split("\n## ").next().unwrap_or_default();
    let commit = section
        .lines()
        .find_map(|line| line.strip_prefix("Release commit: `"))
        .and_then(|rest| rest.split('`').next())
        .filter(|hash| hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit()));
    let Some(commit) = commit else {
        bail!("CHANGELOG.md: release {version} has no line ``Release commit: `<hash>` ``");
    };
    Ok(Some(Release { version: parsed, commit: commit.to_owned() }))
}

fn parse_version(text: &str) -> anyhow::Result<Version> {
    let parts: Vec<u64> = text.split('.').map(str::parse).collect::<Result<_, _>>()?;
    match parts[..] {
        [major, minor, patch] => Ok((major, minor, patch)),
        _ => bail!("`{text}` is not major.minor.patch"),
    }
}

/// Whether `now` is a breaking version bump over `then`.
fn breaking_bump(then: Version, now: Version) -> bool {
    if then.0 == 0 { now.0 > 0 || now.1 > then.1 } else { now.0 > then.0 }
}

/// A crate's public API: each public path and its signature.
type Api = BTreeMap<String, String>;

/// Reads the public API from a crate's rustdoc JSON.
fn api(doc: &Value) -> anyhow::Result<Api> {
    let index = doc["index"].as_object().context("rustdoc JSON without an index")?;
    let paths = doc["paths"].as_object().context("rustdoc JSON without paths")?;
    let root = doc["root"].to_string();
    let root_item = index.get(&root).context("rustdoc JSON without its root module")?;
    let name = root_item["name"].as_str().unwrap_or("crate").to_owned();
    let mut reader = Reader { index, paths, public: BTreeMap::new() };
    let mut public = BTreeMap::new();
    reader.public_paths(root_item, &name, &mut public, 0);
    reader.public = public;
    let mut api = Api::new();
    reader.module(root_item, &name, &mut api, 0);
    Ok(api)
}

struct Reader<'d> {
    index: &'d serde_json::Map<String, Value>,
    paths: &'d serde_json::Map<String, Value>,
    /// The shortest public path of each item of the crate, by id: how a signature names a type of
    /// its own crate, so that moving a type between private modules changes no signature.
    public: BTreeMap<String, String>,
}

impl Reader<'_> {
    /// Fills `public` with the shortest public path of every item reached from `module`.
    fn public_paths(&self, module: &Value, prefix: &str, public: &mut BTreeMap<String, String>, depth: usize) {
        if depth > 16 {
            return;
        }
        for child in module["inner"]["module"]["items"].as_array().into_iter().flatten() {
            let Some(item) = self.item(child).filter(|item| item["visibility"] == "public") else { continue };
            let (target, name) = match item["inner"].get("use") {
                Some(reexport) if reexport["is_glob"] == true => {
                    if let Some(target) = self.item(&reexport["id"]) {
                        self.public_paths(target, prefix, public, depth + 1);
                    }
                    continue;
                }
                Some(reexport) => (reexport["id"].clone(), reexport["name"].as_str().unwrap_or_default().to_owned()),
                None => (child.clone(), item["name"].as_str().unwrap_or_default().to_owned()),
            };
            let path = format!("{prefix}::{name}");
            let key = target.to_string();
            let shorter = public
                .get(&key)
                .is_none_or(|known| (path.matches("::").count(), &path) < (known.matches("::").count(), known));
            if shorter {
                public.insert(key, path.clone());
            }
            if let Some(target) = self.item(&target).filter(|t| t["inner"].get("module").is_some()) {
                self.public_paths(target, &path, public, depth + 1);
            }
        }
    }

    fn item(&self, id: &Value) -> Option<&Value> {
        self.index.get(&id.to_string())
    }

    fn module(&self, module: &Value, prefix: &str, api: &mut Api, depth: usize) {
        if depth > 16 {
            return;
        }
        for child in module["inner"]["module"]["items"].as_array().into_iter().flatten() {
            let Some(item) = self.item(child) else { continue };
            if item["visibility"] != "public" {
                continue;
            }
            if let Some(reexport) = item["inner"].get("use") {
                let Some(target) = self.item(&reexport["id"]) else { continue };
                if reexport["is_glob"] == true {
                    self.module(target, prefix, api, depth + 1);
                } else {
                    let name = reexport["name"].as_str().unwrap_or_default();
                    self.record(target, &format!("{prefix}::{name}"), api, depth + 1);
                }
                continue;
            }
            let name = item["name"].as_str().unwrap_or_default();
            self.record(item, &format!("{prefix}::{name}"), api, depth + 1);
        }
    }

    fn record(&self, item: &Value, path: &str, api: &mut Api, depth: usize) {
        let inner = &item["inner"];
        if inner.get("module").is_some() {
            api.insert(path.to_owned(), "module".to_owned());
            self.module(item, path, api, depth);
            return;
        }
        api.insert(path.to_owned(), self.signature(inner));
        for (kind, list) in [("enum", "variants"), ("trait", "items")] {
            for id in inner[kind][list].as_array().into_iter().flatten() {
                if let Some(member) = self.item(id) {
                    let name = member["name"].as_str().unwrap_or_default();
                    api.insert(format!("{path}::{name}"), self.signature(&member["inner"]));
                }
            }
        }
        for id in inner["struct"]["kind"]["plain"]["fields"].as_array().into_iter().flatten() {
            if let Some(field) = self.item(id).filter(|f| f["visibility"] == "public") {
                let name = field["name"].as_str().unwrap_or_default();
                api.insert(format!("{path}.{name}"), self.signature(&field["inner"]));
            }
        }
        let impls = ["struct", "enum", "union"].iter().find_map(|kind| inner[kind]["impls"].as_array());
        for id in impls.into_iter().flatten() {
            let Some(block) = self.item(id).map(|i| &i["inner"]["impl"]) else { continue };
            if block["is_synthetic"] == true || !block["blanket_impl"].is_null() {
                continue;
            }
            if block["trait"].is_null() {
                for method in block["items"].as_array().into_iter().flatten().filter_map(|id| self.item(id)) {
                    let hidden = method["attrs"].to_string().contains("doc(hidden)");
                    if method["visibility"] == "public" && !hidden {
                        let name = method["name"].as_str().unwrap_or_default();
                        api.insert(format!("{path}::{name}"), self.signature(&method["inner"]));
                    }
                }
            } else {
                let mut trait_path = block["trait"].clone();
                self.normalize(&mut trait_path);
                let mut generics = block["generics"].clone();
                self.normalize(&mut generics);
                api.insert(format!("{path}: impl {trait_path}"), generics.to_string());
            }
        }
    }

    /// An item's signature: its JSON without documentation, positions and ids (a path an id
    /// names is written as the path).
    fn signature(&self, inner: &Value) -> String {
        let mut inner = inner.clone();
        for kind in ["struct", "enum", "union", "trait"] {
            if let Some(object) = inner.get_mut(kind).and_then(Value::as_object_mut) {
                object.remove("impls");
                object.remove("items");
                object.remove("variants");
                object.remove("implementations");
            }
        }
        self.normalize(&mut inner);
        inner.to_string()
    }

    /// A field listed by id (`null` for a stripped one), as its visibility, name and type.
    fn field(&self, id: &Value) -> Value {
        let Some(item) = self.item(id) else { return Value::String("stripped".to_owned()) };
        let mut ty = item["inner"]["struct_field"].clone();
        self.normalize(&mut ty);
        Value::String(format!("{} {}: {ty}", item["visibility"], item["name"]))
    }

    fn normalize(&self, value: &mut Value) {
        match value {
            Value::Object(object) => {
                if let Some(id) = object.remove("id") {
                    let key = id.to_string();
                    if let Some(path) = self.public.get(&key) {
                        object.insert("path".to_owned(), Value::String(path.clone()));
                    } else if let Some(known) = self.paths.get(&key) {
                        // Another crate's item: its crate and name (its definition's module path is
                        // that crate's own business).
                        let path: Vec<&str> =
                            known["path"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
                        let short = match path[..] {
                            [first, .., last] => format!("{first}::{last}"),
                            _ => path.join("::"),
                        };
                        object.insert("path".to_owned(), Value::String(short));
                    }
                }
                for (key, member) in object.iter_mut() {
                    // A struct's or variant's fields are listed by id: each as its name and type.
                    if (key == "fields" || key == "tuple")
                        && let Value::Array(fields) = member
                    {
                        for field in fields.iter_mut() {
                            *field = self.field(field);
                        }
                        continue;
                    }
                    self.normalize(member);
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|item| self.normalize(item)),
            _ => {}
        }
    }
}

/// The breaking changes from `then` to `now`: paths gone, and signatures changed.
fn breaking_changes(then: &Api, now: &Api) -> Vec<String> {
    let mut changes = Vec::new();
    for (path, signature) in then {
        match now.get(path) {
            None => changes.push(format!("removed: {path}")),
            Some(current) if current != signature => changes.push(format!("changed: {path}")),
            Some(_) => {}
        }
    }
    changes
}

/// The features whose API is compared where a crate has them: the exchanges and the test helpers.
/// The GPU features need their vendors' toolchains (and some exclude each other), so their
/// crates' APIs are read without them.
const API_FEATURES: &[&str] = &["candle", "dlpack", "testing"];

/// A published crate.
struct Published {
    name: String,
    /// Its library's name (the JSON file rustdoc writes).
    lib: String,
    version: Version,
    /// The features its API is read with, comma-separated.
    features: String,
}

/// The published crates (`publish` not false) under `crates/`.
fn published_crates(root: &Path) -> anyhow::Result<Vec<Published>> {
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args(["metadata", "--no-deps", "--format-version", "1", "--offline"])
        .current_dir(root)
        .output()
        .context("running `cargo metadata`")?;
    let metadata: Value = serde_json::from_slice(&output.stdout).context("reading `cargo metadata`")?;
    let mut crates = Vec::new();
    for package in metadata["packages"].as_array().into_iter().flatten() {
        let manifest = package["manifest_path"].as_str().unwrap_or_default();
        let unpublished = package["publish"].as_array().is_some_and(Vec::is_empty);
        let lib =
            package["targets"].as_array().into_iter().flatten().find(|t| t["kind"].to_string().contains("\"lib\""));
        if let Some(lib) = lib.filter(|_| manifest.contains("/crates/") && !unpublished) {
            let version = parse_version(package["version"].as_str().unwrap_or_default())?;
            let features: Vec<String> = API_FEATURES
                .iter()
                .filter(|feature| package["features"].get(**feature).is_some())
                .map(|feature| (*feature).to_owned())
                .collect();
            crates.push(Published {
                name: package["name"].as_str().unwrap_or_default().to_owned(),
                lib: lib["name"].as_str().unwrap_or_default().replace('-', "_"),
                version,
                features: features.join(","),
            });
        }
    }
    crates.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(crates)
}

/// The rustdoc JSON of `package`'s library in the workspace at `root`.
fn rustdoc_json(root: &Path, krate: &Published, features: &str, target: &Path) -> anyhow::Result<Value> {
    let package = krate.name.as_str();
    match rustdoc_json_with(root, krate, features, target) {
        // A feature that needs a vendor's toolchain (candle's CUDA build in `kernels-cuda`): the API
        // without the features, said.
        Err(error) if !features.is_empty() => {
            println!("semver: {package} with features `{features}` failed ({error:#}); reading it without them");
            rustdoc_json_with(root, krate, "", target)
        }
        result => result,
    }
}

fn rustdoc_json_with(root: &Path, krate: &Published, features: &str, target: &Path) -> anyhow::Result<Value> {
    let (package, lib) = (krate.name.as_str(), krate.lib.as_str());
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args(["rustdoc", "-q", "-p", package, "--lib", "--features", features, "--", "-Z", "unstable-options"])
        .args(["--output-format", "json"])
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_TARGET_DIR", target)
        .current_dir(root)
        .status()
        .with_context(|| format!("running rustdoc on {package}"))?;
    if !status.success() {
        bail!("rustdoc's JSON output of {package} failed ({status})");
    }
    let file = target.join("doc").join(format!("{lib}.json"));
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// `cargo xtask semver`.
pub(crate) fn run() -> anyhow::Result<()> {
    let root = project_root();
    let changelog = std::fs::read_to_string(root.join("CHANGELOG.md")).context("reading CHANGELOG.md")?;
    let crates = published_crates(&root)?;
    let Some(release) = last_release(&changelog)? else {
        println!(
            "semver: no release recorded in CHANGELOG.md yet, so nothing is compared; the first release records its \
             commit (``Release commit: `<hash>` `` under its `## [X.Y.Z]` heading) and from then on every published \
             crate's API ({} crates) is compared with it",
            crates.len()
        );
        return Ok(());
    };
    let baseline = root.join("target").join("semver").join(&release.commit);
    if !baseline.join("Cargo.toml").exists() {
        let status = Command::new("git")
            .args(["worktree", "add", "--detach", "--force"])
            .arg(&baseline)
            .arg(&release.commit)
            .current_dir(&root)
            .status()?;
        if !status.success() {
            bail!(
                "the release commit {} is not in this clone (a shallow clone? `git fetch --unshallow`)",
                release.commit
            );
        }
    }
    let mut failures = Vec::new();
    for krate in &crates {
        let Published { name: package, version, features, .. } = krate;
        let now = api(&rustdoc_json(&root, krate, features, &root.join("target").join("semver-now"))?)?;
        let then = match rustdoc_json(&baseline, krate, features, &root.join("target").join("semver-then")) {
            Ok(doc) => api(&doc)?,
            Err(error) => {
                println!("semver: {package}: not in release {:?} ({error:#}); new since", release.version);
                continue;
            }
        };
        let changes = breaking_changes(&then, &now);
        println!(
            "semver: {package} {version:?}: {} public paths, {} breaking changes since the release",
            now.len(),
            changes.len()
        );
        if !changes.is_empty() && !breaking_bump(release.version, *version) {
            failures.push(format!("{package}:\n  {}", changes.join("\n  ")));
        }
    }
    if !failures.is_empty() {
        bail!(
            "breaking changes without a breaking version bump over release {:?} (commit {}); bump the version, or \
             deprecate instead of removing:\n{}",
            release.version,
            release.commit,
            failures.join("\n")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_release_and_its_commit_are_read_from_the_changelog() {
        let changelog = "# Changelog\n\n## [Unreleased]\n\n- a\n\n## [0.2.0] - 2026-12-20\n\nRelease commit: `0123abcd`\n\n## [0.1.0]\n";
        let release = last_release(changelog).unwrap().unwrap();
        assert_eq!(release, Release { version: (0, 2, 0), commit: "0123abcd".to_owned() });
        assert_eq!(last_release("# Changelog\n\n## [Unreleased]\n\n- a\n").unwrap(), None);
        let error = last_release("## [Unreleased]\n\n## [0.2.0]\n\nno commit\n").unwrap_err();
        assert!(error.to_string().contains("Release commit"), "{error}");
    }

    #[test]
    fn a_breaking_change_needs_a_breaking_bump() {
        assert!(breaking_bump((0, 2, 0), (0, 3, 0)));
        assert!(breaking_bump((0, 2, 0), (1, 0, 0)));
        assert!(!breaking_bump((0, 2, 0), (0, 2, 1)));
        assert!(breaking_bump((1, 2, 0), (2, 0, 0)));
        assert!(!breaking_bump((1, 2, 0), (1, 3, 0)));
    }

    /// A crate `k` with a function, a struct with a public field and a method, a re-export of the
    /// struct at the root and an implemented trait, as rustdoc's JSON writes it.
    fn fixture(method_arg: &str, field: &str) -> Value {
        serde_json::json!({
            "root": 0,
            "paths": {
                "2": {"crate_id": 0, "path": ["k", "m", "S"], "kind": "struct"},
                "9": {"crate_id": 1, "path": ["core", "clone", "Clone"], "kind": "trait"}
            },
            "index": {
                "0": {"name": "k", "visibility": "public", "inner": {"module": {"items": [1, 5, 6]}}},
                "1": {"name": "m", "visibility": "public", "inner": {"module": {"items": [2]}}},
                "2": {"name": "S", "visibility": "public", "inner": {"struct": {
                    "kind": {"plain": {"fields": [3], "has_stripped_fields": false}},
                    "generics": {"params": []}, "impls": [7, 8]}}},
                "3": {"name": field, "visibility": "public", "inner": {"struct_field": {"primitive": "u32"}}},
                "4": {"name": "get", "visibility": "public", "attrs": [], "inner": {"function": {"sig": {
                    "inputs": [["x", {"primitive": method_arg}]], "output": {"resolved_path": {"path": "S", "id": 2}}}}}},
                "5": {"name": null, "visibility": "public", "inner": {"use": {"name": "S", "id": 2, "is_glob": false}}},
                "6": {"name": "f", "visibility": "public", "inner": {"function": {"sig": {"inputs": []}}}},
                "7": {"inner": {"impl": {"trait": null, "items": [4], "is_synthetic": false, "blanket_impl": null}}},
                "8": {"inner": {"impl": {"trait": {"path": "Clone", "id": 9}, "items": [], "generics": {},
                    "is_synthetic": false, "blanket_impl": null}}}
            }
        })
    }

    #[test]
    fn the_public_paths_come_with_their_signatures() {
        let read = api(&fixture("u32", "value")).unwrap();
        let paths: Vec<&str> = read.keys().map(String::as_str).collect();
        assert_eq!(
            paths,
            [
                "k::S",
                "k::S.value",
                "k::S: impl {\"path\":\"core::Clone\"}",
                "k::S::get",
                "k::f",
                "k::m",
                "k::m::S",
                "k::m::S.value",
                "k::m::S: impl {\"path\":\"core::Clone\"}",
                "k::m::S::get",
            ]
        );
        assert!(read["k::S::get"].contains("\"path\":\"k::S\""), "an id is written as its shortest public path");
        assert!(breaking_changes(&read, &read).is_empty());
        let changed = api(&fixture("u64", "value")).unwrap();
        assert_eq!(breaking_changes(&read, &changed), ["changed: k::S::get", "changed: k::m::S::get"]);
        let renamed = api(&fixture("u32", "count")).unwrap();
        let gone = ["changed: k::S", "removed: k::S.value", "changed: k::m::S", "removed: k::m::S.value"];
        assert_eq!(breaking_changes(&read, &renamed), gone, "the struct's fields are part of its signature");
        assert_eq!(breaking_changes(&renamed, &read).len(), 4, "a field gone either way");
    }
}
