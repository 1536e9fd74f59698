//! `ir-ops`: the built-in ops of vllm-ir-rs, each declared once with
//! [`define_op!`](ir_core::define_op) in its own module: its schema, its semantics (a plain Rust
//! reference, registered as provider `native`), its meta function (shape inference and
//! validation) and its test-input generator.
//!
//! | op | module |
//! |---|---|
//! | `rms_norm`, `fused_add_rms_norm` | [`rms_norm`], [`fused_add_rms_norm`] |
//! | `silu_and_mul`, `gelu_and_mul`, `gelu_and_mul_sparse` | [`silu_and_mul`], [`gelu_and_mul`], [`gelu_and_mul_sparse`] (shared: [`gated`]) |
//! | `static_scaled_fp8_quant`, `dynamic_per_token_scaled_fp8_quant` | [`static_scaled_fp8_quant`], [`dynamic_per_token_scaled_fp8_quant`] (shared: [`quant`]) |
//! | the four norm + quantization fusions | [`rms_norm_static_fp8_quant`], [`rms_norm_dynamic_per_token_quant`], [`fused_add_rms_norm_static_fp8_quant`], [`fused_add_rms_norm_dynamic_per_token_quant`] |
//! | `rotary_embedding` | [`rotary_embedding`] |
//! | `layer_norm` (its semantics a row program, every provider's implementation generated from it) | [`layer_norm`] |
//! | `silu_and_mul_dynamic_fp8_quant` (the gated activation and the per-token quantization fused, likewise) | [`silu_and_mul_dynamic_fp8_quant`] |
//! | `fused_add_layer_norm` (the residual add and `layer_norm` fused, likewise) | [`fused_add_layer_norm`] |
//! | `fused_sandwich_rms_norm` (Gemma 2/3: `rms_norm`, residual add, `rms_norm` of the sum, fused, likewise) | [`fused_sandwich_rms_norm`] |
//! | `fused_qk_norm_rope` (Qwen3: `rms_norm` of every query and key head, then `rotary_embedding`, fused, likewise) | [`fused_qk_norm_rope`] |
//!
//! [`row_program`] describes a memory-bound computation over rows once, as data, with a reference
//! interpreter that defines its semantics; [`row_program::builtin`] expresses the norms, the gated
//! activations and the quantizations above as row programs with their natives' bits.
//!
//! The mechanism they are declared with (the registry, dispatch, the tensor model) is `ir-core`'s;
//! kernel crates, layers and passes name an op by its definition here (`rms_norm::RMS_NORM`,
//! `rms_norm::call`), never by a string. [`registry`] builds a registry defining all of them, each
//! with `native` only; kernel crates then register their providers on it. Feature `candle` adds
//! [`candle_ops`], the ops as candle custom ops that run on candle tensors in place.
//!
//! ```
//! use ir_core::{DType, Tensor};
//! use ir_ops::rms_norm::rms_norm;
//!
//! let registry = ir_ops::registry();
//! let x = Tensor::from_f32(DType::BF16, &[2, 4], &[1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 2.0])?;
//! let weight = Tensor::ones(DType::BF16, &[4]).unwrap();
//! let y = rms_norm(&registry, &x, Some(&weight), 1e-6, None)?;
//! assert_eq!(y.shape(), &[2, 4]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#[cfg(feature = "candle")]
pub mod candle_ops;
pub mod dynamic_per_token_scaled_fp8_quant;
pub mod fused_add_layer_norm;
pub mod fused_add_rms_norm;
pub mod fused_add_rms_norm_dynamic_per_token_quant;
pub mod fused_add_rms_norm_static_fp8_quant;
mod fused_norm;
pub mod fused_qk_norm_rope;
pub mod fused_sandwich_rms_norm;
pub mod gated;
pub mod gelu_and_mul;
pub mod gelu_and_mul_sparse;
pub mod layer_norm;
mod norm_math;
pub mod quant;
pub mod rms_norm;
pub mod rms_norm_dynamic_per_token_quant;
pub mod rms_norm_static_fp8_quant;
pub mod rotary_embedding;
pub mod row_program;
pub mod silu_and_mul;
pub mod silu_and_mul_dynamic_fp8_quant;
pub mod static_scaled_fp8_quant;

use ir_core::op::OpDef;
use ir_core::{DType, Registry};

ir_core::str_enum! {
    /// Where the norms, the quantizations and `rotary_embedding` round their intermediate values
    /// (their last parameter, `rounding = "exact"`).
    pub enum Rounding {
        /// The default: intermediates stay in the compute dtype (f32; f64 for f64 tensors) and only
        /// the results round to the tensors' dtype, closer to the exact values: `fused_add_rms_norm`
        /// and the fused-add norm + quantization ops normalize the f32 sum, rotary keeps its
        /// products in f32, a static quantization divides by its scale.
        Exact = "exact",
        /// Rounded where PyTorch's eager arithmetic and vLLM's CUDA kernels round, for engines
        /// checking bit parity with Hugging Face transformers or vLLM: `fused_add_rms_norm` and the
        /// fused-add norm + quantization ops normalize the sum rounded to x's dtype (the residual
        /// output's values), rotary rounds each product (and the cos and sin) to the query's dtype
        /// before the sum or difference. These are the same as `exact` for f32 and f64 tensors. A
        /// static quantization (plain or after a norm) multiplies by the scale's reciprocal,
        /// rounded to the compute dtype, as vLLM's static kernels do, for every dtype.
        Dtype = "dtype",
    }
}

impl Rounding {
    /// Whether this rounding rounds intermediates of `dtype` tensors (`dtype` on a 16-bit dtype).
    pub fn rounds_intermediates(self, dtype: DType) -> bool {
        self == Rounding::Dtype && !matches!(dtype, DType::F32 | DType::F64)
    }

    /// Whether a static quantization multiplies by the scale's reciprocal (`dtype`, on every
    /// dtype) instead of dividing by the scale.
    pub fn inverts_scale(self) -> bool {
        self == Rounding::Dtype
    }
}

/// Every op this crate declares, in the order [`registry`] defines them.
pub const BUILTIN_OPS: &[&OpDef] = &[
    &rms_norm::RMS_NORM,
    &fused_add_rms_norm::FUSED_ADD_RMS_NORM,
    &silu_and_mul::SILU_AND_MUL,
    &gelu_and_mul::GELU_AND_MUL,
    &gelu_and_mul_sparse::GELU_AND_MUL_SPARSE,
    &static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT,
    &dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT,
    &rms_norm_static_fp8_quant::RMS_NORM_STATIC_FP8_QUANT,
    &fused_add_rms_norm_static_fp8_quant::FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT,
    &rms_norm_dynamic_per_token_quant::RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
    &fused_add_rms_norm_dynamic_per_token_quant::FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
    &rotary_embedding::ROTARY_EMBEDDING,
    &layer_norm::LAYER_NORM,
    &silu_and_mul_dynamic_fp8_quant::SILU_AND_MUL_DYNAMIC_FP8_QUANT,
    &fused_add_layer_norm::FUSED_ADD_LAYER_NORM,
    &fused_sandwich_rms_norm::FUSED_SANDWICH_RMS_NORM,
    &fused_qk_norm_rope::FUSED_QK_NORM_ROPE,
];

/// A registry defining every op of [`BUILTIN_OPS`], each with `native` only; kernel crates register
/// their providers on it.
#[track_caller]
pub fn registry() -> Registry {
    let registry = Registry::new();
    for def in BUILTIN_OPS {
        registry.define_op(def).expect("built-in op definitions are valid and distinct");
    }
    registry
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerances() {
        let fused = &fused_add_rms_norm::FUSED_ADD_RMS_NORM;
        assert_eq!(ir_core::op::tolerance(fused, DType::F16), Ok(ir_core::op::Tolerance { atol: 1e-2, rtol: 2e-3 }));
        assert_eq!(ir_core::op::tolerance(fused, DType::BF16), Ok(ir_core::op::Tolerance { atol: 1e-3, rtol: 1.6e-2 }));
        for op in BUILTIN_OPS {
            for dtype in DType::ALL {
                assert!(ir_core::op::tolerance(op, dtype).is_ok());
            }
        }
    }
}
