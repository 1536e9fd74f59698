//! Argument marshalling for the HIP kernels (feature `rocm`).

use std::ffi::c_void;

use ir_core::storage::{DeviceAllocator, Storage};
use ir_core::{DType, KernelError, Tensor, TensorError, TensorMeta, UniqueTensor};
use kernel_support::{ComputeScalar, Rows, device_buffer, device_buffer_mut, kernel_int, norm_variance};

use crate::device::{HipBuffer, allocator, device};
use crate::module::{KernelVariant, NormOp};

pub(crate) fn rms_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, KernelError> {
    let dtype = x.dtype();
    let x_rows = Rows::for_kernel(x.meta())?;
    let variance = norm_variance(variance_size, x_rows.hidden)?;
    let out_layout = x.layout().copy_layout();
    let out_rows = Rows::for_kernel(&TensorMeta { layout: out_layout.clone(), ..x.meta().clone() })?;
    let allocator = allocator().map_err(|message| KernelError::Driver { backend: "rocm", message })?;
    let mut out = allocator.allocate(out_layout.storage_end() * dtype.size_in_bytes()).map_err(TensorError::from)?;
    if x_rows.n_rows > 0 && x_rows.hidden > 0 {
        let x_ptr = element_ptr(device_buffer::<HipBuffer>(x, "x", "HIP")?.pointer, x_rows.offset, dtype);
        let out_buffer = out.as_any_mut().downcast_mut::<HipBuffer>().expect("allocated by this crate");
        let out_ptr = element_ptr(out_buffer.pointer, out_rows.offset, dtype);
        let weight_ptr = weight_ptr(weight)?;
        let vectorized = vector_ok(&[(x_rows, x_ptr), (out_rows, out_ptr)], weight_ptr, dtype);
        run(
            NormOp::RmsNorm,
            dtype,
            x_rows,
            vectorized,
            [out_ptr, x_ptr],
            weight_ptr,
            epsilon,
            variance,
            [x_rows.row_stride, out_rows.row_stride],
        )?;
    }
    Ok(Tensor::from_storage(Storage::Device(out), dtype, out_layout)?)
}

pub(crate) fn fused(
    mut x: UniqueTensor,
    mut residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    round_sum: bool,
) -> Result<(Tensor, Tensor), KernelError> {
    let dtype = x.tensor().dtype();
    let x_rows = Rows::for_kernel(x.tensor().meta())?;
    let r_rows = Rows::for_kernel(residual.tensor().meta())?;
    let variance = norm_variance(variance_size, x_rows.hidden)?;
    if x_rows.n_rows > 0 && x_rows.hidden > 0 {
        let weight_ptr = weight_ptr(weight)?;
        let x_ptr = element_ptr(device_buffer_mut::<HipBuffer>(&mut x, "x", "HIP")?.pointer, x_rows.offset, dtype);
        let r_ptr = element_ptr(
            device_buffer_mut::<HipBuffer>(&mut residual, "x_residual", "HIP")?.pointer,
            r_rows.offset,
            dtype,
        );
        let vectorized = vector_ok(&[(x_rows, x_ptr), (r_rows, r_ptr)], weight_ptr, dtype);
        run(
            NormOp::FusedAddRmsNorm,
            dtype,
            x_rows,
            vectorized,
            [x_ptr, r_ptr],
            weight_ptr,
            epsilon,
            variance,
            [x_rows.row_stride, r_rows.row_stride],
        )?;
        if round_sum {
            // `dtype` rounding: the residual now holds the rounded sum; x gets its norm (this
            // provider's `rms_norm` of the rounded sum), a second launch in stream order.
            let strides = [r_rows.row_stride, x_rows.row_stride];
            run(NormOp::RmsNorm, dtype, r_rows, vectorized, [x_ptr, r_ptr], weight_ptr, epsilon, variance, strides)?;
        }
    }
    Ok((x.into_tensor(), residual.into_tensor()))
}

#[allow(clippy::too_many_arguments)]
fn run(
    op: NormOp,
    dtype: DType,
    rows: Rows,
    vectorized: bool,
    buffers: [*mut c_void; 2],
    weight: Option<(*mut c_void, DType)>,
    epsilon: f64,
    variance: usize,
    strides: [usize; 2],
) -> Result<(), KernelError> {
    let device = device().map_err(|message| KernelError::Driver { backend: "rocm", message })?;
    let weight_dtype = weight.map(|(_, w_dtype)| w_dtype);
    let variant = KernelVariant {
        op,
        dtype,
        weight: weight_dtype,
        vectorized,
        threads_per_row: crate::module::launch_threads_per_row(rows.hidden, dtype, weight_dtype),
    };
    let rows_per_block = (variant.block_size() / variant.threads_per_row) as usize;
    let blocks = u32::try_from(rows.n_rows.div_ceil(rows_per_block))
        .map_err(|_| KernelError::GridLimit { what: "rows", count: rows.n_rows })?;
    let (mut first, mut second) = (buffers[0], buffers[1]);
    let mut weight = weight.map_or(std::ptr::null_mut(), |(pointer, _)| pointer);
    let mut epsilon = ComputeScalar::new(dtype, epsilon);
    let mut n_rows: i64 = kernel_int(rows.n_rows, "rows")?;
    let mut hidden: i32 = kernel_int(rows.hidden, "hidden size")?;
    let mut variance: i32 = kernel_int(variance, "variance_size")?;
    // rms_norm: (out, x, weight, epsilon, n_rows, hidden, variance, x_row_stride, out_row_stride)
    // fused:    (x, residual, weight, epsilon, n_rows, hidden, variance, x_row_stride, residual_row_stride)
    let mut stride_a: i64 = kernel_int(strides[0], "row stride")?;
    let mut stride_b: i64 = kernel_int(strides[1], "row stride")?;
    let mut params: [*mut c_void; 9] = [
        &mut first as *mut _ as *mut c_void,
        &mut second as *mut _ as *mut c_void,
        &mut weight as *mut _ as *mut c_void,
        compute_param(&mut epsilon),
        &mut n_rows as *mut _ as *mut c_void,
        &mut hidden as *mut _ as *mut c_void,
        &mut variance as *mut _ as *mut c_void,
        &mut stride_a as *mut _ as *mut c_void,
        &mut stride_b as *mut _ as *mut c_void,
    ];
    // SAFETY: the parameters point to locals of the kernel's declared types in prototype order, each
    // integer converted without loss by `kernel_int`. The buffers cover the rows: each tensor's layout
    // was checked against its storage by `check_fits` (checked arithmetic) when it was built, and the
    // rows, offsets and strides come from that layout.
    unsafe { device.launch(&variant.symbol(), blocks, variant.block_size(), &mut params) }
}

/// A pointer to `value`'s number for a kernel's parameter array: a `Compute<DTYPE>` parameter
/// (element.hip.h) of the kernel `value` was made for.
pub(crate) fn compute_param(value: &mut ComputeScalar) -> *mut c_void {
    match value {
        ComputeScalar::F32(v) => v as *mut f32 as *mut c_void,
        ComputeScalar::F64(v) => v as *mut f64 as *mut c_void,
    }
}

pub(crate) fn element_ptr(base: *mut c_void, offset: usize, dtype: DType) -> *mut c_void {
    base.wrapping_byte_add(offset * dtype.size_in_bytes())
}

/// Whether 16-byte accesses are safe: x's rows, the output's and a weight of x's dtype (a weight of
/// another dtype is read with scalar loads in either path).
fn vector_ok(tensors: &[(Rows, *mut c_void)], weight: Option<(*mut c_void, DType)>, dtype: DType) -> bool {
    if !crate::module::vectorizes(dtype) {
        return false;
    }
    let width = 16 / dtype.size_in_bytes();
    let aligned = |p: *mut c_void| (p as usize).is_multiple_of(16);
    tensors.iter().all(|(rows, p)| {
        aligned(*p) && rows.hidden.is_multiple_of(width) && (rows.n_rows <= 1 || rows.row_stride.is_multiple_of(width))
    }) && weight.is_none_or(|(pointer, w_dtype)| w_dtype != dtype || aligned(pointer))
}

/// The weight's address (at its storage offset, in its own dtype) and dtype.
fn weight_ptr(weight: Option<&Tensor>) -> Result<Option<(*mut c_void, DType)>, KernelError> {
    match weight {
        None => Ok(None),
        Some(w) => {
            let base = device_buffer::<HipBuffer>(w, "weight", "HIP")?.pointer;
            Ok(Some((element_ptr(base, w.offset(), w.dtype()), w.dtype())))
        }
    }
}
