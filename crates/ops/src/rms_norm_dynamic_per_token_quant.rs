//! `rms_norm_dynamic_per_token_quant(x, weight, epsilon, scale_ub = none, out_dtype = f8e4m3fn,
//! rounding = "exact") -> (q, scales)`: `rms_norm` followed by `dynamic_per_token_scaled_fp8_quant` of its output, in one
//! pass over each row.
//!
//! The semantics are the composition: `(q, scales) = dynamic_per_token_scaled_fp8_quant(
//! rms_norm(x, weight, epsilon), scale_ub, out_dtype)`: each row's scale comes from the absmax of
//! its normalized values rounded to x's dtype (see [`quant`](crate::quant)). Not in place;
//! activations `[x]`. `rounding` changes nothing here (no sum to round, per-token scales are
//! divided by under both): it is there so every norm + quantization op takes the same arguments.
//!
//! Tolerance: a kernel's f32 sum of squares may round a normalized value one step of x's dtype away
//! from the reference's, and that value may be the row's absmax, so the scales (f32) are compared
//! within 2^-7 relative, one bf16 step.

use crate::Rounding;
use crate::norm_math::native_norm;
use crate::quant::{QuantScale, norm_quant_inputs, norm_quant_meta, quantize_host, scale_value, to_device_of};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, Tolerance, Value};
use ir_core::{DType, KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `rms_norm_dynamic_per_token_quant`.
    op rms_norm_dynamic_per_token_quant {
        def: RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
        args: RmsNormDynamicPerTokenQuantArgs,
        params: (
            /// Input `[..., H]`.
            x: Activation,
            /// Optional weight `[H]`.
            weight: Option<Tensor>,
            /// Epsilon.
            epsilon: f64,
            /// Optional upper bound of each row's absmax: an f32 tensor of one element.
            scale_ub: Option<Tensor> = Literal::None,
            /// The fp8 format of the output.
            out_dtype: DType = Literal::DType(DType::F8E4M3FN),
            /// Where intermediates round ([`Rounding`]): the sum the norm reads (fused-add forms,
            /// 16-bit x) and a static scale's reciprocal.
            rounding: Rounding = Literal::Str("exact"),
        ),
        outputs: (Tensor, Tensor),
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[(DType::F32, Tolerance { atol: 1e-7, rtol: 7.8125e-3 })],
        description: "RMS normalization then fp8 quantization with one scale per row; returns (q, scales)",
    }
}

/// The reference implementation: the composition of the two ops' references.
pub fn native(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let (normalized, _) = native_norm(&x.to_cpu()?, None, weight, epsilon, None, rounding)?;
    let ub = scale_ub.map(scale_value).transpose()?;
    let (q, scales) = quantize_host(&normalized, QuantScale::Dynamic(ub), out_dtype, rounding)?;
    let scales = scales.expect("a dynamic quantization has scales");
    Ok((to_device_of(q, x)?, to_device_of(scales, x)?))
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    norm_quant_meta(def, args)
}

/// `x ~ N(0, 1)`, `weight ~ N(1, 0.1)`, absmax bound 3.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    norm_quant_inputs(spec, false, 3.0)
}
