//! The driver of the gated activations (`x: [..., 2d]` → `act(gate) * up: [..., d]`) and their
//! activations, in f32.
//!
//! Each row: widen the gate and up halves into f32 scratch, let the op's [`GateRow`] turn the gate
//! into the activation (in f32, with rten-vecmath's vectorized exp, erf and tanh), round it to the
//! element type, multiply by the up half and round once more on the store: the rounding points of
//! the reference. Rows are split across threads as
//! the norms are ([`BYTES_PER_TASK`](crate::BYTES_PER_TASK)); each row's result depends on that row
//! only.

use ir_core::kernel::{GatedGeometry, Rows, gated_support};
use ir_core::op::gelu_and_mul::Approximate;
use ir_core::storage::CpuBuffer;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Tensor};
use rayon::prelude::*;
use rten_simd::SimdUnaryOp;

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
    fn activate_into(&self, gate: &[f32], out: &mut [f32], round: fn(&mut [f32])) {
        out.copy_from_slice(gate);
        self.activate(out, round);
    }
}

/// `out ← op(gate)` with rten-vecmath's vectorized `op`, `out` fully overwritten.
fn map_into(op: impl SimdUnaryOp<f32>, gate: &[f32], out: &mut [f32]) {
    // SAFETY: `MaybeUninit<f32>` has f32's layout, and `map` writes only initialized values (every
    // element of `out`), so `out` stays initialized.
    let uninit = unsafe { &mut *(std::ptr::from_mut(out) as *mut [std::mem::MaybeUninit<f32>]) };
    op.map(gate, uninit);
}

/// `silu(g) = g / (1 + e^-g)`.
#[derive(Clone, Copy, Debug)]
pub struct Silu;

impl GateRow for Silu {
    fn activate(&self, gate: &mut [f32], _: fn(&mut [f32])) {
        rten_vecmath::Silu {}.map_mut(gate);
    }

    fn activate_into(&self, gate: &[f32], out: &mut [f32], _: fn(&mut [f32])) {
        map_into(rten_vecmath::Silu {}, gate, out);
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
            Approximate::None => map_into(rten_vecmath::Gelu {}, gate, out),
            Approximate::Tanh => map_into(rten_vecmath::ApproxGelu {}, gate, out),
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
    fn activate(&self, gate: &mut [f32], round: fn(&mut [f32])) {
        let n = gate.len() as f64;
        let mean = lane_sum(gate, |g| g) / n;
        let variance = lane_sum(gate, |g| (g - mean) * (g - mean)) / n;
        let mut stats = [mean as f32, variance.sqrt() as f32];
        round(&mut stats);
        let mut shift = [(f64::from(stats[1]) * self.std_multiplier) as f32];
        round(&mut shift);
        let mut cutoff = [stats[0] + shift[0]];
        round(&mut cutoff);
        gate.iter_mut().for_each(|g| *g -= cutoff[0]);
        round(gate);
        gate.iter_mut().for_each(|g| {
            if *g < 0.0 {
                *g = 0.0;
            }
        });
        gelu_in_place(gate, self.approximate);
    }
}

/// Σ f(v) over `values` in f64, over 8 independent lanes reduced in a fixed order (so it vectorizes;
/// a single f64 accumulator is bound by the latency of each addition).
#[inline(always)]
fn lane_sum(values: &[f32], f: impl Fn(f64) -> f64) -> f64 {
    const LANES: usize = 8;
    let mut lanes = [0f64; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f(f64::from(v));
        }
    }
    let total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    tail.iter().fold(total, |acc, &v| acc + f(f64::from(v)))
}

/// `gelu` over a row, in f32, vectorized (the SIMD width of the machine, chosen at run time).
pub fn gelu_in_place(v: &mut [f32], approximate: Approximate) {
    match approximate {
        Approximate::None => rten_vecmath::Gelu {}.map_mut(v),
        Approximate::Tanh => rten_vecmath::ApproxGelu {}.map_mut(v),
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
fn gated_row<T: CpuElement, G: GateRow>(
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
