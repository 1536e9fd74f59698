//! `kernels-rocm`: the `rocm` provider (AMD GPUs through HIP) of every built-in op: the norms
//! (`fused_add_rms_norm` in place), the gated activations, the fp8 quantizations and the fused norm +
//! quantizations, and `rotary_embedding` (in place on query and key).
//!
//! With feature `rocm`, `build.rs` compiles every `kernels/*.hip` with `hipcc --genco` for the
//! targets in `VLLM_IR_HIP_ARCHS` (default `gfx90a`) and embeds the code objects, and hip-sys links
//! `libamdhip64`. Without the feature the same API exists and the provider is registered as
//! unavailable ("built without feature `rocm`"). Reductions use the wave size of the device.
//!
//! ```
//! let registry = ir_ops::registry();
//! kernels_rocm::register(&registry)?;
//! let rocm = registry.providers("rms_norm").into_iter().find(|p| p.name == "rocm").unwrap();
//! println!("{:?}", rocm.availability);
//! # Ok::<(), ir_core::RegistryError>(())
//! ```
//!
//! # Logging
//!
//! Target `kernels_rocm`: the device and its code object (info).

/// `$call` through HIP (feature `rocm`); without the feature, the error that says the crate was
/// built without it (`$arg`s are the call's arguments, unused then).
macro_rules! with_hip {
    ($call:expr, $($arg:expr),+) => {{
        #[cfg(feature = "rocm")]
        return $call;
        #[cfg(not(feature = "rocm"))]
        {
            let _ = ($($arg),+);
            Err(crate::not_built())
        }
    }};
}

pub mod gated;
pub use kernel_support::{BINARY_KERNELS, CONVERT_KERNELS};
#[cfg(feature = "rocm")]
#[cfg_attr(docsrs, doc(cfg(feature = "rocm")))]
mod device;
mod module;
pub mod quant;
pub mod rotary;
#[cfg(feature = "rocm")]
mod runtime;

use ir_core::{Availability, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};
use ir_ops::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
use ir_ops::rms_norm;
use kernel_support::{KernelDTypes, NormCapabilities, fused_add_rms_norm_support_with, rms_norm_support_with};

#[cfg(feature = "rocm")]
#[cfg_attr(docsrs, doc(cfg(feature = "rocm")))]
pub use crate::device::{HipBuffer, HipStream, RocmAllocator};
pub use crate::module::{
    F64_MIXED_THREADS_PER_ROW, KernelVariant, MIXED_WEIGHT_THREADS_PER_ROW, NormOp, THREADS_PER_ROW, all_variants,
    launch_threads_per_row, vectorizes,
};

/// The provider name.
pub const PROVIDER: &str = "rocm";

/// The element dtypes the kernels compute on: f32, f16, bf16 and f64 (every AMD GPU computes in
/// f64; an f64 reference on device tensors then stays on the device).
pub const KERNEL_DTYPES: KernelDTypes = KernelDTypes::WithF64;

/// The norms' capabilities: every argument form, on [`KERNEL_DTYPES`].
const CAPABILITIES: NormCapabilities = NormCapabilities { dtypes: KERNEL_DTYPES, ..NormCapabilities::ALL };

/// The kernel source, embedded for reference and for compilation checks.
pub const SOURCE: &str = include_str!("../kernels/rms_norm.hip");

/// Registers the `rocm` implementations of every built-in op (unavailable without feature `rocm` or a device).
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    let rms_spec = ImplSpec::new(PROVIDER)
        .with_probe(availability)
        .with_supports(|args| rms_norm_support_with(args, DeviceKind::Rocm, CAPABILITIES));
    rms_norm::register(registry, rms_spec, rms_norm_rocm)?;
    let fused_spec = ImplSpec::new(PROVIDER)
        .with_probe(availability)
        .with_supports(|args| fused_add_rms_norm_support_with(args, DeviceKind::Rocm, CAPABILITIES));
    fused_add_rms_norm::register(registry, fused_spec, FusedAddRmsNormImpl::inplace(fused_add_rms_norm_rocm))?;
    gated::register(registry)?;
    quant::register(registry)?;
    rotary::register(registry)
}

/// Whether the provider can run here, and why not.
pub fn availability() -> Availability {
    #[cfg(feature = "rocm")]
    return device::availability();
    #[cfg(not(feature = "rocm"))]
    Availability::Unavailable("built without feature `rocm`".to_owned())
}

/// An allocator for `rocm:0` (with feature `rocm` and a device).
pub fn allocator() -> Result<Box<dyn ir_core::storage::DeviceAllocator>, String> {
    #[cfg(feature = "rocm")]
    return device::allocator().map(|a| Box::new(a) as Box<dyn ir_core::storage::DeviceAllocator>);
    #[cfg(not(feature = "rocm"))]
    Err("built without feature `rocm`".to_owned())
}

/// `rms_norm` on `rocm:0`.
pub fn rms_norm_rocm(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, KernelError> {
    with_hip!(
        kernel_support::gpu::run_rms_norm::<runtime::Hip>(x, weight, epsilon, variance_size),
        x,
        weight,
        epsilon,
        variance_size
    )
}

/// `fused_add_rms_norm` on `rocm:0`, in place.
pub fn fused_add_rms_norm_rocm(
    x: UniqueTensor,
    residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let round_sum = rounding.rounds_intermediates(x.tensor().dtype());
    with_hip!(
        kernel_support::gpu::run_fused_add_rms_norm::<runtime::Hip>(
            x,
            residual,
            weight,
            epsilon,
            variance_size,
            round_sum
        ),
        x,
        residual,
        weight,
        epsilon,
        variance_size,
        round_sum
    )
}

/// The error of a kernel call in a build without feature `rocm`.
#[cfg(not(feature = "rocm"))]
pub(crate) fn not_built() -> KernelError {
    KernelError::Driver { backend: "rocm", message: "built without feature `rocm`".to_owned() }
}
