//! `kernel-support`: what the kernel crates of vllm-ir-rs (`cpu`, `cuda`, `rocm`, `xpu`) share,
//! kept apart from the engine-facing API of `ir-core` and the op declarations of `ir-ops`: the
//! standard kernel predicates (for the norms, the gated activations, the quantizations and rotary),
//! the row geometry kernels derive from the same metadata, the families' launch plumbing (the gated
//! family's scalar packing and table entries, the norm + quantization and rotary registration
//! helpers, the strided-copy pieces and kernel tables) and access to a device provider's own
//! buffers behind a tensor. With feature `emu`, module `emu` executes the CUDA/HIP kernel source
//! on the CPU (for tests). Module `program` generates CUDA/HIP and OpenCL C source from a row
//! program (`ir_ops::row_program`), with the caches of compiled generated kernels; `gpu` launches
//! them (`gpu::run_row_program`), and with `emu`, `emu::run_row_program` runs one on the emulated
//! GPU without a backend.
//!
//! Every item is at the crate root; the modules behind it hold one concern each (`support`,
//! `rows`, `geometry`, `gated`, `quant`, `rotary`, `copy`, `args`).
//!
//! Nothing here depends on the number of rows, so a provider's answer is the same for 1 or 65536
//! tokens. An engine never needs this crate; a kernel crate needs it, `ir-core` and `ir-ops`.

#[cfg(feature = "emu")]
pub mod emu;
pub mod gpu;
pub mod testing;

mod args;
mod copy;
mod gated;
mod geometry;
pub mod program;
mod quant;
mod rotary;
mod rows;
mod support;
#[cfg(test)]
mod tests;

pub use crate::args::{Bounded, device_buffer, device_buffer_mut, kernel_int, out_of_range, stepped_extent};
pub use crate::copy::{
    BINARY_KERNELS, CONVERT_KERNELS, COPY_MAX_RANK, ConvertFactor, CopyDims, CopyPieces, WIDE_COPY_BYTES,
    converts_through_f64,
};
pub use crate::gated::{GATED_SLOTS, GatedCall, GatedGeometry, GatedKernel, GatedScalars};
pub use crate::geometry::{
    GATED_MAX_BLOCK, GATED_STEP_CHUNKS, compute_dtype_code, element_code, gated_block, gpu_chunk, gpu_threads_per_row,
    largest_cached_row, norm_cache_chunks, norm_fused_cache_chunks,
};
pub use crate::quant::{
    NORM_QUANT_MIXED_KERNELS, NormQuantCall, NormQuantOutputs, NormQuantResidual, QUANT_KERNELS, QUANT_OPS,
    floor_scales, fp8_format_code, host_scale, norm_quant_kernel, register_norm_quant_ops,
};
pub use crate::rotary::{RotaryCall, RotaryKernel, RotaryLaunch, register_rotary, register_rotary_with};
pub use crate::rows::{NormOp, RowArgs, RowBlocks, Rows, norm_variance, reject_variance_size};
pub use crate::support::{
    ComputeScalar, KernelDTypes, NormCapabilities, fused_add_rms_norm_dynamic_per_token_quant_support,
    fused_add_rms_norm_dynamic_per_token_quant_support_with, fused_add_rms_norm_static_fp8_quant_support,
    fused_add_rms_norm_static_fp8_quant_support_with, fused_add_rms_norm_support, fused_add_rms_norm_support_with,
    gated_support, gated_support_with, qk_norm_rope_support_with, quant_support, quant_support_with,
    rms_norm_dynamic_per_token_quant_support, rms_norm_dynamic_per_token_quant_support_with,
    rms_norm_static_fp8_quant_support, rms_norm_static_fp8_quant_support_with, rms_norm_support, rms_norm_support_with,
    rotary_support, rotary_support_with,
};
pub use ir_ops::quant::per_token_scales_shape;
