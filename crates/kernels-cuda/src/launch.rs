//! Launch geometry, chosen from the hidden size alone, and the two launch paths.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};
use ir_core::{DType, KernelError};
use kernel_support::{ComputeScalar, Rows, gpu_threads_per_row, kernel_int};

use crate::device::{CudaBuffer, CudaDeviceState, driver_error};
use crate::module::{NormOp, NormProgram};

/// Threads per row the kernels are compiled for.
pub const THREADS_PER_ROW: [u32; 6] = [8, 16, 32, 64, 128, 256];
/// Block sizes: 128 threads, 256 above H = 16384.
pub const BLOCK_SIZES: [u32; 2] = [128, 256];

/// The launch shape of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Threads cooperating on one row.
    pub threads_per_row: u32,
    /// Threads per block.
    pub block_size: u32,
    /// Rows one block handles.
    pub rows_per_block: u32,
    /// Blocks in the grid.
    pub grid: u32,
}

pub(crate) fn block_size(threads_per_row: u32) -> u32 {
    if threads_per_row > 128 { 256 } else { 128 }
}

/// The geometry for `n_rows` rows of `hidden` elements; nothing but the grid depends on `n_rows`.
pub fn rms_norm_launch(n_rows: usize, hidden: usize) -> Result<Geometry, KernelError> {
    let threads_per_row = gpu_threads_per_row(hidden);
    let block_size = block_size(threads_per_row);
    let rows_per_block = block_size / threads_per_row;
    let grid = n_rows.div_ceil(rows_per_block as usize);
    let grid = u32::try_from(grid)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| KernelError::GridLimit { what: "rows", count: n_rows })?;
    Ok(Geometry { threads_per_row, block_size, rows_per_block, grid })
}

/// Whether 16-byte accesses are safe for a tensor: aligned start, and a row stride and hidden size
/// that are multiples of the vector width. Decided on the host; both paths give the same bits.
pub(crate) fn vector_ok(rows: &Rows, dtype: DType, base_alignment: usize) -> bool {
    let size = dtype.size_in_bytes();
    let width = 16 / size;
    let start = rows.offset * size;
    crate::module::vectorizes(dtype)
        && base_alignment.is_multiple_of(16)
        && start.is_multiple_of(16)
        && rows.hidden.is_multiple_of(width)
        && (rows.n_rows <= 1 || rows.row_stride.is_multiple_of(width))
}

/// Pushes `value` as the kernel's next argument, a `compute_t` (`element.cuh`) of the program
/// `value` was made for.
pub(crate) fn arg_compute<'a>(builder: &mut LaunchArgs<'a>, value: &'a ComputeScalar) {
    match value {
        ComputeScalar::F32(v) => builder.arg(v),
        ComputeScalar::F64(v) => builder.arg(v),
    };
}

/// Arguments of one launch, besides the buffers.
pub(crate) struct Launch {
    pub(crate) dtype: DType,
    pub(crate) rows: Rows,
    pub(crate) other_rows: Rows,
    pub(crate) epsilon: ComputeScalar,
    pub(crate) vectorized: bool,
    /// Elements of each row the mean square runs over, from `kernel_support::norm_variance` (in 1..=H).
    pub(crate) variance: usize,
}

/// A launch's weight: its buffer, storage offset (elements) and dtype (which may differ from x's).
pub(crate) type WeightArg<'a> = Option<(&'a CudaBuffer, usize, DType)>;

/// What both launches share: the compiled variant for this call and its launch shape.
struct Prepared {
    function: CudaFunction,
    config: LaunchConfig,
    n_rows: i64,
    hidden: i32,
    variance: i32,
}

fn prepare(
    device: &CudaDeviceState,
    op: NormOp,
    launch: &Launch,
    weight: Option<DType>,
) -> Result<Prepared, KernelError> {
    let rows = launch.rows;
    let geometry = rms_norm_launch(rows.n_rows, rows.hidden)?;
    let program = NormProgram {
        dtype: launch.dtype,
        weight,
        vectorized: launch.vectorized,
        threads_per_row: geometry.threads_per_row,
    };
    Ok(Prepared {
        function: device.function(&program.kernel(op))?,
        config: LaunchConfig {
            grid_dim: (geometry.grid, 1, 1),
            block_dim: (geometry.block_size, 1, 1),
            shared_mem_bytes: 0,
        },
        n_rows: kernel_int(rows.n_rows, "rows")?,
        hidden: kernel_int(rows.hidden, "hidden size")?,
        variance: kernel_int(launch.variance, "variance_size")?,
    })
}

/// Launches `rms_norm_<dtype>(out, x, weight, epsilon, n_rows, hidden, variance, x_row_stride,
/// out_row_stride)` on `stream` (the call's: see `CudaBuffer::call_stream`).
pub(crate) fn launch_rms_norm(
    stream: &Arc<CudaStream>,
    launch: &Launch,
    out: &mut CudaBuffer,
    x: &CudaBuffer,
    weight: WeightArg<'_>,
) -> Result<(), KernelError> {
    let (rows, out_rows) = (launch.rows, launch.other_rows);
    let prepared = prepare(&x.device, NormOp::RmsNorm, launch, weight.map(|(_, _, dtype)| dtype))?;
    let size = launch.dtype.size_in_bytes();
    let x_stride: i64 = kernel_int(rows.row_stride, "x row stride")?;
    let out_stride: i64 = kernel_int(out_rows.row_stride, "out row stride")?;
    let x_address = x.read_address(stream);
    let out_address = out.write_address(stream);
    let weight_address = weight.map(|(w, offset, dtype)| (w.read_address(stream), offset * dtype.size_in_bytes()));
    let x_ptr = x_address.offset(rows.offset * size);
    let out_ptr = out_address.offset(out_rows.offset * size);
    let weight_ptr = weight_address.as_ref().map_or(0, |(w, offset_bytes)| w.offset(*offset_bytes));
    let mut builder = stream.launch_builder(&prepared.function);
    // rms_norm_<dtype>(elem_t* out, const elem_t* x, const welem_t* weight, compute_t epsilon,
    //                  long long n_rows, int hidden, int variance, long long x_row_stride,
    //                  long long out_row_stride)
    builder.arg(&out_ptr).arg(&x_ptr).arg(&weight_ptr);
    arg_compute(&mut builder, &launch.epsilon);
    builder.arg(&prepared.n_rows).arg(&prepared.hidden).arg(&prepared.variance);
    builder.arg(&x_stride).arg(&out_stride);
    // SAFETY: the arguments follow the kernel's prototype above, each integer converted without loss
    // by `kernel_int`. The addresses cover every element the rows reach: each tensor was built
    // through `check_fits`, which verified (in checked arithmetic) that its layout's byte extent fits
    // its storage, and `Rows::for_kernel` derived offset, row stride and span from that layout, so
    // `offset + span <= storage length` (for adopted memory, `from_raw_parts`'s contract makes the
    // storage length valid device memory). The kernel writes only `out`. The launch is on x's
    // stream; cudarc orders the buffers it allocated on it (the address guards, dropped after the
    // launch, record the uses).
    unsafe { builder.launch(prepared.config) }.map_err(driver_error)?;
    Ok(())
}

/// Launches `fused_add_rms_norm_<dtype>(x, residual, weight, epsilon, n_rows, hidden, variance,
/// x_row_stride, residual_row_stride)` on `stream`.
pub(crate) fn launch_fused(
    stream: &Arc<CudaStream>,
    launch: &Launch,
    x: &mut CudaBuffer,
    residual: &mut CudaBuffer,
    weight: WeightArg<'_>,
) -> Result<(), KernelError> {
    let (rows, residual_rows) = (launch.rows, launch.other_rows);
    let prepared = prepare(&x.device, NormOp::FusedAddRmsNorm, launch, weight.map(|(_, _, dtype)| dtype))?;
    let size = launch.dtype.size_in_bytes();
    let x_stride: i64 = kernel_int(rows.row_stride, "x row stride")?;
    let residual_stride: i64 = kernel_int(residual_rows.row_stride, "residual row stride")?;
    let x_address = x.write_address(stream);
    let residual_address = residual.write_address(stream);
    let weight_address = weight.map(|(w, offset, dtype)| (w.read_address(stream), offset * dtype.size_in_bytes()));
    let x_ptr = x_address.offset(rows.offset * size);
    let residual_ptr = residual_address.offset(residual_rows.offset * size);
    let weight_ptr = weight_address.as_ref().map_or(0, |(w, offset_bytes)| w.offset(*offset_bytes));
    let mut builder = stream.launch_builder(&prepared.function);
    // fused_add_rms_norm_<dtype>(elem_t* x, elem_t* residual, const welem_t* weight, compute_t epsilon,
    //                            long long n_rows, int hidden, int variance, long long x_row_stride,
    //                            long long residual_row_stride)
    builder.arg(&x_ptr).arg(&residual_ptr).arg(&weight_ptr);
    arg_compute(&mut builder, &launch.epsilon);
    builder.arg(&prepared.n_rows).arg(&prepared.hidden).arg(&prepared.variance);
    builder.arg(&x_stride).arg(&residual_stride);
    // SAFETY: the arguments follow the kernel's prototype above, each integer converted without loss
    // by `kernel_int`. x and residual are distinct, uniquely owned buffers (`UniqueTensor`), and their
    // addresses cover every element the rows reach: each tensor's layout was checked against its
    // storage by `check_fits` (checked arithmetic) and the rows come from that layout. The launch is
    // on x's stream, as for `launch_rms_norm`.
    unsafe { builder.launch(prepared.config) }.map_err(driver_error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_depends_on_hidden_only() {
        let cases = [
            (8, 8, 128, 16),
            (64, 8, 128, 16),
            (65, 16, 128, 8),
            (1024, 32, 128, 4),
            (3072, 32, 128, 4),
            (4096, 64, 128, 2),
            (8192, 128, 128, 1),
            (16384, 128, 128, 1),
            (16385, 256, 256, 1),
        ];
        for (hidden, threads_per_row, block_size, rows_per_block) in cases {
            for n_rows in [1, 7, 2048, 262145] {
                let g = rms_norm_launch(n_rows, hidden).unwrap();
                assert_eq!(
                    (g.threads_per_row, g.block_size, g.rows_per_block),
                    (threads_per_row, block_size, rows_per_block),
                    "H {hidden}"
                );
                assert_eq!(g.grid as usize, n_rows.div_ceil(rows_per_block as usize));
            }
        }
        assert!(rms_norm_launch(1024, 1024).unwrap().rows_per_block > 1, "several rows per block when H <= 1024");
    }

    #[test]
    fn vector_path_needs_alignment() {
        let rows = |hidden, row_stride, offset| Rows { n_rows: 4, hidden, row_stride, offset };
        assert!(vector_ok(&rows(4096, 4096, 0), DType::BF16, 256));
        assert!(!vector_ok(&rows(4096, 4096, 1), DType::BF16, 256), "misaligned offset");
        assert!(!vector_ok(&rows(4095, 4096, 0), DType::BF16, 256), "H not a multiple of 8");
        assert!(!vector_ok(&rows(4096, 4099, 0), DType::BF16, 256), "row stride");
        assert!(vector_ok(&rows(4096, 4096, 8), DType::BF16, 256));
        assert!(vector_ok(&rows(4096, 4100, 4), DType::F32, 256));
        assert!(!vector_ok(&rows(4096, 4096, 0), DType::F64, 256), "f64 rows launch with scalar accesses");
    }

    /// Memory an engine adopts may start at any address: the 16-byte path follows the real one
    /// (a misaligned 16-byte load is a sticky error that poisons the engine's CUDA context).
    #[test]
    fn the_vector_path_follows_the_real_address_of_adopted_memory() {
        use crate::device::address_alignment;
        let rows = Rows { n_rows: 4, hidden: 4096, row_stride: 4096, offset: 0 };
        assert_eq!(address_alignment(0x7f00_1234_5602), 2);
        assert!(!vector_ok(&rows, DType::BF16, address_alignment(0x7f00_1234_5602)), "2 bytes past alignment");
        assert!(!vector_ok(&rows, DType::F32, address_alignment(0x7f00_1234_5608)), "8-byte aligned only");
        assert!(vector_ok(&rows, DType::BF16, address_alignment(0x7f00_1234_5610)), "16-byte aligned");
        assert_eq!(address_alignment(0x7f00_1234_5600), 256, "capped at the driver's alignment");
        assert_eq!(address_alignment(0), 256);
        // A misaligned base made good by the offset is not taken: the check is on the base and the
        // offset separately, and a base below 16 bytes of alignment never vectorizes.
        let shifted = Rows { offset: 1, ..rows };
        assert!(!vector_ok(&shifted, DType::BF16, address_alignment(0x7f00_1234_560e)));
    }
}
