//! The gelu activations in f32 without cancellation, vectorized with rten-simd.
//!
//! Both textbook forms cancel in the negative tail: `0.5·v·(1 + tanh z)` and `0.5·v·(1 + erf(v/√2))`
//! subtract two numbers near 1 where gelu is tiny (gate −5: `1 + tanh z` is 7e−5, so an f32 tanh's
//! rounding leaves no correct digit), and a large `up` turns that into an error past the tolerance.
//! Here each form is written so the tail is a product, not a difference:
//!
//! - tanh: `0.5·v·(1 + tanh z) = v / (1 + e^w)` with `w = −2z = v·(A + B·v²)`, `A = −2√(2/π)`,
//!   `B = A·0.044715` (for negative `v`, `v·e^−w / (1 + e^−w)`, so the exponential never overflows);
//! - erf: `0.5·v·(1 + erf(v/√2)) = 0.5·v·erfc(−v/√2)`, with `erfc(x) = t·e^(−x² + Q(t))`,
//!   `t = 1 / (1 + x/2)` for `x ≥ 0` (Numerical Recipes' Chebyshev fit, fractional error below
//!   1.2e−7 everywhere) and `erfc(−x) = 2 − erfc(x)`.
//!
//! The exponent is where f32 would still lose: `e^w` turns an absolute error of `w` into a relative
//! one, and `|w|` reaches 87 before the result underflows, so one rounding of `w` alone would cost
//! 87 ulps. The exponents are therefore formed in two floats: each product's rounding error is exact
//! with a fused multiply-add (`fma(a, b, −a·b)`), each sum's with the two-sum, the constants are split
//! into a float and its remainder, and `e^(hi + lo) = e^hi · (1 + lo)`. What remains is the exp's
//! own error (1 ulp) and a few roundings: a few parts in 1e7 over the whole range (tested against
//! the f64 reference with gates over every magnitude and large `up`). On an instruction set without
//! a fused multiply-add (rten-simd's portable form) the products' errors read as zero and the
//! exponent is plain f32: less accurate, never worse than the uncompensated formula.

use rten_simd::ops::{BitOps, FloatOps, NumOps};
use rten_simd::{Isa, SimdUnaryOp};
use rten_vecmath::Exp;

/// `−2√(2/π)`, the exponent's linear coefficient in the tanh form.
const TANH_A: f64 = -2.0 * 0.797_884_560_802_865_4;
/// The cubic coefficient `−2√(2/π)·0.044715`.
const TANH_B: f64 = TANH_A * 0.044_715;
/// Beyond this magnitude the tanh form is `v` (positive; `e^w` is below half an ulp of 1) or `v·0`
/// (negative: below f32's smallest subnormal; `−∞` gives NaN, as `0.5·v·(1 + tanh z)` does); it
/// also keeps `v²` finite in the exponent.
const TANH_LIMIT: f32 = 20.0;
/// Beyond this magnitude the erf form is `v` (positive: `erfc(−v/√2)` is 2 to within half an ulp)
/// or `v·0` (negative: below f32's smallest subnormal; `−∞` gives NaN, as `0.5·v·(1 + erf)` does);
/// it also keeps `v²` finite in the exponent.
const ERF_LIMIT: f32 = 14.0;
/// Numerical Recipes' `Q(t)` of `erfc(x) = t·e^(−x² + Q(t))`, constant term first, as published (the
/// GPU kernels spell them the same way; each rounds to the f32 nearest it).
#[allow(clippy::excessive_precision)]
const ERFC_Q: [f32; 10] = [
    -1.265_512_23,
    1.000_023_68,
    0.374_091_96,
    0.096_784_18,
    -0.186_288_06,
    0.278_868_07,
    -1.135_203_98,
    1.488_515_87,
    -0.822_152_23,
    0.170_872_77,
];

/// `c` as the f32 nearest it and the f32 nearest the remainder: `c ≈ hi + lo` to 2^−48 relative.
const fn split(c: f64) -> (f32, f32) {
    let hi = c as f32;
    (hi, (c - hi as f64) as f32)
}

/// gelu with the tanh form (`approximate = "tanh"`), as [the module](self) describes.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GeluTanh;

impl SimdUnaryOp<f32> for GeluTanh {
    #[inline(always)]
    fn eval<I: Isa>(&self, isa: I, v: I::F32) -> I::F32 {
        let ops = isa.f32();
        let ((a_hi, a_lo), (b_hi, b_lo)) = (split(TANH_A), split(TANH_B));
        let (a_hi, a_lo, b_hi, b_lo) = (ops.splat(a_hi), ops.splat(a_lo), ops.splat(b_hi), ops.splat(b_lo));
        // v² = v2 + v2_lo exactly.
        let v2 = ops.mul(v, v);
        let v2_lo = ops.mul_add(v, v, ops.neg(v2));
        // B·v² ≈ t + t_lo.
        let t = ops.mul(b_hi, v2);
        let t_lo = ops.add(ops.mul_add(b_hi, v2, ops.neg(t)), ops.mul_add(b_hi, v2_lo, ops.mul(b_lo, v2)));
        // A + B·v² ≈ s + s_lo.
        let (s, s_err) = two_sum(isa, a_hi, t);
        let s_lo = ops.add(s_err, ops.add(a_lo, t_lo));
        // w = v·(A + B·v²) ≈ w + w_lo; A + B·v² < 0, so w has the sign opposite to v's. With
        // u = −|w| (never positive: e^u never overflows), gelu = v / (1 + e^u) for v ≥ 0 and
        // v·e^u / (1 + e^u) for v < 0 (the same function: divide through by e^w).
        let w = ops.mul(s, v);
        let w_lo = ops.mul_add(s_lo, v, ops.mul_add(s, v, ops.neg(w)));
        let negative = ops.lt(v, ops.zero());
        let (u, u_lo) = (ops.select(ops.neg(w), w, negative), ops.select(ops.neg(w_lo), w_lo, negative));
        let e = Exp::apply(isa, u);
        let e = ops.mul_add(e, u_lo, e);
        let gelu = ops.div(ops.mul(v, ops.select(e, ops.one(), negative)), ops.add(ops.one(), e));
        let limit = ops.splat(TANH_LIMIT);
        let gelu = ops.select(v, gelu, ops.gt(v, limit));
        ops.select(ops.mul(v, ops.zero()), gelu, ops.lt(v, ops.neg(limit)))
    }
}

/// gelu with the erf form (`approximate = "none"`), as [the module](self) describes.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GeluErf;

impl SimdUnaryOp<f32> for GeluErf {
    #[inline(always)]
    fn eval<I: Isa>(&self, isa: I, v: I::F32) -> I::F32 {
        let ops = isa.f32();
        let half = ops.splat(0.5);
        // x = |v|/√2; t = 1 / (1 + x/2).
        let x = ops.mul(ops.abs(v), ops.splat(std::f32::consts::FRAC_1_SQRT_2));
        let t = ops.div(ops.one(), ops.mul_add(x, half, ops.one()));
        let mut q = ops.splat(ERFC_Q[ERFC_Q.len() - 1]);
        for &c in ERFC_Q[..ERFC_Q.len() - 1].iter().rev() {
            q = ops.mul_add(q, t, ops.splat(c));
        }
        // −x² = −v²/2 = −(v2 + v2_lo)/2 exactly; −x² + Q ≈ a + a_lo.
        let v2 = ops.mul(v, v);
        let v2_lo = ops.mul_add(v, v, ops.neg(v2));
        let (a, a_err) = two_sum(isa, ops.mul(v2, ops.neg(half)), q);
        let a_lo = ops.mul_add(v2_lo, ops.neg(half), a_err);
        let e = Exp::apply(isa, a);
        let erfc_abs = ops.mul(t, ops.mul_add(e, a_lo, e));
        // erfc(−v/√2): erfc(x) for negative v, 2 − erfc(x) for the others.
        let erfc = ops.select(erfc_abs, ops.sub(ops.splat(2.0), erfc_abs), ops.lt(v, ops.zero()));
        let gelu = ops.mul(ops.mul(half, v), erfc);
        let limit = ops.splat(ERF_LIMIT);
        let gelu = ops.select(v, gelu, ops.gt(v, limit));
        ops.select(ops.mul(v, ops.zero()), gelu, ops.lt(v, ops.neg(limit)))
    }
}

/// `a + b = s + err` exactly (Knuth's two-sum: no ordering of the magnitudes needed).
#[inline(always)]
fn two_sum<I: Isa>(isa: I, a: I::F32, b: I::F32) -> (I::F32, I::F32) {
    let ops = isa.f32();
    let s = ops.add(a, b);
    let bb = ops.sub(s, a);
    let err = ops.add(ops.sub(a, ops.sub(s, bb)), ops.sub(b, bb));
    (s, err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gates over every magnitude the activations distinguish, the tails and the extremes.
    fn gates() -> Vec<f32> {
        let mut gates: Vec<f32> = (-2600..=2600).map(|i| i as f32 / 100.0).collect();
        gates.extend([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 1e10, -1e10, f32::MAX, f32::MIN]);
        gates.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE, -f32::MIN_POSITIVE]);
        gates
    }

    /// The largest relative error against the f64 reference (rounded to f32) over `gates()`, where
    /// the reference is at least 1e−30 (below, f32's subnormals lose digits by design: there the
    /// error must stay below 1e−36, far under any tolerance); special values must agree exactly.
    fn worst(op: impl SimdUnaryOp<f32>, reference: fn(f64) -> f64) -> (f64, f32) {
        let gates = gates();
        let mut out = vec![std::mem::MaybeUninit::uninit(); gates.len()];
        let got = op.map(&gates, &mut out);
        let mut worst = (0.0f64, 0.0f32);
        for (&g, &y) in gates.iter().zip(got.iter()) {
            let expected = reference(f64::from(g)) as f32;
            if expected.is_nan() || y.is_nan() {
                assert!(expected.is_nan() && y.is_nan(), "gate {g}: {y} against {expected}");
                continue;
            }
            if expected.is_infinite() {
                assert_eq!(y, expected, "gate {g}");
                continue;
            }
            if expected.abs() < 1e-30 {
                assert!((y - expected).abs() < 1e-36, "gate {g}: {y} vs {expected}");
                continue;
            }
            let relative = (f64::from(y) - f64::from(expected)).abs() / f64::from(expected).abs();
            if relative > worst.0 {
                worst = (relative, g);
            }
        }
        worst
    }

    #[test]
    fn the_tanh_form_keeps_its_relative_accuracy_in_the_tail() {
        let (error, gate) = worst(GeluTanh, ir_ops::gated::gelu_tanh);
        eprintln!("gelu (tanh form): largest relative error {error:e}, at gate {gate}");
        assert!(error < 4e-7, "relative error {error:e} at gate {gate}");
    }

    #[test]
    fn the_erf_form_keeps_its_relative_accuracy_in_the_tail() {
        let (error, gate) = worst(GeluErf, ir_ops::gated::gelu_erf);
        eprintln!("gelu (erf form): largest relative error {error:e}, at gate {gate}");
        assert!(error < 4e-7, "relative error {error:e} at gate {gate}");
    }
}
