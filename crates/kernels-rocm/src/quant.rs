//! fp8 quantization on `rocm:0`: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! The kernels are the ones CUDA and HIP share, `kernels/gpu/quant.h` and `kernels/gpu/norm_quant.h`
//! (which `kernels/quant.hip` includes; `build.rs` compiles it into the code object with every
//! other source), `<op>_<dtype>` per input dtype; the fp8 format is a kernel argument and the scales
//! stay on the device. The host code is the shared one of [`kernel_support::gpu`].

/// Threads per block (`QUANT_BLOCK` in `kernels/gpu/quant.h`): one block per row.
pub const QUANT_BLOCK: u32 = 256;

/// The ops of this module, and its kernels (`<kernel>_<dtype>`).
pub use kernel_support::{QUANT_KERNELS as KERNELS, QUANT_OPS};
