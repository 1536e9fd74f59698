//! The gated activation layers of MLPs: the input is `[..., 2d]`, the gate then the up projection
//! (one fused `gate_up_proj` matmul's output); the output is `act(gate) * up`, `[..., d]`.
//!
//! Checkpoints store `gate_proj` and `up_proj` apart (Hugging Face: `mlp.gate_proj.weight` and
//! `mlp.up_proj.weight`, each `[d, hidden]`). Stack them once at load with [`gate_up_weight`] into
//! one `[2d, hidden]` projection, gate rows first: its output is the `[..., gate | up]` these
//! layers take, and one matmul replaces two.

use ir_core::{ExecutionContext, TensorMeta};
use ir_ops::gelu_and_mul::{self, Approximate};
use ir_ops::{gelu_and_mul_sparse, silu_and_mul};

use crate::LayerError;

/// `gate_proj` and `up_proj` weights (`[d, hidden]` each) stacked into the `[2d, hidden]` weight of
/// one projection whose output is `[..., gate | up]`, the input of the gated layers.
///
/// ```
/// use ir_core::{DType, Tensor};
/// let gate = Tensor::from_f64(DType::F32, &[1, 2], &[1.0, 2.0])?;
/// let up = Tensor::from_f64(DType::F32, &[1, 2], &[3.0, 4.0])?;
/// let gate_up = layers::gate_up_weight(&gate, &up)?;
/// assert_eq!(gate_up.to_f64_vec()?, [1.0, 2.0, 3.0, 4.0]);
/// # Ok::<(), layers::LayerError>(())
/// ```
pub fn gate_up_weight(gate: &ir_core::Tensor, up: &ir_core::Tensor) -> Result<ir_core::Tensor, LayerError> {
    if gate.shape() != up.shape() || gate.layout().rank() != 2 {
        return Err(LayerError::GateUpShapes { gate: gate.shape().to_vec(), up: up.shape().to_vec() });
    }
    Ok(gate.cat(up, 0)?)
}

/// `silu(x[..., :d]) * x[..., d:]`: the activation of Llama-style MLPs.
///
/// ```
/// use ir_core::{DType, EagerContext, Registry, Tensor};
/// use layers::SiluAndMul;
///
/// let registry = ir_ops::registry();
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

/// Gemma 3n's sparse GeGLU activation: on the gate, only the part above the row's
/// `mean + std_multiplier · std` passes through gelu, then the product with the up half
/// (`gelu_and_mul_sparse`). Built from the target sparsity, whose standard normal quantile (of the
/// f32-rounded sparsity, as upstream computes it) is the multiplier.
///
/// ```
/// use ir_ops::gelu_and_mul::Approximate;
/// use layers::GeluAndMulSparse;
///
/// let layer = GeluAndMulSparse::new(0.95, Approximate::Tanh)?;
/// assert!((layer.std_multiplier() - 1.6448536).abs() < 1e-6);
/// assert!(GeluAndMulSparse::new(1.0, Approximate::Tanh).is_err());
/// # Ok::<(), layers::LayerError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GeluAndMulSparse {
    std_multiplier: f64,
    approximate: Approximate,
}

impl GeluAndMulSparse {
    /// A layer keeping about `1 - activation_sparsity` of a normal gate; the sparsity lies in (0, 1).
    pub fn new(activation_sparsity: f64, approximate: Approximate) -> Result<GeluAndMulSparse, LayerError> {
        use statrs::distribution::{ContinuousCDF, Normal};
        if !(activation_sparsity > 0.0 && activation_sparsity < 1.0) {
            return Err(LayerError::Sparsity { activation_sparsity });
        }
        let standard = Normal::new(0.0, 1.0).expect("the standard normal is valid");
        let std_multiplier = standard.inverse_cdf(f64::from(activation_sparsity as f32));
        Ok(GeluAndMulSparse { std_multiplier, approximate })
    }

    /// A layer with an explicit multiplier (any finite value; the op checks it).
    pub fn with_std_multiplier(std_multiplier: f64, approximate: Approximate) -> GeluAndMulSparse {
        GeluAndMulSparse { std_multiplier, approximate }
    }

    /// Standard deviations above the gate's mean where the cutoff lies.
    pub fn std_multiplier(&self) -> f64 {
        self.std_multiplier
    }

    /// The gelu formula.
    pub fn approximate(&self) -> Approximate {
        self.approximate
    }

    /// Applies the layer to `x: [..., 2d]`.
    pub fn forward<C: ExecutionContext>(&self, ctx: &C, x: &C::Tensor) -> Result<C::Tensor, LayerError> {
        check_gated("GeluAndMulSparse", ctx.meta(x))?;
        Ok(gelu_and_mul_sparse::call(ctx, x, self.std_multiplier, self.approximate)?)
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
    use ir_core::{DType, EagerContext, Tensor, bit_eq};

    #[test]
    fn stacked_weights_project_to_gate_then_up() {
        let gate = Tensor::randn(&TensorMeta::compact(DType::F32, &[3, 5]), 1).unwrap();
        let up = Tensor::randn(&TensorMeta::compact(DType::F32, &[3, 5]), 2).unwrap();
        let stacked = gate_up_weight(&gate, &up).unwrap();
        assert_eq!(stacked.shape(), [6, 5]);
        let values = stacked.to_f64_vec().unwrap();
        assert_eq!(values[..15], gate.to_f64_vec().unwrap()[..], "gate rows first");
        assert_eq!(values[15..], up.to_f64_vec().unwrap()[..], "then up");
        let err = gate_up_weight(&gate, &Tensor::zeros(DType::F32, &[4, 5]).unwrap()).unwrap_err();
        assert_eq!(err, LayerError::GateUpShapes { gate: vec![3, 5], up: vec![4, 5] });
        assert!(
            gate_up_weight(&Tensor::zeros(DType::F32, &[5]).unwrap(), &Tensor::zeros(DType::F32, &[5]).unwrap())
                .is_err()
        );
    }

    #[test]
    fn layers_call_their_ops_and_check_the_input() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[3, 16]), 4).unwrap();
        let silu = SiluAndMul.forward(&ctx, &x).unwrap();
        assert!(bit_eq(&silu, &silu_and_mul::native(&x).unwrap()));
        for approximate in [Approximate::None, Approximate::Tanh] {
            let gelu = GeluAndMul::new(approximate).forward(&ctx, &x).unwrap();
            assert!(bit_eq(&gelu, &gelu_and_mul::native(&x, approximate).unwrap()), "{approximate:?}");
        }
        assert_eq!(GeluAndMul::default().approximate(), Approximate::None);
        let sparse = GeluAndMulSparse::new(0.95, Approximate::Tanh).unwrap();
        let out = sparse.forward(&ctx, &x).unwrap();
        let expected = gelu_and_mul_sparse::native(&x, sparse.std_multiplier(), Approximate::Tanh).unwrap();
        assert!(bit_eq(&out, &expected));
        for bad in [0.0, 1.0, f64::NAN, -0.5] {
            let err = GeluAndMulSparse::new(bad, Approximate::None).unwrap_err();
            assert!(err.to_string().contains("activation_sparsity"), "{err}");
        }
        let odd = Tensor::zeros(DType::BF16, &[3, 15]).unwrap();
        let err = SiluAndMul.forward(&ctx, &odd).unwrap_err();
        assert_eq!(err.to_string(), "SiluAndMul needs an input with an even last dimension, got shape [3, 15]");
    }
}
