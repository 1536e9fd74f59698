//! Setting a kernel's arguments and enqueueing it.

use ir_core::{DType, KernelError};
use kernel_support::{ComputeScalar, Rows, kernel_int};
use opencl3::kernel::ExecuteKernel;
use std::sync::Arc;

use opencl3::command_queue::CommandQueue;
use opencl3::memory::ClMem;

use crate::FORCE_TREE_ENV;
use crate::device::{XpuBuffer, cl_error};
use crate::module::{KernelVariant, NormOp, group_size, threads_per_row, use_subgroups};

/// Sets the kernel's next argument to `value`.
///
/// # Safety
///
/// That argument is `compute_t` of the program `value` was made for (its dtype's).
pub(crate) unsafe fn set_compute<'b, 'k>(
    execute: &'b mut ExecuteKernel<'k>,
    value: &ComputeScalar,
) -> &'b mut ExecuteKernel<'k> {
    // SAFETY: the caller's promise: the argument has this value's type.
    unsafe {
        match value {
            ComputeScalar::F32(v) => execute.set_arg(v),
            ComputeScalar::F64(v) => execute.set_arg(v),
        }
    }
}

/// Scalars of one launch.
pub(crate) struct Args {
    pub(crate) dtype: DType,
    pub(crate) epsilon: ComputeScalar,
    /// Rows of x.
    pub(crate) rows: Rows,
    /// Rows of the output (`rms_norm`) or of the residual (`fused_add_rms_norm`).
    pub(crate) other_rows: Rows,
    /// Elements of each row the mean square runs over, from `kernel_support::norm_variance` (in 1..=H).
    pub(crate) variance: usize,
}

/// Enqueues one kernel on `queue` (every buffer moved to it first). For `rms_norm`, `first` is the
/// output and `second` is x; for the fused op, `first` is x and `second` the residual (both
/// written in place).
pub(crate) fn launch(
    queue: &Arc<CommandQueue>,
    op: NormOp,
    args: Args,
    first: &XpuBuffer,
    second: &XpuBuffer,
    weight: Option<(&XpuBuffer, usize, DType)>,
) -> Result<(), KernelError> {
    let device = &second.device;
    for buffer in [Some(first), Some(second), weight.map(|(w, _, _)| w)].into_iter().flatten() {
        buffer.use_on(queue)?;
    }
    let (rows, other) = (args.rows, args.other_rows);
    let threads_per_row = threads_per_row(rows.hidden, device.max_work_group_size());
    let force_tree = std::env::var(FORCE_TREE_ENV).is_ok_and(|v| v == "1");
    let variant = KernelVariant {
        op,
        dtype: args.dtype,
        weight: weight.map(|(_, _, dtype)| dtype),
        threads_per_row,
        subgroups: use_subgroups(device.extensions(), device.max_sub_group_size(), threads_per_row, force_tree),
    };
    let kernel = device.kernel(&variant)?;
    let kernel = kernel.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let group = group_size(threads_per_row) as usize;
    let groups = rows.n_rows.div_ceil(variant.rows_per_group() as usize);
    let (first_mem, second_mem) = (first.buffer.get(), second.buffer.get());
    let weight_mem = weight.map_or(second_mem, |(w, _, _)| w.buffer.get());
    let weight_offset: i64 = kernel_int(weight.map_or(0, |(_, offset, _)| offset), "weight offset")?;
    let n_rows: i64 = kernel_int(rows.n_rows, "rows")?;
    let hidden: i32 = kernel_int(rows.hidden, "hidden size")?;
    let variance: i32 = kernel_int(args.variance, "variance_size")?;
    let (first_stride, second_stride, first_offset, second_offset) = match op {
        NormOp::RmsNorm => (other.row_stride, rows.row_stride, other.offset, rows.offset),
        NormOp::FusedAddRmsNorm => (rows.row_stride, other.row_stride, rows.offset, other.offset),
    };
    let (first_stride, second_stride): (i64, i64) =
        (kernel_int(first_stride, "row stride")?, kernel_int(second_stride, "row stride")?);
    let (first_offset, second_offset): (i64, i64) =
        (kernel_int(first_offset, "storage offset")?, kernel_int(second_offset, "storage offset")?);
    // rms_norm_<dtype>(out, x, weight, epsilon, n_rows, hidden, variance, x_row_stride, out_row_stride,
    //                  x_offset, out_offset, weight_offset)
    // fused_add_rms_norm_<dtype>(x, residual, weight, epsilon, n_rows, hidden, variance, x_row_stride,
    //                            residual_row_stride, x_offset, residual_offset, weight_offset)
    let (stride_a, stride_b, offset_a, offset_b) = match op {
        NormOp::RmsNorm => (second_stride, first_stride, second_offset, first_offset),
        NormOp::FusedAddRmsNorm => (first_stride, second_stride, first_offset, second_offset),
    };
    let mut execute = ExecuteKernel::new(&kernel);
    // SAFETY: the arguments follow the kernel's prototype above, with the types it declares
    // (cl_mem, compute_t, long, int; `epsilon` made for this dtype), each integer converted without
    // loss by `kernel_int`; every row the
    // kernel touches lies inside its buffer: each tensor's layout was checked against its storage by
    // `check_fits` (checked arithmetic) when it was built, and the rows come from that layout.
    unsafe {
        let execute = execute.set_arg(&first_mem).set_arg(&second_mem).set_arg(&weight_mem);
        set_compute(execute, &args.epsilon)
            .set_arg(&n_rows)
            .set_arg(&hidden)
            .set_arg(&variance)
            .set_arg(&stride_a)
            .set_arg(&stride_b)
            .set_arg(&offset_a)
            .set_arg(&offset_b)
            .set_arg(&weight_offset)
            .set_global_work_size(groups * group)
            .set_local_work_size(group)
            .enqueue_nd_range(queue)
    }
    .map_err(cl_error)?;
    Ok(())
}
