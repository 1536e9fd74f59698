//! `fused_add_rms_norm_dynamic_per_token_quant(x, x_residual, weight, epsilon, scale_ub = none,
//! out_dtype = f8e4m3fn, rounding = "exact") -> (residual_out, q, scales)`: `fused_add_rms_norm` followed by
//! `dynamic_per_token_scaled_fp8_quant` of its normalized output, in one pass over each row: the
//! residual form of vLLM's `rms_norm_dynamic_per_token_quant`.
//!
//! The semantics are the composition: `(out, residual_out) = fused_add_rms_norm(x, x_residual,
//! weight, epsilon, rounding = rounding)` and `(q, scales) = dynamic_per_token_scaled_fp8_quant(out,
//! scale_ub, out_dtype)`: with `rounding = "dtype"` the norm reads the sum rounded to x's dtype, as
//! `fused_add_rms_norm` with `"dtype"` and PyTorch's `residual + x` do; the normalized row is never written. Each row's scale comes from the absmax of its
//! normalized values rounded to x's dtype (see [`quant`](crate::quant)).
//!
//! `allow_inplace` with activations `[x_residual]`: the `maybe_inplace` form donates the residual,
//! and an in-place kernel writes `residual_out` into its storage; `q` and `scales` are always
//! fresh. The residual comes first among the outputs, as in `fused_add_rms_norm_static_fp8_quant`:
//! an in-place op's first outputs are its activations'.
//!
//! Tolerance: as `rms_norm_dynamic_per_token_quant`'s, a kernel's f32 sum of squares may round a
//! normalized value (maybe the row's absmax) one step of x's dtype away from the reference's, so
//! the scales are compared within 2^-7 relative.

use crate::Rounding;
use crate::norm_math::native_norm;
use crate::quant::{QuantScale, norm_quant_inputs, norm_quant_meta, quantize_host, scale_value, to_device_of};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, Tolerance, Value};
use ir_core::{DType, KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `fused_add_rms_norm_dynamic_per_token_quant`.
    op fused_add_rms_norm_dynamic_per_token_quant {
        def: FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
        args: FusedAddRmsNormDynamicPerTokenQuantArgs,
        params: (
            /// Input `[..., H]`.
            x: Tensor,
            /// Residual input, x's shape.
            x_residual: Activation,
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
        outputs: (Tensor, Tensor, Tensor),
        inplace: true,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[
            (DType::F32, Tolerance { atol: 1e-7, rtol: 7.8125e-3 }),
            (DType::F16, Tolerance { atol: 1e-2, rtol: 2e-3 }),
        ],
        description: "residual add, RMS normalization and fp8 quantization with one scale per row; returns (residual_out, q, scales)",
    }
}

/// The reference implementation: the composition of the two ops' references.
pub fn native(
    x: &Tensor,
    x_residual: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<(Tensor, Tensor, Tensor), KernelError> {
    let (normalized, residual_out) = native_norm(&x.to_cpu()?, Some(x_residual), weight, epsilon, None, rounding)?;
    let residual_out = residual_out.expect("a residual was given");
    let ub = scale_ub.map(scale_value).transpose()?;
    let (q, scales) = quantize_host(&normalized, QuantScale::Dynamic(ub), out_dtype, rounding)?;
    let scales = scales.expect("a dynamic quantization has scales");
    Ok((to_device_of(residual_out, x)?, to_device_of(q, x)?, to_device_of(scales, x)?))
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    norm_quant_meta(def, args)
}

/// `x, x_residual ~ N(0, 1)`, `weight ~ N(1, 0.1)`, absmax bound 3.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    norm_quant_inputs(spec, true, 3.0)
}
