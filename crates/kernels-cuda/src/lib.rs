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

use ir_core::storage::Storage;
use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};
use ir_ops::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
use ir_ops::rms_norm;
use kernel_support::{
    ComputeScalar, KernelDTypes, NormCapabilities, Rows, device_buffer, device_buffer_mut,
    fused_add_rms_norm_support_with, norm_variance, rms_norm_support_with,
};

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
    let dtype = x.dtype();
    let x_rows = Rows::for_kernel(x.meta())?;
    let variance = norm_variance(variance_size, x_rows.hidden)?;
    let x_buffer = device_buffer::<CudaBuffer>(x, "x", "CUDA")?;
    let out_layout = x.layout().copy_layout();
    let out_meta = ir_core::TensorMeta { layout: out_layout.clone(), ..x.meta().clone() };
    let out_rows = Rows::for_kernel(&out_meta)?;
    // Outputs live on the call's stream, in stream order with the kernel that writes them.
    let stream = x_buffer.call_stream()?;
    let mut out = x_buffer
        .device
        .allocate_on(&stream, out_layout.storage_end() * dtype.size_in_bytes())
        .map_err(ir_core::TensorError::from)?;
    if x_rows.n_rows > 0 && x_rows.hidden > 0 {
        let weight = weight_arg(weight)?;
        let vectorized = launch::vector_ok(&x_rows, dtype, x_buffer.base_alignment())
            && launch::vector_ok(&out_rows, dtype, out.base_alignment())
            && weight_vector_ok(weight, x_rows.hidden, dtype);
        let launch = launch::Launch {
            dtype,
            rows: x_rows,
            other_rows: out_rows,
            epsilon: ComputeScalar::new(dtype, epsilon),
            vectorized,
            variance,
        };
        launch::launch_rms_norm(&stream, &launch, &mut out, x_buffer, weight)?;
    }
    Ok(Tensor::from_storage(Storage::Device(Box::new(out)), dtype, out_layout)?)
}

/// `fused_add_rms_norm` on a CUDA device, in place: `residual ← x + residual`, `x ← norm(sum)`.
pub fn fused_add_rms_norm_cuda(
    mut x: UniqueTensor,
    mut residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let dtype = x.tensor().dtype();
    let x_rows = Rows::for_kernel(x.tensor().meta())?;
    let residual_rows = Rows::for_kernel(residual.tensor().meta())?;
    let variance = norm_variance(variance_size, x_rows.hidden)?;
    if x_rows.n_rows > 0 && x_rows.hidden > 0 {
        let weight = weight_arg(weight)?;
        let x_buffer = device_buffer_mut::<CudaBuffer>(&mut x, "x", "CUDA")?;
        let residual_buffer = device_buffer_mut::<CudaBuffer>(&mut residual, "x_residual", "CUDA")?;
        let vectorized = launch::vector_ok(&x_rows, dtype, x_buffer.base_alignment())
            && launch::vector_ok(&residual_rows, dtype, residual_buffer.base_alignment())
            && weight_vector_ok(weight, x_rows.hidden, dtype);
        let launch = launch::Launch {
            dtype,
            rows: x_rows,
            other_rows: residual_rows,
            epsilon: ComputeScalar::new(dtype, epsilon),
            vectorized,
            variance,
        };
        let stream = x_buffer.call_stream()?;
        launch::launch_fused(&stream, &launch, x_buffer, residual_buffer, weight)?;
        if rounding.rounds_intermediates(dtype) {
            // `dtype` rounding: the residual now holds the rounded sum; x gets its norm (this
            // provider's `rms_norm` of the rounded sum), a second launch on the same stream.
            let norm = launch::Launch { rows: residual_rows, other_rows: x_rows, ..launch };
            launch::launch_rms_norm(&stream, &norm, x_buffer, residual_buffer, weight)?;
        }
    }
    Ok((x.into_tensor(), residual.into_tensor()))
}

/// Whether the weight allows the 16-byte path: none, or a weight of another dtype than x (read with
/// scalar loads in either path), or one of x's dtype whose real address is 16-byte aligned.
fn weight_vector_ok(weight: launch::WeightArg<'_>, hidden: usize, dtype: ir_core::DType) -> bool {
    weight.is_none_or(|(buffer, offset, weight_dtype)| {
        let rows = Rows { n_rows: 1, hidden, row_stride: hidden, offset };
        weight_dtype != dtype || launch::vector_ok(&rows, dtype, buffer.base_alignment())
    })
}

/// The weight's buffer, storage offset and dtype (which may differ from x's).
fn weight_arg(weight: Option<&Tensor>) -> Result<launch::WeightArg<'_>, KernelError> {
    match weight {
        None => Ok(None),
        Some(w) => Ok(Some((device_buffer::<CudaBuffer>(w, "weight", "CUDA")?, w.offset(), w.dtype()))),
    }
}
