//! The driver of the gated activations (`x: [..., 2d]` → `act(gate) * up: [..., d]`) and their
//! activations, in f32.
//!
//! Each row: widen the gate and up halves into f32 scratch, let the op's [`GateRow`] turn the gate
//! into the activation (in f32, vectorized: rten-vecmath's silu, and this crate's gelu forms, which
//! keep their accuracy in the negative tail), round it to the
//! element type, multiply by the up half and round once more on the store: the rounding points of
//! the reference. Rows are split across threads as
//! the norms are ([`BYTES_PER_TASK`](crate::BYTES_PER_TASK)); each row's result depends on that row
//! only.

use ir_core::storage::CpuBuffer;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Tensor};
use ir_ops::gelu_and_mul::Approximate;
use kernel_support::{GatedGeometry, Rows, gated_support};
use rayon::prelude::*;
use rten_simd::SimdUnaryOp;

use crate::activation::{GeluErf, GeluTanh};
use crate::element::CpuElement;
use crate::rows::{rows_per_task, with_scratch};

/// What a gated op does to one row's gate before the product: replace `gate` (f32, widened from
/// the stored values) with the activation. `round` rounds values to the element type, for ops with
/// intermediate rounding points.
pub trait GateRow: Sync {
    /// Turns the gate into the activation, in place.
    fn activate(&self, gate: &mut [f32], round: fn(&mut [f32]));

    /// Writes the activation of `gate` into `out` (same length). This default copies, then
    /// activates in place; element-wise activations read `gate` where it is (an f32 row straight
    /// from the tensor, without a copy).
    #[inline(always)]
    fn activate_into(&self, gate: &[f32], out: &mut [f32], round: fn(&mut [f32])) {
        out.copy_from_slice(gate);
        self.activate(out, round);
    }
}

/// `out ← op(gate)` with a vectorized `op`, `out` fully overwritten.
pub(crate) fn map_into(op: &impl SimdUnaryOp<f32>, gate: &[f32], out: &mut [f32]) {
    // SAFETY: `MaybeUninit<f32>` has f32's layout, and `map` writes only initialized values (every
    // element of `out`), so `out` stays initialized.
    let uninit = unsafe { &mut *(std::ptr::from_mut(out) as *mut [std::mem::MaybeUninit<f32>]) };
    op.map(gate, uninit);
}

/// `values ← op(values)` with a vectorized `op`, through a stack copy of each chunk (rten-simd's own
/// in-place map reads through a shared view of the slice it writes, which Miri's Stacked Borrows
/// rejects; a chunk of 256 values stays in L1).
fn map_in_place(op: &impl SimdUnaryOp<f32>, values: &mut [f32]) {
    let mut copy = [0f32; 256];
    for chunk in values.chunks_mut(copy.len()) {
        let source = &mut copy[..chunk.len()];
        source.copy_from_slice(chunk);
        map_into(op, source, chunk);
    }
}

/// `silu(g) = g / (1 + e^-g)`.
#[derive(Clone, Copy, Debug)]
pub struct Silu;

impl GateRow for Silu {
    fn activate(&self, gate: &mut [f32], _: fn(&mut [f32])) {
        map_in_place(&rten_vecmath::Silu {}, gate);
    }

    fn activate_into(&self, gate: &[f32], out: &mut [f32], _: fn(&mut [f32])) {
        map_into(&rten_vecmath::Silu {}, gate, out);
    }
}

/// `gelu(g)` with the erf or the tanh form.
#[derive(Clone, Copy, Debug)]
pub struct Gelu(pub Approximate);

impl GateRow for Gelu {
    fn activate(&self, gate: &mut [f32], _: fn(&mut [f32])) {
        gelu_in_place(gate, self.0);
    }

    fn activate_into(&self, gate: &[f32], out: &mut [f32], _: fn(&mut [f32])) {
        match self.0 {
            Approximate::None => map_into(&GeluErf, gate, out),
            Approximate::Tanh => map_into(&GeluTanh, gate, out),
        }
    }
}

/// `gelu_and_mul_sparse`'s gate: `gelu(relu(round(g - cutoff)))`, with the row's cutoff
/// `round(round(mean) + round(round(std) · std_multiplier))`; the mean and the (biased) std are
/// summed in f64, as native does, so the rounded cutoff agrees with native's.
#[derive(Clone, Copy, Debug)]
pub struct SparseGelu {
    /// Standard deviations above the mean.
    pub std_multiplier: f64,
    /// The gelu formula.
    pub approximate: Approximate,
}

impl GateRow for SparseGelu {
    // Inlined into the multiversioned row, so the passes compile for its instruction set.
    #[inline(always)]
    fn activate(&self, gate: &mut [f32], round: fn(&mut [f32])) {
        let cutoff = self.cutoff(gate, round);
        gate.iter_mut().for_each(|g| *g -= cutoff);
        self.finish(gate, round);
    }

    /// The gate read where it is: `out = gate − cutoff` is the first write of `out`.
    #[inline(always)]
    fn activate_into(&self, gate: &[f32], out: &mut [f32], round: fn(&mut [f32])) {
        let cutoff = self.cutoff(gate, round);
        for (o, g) in out.iter_mut().zip(gate) {
            *o = g - cutoff;
        }
        self.finish(out, round);
    }
}

impl SparseGelu {
    /// The row's cutoff `round(round(mean) + round(round(std) · std_multiplier))`.
    #[inline(always)]
    fn cutoff(&self, gate: &[f32], round: fn(&mut [f32])) -> f32 {
        let n = gate.len() as f64;
        let mean = row_sum(gate, None) / n;
        let variance = row_sum(gate, Some(mean)) / n;
        let mut stats = [mean as f32, variance.sqrt() as f32];
        round(&mut stats);
        let mut shift = [(f64::from(stats[1]) * self.std_multiplier) as f32];
        round(&mut shift);
        let mut cutoff = [stats[0] + shift[0]];
        round(&mut cutoff);
        cutoff[0]
    }

    /// `gelu(relu(round(s)))` of the shifted gate `s`, in place.
    #[inline(always)]
    fn finish(&self, shifted: &mut [f32], round: fn(&mut [f32])) {
        round(shifted);
        shifted.iter_mut().for_each(|g| {
            if *g < 0.0 {
                *g = 0.0;
            }
        });
        #[cfg(target_arch = "x86_64")]
        if crate::row_path().is_avx512() {
            return sparse_gelu_avx512(shifted, self.approximate);
        }
        gelu_in_place(shifted, self.approximate);
    }
}

/// `gelu` in place of a row most of whose values are ±0 (the sparse gate after its relu): only the
/// others (NaN included), packed with AVX-512, go through gelu and back. gelu is elementwise and
/// keeps ±0 as they are (tested), so the bits are those of `gelu_in_place` over the whole row,
/// for about a twentieth of its work at Gemma 3n's 95% sparsity.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn sparse_gelu_avx512(row: &mut [f32], approximate: Approximate) {
    const BLOCK: usize = 1024;
    let mut packed = [0f32; BLOCK + 16];
    let mut indices = [0u32; BLOCK + 16];
    for block in row.chunks_mut(BLOCK) {
        // SAFETY: the AVX-512 row path is chosen only where AVX-512F is available; both buffers hold
        // the block's length + 16.
        let n = unsafe { crate::avx512::pack_nonzero(block, &mut packed, &mut indices) };
        if n == 0 {
            continue;
        }
        gelu_in_place(&mut packed[..n], approximate);
        for (&value, &index) in packed[..n].iter().zip(&indices[..n]) {
            block[index as usize] = value;
        }
    }
}

/// `Σ v` (`center` `None`) or `Σ (v − center)²` over `values` in f64 ([`lane_sum`]'s order): with
/// explicit AVX-512 where the row path is (the compiler keeps [`lane_sum`]'s lanes in 128-bit
/// registers), the same bits.
#[inline(always)]
fn row_sum(values: &[f32], center: Option<f64>) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::row_path().is_avx512() {
        // SAFETY: the AVX-512 row path is chosen only where AVX-512F is available.
        return unsafe { crate::avx512::lane_sum_f64(values, center) };
    }
    match center {
        Some(center) => lane_sum(values, |v| (v - center) * (v - center)),
        None => lane_sum(values, |v| v),
    }
}

/// Σ f(v) over `values` in f64, over 32 independent lanes (element i into lane i mod 32, in order)
/// reduced in a fixed pairwise order, then the tail in order: the same bits on every instruction
/// set. Fixed-size chunks let the compiler keep the lanes in four vector registers; with eight
/// lanes it kept them in 128-bit halves and one dependent chain bound the loop.
#[inline(always)]
fn lane_sum(values: &[f32], f: impl Fn(f64) -> f64) -> f64 {
    const LANES: usize = 32;
    let mut lanes = [0f64; LANES];
    let (chunks, tail) = values.as_chunks::<LANES>();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f(f64::from(v));
        }
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    tail.iter().fold(lanes[0], |acc, &v| acc + f(f64::from(v)))
}

/// `gelu` over a row, in f32, vectorized (the SIMD width of the machine, chosen at run time), with
/// forms that keep their relative accuracy in the negative tail (no `1 + tanh` or `1 + erf` that
/// cancels; see `docs/kernels.md`).
pub fn gelu_in_place(v: &mut [f32], approximate: Approximate) {
    match approximate {
        Approximate::None => map_in_place(&GeluErf, v),
        Approximate::Tanh => map_in_place(&GeluTanh, v),
    }
}

/// The `supports` predicate and spec of every gated op on the cpu.
pub(crate) fn spec() -> ImplSpec {
    ImplSpec::new(crate::PROVIDER).with_supports(|args| gated_support(args, DeviceKind::Cpu))
}

/// Runs a gated op on the cpu: a fresh compact `[..., d]` output.
pub fn run(x: &Tensor, gate: impl GateRow) -> Result<Tensor, KernelError> {
    let geometry = GatedGeometry::of(x.meta())?;
    let empty = geometry.is_empty();
    let GatedGeometry { rows, out_layout, .. } = geometry;
    // Every element of the compact output is written (or there are none).
    let mut out = Tensor::empty_with_layout(x.dtype(), out_layout)?;
    if empty {
        return Ok(out);
    }
    let x_buffer = x.cpu_buffer().ok_or_else(|| crate::not_on_cpu("x"))?;
    let out_buffer = out.cpu_buffer_mut()?.ok_or_else(|| crate::not_on_cpu("out"))?;
    match x.dtype() {
        DType::F32 => gated::<f32, _>(x_buffer, rows, out_buffer, &gate),
        DType::F16 => gated::<half::f16, _>(x_buffer, rows, out_buffer, &gate),
        DType::BF16 => gated::<half::bf16, _>(x_buffer, rows, out_buffer, &gate),
        other => return Err(crate::unsupported_dtype(other)),
    }
    Ok(out)
}

fn gated<T: CpuElement, G: GateRow>(x: &CpuBuffer, rows: Rows, out: &mut CpuBuffer, gate: &G) {
    let d = rows.hidden / 2;
    let x_data = &x.typed::<T>()[rows.offset..rows.offset + rows.span()];
    let out_data = &mut out.typed_mut::<T>()[..rows.n_rows * d];
    // An output larger than the last-level cache is streamed past it (as the norms' is).
    let stream = size_of_val(out_data) > crate::rows::last_level_cache_bytes();
    let task = |(index, out_row): (usize, &mut [T])| {
        let start = index * rows.row_stride;
        let (g, u) = (&x_data[start..start + d], &x_data[start + d..start + 2 * d]);
        // Whole rows in this thread's reused scratch. Activating a row in 256-value stack chunks
        // instead was 50% slower at 4096×4096 f32 (9.3 against 6.1 ms, alternating runs).
        with_scratch(2 * d, |scratch: &mut [f32]| {
            let (a, b) = scratch.split_at_mut(d);
            gated_row(g, u, a, b, gate, out_row, stream);
        });
    };
    let per_task = rows_per_task(rows.hidden, size_of::<T>());
    if rows.n_rows <= per_task {
        out_data.chunks_mut(d).enumerate().for_each(task);
        return;
    }
    tracing::debug!(target: "kernels_cpu", rows = rows.n_rows, per_task, "gated activation split across threads");
    out_data.par_chunks_mut(d).enumerate().with_min_len(per_task).for_each(task);
}

/// One row: `out = round(round(act(g)) · u)`, stored with non-temporal stores when `stream`.
/// Multiversioned like the norm rows.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub(crate) fn gated_row<T: CpuElement, G: GateRow>(
    g: &[T],
    u: &[T],
    a: &mut [f32],
    up: &mut [f32],
    gate: &G,
    out: &mut [T],
    stream: bool,
) {
    // The gate as f32 (an f32 row is read where it is; others are widened into `up`, free until the
    // product), activated into `a` and rounded to the element type.
    let g = T::widen(g, up);
    gate.activate_into(g, a, T::round_in_place);
    T::round_in_place(a);
    // The product in stack-sized chunks: the up half is read once, where it is for f32.
    let mut widened = [0f32; PRODUCT_CHUNK];
    for ((a, u), out) in a.chunks_mut(PRODUCT_CHUNK).zip(u.chunks(PRODUCT_CHUNK)).zip(out.chunks_mut(PRODUCT_CHUNK)) {
        let u = T::widen(u, &mut widened[..u.len()]);
        for (a, u) in a.iter_mut().zip(u) {
            *a *= *u;
        }
        if stream {
            T::store_streaming(a, out);
        } else {
            T::store(a, out);
        }
    }
    if stream {
        crate::element::fence_streaming();
    }
}

/// Elements of the product `act · up` formed at a time in [`gated_row`].
const PRODUCT_CHUNK: usize = 256;

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// A deterministic row: values of mixed magnitudes and signs, a share `zeros` of them ±0 and,
    /// when `specials`, NaN and infinities among them.
    fn row(len: usize, seed: u64, zeros: f64, specials: bool) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
                let value = ((unit - 0.5) * 8.0 * 2f64.powi((i % 7) as i32 - 3)) as f32;
                match (specials, i % 97) {
                    (true, 5) => f32::NAN,
                    (true, 11) => f32::INFINITY,
                    (true, 13) => f32::NEG_INFINITY,
                    _ if unit < zeros / 2.0 => 0.0,
                    _ if unit < zeros => -0.0,
                    _ => value,
                }
            })
            .collect()
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    fn avx512() -> bool {
        let available = crate::avx512::available();
        if !available {
            eprintln!("skipped: this CPU has no AVX-512F, so only the portable sparse gate runs here");
        }
        available
    }

    #[test]
    fn the_avx512_row_sums_are_the_portable_lane_sums_bit_for_bit() {
        if !avx512() {
            return;
        }
        for len in (0..200).chain([4096, 4096 + 7, 8191]) {
            for specials in [false, true] {
                let values = row(len, len as u64 + 1, 0.1, specials);
                let mean = lane_sum(&values, |v| v) / len.max(1) as f64;
                // SAFETY: AVX-512F was detected above.
                let (sum, squares) = unsafe {
                    (crate::avx512::lane_sum_f64(&values, None), crate::avx512::lane_sum_f64(&values, Some(mean)))
                };
                let what = format!("len {len}, specials {specials}");
                assert_eq!(sum.to_bits(), lane_sum(&values, |v| v).to_bits(), "{what}: sum");
                let portable = lane_sum(&values, |v| (v - mean) * (v - mean));
                assert_eq!(squares.to_bits(), portable.to_bits(), "{what}: squares");
            }
        }
    }

    #[test]
    fn packing_keeps_every_value_but_the_zeros_in_order() {
        if !avx512() {
            return;
        }
        for len in [0, 1, 15, 16, 17, 100, 1024] {
            for zeros in [0.0, 0.5, 0.95, 1.0] {
                let values = row(len, 7 + len as u64, zeros, true);
                let (mut packed, mut indices) = (vec![0f32; len + 16], vec![0u32; len + 16]);
                // SAFETY: AVX-512F was detected above; both buffers hold len + 16.
                let n = unsafe { crate::avx512::pack_nonzero(&values, &mut packed, &mut indices) };
                let expected: Vec<(u32, u32)> = values
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| **v != 0.0)
                    .map(|(i, v)| (i as u32, v.to_bits()))
                    .collect();
                let got: Vec<(u32, u32)> =
                    indices[..n].iter().zip(&packed[..n]).map(|(i, v)| (*i, v.to_bits())).collect();
                assert_eq!(got, expected, "len {len}, zeros {zeros}");
            }
        }
    }

    #[test]
    fn the_packed_gelu_gives_the_bits_of_gelu_over_the_whole_row() {
        if !avx512() {
            return;
        }
        for approximate in [Approximate::None, Approximate::Tanh] {
            for (len, zeros) in [(4096, 0.95), (4096, 0.0), (3000, 0.5), (1024 + 5, 1.0), (33, 0.9)] {
                let values = row(len, len as u64 * 3 + 1, zeros, true);
                let mut whole = values.clone();
                gelu_in_place(&mut whole, approximate);
                let mut packed = values.clone();
                sparse_gelu_avx512(&mut packed, approximate);
                // Also: gelu keeps ±0 as they are, which skipping them relies on.
                assert_eq!(bits(&packed), bits(&whole), "{approximate:?}, len {len}, zeros {zeros}");
            }
        }
    }
}
