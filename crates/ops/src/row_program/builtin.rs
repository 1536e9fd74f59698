//! The built-in row ops as row programs: each function returns the program of one op in one
//! configuration (its optional tensors present or not, its `rounding`, its output dtype), with the
//! op's parameters as inputs in the op's order (absent optional ones left out) and the op's
//! outputs in the op's order. Run by the reference interpreter, each gives its op's native
//! reference's bits (tested below on every compute dtype, strided inputs and non-finite values).
//!
//! `rotary_embedding` is [`rotary`] run on its query, then on its key, each viewed as rows of one
//! head (`[tokens, heads, head_size]`): the program's row is a head, its positions one per token.

use ir_core::DType;

use super::{BinaryOp, Builder, InputId, OutDType, Precision, ProgramError, ReduceOp, RowProgram, UnaryOp, ValueId};
use crate::Rounding;
use crate::gelu_and_mul::Approximate;

/// The steps of `rms_norm` on `a` (the row's values in the compute dtype): the mean square over
/// the first `variance_size` elements (all without it), accumulated wide and divided once; `rstd =
/// 1 / sqrt(ms + eps)` rounded at every step; `y = a · rstd`; with a weight, `y` rounded to its
/// dtype, times the weight, rounded again. Returns the value stored as the norm's output.
fn norm_steps(
    b: &mut Builder,
    a: ValueId,
    weight: Option<InputId>,
    epsilon: InputId,
    variance: Option<InputId>,
) -> ValueId {
    let count = variance.map(|v| b.param(v, Precision::Wide));
    let sum = b.reduce(ReduceOp::SumSquares, a, count, Precision::Wide);
    let n = match count {
        Some(count) => count,
        None => b.width(),
    };
    let mean_square = b.binary(BinaryOp::Div, sum, n, Precision::Compute);
    let eps = b.param(epsilon, Precision::Compute);
    let shifted = b.binary(BinaryOp::Add, mean_square, eps, Precision::Compute);
    let root = b.unary(UnaryOp::Sqrt, shifted, Precision::Compute);
    let rstd = b.unary(UnaryOp::Recip, root, Precision::Compute);
    let y = b.binary(BinaryOp::Mul, a, rstd, Precision::Compute);
    match weight {
        Some(w) => {
            let y = b.round(y, Precision::Like(w));
            let wv = b.load_weight(w);
            b.binary(BinaryOp::Mul, y, wv, Precision::Like(w))
        }
        None => y,
    }
}

/// `residual ← x + residual` (in place), rounded to x's dtype under `rounding = "dtype"`; returns
/// the sum the norm reads.
fn add_residual(b: &mut Builder, x: InputId, residual: InputId, rounding: Rounding) -> ValueId {
    let (a, r) = (b.load(x, 0), b.load(residual, 0));
    let sum = b.binary(BinaryOp::Add, a, r, Precision::Compute);
    let sum = match rounding {
        Rounding::Dtype => b.round(sum, Precision::Like(x)),
        Rounding::Exact => sum,
    };
    b.store("residual_out", sum, OutDType::Like(residual), Some(residual));
    sum
}

/// The largest finite value of an fp8 `dtype`, or the error naming the program.
fn fp8_max(program: &str, dtype: DType) -> Result<f64, ProgramError> {
    dtype.fp8_max().ok_or_else(|| ProgramError::Invalid {
        program: program.to_owned(),
        what: "out_dtype".to_owned(),
        reason: format!("{dtype} is not f8e4m3fn or f8e5m2"),
    })
}

/// A static quantization of `v` (in the compute dtype) by scale tensor `scale`: divided, or
/// multiplied by the rounded reciprocal under `rounding = "dtype"`; the store rounds to fp8.
fn static_quant_steps(b: &mut Builder, v: ValueId, scale: InputId, rounding: Rounding) -> ValueId {
    let s = b.param(scale, Precision::Compute);
    match rounding {
        Rounding::Dtype => {
            let inverse = b.unary(UnaryOp::Recip, s, Precision::Compute);
            b.binary(BinaryOp::Mul, v, inverse, Precision::Compute)
        }
        Rounding::Exact => b.binary(BinaryOp::Div, v, s, Precision::Compute),
    }
}

/// A dynamic per-token quantization of `v`: the row's scale `max(c(min(max|v|, ub) / M), c(1 / (M ·
/// 512)))` and `v / scale`. Returns `(quotient, scale)`.
fn dynamic_quant_steps(b: &mut Builder, v: ValueId, scale_ub: Option<InputId>, max: f64) -> (ValueId, ValueId) {
    let mut absmax = b.reduce(ReduceOp::MaxAbs, v, None, Precision::Wide);
    if let Some(ub) = scale_ub {
        let bound = b.param(ub, Precision::Compute);
        absmax = b.binary(BinaryOp::Min, absmax, bound, Precision::Wide);
    }
    let floor = b.constant(1.0 / (max * 512.0));
    let floor = b.round(floor, Precision::Compute);
    let m = b.constant(max);
    let scale = b.binary(BinaryOp::Div, absmax, m, Precision::Compute);
    let scale = b.binary(BinaryOp::Max, scale, floor, Precision::Wide);
    let quotient = b.binary(BinaryOp::Div, v, scale, Precision::Compute);
    (quotient, scale)
}

fn build(b: Builder) -> RowProgram {
    b.build().expect("the built-in programs are well formed (tested)")
}

/// `rms_norm(x, weight?, epsilon, variance_size?)`.
pub fn rms_norm(weight: bool, variance_size: bool) -> RowProgram {
    let mut b = RowProgram::builder("rms_norm");
    let x = b.activation("x", 1);
    let w = weight.then(|| b.weight("weight"));
    let eps = b.scalar("epsilon");
    let variance = variance_size.then(|| b.scalar("variance_size"));
    let a = b.load(x, 0);
    let out = norm_steps(&mut b, a, w, eps, variance);
    b.store("out", out, OutDType::Like(x), None);
    build(b)
}

/// `fused_add_rms_norm(x, x_residual, weight?, epsilon, variance_size?)` with `rounding`: `x ←
/// rms_norm(x + residual)` and `residual ← x + residual`, both in place.
pub fn fused_add_rms_norm(weight: bool, variance_size: bool, rounding: Rounding) -> RowProgram {
    let mut b = RowProgram::builder("fused_add_rms_norm");
    let x = b.activation("x", 1);
    let residual = b.activation("x_residual", 1);
    let w = weight.then(|| b.weight("weight"));
    let eps = b.scalar("epsilon");
    let variance = variance_size.then(|| b.scalar("variance_size"));
    let sum = add_residual(&mut b, x, residual, rounding);
    let out = norm_steps(&mut b, sum, w, eps, variance);
    b.store("out", out, OutDType::Like(x), Some(x));
    // The op's outputs are (out, residual_out).
    b.program.outputs.rotate_right(1);
    build(b)
}

/// `silu(g) = g / (1 + e^-g)` in `f64`.
fn silu_steps(b: &mut Builder, g: ValueId) -> ValueId {
    let negated = b.unary(UnaryOp::Neg, g, Precision::Wide);
    let exp = b.unary(UnaryOp::Exp, negated, Precision::Wide);
    let one = b.constant(1.0);
    let denominator = b.binary(BinaryOp::Add, one, exp, Precision::Wide);
    b.binary(BinaryOp::Div, g, denominator, Precision::Wide)
}

/// gelu of `g` in `f64`, in the forms of [`crate::gated::gelu_erf`] and
/// [`crate::gated::gelu_tanh`].
fn gelu_steps(b: &mut Builder, g: ValueId, approximate: Approximate) -> ValueId {
    match approximate {
        Approximate::None => {
            // 0.5·g·erfc(−g/√2)
            let half = b.constant(0.5);
            let half_g = b.binary(BinaryOp::Mul, half, g, Precision::Wide);
            let negated = b.unary(UnaryOp::Neg, g, Precision::Wide);
            let k = b.constant(std::f64::consts::FRAC_1_SQRT_2);
            let t = b.binary(BinaryOp::Mul, negated, k, Precision::Wide);
            let erfc = b.unary(UnaryOp::Erfc, t, Precision::Wide);
            b.binary(BinaryOp::Mul, half_g, erfc, Precision::Wide)
        }
        Approximate::Tanh => {
            // g / (1 + e^(−2·√(2/π)·(g + 0.044715·g³)))
            const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
            let c = b.constant(0.044_715);
            let cube = b.binary(BinaryOp::Mul, c, g, Precision::Wide);
            let cube = b.binary(BinaryOp::Mul, cube, g, Precision::Wide);
            let cube = b.binary(BinaryOp::Mul, cube, g, Precision::Wide);
            let inner = b.binary(BinaryOp::Add, g, cube, Precision::Wide);
            let k = b.constant(-2.0 * SQRT_2_OVER_PI);
            let z = b.binary(BinaryOp::Mul, k, inner, Precision::Wide);
            let exp = b.unary(UnaryOp::Exp, z, Precision::Wide);
            let one = b.constant(1.0);
            let denominator = b.binary(BinaryOp::Add, one, exp, Precision::Wide);
            b.binary(BinaryOp::Div, g, denominator, Precision::Wide)
        }
    }
}

/// A gated op: `out = round_d(round_d(act(gate)) · up)`, gate and up the two blocks of `x`.
fn gated(name: &str, activation: impl FnOnce(&mut Builder, InputId, ValueId) -> ValueId) -> RowProgram {
    let mut b = RowProgram::builder(name);
    let x = b.activation("x", 2);
    let (gate, up) = (b.load(x, 0), b.load(x, 1));
    let act = activation(&mut b, x, gate);
    let act = b.round(act, Precision::Like(x));
    let out = b.binary(BinaryOp::Mul, act, up, Precision::Like(x));
    b.store("out", out, OutDType::Like(x), None);
    build(b)
}

/// `silu_and_mul(x)`.
pub fn silu_and_mul() -> RowProgram {
    gated("silu_and_mul", |b, _, g| silu_steps(b, g))
}

/// `gelu_and_mul(x, approximate)`.
pub fn gelu_and_mul(approximate: Approximate) -> RowProgram {
    gated("gelu_and_mul", |b, _, g| gelu_steps(b, g, approximate))
}

/// `gelu_and_mul_sparse(x, std_multiplier, approximate)`: the gate above `mean + std ·
/// std_multiplier` of its row (biased std, both reduced wide and rounded to x's dtype), through
/// relu and gelu, times the up half.
pub fn gelu_and_mul_sparse(approximate: Approximate) -> RowProgram {
    let mut b = RowProgram::builder("gelu_and_mul_sparse");
    let x = b.activation("x", 2);
    let multiplier = b.scalar("std_multiplier");
    let (gate, up) = (b.load(x, 0), b.load(x, 1));
    let d = Precision::Like(x);
    let n = b.width();
    let sum = b.reduce(ReduceOp::Sum, gate, None, Precision::Wide);
    let mean = b.binary(BinaryOp::Div, sum, n, Precision::Wide);
    let deviation = b.binary(BinaryOp::Sub, gate, mean, Precision::Wide);
    let squares = b.reduce(ReduceOp::SumSquares, deviation, None, Precision::Wide);
    let variance = b.binary(BinaryOp::Div, squares, n, Precision::Wide);
    let std = b.unary(UnaryOp::Sqrt, variance, d);
    let m = b.param(multiplier, Precision::Wide);
    let shift = b.binary(BinaryOp::Mul, std, m, d);
    let mean = b.round(mean, d);
    let cutoff = b.binary(BinaryOp::Add, mean, shift, d);
    let shifted = b.binary(BinaryOp::Sub, gate, cutoff, d);
    let relu = b.unary(UnaryOp::Relu, shifted, Precision::Wide);
    let act = gelu_steps(&mut b, relu, approximate);
    let act = b.round(act, d);
    let out = b.binary(BinaryOp::Mul, act, up, d);
    b.store("out", out, OutDType::Like(x), None);
    build(b)
}

/// `static_scaled_fp8_quant(x, scale, out_dtype, rounding)`.
pub fn static_scaled_fp8_quant(out_dtype: DType, rounding: Rounding) -> Result<RowProgram, ProgramError> {
    let name = "static_scaled_fp8_quant";
    fp8_max(name, out_dtype)?;
    let mut b = RowProgram::builder(name);
    let x = b.activation("x", 1);
    let scale = b.scalar_tensor("scale");
    let v = b.load(x, 0);
    let q = static_quant_steps(&mut b, v, scale, rounding);
    b.store("out", q, OutDType::Fixed(out_dtype), None);
    Ok(build(b))
}

/// `dynamic_per_token_scaled_fp8_quant(x, scale_ub?, out_dtype)`: the codes and the per-token scales.
pub fn dynamic_per_token_scaled_fp8_quant(out_dtype: DType, scale_ub: bool) -> Result<RowProgram, ProgramError> {
    let name = "dynamic_per_token_scaled_fp8_quant";
    let max = fp8_max(name, out_dtype)?;
    let mut b = RowProgram::builder(name);
    let x = b.activation("x", 1);
    let ub = scale_ub.then(|| b.scalar_tensor("scale_ub"));
    let v = b.load(x, 0);
    let (q, scale) = dynamic_quant_steps(&mut b, v, ub, max);
    b.store("out", q, OutDType::Fixed(out_dtype), None);
    b.store("scales", scale, OutDType::Fixed(DType::F32), None);
    Ok(build(b))
}

/// `silu_and_mul` then `dynamic_per_token_scaled_fp8_quant` of its output, fused (what vLLM fuses
/// on GPUs before an fp8 matmul): `x` is `[..., 2d]`; outputs the codes `[..., d]` and the per-token
/// scales. The gated output is rounded to x's dtype first, as the unfused pair stores it, so the
/// program gives the pair's bits.
pub fn silu_and_mul_dynamic_fp8_quant(out_dtype: DType, scale_ub: bool) -> Result<RowProgram, ProgramError> {
    let name = "silu_and_mul_dynamic_fp8_quant";
    let max = fp8_max(name, out_dtype)?;
    let mut b = RowProgram::builder(name);
    let x = b.activation("x", 2);
    let ub = scale_ub.then(|| b.scalar_tensor("scale_ub"));
    let (gate, up) = (b.load(x, 0), b.load(x, 1));
    let act = silu_steps(&mut b, gate);
    let act = b.round(act, Precision::Like(x));
    let gated = b.binary(BinaryOp::Mul, act, up, Precision::Like(x));
    let (q, scale) = dynamic_quant_steps(&mut b, gated, ub, max);
    b.store("out", q, OutDType::Fixed(out_dtype), None);
    b.store("scales", scale, OutDType::Fixed(DType::F32), None);
    Ok(build(b))
}

/// `layer_norm(x, weight?, bias?, epsilon)` ([`crate::layer_norm`], whose semantics this is):
/// inputs `x`, `weight` and `bias` (those present) and `epsilon`; output `out`. The mean and the
/// biased variance from two wide sums, every step rounded to the compute type, the result to x's
/// dtype once.
pub fn layer_norm(weight: bool, bias: bool) -> RowProgram {
    let mut b = RowProgram::builder("layer_norm");
    let x = b.activation("x", 1);
    let w = weight.then(|| b.weight("weight"));
    let bi = bias.then(|| b.weight("bias"));
    let eps = b.scalar("epsilon");
    let a = b.load(x, 0);
    let y = layer_norm_steps(&mut b, a, w, bi, eps);
    b.store("out", y, OutDType::Like(x), None);
    build(b)
}

/// The steps of `layer_norm` on `a` (the row's values in the compute dtype): the mean and the
/// biased variance from two wide sums each divided once, every step rounded to the compute type,
/// then the weight and the bias when given. Returns the value stored as the norm's output.
fn layer_norm_steps(
    b: &mut Builder,
    a: ValueId,
    weight: Option<InputId>,
    bias: Option<InputId>,
    epsilon: InputId,
) -> ValueId {
    let c = Precision::Compute;
    let n = b.width();
    let sum = b.reduce(ReduceOp::Sum, a, None, Precision::Wide);
    let mean = b.binary(BinaryOp::Div, sum, n, c);
    let d = b.binary(BinaryOp::Sub, a, mean, c);
    let squares = b.reduce(ReduceOp::SumSquares, d, None, Precision::Wide);
    let var = b.binary(BinaryOp::Div, squares, n, c);
    let e = b.param(epsilon, c);
    let shifted = b.binary(BinaryOp::Add, var, e, c);
    let root = b.unary(UnaryOp::Sqrt, shifted, c);
    let rstd = b.unary(UnaryOp::Recip, root, c);
    let mut y = b.binary(BinaryOp::Mul, d, rstd, c);
    if let Some(w) = weight {
        let wv = b.load_weight(w);
        y = b.binary(BinaryOp::Mul, y, wv, c);
    }
    if let Some(bi) = bias {
        let bv = b.load_weight(bi);
        y = b.binary(BinaryOp::Add, y, bv, c);
    }
    y
}

/// `fused_add_layer_norm(x, x_residual, weight?, bias?, epsilon)` with `rounding`
/// ([`crate::fused_add_layer_norm`]): `residual ← x + residual` and `x ← layer_norm(x +
/// residual)`, both in place; outputs `(out, residual_out)`. The sum is the one
/// `fused_add_rms_norm` computes (rounded to x's dtype under `rounding = "dtype"`), the norm
/// `layer_norm`'s.
pub fn fused_add_layer_norm(weight: bool, bias: bool, rounding: Rounding) -> RowProgram {
    let mut b = RowProgram::builder("fused_add_layer_norm");
    let x = b.activation("x", 1);
    let residual = b.activation("x_residual", 1);
    let w = weight.then(|| b.weight("weight"));
    let bi = bias.then(|| b.weight("bias"));
    let eps = b.scalar("epsilon");
    let sum = add_residual(&mut b, x, residual, rounding);
    let out = layer_norm_steps(&mut b, sum, w, bi, eps);
    b.store("out", out, OutDType::Like(x), Some(x));
    // The op's outputs are (out, residual_out).
    b.program.outputs.rotate_right(1);
    build(b)
}

/// `fused_sandwich_rms_norm(x, x_residual, post_weight?, pre_weight?, epsilon)` with `rounding`
/// ([`crate::fused_sandwich_rms_norm`]): Gemma 2 and 3's norms around a residual add. `h =
/// rms_norm(x, post_weight)` rounded to x's dtype (as `rms_norm` stores it), then
/// `fused_add_rms_norm(h, residual, pre_weight)`: `residual ← h + residual` and `x ←
/// rms_norm(h + residual, pre_weight)`, both in place; outputs `(out, residual_out)`.
pub fn fused_sandwich_rms_norm(post_weight: bool, pre_weight: bool, rounding: Rounding) -> RowProgram {
    let mut b = RowProgram::builder("fused_sandwich_rms_norm");
    let x = b.activation("x", 1);
    let residual = b.activation("x_residual", 1);
    let post = post_weight.then(|| b.weight("post_weight"));
    let pre = pre_weight.then(|| b.weight("pre_weight"));
    let eps = b.scalar("epsilon");
    let a = b.load(x, 0);
    let h = norm_steps(&mut b, a, post, eps, None);
    let h = b.round(h, Precision::Like(x));
    let r = b.load(residual, 0);
    let sum = b.binary(BinaryOp::Add, h, r, Precision::Compute);
    let sum = match rounding {
        Rounding::Dtype => b.round(sum, Precision::Like(x)),
        Rounding::Exact => sum,
    };
    b.store("residual_out", sum, OutDType::Like(residual), Some(residual));
    let out = norm_steps(&mut b, sum, pre, eps, None);
    b.store("out", out, OutDType::Like(x), Some(x));
    b.program.outputs.rotate_right(1);
    build(b)
}

/// The norm (plain or after the residual add) rounded to x's dtype, as the quantization reads it.
fn norm_for_quant(b: &mut Builder, fused: Option<Rounding>, weight: bool) -> (InputId, ValueId) {
    let x = b.activation("x", 1);
    let residual = fused.map(|_| b.activation("x_residual", 1));
    let w = weight.then(|| b.weight("weight"));
    let eps = b.scalar("epsilon");
    let a = match (residual, fused) {
        (Some(residual), Some(rounding)) => add_residual(b, x, residual, rounding),
        _ => b.load(x, 0),
    };
    let out = norm_steps(b, a, w, eps, None);
    (x, b.round(out, Precision::Like(x)))
}

/// `rms_norm_static_fp8_quant(x, weight?, epsilon, scale, out_dtype, rounding)`, or with `fused`
/// `fused_add_rms_norm_static_fp8_quant(x, x_residual, weight?, ...)` (outputs: the residual, then
/// the codes).
pub fn norm_static_fp8_quant(
    fused: bool,
    weight: bool,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<RowProgram, ProgramError> {
    let name = if fused { "fused_add_rms_norm_static_fp8_quant" } else { "rms_norm_static_fp8_quant" };
    fp8_max(name, out_dtype)?;
    let mut b = RowProgram::builder(name);
    let (_, normalized) = norm_for_quant(&mut b, fused.then_some(rounding), weight);
    let scale = b.scalar_tensor("scale");
    let q = static_quant_steps(&mut b, normalized, scale, rounding);
    b.store("out", q, OutDType::Fixed(out_dtype), None);
    Ok(build(b))
}

/// `rms_norm_dynamic_per_token_quant(x, weight?, epsilon, scale_ub?, out_dtype, rounding)`, or
/// with `fused` `fused_add_rms_norm_dynamic_per_token_quant(x, x_residual, ...)` (outputs: the
/// residual when fused, the codes, the scales).
pub fn norm_dynamic_per_token_quant(
    fused: bool,
    weight: bool,
    scale_ub: bool,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<RowProgram, ProgramError> {
    let name = if fused { "fused_add_rms_norm_dynamic_per_token_quant" } else { "rms_norm_dynamic_per_token_quant" };
    let max = fp8_max(name, out_dtype)?;
    let mut b = RowProgram::builder(name);
    let (_, normalized) = norm_for_quant(&mut b, fused.then_some(rounding), weight);
    let ub = scale_ub.then(|| b.scalar_tensor("scale_ub"));
    let (q, scale) = dynamic_quant_steps(&mut b, normalized, ub, max);
    b.store("out", q, OutDType::Fixed(out_dtype), None);
    b.store("scales", scale, OutDType::Fixed(DType::F32), None);
    Ok(build(b))
}

/// The products' and the sum's precision of a rotation under `rounding`: f32 (the compute dtype),
/// or x's dtype with `"dtype"` (vLLM's rounding of 16-bit tensors; the same on f32 and f64).
fn rotation_precision(x: InputId, rounding: Rounding) -> Precision {
    match rounding {
        Rounding::Exact => Precision::Compute,
        Rounding::Dtype => Precision::Like(x),
    }
}

/// `rotary_embedding` of one tensor, in place: `rotary(positions, x, cos_sin_cache)` with x's rows
/// the heads (`[tokens, heads, head_size]`; positions one per token), the cache's pairs NeoX-style
/// when `neox` (else GPT-J), each pair `(x·c − y·s, y·c + x·s)` with the products and the sum
/// rounded as `rounding` says.
pub fn rotary(neox: bool, rounding: Rounding) -> RowProgram {
    let mut b = RowProgram::builder(format!("rotary_{}", if neox { "neox" } else { "gptj" }));
    let positions = b.positions("positions");
    let x = b.activation("x", 1);
    let cache = b.cos_sin_cache("cos_sin_cache", positions, neox);
    let v = b.load(x, 0);
    let precision = rotation_precision(x, rounding);
    let rotated = b.rotate(v, cache, precision, precision);
    b.store("out", rotated, OutDType::Like(x), Some(x));
    build(b)
}

/// Qwen3's head norm and rotation of one tensor, in place: `rms_norm(x, weight, epsilon)` of each
/// head (rounded to x's dtype, as the norm's output is stored), then [`rotary`] of it:
/// `rms_norm_rotary(positions, x, weight, cos_sin_cache, epsilon)`, the bits of the two ops run one
/// after the other.
pub fn rms_norm_rotary(neox: bool, rounding: Rounding) -> RowProgram {
    let mut b = RowProgram::builder(format!("rms_norm_rotary_{}", if neox { "neox" } else { "gptj" }));
    let positions = b.positions("positions");
    let x = b.activation("x", 1);
    let weight = b.weight("weight");
    let cache = b.cos_sin_cache("cos_sin_cache", positions, neox);
    let epsilon = b.scalar("epsilon");
    let v = b.load(x, 0);
    let normed = norm_steps(&mut b, v, Some(weight), epsilon, None);
    let normed = b.round(normed, Precision::Like(x));
    let precision = rotation_precision(x, rounding);
    let rotated = b.rotate(normed, cache, precision, precision);
    b.store("out", rotated, OutDType::Like(x), Some(x));
    build(b)
}

/// Every built-in program in the configurations the ops take: with and without a weight, both
/// roundings, both gelu forms, both fp8 dtypes, with and without a bound or a variance size, and
/// `layer_norm`'s with and without its weight and bias, the fused `silu_and_mul` + dynamic
/// quantization, the fused add + `layer_norm` and sandwich norms in both roundings, and the
/// rotations and head norms + rotations in both styles and roundings (35 programs), for tests and
/// benchmarks that cover them all.
pub fn all() -> Vec<RowProgram> {
    let fp8 = |result: Result<RowProgram, ProgramError>| result.expect("an fp8 dtype");
    let mut programs = vec![rms_norm(true, false), rms_norm(false, false), rms_norm(true, true)];
    for rounding in [Rounding::Exact, Rounding::Dtype] {
        programs.push(fused_add_rms_norm(true, false, rounding));
    }
    programs.push(fused_add_rms_norm(false, true, Rounding::Exact));
    programs.push(silu_and_mul());
    for approximate in [Approximate::None, Approximate::Tanh] {
        programs.push(gelu_and_mul(approximate));
        programs.push(gelu_and_mul_sparse(approximate));
    }
    for (out_dtype, rounding) in [(DType::F8E4M3FN, Rounding::Exact), (DType::F8E5M2, Rounding::Dtype)] {
        programs.push(fp8(static_scaled_fp8_quant(out_dtype, rounding)));
        programs.push(fp8(dynamic_per_token_scaled_fp8_quant(out_dtype, rounding == Rounding::Dtype)));
        for fused in [false, true] {
            programs.push(fp8(norm_static_fp8_quant(fused, true, out_dtype, rounding)));
            programs.push(fp8(norm_dynamic_per_token_quant(
                fused,
                fused,
                rounding == Rounding::Exact,
                out_dtype,
                rounding,
            )));
        }
    }
    programs.push(fp8(silu_and_mul_dynamic_fp8_quant(DType::F8E4M3FN, false)));
    programs.push(fp8(silu_and_mul_dynamic_fp8_quant(DType::F8E5M2, true)));
    programs.push(layer_norm(true, true));
    programs.push(layer_norm(false, false));
    programs.push(fused_add_layer_norm(true, true, Rounding::Exact));
    programs.push(fused_add_layer_norm(false, false, Rounding::Dtype));
    programs.push(fused_sandwich_rms_norm(true, true, Rounding::Dtype));
    programs.push(fused_sandwich_rms_norm(false, true, Rounding::Exact));
    programs.push(rotary(true, Rounding::Exact));
    programs.push(rotary(false, Rounding::Dtype));
    programs.push(rms_norm_rotary(true, Rounding::Dtype));
    programs.push(rms_norm_rotary(false, Rounding::Exact));
    programs
}

#[cfg(test)]
mod tests {
    use super::super::RowArg;
    use super::*;
    use ir_core::Tensor;
    use ir_core::testing::InputRng;

    const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];
    const ROUNDINGS: [Rounding; 2] = [Rounding::Exact, Rounding::Dtype];
    const FP8: [DType; 2] = [DType::F8E4M3FN, DType::F8E5M2];

    /// Equal dtype, shape and bits (any NaN equals any NaN).
    fn assert_same(ours: &Tensor, native: &Tensor, what: &str) {
        assert_eq!((ours.dtype(), ours.shape()), (native.dtype(), native.shape()), "{what}");
        let (a, b) = (ours.to_f64_vec().unwrap(), native.to_f64_vec().unwrap());
        for (index, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{what}: element {index}: {x} != {y}");
        }
    }

    /// Activations of `[rows, width]` in `dtype`: N(0, scale) with awkward rows (zeros, a NaN, an
    /// infinity, values beyond the fp8 range); with `strided`, a column slice of a wider buffer.
    fn activation(rng: &mut InputRng, dtype: DType, rows: usize, width: usize, scale: f64, strided: bool) -> Tensor {
        let wide = if strided { width + 3 } else { width };
        let t = rng.normal(dtype, &[rows, wide], 0.0, scale).unwrap();
        let mut values = t.to_f64_vec().unwrap();
        values[..wide].iter_mut().for_each(|v| *v = 0.0);
        if rows > 2 && wide >= 3 {
            values[wide + 1] = f64::NAN;
            values[2 * wide + 2] = f64::INFINITY;
        }
        if rows > 3 && wide >= 2 {
            values[3 * wide] = 1e4;
            values[3 * wide + 1] = -7e4;
        }
        let t = Tensor::from_f64(dtype, &[rows, wide], &values).unwrap();
        if strided { t.narrow(1, 1, width).unwrap() } else { t }
    }

    fn weight(rng: &mut InputRng, dtype: DType, width: usize) -> Tensor {
        rng.normal(dtype, &[width], 1.0, 0.1).unwrap()
    }

    fn scalar_tensor(value: f64) -> Tensor {
        Tensor::from_f64(DType::F32, &[1], &[value]).unwrap()
    }

    #[test]
    fn the_norm_programs_give_the_native_bits() {
        let mut rng = InputRng::new(7);
        for dtype in DTYPES {
            for strided in [false, true] {
                let (rows, width) = (5, 24);
                let x = activation(&mut rng, dtype, rows, width, 1.0, strided);
                let r = activation(&mut rng, dtype, rows, width, 1.0, !strided);
                let w = weight(&mut rng, dtype, width);
                for (with_weight, variance) in [(false, None), (true, None), (true, Some(10))] {
                    let what = format!("rms_norm {dtype} strided {strided} weight {with_weight} variance {variance:?}");
                    let wref = with_weight.then_some(&w);
                    let native = crate::rms_norm::native(&x, wref, 1e-5, variance).unwrap();
                    let program = rms_norm(with_weight, variance.is_some());
                    let mut args = vec![RowArg::Tensor(&x)];
                    args.extend(wref.map(RowArg::Tensor));
                    args.push(RowArg::Scalar(1e-5));
                    args.extend(variance.map(|v| RowArg::Scalar(v as f64)));
                    assert_same(&program.run(&args).unwrap()[0], &native, &what);

                    for rounding in ROUNDINGS {
                        let what = format!("fused_add_{what} {rounding:?}");
                        let (out, residual) =
                            crate::fused_add_rms_norm::native(&x, &r, wref, 1e-5, variance, rounding).unwrap();
                        let program = fused_add_rms_norm(with_weight, variance.is_some(), rounding);
                        let mut args = vec![RowArg::Tensor(&x), RowArg::Tensor(&r)];
                        args.extend(wref.map(RowArg::Tensor));
                        args.push(RowArg::Scalar(1e-5));
                        args.extend(variance.map(|v| RowArg::Scalar(v as f64)));
                        let ours = program.run(&args).unwrap();
                        assert_same(&ours[0], &out, &format!("{what}: out"));
                        assert_same(&ours[1], &residual, &format!("{what}: residual"));
                    }
                }
            }
        }
    }

    #[test]
    fn the_gated_programs_give_the_native_bits() {
        let mut rng = InputRng::new(11);
        for dtype in DTYPES {
            for strided in [false, true] {
                let x = activation(&mut rng, dtype, 5, 32, 3.0, strided);
                let what = format!("{dtype} strided {strided}");
                let native = crate::silu_and_mul::native(&x).unwrap();
                assert_same(&silu_and_mul().run(&[RowArg::Tensor(&x)]).unwrap()[0], &native, &format!("silu {what}"));
                for approximate in [Approximate::None, Approximate::Tanh] {
                    let native = crate::gelu_and_mul::native(&x, approximate).unwrap();
                    let ours = gelu_and_mul(approximate).run(&[RowArg::Tensor(&x)]).unwrap();
                    assert_same(&ours[0], &native, &format!("gelu {approximate:?} {what}"));
                    for multiplier in [0.0, 1.6448536269514722] {
                        let native = crate::gelu_and_mul_sparse::native(&x, multiplier, approximate).unwrap();
                        let args = [RowArg::Tensor(&x), RowArg::Scalar(multiplier)];
                        let ours = gelu_and_mul_sparse(approximate).run(&args).unwrap();
                        assert_same(&ours[0], &native, &format!("gelu sparse {approximate:?} {multiplier} {what}"));
                    }
                }
            }
        }
    }

    #[test]
    fn the_quantization_programs_give_the_native_bits() {
        let mut rng = InputRng::new(13);
        for dtype in DTYPES {
            for strided in [false, true] {
                let x = activation(&mut rng, dtype, 5, 16, 100.0, strided);
                let scale = scalar_tensor(0.37);
                for out_dtype in FP8 {
                    let what = format!("{dtype} strided {strided} {out_dtype}");
                    for rounding in ROUNDINGS {
                        let native = crate::static_scaled_fp8_quant::native(&x, &scale, out_dtype, rounding).unwrap();
                        let program = static_scaled_fp8_quant(out_dtype, rounding).unwrap();
                        let ours = program.run(&[RowArg::Tensor(&x), RowArg::Tensor(&scale)]).unwrap();
                        assert_same(&ours[0], &native, &format!("static {rounding:?} {what}"));
                    }
                    for ub in [None, Some(scalar_tensor(50.0))] {
                        let (q, scales) =
                            crate::dynamic_per_token_scaled_fp8_quant::native(&x, ub.as_ref(), out_dtype).unwrap();
                        let program = dynamic_per_token_scaled_fp8_quant(out_dtype, ub.is_some()).unwrap();
                        let mut args = vec![RowArg::Tensor(&x)];
                        args.extend(ub.as_ref().map(RowArg::Tensor));
                        let ours = program.run(&args).unwrap();
                        assert_same(&ours[0], &q, &format!("dynamic ub {ub:?} {what}: q"));
                        assert_same(&ours[1], &scales, &format!("dynamic ub {ub:?} {what}: scales"));
                    }
                }
            }
        }
        let refused = static_scaled_fp8_quant(DType::BF16, Rounding::Exact).unwrap_err().to_string();
        assert!(refused.contains("bf16 is not f8e4m3fn or f8e5m2"), "{refused}");
    }

    #[test]
    fn the_norm_quantization_programs_give_the_native_bits() {
        let mut rng = InputRng::new(17);
        for dtype in DTYPES {
            let x = activation(&mut rng, dtype, 5, 16, 1.0, false);
            let r = activation(&mut rng, dtype, 5, 16, 1.0, true);
            let w = weight(&mut rng, dtype, 16);
            let scale = scalar_tensor(0.01);
            let ub = scalar_tensor(2.0);
            for (with_weight, rounding, out_dtype) in [
                (true, Rounding::Exact, DType::F8E4M3FN),
                (false, Rounding::Dtype, DType::F8E5M2),
                (true, Rounding::Dtype, DType::F8E4M3FN),
            ] {
                let what = format!("{dtype} weight {with_weight} {rounding:?} {out_dtype}");
                let wref = with_weight.then_some(&w);
                let head = |fused: bool| {
                    let mut args = vec![RowArg::Tensor(&x)];
                    if fused {
                        args.push(RowArg::Tensor(&r));
                    }
                    args.extend(wref.map(RowArg::Tensor));
                    args.push(RowArg::Scalar(1e-6));
                    args
                };
                let q = crate::rms_norm_static_fp8_quant::native(&x, wref, 1e-6, &scale, out_dtype, rounding).unwrap();
                let mut args = head(false);
                args.push(RowArg::Tensor(&scale));
                let ours = norm_static_fp8_quant(false, with_weight, out_dtype, rounding).unwrap().run(&args).unwrap();
                assert_same(&ours[0], &q, &format!("rms_norm_static {what}"));

                let (residual, q) =
                    crate::fused_add_rms_norm_static_fp8_quant::native(&x, &r, wref, 1e-6, &scale, out_dtype, rounding)
                        .unwrap();
                let mut args = head(true);
                args.push(RowArg::Tensor(&scale));
                let ours = norm_static_fp8_quant(true, with_weight, out_dtype, rounding).unwrap().run(&args).unwrap();
                assert_same(&ours[0], &residual, &format!("fused_add_static {what}: residual"));
                assert_same(&ours[1], &q, &format!("fused_add_static {what}: q"));

                for bound in [None, Some(&ub)] {
                    let (q, scales) =
                        crate::rms_norm_dynamic_per_token_quant::native(&x, wref, 1e-6, bound, out_dtype, rounding)
                            .unwrap();
                    let mut args = head(false);
                    args.extend(bound.map(RowArg::Tensor));
                    let program =
                        norm_dynamic_per_token_quant(false, with_weight, bound.is_some(), out_dtype, rounding);
                    let ours = program.unwrap().run(&args).unwrap();
                    assert_same(&ours[0], &q, &format!("rms_norm_dynamic {what} {bound:?}: q"));
                    assert_same(&ours[1], &scales, &format!("rms_norm_dynamic {what} {bound:?}: scales"));

                    let (residual, q, scales) = crate::fused_add_rms_norm_dynamic_per_token_quant::native(
                        &x, &r, wref, 1e-6, bound, out_dtype, rounding,
                    )
                    .unwrap();
                    let mut args = head(true);
                    args.extend(bound.map(RowArg::Tensor));
                    let program = norm_dynamic_per_token_quant(true, with_weight, bound.is_some(), out_dtype, rounding);
                    let ours = program.unwrap().run(&args).unwrap();
                    assert_same(&ours[0], &residual, &format!("fused_add_dynamic {what} {bound:?}: residual"));
                    assert_same(&ours[1], &q, &format!("fused_add_dynamic {what} {bound:?}: q"));
                    assert_same(&ours[2], &scales, &format!("fused_add_dynamic {what} {bound:?}: scales"));
                }
            }
        }
    }

    /// Query `[tokens, heads · head_size]` rotated by native `rotary_embedding` and by the program
    /// on its heads, every dtype, both styles and roundings, a partial and a full rotary width.
    #[test]
    fn the_rotary_program_gives_the_native_bits() {
        let mut rng = InputRng::new(29);
        let (tokens, heads, head_size, max_position) = (5, 3, 8, 7);
        let positions = Tensor::from_slice::<i64>(&[tokens], &[6, 0, 3, 3, 1]).unwrap();
        for dtype in DTYPES {
            let query = activation(&mut rng, dtype, tokens, heads * head_size, 2.0, false);
            for rotary_dim in [4, head_size] {
                let cache = rng.normal(dtype, &[max_position, rotary_dim], 0.0, 1.0).unwrap();
                for neox in [true, false] {
                    for rounding in ROUNDINGS {
                        let what = format!("{dtype} rotary_dim {rotary_dim} neox {neox} {rounding:?}");
                        let (native, _) = crate::rotary_embedding::native(
                            &positions,
                            &query,
                            None,
                            &cache,
                            head_size as i64,
                            rotary_dim as i64,
                            neox,
                            rounding,
                        )
                        .unwrap();
                        let heads_view = query.reshape(&[tokens, heads, head_size]).unwrap();
                        let args = [RowArg::Tensor(&positions), RowArg::Tensor(&heads_view), RowArg::Tensor(&cache)];
                        let ours = rotary(neox, rounding).run(&args).unwrap();
                        let ours = ours[0].reshape(&[tokens, heads * head_size]).unwrap();
                        assert_same(&ours, &native, &what);
                    }
                }
            }
        }
    }

    /// Qwen3's head norm then rotation: the program gives the bits of native `rms_norm` on the heads
    /// followed by native `rotary_embedding`, every dtype (a weight of x's dtype and an f32 one),
    /// both styles and roundings.
    #[test]
    fn the_head_norm_rotation_gives_the_native_pairs_bits() {
        let mut rng = InputRng::new(31);
        let (tokens, heads, head_size, max_position) = (4, 2, 16, 5);
        let positions = Tensor::from_slice::<i64>(&[tokens], &[4, 0, 2, 2]).unwrap();
        for dtype in DTYPES {
            let query = activation(&mut rng, dtype, tokens, heads * head_size, 2.0, false);
            let heads_view = query.reshape(&[tokens, heads, head_size]).unwrap();
            let cache = rng.normal(dtype, &[max_position, head_size], 0.0, 1.0).unwrap();
            for weight_dtype in [dtype, DType::F32] {
                let w = weight(&mut rng, weight_dtype, head_size);
                let normed = crate::rms_norm::native(&heads_view, Some(&w), 1e-6, None).unwrap();
                let normed = normed.reshape(&[tokens, heads * head_size]).unwrap();
                for neox in [true, false] {
                    for rounding in ROUNDINGS {
                        let what = format!("{dtype} weight {weight_dtype} neox {neox} {rounding:?}");
                        let (native, _) = crate::rotary_embedding::native(
                            &positions,
                            &normed,
                            None,
                            &cache,
                            head_size as i64,
                            head_size as i64,
                            neox,
                            rounding,
                        )
                        .unwrap();
                        let args = [
                            RowArg::Tensor(&positions),
                            RowArg::Tensor(&heads_view),
                            RowArg::Tensor(&w),
                            RowArg::Tensor(&cache),
                            RowArg::Scalar(1e-6),
                        ];
                        let ours = rms_norm_rotary(neox, rounding).run(&args).unwrap();
                        assert_same(&ours[0].reshape(&[tokens, heads * head_size]).unwrap(), &native, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn rotary_arguments_that_do_not_fit_are_refused_naming_them() {
        let program = rotary(true, Rounding::Exact);
        let x = Tensor::zeros(DType::F32, &[2, 3, 8]).unwrap();
        let cache = Tensor::zeros(DType::F32, &[4, 8]).unwrap();
        let fails = |positions: &Tensor, x: &Tensor, cache: &Tensor, needle: &str| {
            let args = [RowArg::Tensor(positions), RowArg::Tensor(x), RowArg::Tensor(cache)];
            let error = program.run(&args).unwrap_err().to_string();
            assert!(error.contains(needle), "{error}");
        };
        let positions = Tensor::from_slice::<i64>(&[2], &[1, 3]).unwrap();
        fails(&Tensor::from_slice::<i64>(&[2], &[1, 4]).unwrap(), &x, &cache, "position 4 of row group 1 is outside");
        fails(&Tensor::from_slice::<i64>(&[2], &[-1, 0]).unwrap(), &x, &cache, "position -1 of row group 0");
        fails(&Tensor::from_slice::<i64>(&[4], &[0, 1, 2, 3]).unwrap(), &x, &cache, "do not split the 6 rows");
        fails(&Tensor::zeros(DType::F32, &[2]).unwrap(), &x, &cache, "expected i64");
        fails(&positions, &x, &Tensor::zeros(DType::F32, &[4, 10]).unwrap(), "R even in 2..=8");
        fails(&positions, &x, &Tensor::zeros(DType::F32, &[4, 3]).unwrap(), "R even in 2..=8");
        let ok = [RowArg::Tensor(&positions), RowArg::Tensor(&x), RowArg::Tensor(&cache)];
        assert_eq!(program.run(&ok).unwrap()[0].shape(), [2, 3, 8]);
    }

    #[test]
    fn the_catalog_holds_every_configuration_once() {
        let programs = all();
        assert_eq!(programs.len(), 35);
        let mut fingerprints: Vec<u64> = programs.iter().map(RowProgram::fingerprint).collect();
        fingerprints.sort_unstable();
        fingerprints.dedup();
        assert_eq!(fingerprints.len(), programs.len(), "no program twice");
    }

    #[test]
    fn the_fused_silu_quantization_gives_the_unfused_pairs_bits() {
        let mut rng = InputRng::new(23);
        for dtype in DTYPES {
            let x = activation(&mut rng, dtype, 5, 2 * 40, 4.0, true);
            let bound = scalar_tensor(3.0);
            for (out_dtype, ub) in [(DType::F8E4M3FN, None), (DType::F8E5M2, Some(&bound))] {
                let gated = crate::silu_and_mul::native(&x).unwrap();
                let (q, scales) = crate::dynamic_per_token_scaled_fp8_quant::native(&gated, ub, out_dtype).unwrap();
                let program = silu_and_mul_dynamic_fp8_quant(out_dtype, ub.is_some()).unwrap();
                let mut args = vec![RowArg::Tensor(&x)];
                args.extend(ub.map(RowArg::Tensor));
                let ours = program.run(&args).unwrap();
                assert_same(&ours[0], &q, &format!("{dtype} {out_dtype}: q"));
                assert_same(&ours[1], &scales, &format!("{dtype} {out_dtype}: scales"));
            }
        }
    }

    #[test]
    fn in_place_outputs_make_the_fused_adds_in_place() {
        assert!(fused_add_rms_norm(true, false, Rounding::Exact).is_inplace());
        assert!(!rms_norm(true, false).is_inplace());
        assert!(!silu_and_mul().is_inplace());
        let fused = norm_dynamic_per_token_quant(true, true, false, DType::F8E4M3FN, Rounding::Exact).unwrap();
        assert!(fused.is_inplace());
        assert_eq!(fused.reductions(), 2, "the sum of squares and the absmax");
        let names: Vec<&str> = fused.outputs().iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["residual_out", "out", "scales"]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        /// For any row count, width, dtype and inputs, the norm and gated programs give the natives'
        /// bits.
        #[test]
        fn any_rows_give_the_native_bits(
            seed in 0u64..1_000_000,
            rows in 1usize..6,
            width in 1usize..40,
            dtype in proptest::sample::select(DTYPES.to_vec()),
            strided: bool,
            epsilon in proptest::sample::select(vec![1e-6, 1e-5, 0.5]),
        ) {
            let mut rng = InputRng::new(seed);
            let x = activation(&mut rng, dtype, rows, width, 2.0, strided);
            let w = weight(&mut rng, dtype, width);
            let native = crate::rms_norm::native(&x, Some(&w), epsilon, None).unwrap();
            let ours = rms_norm(true, false).run(&[RowArg::Tensor(&x), RowArg::Tensor(&w), RowArg::Scalar(epsilon)]).unwrap();
            assert_same(&ours[0], &native, "rms_norm");
            let gated = activation(&mut rng, dtype, rows, 2 * width, 2.0, strided);
            let native = crate::silu_and_mul::native(&gated).unwrap();
            assert_same(&silu_and_mul().run(&[RowArg::Tensor(&gated)]).unwrap()[0], &native, "silu_and_mul");
        }
    }
}
