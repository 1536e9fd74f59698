//! fp8 quantization of activations, as the input of an fp8 GEMM: a per-tensor (static) scale, or one
//! scale per token computed from the row (dynamic).

use ir_core::storage::DeviceAllocator;
use ir_core::{DType, ExecutionContext, Tensor};
use ir_ops::{Rounding, dynamic_per_token_scaled_fp8_quant, static_scaled_fp8_quant};

use crate::LayerError;

/// How a [`QuantFp8`] layer scales.
#[derive(Clone, Debug)]
pub enum QuantScale {
    /// One calibrated scale for the whole tensor (an f32 tensor of one element, a traced parameter).
    Static(Tensor),
    /// One scale per token from the row's absmax, optionally bounded.
    PerToken {
        /// An upper bound on each row's absmax (an f32 tensor of one element).
        scale_ub: Option<Tensor>,
    },
}

/// fp8 quantization of `[..., H]` activations: `static_scaled_fp8_quant` or
/// `dynamic_per_token_scaled_fp8_quant`. After an `RmsNorm` whose output only it reads, the
/// standard pipeline fuses the two into one norm + quantization op.
///
/// ```
/// use ir_core::{DType, EagerContext, Registry, Tensor};
/// use layers::{QuantFp8, QuantScale};
///
/// let registry = ir_ops::registry();
/// let ctx = EagerContext::new(&registry);
/// let scale = Tensor::from_f64(DType::F32, &[1], &[0.5])?;
/// let quant = QuantFp8::new("layers.0.input_scale", QuantScale::Static(scale), DType::F8E4M3FN)?;
/// let x = Tensor::from_f64(DType::BF16, &[1, 4], &[1.0, -2.0, 300.0, 0.25])?;
/// let (q, scales) = quant.forward(&ctx, &x)?;
/// assert_eq!(q.to_f64_vec()?, [2.0, -4.0, 448.0, 0.5]); // saturates at 448
/// assert!(scales.is_none());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct QuantFp8 {
    name: String,
    scale: QuantScale,
    out_dtype: DType,
    rounding: Rounding,
}

impl QuantFp8 {
    /// Moves the scale tensors (the static scale, or the per-token bound) to the allocator's device.
    pub fn to_device(&mut self, allocator: &dyn DeviceAllocator) -> Result<(), LayerError> {
        match &mut self.scale {
            QuantScale::Static(scale) => *scale = scale.to_device(allocator)?,
            QuantScale::PerToken { scale_ub: Some(bound) } => *bound = bound.to_device(allocator)?,
            QuantScale::PerToken { scale_ub: None } => {}
        }
        Ok(())
    }

    /// A quantization layer named `name` (its scale's parameter name when traced), writing
    /// `out_dtype` (`f8e4m3fn` or `f8e5m2`).
    pub fn new(name: impl Into<String>, scale: QuantScale, out_dtype: DType) -> Result<QuantFp8, LayerError> {
        let name = name.into();
        let error = |reason: String| LayerError::Quant { name: name.clone(), reason };
        if out_dtype.fp8_max().is_none() {
            return Err(error(format!("output dtype {out_dtype} is not f8e4m3fn or f8e5m2")));
        }
        let given = match &scale {
            QuantScale::Static(s) => Some(s),
            QuantScale::PerToken { scale_ub } => scale_ub.as_ref(),
        };
        if let Some(s) = given.filter(|s| s.dtype() != DType::F32 || s.numel() != 1) {
            return Err(error(format!("the scale must be an f32 tensor of one element, got {}", s.meta())));
        }
        Ok(QuantFp8 { name, scale, out_dtype, rounding: Rounding::Exact })
    }

    /// The layer with a static scale's `rounding` ([`Rounding`]): `Exact` (the default) divides by
    /// the scale, `Dtype` multiplies by its reciprocal as vLLM's static kernels do (bit parity with
    /// vLLM). Per-token scales are divided by under both.
    pub fn with_rounding(self, rounding: Rounding) -> QuantFp8 {
        QuantFp8 { rounding, ..self }
    }

    /// The static scale's rounding ([`QuantFp8::with_rounding`]).
    pub fn rounding(&self) -> Rounding {
        self.rounding
    }

    /// The output dtype.
    pub fn out_dtype(&self) -> DType {
        self.out_dtype
    }

    /// Quantizes `x`: `q`, and the per-token scales (`[..., 1]`, f32) when the layer computes them.
    pub fn forward<C: ExecutionContext>(
        &self,
        ctx: &C,
        x: &C::Tensor,
    ) -> Result<(C::Tensor, Option<C::Tensor>), LayerError> {
        match &self.scale {
            QuantScale::Static(scale) => {
                let scale = ctx.parameter(&self.name, scale)?;
                Ok((static_scaled_fp8_quant::call(ctx, x, &scale, self.out_dtype, self.rounding)?, None))
            }
            QuantScale::PerToken { scale_ub } => {
                let bound = scale_ub.as_ref().map(|ub| ctx.parameter(&self.name, ub)).transpose()?;
                let (q, scales) = dynamic_per_token_scaled_fp8_quant::call(ctx, x, bound.as_ref(), self.out_dtype)?;
                Ok((q, Some(scales)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::{EagerContext, TensorMeta, bit_eq};

    #[test]
    fn both_modes_call_their_op_and_bad_scales_are_refused() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[3, 16]), 2).unwrap();
        let ub = Tensor::from_f64(DType::F32, &[1], &[1.5]).unwrap();
        let layer = QuantFp8::new("q", QuantScale::PerToken { scale_ub: Some(ub.clone()) }, DType::F8E5M2).unwrap();
        let (q, scales) = layer.forward(&ctx, &x).unwrap();
        let (eq, es) = dynamic_per_token_scaled_fp8_quant::native(&x, Some(&ub), DType::F8E5M2).unwrap();
        assert!(bit_eq(&q, &eq) && bit_eq(&scales.unwrap(), &es));
        let err = QuantFp8::new("q", QuantScale::Static(Tensor::zeros(DType::F32, &[2]).unwrap()), DType::F8E4M3FN)
            .unwrap_err();
        assert!(err.to_string().contains("QuantFp8 `q`: the scale must be an f32 tensor of one element"), "{err}");
        let err = QuantFp8::new("q", QuantScale::PerToken { scale_ub: None }, DType::BF16).unwrap_err();
        assert!(err.to_string().contains("not f8e4m3fn or f8e5m2"), "{err}");
    }

    #[test]
    fn the_static_rounding_reaches_the_op() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        // Values whose quotient by the scale lies within an f32 step of a tie of the e4m3 grid
        // (8.5 between 8 and 9, ...), where the two roundings can differ.
        let near_ties: Vec<f64> = (8..16)
            .flat_map(|tie| {
                let v = ((f64::from(tie) + 0.5) * f64::from(0.3f32)) as f32;
                [v.next_down(), v, v.next_up()].map(f64::from)
            })
            .collect();
        let x = Tensor::from_f64(DType::F32, &[1, near_ties.len()], &near_ties).unwrap();
        let scale = Tensor::from_f64(DType::F32, &[1], &[0.3]).unwrap();
        let exact = QuantFp8::new("s", QuantScale::Static(scale.clone()), DType::F8E4M3FN).unwrap();
        let parity = exact.clone().with_rounding(Rounding::Dtype);
        assert_eq!(parity.rounding(), Rounding::Dtype);
        let (a, _) = exact.forward(&ctx, &x).unwrap();
        let (b, _) = parity.forward(&ctx, &x).unwrap();
        let expected = static_scaled_fp8_quant::native(&x, &scale, DType::F8E4M3FN, Rounding::Dtype).unwrap();
        assert!(bit_eq(&b, &expected), "the layer's rounding is the op's");
        assert!(!bit_eq(&a, &b), "dividing and multiplying by the reciprocal differ near a tie");
    }
}
