//! `cargo xtask miri`: the tests that reach the workspace's `unsafe` code, under Miri on nightly.

use std::process::Command;

use anyhow::{Context, bail};

use crate::tools::project_root;

/// The tests that reach the workspace's `unsafe` code, run under Miri (nightly with the `miri`
/// component); prints `skipped: <reason>` when either is missing. What runs and what does not:
/// - `ir-core`: the storage (host buffers, the pool, external memory), tensors over them, the candle
///   and DLPack conversions, and the registry (its per-thread selection cache, a selection that outlives
///   its thread's dispatch state); left out, two tests Miri cannot run as written: one asks for 2^60
///   bytes (Miri aborts where the allocator returns an error) and one fills a 1 MiB pool buffer
///   three times (minutes under Miri; the pool's code is the small buffers' code);
/// - `ir-ops`: the ops on candle tensors (views of candle's storage under its locks);
/// - `kernels-cpu`: the rows' raw-pointer slices (in place and into another row), the element
///   conversions and the gated activations' scratch; its AVX-512 code cannot run under Miri (no
///   AVX-512), and its tests say `skipped:` there;
/// - the GPU crates hold `unsafe` only around driver calls (FFI), which Miri cannot run.
///
/// `-Zmiri-deterministic-floats` turns off Miri's deliberate imprecision in transcendental
/// functions, which the exact-value tests would read as failures; isolation is off for the test
/// harness's file and environment reads.
pub(crate) fn run() -> anyhow::Result<()> {
    let works = |args: &[&str]| Command::new("rustup").args(args).output().is_ok_and(|o| o.status.success());
    if !works(&["run", "nightly", "cargo", "miri", "--version"]) {
        println!(
            "skipped: Miri needs the nightly toolchain with its `miri` component (rustup component add --toolchain nightly miri rust-src)"
        );
        return Ok(());
    }
    // One invocation, so the dependencies (and `ir-core` with the features the crates need) are
    // compiled once; the filters pick the tests of the four crates' libraries (`ir-ops` holds the
    // candle custom ops, `kernel-support` the GPU family host code, run over a recording runtime) and of the two `ir-core` test files (their names carry `candle`, `dlpack`
    // or `thread_local`).
    let args = [
        "--package",
        "vllm-ir-core",
        "--package",
        "vllm-ir-ops",
        "--package",
        "vllm-ir-kernels-cpu",
        "--package",
        "vllm-ir-kernel-support",
        "--features",
        "vllm-ir-core/dlpack,vllm-ir-core/candle,vllm-ir-core/testing,vllm-ir-ops/candle",
        "--lib",
        "--test",
        "interop",
        "--test",
        "thread_exit",
        "--",
        "storage::",
        "tensor::",
        "interop::",
        "registry::",
        "candle",
        "dlpack",
        "thread_local",
        "rows::",
        "element::",
        "gated::",
        "gpu::",
        "tests::rms_norm_into",
        "--skip",
        "sizes_never_wrap_and_allocations_never_abort",
        "--skip",
        "a_freed_large_buffer_is_reused",
    ];
    let shown = args.join(" ");
    println!("$ MIRIFLAGS=\"{MIRIFLAGS}\" cargo +nightly miri test --locked {shown}");
    let status = Command::new("rustup")
        .args(["run", "nightly", "cargo", "miri", "test", "--locked"])
        .args(args)
        .env("MIRIFLAGS", MIRIFLAGS)
        .current_dir(project_root())
        .status()
        .context("running cargo miri")?;
    if !status.success() {
        bail!("`cargo +nightly miri test {shown}` failed ({status})");
    }
    Ok(())
}

/// Miri's flags for [`run`].
const MIRIFLAGS: &str = "-Zmiri-disable-isolation -Zmiri-deterministic-floats";
