//! fp8 quantization on the cpu: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! Each row is widened into f32 scratch; the dynamic op reduces its absmax there (`f32::max`, which
//! skips NaN as the reference does), then every element is divided by the row's scale in f32 and
//! converted to fp8 with `Fp8::encode`, a branch-free form of the saturating nearest-even
//! conversion that vectorizes (the `float8` crate's conversion, which native uses, goes through
//! f64 one branchy element at a time: 3.4 ns an element on the development machine, against 0.3 ns); its tests compare the two on every
//! f32 that decides a rounding. The rounding points are those of [`ir_ops::quant`], so results
//! are bit-identical to native. Rows are split across threads as the norms are.

use ir_core::storage::CpuBuffer;
use ir_core::storage::Storage;
use ir_core::{DType, DeviceKind, FP8_NAN, ImplSpec, KernelError, OperandMismatch, Tensor, UniqueTensor};
use ir_ops::quant::min_scale;
use kernel_support::{Rows, host_scale, per_token_scales_shape, quant_support};
use rayon::prelude::*;

use crate::element::{CpuElement, RowOut};
use crate::rows::{Weight, add_into, fused_row, rms_norm_row, rows_per_task, with_scratch};
use ir_ops::Rounding;

/// The `supports` predicate and spec of the quantization ops on the cpu.
pub(crate) fn spec() -> ImplSpec {
    ImplSpec::new(crate::PROVIDER).with_supports(|args| quant_support(args, DeviceKind::Cpu))
}

/// How a row's scale is found.
#[derive(Clone, Copy, Debug)]
enum RowScale {
    /// The same scale for every row, divided by, or multiplied by its f32 reciprocal when `invert`
    /// (`rounding = "dtype"`).
    Static { s: f32, invert: bool },
    /// From the row's absmax, bounded by `ub`, floored at `floor`, divided by the format's maximum.
    Dynamic { ub: Option<f32>, max: f32, floor: f32 },
}

/// `static_scaled_fp8_quant` on the cpu: a fresh compact output in `out_dtype`.
pub fn static_scaled_fp8_quant_cpu(
    x: &Tensor,
    scale: &Tensor,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<Tensor, KernelError> {
    Ok(quantize(x, None, None, static_scale(scale, rounding)?, out_dtype)?.q)
}

/// A static scale applied as `rounding` says.
fn static_scale(scale: &Tensor, rounding: Rounding) -> Result<RowScale, KernelError> {
    Ok(RowScale::Static { s: host_scale(scale, "scale")?, invert: rounding.inverts_scale() })
}

/// `dynamic_per_token_scaled_fp8_quant` on the cpu: fresh compact `(q, scales)`.
pub fn dynamic_per_token_scaled_fp8_quant_cpu(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let done = quantize(x, None, None, dynamic_scale(scale_ub, out_dtype)?, out_dtype)?;
    Ok((done.q, done.scales))
}

/// `rms_norm_static_fp8_quant` on the cpu: each row normalized (the cpu `rms_norm` row, rounded
/// to x's dtype in a row buffer) and quantized in one pass; a fresh compact output.
pub fn rms_norm_static_fp8_quant_cpu(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    scale: &Tensor,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<Tensor, KernelError> {
    let norm = Norm { weight, eps: epsilon as f32, round_sum: false };
    Ok(quantize(x, Some(norm), None, static_scale(scale, rounding)?, out_dtype)?.q)
}

/// `rms_norm_dynamic_per_token_quant` on the cpu: fresh compact `(q, scales)`.
pub fn rms_norm_dynamic_per_token_quant_cpu(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
    _rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    // `rounding` changes nothing without a residual and with per-token scales.
    let norm = Norm { weight, eps: epsilon as f32, round_sum: false };
    let done = quantize(x, Some(norm), None, dynamic_scale(scale_ub, out_dtype)?, out_dtype)?;
    Ok((done.q, done.scales))
}

/// `fused_add_rms_norm_static_fp8_quant` on the cpu, in place on the residual: each row is added,
/// its sum written back into `x_residual` (the residual output, in the residual's layout),
/// normalized and quantized in one pass (the cpu `fused_add_rms_norm` row). Returns
/// `(residual_out, q)`, `q` fresh and compact.
pub fn fused_add_rms_norm_static_fp8_quant_cpu(
    x: &Tensor,
    mut x_residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    scale: &Tensor,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let r_rows = residual_rows(x, &x_residual)?;
    let norm = Norm { weight, eps: epsilon as f32, round_sum: rounding.rounds_intermediates(x.dtype()) };
    let scale = static_scale(scale, rounding)?;
    let Storage::Cpu(r_buffer) = x_residual.storage_mut()? else { return Err(crate::not_on_cpu("x_residual")) };
    let done = quantize(x, Some(norm), Some((r_buffer, r_rows)), scale, out_dtype)?;
    Ok((x_residual.into_tensor(), done.q))
}

/// `fused_add_rms_norm_dynamic_per_token_quant` on the cpu, in place on the residual: each row is
/// added, its sum written back into `x_residual` (in the residual's layout), normalized, its absmax
/// reduced and quantized in one pass. Returns `(residual_out, q, scales)`, `q` and `scales` fresh
/// and compact.
pub fn fused_add_rms_norm_dynamic_per_token_quant_cpu(
    x: &Tensor,
    mut x_residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<(Tensor, Tensor, Tensor), KernelError> {
    let r_rows = residual_rows(x, &x_residual)?;
    let norm = Norm { weight, eps: epsilon as f32, round_sum: rounding.rounds_intermediates(x.dtype()) };
    let scale = dynamic_scale(scale_ub, out_dtype)?;
    let Storage::Cpu(r_buffer) = x_residual.storage_mut()? else { return Err(crate::not_on_cpu("x_residual")) };
    let done = quantize(x, Some(norm), Some((r_buffer, r_rows)), scale, out_dtype)?;
    Ok((x_residual.into_tensor(), done.q, done.scales))
}

/// The rows of an in-place residual, which must have x's shape and dtype.
fn residual_rows(x: &Tensor, x_residual: &UniqueTensor) -> Result<Rows, KernelError> {
    let r_meta = x_residual.tensor().meta();
    if r_meta.dtype != x.dtype() || r_meta.shape() != x.shape() {
        return Err(OperandMismatch::error("x_residual", r_meta, "x", x.meta()));
    }
    Rows::for_kernel(r_meta)
}

/// An fp8 format's parameters and its branch-free conversion from f32.
pub(crate) trait Fp8: Send + Sync {
    /// Mantissa bits.
    const M: u32;
    /// Exponent bias.
    const BIAS: u32;
    /// Largest finite value.
    const MAX: f32;

    /// The code of `f`: every NaN is the canonical NaN [`FP8_NAN`], magnitudes clamp to the largest finite value (saturation,
    /// infinities included; nearest-even rounding of a value at most the largest never exceeds
    /// it), then round to nearest-even:
    /// - in the normal range, on the f32 bits: add half an fp8 step less one (plus one when the
    ///   kept part is odd) and shift, the bf16 rounding trick, then rebias the exponent;
    /// - below it, in whole smallest subnormals: scale exactly by a power of two and add 2^23, so
    ///   the f32 addition rounds to an integer (nearest-even) that lands in the mantissa bits.
    ///
    /// No float-to-integer conversion and no branch: the loop vectorizes.
    #[inline(always)]
    fn encode(f: f32) -> u8 {
        let bits = f.to_bits();
        let sign = (bits >> 24) & 0x80;
        let a = f.abs().min(Self::MAX);
        let ab = a.to_bits();
        let shift = 23 - Self::M;
        let rounded = (ab + ((1 << (shift - 1)) - 1) + ((ab >> shift) & 1)) >> shift;
        let normal = rounded.wrapping_sub((127 - Self::BIAS) << Self::M);
        // The smallest subnormal is 2^(1 - BIAS - M); scale by its inverse.
        let to_units = f32::from_bits((127 + Self::BIAS + Self::M - 1) << 23);
        let subnormal = (a * to_units + 8_388_608.0).to_bits() - 0x4b00_0000;
        let min_normal = f32::from_bits((128 - Self::BIAS) << 23);
        let code = if a < min_normal { subnormal } else { normal };
        if f.is_nan() { FP8_NAN } else { (sign | code) as u8 }
    }
}

/// OCP E4M3FN.
pub(crate) struct E4M3;

impl Fp8 for E4M3 {
    const M: u32 = 3;
    const BIAS: u32 = 7;
    const MAX: f32 = 448.0;
}

/// OCP E5M2.
pub(crate) struct E5M2;

impl Fp8 for E5M2 {
    const M: u32 = 2;
    const BIAS: u32 = 15;
    const MAX: f32 = 57344.0;
}

fn not_fp8(dtype: DType) -> KernelError {
    KernelError::NotFp8 { dtype }
}

fn dynamic_scale(scale_ub: Option<&Tensor>, out_dtype: DType) -> Result<RowScale, KernelError> {
    let ub = scale_ub.map(|t| host_scale(t, "scale_ub")).transpose()?;
    let max = out_dtype.fp8_max().ok_or_else(|| not_fp8(out_dtype))? as f32;
    Ok(RowScale::Dynamic { ub, max, floor: min_scale(out_dtype) })
}

/// The norm in front of a fused quantization: the weight, epsilon, and whether the norm reads the
/// sum rounded to x's dtype (`rounding = "dtype"` with a residual, 16-bit x).
struct Norm<'a> {
    weight: Option<&'a Tensor>,
    eps: f32,
    round_sum: bool,
}

/// What [`quantize`] produces: `q` and the per-row scales (a static call's scale per row).
struct Quantized {
    q: Tensor,
    scales: Tensor,
}

/// Quantizes x's rows, normalized first when `norm` is given, after adding the residual rows (which
/// then receive the sum, in place) when `residual` is given.
fn quantize(
    x: &Tensor,
    norm: Option<Norm<'_>>,
    residual: Option<(&mut CpuBuffer, Rows)>,
    scale: RowScale,
    out_dtype: DType,
) -> Result<Quantized, KernelError> {
    quantize_rows(x, norm, residual, scale, out_dtype, false)
}

/// [`quantize`], or with `gated` the quantization of `silu_and_mul(x)`: x's rows are `[gate | up]`
/// and q has half their width.
fn quantize_rows(
    x: &Tensor,
    norm: Option<Norm<'_>>,
    residual: Option<(&mut CpuBuffer, Rows)>,
    scale: RowScale,
    out_dtype: DType,
    gated: bool,
) -> Result<Quantized, KernelError> {
    let rows = Rows::for_kernel(x.meta())?;
    let mut q_shape = x.shape().to_vec();
    if gated && let Some(last) = q_shape.last_mut() {
        *last /= 2;
    }
    // Every element of q is written (rows of no elements have none); the scales are small.
    let mut q = Tensor::empty_with_layout(out_dtype, ir_core::Layout::compact(&q_shape))?;
    let mut scales = Tensor::zeros(DType::F32, &per_token_scales_shape(x.shape()))?;
    if rows.n_rows > 0 {
        let weight = crate::RowWeight::of(norm.as_ref().and_then(|n| n.weight), x.dtype())?;
        let inputs = RowInputs {
            x: x.cpu_buffer().ok_or_else(|| crate::not_on_cpu("x"))?,
            rows,
            weight: &weight,
            eps: norm.as_ref().map(|n| n.eps),
            round_sum: norm.as_ref().is_some_and(|n| n.round_sum),
            scale,
            gated,
        };
        let outputs = RowOutputs {
            q: q.cpu_buffer_mut()?.ok_or_else(|| crate::not_on_cpu("q"))?,
            scales: scales.cpu_buffer_mut()?.ok_or_else(|| crate::not_on_cpu("scales"))?,
            residual,
        };
        match (x.dtype(), out_dtype) {
            (DType::F32, DType::F8E4M3FN) => rows_of::<f32, E4M3>(inputs, outputs),
            (DType::F16, DType::F8E4M3FN) => rows_of::<half::f16, E4M3>(inputs, outputs),
            (DType::BF16, DType::F8E4M3FN) => rows_of::<half::bf16, E4M3>(inputs, outputs),
            (DType::F32, DType::F8E5M2) => rows_of::<f32, E5M2>(inputs, outputs),
            (DType::F16, DType::F8E5M2) => rows_of::<half::f16, E5M2>(inputs, outputs),
            (DType::BF16, DType::F8E5M2) => rows_of::<half::bf16, E5M2>(inputs, outputs),
            (DType::F32 | DType::F16 | DType::BF16, other) => return Err(not_fp8(other)),
            (other, _) => return Err(crate::unsupported_dtype(other)),
        }
    }
    Ok(Quantized { q, scales })
}

/// The read side of a quantization call: x's rows, the norm's parameters (a norm runs when `eps`
/// is given) and the scale.
struct RowInputs<'a> {
    x: &'a CpuBuffer,
    rows: Rows,
    weight: &'a crate::RowWeight<'a>,
    eps: Option<f32>,
    round_sum: bool,
    scale: RowScale,
    /// x's rows are `[gate | up]`, quantized as `silu_and_mul` of them (q half as wide).
    gated: bool,
}

/// The write side: q (compact rows), one scale per row, and the residual (read, then written with
/// the sum, in its own rows).
struct RowOutputs<'a> {
    q: &'a mut CpuBuffer,
    scales: &'a mut CpuBuffer,
    residual: Option<(&'a mut CpuBuffer, Rows)>,
}

/// Per-task scratch: two f32 rows and a row of the element type.
struct Scratch<'a, T> {
    a: &'a mut [f32],
    b: &'a mut [f32],
    normalized: &'a mut [T],
}

/// Owned scratch for a task of the thread pool (allocated once per task, not per row).
struct OwnedScratch<T> {
    a: Vec<f32>,
    b: Vec<f32>,
    normalized: Vec<T>,
}

impl<T: CpuElement> OwnedScratch<T> {
    fn new(hidden: usize) -> OwnedScratch<T> {
        OwnedScratch { a: vec![0f32; hidden], b: vec![0f32; hidden], normalized: vec![T::zeroed(); hidden] }
    }

    fn view(&mut self) -> Scratch<'_, T> {
        Scratch { a: &mut self.a, b: &mut self.b, normalized: &mut self.normalized }
    }
}

fn rows_of<T: CpuElement, Q: Fp8>(inputs: RowInputs<'_>, outputs: RowOutputs<'_>) {
    let RowInputs { x, rows, weight, eps, round_sum, scale, gated } = inputs;
    let weight = weight.typed::<T>();
    // The width of q's rows (and of the rows quantized).
    let hidden = if gated { rows.hidden / 2 } else { rows.hidden };
    let scales = &mut outputs.scales.typed_mut::<f32>()[..rows.n_rows];
    if hidden == 0 {
        scales.iter_mut().for_each(|s| *s = row_scale(&[], scale));
        return;
    }
    let x_data = &x.typed::<T>()[rows.offset..rows.offset + rows.span()];
    let x_width = rows.hidden;
    let q_data = &mut outputs.q.typed_mut::<u8>()[..rows.n_rows * hidden];
    let residual = outputs
        .residual
        .map(|(r, r_rows)| (&mut r.typed_mut::<T>()[r_rows.offset..r_rows.offset + r_rows.span()], r_rows.row_stride));
    let task = |scratch: &mut Scratch<T>, index: usize, q_row: &mut [u8], s: &mut f32, r: Option<&mut [T]>| {
        let x_row = &x_data[index * rows.row_stride..][..x_width];
        let row = match (eps, r) {
            (None, _) if gated => Row::Gated { g: &x_row[..hidden], u: &x_row[hidden..] },
            (None, _) => Row::Plain(x_row),
            (Some(eps), Some(r)) => Row::Fused { x: x_row, r: &mut r[..hidden], weight, eps, round_sum },
            (Some(eps), None) => Row::Norm { x: x_row, weight, eps },
        };
        *s = quantize_row::<T, Q>(row, scratch, scale, q_row);
    };
    let per_task = rows_per_task(hidden, size_of::<T>());
    if rows.n_rows <= per_task {
        // This thread's reused scratch: two f32 rows, then a row of T (at most 4 bytes a value).
        with_scratch(3 * hidden, |words: &mut [f32]| {
            let (a, rest) = words.split_at_mut(hidden);
            let (b, normalized) = rest.split_at_mut(hidden);
            let normalized = &mut bytemuck::cast_slice_mut::<f32, T>(normalized)[..hidden];
            let mut scratch = Scratch { a, b, normalized };
            let mut r_chunks = residual.map(|(r, stride)| r.chunks_mut(stride));
            for (index, (q_row, s)) in q_data.chunks_mut(hidden).zip(scales.iter_mut()).enumerate() {
                let r = r_chunks.as_mut().and_then(Iterator::next);
                task(&mut scratch, index, q_row, s, r);
            }
        });
        return;
    }
    tracing::debug!(target: "kernels_cpu", rows = rows.n_rows, per_task, "fp8 quantization split across threads");
    let r_chunks = match residual {
        Some((r, stride)) => rayon::iter::Either::Left(r.par_chunks_mut(stride).map(Some)),
        None => rayon::iter::Either::Right((0..rows.n_rows).into_par_iter().map(|_| None)),
    };
    q_data
        .par_chunks_mut(hidden)
        .zip(scales.par_iter_mut())
        .zip(r_chunks)
        .enumerate()
        .with_min_len(per_task)
        .for_each_init(
            || OwnedScratch::new(hidden),
            |scratch, (index, ((q_row, s), r))| task(&mut scratch.view(), index, q_row, s, r),
        );
}

/// `silu_and_mul_dynamic_fp8_quant` on the cpu: per row, the cpu `silu_and_mul` row (in scratch,
/// stored in x's type as that kernel stores it), then the cpu per-token quantization row of it: the
/// unfused pair's codes and scales, with the gated values never written to memory. x is rows of one
/// stride (`[..., gate | up]`).
pub fn silu_and_mul_dynamic_fp8_quant_cpu(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let Quantized { q, scales } = quantize_rows(x, None, None, dynamic_scale(scale_ub, out_dtype)?, out_dtype, true)?;
    Ok((q, scales))
}

/// One row's input to quantization.
enum Row<'a, T> {
    /// x itself.
    Plain(&'a [T]),
    /// `rms_norm(x)`.
    Norm { x: &'a [T], weight: Weight<'a, T>, eps: f32 },
    /// `fused_add_rms_norm(x, r)`, writing the sum back into `r`; the norm of the rounded sum when
    /// `round_sum`.
    Fused { x: &'a [T], r: &'a mut [T], weight: Weight<'a, T>, eps: f32, round_sum: bool },
    /// `silu_and_mul` of the gate and up halves of a row.
    Gated { g: &'a [T], u: &'a [T] },
}

/// The scale of one row of f32 values.
fn row_scale(row: &[f32], scale: RowScale) -> f32 {
    match scale {
        RowScale::Static { s, .. } => s,
        RowScale::Dynamic { ub, max, floor } => {
            let mut absmax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            if let Some(ub) = ub {
                absmax = absmax.min(ub);
            }
            (absmax / max).max(floor)
        }
    }
}

/// One row: widen (normalizing first for the fused ops, through a row of x's dtype: the
/// composition's rounding point), find the scale, divide and convert. Returns the row's scale.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn quantize_row<T: CpuElement, Q: Fp8>(
    row: Row<'_, T>,
    scratch: &mut Scratch<T>,
    scale: RowScale,
    q: &mut [u8],
) -> f32 {
    let Scratch { a, b, normalized } = scratch;
    match row {
        Row::Plain(x) => T::load(x, a),
        Row::Gated { g, u } => {
            // The cpu silu_and_mul row itself, stored in x's type as that kernel stores it, so
            // the composition's bits are the pair's.
            crate::gated::gated_row(g, u, a, b, &crate::gated::Silu, normalized, false);
            T::load(normalized, a);
        }
        Row::Norm { x, weight, eps } => {
            // The cpu rms_norm row itself (explicit where the CPU has it), so the composition's
            // bits are the cpu norm's.
            rms_norm_row(x, weight, eps, normalized, false);
            T::load(normalized, a);
        }
        Row::Fused { x, r, weight, eps, round_sum: false } => {
            // The cpu fused row with its norm into `normalized` (x is read only): r ← x + r.
            fused_row(RowOut::Separate { x, out: normalized }, r, weight, eps);
            T::load(normalized, a);
        }
        Row::Fused { x, r, weight, eps, round_sum: true } => {
            // `dtype` rounding: the stored sum, then the norm row of it (the cpu fused_add_rms_norm
            // with `dtype`, bit for bit).
            add_into(x, r);
            rms_norm_row(r, weight, eps, normalized, false);
            T::load(normalized, a);
        }
    }
    let s = row_scale(a, scale);
    if let RowScale::Static { invert: true, .. } = scale {
        // vLLM's static kernels: one f32 reciprocal, then a product per element.
        let inverse = 1.0 / s;
        for (q, v) in q.iter_mut().zip(a.iter()) {
            *q = Q::encode(v * inverse);
        }
    } else {
        for (q, v) in q.iter_mut().zip(a.iter()) {
            *q = Q::encode(v / s);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::{TensorMeta, bit_eq};
    use ir_ops::dynamic_per_token_scaled_fp8_quant as dynamic;
    use ir_ops::static_scaled_fp8_quant as fixed;

    #[test]
    fn both_formats_match_native_bit_for_bit_on_padded_rows() {
        let wide = Tensor::randn(&TensorMeta::compact(DType::BF16, &[5, 40]), 3).unwrap();
        let x = wide.narrow(1, 2, 33).unwrap();
        let scale = Tensor::from_f64(DType::F32, &[1], &[0.01]).unwrap();
        let ub = Tensor::from_f64(DType::F32, &[], &[1.5]).unwrap();
        for out_dtype in DType::FP8 {
            for rounding in [Rounding::Exact, Rounding::Dtype] {
                let got = static_scaled_fp8_quant_cpu(&x, &scale, out_dtype, rounding).unwrap();
                let expected = fixed::native(&x, &scale, out_dtype, rounding).unwrap();
                assert!(bit_eq(&got, &expected), "{out_dtype} static {rounding:?}");
            }
            for ub in [None, Some(&ub)] {
                let (q, s) = dynamic_per_token_scaled_fp8_quant_cpu(&x, ub, out_dtype).unwrap();
                let (eq, es) = dynamic::native(&x, ub, out_dtype).unwrap();
                assert!(bit_eq(&q, &eq) && bit_eq(&s, &es), "{out_dtype} dynamic, bound {}", ub.is_some());
                assert_eq!(s.shape(), [5, 1]);
            }
        }
    }

    /// Every f32 whose low 16 bits are one of the patterns that decide a rounding (exact, a tie, just
    /// above or below one), for every high half: `encode` agrees with `float8`'s conversion.
    #[test]
    fn the_branch_free_conversion_matches_float8_on_every_deciding_value() {
        use ir_core::{F8E4M3, F8E5M2};
        for high in 0..=u16::MAX {
            for low in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let f = f32::from_bits((u32::from(high) << 16) | low);
                // `float8` keeps a NaN's sign and payload bits; every provider writes the one
                // canonical NaN instead.
                let (e4m3, e5m2) = match f.is_nan() {
                    true => (ir_core::FP8_NAN, ir_core::FP8_NAN),
                    false => (F8E4M3::from_f32(f).to_bits(), F8E5M2::from_f32(f).to_bits()),
                };
                assert_eq!(E4M3::encode(f), e4m3, "e4m3 {f:e} ({:#010x})", f.to_bits());
                assert_eq!(E5M2::encode(f), e5m2, "e5m2 {f:e} ({:#010x})", f.to_bits());
            }
        }
    }

    /// The fused ops equal the cpu norm followed by the cpu quantization, bit for bit, on padded
    /// rows, with and without a weight, on one thread and split across threads, with either
    /// rounding (the same rounding given to both calls of the pair).
    #[test]
    fn the_fused_ops_are_the_cpu_composition() {
        use crate::{fused_add_rms_norm_cpu, rms_norm_cpu};
        for (tokens, hidden) in [(3, 40), (300, 1024)] {
            let wide = Tensor::randn(&TensorMeta::compact(DType::BF16, &[tokens, hidden + 5]), 4).unwrap();
            let x = wide.narrow(1, 1, hidden).unwrap();
            let r = Tensor::randn(&TensorMeta::compact(DType::BF16, &[tokens, hidden]), 5).unwrap();
            let w = Tensor::randn(&TensorMeta::compact(DType::BF16, &[hidden]), 6).unwrap();
            let scale = Tensor::from_f64(DType::F32, &[1], &[0.02]).unwrap();
            let ub = Tensor::from_f64(DType::F32, &[1], &[2.0]).unwrap();
            let cases = [None, Some(&w)].into_iter().flat_map(|w| [Rounding::Exact, Rounding::Dtype].map(|r| (w, r)));
            for (weight, rounding) in cases {
                for out_dtype in DType::FP8 {
                    let label = format!("T={tokens} weight={} {out_dtype} {rounding:?}", weight.is_some());
                    let normalized = rms_norm_cpu(&x, weight, 1e-6, None).unwrap();
                    let q = rms_norm_static_fp8_quant_cpu(&x, weight, 1e-6, &scale, out_dtype, rounding).unwrap();
                    let expected = static_scaled_fp8_quant_cpu(&normalized, &scale, out_dtype, rounding).unwrap();
                    assert!(bit_eq(&q, &expected), "{label}: static");
                    let (q, s) =
                        rms_norm_dynamic_per_token_quant_cpu(&x, weight, 1e-6, Some(&ub), out_dtype, rounding).unwrap();
                    let (eq, es) = dynamic_per_token_scaled_fp8_quant_cpu(&normalized, Some(&ub), out_dtype).unwrap();
                    assert!(bit_eq(&q, &eq) && bit_eq(&s, &es), "{label}: dynamic");
                    let unique = |t: &Tensor| UniqueTensor::new(t.contiguous().unwrap()).unwrap();
                    let (residual_out, q) = fused_add_rms_norm_static_fp8_quant_cpu(
                        &x,
                        unique(&r),
                        weight,
                        1e-6,
                        &scale,
                        out_dtype,
                        rounding,
                    )
                    .unwrap();
                    let (out, sum) =
                        fused_add_rms_norm_cpu(unique(&x), unique(&r), weight, 1e-6, None, rounding).unwrap();
                    assert!(bit_eq(&residual_out, &sum), "{label}: residual_out");
                    let expected = static_scaled_fp8_quant_cpu(&out, &scale, out_dtype, rounding).unwrap();
                    assert!(bit_eq(&q, &expected), "{label}: fused q");
                    let dynamic = fused_add_rms_norm_dynamic_per_token_quant_cpu;
                    let (residual_out, q, s) =
                        dynamic(&x, unique(&r), weight, 1e-6, Some(&ub), out_dtype, rounding).unwrap();
                    let (eq, es) = dynamic_per_token_scaled_fp8_quant_cpu(&out, Some(&ub), out_dtype).unwrap();
                    assert!(bit_eq(&residual_out, &sum), "{label}: dynamic residual_out");
                    assert!(bit_eq(&q, &eq) && bit_eq(&s, &es), "{label}: fused dynamic");
                }
            }
        }
    }

    #[test]
    fn zero_nan_and_empty_rows() {
        let x = Tensor::from_f64(DType::F32, &[3, 2], &[0.0, 0.0, f64::NAN, 2.0, 1e30, -1.0]).unwrap();
        let (q, s) = dynamic_per_token_scaled_fp8_quant_cpu(&x, None, DType::F8E4M3FN).unwrap();
        let (eq, es) = dynamic::native(&x, None, DType::F8E4M3FN).unwrap();
        assert!(bit_eq(&q, &eq) && bit_eq(&s, &es));
        let q = q.to_f64_vec().unwrap();
        assert_eq!(q[..2], [0.0, 0.0], "a zero row quantizes to zeros with the floor scale");
        assert!(q[2].is_nan() && q[3] == 448.0, "NaN stays, the row's absmax maps to the maximum");
        let empty = Tensor::zeros(DType::F16, &[4, 0]).unwrap();
        let (q, s) = dynamic_per_token_scaled_fp8_quant_cpu(&empty, None, DType::F8E5M2).unwrap();
        assert_eq!((q.shape(), s.to_f64_vec().unwrap()), (&[4, 0][..], vec![min_scale(DType::F8E5M2) as f64; 4]));
    }
}
