//! fp8 quantization on `rocm:0`: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! The kernels are `kernels/quant.hip` (compiled into the code object with every other source by
//! `build.rs`), `<op>_<dtype>` per input dtype; the fp8 format is a kernel argument and the scales
//! stay on the device.

use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use ir_ops::{dynamic_per_token_scaled_fp8_quant, static_scaled_fp8_quant};
use kernel_support::{NormQuantCall, NormQuantOutputs, fp8_format_code, quant_support_with};

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
    let format = fp8_format_code(call.out_dtype)?;
    #[cfg(feature = "rocm")]
    return launch::norm_quant(call, format);
    #[cfg(not(feature = "rocm"))]
    {
        let _ = (call, format);
        Err(crate::not_built())
    }
}

/// `static_scaled_fp8_quant` on `rocm:0`: a fresh compact output in `out_dtype`.
pub fn static_scaled_fp8_quant_rocm(x: &Tensor, scale: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
    let format = fp8_format_code(out_dtype)?;
    #[cfg(feature = "rocm")]
    return launch::quantize(x, launch::Scale::Static(scale), out_dtype, format).map(|(q, _)| q);
    #[cfg(not(feature = "rocm"))]
    {
        let _ = (x, scale, format);
        Err(crate::not_built())
    }
}

/// `dynamic_per_token_scaled_fp8_quant` on `rocm:0`: fresh compact `(q, scales)`.
pub fn dynamic_per_token_scaled_fp8_quant_rocm(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let format = fp8_format_code(out_dtype)?;
    #[cfg(feature = "rocm")]
    return launch::quantize(x, launch::Scale::Dynamic(scale_ub), out_dtype, format)
        .map(|(q, scales)| (q, scales.expect("a dynamic call makes scales")));
    #[cfg(not(feature = "rocm"))]
    {
        let _ = (x, scale_ub, format);
        Err(crate::not_built())
    }
}

#[cfg(feature = "rocm")]
mod launch {
    use std::ffi::c_void;

    use ir_core::storage::{DeviceAllocator, Storage};
    use ir_core::{DType, KernelError, Layout, Tensor, TensorError};
    use kernel_support::{
        ComputeScalar, NormQuantCall, NormQuantOutputs, NormQuantResidual, RowArgs, Rows, device_buffer,
        device_buffer_mut,
    };

    use ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT;
    use ir_ops::static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT;

    use super::QUANT_BLOCK;
    use crate::device::{HipBuffer, allocator, device};
    use crate::launch::{compute_param, element_ptr};

    pub(super) enum Scale<'a> {
        Static(&'a Tensor),
        Dynamic(Option<&'a Tensor>),
    }

    fn driver(message: String) -> KernelError {
        KernelError::Driver { backend: "rocm", message }
    }

    /// Quantizes x; the scales come back for a dynamic call.
    pub(super) fn quantize(
        x: &Tensor,
        scale: Scale<'_>,
        out_dtype: DType,
        mut format: i32,
    ) -> Result<(Tensor, Option<Tensor>), KernelError> {
        let rows = Rows::for_kernel(x.meta())?;
        let dtype = x.dtype();
        let allocator = allocator().map_err(driver)?;
        let mut q = allocator.allocate(x.numel() * out_dtype.size_in_bytes()).map_err(TensorError::from)?;
        let scales_shape = kernel_support::per_token_scales_shape(x.shape());
        let dynamic = matches!(scale, Scale::Dynamic(_));
        let mut scales =
            if dynamic { Some(allocator.allocate(rows.n_rows * 4).map_err(TensorError::from)?) } else { None };
        if rows.n_rows > 0 && rows.hidden == 0 && dynamic {
            // No element to reduce: every scale is the floor.
            let q = Tensor::from_storage(Storage::Device(q), out_dtype, Layout::compact(x.shape()))?;
            return Ok((q, Some(kernel_support::floor_scales(x, out_dtype)?)));
        }
        if rows.n_rows > 0 && rows.hidden > 0 {
            let device = device().map_err(driver)?;
            let mut x_ptr = element_ptr(device_buffer::<HipBuffer>(x, "x", "HIP")?.pointer, rows.offset, dtype);
            let mut q_ptr = q.as_any_mut().downcast_mut::<HipBuffer>().expect("allocated by this crate").pointer;
            let blocks =
                u32::try_from(rows.n_rows).map_err(|_| KernelError::GridLimit { what: "rows", count: rows.n_rows })?;
            let RowArgs { mut n_rows, mut hidden, row_stride: mut x_stride, .. } = rows.kernel_args()?;
            let scale_ptr = |t: &Tensor, param: &str| -> Result<*mut c_void, KernelError> {
                Ok(element_ptr(device_buffer::<HipBuffer>(t, param, "HIP")?.pointer, t.offset(), DType::F32))
            };
            match scale {
                Scale::Static(scale) => {
                    let mut s_ptr = scale_ptr(scale, "scale")?;
                    // static_scaled_fp8_quant_<dtype>(q, x, long long n_rows, int hidden,
                    //                                  long long x_row_stride, const float* scale, int format)
                    let mut params: [*mut c_void; 7] = [
                        &mut q_ptr as *mut _ as *mut c_void,
                        &mut x_ptr as *mut _ as *mut c_void,
                        &mut n_rows as *mut _ as *mut c_void,
                        &mut hidden as *mut _ as *mut c_void,
                        &mut x_stride as *mut _ as *mut c_void,
                        &mut s_ptr as *mut _ as *mut c_void,
                        &mut format as *mut _ as *mut c_void,
                    ];
                    let symbol = format!("{}_{dtype}", STATIC_SCALED_FP8_QUANT.name);
                    // SAFETY: the parameters point to locals of the kernel's declared types in
                    // prototype order, each integer converted without loss by `Rows::kernel_args`. x's rows
                    // lie inside its buffer (its layout was checked against its storage, and the rows
                    // come from that layout); the scale points at its one f32 element likewise; `q`
                    // holds n_rows · hidden bytes, written densely.
                    unsafe { device.launch(&symbol, blocks, QUANT_BLOCK, &mut params) }?;
                }
                Scale::Dynamic(ub) => {
                    let mut scales_ptr = scales
                        .as_mut()
                        .and_then(|s| s.as_any_mut().downcast_mut::<HipBuffer>())
                        .expect("allocated by this crate")
                        .pointer;
                    // Without a bound the kernel never reads `scale_ub`; the scales stand in.
                    let mut ub_ptr = match ub {
                        Some(ub) => scale_ptr(ub, "scale_ub")?,
                        None => scales_ptr,
                    };
                    let mut has_ub = i32::from(ub.is_some());
                    // dynamic_per_token_scaled_fp8_quant_<dtype>(q, scales, x, long long n_rows,
                    //     int hidden, long long x_row_stride, const float* scale_ub, int has_ub, int format)
                    let mut params: [*mut c_void; 9] = [
                        &mut q_ptr as *mut _ as *mut c_void,
                        &mut scales_ptr as *mut _ as *mut c_void,
                        &mut x_ptr as *mut _ as *mut c_void,
                        &mut n_rows as *mut _ as *mut c_void,
                        &mut hidden as *mut _ as *mut c_void,
                        &mut x_stride as *mut _ as *mut c_void,
                        &mut ub_ptr as *mut _ as *mut c_void,
                        &mut has_ub as *mut _ as *mut c_void,
                        &mut format as *mut _ as *mut c_void,
                    ];
                    let symbol = format!("{}_{dtype}", DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT.name);
                    // SAFETY: as for the static kernel; `scales` holds n_rows f32 values, one written
                    // per row, and `scale_ub` is read only when `has_ub` is 1.
                    unsafe { device.launch(&symbol, blocks, QUANT_BLOCK, &mut params) }?;
                }
            }
        }
        let q = Tensor::from_storage(Storage::Device(q), out_dtype, Layout::compact(x.shape()))?;
        let scales = scales
            .map(|s| Tensor::from_storage(Storage::Device(s), DType::F32, Layout::compact(&scales_shape)))
            .transpose()?;
        Ok((q, scales))
    }

    /// The norm + quantization kernel: fresh compact outputs.
    pub(super) fn norm_quant(call: NormQuantCall<'_>, mut format: i32) -> Result<NormQuantOutputs, KernelError> {
        let NormQuantCall { x, mut residual, weight, epsilon, scale, dynamic, out_dtype } = call;
        let rows = Rows::for_kernel(x.meta())?;
        let dtype = x.dtype();
        let allocator = allocator().map_err(driver)?;
        let mut q = allocator.allocate(x.numel() * out_dtype.size_in_bytes()).map_err(TensorError::from)?;
        let mut residual_out = match &residual {
            Some(NormQuantResidual::Read(_)) => {
                Some(allocator.allocate(x.numel() * dtype.size_in_bytes()).map_err(TensorError::from)?)
            }
            _ => None,
        };
        let mut scales =
            if dynamic { Some(allocator.allocate(rows.n_rows * 4).map_err(TensorError::from)?) } else { None };
        let scales_shape = kernel_support::per_token_scales_shape(x.shape());
        if rows.n_rows > 0 && rows.hidden > 0 {
            let device = device().map_err(driver)?;
            let pointer = |t: &Tensor, param: &str, offset: usize, dtype: DType| -> Result<*mut c_void, KernelError> {
                Ok(element_ptr(device_buffer::<HipBuffer>(t, param, "HIP")?.pointer, offset, dtype))
            };
            let own = |b: &mut Box<dyn ir_core::storage::DeviceBuffer>| {
                b.as_any_mut().downcast_mut::<HipBuffer>().expect("allocated by this crate").pointer
            };
            let residual_rows = residual.as_ref().map(|r| Rows::for_kernel(r.tensor().meta())).transpose()?;
            let null = std::ptr::null_mut::<c_void>();
            let mut q_ptr = own(&mut q);
            let mut scales_ptr = scales.as_mut().map_or(null, own);
            let mut x_ptr = pointer(x, "x", rows.offset, dtype)?;
            let has_residual = residual.is_some();
            // The residual: read, or read and written in place (through its unique ownership).
            let mut r_ptr = match (&mut residual, residual_rows) {
                (Some(NormQuantResidual::Read(r)), Some(r_rows)) => pointer(r, "x_residual", r_rows.offset, dtype)?,
                (Some(NormQuantResidual::InPlace(r)), Some(r_rows)) => {
                    let buffer = device_buffer_mut::<HipBuffer>(r, "x_residual", "HIP")?;
                    element_ptr(buffer.pointer, r_rows.offset, dtype)
                }
                _ => null,
            };
            let mut w_ptr = weight.map(|w| pointer(w, "weight", w.offset(), dtype)).transpose()?.unwrap_or(null);
            let scale_param = if dynamic { "scale_ub" } else { "scale" };
            let mut s_ptr = scale.map(|s| pointer(s, scale_param, s.offset(), DType::F32)).transpose()?.unwrap_or(null);
            let RowArgs { mut n_rows, mut hidden, row_stride: mut x_stride, .. } = rows.kernel_args()?;
            let mut r_stride = residual_rows.map(|r| r.kernel_args()).transpose()?.map_or(0, |r| r.row_stride);
            // A fresh residual output is compact; in place, the sum goes into the residual's own rows.
            let (mut out_ptr, mut out_stride) = match residual_out.as_mut() {
                Some(out) => (own(out), i64::from(hidden)),
                None if has_residual => (r_ptr, r_stride),
                None => (null, 0),
            };
            let mut eps = ComputeScalar::new(dtype, epsilon);
            let [mut has_residual, mut has_weight, mut is_dynamic, mut has_scale] =
                [has_residual, weight.is_some(), dynamic, scale.is_some()].map(i32::from);
            let blocks =
                u32::try_from(rows.n_rows).map_err(|_| KernelError::GridLimit { what: "rows", count: rows.n_rows })?;
            // norm_quant_<dtype>(q, scales, residual_out, x, r, w, long long n_rows, int hidden,
            //     long long x_row_stride, long long r_row_stride, long long out_row_stride, Compute<DTYPE> eps,
            //     const float* scale, int has_residual, int has_weight, int dynamic, int has_scale,
            //     int format)
            let mut params: [*mut c_void; 18] = [
                &mut q_ptr as *mut _ as *mut c_void,
                &mut scales_ptr as *mut _ as *mut c_void,
                &mut out_ptr as *mut _ as *mut c_void,
                &mut x_ptr as *mut _ as *mut c_void,
                &mut r_ptr as *mut _ as *mut c_void,
                &mut w_ptr as *mut _ as *mut c_void,
                &mut n_rows as *mut _ as *mut c_void,
                &mut hidden as *mut _ as *mut c_void,
                &mut x_stride as *mut _ as *mut c_void,
                &mut r_stride as *mut _ as *mut c_void,
                &mut out_stride as *mut _ as *mut c_void,
                compute_param(&mut eps),
                &mut s_ptr as *mut _ as *mut c_void,
                &mut has_residual as *mut _ as *mut c_void,
                &mut has_weight as *mut _ as *mut c_void,
                &mut is_dynamic as *mut _ as *mut c_void,
                &mut has_scale as *mut _ as *mut c_void,
                &mut format as *mut _ as *mut c_void,
            ];
            // SAFETY: the parameters point to locals of the kernel's declared types in prototype
            // order, each integer converted without loss by `Rows::kernel_args`. x's and the
            // residual's rows lie inside their buffers (their layouts were checked against their
            // storage); the weight holds `hidden` unit-stride elements from its offset (the
            // predicate); the scale points at its one f32 element. `q` holds n_rows · hidden
            // elements written densely, `scales` n_rows; the residual output is a fresh compact
            // buffer or, in place, the residual's own rows (uniquely owned: the call's activation;
            // each element read before the same thread writes it, only in the last pass). A null
            // pointer is never dereferenced: its flag is 0.
            unsafe { device.launch(&format!("norm_quant_{dtype}"), blocks, QUANT_BLOCK, &mut params) }?;
        }
        let q = Tensor::from_storage(Storage::Device(q), out_dtype, Layout::compact(x.shape()))?;
        let residual_out = residual_out
            .map(|r| Tensor::from_storage(Storage::Device(r), dtype, Layout::compact(x.shape())))
            .transpose()?;
        let scales = match scales {
            Some(_) if rows.hidden == 0 && rows.n_rows > 0 => Some(kernel_support::floor_scales(x, out_dtype)?),
            Some(s) => Some(Tensor::from_storage(Storage::Device(s), DType::F32, Layout::compact(&scales_shape))?),
            None => None,
        };
        Ok(NormQuantOutputs { q, scales, residual_out })
    }
}
