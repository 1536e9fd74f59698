//! `kernels-cuda`: the `cuda` provider of every built-in op: the norms (`fused_add_rms_norm` in place),
//! the gated activations, the fp8 quantizations and the fused norm + quantizations, and
//! `rotary_embedding` (in place on query and key).
//!
//! cudarc loads `libcuda` and `libnvrtc` at run time, so this crate builds everywhere; on a machine
//! without them the provider is registered and reports itself unavailable with the reason. The
//! kernels (`kernels/rms_norm.cu`, embedded) are compiled by NVRTC at first use per variant and
//! cached per device; launch geometry depends on the hidden size only, so each row's result is the
//! same whatever the batch.
//!
//! ```
//! let registry = ir_ops::registry();
//! kernels_cuda::register(&registry)?;
//! let cuda = registry.providers("rms_norm").into_iter().find(|p| p.name == "cuda").unwrap();
//! // Available on a machine with an NVIDIA driver and a GPU; otherwise the reason says what is missing.
//! println!("{:?}", cuda.availability);
//! # Ok::<(), ir_core::RegistryError>(())
//! ```
//!
//! # candle
//!
//! With feature `candle` (and the defaults off, beside candle-core's `cuda` feature), module
//! `candle` lends candle's CUDA storages to `ir_ops::candle_ops`, so its functions run
//! this provider on candle CUDA tensors, on candle's stream; [`register`] installs it.
//!
//! # Logging
//!
//! Target `kernels_cuda`: devices found (info), compilation and loading of each variant (debug).

#[cfg(feature = "candle")]
pub mod candle;
pub mod copy;
mod device;
pub mod gated;
mod launch;
mod module;
pub mod quant;
pub mod rotary;
pub mod runtime;

use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};
use ir_ops::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
use ir_ops::rms_norm;
use kernel_support::{KernelDTypes, NormCapabilities, fused_add_rms_norm_support_with, rms_norm_support_with};

use crate::runtime::Cuda;

pub use crate::device::{CudaAllocator, CudaBuffer, CudaDeviceState, allocator, availability, devices};
pub use crate::launch::{BLOCK_SIZES, Geometry, THREADS_PER_ROW, rms_norm_launch};
pub use crate::module::{
    ELEMENT, KernelVariant, NARROW, NormOp, NormProgram, SOURCE, all_programs, arch_for, compile_ptx,
    largest_cached_row, nvrtc_availability, vectorizes,
};
/// The cudarc this crate is built with, so an engine names the same slice and stream types.
pub use cudarc;

/// The provider name.
pub const PROVIDER: &str = "cuda";

/// The element dtypes the kernels compute on: f32, f16, bf16 and f64 (every CUDA GPU computes in
/// f64; an f64 reference on device tensors then stays on the device).
pub const KERNEL_DTYPES: KernelDTypes = KernelDTypes::WithF64;

/// The norms' capabilities: every argument form, on [`KERNEL_DTYPES`].
const CAPABILITIES: NormCapabilities = NormCapabilities { dtypes: KERNEL_DTYPES, ..NormCapabilities::ALL };

/// Registers the `cuda` implementations of every built-in op (also when no GPU exists: then unavailable).
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    let rms_spec = ImplSpec::new(PROVIDER)
        .with_probe(availability)
        .with_supports(|args| rms_norm_support_with(args, DeviceKind::Cuda, CAPABILITIES));
    rms_norm::register(registry, rms_spec, rms_norm_cuda)?;
    let fused_spec = ImplSpec::new(PROVIDER)
        .with_probe(availability)
        .with_supports(|args| fused_add_rms_norm_support_with(args, DeviceKind::Cuda, CAPABILITIES));
    fused_add_rms_norm::register(registry, fused_spec, FusedAddRmsNormImpl::inplace(fused_add_rms_norm_cuda))?;
    gated::register(registry)?;
    quant::register(registry)?;
    rotary::register(registry)?;
    #[cfg(feature = "candle")]
    candle::install();
    Ok(())
}

/// `rms_norm` on a CUDA device: a fresh output with the declared layout; the launch is asynchronous.
pub fn rms_norm_cuda(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, KernelError> {
    kernel_support::gpu::run_rms_norm::<Cuda>(x, weight, epsilon, variance_size)
}

/// `fused_add_rms_norm` on a CUDA device, in place: `residual ← x + residual`, `x ← norm(sum)`.
pub fn fused_add_rms_norm_cuda(
    x: UniqueTensor,
    residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let round_sum = rounding.rounds_intermediates(x.tensor().dtype());
    kernel_support::gpu::run_fused_add_rms_norm::<Cuda>(x, residual, weight, epsilon, variance_size, round_sum)
}
