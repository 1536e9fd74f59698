//! The gated activations (`silu_and_mul`, `gelu_and_mul`, …) on the xpu.
//!
//! Each op is one kernel source `kernels/<op>.cl` and one line of [`GATED_OPS`]; the program is the
//! element prelude, `kernels/gated.cl` (the shared row kernel) and the op's source, built per dtype
//! at first use. The op's scalar parameters reach the kernel through [`GatedScalars`](kernel_support::GatedScalars).

use ir_core::op::Value;
use ir_core::storage::Storage;
use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use ir_ops::gelu_and_mul::GELU_AND_MUL;
use ir_ops::silu_and_mul::SILU_AND_MUL;
use kernel_support::{
    ComputeScalar, GatedCall, GatedGeometry, GatedKernel, device_buffer, gated_support_with, kernel_int,
};
use opencl3::kernel::ExecuteKernel;
use opencl3::memory::ClMem;

use crate::device::{XpuBuffer, cl_error};
use crate::launch::set_compute;
use crate::module::ELEMENT;

/// The shared row kernel of the gated ops.
pub const GATED: &str = include_str!("../kernels/gated.cl");

/// Work-items per work-group of the gated kernels (`GATED_GROUP` in `gated.cl`): one group per row.
pub const GATED_GROUP: usize = 128;

/// Every gated op this provider implements: adding one is a kernel source and a line here.
pub const GATED_OPS: &[GatedKernel] = &[
    GatedKernel { def: &SILU_AND_MUL, source: include_str!("../kernels/silu_and_mul.cl") },
    GatedKernel { def: &GELU_AND_MUL, source: include_str!("../kernels/gelu_and_mul.cl") },
    GatedKernel {
        def: &ir_ops::gelu_and_mul_sparse::GELU_AND_MUL_SPARSE,
        source: include_str!("../kernels/gelu_and_mul_sparse.cl"),
    },
];

/// The program source of a gated op: the element prelude, the row kernel, the op.
pub fn program(op: &GatedKernel) -> String {
    format!("{ELEMENT}\n{GATED}\n{}", op.source)
}

/// Registers every op of [`GATED_OPS`].
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || {
        ImplSpec::new(crate::PROVIDER)
            .with_probe(crate::availability)
            .with_platform_detection(crate::is_gpu)
            .with_supports(|args| gated_support_with(args, DeviceKind::Xpu, crate::kernel_dtypes()))
    };
    GatedKernel::register_all(GATED_OPS, registry, spec, run)
}

/// Runs `op` on the bound `args` (x first): a fresh compact `[..., d]` output.
pub fn run(op: &GatedKernel, args: &[Value]) -> Result<Tensor, KernelError> {
    let GatedCall { x, scalars, geometry } = GatedCall::new(op.def, args)?;
    let empty = geometry.is_empty();
    let GatedGeometry { rows, d, out_layout } = geometry;
    let dtype = x.dtype();
    let x_buffer = device_buffer::<XpuBuffer>(x, "x", "xpu")?;
    // The output belongs to the call's queue, where the kernel writes it.
    let queue = x_buffer.call_queue()?;
    let out_buffer = x_buffer
        .device
        .allocate_on(&queue, out_layout.storage_end() * dtype.size_in_bytes())
        .map_err(ir_core::TensorError::from)?;
    if !empty {
        x_buffer.use_on(&queue)?;
        let kernel = x_buffer.device.gated_kernel(op, dtype)?;
        let kernel = kernel.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (out_mem, x_mem) = (out_buffer.buffer.get(), x_buffer.buffer.get());
        let n_rows: i64 = kernel_int(rows.n_rows, "rows")?;
        let d: i32 = kernel_int(d, "output width")?;
        let x_stride: i64 = kernel_int(rows.row_stride, "x row stride")?;
        let x_offset: i64 = kernel_int(rows.offset, "storage offset")?;
        let global = rows
            .n_rows
            .checked_mul(GATED_GROUP)
            .ok_or_else(|| KernelError::GridLimit { what: "rows", count: rows.n_rows })?;
        let [f0, f1] = scalars.floats.map(|v| ComputeScalar::new(dtype, v));
        // <op>_<dtype>(out, x, long n_rows, int d, long x_row_stride, long x_offset, compute_t f0,
        //              compute_t f1, int i0, int i1)
        // SAFETY: the arguments follow the kernel's prototype above, with the types it declares,
        // each integer converted without loss by `kernel_int`; x's rows lie inside its buffer (its
        // layout was checked against its storage by `check_fits`, and the rows come from that
        // layout); `out` holds n_rows · d elements, written densely.
        unsafe {
            let mut execute = ExecuteKernel::new(&kernel);
            let execute = execute
                .set_arg(&out_mem)
                .set_arg(&x_mem)
                .set_arg(&n_rows)
                .set_arg(&d)
                .set_arg(&x_stride)
                .set_arg(&x_offset);
            let execute = set_compute(execute, &f0);
            set_compute(execute, &f1)
                .set_arg(&scalars.ints[0])
                .set_arg(&scalars.ints[1])
                .set_global_work_size(global)
                .set_local_work_size(GATED_GROUP)
                .enqueue_nd_range(&queue)
        }
        .map_err(cl_error)?;
    }
    Ok(Tensor::from_storage(Storage::Device(Box::new(out_buffer)), dtype, out_layout)?)
}
