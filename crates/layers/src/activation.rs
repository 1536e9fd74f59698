//! The gated activation layers of MLPs: the input is `[..., 2d]`, the gate then the up projection
//! (one fused `gate_up_proj` matmul's output); the output is `act(gate) * up`, `[..., d]`.

use ir_core::op::gelu_and_mul::{self, Approximate};
use ir_core::op::silu_and_mul;
use ir_core::{ExecutionContext, TensorMeta};

use crate::LayerError;

/// `silu(x[..., :d]) * x[..., d:]`: the activation of Llama-style MLPs.
///
/// ```
/// use ir_core::{DType, EagerContext, Registry, Tensor};
/// use layers::SiluAndMul;
///
/// let registry = Registry::with_builtin_ops();
/// let x = Tensor::from_f64(DType::F32, &[1, 4], &[1.0, -1.0, 2.0, 3.0])?;
/// let out = SiluAndMul.forward(&EagerContext::new(&registry), &x)?;
/// assert_eq!(out.shape(), &[1, 2]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SiluAndMul;

impl SiluAndMul {
    /// Applies the layer to `x: [..., 2d]`.
    pub fn forward<C: ExecutionContext>(&self, ctx: &C, x: &C::Tensor) -> Result<C::Tensor, LayerError> {
        check_gated("SiluAndMul", ctx.meta(x))?;
        Ok(silu_and_mul::call(ctx, x)?)
    }
}

/// `gelu(x[..., :d], approximate) * x[..., d:]` (GeGLU MLPs), with the erf form or the tanh
/// approximation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeluAndMul {
    approximate: Approximate,
}

impl GeluAndMul {
    /// A layer using the given gelu formula.
    pub fn new(approximate: Approximate) -> GeluAndMul {
        GeluAndMul { approximate }
    }

    /// The gelu formula.
    pub fn approximate(&self) -> Approximate {
        self.approximate
    }

    /// Applies the layer to `x: [..., 2d]`.
    pub fn forward<C: ExecutionContext>(&self, ctx: &C, x: &C::Tensor) -> Result<C::Tensor, LayerError> {
        check_gated("GeluAndMul", ctx.meta(x))?;
        Ok(gelu_and_mul::call(ctx, x, self.approximate)?)
    }
}

impl Default for GeluAndMul {
    /// The erf form, as upstream's default.
    fn default() -> GeluAndMul {
        GeluAndMul::new(Approximate::None)
    }
}

/// Checks that `x` has rank ≥ 1 and an even last dimension, naming the layer otherwise.
pub(crate) fn check_gated(layer: &'static str, x: &TensorMeta) -> Result<(), LayerError> {
    match x.shape().last() {
        Some(last) if last % 2 == 0 => Ok(()),
        _ => Err(LayerError::GatedInput { layer, shape: x.shape().to_vec() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::{DType, EagerContext, Registry, Tensor, bit_eq};

    #[test]
    fn layers_call_their_ops_and_check_the_input() {
        let registry = Registry::with_builtin_ops();
        let ctx = EagerContext::new(&registry);
        let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[3, 16]), 4).unwrap();
        let silu = SiluAndMul.forward(&ctx, &x).unwrap();
        assert!(bit_eq(&silu, &silu_and_mul::native(&x).unwrap()));
        for approximate in [Approximate::None, Approximate::Tanh] {
            let gelu = GeluAndMul::new(approximate).forward(&ctx, &x).unwrap();
            assert!(bit_eq(&gelu, &gelu_and_mul::native(&x, approximate).unwrap()), "{approximate:?}");
        }
        assert_eq!(GeluAndMul::default().approximate(), Approximate::None);
        let odd = Tensor::zeros(DType::BF16, &[3, 15]).unwrap();
        let err = SiluAndMul.forward(&ctx, &odd).unwrap_err();
        assert_eq!(err.to_string(), "SiluAndMul needs an input with an even last dimension, got shape [3, 15]");
    }
}
