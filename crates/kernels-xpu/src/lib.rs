//! `kernels-xpu`: the `xpu` provider (Intel GPUs through OpenCL C) of every built-in op: the norms
//! (`fused_add_rms_norm` in place), the gated activations, the fp8 quantizations and the fused norm +
//! quantizations, and `rotary_embedding` (in place on query and key).
//!
//! opencl3 loads the OpenCL ICD loader at run time, so this crate builds everywhere; without a GPU
//! the provider is registered and reports why it is unavailable. `VLLM_IR_XPU_ALLOW_CPU=1` lets it
//! use a CPU OpenCL device such as PoCL (how CI runs the kernels); such a device never makes the
//! platform Xpu. Kernels (`kernels/rms_norm.cl`, embedded) are built at first use per variant.
//!
//! ```
//! let registry = ir_ops::registry();
//! kernels_xpu::register(&registry)?;
//! let xpu = registry.providers("rms_norm").into_iter().find(|p| p.name == "xpu").unwrap();
//! println!("{:?}", xpu.availability);
//! # Ok::<(), ir_core::RegistryError>(())
//! ```
//!
//! # Logging
//!
//! Target `kernels_xpu`: the selected device (info), program builds (debug).

mod device;
pub mod gated;
mod module;
pub mod quant;
pub mod rotary;
pub mod runtime;

use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};
use ir_ops::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
use ir_ops::rms_norm;
use kernel_support::{KernelDTypes, NormCapabilities, fused_add_rms_norm_support_with, rms_norm_support_with};

use crate::runtime::OpenCl;

pub use crate::device::{
    ALLOW_CPU_ENV, COPY_MAX_RANK, XpuAllocator, XpuBuffer, XpuDevice, allocator, availability, device, is_gpu,
};
pub use crate::module::{
    CACHED_PER_WORK_ITEM, ELEMENT, KernelVariant, NormOp, SOURCE, THREADS_PER_ROW, all_variants, group_size,
    threads_per_row, use_subgroups,
};

/// The provider name.
pub const PROVIDER: &str = "xpu";

/// Environment variable forcing the local-memory tree reduction even where sub-groups exist.
pub const FORCE_TREE_ENV: &str = "VLLM_IR_XPU_FORCE_TREE";

/// Registers the `xpu` implementations of every built-in op (also when no device exists: then unavailable).
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = |supports: fn(&[ir_core::op::ArgMeta<'_>], DeviceKind) -> ir_core::Support| {
        ImplSpec::new(PROVIDER)
            .with_probe(availability)
            .with_platform_detection(is_gpu)
            .with_supports(move |args| supports(args, DeviceKind::Xpu))
    };
    // The norms compute everything the reference does: a weight of another dtype than x and
    // `variance_size` run on the device, not on the host through native.
    // On a device with cl_khr_fp64 they compute on f64 too (an f64 reference on device tensors).
    let rms_norm_support =
        |args: &[ir_core::op::ArgMeta<'_>], device| rms_norm_support_with(args, device, capabilities());
    let fused_add_rms_norm_support =
        |args: &[ir_core::op::ArgMeta<'_>], device| fused_add_rms_norm_support_with(args, device, capabilities());
    rms_norm::register(registry, spec(rms_norm_support), rms_norm_xpu)?;
    fused_add_rms_norm::register(
        registry,
        spec(fused_add_rms_norm_support),
        FusedAddRmsNormImpl::inplace(fused_add_rms_norm_xpu),
    )?;
    gated::register(registry)?;
    quant::register(registry)?;
    quant::register_fused(registry)?;
    rotary::register(registry)
}

/// The element dtypes the kernels compute on: f32, f16 and bf16, and f64 where the device has
/// `cl_khr_fp64` (every kernel then computes in f64, as the reference does for f64).
pub fn kernel_dtypes() -> KernelDTypes {
    KernelDTypes::with_f64_if(device().is_ok_and(|d| d.has_fp64()))
}

/// The norms' capabilities: every argument form, on [`kernel_dtypes`].
fn capabilities() -> NormCapabilities {
    NormCapabilities { dtypes: kernel_dtypes(), ..NormCapabilities::ALL }
}

/// `rms_norm` on `xpu:0`: a fresh output with the declared layout.
pub fn rms_norm_xpu(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, KernelError> {
    kernel_support::gpu::run_rms_norm::<OpenCl>(x, weight, epsilon, variance_size)
}

/// `fused_add_rms_norm` on `xpu:0`, in place: `residual ← x + residual`, `x ← norm(sum)`.
pub fn fused_add_rms_norm_xpu(
    x: UniqueTensor,
    residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let round_sum = rounding.rounds_intermediates(x.tensor().dtype());
    kernel_support::gpu::run_fused_add_rms_norm::<OpenCl>(x, residual, weight, epsilon, variance_size, round_sum)
}
