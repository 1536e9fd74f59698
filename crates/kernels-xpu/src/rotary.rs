//! `rotary_embedding` on the xpu, in place on query and key: `kernels/rotary.cl` after the element
//! prelude, one program per dtype, one work-group per token. The positions stay on the device; a
//! token whose position lies outside the cache is left unrotated (the kernel cannot report it).

use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use kernel_support::{RotaryCall, register_rotary_with};

use crate::module::ELEMENT;
use crate::runtime::OpenCl;

/// The rotary kernel's source (after the element prelude).
pub const ROTARY: &str = include_str!("../kernels/rotary.cl");

/// The program source of the rotary kernel.
pub fn program() -> String {
    format!("{ELEMENT}\n{ROTARY}")
}

/// Registers `rotary_embedding` (in place).
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = ImplSpec::new(crate::PROVIDER).with_probe(crate::availability).with_platform_detection(crate::is_gpu);
    register_rotary_with(registry, DeviceKind::Xpu, crate::kernel_dtypes, spec, rotary_embedding_xpu)
}

/// `rotary_embedding` on `xpu:0`: rotates query and key (when given) in their storage.
pub fn rotary_embedding_xpu(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    kernel_support::gpu::run_rotary::<OpenCl>(call)
}
