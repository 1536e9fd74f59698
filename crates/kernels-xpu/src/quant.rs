//! fp8 quantization on the xpu: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! One program per input dtype, `kernels/quant.cl` after the element prelude, holding both kernels;
//! the fp8 format is a kernel argument. The scales stay on the device: the kernels read them there.

use std::sync::Arc;

use ir_core::storage::Storage;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Layout, Registry, RegistryError, Tensor, TensorError};
use ir_ops::dynamic_per_token_scaled_fp8_quant;
use ir_ops::static_scaled_fp8_quant;
use kernel_support::{
    ComputeScalar, NormQuantCall, NormQuantOutputs, NormQuantResidual, RowArgs, Rows, device_buffer, device_buffer_mut,
    floor_scales, fp8_format_code, kernel_int, per_token_scales_shape, quant_support_with,
};
use opencl3::command_queue::CommandQueue;
use opencl3::kernel::ExecuteKernel;
use opencl3::memory::ClMem;

use crate::device::{XpuBuffer, cl_error};
use crate::launch::set_compute;
use crate::module::ELEMENT;

/// The quantization kernels' source (after the element prelude).
pub const QUANT: &str = include_str!("../kernels/quant.cl");

/// Work-items per work-group (`QUANT_GROUP` in `quant.cl`): one group per row.
pub const QUANT_GROUP: usize = 128;

/// The program source of the quantization kernels: the element prelude, then `quant.cl`.
pub fn program() -> String {
    format!("{ELEMENT}\n{QUANT}")
}

/// Registers both quantization ops.
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || {
        ImplSpec::new(crate::PROVIDER)
            .with_probe(crate::availability)
            .with_platform_detection(crate::is_gpu)
            .with_supports(|args| quant_support_with(args, DeviceKind::Xpu, crate::kernel_dtypes()))
    };
    static_scaled_fp8_quant::register(registry, spec(), static_scaled_fp8_quant_xpu)?;
    dynamic_per_token_scaled_fp8_quant::register(registry, spec(), dynamic_per_token_scaled_fp8_quant_xpu)
}

/// What both kernels share: x's rows and buffer, the call's queue, and the fresh q buffer on it.
struct Launch<'a> {
    rows: Rows,
    x: &'a XpuBuffer,
    queue: Arc<CommandQueue>,
    q: XpuBuffer,
    global: usize,
}

impl<'a> Launch<'a> {
    fn new(x: &'a Tensor, out_dtype: DType) -> Result<Launch<'a>, KernelError> {
        let rows = Rows::for_kernel(x.meta())?;
        let x_buffer = device_buffer::<XpuBuffer>(x, "x", "xpu")?;
        let queue = x_buffer.call_queue()?;
        let q =
            x_buffer.device.allocate_on(&queue, x.numel() * out_dtype.size_in_bytes()).map_err(TensorError::from)?;
        let global = rows
            .n_rows
            .checked_mul(QUANT_GROUP)
            .ok_or_else(|| KernelError::GridLimit { what: "rows", count: rows.n_rows })?;
        Ok(Launch { rows, x: x_buffer, queue, q, global })
    }

    fn is_empty(&self) -> bool {
        self.rows.n_rows == 0 || self.rows.hidden == 0
    }

    /// A one-element scale's buffer and offset, ordered after its last use.
    fn scale(&self, scale: &'a Tensor, param: &str) -> Result<(&'a XpuBuffer, i64), KernelError> {
        let buffer = device_buffer::<XpuBuffer>(scale, param, "xpu")?;
        buffer.use_on(&self.queue)?;
        Ok((buffer, kernel_int(scale.offset(), "scale offset")?))
    }

    fn kernel(
        &self,
        op: &'static str,
        dtype: DType,
    ) -> Result<Arc<std::sync::Mutex<opencl3::kernel::Kernel>>, KernelError> {
        self.x.use_on(&self.queue)?;
        self.x.device.op_kernel(op, dtype, &format!("{op}_{dtype}"), program)
    }

    fn into_q(self, x: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
        let layout = Layout::compact(x.shape());
        Ok(Tensor::from_storage(Storage::Device(Box::new(self.q)), out_dtype, layout)?)
    }
}

/// `static_scaled_fp8_quant` on `xpu:0`: a fresh compact output in `out_dtype`.
pub fn static_scaled_fp8_quant_xpu(x: &Tensor, scale: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
    let format = fp8_format_code(out_dtype)?;
    let launch = Launch::new(x, out_dtype)?;
    if !launch.is_empty() {
        let (scale_buffer, scale_offset) = launch.scale(scale, "scale")?;
        let kernel = launch.kernel(static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT.name, x.dtype())?;
        let kernel = kernel.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let rows = launch.rows;
        let (q_mem, x_mem, scale_mem) = (launch.q.buffer.get(), launch.x.buffer.get(), scale_buffer.buffer.get());
        let RowArgs { n_rows, hidden, row_stride: x_stride, offset: x_offset } = rows.kernel_args()?;
        // static_scaled_fp8_quant_<dtype>(q, x, long n_rows, int hidden, long x_row_stride,
        //                                  long x_offset, scale, long scale_offset, int format)
        // SAFETY: the arguments follow the kernel's prototype above, with the types it declares, each
        // integer converted without loss by `Rows::kernel_args`; x's rows lie inside its buffer (its layout
        // was checked against its storage, and the rows come from that layout); q holds n_rows ·
        // hidden bytes, written densely; the scale's element lies inside its buffer likewise.
        unsafe {
            ExecuteKernel::new(&kernel)
                .set_arg(&q_mem)
                .set_arg(&x_mem)
                .set_arg(&n_rows)
                .set_arg(&hidden)
                .set_arg(&x_stride)
                .set_arg(&x_offset)
                .set_arg(&scale_mem)
                .set_arg(&scale_offset)
                .set_arg(&format)
                .set_global_work_size(launch.global)
                .set_local_work_size(QUANT_GROUP)
                .enqueue_nd_range(&launch.queue)
        }
        .map_err(cl_error)?;
    }
    launch.into_q(x, out_dtype)
}

/// `dynamic_per_token_scaled_fp8_quant` on `xpu:0`: fresh compact `(q, scales)`.
pub fn dynamic_per_token_scaled_fp8_quant_xpu(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let format = fp8_format_code(out_dtype)?;
    let launch = Launch::new(x, out_dtype)?;
    let scales_shape = per_token_scales_shape(x.shape());
    let rows = launch.rows;
    if rows.hidden == 0 && rows.n_rows > 0 {
        // No element to reduce: every scale is the floor.
        return Ok((launch.into_q(x, out_dtype)?, floor_scales(x, out_dtype)?));
    }
    let scales = launch.x.device.allocate_on(&launch.queue, rows.n_rows * 4).map_err(TensorError::from)?;
    if !launch.is_empty() {
        let ub = scale_ub.map(|t| launch.scale(t, "scale_ub")).transpose()?;
        let kernel =
            launch.kernel(dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT.name, x.dtype())?;
        let kernel = kernel.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (q_mem, scales_mem, x_mem) = (launch.q.buffer.get(), scales.buffer.get(), launch.x.buffer.get());
        // Without a bound the kernel never reads `scale_ub`; any buffer of the context stands in.
        let (ub_mem, ub_offset, has_ub) = match ub {
            Some((buffer, offset)) => (buffer.buffer.get(), offset, 1i32),
            None => (scales_mem, 0i64, 0i32),
        };
        let RowArgs { n_rows, hidden, row_stride: x_stride, offset: x_offset } = rows.kernel_args()?;
        // dynamic_per_token_scaled_fp8_quant_<dtype>(q, scales, x, long n_rows, int hidden,
        //     long x_row_stride, long x_offset, scale_ub, long ub_offset, int has_ub, int format)
        // SAFETY: as in `static_scaled_fp8_quant_xpu`; `scales` holds n_rows f32 values, one
        // written per row, and `scale_ub` is read only when `has_ub` is 1.
        unsafe {
            ExecuteKernel::new(&kernel)
                .set_arg(&q_mem)
                .set_arg(&scales_mem)
                .set_arg(&x_mem)
                .set_arg(&n_rows)
                .set_arg(&hidden)
                .set_arg(&x_stride)
                .set_arg(&x_offset)
                .set_arg(&ub_mem)
                .set_arg(&ub_offset)
                .set_arg(&has_ub)
                .set_arg(&format)
                .set_global_work_size(launch.global)
                .set_local_work_size(QUANT_GROUP)
                .enqueue_nd_range(&launch.queue)
        }
        .map_err(cl_error)?;
    }
    let scales = Tensor::from_storage(Storage::Device(Box::new(scales)), DType::F32, Layout::compact(&scales_shape))?;
    Ok((launch.into_q(x, out_dtype)?, scales))
}

/// The norm + quantization kernel's source (after the element prelude and `quant.cl`).
pub const NORM_QUANT: &str = include_str!("../kernels/norm_quant.cl");

/// The program source of the norm + quantization kernel.
pub fn norm_quant_program() -> String {
    format!("{ELEMENT}\n{QUANT}\n{NORM_QUANT}")
}

/// Registers the four norm + quantization ops.
pub(crate) fn register_fused(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || ImplSpec::new(crate::PROVIDER).with_probe(crate::availability).with_platform_detection(crate::is_gpu);
    kernel_support::register_norm_quant_ops(registry, DeviceKind::Xpu, crate::kernel_dtypes, spec, norm_quant)
}

/// Runs the norm + quantization kernel: fresh compact outputs, and the residual output fresh or
/// written into the residual in place.
fn norm_quant(call: NormQuantCall<'_>) -> Result<NormQuantOutputs, KernelError> {
    let NormQuantCall { x, mut residual, weight, epsilon, scale, dynamic, out_dtype } = call;
    let format = fp8_format_code(out_dtype)?;
    let launch = Launch::new(x, out_dtype)?;
    let rows = launch.rows;
    let dtype = x.dtype();
    let device = &launch.x.device;
    let residual_out = match &residual {
        Some(NormQuantResidual::Read(_)) => {
            Some(device.allocate_on(&launch.queue, x.numel() * dtype.size_in_bytes()).map_err(TensorError::from)?)
        }
        _ => None,
    };
    let scales = if dynamic {
        Some(device.allocate_on(&launch.queue, rows.n_rows * 4).map_err(TensorError::from)?)
    } else {
        None
    };
    if !launch.is_empty() {
        let residual_rows = residual.as_ref().map(|r| Rows::for_kernel(r.tensor().meta())).transpose()?;
        // The residual's buffer: read only, or read and written (then it is also the output).
        let residual_buffer: Option<&XpuBuffer> = match &mut residual {
            Some(NormQuantResidual::Read(r)) => Some(device_buffer::<XpuBuffer>(r, "x_residual", "xpu")?),
            Some(NormQuantResidual::InPlace(r)) => Some(&*device_buffer_mut::<XpuBuffer>(r, "x_residual", "xpu")?),
            None => None,
        };
        let weight_buffer = weight.map(|w| device_buffer::<XpuBuffer>(w, "weight", "xpu")).transpose()?;
        for buffer in residual_buffer.iter().chain(weight_buffer.iter()) {
            buffer.use_on(&launch.queue)?;
        }
        let scale = scale.map(|s| launch.scale(s, if dynamic { "scale_ub" } else { "scale" })).transpose()?;
        let kernel =
            launch.x.device.op_kernel("norm_quant", dtype, &format!("norm_quant_{dtype}"), norm_quant_program)?;
        launch.x.use_on(&launch.queue)?;
        let kernel = kernel.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let RowArgs { n_rows, hidden, row_stride: x_stride, offset: x_offset } = rows.kernel_args()?;
        let residual_args = residual_rows.map(|r| r.kernel_args()).transpose()?;
        let (r_stride, r_offset) = residual_args.map_or((0, 0), |r| (r.row_stride, r.offset));
        let w_offset: i64 = kernel_int(weight.map_or(0, Tensor::offset), "weight offset")?;
        let eps = ComputeScalar::new(x.dtype(), epsilon);
        // Absent tensors are never read; buffers of the call stand in for them.
        let q_mem = launch.q.buffer.get();
        let x_mem = launch.x.buffer.get();
        let scales_mem = scales.as_ref().map_or(q_mem, |s| s.buffer.get());
        let r_mem = residual_buffer.map_or(x_mem, |r| r.buffer.get());
        // A fresh residual output is compact; in place, the sum goes into the residual's own rows.
        let (out_mem, out_stride, out_offset) = match &residual_out {
            Some(out) => (out.buffer.get(), i64::from(hidden), 0i64),
            None if residual_buffer.is_some() => (r_mem, r_stride, r_offset),
            None => (q_mem, 0, 0),
        };
        let w_mem = weight_buffer.map_or(x_mem, |w| w.buffer.get());
        let (scale_mem, scale_offset) = scale.map_or((q_mem, 0), |(b, offset)| (b.buffer.get(), offset));
        let has_residual = i32::from(residual_buffer.is_some());
        let has_weight = i32::from(weight.is_some());
        let is_dynamic = i32::from(dynamic);
        let has_scale = i32::from(scale.is_some());
        // norm_quant_<dtype>(q, scales, residual_out, x, r, w, long n_rows, int hidden,
        //     long x_row_stride, long x_offset, long r_row_stride, long r_offset, long out_row_stride,
        //     long out_offset, long w_offset, compute_t eps, scale, long scale_offset, int has_residual,
        //     int has_weight, int dynamic, int has_scale, int format)
        // SAFETY: the arguments follow the kernel's prototype above, with the types it declares,
        // each integer converted without loss (`Rows::kernel_args`, `kernel_int`). x's and the
        // residual's rows lie inside their buffers (their layouts were checked against their
        // storage, and the rows come from those layouts); the weight holds `hidden` unit-stride
        // elements from its offset (the predicate); the scale points at its one f32 element. `q`
        // holds n_rows · hidden elements written densely, `scales` n_rows; the residual output is
        // a fresh compact buffer of n_rows · hidden elements or, in place, the residual's own rows
        // (uniquely owned: the call's activation), each element read before the same work-item
        // writes it, and only in the last pass. A flag of 0 keeps the kernel from touching the
        // stand-in buffer it guards.
        unsafe {
            let mut execute = ExecuteKernel::new(&kernel);
            let execute = execute
                .set_arg(&q_mem)
                .set_arg(&scales_mem)
                .set_arg(&out_mem)
                .set_arg(&x_mem)
                .set_arg(&r_mem)
                .set_arg(&w_mem)
                .set_arg(&n_rows)
                .set_arg(&hidden)
                .set_arg(&x_stride)
                .set_arg(&x_offset)
                .set_arg(&r_stride)
                .set_arg(&r_offset)
                .set_arg(&out_stride)
                .set_arg(&out_offset)
                .set_arg(&w_offset);
            set_compute(execute, &eps)
                .set_arg(&scale_mem)
                .set_arg(&scale_offset)
                .set_arg(&has_residual)
                .set_arg(&has_weight)
                .set_arg(&is_dynamic)
                .set_arg(&has_scale)
                .set_arg(&format)
                .set_global_work_size(launch.global)
                .set_local_work_size(QUANT_GROUP)
                .enqueue_nd_range(&launch.queue)
        }
        .map_err(cl_error)?;
    }
    let compact = || Layout::compact(x.shape());
    let residual_out =
        residual_out.map(|r| Tensor::from_storage(Storage::Device(Box::new(r)), dtype, compact())).transpose()?;
    let scales = match scales {
        Some(_) if rows.hidden == 0 && rows.n_rows > 0 => Some(floor_scales(x, out_dtype)?),
        Some(s) => Some(Tensor::from_storage(
            Storage::Device(Box::new(s)),
            DType::F32,
            Layout::compact(&per_token_scales_shape(x.shape())),
        )?),
        None => None,
    };
    Ok(NormQuantOutputs { q: launch.into_q(x, out_dtype)?, scales, residual_out })
}
