//! The normative math of the fp8 quantization ops, shared by the unfused ops and the norm + quant
//! ops whose semantics are their composition.
//!
//! Notation: `c` is f32 (the compute dtype; f64 for f64 inputs), `d` the fp8 output dtype
//! (`f8e4m3fn` or `f8e5m2`), `M` its largest finite value (448, 57344), and `sat_d` the saturating
//! nearest-even conversion to `d` ([`DType::round`]). Per element, with the row's scale `s`:
//!
//! ```text
//! q_j = sat_d(c(x_j / s))            // one division in c, one conversion
//! ```
//!
//! A static scale is the caller's f32 scalar. A dynamic per-token scale is computed from the row:
//!
//! ```text
//! a = max_j |x_j|                    // NaN elements do not count (fmax semantics); 0 for an empty row
//! a = min(a, scale_ub)               // when an upper bound is given (it bounds the row's absmax)
//! s = max(c(a / M), c(1 / (M · 512)))  // the floor keeps all-zero rows finite
//! ```
//!
//! These are the rounding points of vLLM's CUDA kernels except one by default: vLLM's static
//! kernels multiply by the scale's reciprocal, which rounds twice; with `rounding = "exact"` (the
//! default) a static quantization divides once, closer to the exact quotient. With `rounding =
//! "dtype"` (vLLM parity) it multiplies as vLLM does:
//!
//! ```text
//! q_j = sat_d(c(x_j · c(1 / s)))     // static scale, rounding "dtype"
//! ```
//!
//! Dynamic per-token scales are divided by under both roundings, as vLLM's fp8 kernels do. Overflow saturates (an element beyond `M · s`
//! becomes `±M`); NaN stays NaN; an infinite element makes its row's dynamic scale infinite, so
//! that element is NaN and the rest of the row zero.

use crate::norm_math::{named, norm_meta};
use ir_core::op::{ArgMeta, MetaError, OpDef, StrEnum};
use ir_core::{DType, Device, Tensor, TensorError, TensorMeta};

/// The fp8 output dtype, or the error naming the parameter.
pub(crate) fn fp8_dtype(op: &'static str, out_dtype: Option<&ArgMeta<'_>>) -> Result<DType, MetaError> {
    let dtype = out_dtype.and_then(ArgMeta::dtype).ok_or(MetaError::Kind { op, param: "out_dtype" })?;
    if dtype.fp8_max().is_none() {
        return Err(MetaError::Scalar {
            op,
            param: "out_dtype",
            value: dtype.to_string(),
            reason: "must be f8e4m3fn or f8e5m2".to_owned(),
        });
    }
    Ok(dtype)
}

/// Checks a scale argument: an f32 tensor of one element on x's device.
pub(crate) fn check_scale(
    op: &'static str,
    param: &'static str,
    scale: &TensorMeta,
    x: &TensorMeta,
) -> Result<(), MetaError> {
    if scale.dtype != DType::F32 {
        return Err(MetaError::DType { op, param, dtype: scale.dtype, expected: "f32" });
    }
    if scale.numel() != 1 {
        return Err(MetaError::Shape {
            op,
            param,
            shape: scale.shape().to_vec(),
            expected: "must hold exactly one element",
            other: "x",
            other_shape: x.shape().to_vec(),
        });
    }
    if scale.device != x.device {
        return Err(MetaError::Device { op, param, device: scale.device, other: "x", other_device: x.device });
    }
    Ok(())
}

/// The quantized output's metadata: x's shape, compact, in `dtype`, on x's device.
pub(crate) fn quantized_meta(x: &TensorMeta, dtype: DType) -> TensorMeta {
    TensorMeta { device: x.device, ..TensorMeta::compact(dtype, x.shape()) }
}

/// The per-token scales' metadata: x's shape with the last dimension 1, compact f32 on x's device.
pub(crate) fn scales_meta(x: &TensorMeta) -> TensorMeta {
    let shape = per_token_scales_shape(x.shape());
    TensorMeta { device: x.device, ..TensorMeta::compact(DType::F32, &shape) }
}

/// Checks x of a quantization op: rank ≥ 1, a compute dtype.
pub(crate) fn check_x(op: &'static str, x: &TensorMeta) -> Result<(), MetaError> {
    if x.layout.rank() == 0 {
        return Err(MetaError::Rank { op, param: "x", expected: "rank >= 1", shape: vec![] });
    }
    MetaError::require_compute_dtype(op, "x", x)
}

/// The meta function of the norm + quantization ops: the norm's checks ([`norm_meta`]), then the
/// quantization's, reading the parameters by name from `def` (`scale`, or `scale_ub` for the
/// per-token ops, `out_dtype`, `rounding`). Outputs: the residual's (fused ops), then `q`, then the
/// scales (per-token ops).
pub(crate) fn norm_quant_meta(
    def: &'static OpDef,
    args: &[ArgMeta<'_>],
) -> Result<ir_core::op::OutputMetas, MetaError> {
    let op = def.name;
    let arg = |name: &str| named(def, args, name);
    let mut norm_outputs = norm_meta(def, args)?;
    let x = arg("x").and_then(ArgMeta::tensor).ok_or(MetaError::Kind { op, param: "x" })?;
    let dynamic = def.param_index("scale_ub").is_some();
    let scale_param = if dynamic { "scale_ub" } else { "scale" };
    match arg(scale_param) {
        Some(ArgMeta::Tensor(scale)) => check_scale(op, scale_param, scale, x)?,
        Some(ArgMeta::None) if dynamic => {}
        _ => return Err(MetaError::Kind { op, param: scale_param }),
    }
    let dtype = fp8_dtype(op, arg("out_dtype"))?;
    if !matches!(arg("rounding"), Some(ArgMeta::Str(_))) {
        return Err(MetaError::Kind { op, param: "rounding" });
    }
    let mut outputs: ir_core::op::OutputMetas = norm_outputs.drain(1..).collect();
    outputs.push(quantized_meta(x, dtype));
    if dynamic {
        outputs.push(scales_meta(x));
    }
    Ok(outputs)
}

/// Quantizes a host tensor (the norm's output) with a static scale or per-token dynamic scales:
/// the reference step shared by every quantization op. Returns `(q, scales)`, the scales for a
/// dynamic call only. A static scale is inverted first under `rounding = "dtype"` (see the module
/// doc).
pub(crate) fn quantize_host(
    x: &Tensor,
    scale: QuantScale,
    dtype: DType,
    rounding: crate::Rounding,
) -> Result<(Tensor, Option<Tensor>), TensorError> {
    let compute = x.dtype().compute_dtype();
    let hidden = x.layout().last_dim();
    let values: Vec<f64> = x.to_f64_vec()?.into_iter().map(|v| compute.round(v)).collect();
    let scales_shape = per_token_scales_shape(x.shape());
    let n_rows: usize = scales_shape.iter().product();
    let mut q = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(n_rows);
    for r in 0..n_rows {
        let row = &values[r * hidden..(r + 1) * hidden];
        let s = match scale {
            QuantScale::Static(s) => compute.round(s),
            QuantScale::Dynamic(ub) => dynamic_scale(row, ub.map(|v| compute.round(v)), dtype, compute),
        };
        match scale {
            QuantScale::Static(_) if rounding.inverts_scale() => {
                let inverse = reciprocal(s, compute);
                q.extend(row.iter().map(|&v| quantize_by_reciprocal(v, inverse, dtype, compute)));
            }
            _ => q.extend(row.iter().map(|&v| quantize(v, s, dtype, compute))),
        }
        scales.push(s);
    }
    let q = Tensor::from_f64(dtype, x.shape(), &q)?;
    let scales = match scale {
        QuantScale::Static(_) => None,
        QuantScale::Dynamic(_) => Some(Tensor::from_f64(DType::F32, &scales_shape, &scales)?),
    };
    Ok((q, scales))
}

/// The scale of [`quantize_host`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum QuantScale {
    /// One scale for the whole tensor.
    Static(f64),
    /// Per token, with an optional bound on the absmax.
    Dynamic(Option<f64>),
}

/// The input generator of the norm + quantization ops: `x ~ N(0, 1)` of `[T, H]`, the residual
/// (same distribution) when `with_residual`, `weight ~ N(1, 0.1)`, epsilon, then `scale` (the
/// quantization's scale or bound, an f32 tensor of one element), the output dtype `f8e4m3fn` and
/// the rounding (both, by seed).
pub(crate) fn norm_quant_inputs(
    spec: &ir_core::op::InputSpec,
    with_residual: bool,
    scale: f64,
) -> Result<Vec<ir_core::op::Value>, TensorError> {
    use ir_core::op::Value;
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let shape = [spec.num_tokens, spec.hidden_size];
    let mut values = vec![Value::Tensor(rng.normal(spec.dtype, &shape, 0.0, 1.0)?)];
    if with_residual {
        values.push(Value::Tensor(rng.normal(spec.dtype, &shape, 0.0, 1.0)?));
    }
    values.push(Value::Tensor(rng.normal(spec.dtype, &[spec.hidden_size], 1.0, 0.1)?));
    values.push(Value::F64(spec.epsilon));
    values.push(Value::Tensor(Tensor::from_f64(DType::F32, &[1], &[scale])?));
    values.push(Value::DType(DType::F8E4M3FN));
    values.push(Value::Str(generated_rounding(spec.seed).as_str().to_owned()));
    Ok(values)
}

/// The rounding generated inputs take: both, by seed.
pub(crate) fn generated_rounding(seed: u64) -> crate::Rounding {
    if seed.is_multiple_of(2) { crate::Rounding::Exact } else { crate::Rounding::Dtype }
}

/// The smallest dynamic scale for `dtype`: `c(1 / (M · 512))`.
pub fn min_scale(dtype: DType) -> f32 {
    let max = dtype.fp8_max().unwrap_or(1.0);
    (1.0 / (max * 512.0)) as f32
}

/// The dynamic per-token scale of a row (its values already in `c`), with an optional upper
/// bound on the row's absmax; see the module doc. `compute` is `c`.
pub fn dynamic_scale(row: &[f64], scale_ub: Option<f64>, dtype: DType, compute: DType) -> f64 {
    let max = dtype.fp8_max().unwrap_or(1.0);
    // `f64::max` ignores NaN, as fmax does.
    let mut absmax = row.iter().fold(0.0f64, |a, v| a.max(v.abs()));
    if let Some(ub) = scale_ub {
        absmax = absmax.min(ub);
    }
    let floor = compute.round(1.0 / (max * 512.0));
    compute.round(absmax / max).max(floor)
}

/// `q = sat_d(c(value / scale))` for one element already in `c`.
pub fn quantize(value: f64, scale: f64, dtype: DType, compute: DType) -> f64 {
    dtype.round(compute.round(value / scale))
}

/// `c(1 / scale)`: the reciprocal a static quantization multiplies by under `rounding = "dtype"`.
pub fn reciprocal(scale: f64, compute: DType) -> f64 {
    compute.round(1.0 / scale)
}

/// `q = sat_d(c(value · inverse))` for one element already in `c`, `inverse` from [`reciprocal`].
pub fn quantize_by_reciprocal(value: f64, inverse: f64, dtype: DType, compute: DType) -> f64 {
    dtype.round(compute.round(value * inverse))
}

/// The values of a one-element scale tensor on any device, as f64.
pub(crate) fn scale_value(scale: &Tensor) -> Result<f64, TensorError> {
    Ok(scale.to_f64_vec()?.first().copied().unwrap_or(f64::NAN))
}

/// Moves a host result to x's device.
pub(crate) fn to_device_of(t: Tensor, x: &Tensor) -> Result<Tensor, TensorError> {
    if x.device() == Device::Cpu { Ok(t) } else { t.to_device_of(x) }
}

/// The shape of per-token scales for x of shape `shape`: the last dimension becomes 1.
pub fn per_token_scales_shape(shape: &[usize]) -> Vec<usize> {
    let mut scales = shape.to_vec();
    if let Some(last) = scales.last_mut() {
        *last = 1;
    }
    scales
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_scales_follow_absmax_bound_and_floor() {
        let c = DType::F32;
        let d = DType::F8E4M3FN;
        assert_eq!(dynamic_scale(&[1.0, -448.0, 3.0], None, d, c), 1.0);
        assert_eq!(dynamic_scale(&[1.0, -896.0], Some(448.0), d, c), 1.0, "the bound clamps the absmax");
        assert_eq!(dynamic_scale(&[0.0, 0.0], None, d, c), c.round(1.0 / (448.0 * 512.0)));
        assert_eq!(dynamic_scale(&[f64::NAN, 44.8], None, d, c), c.round(0.1), "NaN does not count");
        assert_eq!(dynamic_scale(&[], None, d, c), min_scale(d) as f64);
        assert_eq!(dynamic_scale(&[57344.0], None, DType::F8E5M2, c), 1.0);
    }

    #[test]
    fn quantization_divides_once_and_saturates() {
        let (c, d) = (DType::F32, DType::F8E4M3FN);
        assert_eq!(quantize(1.0, 0.5, d, c), 2.0);
        assert_eq!(quantize(1000.0, 1.0, d, c), 448.0);
        assert_eq!(quantize(-1000.0, 1.0, d, c), -448.0);
        assert_eq!(quantize(f64::INFINITY, 1.0, d, c), 448.0);
        assert!(quantize(f64::NAN, 1.0, d, c).is_nan());
        // 17 / 1 lies halfway between 16 and 18: ties to even (16).
        assert_eq!(quantize(17.0, 1.0, d, c), 16.0);
        assert_eq!(quantize(100000.0, 1.0, DType::F8E5M2, c), 57344.0);
    }

    #[test]
    fn the_reciprocal_form_rounds_twice() {
        let (c, d) = (DType::F32, DType::F8E4M3FN);
        // Values whose quotient by 0.3 lies within an f32 step of a tie of the fp8 grid (17 lies
        // halfway between 16 and 18, ...): `x · c(1/s)` rounds on the other side of some.
        let s = c.round(0.3);
        let inverse = reciprocal(s, c);
        let near_ties = (8..400).flat_map(|tie| {
            let v = (f64::from(tie) + 0.5) * s;
            let v = v as f32;
            [v.next_down(), v, v.next_up()].map(f64::from)
        });
        let differing = near_ties.filter(|&v| quantize(v, s, d, c) != quantize_by_reciprocal(v, inverse, d, c)).count();
        assert!(differing > 0, "some value near a tie quantizes differently through the reciprocal");
        assert_eq!(quantize_by_reciprocal(1000.0, 1.0, d, c), 448.0, "saturates");
        assert!(quantize_by_reciprocal(f64::NAN, 1.0, d, c).is_nan());
    }
}
