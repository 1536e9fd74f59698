//! The gated activations (`silu_and_mul`, `gelu_and_mul`, …) on CUDA.
//!
//! Each op is one kernel source `kernels/<op>.cu` and one line of [`GATED_OPS`]; NVRTC compiles the
//! element prelude, `kernels/gated.cuh` (the shared row kernel) and the op's source per dtype, at
//! first use, and the module is cached per device. The op's scalar parameters reach the kernel
//! through [`GatedScalars`].

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use ir_core::op::Value;
use ir_core::storage::Storage;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use ir_ops::gelu_and_mul::GELU_AND_MUL;
use ir_ops::silu_and_mul::SILU_AND_MUL;
use kernel_support::{
    ComputeScalar, GatedCall, GatedGeometry, GatedKernel, GatedScalars, Rows, device_buffer, gated_support_with,
    kernel_int,
};

use crate::device::{CudaBuffer, driver_error};
use crate::launch::arg_compute;
use crate::module::{ELEMENT, compile, dtype_define};

/// The shared row kernel of the gated ops.
pub const GATED: &str = include_str!("../kernels/gated.cuh");

/// Threads per block of the gated kernels (`GATED_BLOCK` in `gated.cuh`): one block per row.
pub const GATED_BLOCK: u32 = 256;

/// Every gated op this provider implements: adding one is a kernel source and a line here.
pub const GATED_OPS: &[GatedKernel] = &[
    GatedKernel { def: &SILU_AND_MUL, source: include_str!("../kernels/silu_and_mul.cu") },
    GatedKernel { def: &GELU_AND_MUL, source: include_str!("../kernels/gelu_and_mul.cu") },
    GatedKernel {
        def: &ir_ops::gelu_and_mul_sparse::GELU_AND_MUL_SPARSE,
        source: include_str!("../kernels/gelu_and_mul_sparse.cu"),
    },
];

/// The source NVRTC compiles for a gated op: the element prelude, the row kernel, the op.
pub fn program(op: &GatedKernel) -> String {
    format!("{ELEMENT}\n{GATED}\n{}", op.source)
}

/// Compiles a gated op's kernel for `dtype` to PTX for `arch`.
pub fn compile_ptx(op: &GatedKernel, dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    let file = format!("{}.cu", op.def.name);
    compile(&program(op), &file, op.kernel_name(dtype), vec![dtype_define(dtype)?], arch)
}

/// Registers every op of [`GATED_OPS`].
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || {
        ImplSpec::new(crate::PROVIDER)
            .with_probe(crate::availability)
            .with_supports(|args| gated_support_with(args, DeviceKind::Cuda, crate::KERNEL_DTYPES))
    };
    GatedKernel::register_all(GATED_OPS, registry, spec, run)
}

/// Runs `op` on the bound `args` (x first): a fresh compact `[..., d]` output; the launch is asynchronous.
pub fn run(op: &GatedKernel, args: &[Value]) -> Result<Tensor, KernelError> {
    let GatedCall { x, scalars, geometry } = GatedCall::new(op.def, args)?;
    let empty = geometry.is_empty();
    let GatedGeometry { rows, out_layout, .. } = geometry;
    let dtype = x.dtype();
    let x_buffer = device_buffer::<CudaBuffer>(x, "x", "CUDA")?;
    // The output lives on the call's stream, in stream order with the kernel that writes it.
    let stream = x_buffer.call_stream()?;
    let mut out = x_buffer
        .device
        .allocate_on(&stream, out_layout.storage_end() * dtype.size_in_bytes())
        .map_err(ir_core::TensorError::from)?;
    if !empty {
        launch(&stream, op, dtype, rows, x_buffer, &mut out, scalars)?;
    }
    Ok(Tensor::from_storage(Storage::Device(Box::new(out)), dtype, out_layout)?)
}

fn launch(
    stream: &Arc<CudaStream>,
    op: &GatedKernel,
    dtype: DType,
    rows: Rows,
    x: &CudaBuffer,
    out: &mut CudaBuffer,
    scalars: GatedScalars,
) -> Result<(), KernelError> {
    let function = x.device.gated_function(op, dtype)?;
    let grid = u32::try_from(rows.n_rows)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| KernelError::GridLimit { what: "rows", count: rows.n_rows })?;
    let size = dtype.size_in_bytes();
    let n_rows: i64 = kernel_int(rows.n_rows, "rows")?;
    let d: i32 = kernel_int(rows.hidden / 2, "output width")?;
    let x_stride: i64 = kernel_int(rows.row_stride, "x row stride")?;
    let out_stride: i64 = i64::from(d);
    let x_address = x.read_address(stream);
    let out_address = out.write_address(stream);
    let (x_ptr, out_ptr) = (x_address.offset(rows.offset * size), out_address.ptr);
    let mut builder = stream.launch_builder(&function);
    // <op>_<dtype>(elem_t* out, const elem_t* x, long long n_rows, int d, long long x_row_stride,
    //              long long out_row_stride, compute_t f0, compute_t f1, int i0, int i1)
    let [f0, f1] = scalars.floats.map(|v| ComputeScalar::new(dtype, v));
    builder.arg(&out_ptr).arg(&x_ptr).arg(&n_rows).arg(&d).arg(&x_stride).arg(&out_stride);
    arg_compute(&mut builder, &f0);
    arg_compute(&mut builder, &f1);
    builder.arg(&scalars.ints[0]).arg(&scalars.ints[1]);
    let config = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (GATED_BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments follow the kernel's prototype above, each integer converted without loss
    // by `kernel_int`. x's address covers every element the rows reach (its layout was checked against
    // its storage by `check_fits`, and the rows come from that layout); `out` was allocated for
    // n_rows · d elements, written densely. The kernel writes only `out`. The launch is on x's
    // stream, where `out` was allocated; cudarc orders the buffers it allocated (the address
    // guards, dropped after the launch, record the uses).
    unsafe { builder.launch(config) }.map_err(driver_error)?;
    Ok(())
}
