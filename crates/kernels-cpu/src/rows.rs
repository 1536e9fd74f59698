//! Row kernels and the thread split.
//!
//! Numerics: squares are accumulated in f32 over 32 independent lanes (so the compiler can
//! vectorize) with a fixed reduction order; the fused sum is one f32 addition per element, so the
//! residual output is bit-identical to native; the norm is computed from the unrounded sum; the
//! weight step rounds y to the element type, multiplies by the f32 weight and rounds once.

use ir_core::kernel::Rows;
use ir_core::storage::CpuBuffer;
use rayon::prelude::*;

use crate::element::CpuElement;

/// Bytes of row data one task should own before rows are split across threads. Tuned with the
/// kernels benchmark on 2 cores: at 64 KB, waking the pool cost more than it saved (fused f32 16×4096:
/// 99 µs split in four tasks against 32 µs in one).
pub const BYTES_PER_TASK: usize = 256 * 1024;

/// Lanes of the sum-of-squares accumulator.
const LANES: usize = 32;

/// How many rows one task takes; calls with fewer rows run on the calling thread.
pub(crate) fn rows_per_task(hidden: usize, element_size: usize) -> usize {
    (BYTES_PER_TASK / (hidden * element_size).max(1)).max(1)
}

pub(crate) fn rms_norm<T: CpuElement>(
    x: &CpuBuffer,
    x_rows: Rows,
    out: &mut CpuBuffer,
    out_rows: Rows,
    weight: Option<&[f32]>,
    eps: f32,
) {
    let hidden = x_rows.hidden;
    let x_data = &x.typed::<T>()[x_rows.offset..x_rows.offset + x_rows.span()];
    let out_data = &mut out.typed_mut::<T>()[out_rows.offset..out_rows.offset + out_rows.span()];
    let task = |scratch: &mut Vec<f32>, (index, out_chunk): (usize, &mut [T])| {
        let start = index * x_rows.row_stride;
        rms_norm_row(&x_data[start..start + hidden], scratch, weight, eps, &mut out_chunk[..hidden]);
    };
    let per_task = rows_per_task(hidden, size_of::<T>());
    if x_rows.n_rows <= per_task {
        let mut scratch = vec![0f32; hidden];
        out_data.chunks_mut(out_rows.row_stride).enumerate().for_each(|item| task(&mut scratch, item));
        return;
    }
    tracing::debug!(target: "kernels_cpu", rows = x_rows.n_rows, per_task, "rms_norm split across threads");
    out_data
        .par_chunks_mut(out_rows.row_stride)
        .enumerate()
        .with_min_len(per_task)
        .for_each_init(|| vec![0f32; hidden], task);
}

pub(crate) fn fused<T: CpuElement>(
    x: &mut CpuBuffer,
    x_rows: Rows,
    residual: &mut CpuBuffer,
    residual_rows: Rows,
    weight: Option<&[f32]>,
    eps: f32,
) {
    let hidden = x_rows.hidden;
    let x_data = &mut x.typed_mut::<T>()[x_rows.offset..x_rows.offset + x_rows.span()];
    let residual_data =
        &mut residual.typed_mut::<T>()[residual_rows.offset..residual_rows.offset + residual_rows.span()];
    let task = |scratch: &mut (Vec<f32>, Vec<f32>), (x_chunk, r_chunk): (&mut [T], &mut [T])| {
        let (sum, other) = scratch;
        fused_row(&mut x_chunk[..hidden], &mut r_chunk[..hidden], sum, other, weight, eps);
    };
    let per_task = rows_per_task(hidden, size_of::<T>());
    if x_rows.n_rows <= per_task {
        let mut scratch = (vec![0f32; hidden], vec![0f32; hidden]);
        x_data
            .chunks_mut(x_rows.row_stride)
            .zip(residual_data.chunks_mut(residual_rows.row_stride))
            .for_each(|item| task(&mut scratch, item));
        return;
    }
    tracing::debug!(target: "kernels_cpu", rows = x_rows.n_rows, per_task, "fused_add_rms_norm split across threads");
    x_data
        .par_chunks_mut(x_rows.row_stride)
        .zip(residual_data.par_chunks_mut(residual_rows.row_stride))
        .with_min_len(per_task)
        .for_each_init(|| (vec![0f32; hidden], vec![0f32; hidden]), task);
}

/// One row of `rms_norm`: widen x into the f32 scratch, normalize, store weighted. Compiled for
/// AVX-512, AVX2 (+FMA, F16C) and NEON besides the baseline, chosen at run time; the results are the
/// same bits on every path (Rust never contracts a multiply and an add into an FMA by itself).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn rms_norm_row<T: CpuElement>(x: &[T], scratch: &mut [f32], weight: Option<&[f32]>, eps: f32, out: &mut [T]) {
    T::load(x, scratch);
    normalize_into(scratch, weight, eps, out);
}

/// One row of `fused_add_rms_norm`, in place: `r ← x + r` (rounded), `x ← norm(x + r)` from the
/// unrounded f32 sum. Multiversioned like [`rms_norm_row`].
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn fused_row<T: CpuElement>(
    x: &mut [T],
    r: &mut [T],
    sum: &mut [f32],
    other: &mut [f32],
    weight: Option<&[f32]>,
    eps: f32,
) {
    T::load(x, sum);
    T::load(r, other);
    for (s, r) in sum.iter_mut().zip(other.iter()) {
        *s += *r;
    }
    T::store(sum, r);
    normalize_into(sum, weight, eps, x);
}

/// Normalizes the f32 row `s` and stores the result, weighted, into `out`.
#[inline(always)]
pub(crate) fn normalize_into<T: CpuElement>(s: &[f32], weight: Option<&[f32]>, eps: f32, out: &mut [T]) {
    let mut mean_square = sum_squares(s) / s.len() as f32;
    if mean_square.is_infinite() {
        // The f32 sum overflowed (|x| above about 1.8e19 / sqrt(H)) although the mean square may fit:
        // native sums in f64 and rounds the mean once, so this rare row does the same. One compare
        // per row on the fast path.
        mean_square = mean_square_f64(s);
    }
    let rstd = 1.0 / (mean_square + eps).sqrt();
    T::store_normalized(s, rstd, weight, out);
}

/// The mean of v² summed in f64 and rounded once to f32, as native computes it.
#[cold]
fn mean_square_f64(v: &[f32]) -> f32 {
    let sum: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    (sum / v.len() as f64) as f32
}

/// Σ v² in f32 over 32 independent lanes, reduced in a fixed order.
#[inline(always)]
fn sum_squares(v: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        let chunk: &[f32; LANES] = chunk.try_into().expect("chunks_exact yields LANES values");
        for i in 0..LANES {
            lanes[i] += chunk[i] * chunk[i];
        }
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    tail.iter().fold(lanes[0], |acc, value| acc + value * value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_of_squares_is_close_to_f64() {
        for n in [0, 1, 31, 32, 33, 769, 8199] {
            let v: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
            let exact: f64 = v.iter().map(|&x| (x as f64) * (x as f64)).sum();
            let got = sum_squares(&v) as f64;
            assert!((got - exact).abs() <= 1e-5 * exact.max(1.0), "n {n}: {got} vs {exact}");
        }
    }

    #[test]
    fn task_size() {
        assert_eq!(rows_per_task(4096, 2), 32);
        assert_eq!(rows_per_task(65536, 4), 1);
        assert_eq!(rows_per_task(8, 2), 16384);
    }
}
