//! `cargo xtask build --platform cpu|cuda|rocm|xpu`: the CLI in release with that platform's
//! features, saying what the machine lacks to run it.

use anyhow::bail;

use crate::Platform;
use crate::tools::{cargo, hip_installed, library_loadable};

/// `cargo xtask build --platform P`.
pub(crate) fn run(platform: Platform) -> anyhow::Result<()> {
    let features = match platform {
        Platform::Cpu => None,
        Platform::Cuda => {
            println!(
                "cuda: kernels are compiled by NVRTC at first use (cudarc loads libcuda and libnvrtc at run time)"
            );
            if !library_loadable("libcuda.so.1") {
                println!(
                    "note: libcuda.so.1 is not on this machine; the binary builds but `cuda` will report itself unavailable"
                );
            }
            if !library_loadable("libnvrtc.so.12") {
                println!(
                    "note: libnvrtc.so.12 is not on the loader path (pip install nvidia-cuda-nvrtc-cu12 and add its lib dir to LD_LIBRARY_PATH)"
                );
            }
            Some("cuda")
        }
        Platform::Xpu => {
            if !library_loadable("libOpenCL.so.1") {
                println!(
                    "note: libOpenCL.so.1 (the OpenCL ICD loader) is missing; `xpu` will report itself unavailable"
                );
            }
            Some("xpu")
        }
        Platform::Rocm => {
            if !hip_installed() {
                bail!(
                    "platform rocm needs hipcc and libamdhip64-dev (apt-get install hipcc libamdhip64-dev); kernels are compiled ahead of time for VLLM_IR_HIP_ARCHS (default gfx90a)"
                );
            }
            Some("rocm")
        }
    };
    let mut args = vec!["build", "--release", "--package", "vllm-ir-cli", "--no-default-features", "--locked"];
    if let Some(feature) = features {
        args.extend(["--features", feature]);
    }
    cargo(&args, &[])
}
