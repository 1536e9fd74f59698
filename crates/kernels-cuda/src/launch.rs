//! Norm launch geometry, chosen from the hidden size alone.

use ir_core::KernelError;
use kernel_support::gpu_threads_per_row;

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
}
