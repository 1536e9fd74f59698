//! The gated activations' host code.

use ir_core::op::Value;
use ir_core::storage::Storage;
use ir_core::{KernelError, Tensor};

use super::{GpuRuntime, Grid, KernelArgs, KernelKey};
use crate::{ComputeScalar, GatedCall, GatedGeometry, GatedKernel, device_buffer, kernel_int, stepped_extent};

/// Runs the gated op `op` on the bound `args` (x first) on runtime `R`: a fresh compact
/// `[..., d]` output, one group of [`GpuRuntime::GATED_GROUP`] per row. The kernel is
/// `<op>_<dtype>(out, x, long long n_rows, int d, long long x_row_stride, long long out_row_stride,
/// compute_t f0, compute_t f1, int i0, int i1)`.
pub fn run_gated<R: GpuRuntime>(op: &GatedKernel, args: &[Value]) -> Result<Tensor, KernelError> {
    let GatedCall { x, scalars, geometry } = GatedCall::new(op.def, args)?;
    let empty = geometry.is_empty();
    let GatedGeometry { rows, d, out_layout } = geometry;
    let dtype = x.dtype();
    let x_buffer = device_buffer::<R::Buffer>(x, "x", R::MEMORY)?;
    let queue = R::queue(x_buffer)?;
    let mut out = R::allocate(x_buffer, &queue, out_layout.storage_end() * dtype.size_in_bytes())?;
    if !empty {
        let kernel = R::kernel(x_buffer, KernelKey::Gated { op, dtype })?;
        let [f0, f1] = scalars.floats.map(|v| ComputeScalar::new(dtype, v));
        let d = stepped_extent(d, "output width", R::GATED_GROUP)?;
        let mut launch = KernelArgs::new();
        launch
            .write(&mut out, 0, dtype)
            .read(x_buffer, rows.offset, dtype)
            .long(kernel_int(rows.n_rows, "rows")?)
            .int(d)
            .long(kernel_int(rows.row_stride, "x row stride")?)
            .long(i64::from(d))
            .compute(f0)
            .compute(f1)
            .int(scalars.ints[0])
            .int(scalars.ints[1]);
        let grid = Grid { groups: rows.n_rows, group_size: R::GATED_GROUP, what: "rows" };
        // SAFETY: the arguments follow the prototype above, each integer converted without loss by
        // `kernel_int` (the width with room for the kernel's last block step, `stepped_extent`).
        // x's rows lie inside its buffer (its layout was checked against its storage when the
        // tensor was built, and the rows come from that layout); `out` was allocated for
        // the compact output layout, n_rows · d elements, which the kernel writes densely, and is
        // held only here.
        unsafe { R::launch(&queue, &kernel, grid, launch) }?;
    }
    Ok(Tensor::from_storage(Storage::Device(Box::new(out)), dtype, out_layout)?)
}
