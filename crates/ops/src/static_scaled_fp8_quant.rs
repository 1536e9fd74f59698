//! `static_scaled_fp8_quant(x, scale, out_dtype = f8e4m3fn, rounding = "exact") -> q`: per-tensor
//! fp8 quantization with the caller's scale.
//!
//! `x` is `[..., H]` in f32, f16, bf16 or f64; `scale` an f32 tensor of one element on x's device;
//! `q` a fresh compact tensor of x's shape in `out_dtype` (`f8e4m3fn` or `f8e5m2`) with
//! `q_j = sat(c(x_j / scale))`, or with `rounding = "dtype"` (vLLM's rounding points)
//! `q_j = sat(c(x_j · c(1 / scale)))`: see [`quant`](crate::quant). Not in place (the output dtype
//! differs); activations `[x]`.

use crate::Rounding;
use crate::quant::{
    QuantScale, check_scale, check_x, fp8_dtype, quantize_host, quantized_meta, scale_value, to_device_of,
};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, StrEnum, Value};
use ir_core::{DType, KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `static_scaled_fp8_quant`.
    op static_scaled_fp8_quant {
        def: STATIC_SCALED_FP8_QUANT,
        args: StaticScaledFp8QuantArgs,
        params: (
            /// Input `[..., H]`.
            x: Activation,
            /// The scale: an f32 tensor of one element.
            scale: Tensor,
            /// The fp8 format of the output.
            out_dtype: DType = Literal::DType(DType::F8E4M3FN),
            /// Divide by the scale (`"exact"`) or multiply by its reciprocal (`"dtype"`, as vLLM).
            rounding: Rounding = Literal::Str("exact"),
        ),
        outputs: Tensor,
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "fp8 quantization with a per-tensor scale, saturating",
    }
}

/// The reference implementation (the semantics).
pub fn native(x: &Tensor, scale: &Tensor, out_dtype: DType, rounding: Rounding) -> Result<Tensor, KernelError> {
    let args = [
        ArgMeta::Tensor(x.meta()),
        ArgMeta::Tensor(scale.meta()),
        ArgMeta::DType(out_dtype),
        ArgMeta::Str(rounding.as_str()),
    ];
    meta(&STATIC_SCALED_FP8_QUANT, &args)?;
    let (q, _) = quantize_host(x, QuantScale::Static(scale_value(scale)?), out_dtype, rounding)?;
    Ok(to_device_of(q, x)?)
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let op = def.name;
    let kind = |param| MetaError::Kind { op, param };
    let x = args.first().and_then(ArgMeta::tensor).ok_or(kind("x"))?;
    check_x(op, x)?;
    let scale = args.get(1).and_then(ArgMeta::tensor).ok_or(kind("scale"))?;
    check_scale(op, "scale", scale, x)?;
    let dtype = fp8_dtype(op, args.get(StaticScaledFp8QuantArgs::out_dtype))?;
    if !matches!(args.get(3), Some(ArgMeta::Str(_))) {
        return Err(kind("rounding"));
    }
    Ok(ir_core::op::smallvec![quantized_meta(x, dtype)])
}

/// `x ~ N(0, 1)` of `[T, H]` and the scale `3 / 448`: elements beyond 3σ saturate; both roundings,
/// by seed.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let x = rng.normal(spec.dtype, &[spec.num_tokens, spec.hidden_size], 0.0, 1.0)?;
    let scale = Tensor::from_f64(DType::F32, &[1], &[3.0 / 448.0])?;
    let rounding = crate::quant::generated_rounding(spec.seed);
    Ok(vec![
        Value::Tensor(x),
        Value::Tensor(scale),
        Value::DType(DType::F8E4M3FN),
        Value::Str(rounding.as_str().to_owned()),
    ])
}
