//! The `RmsNorm` layer: `rms_norm`, or `fused_add_rms_norm` with a residual.

use std::sync::OnceLock;

use ir_core::storage::DeviceAllocator;
use ir_core::{DType, ExecutionContext, Tensor};
use ir_ops::Rounding;

use crate::LayerError;

/// Root-mean-square normalization over the last dimension with an optional learned weight.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    hidden_size: usize,
    eps: f64,
    variance_size: Option<i64>,
    weight: Weight,
    name: String,
    rounding: Rounding,
}

/// The layer's weight.
#[derive(Clone, Debug)]
enum Weight {
    None,
    /// Ones in the dtype of each call's activations (the builder's default until a weight is
    /// loaded), made once per dtype.
    OnesLikeInput(Box<[OnceLock<Tensor>; 3]>),
    Given(Tensor),
}

/// The dtypes the default ones are kept in, one slot each.
const ONES_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Builds an [`RmsNorm`]; defaults: eps 1e-6, the variance over the whole row, and a weight of
/// ones in the activations' dtype (so every provider takes it; [`RmsNormBuilder::dtype`] fixes one).
#[derive(Clone, Debug)]
pub struct RmsNormBuilder {
    hidden_size: usize,
    eps: f64,
    var_hidden_size: Option<usize>,
    has_weight: bool,
    dtype: Option<DType>,
    name: String,
    rounding: Rounding,
}

impl RmsNormBuilder {
    /// Epsilon added to the mean square.
    pub fn eps(self, eps: f64) -> RmsNormBuilder {
        RmsNormBuilder { eps, ..self }
    }

    /// Computes the variance over the first `var_hidden_size` elements of each row only.
    pub fn var_hidden_size(self, var_hidden_size: usize) -> RmsNormBuilder {
        RmsNormBuilder { var_hidden_size: Some(var_hidden_size), ..self }
    }

    /// Builds the layer without a weight.
    pub fn without_weight(self) -> RmsNormBuilder {
        RmsNormBuilder { has_weight: false, ..self }
    }

    /// The dtype of the weight (without it, the weight takes each call's activation dtype). A weight
    /// of another dtype than the activations (a Gemma-style f32 weight on bf16 activations) is
    /// applied in its own dtype.
    pub fn dtype(self, dtype: DType) -> RmsNormBuilder {
        RmsNormBuilder { dtype: Some(dtype), ..self }
    }

    /// The name the weight has when the layer is traced (`model.layers.0.input_layernorm`).
    pub fn name(self, name: impl Into<String>) -> RmsNormBuilder {
        RmsNormBuilder { name: name.into(), ..self }
    }

    /// Where the residual forms round the sum ([`Rounding`]): `Exact` (the default) normalizes the
    /// f32 sum; `Dtype` the sum rounded to the activations' dtype, as PyTorch and vLLM's CUDA
    /// kernel do, for checking bit parity with them.
    pub fn rounding(self, rounding: Rounding) -> RmsNormBuilder {
        RmsNormBuilder { rounding, ..self }
    }

    /// Builds the layer; the weight starts as ones (of the activations' dtype unless
    /// [`RmsNormBuilder::dtype`] fixed one).
    pub fn build(self) -> Result<RmsNorm, LayerError> {
        let hidden_size = self.hidden_size;
        if hidden_size == 0 {
            return Err(LayerError::ZeroHiddenSize);
        }
        let variance_size = match self.var_hidden_size {
            None => None,
            Some(v) if v == hidden_size => None,
            Some(v) if (1..hidden_size).contains(&v) => Some(v as i64),
            Some(v) => return Err(LayerError::VarHiddenSize { hidden_size, var_hidden_size: v }),
        };
        let weight = match (self.has_weight, self.dtype) {
            (false, _) => Weight::None,
            (true, None) => Weight::OnesLikeInput(Box::default()),
            (true, Some(dtype)) => Weight::Given(Tensor::ones(dtype, &[hidden_size])?),
        };
        Ok(RmsNorm { hidden_size, eps: self.eps, variance_size, weight, name: self.name, rounding: self.rounding })
    }
}

impl RmsNorm {
    /// A builder with the defaults.
    pub fn builder(hidden_size: usize) -> RmsNormBuilder {
        RmsNormBuilder {
            hidden_size,
            eps: 1e-6,
            var_hidden_size: None,
            has_weight: true,
            dtype: None,
            rounding: Rounding::Exact,
            name: "rms_norm.weight".to_owned(),
        }
    }

    /// A layer with a ones weight of `dtype` and the other defaults.
    pub fn new(hidden_size: usize, dtype: DType) -> Result<RmsNorm, LayerError> {
        RmsNorm::builder(hidden_size).dtype(dtype).build()
    }

    /// The hidden size.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// Epsilon.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// The variance size passed to the op (`None` when it is the whole row).
    pub fn variance_size(&self) -> Option<i64> {
        self.variance_size
    }

    /// The weight, if one was given or loaded (`None` for a layer without a weight and for the
    /// default ones, which take each call's activation dtype).
    pub fn weight(&self) -> Option<&Tensor> {
        match &self.weight {
            Weight::Given(weight) => Some(weight),
            Weight::None | Weight::OnesLikeInput(_) => None,
        }
    }

    /// Whether the layer has a weight (given, loaded or the default ones).
    pub fn has_weight(&self) -> bool {
        !matches!(self.weight, Weight::None)
    }

    /// Replaces the weight; its shape must be `[hidden_size]`. Its dtype may differ from the
    /// activations' (a Gemma-style f32 weight on bf16 activations): the norm applies it in its own
    /// dtype, on every provider.
    pub fn load_weight(&mut self, weight: Tensor) -> Result<(), LayerError> {
        if matches!(self.weight, Weight::None) {
            return Err(LayerError::NoWeight);
        }
        if weight.shape() != [self.hidden_size] {
            return Err(LayerError::WeightShape { hidden_size: self.hidden_size, found: weight.shape().to_vec() });
        }
        self.weight = Weight::Given(weight);
        Ok(())
    }

    /// Moves the weight to the allocator's device (the default ones: in each dtype they take).
    pub fn to_device(&mut self, allocator: &dyn DeviceAllocator) -> Result<(), LayerError> {
        match &self.weight {
            Weight::Given(weight) => self.weight = Weight::Given(weight.to_device(allocator)?),
            Weight::OnesLikeInput(_) => {
                let slots: [OnceLock<Tensor>; 3] = Default::default();
                for (slot, dtype) in slots.iter().zip(ONES_DTYPES) {
                    let ones = Tensor::ones(dtype, &[self.hidden_size])?.to_device(allocator)?;
                    slot.set(ones).expect("a fresh slot");
                }
                self.weight = Weight::OnesLikeInput(Box::new(slots));
            }
            Weight::None => {}
        }
        Ok(())
    }

    /// `rms_norm(x, weight, eps, variance_size)`.
    pub fn forward<C: ExecutionContext>(&self, ctx: &C, x: &C::Tensor) -> Result<C::Tensor, LayerError> {
        self.check_input(ctx, "x", x)?;
        let weight = self.weight_in(ctx, x)?;
        Ok(ir_ops::rms_norm::call(ctx, x, weight.as_ref(), self.eps, self.variance_size)?)
    }

    /// `fused_add_rms_norm` `maybe_inplace`: takes `x` and `residual` by value (they are donated) and
    /// returns `(out, new_residual)`.
    ///
    /// ```compile_fail
    /// # use ir_core::{DType, EagerContext, Registry, Tensor};
    /// # let registry = ir_ops::registry();
    /// # let ctx = EagerContext::new(&registry);
    /// let norm = layers::RmsNorm::new(8, DType::BF16).unwrap();
    /// let x = Tensor::ones(DType::BF16, &[2, 8]).unwrap();
    /// let residual = Tensor::zeros(DType::BF16, &[2, 8]).unwrap();
    /// let (out, new_residual) = norm.forward_residual(&ctx, x, residual).unwrap();
    /// // `residual` was donated: reading it again does not compile.
    /// let _ = residual.shape();
    /// ```
    pub fn forward_residual<C: ExecutionContext>(
        &self,
        ctx: &C,
        x: C::Tensor,
        residual: C::Tensor,
    ) -> Result<(C::Tensor, C::Tensor), LayerError> {
        let weight = self.residual_weight(ctx, &x, &residual)?;
        let (eps, variance_size, rounding) = (self.eps, self.variance_size, self.rounding);
        Ok(ir_ops::fused_add_rms_norm::call_maybe_inplace(
            ctx,
            x,
            residual,
            weight.as_ref(),
            eps,
            variance_size,
            rounding,
        )?)
    }

    /// `fused_add_rms_norm`, functional: inputs are not donated.
    pub fn forward_residual_functional<C: ExecutionContext>(
        &self,
        ctx: &C,
        x: &C::Tensor,
        residual: &C::Tensor,
    ) -> Result<(C::Tensor, C::Tensor), LayerError> {
        let weight = self.residual_weight(ctx, x, residual)?;
        let (eps, variance_size, rounding) = (self.eps, self.variance_size, self.rounding);
        Ok(ir_ops::fused_add_rms_norm::call(ctx, x, residual, weight.as_ref(), eps, variance_size, rounding)?)
    }

    /// Checks x and the residual of a residual call and gives the weight on x's device.
    fn residual_weight<C: ExecutionContext>(
        &self,
        ctx: &C,
        x: &C::Tensor,
        residual: &C::Tensor,
    ) -> Result<Option<C::Tensor>, LayerError> {
        self.check_input(ctx, "x", x)?;
        let (x_shape, residual_shape) = (ctx.meta(x).shape(), ctx.meta(residual).shape());
        if x_shape != residual_shape {
            return Err(LayerError::ResidualShape { x: x_shape.to_vec(), residual: residual_shape.to_vec() });
        }
        self.weight_in(ctx, x)
    }

    fn check_input<C: ExecutionContext>(&self, ctx: &C, param: &'static str, t: &C::Tensor) -> Result<(), LayerError> {
        let shape = ctx.meta(t).shape();
        if shape.last() == Some(&self.hidden_size) {
            return Ok(());
        }
        Err(LayerError::InputShape { param, shape: shape.to_vec(), hidden_size: self.hidden_size })
    }

    /// The weight as the context's tensor, for activations like `x`.
    fn weight_in<C: ExecutionContext>(&self, ctx: &C, x: &C::Tensor) -> Result<Option<C::Tensor>, LayerError> {
        match &self.weight {
            Weight::Given(weight) => Ok(Some(ctx.parameter(&self.name, weight)?)),
            Weight::OnesLikeInput(ones) => {
                let dtype = ctx.meta(x).dtype;
                let Some(slot) = ONES_DTYPES.iter().position(|&d| d == dtype).map(|i| &ones[i]) else {
                    // The op refuses these activations with its own error; ones of their dtype get there.
                    return Ok(Some(ctx.parameter(&self.name, &Tensor::ones(dtype, &[self.hidden_size])?)?));
                };
                let weight = match slot.get() {
                    Some(weight) => weight,
                    None => {
                        let weight = Tensor::ones(dtype, &[self.hidden_size])?;
                        // A racing call made the same ones; either is the weight.
                        slot.get_or_init(|| weight)
                    }
                };
                Ok(Some(ctx.parameter(&self.name, weight)?))
            }
            Weight::None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use ir_core::{EagerContext, bit_eq};
    use ir_ops::fused_add_rms_norm;
    use ir_ops::rms_norm;

    use super::*;

    fn sample(rows: usize, cols: usize, seed: usize) -> Tensor {
        let values: Vec<f64> = (0..rows * cols).map(|i| ((i * 37 + seed * 11) % 17) as f64 / 4.0 - 2.0).collect();
        Tensor::from_f64(DType::BF16, &[rows, cols], &values).unwrap()
    }

    /// Two layers built without `.name()` share the default weight name; their distinct weights must
    /// stay distinct in the trace, and one weight used by two layers must stay one input.
    #[test]
    fn traced_weights_are_identified_by_tensor_not_by_name() {
        use ir_graph::{InterpOptions, Tracer, interpret, parse};
        let registry = ir_ops::registry();
        let mut first = RmsNorm::new(8, DType::BF16).unwrap();
        let mut second = RmsNorm::new(8, DType::BF16).unwrap();
        first.load_weight(Tensor::full(DType::BF16, &[8], 0.5).unwrap()).unwrap();
        second.load_weight(Tensor::full(DType::BF16, &[8], 3.0).unwrap()).unwrap();
        let tied = first.clone();

        let x = sample(2, 8, 1);
        let eager = {
            let ctx = EagerContext::new(&registry);
            let h = first.forward(&ctx, &x).unwrap();
            let h = second.forward(&ctx, &h).unwrap();
            tied.forward(&ctx, &h).unwrap()
        };
        let tracer = Tracer::new(&registry, "two_layers");
        let input = tracer.input("x", x.meta().clone());
        let h = first.forward(&tracer, &input).unwrap();
        let h = second.forward(&tracer, &h).unwrap();
        let out = tied.forward(&tracer, &h).unwrap();
        let traced = tracer.finish(&[out]);
        let names: Vec<&str> = traced.parameters.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["rms_norm.weight", "rms_norm.weight.1"], "two tensors, two inputs; the tied one is reused");
        let text = traced.graph.to_string();
        assert!(parse(&text).unwrap().structurally_eq(&traced.graph), "{text}");

        let mut inputs = vec![("x".to_owned(), x.clone())];
        inputs.extend(traced.parameters.iter().cloned());
        let run = interpret(&traced.graph, &registry, inputs, InterpOptions::checked()).unwrap();
        assert!(bit_eq(&run.outputs[0], &eager), "the traced model runs each layer's own weight\n{text}");
    }

    /// Names that the text format cannot spell, or that collide with fresh value names, are renamed
    /// so the printed graph parses back.
    #[test]
    fn every_traced_name_parses_back() {
        use ir_graph::{InterpOptions, Tracer, interpret, parse};
        let registry = ir_ops::registry();
        let tracer = Tracer::new(&registry, "names");
        let x = sample(2, 8, 2);
        let input = tracer.input("x y", x.meta().clone());
        let mut h = input;
        for name in ["0", "a)b", "x y", "", "1"] {
            let norm = RmsNorm::builder(8).dtype(DType::BF16).name(name.to_owned()).build().unwrap();
            h = norm.forward(&tracer, &h).unwrap();
        }
        let traced = tracer.finish(&[h]);
        let text = traced.graph.to_string();
        let reparsed = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(reparsed.structurally_eq(&traced.graph), "{text}");
        let input_name = traced.graph.inputs()[0].2.to_owned();
        assert_eq!(input_name, "x_y");
        let mut inputs = vec![(input_name, x)];
        inputs.extend(traced.parameters.iter().cloned());
        interpret(&traced.graph, &registry, inputs, InterpOptions::checked()).unwrap();
    }

    /// The builder's rounding reaches the residual forms: `Dtype` normalizes the bf16 sum as native
    /// does, which differs from the default's f32 sum on some elements.
    #[test]
    fn the_builder_rounding_reaches_the_fused_norm() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        let meta = ir_core::TensorMeta::compact(DType::BF16, &[4, 64]);
        let (x, r) = (Tensor::randn(&meta, 1).unwrap(), Tensor::randn(&meta, 2).unwrap());
        let exact = RmsNorm::builder(64).build().unwrap();
        let parity = RmsNorm::builder(64).rounding(Rounding::Dtype).build().unwrap();
        let (a, _) = exact.forward_residual_functional(&ctx, &x, &r).unwrap();
        let (b, sum) = parity.forward_residual(&ctx, x.deep_clone().unwrap(), r.deep_clone().unwrap()).unwrap();
        let ones = Tensor::ones(DType::BF16, &[64]).unwrap();
        let (expected, _) = fused_add_rms_norm::native(&x, &r, Some(&ones), 1e-6, None, Rounding::Dtype).unwrap();
        assert!(bit_eq(&b, &expected), "the norm of the rounded sum");
        assert!(bit_eq(&sum, &x.add(&r).unwrap()), "the residual output");
        assert!(!bit_eq(&a, &b), "the two roundings differ on bf16");
    }

    #[test]
    fn builder_rules() {
        let norm = RmsNorm::builder(16).var_hidden_size(16).build().unwrap();
        assert_eq!(norm.variance_size(), None, "var_hidden_size == hidden_size means the whole row");
        let norm = RmsNorm::builder(16).var_hidden_size(8).eps(1e-5).build().unwrap();
        assert_eq!((norm.variance_size(), norm.eps()), (Some(8), 1e-5));
        for bad in [0, 17] {
            let err = RmsNorm::builder(16).var_hidden_size(bad).build().unwrap_err();
            assert_eq!(err, LayerError::VarHiddenSize { hidden_size: 16, var_hidden_size: bad });
        }
        assert_eq!(RmsNorm::builder(0).build().unwrap_err(), LayerError::ZeroHiddenSize);
        let norm = RmsNorm::new(16, DType::F16).unwrap();
        let weight = norm.weight().unwrap();
        assert_eq!((weight.dtype(), weight.shape()), (DType::F16, &[16][..]));
        assert_eq!(weight.to_f64_vec().unwrap(), vec![1.0; 16]);
        assert!(RmsNorm::builder(16).without_weight().build().unwrap().weight().is_none());
    }

    #[test]
    fn load_weight_checks_the_shape() {
        let mut norm = RmsNorm::new(16, DType::BF16).unwrap();
        let err = norm.load_weight(Tensor::ones(DType::BF16, &[15]).unwrap()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "weight of shape [15] does not fit RmsNorm with hidden size 16 (expected shape [16])"
        );
        norm.load_weight(Tensor::full(DType::F32, &[16], 2.0).unwrap()).unwrap();
        assert_eq!(norm.weight().unwrap().dtype(), DType::F32);
        let mut weightless = RmsNorm::builder(16).without_weight().build().unwrap();
        assert_eq!(weightless.load_weight(Tensor::ones(DType::BF16, &[16]).unwrap()), Err(LayerError::NoWeight));
    }

    #[test]
    fn forward_matches_the_ops() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        let mut norm = RmsNorm::builder(16).var_hidden_size(8).build().unwrap();
        let weight = sample(1, 16, 3).reshape(&[16]).unwrap();
        norm.load_weight(weight.clone()).unwrap();
        let x = sample(4, 16, 1);
        let residual = sample(4, 16, 2);
        let y = norm.forward(&ctx, &x).unwrap();
        assert!(bit_eq(&y, &rms_norm::native(&x, Some(&weight), 1e-6, Some(8)).unwrap()));
        let (expected_out, expected_residual) =
            fused_add_rms_norm::native(&x, &residual, Some(&weight), 1e-6, Some(8), ir_ops::Rounding::Exact).unwrap();
        let functional = norm.forward_residual_functional(&ctx, &x, &residual).unwrap();
        assert!(bit_eq(&functional.0, &expected_out) && bit_eq(&functional.1, &expected_residual));
        let (out, new_residual) = norm.forward_residual(&ctx, x, residual).unwrap();
        assert!(bit_eq(&out, &expected_out) && bit_eq(&new_residual, &expected_residual));
        let weightless = RmsNorm::builder(16).without_weight().build().unwrap();
        let x = sample(4, 16, 1);
        assert!(bit_eq(&weightless.forward(&ctx, &x).unwrap(), &rms_norm::native(&x, None, 1e-6, None).unwrap()));
    }

    #[test]
    fn shape_errors_name_both_shapes_before_any_write() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        let norm = RmsNorm::new(16, DType::BF16).unwrap();
        let err = norm.forward(&ctx, &sample(4, 15, 0)).unwrap_err();
        assert_eq!(err.to_string(), "input `x` of shape [4, 15] does not fit RmsNorm with hidden size 16");
        let x = sample(4, 16, 0);
        let kept = x.clone();
        let before = x.deep_clone().unwrap();
        let err = norm.forward_residual(&ctx, x, sample(3, 16, 0)).unwrap_err();
        assert_eq!(err.to_string(), "x of shape [4, 16] and residual of shape [3, 16] differ");
        assert!(bit_eq(&kept, &before));
    }
}
