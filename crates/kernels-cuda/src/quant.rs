//! fp8 quantization on CUDA: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`,
//! and the norm + quantization.
//!
//! The kernels are the ones CUDA and HIP share (`kernels/gpu/quant.h`, `kernels/gpu/norm_quant.h`).
//! One NVRTC program per input dtype, after the shared element prelude and the fp8 conversion,
//! holding all three kernels and their 16-byte forms; the fp8 format is a kernel argument. Scales
//! stay on the device: the kernels read them there, so a call never waits for the host. The host
//! code is the shared one of [`kernel_support::gpu`].

use cudarc::nvrtc::Ptx;
use ir_core::{DType, KernelError};

use crate::module::{GPU_ELEMENT, Program, compile_program, dtype_define};

/// The quantization kernels' source (after the shared element prelude and [`FP8`]).
pub const QUANT: &str = include_str!("../kernels/gpu/quant.h");

/// The f32 -> fp8 conversion (`kernels/gpu/fp8.h`: the hardware's on sm_89 and later, software
/// with the same bits before), compiled after the portability header and before the quantization
/// and strided conversion kernels.
pub const FP8: &str = include_str!("../kernels/gpu/fp8.h");

/// Threads per block (`QUANT_BLOCK` in `quant.h`): one block per row.
pub const QUANT_BLOCK: u32 = 256;

/// The ops of this module, and its kernels (`<kernel>_<dtype>`).
pub use kernel_support::{QUANT_KERNELS as KERNELS, QUANT_OPS};

/// The norm + quantization kernel's source (after [`QUANT`]).
pub const NORM_QUANT: &str = include_str!("../kernels/gpu/norm_quant.h");

/// Compiles the quantization program (both quantization kernels and the norm + quantization
/// kernel) for input `dtype` to PTX for `arch`.
pub fn compile_ptx(dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile_program(&program(dtype)?, arch)
}

/// The quantization program for input `dtype`.
pub fn program(dtype: DType) -> Result<Program, KernelError> {
    let source = format!("{GPU_ELEMENT}\n{FP8}\n{QUANT}\n{NORM_QUANT}");
    Ok(Program {
        source,
        file: "quant.cu".to_owned(),
        name: format!("quant_{dtype}"),
        defines: vec![dtype_define(dtype)?],
    })
}
