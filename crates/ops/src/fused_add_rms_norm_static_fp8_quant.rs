//! `fused_add_rms_norm_static_fp8_quant(x, x_residual, weight, epsilon, scale, out_dtype = f8e4m3fn,
//! rounding = "exact") -> (residual_out, q)`: `fused_add_rms_norm` followed by `static_scaled_fp8_quant` of its
//! normalized output, in one pass over each row.
//!
//! The semantics are the composition: `(out, residual_out) = fused_add_rms_norm(x, x_residual,
//! weight, epsilon, rounding = rounding)` and `q = static_scaled_fp8_quant(out, scale, out_dtype,
//! rounding)`; the normalized row is never written. With `rounding = "dtype"` the norm reads the
//! sum rounded to x's dtype and the quantization multiplies by the scale's reciprocal: vLLM's
//! fused kernel, bit for bit, and the unfused pair with `"dtype"`. Activations `[x_residual]`.
//!
//! `allow_inplace` with activations `[x_residual]`: the `maybe_inplace` form donates the residual,
//! and an in-place kernel writes `residual_out` into its storage; `q` is always fresh. The residual
//! comes first among the outputs, unlike vLLM's `(out, residual)`: an in-place op's first outputs
//! are its activations', one per activation in order, and the rest are fresh.

use crate::Rounding;
use crate::norm_math::native_norm;
use crate::quant::{QuantScale, norm_quant_inputs, norm_quant_meta, quantize_host, scale_value, to_device_of};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, Value};
use ir_core::{DType, KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `fused_add_rms_norm_static_fp8_quant`.
    op fused_add_rms_norm_static_fp8_quant {
        def: FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT,
        args: FusedAddRmsNormStaticFp8QuantArgs,
        params: (
            /// Input `[..., H]`.
            x: Tensor,
            /// Residual input, x's shape.
            x_residual: Activation,
            /// Optional weight `[H]`.
            weight: Option<Tensor>,
            /// Epsilon.
            epsilon: f64,
            /// The scale: an f32 tensor of one element.
            scale: Tensor,
            /// The fp8 format of the output.
            out_dtype: DType = Literal::DType(DType::F8E4M3FN),
            /// Where intermediates round ([`Rounding`]): the sum the norm reads (fused-add forms,
            /// 16-bit x) and a static scale's reciprocal.
            rounding: Rounding = Literal::Str("exact"),
        ),
        outputs: (Tensor, Tensor),
        inplace: true,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[(DType::F16, ir_core::op::Tolerance { atol: 1e-2, rtol: 2e-3 })],
        description: "residual add, RMS normalization and fp8 quantization with a per-tensor scale; returns (residual_out, q)",
    }
}

/// The reference implementation: the composition of the two ops' references.
pub fn native(
    x: &Tensor,
    x_residual: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    scale: &Tensor,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let (normalized, residual_out) = native_norm(&x.to_cpu()?, Some(x_residual), weight, epsilon, None, rounding)?;
    let residual_out = residual_out.expect("a residual was given");
    let (q, _) = quantize_host(&normalized, QuantScale::Static(scale_value(scale)?), out_dtype, rounding)?;
    Ok((to_device_of(residual_out, x)?, to_device_of(q, x)?))
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    norm_quant_meta(def, args)
}

/// `x, x_residual ~ N(0, 1)`, `weight ~ N(1, 0.1)`, scale `3 / 448`.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    norm_quant_inputs(spec, true, 3.0 / 448.0)
}
