//! fp8 quantization on CUDA: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! One NVRTC program per input dtype, `kernels/quant.cu` after the element prelude, holding both
//! kernels; the fp8 format is a kernel argument. Scales stay on the device: the kernels read them
//! there, so a call never waits for the host. The host code is the shared one of
//! [`kernel_support::gpu`].

use cudarc::nvrtc::Ptx;
use ir_core::{DType, KernelError};

use crate::module::{ELEMENT, compile, dtype_define};

/// The quantization kernels' source (after the element prelude).
pub const QUANT: &str = include_str!("../kernels/quant.cu");

/// The software f32 -> fp8 conversion (`kernels/fp8.cuh`), compiled before the quantization and
/// strided conversion kernels.
pub const FP8: &str = include_str!("../kernels/fp8.cuh");

/// Threads per block (`QUANT_BLOCK` in `quant.cu`): one block per row.
pub const QUANT_BLOCK: u32 = 256;

/// The ops of this module, and its kernels (`<kernel>_<dtype>`).
pub use kernel_support::{QUANT_KERNELS as KERNELS, QUANT_OPS};

/// The norm + quantization kernel's source (after the element prelude and `quant.cu`).
pub const NORM_QUANT: &str = include_str!("../kernels/norm_quant.cu");

/// Compiles the quantization program (both quantization kernels and the norm + quantization
/// kernel) for input `dtype` to PTX for `arch`.
pub fn compile_ptx(dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    let source = format!("{ELEMENT}\n{FP8}\n{QUANT}\n{NORM_QUANT}");
    compile(&source, "quant.cu", format!("quant_{dtype}"), vec![dtype_define(dtype)?], arch)
}
