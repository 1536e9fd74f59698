//! Rotary position embedding of query and key, with the cos/sin cache built once per layer.

use ir_core::storage::DeviceAllocator;
use ir_core::{DType, ExecutionContext, Tensor};
use ir_ops::{Rounding, rotary_embedding};

use crate::LayerError;
use crate::rope::{RopeScaling, rope_cache};

/// Rotary position embedding (`rotary_embedding`) of `[T, n_heads · head_size]` query and
/// `[T, n_kv_heads · head_size]` key, NeoX or GPT-J style, over the first `rotary_dim` elements of
/// each head. The cos/sin cache (`[max_position, rotary_dim]`, frequencies `base^(−2i / rotary_dim)`,
/// computed in f64 and rounded to the layer's dtype) is built by [`RotaryEmbedding::new`] and
/// passed as a traced parameter.
///
/// ```
/// use ir_core::{DType, EagerContext, Registry, Tensor, TensorMeta};
/// use layers::RotaryEmbedding;
///
/// let registry = ir_ops::registry();
/// let ctx = EagerContext::new(&registry);
/// let rope = RotaryEmbedding::new("rope", 64, 64, 2048, 10000.0, true, DType::BF16)?;
/// let positions = Tensor::from_vec(&[3], vec![0i64, 1, 2])?;
/// let q = Tensor::randn(&TensorMeta::compact(DType::BF16, &[3, 4 * 64]), 0)?;
/// let k = Tensor::randn(&TensorMeta::compact(DType::BF16, &[3, 64]), 1)?;
/// let q0 = q.to_f64_vec()?;
/// // q and k are donated: an in-place kernel rotates them in their storage.
/// let (q, k) = rope.forward(&ctx, &positions, q, Some(k))?;
/// assert!(k.is_some());
/// assert_eq!(q.to_f64_vec()?[..64], q0[..64], "position 0 is not rotated");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    name: String,
    head_size: usize,
    rotary_dim: usize,
    is_neox_style: bool,
    cache: Tensor,
    rounding: Rounding,
}

impl RotaryEmbedding {
    /// A rotary embedding named `name` (the cache's parameter name when traced) for heads of
    /// `head_size`, rotating the first `rotary_dim` (even, at most `head_size`) elements of each,
    /// for positions `0..max_position`, with frequency base `base`, in `dtype` (query's and key's).
    pub fn new(
        name: impl Into<String>,
        head_size: usize,
        rotary_dim: usize,
        max_position: usize,
        base: f64,
        is_neox_style: bool,
        dtype: DType,
    ) -> Result<RotaryEmbedding, LayerError> {
        RotaryEmbedding::with_scaling(name, head_size, rotary_dim, max_position, base, is_neox_style, dtype, None)
    }

    /// [`RotaryEmbedding::new`] with a checkpoint's frequency scaling (linear, dynamic NTK, Llama 3,
    /// YaRN: [`RopeScaling`], read from a Hugging Face `rope_scaling` entry by
    /// [`RopeScaling::from_hugging_face`]). The cache covers the scaled context
    /// ([`RopeScaling::max_position`]).
    #[allow(clippy::too_many_arguments)]
    pub fn with_scaling(
        name: impl Into<String>,
        head_size: usize,
        rotary_dim: usize,
        max_position: usize,
        base: f64,
        is_neox_style: bool,
        dtype: DType,
        scaling: Option<RopeScaling>,
    ) -> Result<RotaryEmbedding, LayerError> {
        let name = name.into();
        let error = |reason: String| LayerError::Rotary { name: name.clone(), reason };
        check_geometry(head_size, rotary_dim).map_err(error)?;
        if max_position == 0 {
            return Err(error("max_position must be at least 1".to_owned()));
        }
        if !(base.is_finite() && base > 0.0) {
            return Err(error(format!("base {base} must be finite and positive")));
        }
        if !dtype.is_compute() {
            return Err(error(format!("dtype {dtype} is not one of f32, f16, bf16, f64")));
        }
        let positions = scaling.as_ref().map_or(max_position, |s| s.max_position(max_position));
        let cache = rope_cache(dtype, positions, rotary_dim, base, scaling.as_ref())?;
        Ok(RotaryEmbedding { name, head_size, rotary_dim, is_neox_style, cache, rounding: Rounding::Exact })
    }

    /// A rotary embedding over a cos/sin cache the engine already has (`[max_position,
    /// rotary_dim]`, cos then sin per position; a checkpoint's own, or one another library built),
    /// used as given.
    pub fn from_cache(
        name: impl Into<String>,
        head_size: usize,
        is_neox_style: bool,
        cache: Tensor,
    ) -> Result<RotaryEmbedding, LayerError> {
        let name = name.into();
        let error = |reason: String| LayerError::Rotary { name: name.clone(), reason };
        let &[positions, rotary_dim] = cache.shape() else {
            return Err(error(format!("the cache must be [max_position, rotary_dim], not {:?}", cache.shape())));
        };
        check_geometry(head_size, rotary_dim).map_err(error)?;
        if positions == 0 {
            return Err(error("the cache has no positions".to_owned()));
        }
        if !cache.dtype().is_compute() {
            return Err(error(format!("cache dtype {} is not one of f32, f16, bf16, f64", cache.dtype())));
        }
        Ok(RotaryEmbedding { name, head_size, rotary_dim, is_neox_style, cache, rounding: Rounding::Exact })
    }

    /// The layer with another [`Rounding`]: `Exact` (the default) keeps the products in f32;
    /// `Dtype` rounds them to the query's dtype, as PyTorch and vLLM's CUDA kernel do, for checking
    /// bit parity with them.
    pub fn with_rounding(self, rounding: Rounding) -> RotaryEmbedding {
        RotaryEmbedding { rounding, ..self }
    }

    /// Elements per head.
    pub fn head_size(&self) -> usize {
        self.head_size
    }

    /// Rotated elements per head.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// The cos/sin cache, `[max_position, rotary_dim]`.
    pub fn cos_sin_cache(&self) -> &Tensor {
        &self.cache
    }

    /// Moves the cache to the allocator's device.
    pub fn to_device(&mut self, allocator: &dyn DeviceAllocator) -> Result<(), LayerError> {
        self.cache = self.cache.to_device(allocator)?;
        Ok(())
    }

    /// `rotary_embedding` `maybe_inplace`: query and key are donated (an in-place kernel rotates
    /// them in their storage, views of one qkv buffer included); returns `(query, key)`, the key
    /// only when one was given.
    pub fn forward<C: ExecutionContext>(
        &self,
        ctx: &C,
        positions: &C::Tensor,
        query: C::Tensor,
        key: Option<C::Tensor>,
    ) -> Result<(C::Tensor, Option<C::Tensor>), LayerError> {
        let cache = ctx.parameter(&self.name, &self.cache)?;
        let (head_size, rotary_dim) = (self.head_size as i64, self.rotary_dim as i64);
        Ok(rotary_embedding::call_maybe_inplace(
            ctx,
            positions,
            query,
            key,
            &cache,
            head_size,
            rotary_dim,
            self.is_neox_style,
            self.rounding,
        )?)
    }

    /// `rotary_embedding`, functional: query and key are not donated.
    pub fn forward_functional<C: ExecutionContext>(
        &self,
        ctx: &C,
        positions: &C::Tensor,
        query: &C::Tensor,
        key: Option<&C::Tensor>,
    ) -> Result<(C::Tensor, Option<C::Tensor>), LayerError> {
        let cache = ctx.parameter(&self.name, &self.cache)?;
        let (head_size, rotary_dim) = (self.head_size as i64, self.rotary_dim as i64);
        let neox = self.is_neox_style;
        Ok(rotary_embedding::call(ctx, positions, query, key, &cache, head_size, rotary_dim, neox, self.rounding)?)
    }
}

/// Heads of `head_size` rotating their first `rotary_dim` elements (even, in 2..=head_size).
fn check_geometry(head_size: usize, rotary_dim: usize) -> Result<(), String> {
    if head_size == 0 || rotary_dim < 2 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_size {
        return Err(format!("rotary_dim {rotary_dim} must be even and lie in 2..={head_size} (head_size)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::{EagerContext, TensorMeta, bit_eq};

    /// The layer's rounding reaches the op: `Dtype` gives native's rounded-products bits on bf16,
    /// which differ from the default's.
    #[test]
    fn the_layer_passes_its_rounding_to_the_op() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        let rope = RotaryEmbedding::new("rope", 16, 16, 32, 10000.0, true, DType::BF16).unwrap();
        let parity = rope.clone().with_rounding(Rounding::Dtype);
        let positions = Tensor::from_vec(&[4], vec![3i64, 9, 31, 7]).unwrap();
        let q = Tensor::randn(&TensorMeta::compact(DType::BF16, &[4, 32]), 5).unwrap();
        let native = |rounding| {
            rotary_embedding::native(&positions, &q, None, rope.cos_sin_cache(), 16, 16, true, rounding).unwrap().0
        };
        let (exact, _) = rope.forward_functional(&ctx, &positions, &q, None).unwrap();
        let (rounded, _) = parity.forward_functional(&ctx, &positions, &q, None).unwrap();
        assert!(bit_eq(&exact, &native(Rounding::Exact)) && bit_eq(&rounded, &native(Rounding::Dtype)));
        assert!(!bit_eq(&exact, &rounded), "bf16 products rounded change some elements");
    }

    #[test]
    fn both_forms_match_the_reference_and_bad_geometry_is_refused() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        let rope = RotaryEmbedding::new("rope", 16, 8, 32, 10000.0, false, DType::F32).unwrap();
        let positions = Tensor::from_vec(&[4], vec![3i64, 0, 31, 7]).unwrap();
        let q = Tensor::randn(&TensorMeta::compact(DType::F32, &[4, 32]), 5).unwrap();
        let (eq, ek) =
            rotary_embedding::native(&positions, &q, None, rope.cos_sin_cache(), 16, 8, false, ir_ops::Rounding::Exact)
                .unwrap();
        assert!(ek.is_none());
        let (fq, fk) = rope.forward_functional(&ctx, &positions, &q, None).unwrap();
        assert!(bit_eq(&fq, &eq) && fk.is_none());
        let (iq, _) = rope.forward(&ctx, &positions, q, None).unwrap();
        assert!(bit_eq(&iq, &eq));
        for (head, rot) in [(16, 3), (16, 18), (16, 0)] {
            let err = RotaryEmbedding::new("r", head, rot, 8, 10000.0, true, DType::F32).unwrap_err();
            assert!(err.to_string().starts_with("RotaryEmbedding `r`: rotary_dim"), "{err}");
        }
        let err = RotaryEmbedding::new("r", 16, 16, 8, 10000.0, true, DType::I8).unwrap_err();
        assert!(err.to_string().contains("dtype i8"), "{err}");
        let err = RotaryEmbedding::new("r", 16, 16, 0, 10000.0, true, DType::F32).unwrap_err();
        assert!(err.to_string().contains("max_position"), "{err}");
    }

    #[test]
    fn a_given_cache_is_used_as_given_and_scaling_stretches_the_cache() {
        let registry = ir_ops::registry();
        let ctx = EagerContext::new(&registry);
        let cache = Tensor::randn(&TensorMeta::compact(DType::F32, &[8, 16]), 3).unwrap();
        let rope = RotaryEmbedding::from_cache("given", 16, true, cache.clone()).unwrap();
        assert!(bit_eq(rope.cos_sin_cache(), &cache) && rope.rotary_dim() == 16);
        let positions = Tensor::from_vec(&[2], vec![7i64, 1]).unwrap();
        let q = Tensor::randn(&TensorMeta::compact(DType::F32, &[2, 32]), 4).unwrap();
        let (got, _) = rope.forward_functional(&ctx, &positions, &q, None).unwrap();
        let (expected, _) =
            rotary_embedding::native(&positions, &q, None, &cache, 16, 16, true, ir_ops::Rounding::Exact).unwrap();
        assert!(bit_eq(&got, &expected));
        for bad in [Tensor::zeros(DType::F32, &[8]).unwrap(), Tensor::zeros(DType::F32, &[8, 15]).unwrap()] {
            assert!(RotaryEmbedding::from_cache("bad", 16, true, bad).is_err());
        }
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 32,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.1,
            truncate: true,
        };
        let stretched =
            RotaryEmbedding::with_scaling("yarn", 16, 16, 32, 10000.0, true, DType::F32, Some(yarn)).unwrap();
        assert_eq!(stretched.cos_sin_cache().shape(), [128, 16], "the cache covers the stretched context");
    }
}
