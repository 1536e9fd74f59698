//! The gated activations (`silu_and_mul`, `gelu_and_mul`, …) on `rocm:0`.
//!
//! Each op is one kernel source `kernels/gpu/<op>.h` (shared with CUDA; `kernels/<op>.hip` includes
//! it after the row kernel `kernels/gpu/gated.h`, and `build.rs` compiles it into the code object
//! with every other source) and one line of [`GATED_OPS`]. The op's scalar parameters reach the kernel
//! through [`GatedScalars`](kernel_support::GatedScalars). Each op has a scalar kernel and, except
//! for f64, a 16-byte one for aligned rows (`<op>_<dtype>_vec`), launched with one block per row of
//! [`gated_block`](kernel_support::gated_block) threads.

use ir_ops::gelu_and_mul::GELU_AND_MUL;
use ir_ops::silu_and_mul::SILU_AND_MUL;
use kernel_support::GatedKernel;

/// The shared row kernel of the gated ops.
pub const GATED: &str = include_str!("../kernels/gpu/gated.h");

/// Every gated op this provider implements: adding one is a kernel source and a line here.
pub const GATED_OPS: &[GatedKernel] = &[
    GatedKernel { def: &SILU_AND_MUL, source: include_str!("../kernels/silu_and_mul.hip") },
    GatedKernel { def: &GELU_AND_MUL, source: include_str!("../kernels/gelu_and_mul.hip") },
    GatedKernel {
        def: &ir_ops::gelu_and_mul_sparse::GELU_AND_MUL_SPARSE,
        source: include_str!("../kernels/gelu_and_mul_sparse.hip"),
    },
];
