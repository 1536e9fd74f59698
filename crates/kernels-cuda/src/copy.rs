//! `clone`, `contiguous` and `cat` of cuda tensors on the device: `kernels/gpu/strided_copy.h`
//! (shared with HIP), one thread per element, each element moved as an unsigned integer of its
//! size (every dtype bit for bit), or 16-byte units for rows contiguous on both sides, up to
//! [`COPY_MAX_RANK`] dimensions a launch (a copy past that takes one launch per
//! [`CopyDims::pieces`](kernel_support::CopyDims::pieces)); into another device's memory, through
//! the host. `copy_` between dtypes and `scale`: `kernels/gpu/strided_convert.h`, one kernel per
//! pair of [`CONVERT_KERNELS`] (every pair of dtypes); `add` and `mul` there too, one kernel per
//! dtype ([`BINARY_KERNELS`]). The host code is the shared one of [`kernel_support::gpu`]
//! (`copy_strided`, `convert_strided`, `binary_strided`).

use cudarc::nvrtc::Ptx;
use ir_core::KernelError;

use crate::module::{Program, compile_program};

/// The strided copy kernels' source (after the portability header).
pub const STRIDED_COPY: &str = include_str!("../kernels/gpu/strided_copy.h");

pub use kernel_support::COPY_MAX_RANK;

/// Threads per block of the copies, conversions and `add`/`mul`: one thread per element.
pub const COPY_BLOCK: u32 = 256;

/// The strided conversion and `add`/`mul` kernels' source (after the portability header, the fp8
/// conversion and [`STRIDED_COPY`]).
pub const STRIDED_CONVERT: &str = include_str!("../kernels/gpu/strided_convert.h");

pub use kernel_support::{BINARY_KERNELS, CONVERT_KERNELS};

/// Compiles the strided conversion program (every kernel of [`CONVERT_KERNELS`]) to PTX for `arch`.
/// The program holds the strided copies too: it is compiled after the portability header, the fp8
/// conversion and their source, whose indexing it uses.
pub fn compile_convert_ptx(arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile_program(&convert_program(), arch)
}

/// The strided conversion program.
pub fn convert_program() -> Program {
    let source = format!("{}\n{}\n{STRIDED_COPY}\n{STRIDED_CONVERT}", crate::module::PORT, crate::quant::FP8);
    Program { source, file: "strided_convert.cu".to_owned(), name: "strided_convert".to_owned(), defines: Vec::new() }
}

/// The element sizes the program has a kernel for (`strided_copy_<bytes>`).
pub const ELEMENT_SIZES: [usize; 5] = [1, 2, 4, 8, 16];

/// Compiles the strided copy program (all four element sizes) to PTX for `arch`.
pub fn compile_ptx(arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile_program(&copy_program(), arch)
}

/// The strided copy program.
pub fn copy_program() -> Program {
    let source = format!("{}\n{STRIDED_COPY}", crate::module::PORT);
    Program { source, file: "strided_copy.cu".to_owned(), name: "strided_copy".to_owned(), defines: Vec::new() }
}
