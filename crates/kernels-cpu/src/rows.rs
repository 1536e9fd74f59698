//! Row kernels and the thread split.
//!
//! Numerics: squares are accumulated in f32 over 32 independent lanes (so the compiler can
//! vectorize) with a fixed reduction order; the fused sum is one f32 addition per element, so the
//! residual output is bit-identical to native; the norm is computed from the unrounded sum; the
//! weight step rounds y to the element type, multiplies by the f32 weight and rounds once.

use ir_core::storage::CpuBuffer;
use kernel_support::Rows;
use rayon::prelude::*;

use crate::element::{CpuElement, RowOut};

/// Bytes of row data one task should own before rows are split across threads. Tuned with the
/// kernels benchmark on 2 cores: at 64 KB, waking the pool cost more than it saved (fused f32 16×4096:
/// 99 µs split in four tasks against 32 µs in one).
pub const BYTES_PER_TASK: usize = 256 * 1024;

/// Lanes of the sum-of-squares accumulator.
pub(crate) const LANES: usize = 32;

/// How many rows one task takes; calls with fewer rows run on the calling thread.
pub(crate) fn rows_per_task(hidden: usize, element_size: usize) -> usize {
    (BYTES_PER_TASK / (hidden * element_size).max(1)).max(1)
}

pub(crate) fn rms_norm<T: CpuElement>(
    x: &CpuBuffer,
    x_rows: Rows,
    out: &mut CpuBuffer,
    out_rows: Rows,
    weight: Weight<'_, T>,
    eps: f32,
) {
    let hidden = x_rows.hidden;
    let x_data = &x.typed::<T>()[x_rows.offset..x_rows.offset + x_rows.span()];
    let out_data = &mut out.typed_mut::<T>()[out_rows.offset..out_rows.offset + out_rows.span()];
    // An output larger than the last-level cache is streamed past it: ordinary stores would read
    // every output line before writing it, and the lines would only evict the input.
    let stream = size_of_val(out_data) > last_level_cache_bytes();
    let task = |(index, out_chunk): (usize, &mut [T])| {
        let start = index * x_rows.row_stride;
        rms_norm_row(&x_data[start..start + hidden], weight, eps, &mut out_chunk[..hidden], stream);
    };
    let per_task = rows_per_task(hidden, size_of::<T>());
    if x_rows.n_rows <= per_task {
        out_data.chunks_mut(out_rows.row_stride).enumerate().for_each(task);
        return;
    }
    tracing::debug!(target: "kernels_cpu", rows = x_rows.n_rows, per_task, "rms_norm split across threads");
    out_data.par_chunks_mut(out_rows.row_stride).enumerate().with_min_len(per_task).for_each(task);
}

pub(crate) fn fused<T: CpuElement>(
    x: &mut CpuBuffer,
    x_rows: Rows,
    residual: &mut CpuBuffer,
    residual_rows: Rows,
    weight: Weight<'_, T>,
    eps: f32,
    round_sum: bool,
) {
    for_each_row_pair(x, x_rows, residual, residual_rows, "fused_add_rms_norm", |x: &mut [T], r: &mut [T]| {
        if round_sum {
            // `dtype` rounding: the stored (rounded) sum, then the norm row of it: rms_norm of the
            // residual output, bit for bit.
            add_into(x, r);
            rms_norm_row(r, weight, eps, x, false);
        } else {
            fused_row(RowOut::InPlace(x), r, weight, eps);
        }
    });
}

/// Runs `row` on each pair of rows of x and the residual (their first `hidden` elements), in
/// order on this thread or split across the pool as the norms' rows are (`op` names the kernel in
/// the log).
fn for_each_row_pair<T: CpuElement>(
    x: &mut CpuBuffer,
    x_rows: Rows,
    residual: &mut CpuBuffer,
    residual_rows: Rows,
    op: &str,
    row: impl Fn(&mut [T], &mut [T]) + Sync,
) {
    let hidden = x_rows.hidden;
    let x_data = &mut x.typed_mut::<T>()[x_rows.offset..x_rows.offset + x_rows.span()];
    let residual_data =
        &mut residual.typed_mut::<T>()[residual_rows.offset..residual_rows.offset + residual_rows.span()];
    let task = |(x_chunk, r_chunk): (&mut [T], &mut [T])| row(&mut x_chunk[..hidden], &mut r_chunk[..hidden]);
    let per_task = rows_per_task(hidden, size_of::<T>());
    if x_rows.n_rows <= per_task {
        x_data.chunks_mut(x_rows.row_stride).zip(residual_data.chunks_mut(residual_rows.row_stride)).for_each(task);
        return;
    }
    tracing::debug!(target: "kernels_cpu", rows = x_rows.n_rows, per_task, op, "rows split across threads");
    x_data
        .par_chunks_mut(x_rows.row_stride)
        .zip(residual_data.par_chunks_mut(residual_rows.row_stride))
        .with_min_len(per_task)
        .for_each(task);
}

/// `fused_sandwich_rms_norm` in place: per row, `h = rms_norm(x, post)` (stored in x's type, in
/// this thread's scratch), then `fused_add_rms_norm(h, r, pre)` with its norm written over x: the
/// cpu's `rms_norm` and `fused_add_rms_norm` rows composed, so the unfused pair's bits, reading and
/// writing x and r once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sandwich<T: CpuElement>(
    x: &mut CpuBuffer,
    x_rows: Rows,
    residual: &mut CpuBuffer,
    residual_rows: Rows,
    post: &crate::RowWeight<'_>,
    pre: &crate::RowWeight<'_>,
    eps: f32,
    round_sum: bool,
) {
    let (post, pre) = (post.typed::<T>(), pre.typed::<T>());
    let hidden = x_rows.hidden;
    for_each_row_pair(x, x_rows, residual, residual_rows, "fused_sandwich_rms_norm", |x: &mut [T], r: &mut [T]| {
        with_scratch::<T, ()>(hidden, |h| {
            rms_norm_row(x, post, eps, h, false);
            if round_sum {
                add_into(h, r);
                rms_norm_row(r, pre, eps, x, false);
            } else {
                fused_row(RowOut::Separate { x: h, out: x }, r, pre, eps);
            }
        });
    });
}

/// Runs `f` on `len` values of this thread's scratch, which grows to the largest request seen and is
/// reused by later calls: no allocation or zeroing per call (the contents are unspecified).
pub(crate) fn with_scratch<T: bytemuck::Pod, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    thread_local! {
        static WORDS: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let words = (len * size_of::<T>()).div_ceil(size_of::<u64>());
    WORDS.with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut scratch) => {
            if scratch.len() < words {
                scratch.resize(words, 0);
            }
            f(&mut bytemuck::cast_slice_mut::<u64, T>(&mut scratch[..words])[..len])
        }
        // Re-entered on this thread (user code inside a row that runs a kernel): a fresh buffer.
        Err(_) => f(&mut bytemuck::cast_slice_mut::<u64, T>(&mut vec![0u64; words])[..len]),
    })
}

/// The size of this machine's largest CPU cache (Linux: from sysfs, read once), else 32 MiB.
pub(crate) fn last_level_cache_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        let read = |index: usize| -> Option<usize> {
            let path = format!("/sys/devices/system/cpu/cpu0/cache/index{index}/size");
            let text = std::fs::read_to_string(path).ok()?;
            let text = text.trim();
            let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
            let value: usize = digits.parse().ok()?;
            Some(match unit {
                "K" => value << 10,
                "M" => value << 20,
                "G" => value << 30,
                _ => value,
            })
        };
        (0..8).filter_map(read).max().unwrap_or(32 << 20)
    })
}

/// A norm's weight as a row reads it: none, in x's element type, or of another dtype (a
/// Gemma-style f32 weight on bf16 activations), widened to f32 once per call with the rounding of
/// its own dtype (the explicit rows take only the first two).
#[derive(Clone, Copy)]
pub(crate) enum Weight<'a, T> {
    None,
    Same(&'a [T]),
    Mixed(MixedWeight<'a>),
}

/// A weight of another dtype than x: its values as f32 (exact: f32, f16 and bf16 widen without
/// rounding) and the rounding to its dtype. The norm is applied in the weight's dtype, as native
/// does: `z = round_w(round_w(y) · w)`, then stored in x's dtype.
#[derive(Clone, Copy)]
pub(crate) struct MixedWeight<'a> {
    pub(crate) values: &'a [f32],
    pub(crate) round: fn(&mut [f32]),
}

/// One `rms_norm` row: the explicit SIMD row when the CPU has one and the weight is in x's type,
/// else the portable row (the same bits either way). `stream` asks for non-temporal output stores.
pub(crate) fn rms_norm_row<T: CpuElement>(x: &[T], weight: Weight<'_, T>, eps: f32, out: &mut [T], stream: bool) {
    match (weight, T::simd_rms_norm_row()) {
        (Weight::Mixed(w), _) => rms_norm_row_mixed(x, w, eps, out),
        (Weight::None, Some(row)) => row(x, None, eps, out, stream),
        (Weight::Same(w), Some(row)) => row(x, Some(w), eps, out, stream),
        (Weight::None, None) => rms_norm_row_portable::<T, T>(x, None, eps, out),
        (Weight::Same(w), None) => rms_norm_row_portable::<T, T>(x, Some(w), eps, out),
    }
}

/// One `fused_add_rms_norm` row (the norm in place or into another row), chosen as
/// [`rms_norm_row`] is.
pub(crate) fn fused_row<T: CpuElement>(x: RowOut<'_, T>, r: &mut [T], weight: Weight<'_, T>, eps: f32) {
    match (weight, T::simd_fused_row()) {
        (Weight::Mixed(w), _) => fused_row_mixed(x, r, w, eps),
        (Weight::None, Some(row)) => row(x, r, None, eps),
        (Weight::Same(w), Some(row)) => row(x, r, Some(w), eps),
        (Weight::None, None) => fused_row_portable::<T, T>(x, r, None, eps),
        (Weight::Same(w), None) => fused_row_portable::<T, T>(x, r, Some(w), eps),
    }
}

/// Stores `y = s · rstd` weighted in the weight's dtype: `round_w(round_w(y) · w)`, then rounded to
/// x's type. Products of two f16 or two bf16 values are exact in f32, and f32 products are rounded
/// once, so each `round_w` is the single rounding native makes.
#[inline(always)]
fn store_normalized_mixed<T: CpuElement>(s: &[f32], rstd: f32, weight: &[f32], round: fn(&mut [f32]), out: &mut [T]) {
    let mut y = [0f32; CHUNK];
    let y = &mut y[..s.len()];
    for (y, v) in y.iter_mut().zip(s) {
        *y = v * rstd;
    }
    round(y);
    for (y, w) in y.iter_mut().zip(weight) {
        *y *= *w;
    }
    round(y);
    T::store(y, out);
}

/// [`rms_norm_row_portable`] with a weight of another dtype ([`MixedWeight`]).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn rms_norm_row_mixed<T: CpuElement>(x: &[T], weight: MixedWeight<'_>, eps: f32, out: &mut [T]) {
    let rstd = rstd(x, None, eps);
    let mut a = [0f32; CHUNK];
    for (start, out) in (0..x.len()).step_by(CHUNK).zip(out.chunks_mut(CHUNK)) {
        let len = out.len();
        let values = T::widen(&x[start..start + len], &mut a[..len]);
        store_normalized_mixed(values, rstd, &weight.values[start..start + len], weight.round, out);
    }
}

/// [`fused_row_portable`] with a weight of another dtype ([`MixedWeight`]).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn fused_row_mixed<T: CpuElement>(mut x: RowOut<'_, T>, r: &mut [T], weight: MixedWeight<'_>, eps: f32) {
    let n = x.len();
    assert_eq!(r.len(), n, "row lengths agree");
    let (x, out) = x.pointers();
    // SAFETY: `x` points to `n` readable values (`RowOut`); the slice ends before the norm is written.
    let rstd = rstd(unsafe { std::slice::from_raw_parts(x, n) }, Some(r), eps);
    let mut a = [0f32; CHUNK];
    for (start, r) in (0..n).step_by(CHUNK).zip(r.chunks_mut(CHUNK)) {
        let len = r.len();
        let sum = &mut a[..len];
        // SAFETY: as in `fused_row_portable`: this chunk of x is read before the same chunk of the
        // norm, which may be the same memory, is written.
        add_widened(unsafe { std::slice::from_raw_parts(x.add(start), len) }, r, sum);
        T::store(sum, r);
        // SAFETY: `start + len <= n` values of the written row, no other borrow of them alive.
        let out = unsafe { std::slice::from_raw_parts_mut(out.add(start), len) };
        store_normalized_mixed(sum, rstd, &weight.values[start..start + len], weight.round, out);
    }
}

/// Elements widened to f32 at a time, in stack buffers (a multiple of [`LANES`]): the row kernels
/// need no heap scratch, and a row's second pass reads it from the L1 cache.
const CHUNK: usize = 128;

/// One row of `rms_norm` in two passes over x, [`CHUNK`] elements at a time: the sum of squares,
/// then widen again, normalize and store weighted. Compiled for AVX-512, AVX2 (+FMA, F16C) and NEON
/// besides the baseline, chosen at run time; the results are the same bits on every path (Rust never
/// contracts a multiply and an add into an FMA by itself) and the same as normalizing a widened copy
/// of the row (widen, sum, normalize: the rule every cpu norm follows).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub(crate) fn rms_norm_row_portable<T: CpuElement, W: CpuElement>(
    x: &[T],
    weight: Option<&[W]>,
    eps: f32,
    out: &mut [T],
) {
    let rstd = rstd(x, None, eps);
    let (mut a, mut w) = ([0f32; CHUNK], [0f32; CHUNK]);
    for (start, out) in (0..x.len()).step_by(CHUNK).zip(out.chunks_mut(CHUNK)) {
        let len = out.len();
        let values = T::widen(&x[start..start + len], &mut a[..len]);
        let weight = weight.map(|weight| W::widen(&weight[start..start + len], &mut w[..len]));
        T::store_normalized(values, rstd, weight, out);
    }
}

/// One row of `fused_add_rms_norm`: `r ← x + r` (rounded), `norm ← norm(x + r)` from the
/// unrounded f32 sum, the norm over x or into another row ([`RowOut`]). Two passes like
/// [`rms_norm_row_portable`]: the first only reads (the sum of squares of `x + r`), the second forms
/// each chunk's sum again (the same bits), then writes `r` and the norm.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub(crate) fn fused_row_portable<T: CpuElement, W: CpuElement>(
    mut x: RowOut<'_, T>,
    r: &mut [T],
    weight: Option<&[W]>,
    eps: f32,
) {
    let n = x.len();
    assert_eq!(r.len(), n, "row lengths agree");
    let (x, out) = x.pointers();
    // SAFETY: `x` points to `n` readable values (`RowOut`); the slice ends before the norm is written.
    let rstd = rstd(unsafe { std::slice::from_raw_parts(x, n) }, Some(r), eps);
    let (mut a, mut w) = ([0f32; CHUNK], [0f32; CHUNK]);
    for (start, r) in (0..n).step_by(CHUNK).zip(r.chunks_mut(CHUNK)) {
        let len = r.len();
        let sum = &mut a[..len];
        // SAFETY: `start + len <= n`; this chunk of x is read (and its borrow ends) before the same
        // chunk of the norm, which may be the same memory, is written.
        add_widened(unsafe { std::slice::from_raw_parts(x.add(start), len) }, r, sum);
        T::store(sum, r);
        let weight = weight.map(|weight| W::widen(&weight[start..start + len], &mut w[..len]));
        // SAFETY: `start + len <= n` values of the written row, no other borrow of them alive.
        T::store_normalized(sum, rstd, weight, unsafe { std::slice::from_raw_parts_mut(out.add(start), len) });
    }
}

/// `r ← x + r`, each sum rounded to `T` (the fused op's residual output), [`CHUNK`] values at a time.
pub(crate) fn add_into<T: CpuElement>(x: &[T], r: &mut [T]) {
    let mut sum = [0f32; CHUNK];
    for (x, r) in x.chunks(CHUNK).zip(r.chunks_mut(CHUNK)) {
        let sum = &mut sum[..r.len()];
        add_widened(x, r, sum);
        T::store(sum, r);
    }
}

/// `sum ← widen(x) + widen(r)`.
#[inline(always)]
pub(crate) fn add_widened<T: CpuElement>(x: &[T], r: &[T], sum: &mut [f32]) {
    let mut other = [0f32; CHUNK];
    T::load(x, sum);
    let r = T::widen(r, &mut other[..r.len()]);
    for (s, r) in sum.iter_mut().zip(r) {
        *s += *r;
    }
}

/// `len` values of the row `x` (or `x + r`) from `start`, as f32: `x` itself when it is f32.
#[inline(always)]
fn row_values<'a, T: CpuElement>(
    x: &'a [T],
    r: Option<&[T]>,
    start: usize,
    len: usize,
    buffer: &'a mut [f32; CHUNK],
) -> &'a [f32] {
    let x = &x[start..start + len];
    match r {
        None => T::widen(x, &mut buffer[..len]),
        Some(r) => {
            add_widened(x, &r[start..start + len], &mut buffer[..len]);
            &buffer[..len]
        }
    }
}

/// `1 / sqrt(mean(v²) + eps)` of the row `v = x` (or `v = x + r`, widened), [`CHUNK`] values at a
/// time: 32 lanes over the row's full 32-value groups in order, a fixed tree, then the tail (the
/// order every cpu norm and the explicit rows share), so the same bits as summing a widened
/// copy.
#[inline(always)]
pub(crate) fn rstd<T: CpuElement>(x: &[T], r: Option<&[T]>, eps: f32) -> f32 {
    let mut buffer = [0f32; CHUNK];
    let full = x.len() - x.len() % LANES;
    let mut lanes = [0f32; LANES];
    for start in (0..full).step_by(CHUNK) {
        for group in row_values(x, r, start, CHUNK.min(full - start), &mut buffer).chunks_exact(LANES) {
            let group: &[f32; LANES] = group.try_into().expect("chunks_exact yields LANES values");
            for i in 0..LANES {
                lanes[i] += group[i] * group[i];
            }
        }
    }
    rstd_from_lanes(lanes, x, r, eps)
}

/// Finishes [`rstd`] from the lanes accumulated over the row's full 32-value groups (by any path
/// that accumulates group j's value i into lane i, in order): the fixed tree, the tail, the mean,
/// and the f64 fallback for a row whose f32 sum overflowed.
#[inline(always)]
pub(crate) fn rstd_from_lanes<T: CpuElement>(mut lanes: [f32; LANES], x: &[T], r: Option<&[T]>, eps: f32) -> f32 {
    let n = x.len();
    let full = n - n % LANES;
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    let mut buffer = [0f32; CHUNK];
    let tail = row_values(x, r, full, n - full, &mut buffer);
    let sum = tail.iter().fold(lanes[0], |acc, value| acc + value * value);
    let mut mean_square = sum / n as f32;
    if mean_square.is_infinite() {
        mean_square = mean_square_f64_of(x, r);
    }
    1.0 / (mean_square + eps).sqrt()
}

/// The f32 sum overflowed (|x| above about 1.8e19 / sqrt(H)) although the mean square may fit:
/// native sums in f64 and rounds the mean once, so this rare row does the same, in order.
#[cold]
fn mean_square_f64_of<T: CpuElement>(x: &[T], r: Option<&[T]>) -> f32 {
    let n = x.len();
    let mut buffer = [0f32; CHUNK];
    let mut sum = 0f64;
    for start in (0..n).step_by(CHUNK) {
        let values = row_values(x, r, start, CHUNK.min(n - start), &mut buffer);
        sum = values.iter().fold(sum, |acc, &x| acc + f64::from(x) * f64::from(x));
    }
    (sum / n as f64) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lane_sum_is_close_to_f64() {
        for n in [1, 31, 32, 33, 769, 8199] {
            let v: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
            let mean: f64 = v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>() / n as f64;
            let exact = 1.0 / (mean + 1e-6).sqrt();
            let got = f64::from(rstd(&v, None, 1e-6));
            assert!((got - exact).abs() <= 1e-5 * exact, "n {n}: {got} vs {exact}");
        }
        // A row whose f32 sum of squares overflows (64 · 1e38) but whose mean square fits is summed
        // in f64.
        let huge = vec![1e19f32; 64];
        let got = f64::from(rstd(&huge, None, 0.0));
        assert!((got - 1e-19).abs() <= 1e-5 * 1e-19, "{got}");
    }

    /// The fused row through its two pointer forms, over the row (in place) and into another row,
    /// gives the same bits, a tail chunk included (`n` not a multiple of [`CHUNK`]): the raw-pointer
    /// slices of `fused_row_portable` on both paths (small enough for Miri, which CI runs on it).
    #[test]
    fn the_fused_row_in_place_and_into_another_row_agree() {
        fn check<T: CpuElement>(from_f32: impl Fn(f32) -> T) {
            let n = CHUNK + 7;
            let x: Vec<T> = (0..n).map(|i| from_f32((i as f32 * 0.37).sin() * 3.0)).collect();
            let r: Vec<T> = (0..n).map(|i| from_f32((i as f32 * 0.11).cos())).collect();
            let w: Vec<T> = (0..n).map(|i| from_f32(1.0 + i as f32 / n as f32)).collect();
            let (mut r_separate, mut out) = (r.clone(), x.clone());
            fused_row_portable(RowOut::Separate { x: &x, out: &mut out }, &mut r_separate, Some(&w), 1e-6);
            let (mut r_in_place, mut in_place) = (r.clone(), x.clone());
            fused_row_portable(RowOut::InPlace(&mut in_place), &mut r_in_place, Some(&w), 1e-6);
            let bits = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
            assert_eq!(bits(&out), bits(&in_place), "the norm");
            assert_eq!(bits(&r_separate), bits(&r_in_place), "the residual");
            assert_ne!(bits(&r_in_place), bits(&r), "the residual was written");
        }
        check::<f32>(|v| v);
        check::<half::bf16>(half::bf16::from_f32);
        check::<half::f16>(half::f16::from_f32);
    }

    /// The mixed-weight fused row (its raw-pointer slices, on both pointer forms) agrees with the
    /// mixed-weight norm of the sum, and rounds the weighted value in the weight's dtype: an f32
    /// weight on bf16 rows keeps `y · w` unrounded until the bf16 store (small enough for Miri).
    #[test]
    fn the_mixed_weight_rows_round_in_the_weights_dtype() {
        let n = CHUNK + 5;
        let x: Vec<half::bf16> = (0..n).map(|i| half::bf16::from_f32((i as f32 * 0.37).sin() * 3.0)).collect();
        let r: Vec<half::bf16> = (0..n).map(|i| half::bf16::from_f32((i as f32 * 0.11).cos())).collect();
        let w: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 / 3.0 / n as f32).collect();
        let weight = MixedWeight { values: &w, round: <f32 as CpuElement>::round_in_place };
        let (mut r_separate, mut out) = (r.clone(), x.clone());
        fused_row_mixed(RowOut::Separate { x: &x, out: &mut out }, &mut r_separate, weight, 1e-6);
        let (mut r_in_place, mut in_place) = (r.clone(), x.clone());
        fused_row_mixed(RowOut::InPlace(&mut in_place), &mut r_in_place, weight, 1e-6);
        assert_eq!(out, in_place, "the norm, both pointer forms");
        assert_eq!(r_separate, r_in_place, "the residual, both pointer forms");
        // The sum as f32 (what the fused row normalizes), normalized by the plain row.
        let sum: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a.to_f32() + b.to_f32()).collect();
        let mut normalized = vec![0f32; n];
        rms_norm_row_mixed(&sum, weight, 1e-6, &mut normalized);
        let expected: Vec<half::bf16> = normalized.iter().map(|&v| half::bf16::from_f32(v)).collect();
        assert_eq!(out, expected, "the fused row normalizes the f32 sum");
        // y · w in f32, rounded once to bf16: not y rounded to bf16 first.
        let rstd = rstd(&sum, None, 1e-6);
        let once: Vec<half::bf16> = sum.iter().zip(&w).map(|(s, w)| half::bf16::from_f32((s * rstd) * w)).collect();
        assert_eq!(out, once);
    }

    #[test]
    fn task_size() {
        assert_eq!(rows_per_task(4096, 2), 32);
        assert_eq!(rows_per_task(65536, 4), 1);
        assert_eq!(rows_per_task(8, 2), 16384);
    }
}
