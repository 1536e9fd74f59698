//! fp8 quantization on the xpu: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! One program per input dtype, `kernels/quant.cl` after the element prelude, holding both kernels;
//! the fp8 format is a kernel argument. The scales stay on the device: the kernels read them there.

use std::sync::Arc;

use ir_core::kernel::{
    RowArgs, Rows, device_buffer, fp8_format_code, kernel_int, per_token_scales_shape, quant_support,
};
use ir_core::op::dynamic_per_token_scaled_fp8_quant;
use ir_core::op::static_scaled_fp8_quant;
use ir_core::storage::Storage;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Layout, Registry, RegistryError, Tensor, TensorError};
use opencl3::command_queue::CommandQueue;
use opencl3::kernel::ExecuteKernel;
use opencl3::memory::ClMem;

use crate::device::{XpuBuffer, cl_error};
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
            .with_supports(|args| quant_support(args, DeviceKind::Xpu))
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
            .ok_or_else(|| KernelError::InvalidArguments { reason: format!("{} rows exceed the grid", rows.n_rows) })?;
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
        // No element to reduce: every scale is the floor. Computed on the host like native's.
        let floor = f64::from(ir_core::op::quant::min_scale(out_dtype));
        let host = Tensor::from_f64(DType::F32, &scales_shape, &vec![floor; rows.n_rows])?;
        let scales = host.to_device_of(x)?;
        return Ok((launch.into_q(x, out_dtype)?, scales));
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
