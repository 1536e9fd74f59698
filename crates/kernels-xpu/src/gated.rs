//! The gated activations (`silu_and_mul`, `gelu_and_mul`, …) on the xpu.
//!
//! Each op is one kernel source `kernels/<op>.cl` and one line of [`GATED_OPS`]; the program is the
//! element prelude, `kernels/gated.cl` (the shared row kernel) and the op's source, built per dtype
//! at first use. The op's scalar parameters reach the kernel through [`GatedScalars`](kernel_support::GatedScalars).

use ir_ops::gelu_and_mul::GELU_AND_MUL;
use ir_ops::silu_and_mul::SILU_AND_MUL;
use kernel_support::GatedKernel;

use crate::module::ELEMENT;

/// The shared row kernel of the gated ops.
pub const GATED: &str = include_str!("../kernels/gated.cl");

/// Work-items per work-group of the gated kernels (`GATED_GROUP` in `gated.cl`): one group per row.
pub const GATED_GROUP: usize = 128;

/// Every gated op this provider implements: adding one is a kernel source and a line here.
pub const GATED_OPS: &[GatedKernel] = &[
    GatedKernel { def: &SILU_AND_MUL, source: include_str!("../kernels/silu_and_mul.cl") },
    GatedKernel { def: &GELU_AND_MUL, source: include_str!("../kernels/gelu_and_mul.cl") },
    GatedKernel {
        def: &ir_ops::gelu_and_mul_sparse::GELU_AND_MUL_SPARSE,
        source: include_str!("../kernels/gelu_and_mul_sparse.cl"),
    },
];

/// The program source of a gated op: the element prelude, the row kernel, the op.
pub fn program(op: &GatedKernel) -> String {
    format!("{ELEMENT}\n{GATED}\n{}", op.source)
}
