//! fp8 quantization on CUDA: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! One NVRTC program per input dtype, `kernels/quant.cu` after the element prelude, holding both
//! kernels; the fp8 format is a kernel argument. Scales stay on the device: the kernels read them
//! there, so a call never waits for the host. The host code is the shared one of
//! [`kernel_support::gpu`].

use cudarc::nvrtc::Ptx;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use ir_ops::dynamic_per_token_scaled_fp8_quant;
use ir_ops::static_scaled_fp8_quant;
use kernel_support::{NormQuantCall, NormQuantOutputs, quant_support_with};

use crate::module::{ELEMENT, compile, dtype_define};
use crate::runtime::Cuda;

/// The quantization kernels' source (after the element prelude).
pub const QUANT: &str = include_str!("../kernels/quant.cu");

/// The software f32 -> fp8 conversion (`kernels/fp8.cuh`), compiled before the quantization and
/// strided conversion kernels.
pub const FP8: &str = include_str!("../kernels/fp8.cuh");

/// Threads per block (`QUANT_BLOCK` in `quant.cu`): one block per row.
pub const QUANT_BLOCK: u32 = 256;

/// The ops of this module, and its kernels (`<kernel>_<dtype>`).
pub use kernel_support::{QUANT_KERNELS as KERNELS, QUANT_OPS};

/// The norm + quantization kernel's source (after the element prelude and `quant.cu`).
pub const NORM_QUANT: &str = include_str!("../kernels/norm_quant.cu");

/// Compiles the quantization program (both quantization kernels and the norm + quantization
/// kernel) for input `dtype` to PTX for `arch`.
pub fn compile_ptx(dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    let source = format!("{ELEMENT}\n{FP8}\n{QUANT}\n{NORM_QUANT}");
    compile(&source, "quant.cu", format!("quant_{dtype}"), vec![dtype_define(dtype)?], arch)
}

/// Registers both quantization ops.
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || {
        ImplSpec::new(crate::PROVIDER)
            .with_probe(crate::availability)
            .with_supports(|args| quant_support_with(args, DeviceKind::Cuda, crate::KERNEL_DTYPES))
    };
    static_scaled_fp8_quant::register(registry, spec(), static_scaled_fp8_quant_cuda)?;
    dynamic_per_token_scaled_fp8_quant::register(registry, spec(), dynamic_per_token_scaled_fp8_quant_cuda)?;
    register_fused(registry)
}

/// Registers the four norm + quantization ops.
fn register_fused(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || ImplSpec::new(crate::PROVIDER).with_probe(crate::availability);
    kernel_support::register_norm_quant_ops(registry, DeviceKind::Cuda, || crate::KERNEL_DTYPES, spec, norm_quant)
}

/// `static_scaled_fp8_quant` on CUDA: a fresh compact output in `out_dtype`; the launch is asynchronous.
pub fn static_scaled_fp8_quant_cuda(x: &Tensor, scale: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
    kernel_support::gpu::run_static_quant::<Cuda>(x, scale, out_dtype)
}

/// `dynamic_per_token_scaled_fp8_quant` on CUDA: fresh compact `(q, scales)`; the launch is asynchronous.
pub fn dynamic_per_token_scaled_fp8_quant_cuda(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    kernel_support::gpu::run_dynamic_quant::<Cuda>(x, scale_ub, out_dtype)
}

/// Runs the norm + quantization kernel: fresh compact outputs; the launch is asynchronous.
fn norm_quant(call: NormQuantCall<'_>) -> Result<NormQuantOutputs, KernelError> {
    kernel_support::gpu::run_norm_quant::<Cuda>(call)
}
