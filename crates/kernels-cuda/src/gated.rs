//! The gated activations (`silu_and_mul`, `gelu_and_mul`, …) on CUDA.
//!
//! Each op is one kernel source `kernels/gpu/<op>.h` (shared with HIP) and one line of
//! [`GATED_OPS`]; NVRTC compiles the shared element prelude, `kernels/gpu/gated.h` (the row kernel
//! CUDA and HIP share) and the op's source per dtype, at first use, and the module is cached per device. The program holds the op's two kernels: scalar
//! accesses, and 16-byte loads and stores for aligned rows (`<op>_<dtype>_vec`), with one block
//! per row of [`gated_block`](kernel_support::gated_block) threads. The op's scalar parameters reach the kernel
//! through [`GatedScalars`](kernel_support::GatedScalars); the host code is
//! [`kernel_support::gpu::run_gated`].

use cudarc::nvrtc::Ptx;
use ir_core::{DType, KernelError};
use ir_ops::gelu_and_mul::GELU_AND_MUL;
use ir_ops::silu_and_mul::SILU_AND_MUL;
use kernel_support::GatedKernel;

use crate::module::{GPU_ELEMENT, Program, compile_program, dtype_define};

/// The shared row kernel of the gated ops.
pub const GATED: &str = include_str!("../kernels/gpu/gated.h");

/// Every gated op this provider implements: adding one is a kernel source and a line here.
pub const GATED_OPS: &[GatedKernel] = &[
    GatedKernel { def: &SILU_AND_MUL, source: include_str!("../kernels/gpu/silu_and_mul.h") },
    GatedKernel { def: &GELU_AND_MUL, source: include_str!("../kernels/gpu/gelu_and_mul.h") },
    GatedKernel {
        def: &ir_ops::gelu_and_mul_sparse::GELU_AND_MUL_SPARSE,
        source: include_str!("../kernels/gpu/gelu_and_mul_sparse.h"),
    },
];

/// The source NVRTC compiles for a gated op: the shared element prelude, the row kernel, the op.
pub fn program(op: &GatedKernel) -> String {
    format!("{GPU_ELEMENT}\n{GATED}\n{}", op.source)
}

/// Compiles a gated op's kernel for `dtype` to PTX for `arch`.
pub fn compile_ptx(op: &GatedKernel, dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile_program(&dtype_program(op, dtype)?, arch)
}

/// A gated op's program for `dtype`.
pub fn dtype_program(op: &GatedKernel, dtype: DType) -> Result<Program, KernelError> {
    Ok(Program {
        source: program(op),
        file: format!("{}.cu", op.def.name),
        name: op.kernel_name(dtype),
        defines: vec![dtype_define(dtype)?],
    })
}
