//! `fused_sandwich_rms_norm(x, x_residual, post_weight, pre_weight, epsilon, rounding = "exact")
//! -> (out, residual_out)`: the norms Gemma 2 and 3 put around each residual add, as one op.
//!
//! A Gemma 2/3 decoder layer normalizes the attention output (`post_attention_layernorm`), adds
//! it to the residual stream and normalizes the sum for the feed-forward block
//! (`pre_feedforward_layernorm`); the same sandwich closes the feed-forward block before the next
//! layer's input norm. Unfused that is `rms_norm` then `fused_add_rms_norm`; this op is that pair,
//! bit for bit: `h = rms_norm(x, post_weight, epsilon)` rounded to x's dtype (as `rms_norm`
//! stores it), `residual_out = h + x_residual` (`fused_add_rms_norm`'s sum, rounded to x's dtype
//! before the norm reads it under `rounding = "dtype"`, [`Rounding`]) and `out =
//! rms_norm(residual_out, pre_weight, epsilon)`. Gemma's `(1 + w)` weights are given as they are
//! applied (an f32 weight on bf16 activations is applied in f32, as Gemma's norm does).
//! [`row_program::builtin::fused_sandwich_rms_norm`](crate::row_program::builtin::fused_sandwich_rms_norm)
//! is that computation as a row program: `native` runs it on the reference interpreter, every GPU
//! provider as the kernel generated from it; the cpu provider composes its `rms_norm` and
//! `fused_add_rms_norm` rows per row (the program's bits, tested, at the speed of those rows). `h`
//! is never stored.
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
    /// The definition of `fused_sandwich_rms_norm`.
    op fused_sandwich_rms_norm {
        def: FUSED_SANDWICH_RMS_NORM,
        args: FusedSandwichRmsNormArgs,
        params: (
            /// The block's output (attention or feed-forward), normalized before the add.
            x: Activation,
            /// Residual input.
            x_residual: Activation,
            /// Optional weight (`[H]`) of the norm of x before the add.
            post_weight: Option<Tensor>,
            /// Optional weight (`[H]`) of the norm of the sum.
            pre_weight: Option<Tensor>,
            /// Epsilon of both norms.
            epsilon: f64,
            /// Whether the second norm reads the unrounded sum or the sum rounded to x's dtype.
            rounding: Rounding = Literal::Str("exact"),
        ),
        outputs: (Tensor, Tensor),
        inplace: true,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "RMS norm, residual add, RMS norm of the sum (Gemma 2/3 sandwich norms); returns (out, residual_out)",
    }
}

/// The op's row program for a call with or without `post_weight` and `pre_weight`, in `rounding`, built
/// once per process.
pub fn program(post_weight: bool, pre_weight: bool, rounding: Rounding) -> &'static RowProgram {
    static PROGRAMS: std::sync::OnceLock<Vec<RowProgram>> = std::sync::OnceLock::new();
    let build = crate::row_program::builtin::fused_sandwich_rms_norm;
    crate::fused_norm::program(&PROGRAMS, build, [post_weight, pre_weight], rounding)
}

/// The reference implementation: its row program on the reference interpreter.
pub fn native(
    x: &Tensor,
    x_residual: &Tensor,
    post_weight: Option<&Tensor>,
    pre_weight: Option<&Tensor>,
    epsilon: f64,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let program = program(post_weight.is_some(), pre_weight.is_some(), rounding);
    crate::fused_norm::native(
        &FUSED_SANDWICH_RMS_NORM,
        program,
        x,
        x_residual,
        [post_weight, pre_weight],
        epsilon,
        rounding,
    )
}

/// The op on an executor that runs row programs in place (`run`: the cpu's
/// `run_row_program_in_place`, a GPU backend's): its program for the call, with `x` and
/// `x_residual` donated and both outputs written into them. What every provider's implementation
/// is.
pub fn run_in_place(
    run: impl FnOnce(&RowProgram, &mut [InPlaceArg<'_>]) -> Result<Vec<Option<Tensor>>, KernelError>,
    x: UniqueTensor,
    x_residual: UniqueTensor,
    post_weight: Option<&Tensor>,
    pre_weight: Option<&Tensor>,
    epsilon: f64,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let program = program(post_weight.is_some(), pre_weight.is_some(), rounding);
    crate::fused_norm::run_in_place(run, program, x, x_residual, [post_weight, pre_weight], epsilon)
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    row_norm_meta(def, args, &["post_weight", "pre_weight"])
}

/// Gemma's form: weights `1 + w` with `w` near 0, an attention output of a larger scale than the
/// residual stream.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let shape = [spec.num_tokens, spec.hidden_size];
    let x = rng.normal(spec.dtype, &shape, 0.0, 4.0)?;
    let residual = rng.normal(spec.dtype, &shape, 0.0, 1.0)?;
    let post_weight = rng.normal(spec.dtype, &[spec.hidden_size], 1.0, 0.1)?;
    let pre_weight = rng.normal(spec.dtype, &[spec.hidden_size], 1.0, 0.1)?;
    // Both roundings, by seed (the same bits for f32).
    let rounding = if spec.seed.is_multiple_of(2) { Rounding::Exact } else { Rounding::Dtype };
    Ok(vec![
        Value::Tensor(x),
        Value::Tensor(residual),
        Value::Tensor(post_weight),
        Value::Tensor(pre_weight),
        Value::F64(spec.epsilon),
        Value::Str(rounding.as_str().to_owned()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::testing::InputRng;
    use ir_core::{DType, bit_eq};

    /// The op is `rms_norm` then `fused_add_rms_norm`, bit for bit, in every compute dtype, both
    /// roundings, with and without each weight (f32 weights on 16-bit activations too, Gemma's
    /// form), on strided inputs.
    #[test]
    fn the_fused_op_gives_the_unfused_pairs_bits() {
        let mut rng = InputRng::new(31);
        for dtype in DType::COMPUTE {
            let wide = rng.normal(dtype, &[4, 72], 0.0, 4.0).unwrap();
            let x = wide.narrow(1, 5, 64).unwrap();
            let r = rng.normal(dtype, &[4, 64], 0.0, 1.0).unwrap();
            for weight_dtype in [dtype, DType::F32] {
                let post = rng.normal(weight_dtype, &[64], 1.0, 0.2).unwrap();
                let pre = rng.normal(weight_dtype, &[64], 1.0, 0.2).unwrap();
                for rounding in [Rounding::Exact, Rounding::Dtype] {
                    for (post_weight, pre_weight) in
                        [(None, None), (Some(&post), None), (None, Some(&pre)), (Some(&post), Some(&pre))]
                    {
                        let what = format!(
                            "{dtype} weights {weight_dtype} {rounding:?} post {} pre {}",
                            post_weight.is_some(),
                            pre_weight.is_some()
                        );
                        let (out, residual) = native(&x, &r, post_weight, pre_weight, 1e-6, rounding).unwrap();
                        let h = crate::rms_norm::native(&x, post_weight, 1e-6, None).unwrap();
                        let (expected, expected_residual) =
                            crate::fused_add_rms_norm::native(&h, &r, pre_weight, 1e-6, None, rounding).unwrap();
                        assert!(bit_eq(&out, &expected), "{what}: out");
                        assert!(bit_eq(&residual, &expected_residual), "{what}: residual");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_refused_naming_the_parameter() {
        let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        let r = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        let short = Tensor::zeros(DType::F32, &[4]).unwrap();
        let error = native(&x, &r, Some(&short), None, 1e-6, Rounding::Exact).unwrap_err().to_string();
        assert!(error.contains("post_weight") && error.contains("[H]"), "{error}");
        let error = native(&x, &r, None, Some(&short), 1e-6, Rounding::Exact).unwrap_err().to_string();
        assert!(error.contains("pre_weight"), "{error}");
        let error = native(&x, &r, None, None, -1.0, Rounding::Exact).unwrap_err().to_string();
        assert!(error.contains("epsilon"), "{error}");
    }
}
