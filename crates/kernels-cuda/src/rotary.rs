//! `rotary_embedding` on CUDA, in place on query and key: `kernels/rotary.cu` after the element
//! prelude, one NVRTC program per dtype, one block per token. The positions stay on the device (a
//! call never waits for the host); a token whose position lies outside the cache is left
//! unrotated (the kernel cannot report it).

use cudarc::nvrtc::Ptx;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use kernel_support::{RotaryCall, register_rotary_with};

use crate::module::{ELEMENT, compile, dtype_define};
use crate::runtime::Cuda;

/// The rotary kernel's source (after the element prelude).
pub const ROTARY: &str = include_str!("../kernels/rotary.cu");

/// The kernel of this module (`rotary_embedding_<dtype>`).
pub const KERNEL: &str = "rotary_embedding";

/// Compiles the rotary program for `dtype` to PTX for `arch`.
pub fn compile_ptx(dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    let source = format!("{ELEMENT}\n{ROTARY}");
    compile(&source, "rotary.cu", format!("rotary_{dtype}"), vec![dtype_define(dtype)?], arch)
}

/// Registers `rotary_embedding` (in place).
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = ImplSpec::new(crate::PROVIDER).with_probe(crate::availability);
    register_rotary_with(registry, DeviceKind::Cuda, || crate::KERNEL_DTYPES, spec, rotary_embedding_cuda)
}

/// `rotary_embedding` on CUDA: rotates query and key (when given) in their storage; the launch is
/// asynchronous, on the query's call stream.
pub fn rotary_embedding_cuda(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    kernel_support::gpu::run_rotary::<Cuda>(call)
}
