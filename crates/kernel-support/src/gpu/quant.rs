//! The fp8 quantizations' and the norm + quantizations' host code.

use ir_core::storage::{DeviceBuffer, Storage};
use ir_core::{DType, KernelError, Layout, Tensor};
use ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT;
use ir_ops::static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT;

use super::{GpuRuntime, Grid, KernelArgs, KernelKey, base_aligned, vector_ok};
use crate::{
    ComputeScalar, NormQuantCall, NormQuantOutputs, NormQuantResidual, QUANT_KERNELS, RowArgs, Rows, device_buffer,
    device_buffer_mut, floor_scales, fp8_format_code, norm_quant_kernel, per_token_scales_shape, stepped_extent,
};

/// What every quantization launch starts from: x's rows and buffer, the call's queue and the fresh
/// compact q (x's shape in `out_dtype`).
struct QuantStart<'a, R: GpuRuntime> {
    rows: Rows,
    x: &'a R::Buffer,
    queue: R::Queue,
    q: R::Buffer,
    /// Whether x's rows and q allow the 16-byte kernel.
    vectorized: bool,
}

impl<'a, R: GpuRuntime> QuantStart<'a, R> {
    fn new(x: &'a Tensor, out_dtype: DType) -> Result<Self, KernelError> {
        let rows = Rows::for_kernel(x.meta())?;
        let x_buffer = device_buffer::<R::Buffer>(x, "x", R::MEMORY)?;
        let queue = R::queue(x_buffer)?;
        let q = R::allocate(x_buffer, &queue, x.numel() * out_dtype.size_in_bytes())?;
        // q's rows are `hidden` one-byte codes from its first byte: with x's rows allowing 16-byte
        // loads (hidden a multiple of the vector width), each starts a whole chunk of codes.
        let vectorized =
            vector_ok(&rows, x.dtype(), R::base_alignment(x_buffer)) && base_aligned(R::base_alignment(&q));
        Ok(QuantStart { rows, x: x_buffer, queue, q, vectorized })
    }
}

/// A fresh compact device tensor over `buffer`.
fn compact<B: DeviceBuffer>(buffer: B, dtype: DType, shape: &[usize]) -> Result<Tensor, KernelError> {
    Ok(Tensor::from_storage(Storage::Device(Box::new(buffer)), dtype, Layout::compact(shape))?)
}

fn quant_grid<R: GpuRuntime>(rows: &Rows) -> Grid {
    Grid { groups: rows.n_rows, group_size: R::QUANT_GROUP, what: "rows", grid_stride: true }
}

/// `static_scaled_fp8_quant` on runtime `R`: a fresh compact output in `out_dtype`, one group of
/// [`GpuRuntime::QUANT_GROUP`] per row; the scale stays on the device, where the kernel reads it.
/// The kernel is `static_scaled_fp8_quant_<dtype>(unsigned char* q, const elem_t* x, long long
/// n_rows, int hidden, long long x_row_stride, const float* scale, int format, int invert)`, or its
/// 16-byte form `<kernel>_<dtype>_vec` (same prototype) when x's rows and q allow it (every
/// quantization kernel has one, except for f64). `invert` is 1 under `rounding = "dtype"`: the
/// kernel multiplies by the scale's reciprocal.
pub fn run_static_quant<R: GpuRuntime>(
    x: &Tensor,
    scale: &Tensor,
    out_dtype: DType,
    rounding: ir_ops::Rounding,
) -> Result<Tensor, KernelError> {
    let format = fp8_format_code(out_dtype)?;
    let QuantStart::<R> { rows, x: x_buffer, queue, mut q, vectorized } = QuantStart::new(x, out_dtype)?;
    if rows.n_rows > 0 && rows.hidden > 0 {
        let scale_buffer = device_buffer::<R::Buffer>(scale, "scale", R::MEMORY)?;
        let kernel = STATIC_SCALED_FP8_QUANT.name;
        let kernel = R::kernel(x_buffer, KernelKey::Quant { kernel, dtype: x.dtype(), vectorized })?;
        let RowArgs { n_rows, hidden, row_stride, .. } = rows.kernel_args()?;
        // The kernel walks the row in block steps with a 32-bit index.
        stepped_extent(rows.hidden, "hidden size", R::QUANT_GROUP)?;
        let mut args = KernelArgs::new();
        args.write(&mut q, 0, out_dtype)
            .read(x_buffer, rows.offset, x.dtype())
            .long(n_rows)
            .int(hidden)
            .long(row_stride)
            .read(scale_buffer, scale.offset(), DType::F32)
            .int(format)
            .int(i32::from(rounding.inverts_scale()));
        // SAFETY: the arguments follow the prototype above, each integer converted without loss by
        // `Rows::kernel_args`. x's rows lie inside its buffer (its layout was checked against its
        // storage, and the rows come from that layout); the scale is one f32 element at its
        // offset; `q` holds n_rows · hidden bytes, written densely, and is held only here.
        unsafe { R::launch(&queue, &kernel, quant_grid::<R>(&rows), args) }?;
    }
    compact(q, out_dtype, x.shape())
}

/// `dynamic_per_token_scaled_fp8_quant` on runtime `R`: fresh compact `(q, scales)`, one group per
/// row. The kernel is `dynamic_per_token_scaled_fp8_quant_<dtype>(unsigned char* q, float* scales,
/// const elem_t* x, long long n_rows, int hidden, long long x_row_stride, const float* scale_ub,
/// int has_ub, int format)`, or its 16-byte form.
pub fn run_dynamic_quant<R: GpuRuntime>(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let format = fp8_format_code(out_dtype)?;
    let QuantStart::<R> { rows, x: x_buffer, queue, mut q, vectorized } = QuantStart::new(x, out_dtype)?;
    if rows.hidden == 0 && rows.n_rows > 0 {
        // No element to reduce: every scale is the floor.
        return Ok((compact(q, out_dtype, x.shape())?, floor_scales(x, out_dtype)?));
    }
    let mut scales = R::allocate(x_buffer, &queue, rows.n_rows * DType::F32.size_in_bytes())?;
    if rows.n_rows > 0 {
        let ub_buffer = scale_ub.map(|t| device_buffer::<R::Buffer>(t, "scale_ub", R::MEMORY)).transpose()?;
        let kernel = DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT.name;
        let kernel = R::kernel(x_buffer, KernelKey::Quant { kernel, dtype: x.dtype(), vectorized })?;
        let RowArgs { n_rows, hidden, row_stride, .. } = rows.kernel_args()?;
        // The kernel walks the row in block steps with a 32-bit index.
        stepped_extent(rows.hidden, "hidden size", R::QUANT_GROUP)?;
        let mut args = KernelArgs::new();
        args.write(&mut q, 0, out_dtype)
            .write(&mut scales, 0, DType::F32)
            .read(x_buffer, rows.offset, x.dtype())
            .long(n_rows)
            .int(hidden)
            .long(row_stride);
        match (ub_buffer, scale_ub) {
            (Some(buffer), Some(ub)) => args.read(buffer, ub.offset(), DType::F32),
            _ => args.null(),
        };
        args.int(i32::from(scale_ub.is_some())).int(format);
        // SAFETY: as in `run_static_quant`; `scales` holds n_rows f32 values, one written per row,
        // and `scale_ub` is read only when `has_ub` is 1.
        unsafe { R::launch(&queue, &kernel, quant_grid::<R>(&rows), args) }?;
    }
    let scales = compact(scales, DType::F32, &per_token_scales_shape(x.shape()))?;
    Ok((compact(q, out_dtype, x.shape())?, scales))
}

/// The four norm + quantization ops on runtime `R`: fresh compact outputs, one group per row. The
/// kernel is `norm_quant_<dtype>(unsigned char* q, float* scales, elem_t* residual_out, const
/// elem_t* x, const elem_t* r, const elem_t* w, long long n_rows, int hidden, long long
/// x_row_stride, long long r_row_stride, long long out_row_stride, compute_t eps, const float*
/// scale, int has_residual, int has_weight, int dynamic, int has_scale, int format, int round_sum, int
/// invert)`, or its 16-byte form when x's, the residual's and the residual output's rows, the weight
/// and q all allow it; with a weight of another dtype, `norm_quant_w<weight>_<dtype>` (the same
/// prototype, `w` of the weight's type, read element by element). `round_sum` and `invert` are the call's `rounding = "dtype"`: the norm of
/// the sum rounded to x's dtype (16-bit x with a residual), a static scale's reciprocal.
pub fn run_norm_quant<R: GpuRuntime>(call: NormQuantCall<'_>) -> Result<NormQuantOutputs, KernelError> {
    let NormQuantCall { x, mut residual, weight, epsilon, scale, dynamic, out_dtype, rounding } = call;
    let round_sum = residual.is_some() && rounding.rounds_intermediates(x.dtype());
    let invert = !dynamic && rounding.inverts_scale();
    let format = fp8_format_code(out_dtype)?;
    let dtype = x.dtype();
    let QuantStart::<R> { rows, x: x_buffer, queue, mut q, vectorized } = QuantStart::new(x, out_dtype)?;
    let mut residual_out = match &residual {
        Some(NormQuantResidual::Read(_)) => Some(R::allocate(x_buffer, &queue, x.numel() * dtype.size_in_bytes())?),
        _ => None,
    };
    let mut scales = if dynamic { Some(R::allocate(x_buffer, &queue, rows.n_rows * 4)?) } else { None };
    if rows.n_rows > 0 && rows.hidden > 0 {
        let residual_rows = residual.as_ref().map(|r| Rows::for_kernel(r.tensor().meta())).transpose()?;
        let weight_buffer = weight.map(|w| device_buffer::<R::Buffer>(w, "weight", R::MEMORY)).transpose()?;
        let scale_param = if dynamic { "scale_ub" } else { "scale" };
        let scale_buffer = scale.map(|s| device_buffer::<R::Buffer>(s, scale_param, R::MEMORY)).transpose()?;
        // The 16-byte kernel also loads the residual's rows and the weight, and stores the residual
        // output's rows (in place: the residual's), each of which must start aligned.
        let vectorized = vectorized
            && residual.as_ref().zip(residual_rows).is_none_or(|(r, r_rows)| {
                device_buffer::<R::Buffer>(r.tensor(), "x_residual", R::MEMORY)
                    .is_ok_and(|buffer| vector_ok(&r_rows, dtype, R::base_alignment(buffer)))
            })
            && residual_out.as_ref().is_none_or(|out| base_aligned(R::base_alignment(out)))
            && weight.zip(weight_buffer).is_none_or(|(w, buffer)| {
                // A weight of another dtype is read element by element.
                let w_rows = Rows { n_rows: 1, hidden: rows.hidden, row_stride: rows.hidden, offset: w.offset() };
                w.dtype() != dtype || vector_ok(&w_rows, dtype, R::base_alignment(buffer))
            });
        let weight_dtype = weight.map(Tensor::dtype);
        let kernel = norm_quant_kernel(dtype, weight_dtype).ok_or_else(|| KernelError::InvalidArguments {
            reason: format!("no norm + quantization kernel takes a {} weight", weight_dtype.unwrap_or(dtype)),
        })?;
        let key = KernelKey::Quant { kernel, dtype, vectorized };
        let kernel = R::kernel(x_buffer, key)?;
        let RowArgs { n_rows, hidden, row_stride: x_stride, .. } = rows.kernel_args()?;
        // The kernel walks the row in block steps with a 32-bit index.
        stepped_extent(rows.hidden, "hidden size", R::QUANT_GROUP)?;
        let r_stride = residual_rows.map(|r| r.kernel_args()).transpose()?.map_or(0, |r| r.row_stride);
        let flags = [residual.is_some(), weight.is_some(), dynamic, scale.is_some()].map(i32::from);
        let mut args = KernelArgs::new();
        args.write(&mut q, 0, out_dtype);
        match scales.as_mut() {
            Some(scales) => args.write(scales, 0, DType::F32),
            None => args.null(),
        };
        // A fresh residual output is compact; in place, the sum goes into the residual's own rows
        // (argument 4, `r`).
        let out_stride = match (residual_out.as_mut(), residual.is_some()) {
            (Some(out), _) => {
                args.write(out, 0, dtype);
                i64::from(hidden)
            }
            (None, true) => {
                args.alias(4);
                r_stride
            }
            (None, false) => {
                args.null();
                0
            }
        };
        args.read(x_buffer, rows.offset, dtype);
        match (&mut residual, residual_rows) {
            (Some(NormQuantResidual::Read(r)), Some(r_rows)) => {
                args.read(device_buffer::<R::Buffer>(r, "x_residual", R::MEMORY)?, r_rows.offset, dtype)
            }
            (Some(NormQuantResidual::InPlace(r)), Some(r_rows)) => {
                args.write(device_buffer_mut::<R::Buffer>(r, "x_residual", R::MEMORY)?, r_rows.offset, dtype)
            }
            _ => args.null(),
        };
        match (weight_buffer, weight) {
            (Some(buffer), Some(w)) => args.read(buffer, w.offset(), w.dtype()),
            _ => args.null(),
        };
        args.long(n_rows).int(hidden).long(x_stride).long(r_stride).long(out_stride);
        args.compute(ComputeScalar::new(dtype, epsilon));
        match (scale_buffer, scale) {
            (Some(buffer), Some(s)) => args.read(buffer, s.offset(), DType::F32),
            _ => args.null(),
        };
        for flag in flags {
            args.int(flag);
        }
        args.int(format).int(i32::from(round_sum)).int(i32::from(invert));
        // SAFETY: the arguments follow the prototype above, each integer converted without loss by
        // `Rows::kernel_args`. x's and the residual's rows lie inside their buffers (their layouts
        // were checked against their storage); the weight holds `hidden` unit-stride elements of
        // x's dtype from its offset (the predicate); the scale is one f32 element. `q` holds
        // n_rows · hidden elements written densely, `scales` n_rows; the residual output is a fresh
        // compact buffer of n_rows · hidden elements or, in place, the residual's own rows
        // (uniquely owned: the call's activation, passed as written; each element read before the
        // same thread writes it, only in the last pass). A null buffer is never dereferenced: its
        // flag is 0.
        unsafe { R::launch(&queue, &kernel, quant_grid::<R>(&rows), args) }?;
    }
    let residual_out = residual_out.map(|r| compact(r, dtype, x.shape())).transpose()?;
    let scales = match scales {
        Some(_) if rows.hidden == 0 && rows.n_rows > 0 => Some(floor_scales(x, out_dtype)?),
        Some(s) => Some(compact(s, DType::F32, &per_token_scales_shape(x.shape()))?),
        None => None,
    };
    Ok(NormQuantOutputs { q: compact(q, out_dtype, x.shape())?, scales, residual_out })
}

/// The norm + quantization kernel's name ([`QUANT_KERNELS`]' last).
pub const NORM_QUANT_KERNEL: &str = QUANT_KERNELS[2];
