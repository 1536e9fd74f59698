//! Shared helpers of the cross-crate tests: an out-of-tree in-place provider registered through the
//! public API, as a downstream engine would register its own kernels.

use ir_core::op::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
use ir_core::{ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};

/// Computes native's values and writes them into the donated buffers.
pub fn inplace_fused_add_rms_norm(
    x: UniqueTensor,
    residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<(Tensor, Tensor), KernelError> {
    let (out, residual_out) =
        fused_add_rms_norm::native(x.tensor(), residual.tensor(), weight, epsilon, variance_size)?;
    let (mut x, mut residual) = (x.into_tensor(), residual.into_tensor());
    x.copy_from(&out)?;
    residual.copy_from(&residual_out)?;
    Ok((x, residual))
}

/// Registers [`inplace_fused_add_rms_norm`] under `provider`.
pub fn register_inplace_provider(registry: &Registry, provider: &'static str) -> Result<(), RegistryError> {
    fused_add_rms_norm::register(
        registry,
        ImplSpec::new(provider),
        FusedAddRmsNormImpl::Inplace(inplace_fused_add_rms_norm),
    )
}
