//! `dynamic_per_token_scaled_fp8_quant(x, scale_ub = none, out_dtype = f8e4m3fn) -> (q, scales)`:
//! fp8 quantization with one scale per row, computed from the row.
//!
//! `x` is `[..., H]` in f32, f16, bf16 or f64; `scale_ub`, when given, an f32 tensor of one element
//! on x's device bounding each row's absmax; `q` a fresh compact tensor of x's shape in `out_dtype`
//! (`f8e4m3fn` or `f8e5m2`); `scales` a fresh compact f32 tensor `[..., 1]` holding each row's
//! `s = max(c(min(absmax, scale_ub) / M), c(1 / (M · 512)))`, and `q_j = sat(c(x_j / s))`: see
//! [`quant`](crate::quant). Not in place; activations `[x]`.

use crate::quant::{
    QuantScale, check_scale, check_x, fp8_dtype, quantize_host, quantized_meta, scale_value, scales_meta, to_device_of,
};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, Value};
use ir_core::{DType, KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `dynamic_per_token_scaled_fp8_quant`.
    op dynamic_per_token_scaled_fp8_quant {
        def: DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT,
        args: DynamicPerTokenScaledFp8QuantArgs,
        params: (
            /// Input `[..., H]`.
            x: Activation,
            /// Optional upper bound of each row's absmax: an f32 tensor of one element.
            scale_ub: Option<Tensor> = Literal::None,
            /// The fp8 format of the output.
            out_dtype: DType = Literal::DType(DType::F8E4M3FN),
        ),
        outputs: (Tensor, Tensor),
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "fp8 quantization with one scale per row from its absmax; returns (q, scales)",
    }
}

/// The reference implementation (the semantics).
pub fn native(x: &Tensor, scale_ub: Option<&Tensor>, out_dtype: DType) -> Result<(Tensor, Tensor), KernelError> {
    let ub_meta = scale_ub.map_or(ArgMeta::None, |t| ArgMeta::Tensor(t.meta()));
    let args = [ArgMeta::Tensor(x.meta()), ub_meta, ArgMeta::DType(out_dtype)];
    meta(&DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT, &args)?;
    let ub = scale_ub.map(scale_value).transpose()?;
    let (q, scales) = quantize_host(x, QuantScale::Dynamic(ub), out_dtype, crate::Rounding::Exact)?;
    let scales = scales.expect("a dynamic quantization has scales");
    Ok((to_device_of(q, x)?, to_device_of(scales, x)?))
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let op = def.name;
    let kind = |param| MetaError::Kind { op, param };
    let x = args.first().and_then(ArgMeta::tensor).ok_or(kind("x"))?;
    check_x(op, x)?;
    match args.get(1) {
        Some(ArgMeta::None) => {}
        Some(ArgMeta::Tensor(ub)) => check_scale(op, "scale_ub", ub, x)?,
        _ => return Err(kind("scale_ub")),
    }
    let dtype = fp8_dtype(op, args.get(DynamicPerTokenScaledFp8QuantArgs::out_dtype))?;
    Ok(ir_core::op::smallvec![quantized_meta(x, dtype), scales_meta(x)])
}

/// `x ~ N(0, 1)` of `[T, H]` and the absmax bound 3: wide rows are clamped, and their elements beyond
/// 3 saturate.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let x = rng.normal(spec.dtype, &[spec.num_tokens, spec.hidden_size], 0.0, 1.0)?;
    let scale_ub = Tensor::from_f64(DType::F32, &[1], &[3.0])?;
    Ok(vec![Value::Tensor(x), Value::Tensor(scale_ub), Value::DType(DType::F8E4M3FN)])
}
