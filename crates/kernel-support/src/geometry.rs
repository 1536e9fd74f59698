//! Launch geometry GPU backends derive from the hidden size and dtype alone: threads per row,
//! 16-byte chunks, the gated block, the norms' register-cached chunks, and the dtype codes kernels take.

use ir_core::{DType, KernelError};

/// Threads cooperating on one row in the CUDA and ROCm kernels, from the hidden size alone:
/// 8/16/32/64/128/256 for H ≤ 64/128/3072/6144/16384/larger.
pub fn gpu_threads_per_row(hidden: usize) -> u32 {
    match hidden {
        0..=64 => 8,
        65..=128 => 16,
        129..=3072 => 32,
        3073..=6144 => 64,
        6145..=16384 => 128,
        _ => 256,
    }
}

/// The elements of one 16-byte chunk of `dtype` (f64: 2), the unit a CUDA/ROCm thread of the
/// norms and gated ops owns.
pub fn gpu_chunk(dtype: DType) -> usize {
    16 / dtype.size_in_bytes().clamp(1, 16)
}

/// The largest block of the CUDA and ROCm gated kernels (`GATED_MAX_BLOCK`, their launch bound).
pub const GATED_MAX_BLOCK: u32 = 1024;

/// The 16-byte chunks of the gate (and of up) a thread of a CUDA or ROCm 16-byte gated kernel
/// loads per step (`gated_unroll` in `kernels/gpu/gated.h`).
pub const GATED_STEP_CHUNKS: usize = 2;

/// Threads per block of a CUDA or ROCm gated row of width `d`, from d and the dtype alone (the
/// row statistics' reduction order follows the block, so both kernels of a width must agree): one
/// step of [`GATED_STEP_CHUNKS`] 16-byte chunks per thread, rounded up to a power of two, from 64
/// (a wavefront) up to [`GATED_MAX_BLOCK`]. A row of up to 16384 16-bit elements is one step of
/// each thread, all its loads in flight at once (the sparse op keeps it through its statistics),
/// and a block of at most 512 threads up to 8192 elements, so two or more blocks share an SM and
/// one block's reductions and barriers hide behind another's loads.
pub fn gated_block(d: usize, dtype: DType) -> u32 {
    let steps = d.div_ceil(gpu_chunk(dtype)).div_ceil(GATED_STEP_CHUNKS).max(1);
    let threads = steps.checked_next_power_of_two().unwrap_or(usize::MAX);
    u32::try_from(threads).map_or(GATED_MAX_BLOCK, |threads| threads.clamp(64, GATED_MAX_BLOCK))
}

/// The longest row a kernel with `threads_per_row` threads per row keeps whole in registers: the
/// largest hidden size that launches with it (the hidden-size buckets), and 32768 for the last,
/// open-ended one.
pub fn largest_cached_row(threads_per_row: u32) -> u32 {
    match threads_per_row {
        ..=8 => 64,
        16 => 128,
        32 => 3072,
        64 => 6144,
        128 => 16384,
        _ => 32768,
    }
}

/// The 16-byte chunks of a row each CUDA/ROCm norm thread keeps in registers (`ROW_CHUNKS` of
/// `kernels/gpu/rms_norm.h`): the whole row up to [`largest_cached_row`]; f64, a reference dtype, gets the f32
/// kernels' chunk count and so their registers: half its row.
pub fn norm_cache_chunks(dtype: DType, threads_per_row: u32) -> u32 {
    let size = if dtype == DType::F64 { 4 } else { dtype.size_in_bytes() as u32 };
    largest_cached_row(threads_per_row).div_ceil(16 / size * threads_per_row)
}

/// The chunks the fused norm keeps (`norm_fused_cache_chunks` in `kernels/gpu/rms_norm.h`): on the 16-byte path x
/// and the residual as stored, as many as [`norm_cache_chunks`] for 16-bit elements (two packed
/// chunks take the registers of one chunk of f32 sums) and half for f32; on the scalar path their
/// sums, as many as `norm_cache_chunks`.
pub fn norm_fused_cache_chunks(dtype: DType, threads_per_row: u32, vectorized: bool) -> u32 {
    let chunks = norm_cache_chunks(dtype, threads_per_row);
    if !vectorized || dtype.size_in_bytes() < 4 { chunks } else { chunks.div_ceil(2) }
}

/// The code the GPU element preludes (`kernels/gpu/elem.h`, `element.cl`) know a
/// compute dtype by (`DTYPE`, `WDTYPE`): f32 0, f16 1, bf16 2, f64 6 (the numbering of
/// [`element_code`], which the strided conversions use for every dtype); an error naming `backend`
/// for a dtype the kernels do not compute on.
pub fn compute_dtype_code(dtype: DType, backend: &'static str) -> Result<u8, KernelError> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 => Ok(element_code(dtype)),
        other => Err(KernelError::UnsupportedDType { backend, dtype: other }),
    }
}

/// The code the GPU kernel sources know an element dtype by: f32 0, f16 1, bf16 2, f8e4m3fn 3,
/// f8e5m2 4, i8 5, f64 6, i64 7.
pub fn element_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::F8E4M3FN => 3,
        DType::F8E5M2 => 4,
        DType::I8 => 5,
        DType::F64 => 6,
        DType::I64 => 7,
    }
}
