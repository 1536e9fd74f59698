//! `cargo xtask candle-cuda`: the ops on candle CUDA tensors, linted beside candle's own CUDA build.

use std::env;
use std::process::Command;

use anyhow::bail;

use crate::tools::{cargo, project_root};

/// Clippy (`-D warnings`, every target) of `examples/candle-cuda`, a crate outside the workspace
/// that runs the ops on candle CUDA tensors: candle-core with its `cuda` feature (candle's kernels
/// compiled by nvcc, cudarc configured by candle) beside the `cuda` provider built with its `candle`
/// feature, so the bridge is checked against candle's real `CudaStorage`. Needs nvcc (CUDA 12 or
/// 13): the toolkit root in `VLLM_IR_CUDA_TOOLKIT` (`.ci/run` installs NVIDIA's CUDA 13.0 wheels and
/// sets it) or nvcc on PATH; without it prints `skipped: <reason>`, or fails when
/// `VLLM_IR_REQUIRE` lists `nvcc`. cudarc's `cuda-version-from-build-system` reads
/// `CUDARC_CUDA_VERSION`, set to 12.8, the API this crate's default binds.
pub(crate) fn run() -> anyhow::Result<()> {
    // The toolkit named by VLLM_IR_CUDA_TOOLKIT (what `.ci/cuda-toolkit` prints) goes on PATH for
    // this build alone: hipcc turns to the NVIDIA platform when it finds nvcc on PATH.
    let toolkit = env::var("VLLM_IR_CUDA_TOOLKIT").ok().filter(|root| !root.is_empty());
    let path = match &toolkit {
        Some(root) => format!("{root}/bin:{}", env::var("PATH").unwrap_or_default()),
        None => env::var("PATH").unwrap_or_default(),
    };
    let nvcc = Command::new("nvcc").arg("--version").env("PATH", &path).output().is_ok_and(|o| o.status.success());
    if !nvcc {
        let reason = "candle's CUDA build needs nvcc: set VLLM_IR_CUDA_TOOLKIT to the root `.ci/cuda-toolkit` prints \
                      (it installs CUDA 13.0's nvcc from NVIDIA's pip wheels), or put nvcc on PATH";
        let required = env::var("VLLM_IR_REQUIRE").unwrap_or_default();
        if required.split(',').any(|b| b.trim() == "nvcc") {
            bail!("`nvcc` is required (VLLM_IR_REQUIRE={required}): {reason}");
        }
        println!("skipped: ops on candle CUDA tensors: {reason}");
        return Ok(());
    }
    let root = project_root();
    let manifest = root.join("examples").join("candle-cuda").join("Cargo.toml");
    let target = root.join("target").join("candle-cuda");
    let (manifest, target) = (manifest.to_string_lossy(), target.to_string_lossy());
    // candle's build asks nvidia-smi for the compute capability unless told; 8.0 when nothing says.
    let compute_cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".to_owned());
    let mut envs = vec![("CUDARC_CUDA_VERSION", "12080"), ("CUDA_COMPUTE_CAP", compute_cap.as_str())];
    if let Some(root) = &toolkit {
        envs.extend([("PATH", path.as_str()), ("CUDA_ROOT", root.as_str())]);
    }
    cargo(
        &[
            "clippy",
            "--manifest-path",
            &manifest,
            "--target-dir",
            &target,
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ],
        &envs,
    )
}
