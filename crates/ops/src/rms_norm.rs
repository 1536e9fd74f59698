//! `rms_norm(x, weight, epsilon, variance_size) -> out`: root-mean-square normalization of each row.
//!
//! Not `allow_inplace`; activations `[x]`. The math is in `native` below.

use crate::norm_math::{native_norm, norm_meta};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, Value};
use ir_core::{KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `rms_norm`.
    op rms_norm {
        def: RMS_NORM,
        args: RmsNormArgs,
        params: (
            /// Input.
            x: Activation,
            /// Optional weight.
            weight: Option<Tensor>,
            /// Epsilon.
            epsilon: f64,
            /// Number of leading elements of each row the variance is computed over.
            variance_size: Option<i64> = Literal::None,
        ),
        outputs: Tensor,
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[(ir_core::DType::F16, ir_core::op::Tolerance { atol: 1e-2, rtol: 2e-3 })],
        description: "RMS normalization over the last dimension, optionally scaled by a weight",
    }
}

/// The typed implementation signature as a function pointer: `(x, weight, epsilon, variance_size) ->
/// out` (never in place). [`register`] takes any closure of this shape.
pub type RmsNormFn = fn(&Tensor, Option<&Tensor>, f64, Option<i64>) -> Result<Tensor, KernelError>;

/// The reference implementation (the semantics).
pub fn native(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, KernelError> {
    Ok(native_norm(x, None, weight, epsilon, variance_size, crate::Rounding::Exact)?.0)
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    norm_meta(def, args)
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let x = rng.normal(spec.dtype, &[spec.num_tokens, spec.hidden_size], 0.0, 1.0)?;
    let weight = rng.normal(spec.dtype, &[spec.hidden_size], 1.0, 0.1)?;
    Ok(vec![Value::Tensor(x), Value::Tensor(weight), Value::F64(spec.epsilon), Value::None])
}
