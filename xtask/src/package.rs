//! `cargo xtask package`: every published crate ships its licenses and kernel sources, and the
//! workspace packages and builds as crates.io would build it.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::tools::{cargo, project_root};

/// Each published crate ships the license texts, and each kernel crate its kernel sources (reached
/// through symlinks), so every crate can be published on its own; then `cargo publish --workspace
/// --dry-run` packages and builds them all as crates.io would.
pub(crate) fn run() -> anyhow::Result<()> {
    let licenses = ["LICENSE-APACHE", "LICENSE-MIT"];
    let crates: [(&str, &[&str]); 12] = [
        ("vllm-ir-core", &[]),
        ("vllm-ir-ops", &[]),
        ("vllm-ir-kernel-support", &["kernels/cpu/runtime.h", "kernels/cpu/port.h"]),
        ("vllm-ir-graph", &[]),
        ("vllm-ir-passes", &[]),
        ("vllm-ir-kernels-cpu", &[]),
        ("vllm-ir-kernels-cuda", &["kernels/rms_norm.cu", "kernels/port.cuh", "kernels/gpu/rms_norm.h"]),
        ("vllm-ir-kernels-rocm", &["kernels/rms_norm.hip", "kernels/port.hip.h", "kernels/gpu/rms_norm.h"]),
        ("vllm-ir-kernels-xpu", &["kernels/rms_norm.cl", "kernels/gated.cl"]),
        ("vllm-ir-layers", &[]),
        ("vllm-ir-cli", &[]),
        ("vllm-ir", &[]),
    ];
    for (krate, sources) in crates {
        let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        println!("$ cargo package --list --allow-dirty --package {krate}");
        let output = Command::new(&cargo)
            .args(["package", "--list", "--allow-dirty", "--package", krate])
            .current_dir(project_root())
            .output()
            .with_context(|| format!("listing the package of {krate}"))?;
        let listing = String::from_utf8_lossy(&output.stdout);
        for file in licenses.iter().chain(sources.iter()) {
            if !output.status.success() || !listing.lines().any(|line| line == *file) {
                bail!(
                    "`cargo package --list` of {krate} does not ship {file}:\n{listing}{}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
    }
    let target_dir = forget_packaged_workspace_crates()?;
    let target_dir = target_dir.to_string_lossy();
    cargo(&["publish", "--workspace", "--dry-run", "--allow-dirty", "--locked", "--target-dir", &target_dir], &[])
}

/// Removes what an earlier `cargo publish --dry-run` left behind, and returns the target directory
/// the dry run builds in. Cargo treats registry crates as immutable: it unpacks the packaged crates
/// of its local registry under `$CARGO_HOME/registry/src/-<hash>/` once per name and version, and
/// reuses their builds by version. So a later dry run of changed sources would verify the dependents
/// against the first run's copies (and fail, or pass wrongly). Only this workspace's `vllm-ir*`
/// unpacked crates go, and the dry run builds in its own target directory whose `vllm-ir*`
/// fingerprints go (third-party builds stay cached).
fn forget_packaged_workspace_crates() -> anyhow::Result<PathBuf> {
    let target_dir = project_root().join("target").join("publish-dry-run");
    let fingerprints = target_dir.join("debug").join(".fingerprint");
    remove_entries_starting_with(&fingerprints, "vllm-ir")?;
    let cargo_home = match env::var_os("CARGO_HOME") {
        Some(home) => PathBuf::from(home),
        None => match env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".cargo"),
            None => return Ok(target_dir),
        },
    };
    let Ok(registries) = std::fs::read_dir(cargo_home.join("registry").join("src")) else { return Ok(target_dir) };
    for registry in registries.flatten() {
        // Local registries have no host name: their folder is `-<hash>`.
        if registry.file_name().to_string_lossy().starts_with('-') {
            remove_entries_starting_with(&registry.path(), "vllm-ir")?;
        }
    }
    Ok(target_dir)
}

/// Removes the entries of `dir` (if it exists) whose names start with `prefix`.
fn remove_entries_starting_with(dir: &Path, prefix: &str) -> anyhow::Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            let path = entry.path();
            let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}
