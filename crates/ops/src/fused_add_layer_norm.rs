//! `fused_add_layer_norm(x, x_residual, weight, bias, epsilon, rounding = "exact") -> (out,
//! residual_out)`: the residual add followed by [`layer_norm`](crate::layer_norm), as one op
//! (the pre-norm of every LayerNorm decoder block after the first).
//!
//! `residual_out = x + x_residual` and `out = layer_norm(residual_out, weight, bias, epsilon)`.
//! The sum is `fused_add_rms_norm`'s: computed in the compute dtype and, with `rounding = "dtype"`,
//! rounded to x's dtype before the norm reads it (what PyTorch's `residual + x` followed by
//! `F.layer_norm` computes); with `"exact"` (the default) the norm reads the unrounded sum
//! ([`Rounding`]). The norm is `layer_norm`'s, step for step.
//! [`row_program::builtin::fused_add_layer_norm`](crate::row_program::builtin::fused_add_layer_norm)
//! is that computation as a row program: `native` runs it on the reference interpreter, the cpu
//! provider on the block-vectorized one, every GPU provider as the kernel generated from it.
//!
//! `allow_inplace`; activations `[x, x_residual]`; `out` ↔ `x`, `residual_out` ↔ `x_residual`
//! (one dtype for both), each output in its activation's layout when that is dense. Every
//! provider's implementation writes in place.

use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, StrEnum, Value};
use ir_core::{KernelError, Tensor, TensorError, UniqueTensor};

use crate::Rounding;
use crate::norm_math::row_norm_meta;
use crate::row_program::{InPlaceArg, RowProgram};

ir_core::define_op! {
    /// The definition of `fused_add_layer_norm`.
    op fused_add_layer_norm {
        def: FUSED_ADD_LAYER_NORM,
        args: FusedAddLayerNormArgs,
        params: (
            /// Input.
            x: Activation,
            /// Residual input.
            x_residual: Activation,
            /// Optional weight (`[H]`).
            weight: Option<Tensor>,
            /// Optional bias (`[H]`).
            bias: Option<Tensor>,
            /// Epsilon.
            epsilon: f64,
            /// Whether the norm reads the unrounded sum or the sum rounded to x's dtype.
            rounding: Rounding = Literal::Str("exact"),
        ),
        outputs: (Tensor, Tensor),
        inplace: true,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "residual add followed by layer normalization; returns (out, residual_out)",
    }
}

/// The op's row program for a call with or without `weight` and `bias`, in `rounding`, built
/// once per process.
pub fn program(weight: bool, bias: bool, rounding: Rounding) -> &'static RowProgram {
    static PROGRAMS: std::sync::OnceLock<Vec<RowProgram>> = std::sync::OnceLock::new();
    let build = crate::row_program::builtin::fused_add_layer_norm;
    crate::fused_norm::program(&PROGRAMS, build, [weight, bias], rounding)
}

/// The reference implementation: its row program on the reference interpreter.
pub fn native(
    x: &Tensor,
    x_residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let program = program(weight.is_some(), bias.is_some(), rounding);
    crate::fused_norm::native(&FUSED_ADD_LAYER_NORM, program, x, x_residual, [weight, bias], epsilon, rounding)
}

/// The op on an executor that runs row programs in place (`run`: the cpu's
/// `run_row_program_in_place`, a GPU backend's): its program for the call, with `x` and
/// `x_residual` donated and both outputs written into them. What every provider's implementation
/// is.
pub fn run_in_place(
    run: impl FnOnce(&RowProgram, &mut [InPlaceArg<'_>]) -> Result<Vec<Option<Tensor>>, KernelError>,
    x: UniqueTensor,
    x_residual: UniqueTensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let program = program(weight.is_some(), bias.is_some(), rounding);
    crate::fused_norm::run_in_place(run, program, x, x_residual, [weight, bias], epsilon)
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    row_norm_meta(def, args, &["weight", "bias"])
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let shape = [spec.num_tokens, spec.hidden_size];
    let x = rng.normal(spec.dtype, &shape, 0.5, 1.0)?;
    let residual = rng.normal(spec.dtype, &shape, 0.0, 1.0)?;
    let weight = rng.normal(spec.dtype, &[spec.hidden_size], 1.0, 0.1)?;
    let bias = rng.normal(spec.dtype, &[spec.hidden_size], 0.0, 0.1)?;
    // Both roundings, by seed (the same bits for f32).
    let rounding = if spec.seed.is_multiple_of(2) { Rounding::Exact } else { Rounding::Dtype };
    Ok(vec![
        Value::Tensor(x),
        Value::Tensor(residual),
        Value::Tensor(weight),
        Value::Tensor(bias),
        Value::F64(spec.epsilon),
        Value::Str(rounding.as_str().to_owned()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::testing::InputRng;
    use ir_core::{DType, bit_eq};

    /// The sum the norm reads, as an unfused engine computes it: `fused_add_rms_norm`'s residual
    /// output (the same sum, rounded as `rounding` says) in x's dtype, or in f32 for an unrounded
    /// 16-bit sum.
    fn unfused_sum(x: &Tensor, r: &Tensor, rounding: Rounding) -> Tensor {
        if rounding.rounds_intermediates(x.dtype()) || matches!(x.dtype(), DType::F32 | DType::F64) {
            return crate::fused_add_rms_norm::native(x, r, None, 1e-5, None, rounding).unwrap().1;
        }
        let wide = |t: &Tensor| Tensor::from_f64(DType::F32, t.shape(), &t.to_f64_vec().unwrap()).unwrap();
        crate::fused_add_rms_norm::native(&wide(x), &wide(r), None, 1e-5, None, rounding).unwrap().1
    }

    /// The op is the residual add followed by `layer_norm`, bit for bit, in every compute dtype,
    /// both roundings, with and without its weight and bias, on strided inputs.
    #[test]
    fn the_fused_op_gives_the_unfused_pairs_bits() {
        let mut rng = InputRng::new(29);
        for dtype in DType::COMPUTE {
            let wide = rng.normal(dtype, &[4, 56], 0.5, 2.0).unwrap();
            let x = wide.narrow(1, 3, 48).unwrap();
            let r = rng.normal(dtype, &[4, 48], 0.0, 1.0).unwrap();
            let w = rng.normal(dtype, &[48], 1.0, 0.2).unwrap();
            let b = rng.normal(dtype, &[48], 0.0, 0.2).unwrap();
            for rounding in [Rounding::Exact, Rounding::Dtype] {
                for (weight, bias) in [(None, None), (Some(&w), None), (Some(&w), Some(&b)), (None, Some(&b))] {
                    let what = format!("{dtype} {rounding:?} weight {} bias {}", weight.is_some(), bias.is_some());
                    let (out, residual) = native(&x, &r, weight, bias, 1e-5, rounding).unwrap();
                    let sum = unfused_sum(&x, &r, rounding);
                    let expected = crate::layer_norm::native(&sum, weight, bias, 1e-5).unwrap();
                    // A sum kept in f32 gives an f32 norm, which the op rounds to x's dtype once.
                    let expected = Tensor::from_f64(dtype, expected.shape(), &expected.to_f64_vec().unwrap()).unwrap();
                    let stored_sum = Tensor::from_f64(dtype, sum.shape(), &sum.to_f64_vec().unwrap()).unwrap();
                    assert!(bit_eq(&out, &expected), "{what}: out");
                    assert!(bit_eq(&residual, &stored_sum), "{what}: residual");
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_refused_naming_the_parameter() {
        let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        let r = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        let short = Tensor::zeros(DType::F32, &[4]).unwrap();
        let error = native(&x, &r, Some(&short), None, 1e-5, Rounding::Exact).unwrap_err().to_string();
        assert!(error.contains("weight") && error.contains("[H]"), "{error}");
        let error = native(&x, &r, None, Some(&short), 1e-5, Rounding::Exact).unwrap_err().to_string();
        assert!(error.contains("bias"), "{error}");
        let other = Tensor::zeros(DType::F32, &[2, 4]).unwrap();
        let error = native(&x, &other, None, None, 1e-5, Rounding::Exact).unwrap_err().to_string();
        assert!(error.contains("x_residual") && error.contains("shape of x"), "{error}");
        let bf16 = Tensor::zeros(DType::BF16, &[2, 8]).unwrap();
        let error = native(&x, &bf16, None, None, 1e-5, Rounding::Exact).unwrap_err().to_string();
        assert!(error.contains("x_residual") && error.contains("x's dtype"), "{error}");
        let error = native(&x, &r, None, None, f64::NAN, Rounding::Exact).unwrap_err().to_string();
        assert!(error.contains("epsilon"), "{error}");
    }
}
