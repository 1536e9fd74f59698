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

use ir_core::{DeviceKind, ImplSpec, Registry, RegistryError};
use kernel_support::KernelDTypes;
use kernel_support::gpu::GpuBackend;

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
/// The norms compute everything the reference does (a weight of another dtype than x and
/// `variance_size` run on the device, not on the host through native), and on a device with
/// `cl_khr_fp64` every op computes on f64 too (an f64 reference on device tensors).
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    kernel_support::gpu::register::<OpenCl>(registry, backend())
}

fn backend() -> GpuBackend {
    GpuBackend {
        device: DeviceKind::Xpu,
        dtypes: kernel_dtypes,
        spec: || ImplSpec::new(PROVIDER).with_probe(availability).with_platform_detection(is_gpu),
        gated: gated::GATED_OPS,
    }
}

/// The element dtypes the kernels compute on: f32, f16 and bf16, and f64 where the device has
/// `cl_khr_fp64` (every kernel then computes in f64, as the reference does for f64).
pub fn kernel_dtypes() -> KernelDTypes {
    KernelDTypes::with_f64_if(device().is_ok_and(|d| d.has_fp64()))
}
