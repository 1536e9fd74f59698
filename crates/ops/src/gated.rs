//! Shared pieces of the gated activations (`silu_and_mul`, `gelu_and_mul`, …): `x` is `[..., 2d]`,
//! the first half of each row is the gate `g`, the second the up projection `u`, and
//! `out = act(g) * u` is `[..., d]`.
//!
//! Numerics of the reference (the rounding points of the PyTorch forms `act(x[..., :d]) * x[..., d:]`
//! in low precision): the activation is computed in f64 from the stored gate value and rounded to
//! x's dtype once (`a_j = round_d(act(g_j))`, a more accurate reference than an f32 formula; kernels
//! compute it in f32 and meet the tolerances); the product is computed exactly and rounded to x's
//! dtype once (`out_j = round_d(a_j · u_j)`). Ops with a per-row step before the activation (the
//! sparse gate's cutoff) give it a row and get back the activation's inputs.

use ir_core::op::{ArgMeta, InputSpec, MetaError, Value};
use ir_core::{DType, KernelError, Tensor, TensorError, TensorMeta};

/// `silu(v) = v / (1 + e^-v)`, in f64.
pub fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// `gelu(v) = 0.5·v·(1 + erf(v/√2))` with the erf form (`approximate = "none"`), in f64, computed
/// as `0.5·v·erfc(−v/√2)`: no `1 + erf` that cancels where gelu is tiny (the negative tail), so the
/// result keeps its relative accuracy at every gate. `−∞` gives NaN (`−∞·0`), as the textbook form.
pub fn gelu_erf(v: f64) -> f64 {
    0.5 * v * libm::erfc(-v * std::f64::consts::FRAC_1_SQRT_2)
}

/// `gelu(v) = 0.5·v·(1 + tanh z)`, `z = √(2/π)·(v + 0.044715·v³)`, with the tanh form
/// (`approximate = "tanh"`), in f64, computed as `v / (1 + e^(−2z))` (the same function): no
/// `1 + tanh z` that cancels in the negative tail. `−∞` gives NaN (`−∞/∞`), as the textbook form.
pub fn gelu_tanh(v: f64) -> f64 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    v / (1.0 + (-2.0 * SQRT_2_OVER_PI * (v + 0.044_715 * v * v * v)).exp())
}

/// The meta function of every gated op: `x` has rank ≥ 1 and an even last dimension `2d`; the
/// output is a fresh compact `[..., d]` tensor of x's dtype on x's device.
pub(crate) fn gated_meta(op: &'static str, x: Option<&TensorMeta>) -> Result<TensorMeta, MetaError> {
    let x = x.ok_or(MetaError::Kind { op, param: "x" })?;
    MetaError::require_compute_dtype(op, "x", x)?;
    let Some((&last, leading)) = x.shape().split_last() else {
        return Err(MetaError::Rank { op, param: "x", expected: "rank >= 1", shape: vec![] });
    };
    if last % 2 != 0 {
        return Err(MetaError::Shape {
            op,
            param: "x",
            shape: x.shape().to_vec(),
            expected: "must have an even last dimension (gate and up halves)",
            other: "x",
            other_shape: x.shape().to_vec(),
        });
    }
    let mut shape = leading.to_vec();
    shape.push(last / 2);
    Ok(TensorMeta { device: x.device, ..TensorMeta::compact(x.dtype, &shape) })
}

/// The argument list of a gated op's input generator: `x ~ N(0, 1)` of shape `[T, 2H]` (so the
/// output is `[T, H]`), followed by `rest`.
pub(crate) fn gated_inputs(spec: &InputSpec, rest: impl IntoIterator<Item = Value>) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let x = rng.normal(spec.dtype, &[spec.num_tokens, 2 * spec.hidden_size], 0.0, 1.0)?;
    Ok(std::iter::once(Value::Tensor(x)).chain(rest).collect())
}

/// The reference computation of a gated op. `gate_row` receives each row's gate values (the stored
/// values, exact in f64) and replaces them with the activation's rounded outputs `a_j`.
pub(crate) fn native_gated(
    op: &'static str,
    x: &Tensor,
    mut gate_row: impl FnMut(&mut [f64], DType),
) -> Result<Tensor, KernelError> {
    let dtype = x.dtype();
    let meta = gated_meta(op, Some(x.meta()))?;
    let values = x.to_f64_vec()?;
    let width = *x.shape().last().unwrap_or(&0);
    let d = width / 2;
    let mut out = Vec::with_capacity(values.len() / 2);
    let mut gate = vec![0f64; d];
    for row in values.chunks_exact(width.max(1)) {
        let (g, u) = row.split_at(d);
        gate.copy_from_slice(g);
        gate_row(&mut gate, dtype);
        out.extend(gate.iter().zip(u).map(|(a, u)| dtype.round(a * u)));
    }
    let out = Tensor::from_f64(dtype, meta.shape(), &out)?;
    Ok(if x.device().is_cpu() { out } else { out.to_device_of(x)? })
}

/// The one-output meta function of a gated op whose other arguments need no check.
pub(crate) fn gated_meta_only_x(op: &'static str, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    Ok(ir_core::op::smallvec![gated_meta(op, args.first().and_then(ArgMeta::tensor))?])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gelu_and_mul::{self, Approximate};
    use crate::silu_and_mul;

    #[test]
    fn activations_match_their_closed_forms() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_578_630_004_9).abs() < 1e-15);
        assert!((gelu_erf(1.0) - 0.841_344_746_068_542_9).abs() < 1e-15);
        assert!((gelu_tanh(1.0) - 0.841_191_990_608_276_8).abs() < 1e-15);
        assert!(gelu_erf(-10.0).abs() < 1e-20 && gelu_tanh(-10.0).abs() < 1e-20);
        // The tail keeps its relative accuracy (no `1 + tanh` or `1 + erf` that cancels), checked
        // against exact forms of the tail.
        // gelu_erf(v) = v·Φ(v); for v = −8, Φ(−8) = 6.220960574271784e−16.
        assert!((gelu_erf(-8.0) / (-8.0 * 6.220_960_574_271_784e-16) - 1.0).abs() < 1e-13);
        // gelu_tanh(v) = v / (1 + e^(−2z)) exactly: for v = −5, z = −√(2/π)·(5 + 0.044715·125).
        let z: f64 = -0.797_884_560_802_865_4 * (5.0 + 0.044_715 * 125.0);
        assert!((gelu_tanh(-5.0) / (-5.0 * (2.0 * z).exp() / (1.0 + (2.0 * z).exp())) - 1.0).abs() < 1e-14);
        assert_eq!(gelu_tanh(f64::INFINITY), f64::INFINITY);
        assert_eq!(gelu_erf(f64::INFINITY), f64::INFINITY);
        assert!(gelu_tanh(f64::NEG_INFINITY).is_nan() && gelu_erf(f64::NEG_INFINITY).is_nan());
        assert!(gelu_tanh(f64::NAN).is_nan() && gelu_erf(f64::NAN).is_nan());
    }

    #[test]
    fn gated_ops_split_the_last_dimension() {
        let x = Tensor::from_f64(DType::F64, &[2, 4], &[1.0, -2.0, 3.0, 0.5, 0.0, 4.0, -1.0, 2.0]).unwrap();
        let out = silu_and_mul::native(&x).unwrap();
        assert_eq!(out.shape(), &[2, 2]);
        let expected = [silu(1.0) * 3.0, silu(-2.0) * 0.5, 0.0, silu(4.0) * 2.0];
        assert_eq!(out.to_f64_vec().unwrap(), expected);
        let gelu = gelu_and_mul::native(&x, Approximate::Tanh).unwrap();
        assert_eq!(gelu.to_f64_vec().unwrap()[0], gelu_tanh(1.0) * 3.0);
    }

    #[test]
    fn low_precision_rounds_the_activation_before_the_product() {
        // Over many bf16 gates and ups, every output is round(round(silu(g)) · u), and some of them
        // differ from round(silu(g) · u): the test tells the two rounding schemes apart.
        let values: Vec<f64> = (0..256).map(|i| (i as f64 - 128.0) / 17.0).collect();
        let ups: Vec<f64> = (0..256).map(|i| 1.0 + (i % 7) as f64 / 128.0).collect();
        let row: Vec<f64> = values.iter().chain(&ups).copied().collect();
        let x = Tensor::from_f64(DType::BF16, &[1, 512], &row).unwrap();
        let stored = x.to_f64_vec().unwrap();
        let out = silu_and_mul::native(&x).unwrap().to_f64_vec().unwrap();
        let mut differs = 0;
        for j in 0..256 {
            let (g, u) = (stored[j], stored[256 + j]);
            let rounded_first = DType::BF16.round(DType::BF16.round(silu(g)) * u);
            assert_eq!(out[j], rounded_first, "j {j}");
            differs += usize::from(DType::BF16.round(silu(g) * u) != rounded_first);
        }
        assert!(differs > 0, "the inputs tell the two rounding schemes apart");
    }

    #[test]
    fn meta_rejects_odd_widths_and_scalars() {
        let odd = TensorMeta::compact(DType::F32, &[2, 3]);
        let err = gated_meta("silu_and_mul", Some(&odd)).unwrap_err().to_string();
        assert!(err.contains("even last dimension"), "{err}");
        let scalar = TensorMeta::compact(DType::F32, &[]);
        assert!(gated_meta("silu_and_mul", Some(&scalar)).is_err());
        let out = gated_meta("silu_and_mul", Some(&TensorMeta::compact(DType::F16, &[3, 5, 8]))).unwrap();
        assert_eq!((out.shape(), out.dtype), (&[3, 5, 4][..], DType::F16));
    }
}
