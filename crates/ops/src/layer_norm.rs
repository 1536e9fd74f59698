//! `layer_norm(x, weight, bias, epsilon) -> out`: layer normalization of each row (PyTorch's
//! `F.layer_norm` over the last dimension), the first op whose semantics are a row program.
//!
//! Per row of `W` values `a_j` (in the compute type `c`: f32, f64 for f64 x), every step rounded to
//! `c`: `mean = Σa / W` (the sum accumulated wide, divided once), `d_j = a_j − mean`, `var = Σd² / W`
//! (biased, likewise), `rstd = 1 / √(var + ε)`, `y_j = d_j · rstd`, then `y_j · w_j` and `+ b_j` when
//! given, and the result rounded to x's dtype once (PyTorch's kernels compute in f32 and round at
//! the end). [`row_program::builtin::layer_norm`](crate::row_program::builtin::layer_norm) is that
//! computation as a row program; `native` runs it on the reference interpreter, so the semantics
//! are stated once. Not in place; activations `[x]`.
//!
//! No provider has a kernel written for it: the cpu provider runs its program on the
//! block-vectorized interpreter, and every GPU provider launches the kernel generated from it
//! (CUDA, HIP and OpenCL C).

use ir_core::op::{Activation, ArgMeta, InputSpec, MetaError, Value};
use ir_core::{KernelError, Tensor, TensorError};

use crate::norm_math::row_norm_meta;
use crate::row_program::{RowArg, RowProgram};

ir_core::define_op! {
    /// The definition of `layer_norm`.
    op layer_norm {
        def: LAYER_NORM,
        args: LayerNormArgs,
        params: (
            /// Input.
            x: Activation,
            /// Optional weight (`[H]`).
            weight: Option<Tensor>,
            /// Optional bias (`[H]`).
            bias: Option<Tensor>,
            /// Epsilon.
            epsilon: f64,
        ),
        outputs: Tensor,
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "layer normalization over the last dimension, optionally scaled by a weight and shifted by a bias",
    }
}

/// The arguments of `layer_norm`'s program for a call: `x`, the weight and bias given, `epsilon`.
pub fn program_args<'a>(
    x: &'a Tensor,
    weight: Option<&'a Tensor>,
    bias: Option<&'a Tensor>,
    epsilon: f64,
) -> Vec<RowArg<'a>> {
    let mut args = vec![RowArg::Tensor(x)];
    args.extend(weight.map(RowArg::Tensor));
    args.extend(bias.map(RowArg::Tensor));
    args.push(RowArg::Scalar(epsilon));
    args
}

/// `layer_norm`'s row program for a call with or without a weight and a bias
/// ([`row_program::builtin::layer_norm`](crate::row_program::builtin::layer_norm)), built once per
/// process.
pub fn program(weight: bool, bias: bool) -> &'static RowProgram {
    static PROGRAMS: std::sync::OnceLock<[RowProgram; 4]> = std::sync::OnceLock::new();
    let programs = PROGRAMS.get_or_init(|| {
        [(false, false), (false, true), (true, false), (true, true)]
            .map(|(weight, bias)| crate::row_program::builtin::layer_norm(weight, bias))
    });
    &programs[usize::from(weight) * 2 + usize::from(bias)]
}

/// The reference implementation: its row program on the reference interpreter.
pub fn native(x: &Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>, epsilon: f64) -> Result<Tensor, KernelError> {
    fn tensor(t: Option<&Tensor>) -> ArgMeta<'_> {
        t.map_or(ArgMeta::None, |t| ArgMeta::Tensor(t.meta()))
    }
    meta(&LAYER_NORM, &[ArgMeta::Tensor(x.meta()), tensor(weight), tensor(bias), ArgMeta::F64(epsilon)])?;
    let out = run_with(|program, args| Ok(program.run(args)?), x, weight, bias, epsilon)?;
    Ok(if x.device().is_cpu() { out } else { out.to_device_of(x)? })
}

/// The op on an executor of row programs (`run`: the reference interpreter, the cpu's, a GPU
/// backend's): its program for the call, run on the call's arguments, and the output. What every
/// implementation of the op is.
pub fn run_with(
    run: impl FnOnce(&RowProgram, &[RowArg<'_>]) -> Result<Vec<Tensor>, KernelError>,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
) -> Result<Tensor, KernelError> {
    let mut out = run(program(weight.is_some(), bias.is_some()), &program_args(x, weight, bias, epsilon))?;
    Ok(out.pop().expect("one output"))
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    row_norm_meta(def, args, &["weight", "bias"])
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let x = rng.normal(spec.dtype, &[spec.num_tokens, spec.hidden_size], 0.5, 1.0)?;
    let weight = rng.normal(spec.dtype, &[spec.hidden_size], 1.0, 0.1)?;
    let bias = rng.normal(spec.dtype, &[spec.hidden_size], 0.0, 0.1)?;
    Ok(vec![Value::Tensor(x), Value::Tensor(weight), Value::Tensor(bias), Value::F64(spec.epsilon)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::DType;

    /// PyTorch's form in f64, rounded at the end: close to the op in every dtype.
    fn by_hand(x: &[f64], w: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        x.iter().zip(w).zip(b).map(|((v, w), b)| (v - mean) / (var + eps).sqrt() * w + b).collect()
    }

    #[test]
    fn layer_norm_is_the_textbook_form() {
        let registry = crate::registry();
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let xs: Vec<f64> = (0..96).map(|i| ((i * 37) % 17) as f64 / 4.0 - 1.0).collect();
            let ws: Vec<f64> = (0..48).map(|i| 1.0 + (i % 5) as f64 / 8.0).collect();
            let bs: Vec<f64> = (0..48).map(|i| (i % 3) as f64 / 4.0).collect();
            let x = Tensor::from_f64(dtype, &[2, 48], &xs).unwrap();
            let (w, b) = (Tensor::from_f64(dtype, &[48], &ws).unwrap(), Tensor::from_f64(dtype, &[48], &bs).unwrap());
            let out = layer_norm(&registry, &x, Some(&w), Some(&b), 1e-5).unwrap();
            let (got, x_stored) = (out.to_f64_vec().unwrap(), x.to_f64_vec().unwrap());
            let (w_stored, b_stored) = (w.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
            let expected: Vec<f64> =
                x_stored.chunks(48).flat_map(|row| by_hand(row, &w_stored, &b_stored, 1e-5)).collect();
            let tolerance = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
            for (g, e) in got.iter().zip(&expected) {
                assert!((g - e).abs() <= tolerance * (1.0 + e.abs()), "{dtype}: {g} vs {e}");
            }
        }
    }

    #[test]
    fn bad_arguments_are_refused_naming_the_parameter() {
        let registry = crate::registry();
        let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        let w = Tensor::zeros(DType::F32, &[4]).unwrap();
        let error = layer_norm(&registry, &x, Some(&w), None, 1e-5).unwrap_err().to_string();
        assert!(error.contains("weight") && error.contains("[H]"), "{error}");
        let error = layer_norm(&registry, &x, None, Some(&w), 1e-5).unwrap_err().to_string();
        assert!(error.contains("bias"), "{error}");
        let ints = Tensor::zeros(DType::I64, &[2, 8]).unwrap();
        let error = layer_norm(&registry, &ints, None, None, 1e-5).unwrap_err().to_string();
        assert!(error.contains("x"), "{error}");
    }
}
