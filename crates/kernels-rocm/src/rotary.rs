//! `rotary_embedding` on `rocm:0`, in place on query and key: `kernels/rotary.hip` (compiled into
//! the code object with every other source by `build.rs`), `rotary_embedding_<dtype>`, one block per
//! token. The positions stay on the device; a token whose position lies outside the cache is left
//! unrotated (the kernel cannot report it).

use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use kernel_support::{RotaryCall, register_rotary_with};

/// The kernel of this module (`rotary_embedding_<dtype>`).
pub const KERNEL: &str = "rotary_embedding";

/// Registers `rotary_embedding` (in place).
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = ImplSpec::new(crate::PROVIDER).with_probe(crate::availability);
    register_rotary_with(registry, DeviceKind::Rocm, || crate::KERNEL_DTYPES, spec, rotary_embedding_rocm)
}

/// `rotary_embedding` on `rocm:0`: rotates query and key (when given) in their storage.
pub fn rotary_embedding_rocm(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    with_hip!(kernel_support::gpu::run_rotary::<crate::runtime::Hip>(call), call)
}
