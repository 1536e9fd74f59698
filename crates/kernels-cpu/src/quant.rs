//! fp8 quantization on the cpu: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! Each row is widened into f32 scratch; the dynamic op reduces its absmax there (`f32::max`, which
//! skips NaN as the reference does), then every element is divided by the row's scale in f32 and
//! converted to fp8 with [`Fp8::encode`], a branch-free form of the saturating nearest-even
//! conversion that vectorizes (the `float8` crate's conversion, which native uses, goes through
//! f64 one branchy element at a time: 3.4 ns an element on the development machine, against 0.3 ns); its tests compare the two on every
//! f32 that decides a rounding. The rounding points are those of [`ir_core::op::quant`], so results
//! are bit-identical to native. Rows are split across threads as the norms are.

use ir_core::kernel::{Rows, host_scale, per_token_scales_shape, quant_support};
use ir_core::op::quant::min_scale;
use ir_core::storage::CpuBuffer;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Tensor};
use rayon::prelude::*;

use crate::element::CpuElement;
use crate::rows::rows_per_task;

/// The `supports` predicate and spec of the quantization ops on the cpu.
pub(crate) fn spec() -> ImplSpec {
    ImplSpec::new(crate::PROVIDER).with_supports(|args| quant_support(args, DeviceKind::Cpu))
}

/// How a row's scale is found.
#[derive(Clone, Copy, Debug)]
enum RowScale {
    /// The same scale for every row.
    Static(f32),
    /// From the row's absmax, bounded by `ub`, floored at `floor`, divided by the format's maximum.
    Dynamic { ub: Option<f32>, max: f32, floor: f32 },
}

/// `static_scaled_fp8_quant` on the cpu: a fresh compact output in `out_dtype`.
pub fn static_scaled_fp8_quant_cpu(x: &Tensor, scale: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
    let scale = host_scale(scale, "scale")?;
    Ok(quantize(x, RowScale::Static(scale), out_dtype)?.0)
}

/// `dynamic_per_token_scaled_fp8_quant` on the cpu: fresh compact `(q, scales)`.
pub fn dynamic_per_token_scaled_fp8_quant_cpu(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let ub = scale_ub.map(|t| host_scale(t, "scale_ub")).transpose()?;
    let max = out_dtype.fp8_max().ok_or_else(|| not_fp8(out_dtype))? as f32;
    quantize(x, RowScale::Dynamic { ub, max, floor: min_scale(out_dtype) }, out_dtype)
}

/// An fp8 format's parameters and its branch-free conversion from f32.
pub(crate) trait Fp8: Send + Sync {
    /// Mantissa bits.
    const M: u32;
    /// Exponent bias.
    const BIAS: u32;
    /// Largest finite value.
    const MAX: f32;

    /// The code of `f`: NaN stays NaN (E4M3FN's one NaN per sign; E5M2 keeps the payload's top two
    /// bits, as `float8` does), magnitudes clamp to the largest finite value (saturation,
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
        let nan = if Self::M == 3 { 0x7f } else { 0x7e | ((bits >> 21) & 3) };
        (sign | if f.is_nan() { nan } else { code }) as u8
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
    KernelError::InvalidArguments { reason: format!("out_dtype {dtype} is not an fp8 dtype") }
}

/// Quantizes x's rows; returns `(q, scales)` (the scales of a static call are its scale per row).
fn quantize(x: &Tensor, scale: RowScale, out_dtype: DType) -> Result<(Tensor, Tensor), KernelError> {
    let rows = Rows::for_kernel(x.meta())?;
    let mut q = Tensor::zeros(out_dtype, x.shape())?;
    let scales_shape = per_token_scales_shape(x.shape());
    let mut scales = Tensor::zeros(DType::F32, &scales_shape)?;
    if rows.n_rows == 0 {
        return Ok((q, scales));
    }
    let x_buffer = x.cpu_buffer().ok_or_else(|| crate::not_on_cpu("x"))?;
    let q_buffer = q.cpu_buffer_mut()?.ok_or_else(|| crate::not_on_cpu("q"))?;
    let scales_buffer = scales.cpu_buffer_mut()?.ok_or_else(|| crate::not_on_cpu("scales"))?;
    let scales_out = &mut scales_buffer.typed_mut::<f32>()[..rows.n_rows];
    match (x.dtype(), out_dtype) {
        (DType::F32, DType::F8E4M3FN) => rows_of::<f32, E4M3>(x_buffer, rows, q_buffer, scales_out, scale),
        (DType::F16, DType::F8E4M3FN) => rows_of::<half::f16, E4M3>(x_buffer, rows, q_buffer, scales_out, scale),
        (DType::BF16, DType::F8E4M3FN) => rows_of::<half::bf16, E4M3>(x_buffer, rows, q_buffer, scales_out, scale),
        (DType::F32, DType::F8E5M2) => rows_of::<f32, E5M2>(x_buffer, rows, q_buffer, scales_out, scale),
        (DType::F16, DType::F8E5M2) => rows_of::<half::f16, E5M2>(x_buffer, rows, q_buffer, scales_out, scale),
        (DType::BF16, DType::F8E5M2) => rows_of::<half::bf16, E5M2>(x_buffer, rows, q_buffer, scales_out, scale),
        (DType::F32 | DType::F16 | DType::BF16, other) => return Err(not_fp8(other)),
        (other, _) => return Err(crate::unsupported_dtype(other)),
    }
    Ok((q, scales))
}

fn rows_of<T: CpuElement, Q: Fp8>(x: &CpuBuffer, rows: Rows, q: &mut CpuBuffer, scales: &mut [f32], scale: RowScale) {
    let hidden = rows.hidden;
    let x_data = &x.typed::<T>()[rows.offset..rows.offset + rows.span()];
    let q_data = &mut q.typed_mut::<u8>()[..rows.n_rows * hidden];
    let task = |scratch: &mut Vec<f32>, (index, (q_row, s)): (usize, (&mut [u8], &mut f32))| {
        let start = index * rows.row_stride;
        *s = quantize_row::<T, Q>(&x_data[start..start + hidden], scratch, scale, q_row);
    };
    if hidden == 0 {
        scales.iter_mut().for_each(|s| *s = row_scale(&[], scale));
        return;
    }
    let per_task = rows_per_task(hidden, size_of::<T>());
    if rows.n_rows <= per_task {
        let mut scratch = vec![0f32; hidden];
        q_data.chunks_mut(hidden).zip(scales.iter_mut()).enumerate().for_each(|item| task(&mut scratch, item));
        return;
    }
    tracing::debug!(target: "kernels_cpu", rows = rows.n_rows, per_task, "fp8 quantization split across threads");
    q_data
        .par_chunks_mut(hidden)
        .zip(scales.par_iter_mut())
        .enumerate()
        .with_min_len(per_task)
        .for_each_init(|| vec![0f32; hidden], task);
}

/// The scale of one row of f32 values.
fn row_scale(row: &[f32], scale: RowScale) -> f32 {
    match scale {
        RowScale::Static(s) => s,
        RowScale::Dynamic { ub, max, floor } => {
            let mut absmax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            if let Some(ub) = ub {
                absmax = absmax.min(ub);
            }
            (absmax / max).max(floor)
        }
    }
}

/// One row: widen, find the scale, divide and convert. Returns the row's scale.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn quantize_row<T: CpuElement, Q: Fp8>(x: &[T], scratch: &mut [f32], scale: RowScale, q: &mut [u8]) -> f32 {
    T::load(x, scratch);
    let s = row_scale(scratch, scale);
    for (q, v) in q.iter_mut().zip(scratch.iter()) {
        *q = Q::encode(v / s);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::op::dynamic_per_token_scaled_fp8_quant as dynamic;
    use ir_core::op::static_scaled_fp8_quant as fixed;
    use ir_core::{TensorMeta, bit_eq};

    #[test]
    fn both_formats_match_native_bit_for_bit_on_padded_rows() {
        let wide = Tensor::randn(&TensorMeta::compact(DType::BF16, &[5, 40]), 3).unwrap();
        let x = wide.narrow(1, 2, 33).unwrap();
        let scale = Tensor::from_f64(DType::F32, &[1], &[0.01]).unwrap();
        let ub = Tensor::from_f64(DType::F32, &[], &[1.5]).unwrap();
        for out_dtype in DType::FP8 {
            let got = static_scaled_fp8_quant_cpu(&x, &scale, out_dtype).unwrap();
            assert!(bit_eq(&got, &fixed::native(&x, &scale, out_dtype).unwrap()), "{out_dtype} static");
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
                assert_eq!(E4M3::encode(f), F8E4M3::from_f32(f).to_bits(), "e4m3 {f:e} ({:#010x})", f.to_bits());
                assert_eq!(E5M2::encode(f), F8E5M2::from_f32(f).to_bits(), "e5m2 {f:e} ({:#010x})", f.to_bits());
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
