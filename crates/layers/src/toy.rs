//! A toy decoder made of this crate's layers, the shape of a Llama block's non-GEMM work, for demos,
//! benchmarks and compiler tests: per layer `RmsNorm` with residual, fp8 quantization of its output
//! (the QKV GEMM's input), rotary embedding of q and k (column slices of one qkv buffer), a second
//! norm + quantization, and a `SiluAndMul` MLP. The GEMMs and the attention are stand-ins made of
//! copies (dequantization into a fresh buffer, `cat` of column slices), so a run is bit-identical
//! to any other run of the same providers, eager or compiled.

use ir_core::builtin::{Builtin, BuiltinArg};
use ir_core::storage::DeviceAllocator;
use ir_core::{DType, ExecutionContext, ExecutionContextExt, Tensor};

use crate::{LayerError, QuantFp8, QuantScale, RmsNorm, RotaryEmbedding, SiluAndMul};

/// The static scale of the toy's fp8 quantizations: normalized values up to 4 in magnitude fit.
pub const QUANT_SCALE: f64 = 4.0 / 448.0;

/// What a [`ToyDecoder`] is built from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ToyDecoderConfig {
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size: a multiple of 8 (it is split into query, key and value heads).
    pub hidden: usize,
    /// Rows of the rotary cache (positions must lie below it).
    pub max_position: usize,
    /// The activations' dtype.
    pub dtype: DType,
    /// Seed of the norm weights.
    pub seed: u64,
}

/// How the hidden size is split into heads: the qkv buffer is `[T, hidden]`, half of it the query's
/// heads and a quarter each the key's and the value's (two query heads per key head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToyHeads {
    /// Elements per head: the largest power of two from 128 down that gives at least four heads.
    pub head_size: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key (and value) heads.
    pub kv_heads: usize,
}

impl ToyHeads {
    /// The split of `hidden`, or the error naming it.
    pub fn of(hidden: usize) -> Result<ToyHeads, LayerError> {
        let Some(head_size) = [128, 64, 32, 16, 8, 4, 2].into_iter().find(|h| hidden.is_multiple_of(4 * h)) else {
            return Err(LayerError::ToyDecoder {
                reason: format!(
                    "hidden size {hidden} must be a multiple of 8 (it is split into query, key and value heads)"
                ),
            });
        };
        let heads = hidden / head_size;
        Ok(ToyHeads { head_size, q_heads: heads / 2, kv_heads: heads / 4 })
    }

    fn q_size(&self) -> usize {
        self.q_heads * self.head_size
    }

    fn kv_size(&self) -> usize {
        self.kv_heads * self.head_size
    }
}

/// One layer's modules.
#[derive(Clone, Debug)]
struct ToyLayer {
    input_norm: RmsNorm,
    input_quant: QuantFp8,
    rope: RotaryEmbedding,
    post_norm: RmsNorm,
    post_quant: QuantFp8,
}

/// The toy decoder; see the module documentation.
///
/// ```
/// use ir_core::{DType, EagerContext, Registry, Tensor, TensorMeta, bit_eq};
/// use layers::toy::{ToyDecoder, ToyDecoderConfig};
///
/// let registry = ir_ops::registry();
/// let ctx = EagerContext::new(&registry);
/// let config = ToyDecoderConfig { layers: 2, hidden: 64, max_position: 16, dtype: DType::BF16, seed: 0 };
/// let model = ToyDecoder::new(config)?;
/// let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[3, 64]), 1)?;
/// let residual = Tensor::randn(&TensorMeta::compact(DType::BF16, &[3, 64]), 2)?;
/// let positions = Tensor::from_vec(&[3], vec![0i64, 1, 2])?;
/// let (a, _) = model.forward(&ctx, (x.deep_clone()?, residual.deep_clone()?), &positions, false)?;
/// let (b, _) = model.forward(&ctx, (x, residual), &positions, true)?; // donated activations
/// assert!(bit_eq(&a, &b));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct ToyDecoder {
    layers: Vec<ToyLayer>,
    heads: ToyHeads,
    silu: SiluAndMul,
    final_norm: RmsNorm,
}

impl ToyDecoder {
    /// The decoder `config` describes, with deterministic norm weights (about 1 ± 0.1) from its seed.
    pub fn new(config: ToyDecoderConfig) -> Result<ToyDecoder, LayerError> {
        let ToyDecoderConfig { layers, hidden, max_position, dtype, seed } = config;
        let heads = ToyHeads::of(hidden)?;
        let norm = |name: String, salt: u64| -> Result<RmsNorm, LayerError> {
            let mut norm = RmsNorm::builder(hidden).dtype(dtype).name(name).build()?;
            let values: Vec<f64> = (0..hidden as u64)
                .map(|j| {
                    let mixed = j
                        .wrapping_mul(7919)
                        .wrapping_add(salt.wrapping_mul(104_729))
                        .wrapping_add(seed.wrapping_mul(31));
                    1.0 + (mixed % 201) as f64 / 1000.0 - 0.1
                })
                .collect();
            norm.load_weight(Tensor::from_f64(dtype, &[hidden], &values)?)?;
            Ok(norm)
        };
        let quant = |name: String| -> Result<QuantFp8, LayerError> {
            let scale = QuantScale::Static(Tensor::from_f64(DType::F32, &[1], &[QUANT_SCALE])?);
            QuantFp8::new(name, scale, DType::F8E4M3FN)
        };
        let mut modules = Vec::with_capacity(layers);
        for layer in 0..layers {
            let salt = 2 * layer as u64;
            modules.push(ToyLayer {
                input_norm: norm(format!("layers.{layer}.input_layernorm.weight"), salt)?,
                input_quant: quant(format!("layers.{layer}.qkv_proj.input_scale"))?,
                rope: RotaryEmbedding::new(
                    format!("layers.{layer}.rotary_emb.cos_sin_cache"),
                    heads.head_size,
                    heads.head_size,
                    max_position,
                    10000.0,
                    true,
                    dtype,
                )?,
                post_norm: norm(format!("layers.{layer}.post_attention_layernorm.weight"), salt + 1)?,
                post_quant: quant(format!("layers.{layer}.gate_up_proj.input_scale"))?,
            });
        }
        let final_norm = norm("final_norm.weight".to_owned(), 2 * layers as u64)?;
        Ok(ToyDecoder { layers: modules, heads, silu: SiluAndMul, final_norm })
    }

    /// Moves every parameter (norm weights, quantization scales, rotary caches) to the allocator's
    /// device, so that a forward pass over activations there stays there.
    pub fn to_device(&mut self, allocator: &dyn DeviceAllocator) -> Result<(), LayerError> {
        for layer in &mut self.layers {
            layer.input_norm.to_device(allocator)?;
            layer.input_quant.to_device(allocator)?;
            layer.rope.to_device(allocator)?;
            layer.post_norm.to_device(allocator)?;
            layer.post_quant.to_device(allocator)?;
        }
        self.final_norm.to_device(allocator)
    }

    /// The head split.
    pub fn heads(&self) -> ToyHeads {
        self.heads
    }

    /// The forward pass over `[T, hidden]` activations and `[T]` i64 positions, written once for every
    /// execution context (eager or traced); `donate` chooses `maybe_inplace` over the functional call
    /// for the fused norms and the rotary embedding. Returns `(hidden, residual)` after the final norm.
    pub fn forward<C: ExecutionContext>(
        &self,
        ctx: &C,
        (mut x, mut residual): (C::Tensor, C::Tensor),
        positions: &C::Tensor,
        donate: bool,
    ) -> Result<(C::Tensor, C::Tensor), LayerError> {
        for layer in &self.layers {
            (x, residual) = self.layer(ctx, layer, (x, residual), positions, donate)?;
        }
        if donate {
            self.final_norm.forward_residual(ctx, x, residual)
        } else {
            self.final_norm.forward_residual_functional(ctx, &x, &residual)
        }
    }

    fn layer<C: ExecutionContext>(
        &self,
        ctx: &C,
        layer: &ToyLayer,
        (x, residual): (C::Tensor, C::Tensor),
        positions: &C::Tensor,
        donate: bool,
    ) -> Result<(C::Tensor, C::Tensor), LayerError> {
        let (q_size, kv_size) = (self.heads.q_size(), self.heads.kv_size());
        let hidden = q_size + 2 * kv_size;
        let (normed, residual) = if donate {
            layer.input_norm.forward_residual(ctx, x, residual)?
        } else {
            layer.input_norm.forward_residual_functional(ctx, &x, &residual)?
        };
        // The fp8 GEMM's input: the normalized output's only reader, so a compiled graph fuses the
        // norm and the quantization into one kernel.
        let (q8, _) = layer.input_quant.forward(ctx, &normed)?;
        let qkv = dequantizing_gemm(ctx, &residual, &q8)?;
        // v is read before the rotary embedding, so the rotary embedding is the qkv buffer's last
        // reader and may rotate q and k, its column slices, in place.
        let v = ctx.contiguous(&ctx.slice(&qkv, 1, q_size + kv_size, hidden)?)?;
        let (q, k) = (ctx.slice(&qkv, 1, 0, q_size)?, ctx.slice(&qkv, 1, q_size, q_size + kv_size)?);
        drop(qkv);
        let (q, k) = if donate {
            layer.rope.forward(ctx, positions, q, Some(k))?
        } else {
            layer.rope.forward_functional(ctx, positions, &q, Some(&k))?
        };
        let k = k.ok_or_else(|| LayerError::ToyDecoder { reason: "rotary_embedding returned no key".to_owned() })?;
        // The attention's stand-in: q, k and v side by side.
        let attention = ctx.cat(&ctx.cat(&q, &k, 1)?, &v, 1)?;
        drop((q, k, v));
        let (normed, residual) = if donate {
            layer.post_norm.forward_residual(ctx, attention, residual)?
        } else {
            layer.post_norm.forward_residual_functional(ctx, &attention, &residual)?
        };
        let (q8, _) = layer.post_quant.forward(ctx, &normed)?;
        let gate_up = dequantizing_gemm(ctx, &residual, &q8)?;
        let activated = self.silu.forward(ctx, &gate_up)?;
        // The down projection's stand-in: the activation twice, side by side.
        Ok((ctx.cat(&activated, &activated, 1)?, residual))
    }
}

/// A stand-in for an fp8 GEMM: `q` dequantized into a fresh buffer shaped like `like`, scaled back
/// to values of about one.
fn dequantizing_gemm<C: ExecutionContext>(ctx: &C, like: &C::Tensor, q: &C::Tensor) -> Result<C::Tensor, LayerError> {
    let buffer = ctx.contiguous(like)?;
    let dequantized = ctx.builtin(Builtin::Copy, vec![BuiltinArg::Value(buffer), BuiltinArg::Value(q.clone())])?;
    Ok(ctx.scale(&dequantized, 0.5 * QUANT_SCALE)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_split_the_hidden_size_or_say_why_not() {
        assert_eq!(ToyHeads::of(4096).unwrap(), ToyHeads { head_size: 128, q_heads: 16, kv_heads: 8 });
        assert_eq!(ToyHeads::of(64).unwrap(), ToyHeads { head_size: 16, q_heads: 2, kv_heads: 1 });
        let err = ToyHeads::of(12).unwrap_err();
        assert!(err.to_string().contains("hidden size 12 must be a multiple of 8"), "{err}");
    }
}
