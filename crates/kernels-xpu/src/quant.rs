//! fp8 quantization on the xpu: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! One program per input dtype, `kernels/quant.cl` after the element prelude, holding both kernels;
//! the fp8 format is a kernel argument. The scales stay on the device: the kernels read them there. The host code is the
//! shared one of [`kernel_support::gpu`]; each buffer parameter is followed by its element offset.

use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use ir_ops::dynamic_per_token_scaled_fp8_quant;
use ir_ops::static_scaled_fp8_quant;
use kernel_support::{NormQuantCall, NormQuantOutputs, quant_support_with};

use crate::module::ELEMENT;
use crate::runtime::OpenCl;

/// The quantization kernels' source (after the element prelude).
pub const QUANT: &str = include_str!("../kernels/quant.cl");

/// Work-items per work-group (`QUANT_GROUP` in `quant.cl`): one group per row.
pub const QUANT_GROUP: usize = 128;

/// The program source of the quantization kernels: the element prelude, then `quant.cl`.
pub fn program() -> String {
    format!("{ELEMENT}\n{QUANT}")
}

/// Registers both quantization ops.
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || {
        ImplSpec::new(crate::PROVIDER)
            .with_probe(crate::availability)
            .with_platform_detection(crate::is_gpu)
            .with_supports(|args| quant_support_with(args, DeviceKind::Xpu, crate::kernel_dtypes()))
    };
    static_scaled_fp8_quant::register(registry, spec(), static_scaled_fp8_quant_xpu)?;
    dynamic_per_token_scaled_fp8_quant::register(registry, spec(), dynamic_per_token_scaled_fp8_quant_xpu)
}

/// `static_scaled_fp8_quant` on `xpu:0`: a fresh compact output in `out_dtype`.
pub fn static_scaled_fp8_quant_xpu(x: &Tensor, scale: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
    kernel_support::gpu::run_static_quant::<OpenCl>(x, scale, out_dtype)
}

/// `dynamic_per_token_scaled_fp8_quant` on `xpu:0`: fresh compact `(q, scales)`.
pub fn dynamic_per_token_scaled_fp8_quant_xpu(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    kernel_support::gpu::run_dynamic_quant::<OpenCl>(x, scale_ub, out_dtype)
}

/// The norm + quantization kernel's source (after the element prelude and `quant.cl`).
pub const NORM_QUANT: &str = include_str!("../kernels/norm_quant.cl");

/// The program source of the norm + quantization kernel.
pub fn norm_quant_program() -> String {
    format!("{ELEMENT}\n{QUANT}\n{NORM_QUANT}")
}

/// Registers the four norm + quantization ops.
pub(crate) fn register_fused(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || ImplSpec::new(crate::PROVIDER).with_probe(crate::availability).with_platform_detection(crate::is_gpu);
    kernel_support::register_norm_quant_ops(registry, DeviceKind::Xpu, crate::kernel_dtypes, spec, norm_quant)
}

/// Runs the norm + quantization kernel: fresh compact outputs, and the residual output fresh or
/// written into the residual in place.
fn norm_quant(call: NormQuantCall<'_>) -> Result<NormQuantOutputs, KernelError> {
    kernel_support::gpu::run_norm_quant::<OpenCl>(call)
}
