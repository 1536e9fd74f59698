//! `rotary_embedding` on CUDA, in place on query and key: the kernel CUDA and HIP share
//! (`kernels/gpu/rotary.h`) after the shared element prelude, one NVRTC program per dtype, one
//! block per token. The positions stay on the device (a
//! call never waits for the host); a token whose position lies outside the cache is left
//! unrotated (the kernel cannot report it).

use cudarc::nvrtc::Ptx;
use ir_core::{DType, KernelError};

use crate::module::{GPU_ELEMENT, Program, compile_program, dtype_define};

/// The rotary kernel's source (after the shared element prelude).
pub const ROTARY: &str = include_str!("../kernels/gpu/rotary.h");

/// The kernel of this module (`rotary_embedding_<dtype>`).
pub const KERNEL: &str = "rotary_embedding";

/// Compiles the rotary program for `dtype` to PTX for `arch`.
pub fn compile_ptx(dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile_program(&program(dtype)?, arch)
}

/// The rotary program for `dtype`.
pub fn program(dtype: DType) -> Result<Program, KernelError> {
    let source = format!("{GPU_ELEMENT}\n{ROTARY}");
    Ok(Program {
        source,
        file: "rotary.cu".to_owned(),
        name: format!("rotary_{dtype}"),
        defines: vec![dtype_define(dtype)?],
    })
}
