//! `cargo xtask lint`: formatting, clippy with warnings denied on every target, and the published
//! crates' documentation without a warning.

use crate::tools::{cargo, hip_installed};

/// `cargo xtask lint`: fmt check, clippy and rustdoc with warnings denied (and clippy of feature
/// `rocm` where hipcc is installed).
pub(crate) fn run() -> anyhow::Result<()> {
    lint_core()?;
    if hip_installed() {
        lint_rocm()?;
    }
    Ok(())
}

pub(crate) fn lint_core() -> anyhow::Result<()> {
    cargo(&["fmt", "--all", "--", "--check"], &[])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"], &[])?;
    // The published crates' documentation builds without a warning (broken or private links).
    cargo(
        &["doc", "--workspace", "--no-deps", "--exclude", "vllm-ir-bench", "--locked"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )
}

pub(crate) fn lint_rocm() -> anyhow::Result<()> {
    let args = [
        "clippy",
        "--package",
        "vllm-ir-kernels-rocm",
        "--all-targets",
        "--features",
        "rocm",
        "--locked",
        "--",
        "-D",
        "warnings",
    ];
    cargo(&args, &[])
}
