//! fp8 quantization on `rocm:0`: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! The kernels are `kernels/quant.hip` (compiled into the code object with every other source by
//! `build.rs`), `<op>_<dtype>` per input dtype; the fp8 format is a kernel argument and the scales
//! stay on the device. The host code is the shared one of [`kernel_support::gpu`].

/// Threads per block (`QUANT_BLOCK` in `quant.hip`): one block per row.
pub const QUANT_BLOCK: u32 = 256;

/// The ops of this module, and its kernels (`<kernel>_<dtype>`).
pub use kernel_support::{QUANT_KERNELS as KERNELS, QUANT_OPS};
