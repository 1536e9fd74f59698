//! `kernels-cuda`: the `cuda` provider of every built-in op: the norms (`fused_add_rms_norm` in place),
//! the gated activations, the fp8 quantizations and the fused norm + quantizations, and
//! `rotary_embedding` (in place on query and key).
//!
//! cudarc loads `libcuda` and `libnvrtc` at run time, so this crate builds everywhere; on a machine
//! without them the provider is registered and reports itself unavailable with the reason. The
//! kernels (the source CUDA and HIP share, `kernels/gpu`, embedded; the norms instantiated per
//! program by `kernels/cuda/rms_norm.cu`) are compiled by NVRTC at first use per variant and
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
#[cfg(feature = "emu")]
pub mod emu;
pub mod gated;
mod module;
pub mod program;
pub mod quant;
pub mod rotary;
pub mod runtime;

use ir_core::{DeviceKind, ImplSpec, Registry, RegistryError};
use kernel_support::KernelDTypes;
use kernel_support::gpu::GpuBackend;

use crate::runtime::Cuda;

pub use crate::device::{CudaAllocator, CudaBuffer, CudaDeviceState, allocator, availability, devices};
#[allow(deprecated)]
pub use crate::module::ELEMENT;
pub use crate::module::{
    BLOCK_SIZES, GPU_ELEMENT, Geometry, KernelVariant, NormOp, NormProgram, PORT, PORT_HEADER, Program, SOURCE,
    THREADS_PER_ROW, all_programs, arch_for, compile_program, compile_ptx, largest_cached_row, norm_program,
    nvrtc_availability, rms_norm_launch, vectorizes,
};
/// The cudarc this crate is built with, so an engine names the same slice and stream types.
pub use cudarc;

/// The provider name.
pub const PROVIDER: &str = "cuda";

/// The element dtypes the kernels compute on: f32, f16, bf16 and f64 (every CUDA GPU computes in
/// f64; an f64 reference on device tensors then stays on the device).
pub const KERNEL_DTYPES: KernelDTypes = KernelDTypes::WithF64;

fn backend() -> GpuBackend {
    GpuBackend {
        device: DeviceKind::Cuda,
        dtypes: || KERNEL_DTYPES,
        spec: || ImplSpec::new(PROVIDER).with_probe(availability),
        gated: gated::GATED_OPS,
    }
}

/// Registers the `cuda` implementations of every built-in op (also when no GPU exists: then unavailable).
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    kernel_support::gpu::register::<Cuda>(registry, backend())?;
    #[cfg(feature = "candle")]
    candle::install();
    Ok(())
}
