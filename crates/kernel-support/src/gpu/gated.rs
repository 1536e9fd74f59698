//! The gated activations' host code.

use ir_core::op::Value;
use ir_core::storage::Storage;
use ir_core::{DType, KernelError, Tensor};

use super::vector_ok;
use super::{GpuRuntime, Grid, KernelArgs, KernelKey};
use crate::{ComputeScalar, GatedCall, GatedGeometry, GatedKernel, Rows, device_buffer, kernel_int, stepped_extent};

/// Runs the gated op `op` on the bound `args` (x first) on runtime `R`: a fresh compact
/// `[..., d]` output, one group of [`GpuRuntime::gated_group`] per row. The kernel is
/// `<op>_<dtype>(out, x, long long n_rows, int d, long long x_row_stride, long long out_row_stride,
/// compute_t f0, compute_t f1, int i0, int i1)`, or its 16-byte variant `<op>_<dtype>_vec` when
/// [`gated_vectorizes`] allows it.
pub fn run_gated<R: GpuRuntime>(op: &GatedKernel, args: &[Value]) -> Result<Tensor, KernelError> {
    let GatedCall { x, scalars, geometry } = GatedCall::new(op.def, args)?;
    let empty = geometry.is_empty();
    let GatedGeometry { rows, d, out_layout } = geometry;
    let dtype = x.dtype();
    let x_buffer = device_buffer::<R::Buffer>(x, "x", R::MEMORY)?;
    let queue = R::queue(x_buffer)?;
    let mut out = R::allocate(x_buffer, &queue, out_layout.storage_end() * dtype.size_in_bytes())?;
    if !empty {
        let vectorized = gated_vectorizes(&rows, d, dtype, R::base_alignment(x_buffer), R::base_alignment(&out));
        let kernel = R::kernel(x_buffer, KernelKey::Gated { op, dtype, vectorized })?;
        let [f0, f1] = scalars.floats.map(|v| ComputeScalar::new(dtype, v));
        let group_size = R::gated_group(d, dtype);
        // The kernels index chunks of 16 bytes with `int`: the width needs room for a chunk past it.
        let d = stepped_extent(d, "output width", 16)?;
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
        let grid = Grid { groups: rows.n_rows, group_size, what: "rows", grid_stride: true };
        // SAFETY: the arguments follow the prototype above, each integer converted without loss by
        // `kernel_int` (the width with room for the kernel's last chunk, `stepped_extent`).
        // x's rows lie inside its buffer (its layout was checked against its storage when the
        // tensor was built, and the rows come from that layout); `out` was allocated for
        // the compact output layout, n_rows · d elements, which the kernel writes densely, and is
        // held only here. The 16-byte kernel runs only on rows whose every chunk is whole and
        // aligned in both buffers (`gated_vectorizes`).
        unsafe { R::launch(&queue, &kernel, grid, launch) }?;
    }
    Ok(Tensor::from_storage(Storage::Device(Box::new(out)), dtype, out_layout)?)
}

/// Whether a gated call may run the 16-byte kernel: x's rows (`rows`, of 2d elements) start
/// 16-byte aligned in a buffer whose first byte has `x_alignment`, d is a multiple of the chunk
/// (so each row's up half and every output row start aligned too), and the fresh output's first
/// byte has `out_alignment` of at least 16. Both kernels give the same bits.
pub fn gated_vectorizes(rows: &Rows, d: usize, dtype: DType, x_alignment: usize, out_alignment: usize) -> bool {
    let halves = Rows { hidden: d, ..*rows };
    let out = Rows { n_rows: rows.n_rows, hidden: d, row_stride: d, offset: 0 };
    vector_ok(&halves, dtype, x_alignment) && vector_ok(&out, dtype, out_alignment)
}
