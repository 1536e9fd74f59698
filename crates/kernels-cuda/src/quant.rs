//! fp8 quantization on CUDA: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! One NVRTC program per input dtype, `kernels/quant.cu` after the element prelude, holding both
//! kernels; the fp8 format is a kernel argument. Scales stay on the device: the kernels read them
//! there, so a call never waits for the host.

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use ir_core::storage::Storage;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Layout, Registry, RegistryError, Tensor, TensorError};
use ir_ops::dynamic_per_token_scaled_fp8_quant::{self, DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT};
use ir_ops::static_scaled_fp8_quant::{self, STATIC_SCALED_FP8_QUANT};
use kernel_support::{
    ComputeScalar, NormQuantCall, NormQuantOutputs, NormQuantResidual, RowArgs, Rows, device_buffer, device_buffer_mut,
    floor_scales, fp8_format_code, per_token_scales_shape, quant_support_with,
};

use crate::device::{CudaBuffer, driver_error};
use crate::launch::arg_compute;
use crate::module::{ELEMENT, compile, dtype_define};

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
        let grid = u32::try_from(self.rows.n_rows)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| KernelError::GridLimit { what: "rows", count: self.rows.n_rows })?;
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
        // No element to reduce: every scale is the floor.
        return Ok((launch.into_q(x, out_dtype)?, floor_scales(x, out_dtype)?));
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

/// Runs the norm + quantization kernel: fresh compact outputs; the launch is asynchronous.
fn norm_quant(call: NormQuantCall<'_>) -> Result<NormQuantOutputs, KernelError> {
    let NormQuantCall { x, mut residual, weight, epsilon, scale, dynamic, out_dtype } = call;
    let format = fp8_format_code(out_dtype)?;
    let mut launch = Launch::new(x, out_dtype)?;
    let rows = launch.rows;
    let dtype = x.dtype();
    let size = dtype.size_in_bytes();
    let stream = Arc::clone(&launch.stream);
    let device = Arc::clone(&launch.x.device);
    let mut residual_out = match &residual {
        Some(NormQuantResidual::Read(_)) => {
            Some(device.allocate_on(&stream, x.numel() * size).map_err(TensorError::from)?)
        }
        _ => None,
    };
    let mut scales =
        if dynamic { Some(device.allocate_on(&stream, rows.n_rows * 4).map_err(TensorError::from)?) } else { None };
    let scales_shape = per_token_scales_shape(x.shape());
    if !launch.is_empty() {
        let residual_rows = residual.as_ref().map(|r| Rows::for_kernel(r.tensor().meta())).transpose()?;
        let has_residual = residual.is_some();
        // The residual's buffer: read, or read and written in place (through its write guard).
        let (residual_read, residual_written) = match &mut residual {
            Some(NormQuantResidual::Read(r)) => (Some(device_buffer::<CudaBuffer>(r, "x_residual", "CUDA")?), None),
            Some(NormQuantResidual::InPlace(r)) => {
                (None, Some(device_buffer_mut::<CudaBuffer>(r, "x_residual", "CUDA")?))
            }
            None => (None, None),
        };
        let weight_buffer = weight.map(|w| device_buffer::<CudaBuffer>(w, "weight", "CUDA")).transpose()?;
        let scale_param = if dynamic { "scale_ub" } else { "scale" };
        let scale_buffer = scale.map(|s| device_buffer::<CudaBuffer>(s, scale_param, "CUDA")).transpose()?;
        let arch = device.arch;
        let function =
            device.op_function("norm_quant", dtype, &format!("norm_quant_{dtype}"), || compile_ptx(dtype, arch))?;
        let config = launch.config()?;
        let RowArgs { n_rows, hidden, row_stride: x_stride, .. } = rows.kernel_args()?;
        let r_stride = residual_rows.map(|r| r.kernel_args()).transpose()?.map_or(0, |r| r.row_stride);
        let eps = ComputeScalar::new(dtype, epsilon);
        let flags = [has_residual, weight.is_some(), dynamic, scale.is_some()].map(i32::from);
        let x_address = launch.x.read_address(&stream);
        let r_address = match (residual_read, residual_written) {
            (Some(b), _) => Some(b.read_address(&stream)),
            (None, Some(b)) => Some(b.write_address(&stream)),
            _ => None,
        };
        let w_address = weight_buffer.map(|b| b.read_address(&stream));
        let s_address = scale_buffer.map(|b| b.read_address(&stream));
        let q_address = launch.q.write_address(&stream);
        let scales_address = scales.as_mut().map(|b| b.write_address(&stream));
        let out_address = residual_out.as_mut().map(|b| b.write_address(&stream));
        // Absent tensors are null: the kernel's flags keep it from reading or writing them.
        let x_ptr = x_address.offset(rows.offset * size);
        let r_ptr = match (&r_address, residual_rows) {
            (Some(address), Some(r_rows)) => address.offset(r_rows.offset * size),
            _ => 0,
        };
        let w_ptr = match (&w_address, weight) {
            (Some(address), Some(w)) => address.offset(w.offset() * size),
            _ => 0,
        };
        let s_ptr = match (&s_address, scale) {
            (Some(address), Some(s)) => address.offset(s.offset() * 4),
            _ => 0,
        };
        let scales_ptr = scales_address.as_ref().map_or(0, |a| a.ptr);
        // A fresh residual output is compact; in place, the sum goes into the residual's own rows.
        let (out_ptr, out_stride) = match &out_address {
            Some(address) => (address.ptr, i64::from(hidden)),
            None if has_residual => (r_ptr, r_stride),
            None => (0, 0),
        };
        let mut builder = stream.launch_builder(&function);
        // norm_quant_<dtype>(unsigned char* q, float* scales, elem_t* residual_out, const elem_t* x,
        //     const elem_t* r, const elem_t* w, long long n_rows, int hidden, long long x_row_stride,
        //     long long r_row_stride, long long out_row_stride, compute_t eps, const float* scale,
        //     int has_residual, int has_weight, int dynamic, int has_scale, int format)
        builder.arg(&q_address.ptr).arg(&scales_ptr).arg(&out_ptr).arg(&x_ptr).arg(&r_ptr).arg(&w_ptr);
        builder.arg(&n_rows).arg(&hidden).arg(&x_stride).arg(&r_stride).arg(&out_stride);
        arg_compute(&mut builder, &eps);
        builder.arg(&s_ptr);
        builder.arg(&flags[0]).arg(&flags[1]).arg(&flags[2]).arg(&flags[3]).arg(&format);
        // SAFETY: the arguments follow the kernel's prototype above, each integer converted without
        // loss by `Rows::kernel_args`. x's and the residual's addresses cover every element their
        // rows reach (their layouts were checked against their storage); the weight holds `hidden`
        // unit-stride elements from its offset (the predicate); the scale points at its one f32
        // element. `q` was allocated for n_rows · hidden elements written densely, `scales` for
        // n_rows; the residual output is a fresh compact buffer of n_rows · hidden elements or, in
        // place, the residual's own rows (uniquely owned: the call's activation; each element read
        // before the same thread writes it, only in the last pass). A null pointer is never
        // dereferenced: its flag is 0. The launch is on the call's stream; the address guards
        // record every use for cudarc's ordering.
        unsafe { builder.launch(config) }.map_err(driver_error)?;
    }
    let residual_out = residual_out
        .map(|r| Tensor::from_storage(Storage::Device(Box::new(r)), dtype, Layout::compact(x.shape())))
        .transpose()?;
    let scales = match scales {
        Some(_) if rows.hidden == 0 && rows.n_rows > 0 => Some(floor_scales(x, out_dtype)?),
        Some(s) => {
            Some(Tensor::from_storage(Storage::Device(Box::new(s)), DType::F32, Layout::compact(&scales_shape))?)
        }
        None => None,
    };
    Ok(NormQuantOutputs { q: launch.into_q(x, out_dtype)?, scales, residual_out })
}
