//! `cargo xtask check-features`: each platform's features compile on their own (the engine's
//! crates without `testing`, the CLI with none, `cuda`, `xpu`, `rocm`; the bench with `candle`).

use crate::tools::{cargo, hip_installed};

/// `cargo xtask check-features`.
pub(crate) fn run() -> anyhow::Result<()> {
    check_features_core()?;
    if hip_installed() {
        check_features_rocm()?;
    } else {
        println!("skipped: feature `rocm` (needs hipcc and libamdhip64-dev: apt-get install hipcc libamdhip64-dev)");
    }
    Ok(())
}

pub(crate) fn check_features_core() -> anyhow::Result<()> {
    // What an engine links: the core and the cpu kernels without the `testing` feature (no
    // random-number crates); the generators then report the missing feature.
    cargo(
        &[
            "check",
            "--package",
            "vllm-ir-core",
            "--package",
            "vllm-ir-ops",
            "--package",
            "vllm-ir-kernel-support",
            "--package",
            "vllm-ir-kernels-cpu",
            "--package",
            "vllm-ir-layers",
            "--lib",
            "--locked",
        ],
        &[],
    )?;
    cargo(&["check", "--package", "vllm-ir-cli", "--no-default-features", "--locked"], &[])?;
    cargo(&["check", "--package", "vllm-ir-cli", "--no-default-features", "--features", "cuda", "--locked"], &[])?;
    cargo(&["check", "--package", "vllm-ir-cli", "--no-default-features", "--features", "xpu", "--locked"], &[])?;
    // The benchmarks' candle baseline is compiled only by `cargo xtask bench`: check it here, so a
    // change elsewhere (a new dtype) cannot break it unseen.
    cargo(&["check", "--package", "vllm-ir-bench", "--features", "candle", "--all-targets", "--locked"], &[])
}

pub(crate) fn check_features_rocm() -> anyhow::Result<()> {
    cargo(&["check", "--package", "vllm-ir-cli", "--no-default-features", "--features", "rocm", "--locked"], &[])?;
    // Every feature but the bench crate's `candle` (compiled only by `cargo xtask bench`) and
    // kernels-cuda's cudarc choices, which exclude each other (its dependents build its defaults).
    cargo(
        &[
            "check",
            "--workspace",
            "--all-features",
            "--exclude",
            "vllm-ir-bench",
            "--exclude",
            "vllm-ir-kernels-cuda",
            "--locked",
        ],
        &[],
    )?;
    cargo(&["check", "--package", "vllm-ir-bench", "--features", "rocm", "--all-targets", "--locked"], &[])
}
