//! fp8 quantization on `rocm:0`: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! The kernels are `kernels/quant.hip` (compiled into the code object with every other source by
//! `build.rs`), `<op>_<dtype>` per input dtype; the fp8 format is a kernel argument and the scales
//! stay on the device. The host code is the shared one of [`kernel_support::gpu`].

use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use ir_ops::{dynamic_per_token_scaled_fp8_quant, static_scaled_fp8_quant};
use kernel_support::{NormQuantCall, NormQuantOutputs, quant_support_with};

/// Threads per block (`QUANT_BLOCK` in `quant.hip`): one block per row.
pub const QUANT_BLOCK: u32 = 256;

/// The ops of this module, and its kernels (`<kernel>_<dtype>`).
pub use kernel_support::{QUANT_KERNELS as KERNELS, QUANT_OPS};

/// Registers both quantization ops.
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || {
        ImplSpec::new(crate::PROVIDER)
            .with_probe(crate::availability)
            .with_supports(|args| quant_support_with(args, DeviceKind::Rocm, crate::KERNEL_DTYPES))
    };
    static_scaled_fp8_quant::register(registry, spec(), static_scaled_fp8_quant_rocm)?;
    dynamic_per_token_scaled_fp8_quant::register(registry, spec(), dynamic_per_token_scaled_fp8_quant_rocm)?;
    register_fused(registry)
}

/// Registers the four norm + quantization ops.
fn register_fused(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || ImplSpec::new(crate::PROVIDER).with_probe(crate::availability);
    kernel_support::register_norm_quant_ops(registry, DeviceKind::Rocm, || crate::KERNEL_DTYPES, spec, norm_quant)
}

/// Runs the norm + quantization kernel: fresh compact outputs.
fn norm_quant(call: NormQuantCall<'_>) -> Result<NormQuantOutputs, KernelError> {
    with_hip!(kernel_support::gpu::run_norm_quant::<crate::runtime::Hip>(call), call)
}

/// `static_scaled_fp8_quant` on `rocm:0`: a fresh compact output in `out_dtype`.
pub fn static_scaled_fp8_quant_rocm(x: &Tensor, scale: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
    with_hip!(kernel_support::gpu::run_static_quant::<crate::runtime::Hip>(x, scale, out_dtype), x, scale, out_dtype)
}

/// `dynamic_per_token_scaled_fp8_quant` on `rocm:0`: fresh compact `(q, scales)`.
pub fn dynamic_per_token_scaled_fp8_quant_rocm(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    with_hip!(
        kernel_support::gpu::run_dynamic_quant::<crate::runtime::Hip>(x, scale_ub, out_dtype),
        x,
        scale_ub,
        out_dtype
    )
}
