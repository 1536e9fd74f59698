//! `cargo xtask kernels`: the kernel tests of every backend this machine has, each required to run.

use crate::tools::{cargo, hip_installed, library_loadable};

/// The kernel tests of every backend this machine has, each required to run (a missing toolkit
/// there is a failure); backends the machine lacks are skipped with the reason and what to install.
pub(crate) fn run() -> anyhow::Result<()> {
    if library_loadable("libnvrtc.so.12") {
        cargo(
            &[
                "test",
                "--package",
                "vllm-ir-kernels-cuda",
                "--test",
                "nvrtc",
                "--test",
                "ptxas",
                "--locked",
                "--",
                "--include-ignored",
            ],
            &[("VLLM_IR_REQUIRE", "nvrtc")],
        )?;
    } else {
        println!(
            "skipped: cuda kernels: libnvrtc.so.12 is not on the loader path (pip install nvidia-cuda-nvrtc-cu12 \
             nvidia-cuda-runtime-cu12 and add the wheel's lib directory to LD_LIBRARY_PATH)"
        );
    }
    if hip_installed() {
        cargo(
            &["test", "--package", "vllm-ir-kernels-rocm", "--test", "hipcc", "--locked", "--", "--include-ignored"],
            &[("VLLM_IR_REQUIRE", "hip")],
        )?;
    } else {
        println!("skipped: rocm kernels: hipcc or the HIP headers are missing (apt-get install hipcc libamdhip64-dev)");
    }
    let opencl: &[(&str, &str)] = if library_loadable("libOpenCL.so.1") {
        &[("VLLM_IR_REQUIRE", "xpu"), ("VLLM_IR_XPU_ALLOW_CPU", "1")]
    } else {
        println!("skipped: xpu kernels: no OpenCL ICD loader (apt-get install ocl-icd-libopencl1 pocl-opencl-icd)");
        &[]
    };
    if !opencl.is_empty() {
        cargo(&["test", "--package", "vllm-ir-kernels-xpu", "--locked"], opencl)?;
    }
    // The harness runs every provider available here (cpu always).
    cargo(&["test", "--package", "vllm-ir-tests", "--test", "kernels", "--locked"], opencl)
}
