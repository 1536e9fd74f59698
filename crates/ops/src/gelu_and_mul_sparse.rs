//! `gelu_and_mul_sparse(x, std_multiplier, approximate = "none") -> out`: the activation of
//! Gemma 3n's sparse MLP layers. `x` is `[..., 2d]`; on the gate `g = x[..., :d]` of each row,
//! `cutoff = mean(g) + std(g) · std_multiplier` (biased std), `sparse = relu(g - cutoff)`, and
//! `out = gelu(sparse, approximate) · x[..., d:]` is `[..., d]`. `std_multiplier` is the standard
//! normal quantile of the target sparsity (1.6449 keeps the top 5% of a normal gate).
//!
//! With `d` the dtype of x, every op boundary of the PyTorch form rounds to `d`: the mean and the
//! std are computed in f64 (sum of squares around the unrounded mean) and each rounded to `d`;
//! `t = round_d(std · std_multiplier)`; `cutoff = round_d(mean + t)`; `s_j = max(round_d(g_j -
//! cutoff), 0)`; `a_j = round_d(gelu(s_j))` (gelu in f64); `out_j = round_d(a_j · u_j)`.
//!
//! Kernels reduce the row in f32, so their rounded mean or std may land one ulp of `d` away from
//! native's when the exact value lies within the f32 error of a rounding boundary; the cutoff then
//! moves by about one ulp of `d` for the whole row. The low-precision tolerances cover two such
//! ulps of a cutoff in [1, 2) times an up value of 4.5 (`|u|` of generated inputs stays below it):
//! bf16 atol 8e-2, f16 atol 1e-2. Not in place; activations `[x]`.

use crate::gated::{gated_inputs, gated_meta, native_gated};
use crate::gelu_and_mul::Approximate;
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, StrEnum, Tolerance, Value};
use ir_core::{DType, KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `gelu_and_mul_sparse`.
    op gelu_and_mul_sparse {
        def: GELU_AND_MUL_SPARSE,
        args: GeluAndMulSparseArgs,
        params: (
            /// `[..., 2d]`: the gate, then the up projection.
            x: Activation,
            /// How many standard deviations above the gate's mean the cutoff lies.
            std_multiplier: f64,
            /// The gelu formula.
            approximate: Approximate = Literal::Str("none"),
        ),
        outputs: Tensor,
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[
            (DType::BF16, Tolerance { atol: 8e-2, rtol: 1.6e-2 }),
            (DType::F16, Tolerance { atol: 1e-2, rtol: 1e-3 }),
        ],
        description: "gelu of the gate above mean + std_multiplier·std of its row, times the up half",
    }
}

/// The quantile of 95% sparsity (Gemma 3n's first layers), used by the input generator.
pub const STD_MULTIPLIER_95: f64 = 1.644_853_626_951_472_2;

/// The reference implementation (the semantics).
pub fn native(x: &Tensor, std_multiplier: f64, approximate: Approximate) -> Result<Tensor, KernelError> {
    native_gated(GELU_AND_MUL_SPARSE.name, x, |gate, dtype| {
        let n = gate.len() as f64;
        let mean = gate.iter().sum::<f64>() / n;
        let std = (gate.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / n).sqrt();
        let shift = dtype.round(dtype.round(std) * std_multiplier);
        let cutoff = dtype.round(dtype.round(mean) + shift);
        for g in gate.iter_mut() {
            let s = dtype.round(*g - cutoff);
            let relu = if s < 0.0 { 0.0 } else { s };
            *g = dtype.round(approximate.gelu(relu));
        }
    })
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let op = def.name;
    let args = GeluAndMulSparseArgs::from_meta(args).ok_or(MetaError::Kind { op, param: "x" })?;
    if !args.std_multiplier.is_finite() {
        let value = format!("{:?}", args.std_multiplier);
        return Err(MetaError::Scalar { op, param: "std_multiplier", value, reason: "must be finite".to_owned() });
    }
    Ok(ir_core::op::smallvec![gated_meta(op, Some(args.x))?])
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let approximate = Approximate::for_seed(spec.seed).as_str().to_owned();
    gated_inputs(spec, [Value::F64(STD_MULTIPLIER_95), Value::Str(approximate)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gated::gelu_erf;
    use ir_core::TensorMeta;

    #[test]
    fn only_the_gate_above_the_cutoff_passes() {
        // Gate [0, 1, 2, 3, 10]: mean 3.2, std 3.487…; with multiplier 1 the cutoff is 6.687…, so
        // only g = 10 passes, as gelu(10 - cutoff) times its up value.
        let gate = [0.0, 1.0, 2.0, 3.0, 10.0];
        let up = [1.0, 1.0, 1.0, 1.0, 2.0];
        let row: Vec<f64> = gate.iter().chain(&up).copied().collect();
        let x = Tensor::from_f64(DType::F64, &[1, 10], &row).unwrap();
        let out = native(&x, 1.0, Approximate::None).unwrap().to_f64_vec().unwrap();
        let mean = 3.2;
        let std = (gate.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / 5.0f64).sqrt();
        assert_eq!(out[..4], [0.0; 4]);
        assert!((out[4] - gelu_erf(10.0 - (mean + std)) * 2.0).abs() < 1e-12, "{out:?}");
    }

    #[test]
    fn low_precision_rounds_the_cutoff_at_each_step() {
        let values: Vec<f64> = (0..64).map(|i| ((i * 37) % 64) as f64 / 16.0 - 2.0).collect();
        let ups = vec![1.0; 64];
        let row: Vec<f64> = values.iter().chain(&ups).copied().collect();
        let x = Tensor::from_f64(DType::BF16, &[1, 128], &row).unwrap();
        let got = native(&x, STD_MULTIPLIER_95, Approximate::Tanh).unwrap().to_f64_vec().unwrap();
        let stored = x.to_f64_vec().unwrap();
        let g = &stored[..64];
        let d = DType::BF16;
        let mean = g.iter().sum::<f64>() / 64.0;
        let std = (g.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 64.0).sqrt();
        let cutoff = d.round(d.round(mean) + d.round(d.round(std) * STD_MULTIPLIER_95));
        for (j, &v) in g.iter().enumerate() {
            let s = d.round(v - cutoff).max(0.0);
            assert_eq!(got[j], d.round(d.round(Approximate::Tanh.gelu(s)) * stored[64 + j]), "j {j}");
        }
        assert!(got.iter().filter(|v| **v != 0.0).count() < 16, "most of the row is cut: {got:?}");
    }

    #[test]
    fn the_multiplier_must_be_finite() {
        let x = TensorMeta::compact(DType::F32, &[2, 8]);
        for bad in [f64::NAN, f64::INFINITY] {
            let args = [ArgMeta::Tensor(&x), ArgMeta::F64(bad), ArgMeta::Str("none")];
            let err = meta(&GELU_AND_MUL_SPARSE, &args).unwrap_err().to_string();
            assert!(err.contains("`std_multiplier`") && err.contains("must be finite"), "{err}");
        }
    }
}
