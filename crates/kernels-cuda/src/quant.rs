//! fp8 quantization on CUDA: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! One NVRTC program per input dtype, `kernels/quant.cu` after the element prelude, holding both
//! kernels; the fp8 format is a kernel argument. Scales stay on the device: the kernels read them
//! there, so a call never waits for the host.

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use ir_core::kernel::{RowArgs, Rows, device_buffer, fp8_format_code, per_token_scales_shape, quant_support};
use ir_core::op::dynamic_per_token_scaled_fp8_quant::{self, DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT};
use ir_core::op::static_scaled_fp8_quant::{self, STATIC_SCALED_FP8_QUANT};
use ir_core::storage::Storage;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Layout, Registry, RegistryError, Tensor, TensorError};

use crate::device::{CudaBuffer, driver_error};
use crate::module::{ELEMENT, compile, dtype_define};

/// The quantization kernels' source (after the element prelude).
pub const QUANT: &str = include_str!("../kernels/quant.cu");

/// Threads per block (`QUANT_BLOCK` in `quant.cu`): one block per row.
pub const QUANT_BLOCK: u32 = 256;

/// The ops of this module, each a kernel `<op>_<dtype>` of the one program.
pub const QUANT_OPS: [&str; 2] = [STATIC_SCALED_FP8_QUANT.name, DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT.name];

/// Compiles the quantization program for input `dtype` to PTX for `arch`.
pub fn compile_ptx(dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile(&format!("{ELEMENT}\n{QUANT}"), "quant.cu", format!("quant_{dtype}"), vec![dtype_define(dtype)?], arch)
}

/// Registers both quantization ops.
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || {
        ImplSpec::new(crate::PROVIDER)
            .with_probe(crate::availability)
            .with_supports(|args| quant_support(args, DeviceKind::Cuda))
    };
    static_scaled_fp8_quant::register(registry, spec(), static_scaled_fp8_quant_cuda)?;
    dynamic_per_token_scaled_fp8_quant::register(registry, spec(), dynamic_per_token_scaled_fp8_quant_cuda)
}

/// x's rows, buffer and call stream, and the fresh q buffer on that stream.
struct Launch<'a> {
    rows: Rows,
    x: &'a CudaBuffer,
    stream: Arc<CudaStream>,
    q: CudaBuffer,
}

impl<'a> Launch<'a> {
    fn new(x: &'a Tensor, out_dtype: DType) -> Result<Launch<'a>, KernelError> {
        let rows = Rows::for_kernel(x.meta())?;
        let x_buffer = device_buffer::<CudaBuffer>(x, "x", "CUDA")?;
        let stream = x_buffer.call_stream()?;
        let q =
            x_buffer.device.allocate_on(&stream, x.numel() * out_dtype.size_in_bytes()).map_err(TensorError::from)?;
        Ok(Launch { rows, x: x_buffer, stream, q })
    }

    fn is_empty(&self) -> bool {
        self.rows.n_rows == 0 || self.rows.hidden == 0
    }

    fn function(&self, op: &'static str, dtype: DType) -> Result<cudarc::driver::CudaFunction, KernelError> {
        let arch = self.x.device.arch;
        self.x.device.op_function(op, dtype, &format!("{op}_{dtype}"), || compile_ptx(dtype, arch))
    }

    fn config(&self) -> Result<LaunchConfig, KernelError> {
        let grid = u32::try_from(self.rows.n_rows).ok().filter(|&g| g <= i32::MAX as u32).ok_or_else(|| {
            KernelError::InvalidArguments { reason: format!("{} rows exceed the grid limit", self.rows.n_rows) }
        })?;
        Ok(LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (QUANT_BLOCK, 1, 1), shared_mem_bytes: 0 })
    }

    fn into_q(self, x: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
        Ok(Tensor::from_storage(Storage::Device(Box::new(self.q)), out_dtype, Layout::compact(x.shape()))?)
    }
}

/// `static_scaled_fp8_quant` on CUDA: a fresh compact output in `out_dtype`; the launch is asynchronous.
pub fn static_scaled_fp8_quant_cuda(x: &Tensor, scale: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
    let format = fp8_format_code(out_dtype)?;
    let mut launch = Launch::new(x, out_dtype)?;
    if !launch.is_empty() {
        let scale_buffer = device_buffer::<CudaBuffer>(scale, "scale", "CUDA")?;
        let function = launch.function(STATIC_SCALED_FP8_QUANT.name, x.dtype())?;
        let config = launch.config()?;
        let rows = launch.rows;
        let RowArgs { n_rows, hidden, row_stride: x_stride, .. } = rows.kernel_args()?;
        let stream = Arc::clone(&launch.stream);
        let x_address = launch.x.read_address(&stream);
        let scale_address = scale_buffer.read_address(&stream);
        let q_address = launch.q.write_address(&stream);
        let x_ptr = x_address.offset(rows.offset * x.dtype().size_in_bytes());
        let scale_ptr = scale_address.offset(scale.offset() * 4);
        let mut builder = stream.launch_builder(&function);
        // static_scaled_fp8_quant_<dtype>(unsigned char* q, const elem_t* x, long long n_rows,
        //     int hidden, long long x_row_stride, const float* scale, int format)
        builder.arg(&q_address.ptr).arg(&x_ptr).arg(&n_rows).arg(&hidden).arg(&x_stride).arg(&scale_ptr).arg(&format);
        // SAFETY: the arguments follow the kernel's prototype above, each integer converted without
        // loss by `Rows::kernel_args`. x's address covers every element the rows reach (its layout was
        // checked against its storage, and the rows come from that layout); the scale's address
        // points at its one f32 element likewise; `q` was allocated for n_rows · hidden bytes,
        // written densely. The kernel writes only `q`. The launch is on the call's stream, where `q`
        // was allocated; the address guards record the uses for cudarc's ordering.
        unsafe { builder.launch(config) }.map_err(driver_error)?;
    }
    launch.into_q(x, out_dtype)
}

/// `dynamic_per_token_scaled_fp8_quant` on CUDA: fresh compact `(q, scales)`; the launch is asynchronous.
pub fn dynamic_per_token_scaled_fp8_quant_cuda(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let format = fp8_format_code(out_dtype)?;
    let mut launch = Launch::new(x, out_dtype)?;
    let scales_shape = per_token_scales_shape(x.shape());
    let rows = launch.rows;
    if rows.hidden == 0 && rows.n_rows > 0 {
        // No element to reduce: every scale is the floor, as native computes it.
        let floor = f64::from(ir_core::op::quant::min_scale(out_dtype));
        let scales = Tensor::from_f64(DType::F32, &scales_shape, &vec![floor; rows.n_rows])?.to_device_of(x)?;
        return Ok((launch.into_q(x, out_dtype)?, scales));
    }
    let mut scales = launch.x.device.allocate_on(&launch.stream, rows.n_rows * 4).map_err(TensorError::from)?;
    if !launch.is_empty() {
        let ub_buffer = scale_ub.map(|t| device_buffer::<CudaBuffer>(t, "scale_ub", "CUDA")).transpose()?;
        let function = launch.function(DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT.name, x.dtype())?;
        let config = launch.config()?;
        let RowArgs { n_rows, hidden, row_stride: x_stride, .. } = rows.kernel_args()?;
        let has_ub = i32::from(ub_buffer.is_some());
        let stream = Arc::clone(&launch.stream);
        let x_address = launch.x.read_address(&stream);
        let ub_address = ub_buffer.map(|b| b.read_address(&stream));
        let q_address = launch.q.write_address(&stream);
        let scales_address = scales.write_address(&stream);
        let x_ptr = x_address.offset(rows.offset * x.dtype().size_in_bytes());
        // Without a bound the kernel never reads `scale_ub`; the scales' address stands in.
        let ub_ptr = match (&ub_address, scale_ub) {
            (Some(address), Some(t)) => address.offset(t.offset() * 4),
            _ => scales_address.ptr,
        };
        let mut builder = stream.launch_builder(&function);
        // dynamic_per_token_scaled_fp8_quant_<dtype>(unsigned char* q, float* scales, const elem_t* x,
        //     long long n_rows, int hidden, long long x_row_stride, const float* scale_ub, int has_ub,
        //     int format)
        builder.arg(&q_address.ptr).arg(&scales_address.ptr).arg(&x_ptr).arg(&n_rows).arg(&hidden).arg(&x_stride);
        builder.arg(&ub_ptr).arg(&has_ub).arg(&format);
        // SAFETY: as in `static_scaled_fp8_quant_cuda`; `scales` holds n_rows f32 values, one
        // written per row, and `scale_ub` is read only when `has_ub` is 1.
        unsafe { builder.launch(config) }.map_err(driver_error)?;
    }
    let scales = Tensor::from_storage(Storage::Device(Box::new(scales)), DType::F32, Layout::compact(&scales_shape))?;
    Ok((launch.into_q(x, out_dtype)?, scales))
}
