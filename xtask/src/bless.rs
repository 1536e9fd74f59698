//! `cargo xtask bless`: rewrites the golden IR tests' expectations and shows what changed.

use std::process::Command;

use anyhow::{Context, bail};

use crate::tools::{cargo, project_root};

/// Reruns the golden IR tests with `IR_BLESS=1`, then shows what changed.
pub(crate) fn run() -> anyhow::Result<()> {
    cargo(&["test", "--package", "vllm-ir-tests", "--test", "ir_golden", "--locked"], &[("IR_BLESS", "1")])?;
    let status = Command::new("git")
        .args(["diff", "--stat", "--", "tests/ir"])
        .current_dir(project_root())
        .status()
        .context("running git diff")?;
    if !status.success() {
        bail!("git diff failed ({status})");
    }
    Ok(())
}
