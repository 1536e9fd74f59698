//! `rms_norm_static_fp8_quant(x, weight, epsilon, scale, out_dtype = f8e4m3fn, rounding = "exact")
//! -> q`: `rms_norm` followed by `static_scaled_fp8_quant` of its output, in one pass over each row.
//!
//! The semantics are the composition: `q = static_scaled_fp8_quant(rms_norm(x, weight, epsilon),
//! scale, out_dtype, rounding)` (with `"dtype"` the quantization multiplies by the scale's
//! reciprocal, as vLLM's fused kernel does), the norm's output rounded to x's dtype before it is divided by the scale
//! (see [`rms_norm`](crate::rms_norm) and [`quant`](crate::quant)); a kernel keeps the
//! normalized row in registers instead of writing it. Not in place; activations `[x]`.

use crate::Rounding;
use crate::norm_math::native_norm;
use crate::quant::{QuantScale, norm_quant_inputs, norm_quant_meta, quantize_host, scale_value, to_device_of};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, Value};
use ir_core::{DType, KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `rms_norm_static_fp8_quant`.
    op rms_norm_static_fp8_quant {
        def: RMS_NORM_STATIC_FP8_QUANT,
        args: RmsNormStaticFp8QuantArgs,
        params: (
            /// Input `[..., H]`.
            x: Activation,
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
        outputs: Tensor,
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "RMS normalization then fp8 quantization with a per-tensor scale, in one pass",
    }
}

/// The reference implementation: the composition of the two ops' references.
pub fn native(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    scale: &Tensor,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<Tensor, KernelError> {
    let (normalized, _) = native_norm(&x.to_cpu()?, None, weight, epsilon, None, rounding)?;
    let (q, _) = quantize_host(&normalized, QuantScale::Static(scale_value(scale)?), out_dtype, rounding)?;
    Ok(to_device_of(q, x)?)
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    norm_quant_meta(def, args)
}

/// `x ~ N(0, 1)`, `weight ~ N(1, 0.1)`, scale `3 / 448` (outputs beyond about 3 saturate).
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    norm_quant_inputs(spec, false, 3.0 / 448.0)
}
