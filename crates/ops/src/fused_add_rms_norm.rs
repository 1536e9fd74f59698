//! `fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size = none, rounding = "exact") ->
//! (out, residual_out)`.
//!
//! `residual_out = x + x_residual` and `out = rms_norm(residual_out)`. With `rounding = "exact"`
//! (the default) the norm is computed from the unrounded (f32) sum, closer to the exact value; with
//! `"dtype"` from the sum rounded to x's dtype (the residual output's values), as PyTorch's
//! `residual + x` followed by a norm and vLLM's CUDA kernel compute it ([`Rounding`]).
//! `allow_inplace`; activations `[x, x_residual]`; `out` ↔ `x`, `residual_out` ↔ `x_residual`.
//!
//! [`maybe_inplace`] takes x and the residual by value (donated), so an in-place kernel may write
//! the outputs into their storage when nothing else refers to it; a donated tensor cannot be used
//! again:
//!
//! ```compile_fail
//! # use ir_core::{DType, Tensor};
//! # use ir_ops::{Rounding, fused_add_rms_norm};
//! let registry = ir_ops::registry();
//! let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
//! let residual = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
//! let (out, new_residual) =
//!     fused_add_rms_norm::maybe_inplace(&registry, x, residual, None, 1e-6, None, Rounding::Exact).unwrap();
//! // `x` was donated: using it again does not compile.
//! println!("{:?}", x.shape());
//! ```
//!
//! Without that last line it compiles and runs:
//!
//! ```
//! # use ir_core::{DType, Tensor};
//! # use ir_ops::{Rounding, fused_add_rms_norm};
//! let registry = ir_ops::registry();
//! let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
//! let residual = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
//! let (out, new_residual) =
//!     fused_add_rms_norm::maybe_inplace(&registry, x, residual, None, 1e-6, None, Rounding::Exact).unwrap();
//! assert_eq!((out.shape(), new_residual.shape()), (&[2, 8][..], &[2, 8][..]));
//! ```

use crate::Rounding;
use crate::norm_math::{native_norm, norm_meta};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, StrEnum, Value};
use ir_core::{KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `fused_add_rms_norm`.
    op fused_add_rms_norm {
        def: FUSED_ADD_RMS_NORM,
        args: FusedAddRmsNormArgs,
        params: (
            /// Input.
            x: Activation,
            /// Residual input.
            x_residual: Activation,
            /// Optional weight.
            weight: Option<Tensor>,
            /// Epsilon.
            epsilon: f64,
            /// Number of leading elements of each row the variance is computed over.
            variance_size: Option<i64> = Literal::None,
            /// Whether the norm reads the f32 sum or the sum rounded to x's dtype.
            rounding: Rounding = Literal::Str("exact"),
        ),
        outputs: (Tensor, Tensor),
        inplace: true,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[(ir_core::DType::F16, ir_core::op::Tolerance { atol: 1e-2, rtol: 2e-3 })],
        description: "residual add followed by RMS normalization; returns (out, residual_out)",
    }
}

/// The typed implementation of either kind (the declaration's [`Impl`]).
pub type FusedAddRmsNormImpl = Impl;

/// The reference implementation (the semantics).
pub fn native(
    x: &Tensor,
    x_residual: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let (out, residual_out) = native_norm(x, Some(x_residual), weight, epsilon, variance_size, rounding)?;
    Ok((out, residual_out.expect("a residual was given")))
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    norm_meta(def, args)
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let shape = [spec.num_tokens, spec.hidden_size];
    let x = rng.normal(spec.dtype, &shape, 0.0, 1.0)?;
    let residual = rng.normal(spec.dtype, &shape, 0.0, 1.0)?;
    let weight = rng.normal(spec.dtype, &[spec.hidden_size], 1.0, 0.1)?;
    // Both roundings, by seed (the same bits for f32).
    let rounding = if spec.seed.is_multiple_of(2) { Rounding::Exact } else { Rounding::Dtype };
    Ok(vec![
        Value::Tensor(x),
        Value::Tensor(residual),
        Value::Tensor(weight),
        Value::F64(spec.epsilon),
        Value::None,
        Value::Str(rounding.as_str().to_owned()),
    ])
}
