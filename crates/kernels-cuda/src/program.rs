//! Row programs compiled by NVRTC: the CUDA source `kernel_support::program::gpu_source`
//! generates from a program, after this backend's portability header and the shared headers, the
//! same program the emulated GPU runs (`kernel_support::program::run_emulated`).

use cudarc::nvrtc::Ptx;
use ir_core::KernelError;
use ir_ops::row_program::{Binding, RowProgram};
use kernel_support::program::{ROW_PROGRAM_HEADERS, gpu_source};

use crate::module::{PORT_HEADER, Program, compile_program};

/// The NVRTC program of `program` for a call bound as `binding` (kernel
/// [`ROW_PROGRAM_KERNEL`](kernel_support::program::ROW_PROGRAM_KERNEL)).
pub fn row_program(program: &RowProgram, binding: &Binding) -> Result<Program, KernelError> {
    let generated =
        gpu_source(program, binding).map_err(|error| KernelError::InvalidArguments { reason: error.to_string() })?;
    Ok(Program {
        source: format!("{PORT_HEADER}\n{ROW_PROGRAM_HEADERS}{generated}"),
        file: "row_program.cu".to_owned(),
        name: format!("row program `{}`", program.name()),
        defines: Vec::new(),
    })
}

/// Compiles `program` for a call bound as `binding` to PTX for `arch` (`compute_90`, …; `None`
/// for NVRTC's default).
pub fn compile_ptx(program: &RowProgram, binding: &Binding, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile_program(&row_program(program, binding)?, arch)
}
