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
//! # Emulation
//!
//! With feature `emu`, module `emu` runs this crate's host code and code object on the CPU (the
//! providers `emu_hip`, waves of 64, and `emu_hip_wave32`, waves of 32), for tests on machines
//! without an AMD GPU.
//!
//! # Logging
//!
//! Target `kernels_rocm`: the device and its code object (info).

pub mod gated;
pub use kernel_support::{BINARY_KERNELS, CONVERT_KERNELS};
#[cfg(feature = "rocm")]
#[cfg_attr(docsrs, doc(cfg(feature = "rocm")))]
mod device;
#[cfg(feature = "emu")]
pub mod emu;
mod module;
pub mod program;
pub mod quant;
pub mod rotary;
mod runtime;

use ir_core::{Availability, DeviceKind, ImplSpec, Registry, RegistryError};
use kernel_support::KernelDTypes;
use kernel_support::gpu::GpuBackend;

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

/// The norms' HIP source (every variant of the row kernel CUDA and HIP share,
/// `kernels/gpu/rms_norm.h`, which it includes), embedded for reference and for compilation checks.
pub const SOURCE: &str = include_str!("../kernels/rms_norm.hip");

/// Registers the `rocm` implementations of every built-in op (unavailable without feature `rocm` or a device).
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    kernel_support::gpu::register::<runtime::Hip>(registry, backend())
}

fn backend() -> GpuBackend {
    GpuBackend {
        device: DeviceKind::Rocm,
        dtypes: || KERNEL_DTYPES,
        spec: || ImplSpec::new(PROVIDER).with_probe(availability),
        gated: gated::GATED_OPS,
    }
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

/// The error of a kernel call in a build without feature `rocm`.
#[cfg(not(feature = "rocm"))]
pub(crate) fn not_built() -> ir_core::KernelError {
    ir_core::KernelError::Driver { backend: "rocm", message: "built without feature `rocm`".to_owned() }
}
