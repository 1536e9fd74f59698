//! A Llama-architecture decoder on candle: Llama with grouped-query attention; Gemma's variant (the
//! `(1 + w)` norm weight in f32, scaled embeddings, GELU-tanh); Qwen3's (an RMS norm of each query
//! and key head before rotary); and Gemma 3's (Gemma's, with q/k norms, the sandwich norms around
//! the attention and the MLP, sliding-window layers with their own rotary base, and the attention
//! scaled by `query_pre_attn_scalar`). Candle's matmuls, attention and KV cache, and either this
//! project's ops on candle tensors ([`Ops::Ours`]) or candle-nn's ([`Ops::CandleNn`]) for the
//! norms, rotary and the gated activation.
//!
//! Weights use Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...); q, k and v are
//! merged into one `qkv` projection at load and gate and up into one `gate_up` projection (the
//! `[gate | up]` layout the gated ops take), as vLLM does, so rotary runs in place on the q and k
//! column slices of the qkv output; with this project's ops, Qwen3's and Gemma 3's head norms and
//! rotation are one `fused_qk_norm_rope` per slice, in place.

// Shared by the example and its test (`tests/llama.rs`), each of which uses its own part.
#![allow(unreachable_pub, dead_code)]

use std::collections::HashMap;

use candle_core::{D, DType, Device, Module, Tensor};
use candle_nn::{Embedding, Linear};
use vllm_ir::Registry;
use vllm_ir::interop::candle_ops;
use vllm_ir::layers::{RopeScaling, rope_cache};
use vllm_ir::op::gelu_and_mul::Approximate;
use vllm_ir::op::{Rounding, fused_qk_norm_rope, fused_sandwich_rms_norm};

/// The fields of a Hugging Face `config.json` this model reads.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct Config {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The residual stream's width.
    pub hidden_size: usize,
    /// The MLP's inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key and value heads (grouped-query attention); the query heads when absent.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Elements per head; `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// The norms' epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Rotary base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Positions the rotary cache covers.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// Whether the output projection is the embedding's transpose.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// `llama`, `gemma`, `qwen3` or `gemma3_text`.
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// Gemma 3: the attention scores are scaled by `query_pre_attn_scalar^-1/2` (`head_dim^-1/2`
    /// when absent).
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 3: the keys a sliding layer's query sees: itself and the `sliding_window - 1` before.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Gemma 3: every `sliding_window_pattern`-th layer attends globally, the others slide (6 when
    /// absent).
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3: the rotary base of the sliding layers (`rope_theta` when absent).
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// The rotary frequencies' scaling (`rope_type` linear, dynamic, llama3 or yarn, and its
    /// fields), if any.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Map<String, serde_json::Value>>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_positions() -> usize {
    4096
}
fn default_model_type() -> String {
    "llama".to_owned()
}

impl Config {
    /// Whether this is Gemma's variant (Gemma 3 included).
    pub fn is_gemma(&self) -> bool {
        self.model_type.starts_with("gemma")
    }

    /// Whether this is Gemma 3.
    pub fn is_gemma3(&self) -> bool {
        self.model_type.starts_with("gemma3")
    }

    /// Whether each query and key head is RMS-normalized before rotary (Qwen3, Gemma 3).
    pub fn has_qk_norm(&self) -> bool {
        self.model_type == "qwen3" || self.is_gemma3()
    }

    /// How many keys before itself (and itself) a query of `layer` sees: Gemma 3's sliding layers.
    pub fn window(&self, layer: usize) -> Option<usize> {
        let pattern = self.sliding_window_pattern.unwrap_or(6).max(1);
        self.sliding_window.filter(|_| self.is_gemma3() && !(layer + 1).is_multiple_of(pattern))
    }

    /// The attention scores' scale.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self.query_pre_attn_scalar.unwrap_or(self.head_size() as f64).sqrt()
    }

    /// Refuses an architecture this model does not run: Gemma 2 (its logit soft-capping is not
    /// implemented here).
    pub fn check_supported(&self) -> anyhow::Result<()> {
        if self.model_type == "gemma2" {
            anyhow::bail!("model_type `gemma2` is not supported by this example (attention logit soft-capping)");
        }
        Ok(())
    }

    /// Key and value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Elements per head.
    pub fn head_size(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// The rotary scaling `rope_scaling` describes.
    pub fn scaling(&self) -> anyhow::Result<Option<RopeScaling>> {
        let Some(entry) = &self.rope_scaling else { return Ok(None) };
        let kind = entry.get("rope_type").or_else(|| entry.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
        // Booleans (YaRN's `truncate`) are read as 1 or 0.
        let field = |name: &str| {
            let value = entry.get(name)?;
            value.as_f64().or_else(|| value.as_bool().map(|b| f64::from(u8::from(b))))
        };
        Ok(RopeScaling::from_hugging_face(kind, field, self.max_position_embeddings)?)
    }
}

thread_local! {
    /// Time spent inside this project's op calls on this thread since [`reset_op_time`].
    static OP_TIME: std::cell::Cell<std::time::Duration> = const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// Clears this thread's [`op_time`].
pub fn reset_op_time() {
    OP_TIME.with(|t| t.set(std::time::Duration::ZERO));
}

/// Time this thread spent inside this project's op calls (the [`Ops::Ours`] calls) since
/// [`reset_op_time`].
pub fn op_time() -> std::time::Duration {
    OP_TIME.with(std::cell::Cell::get)
}

/// Runs one of our op calls, adding its time to [`op_time`].
fn ours<T>(call: impl FnOnce() -> T) -> T {
    let start = std::time::Instant::now();
    let result = call();
    OP_TIME.with(|t| t.set(t.get() + start.elapsed()));
    result
}

/// Which ops run the norms, rotary and the gated activation.
#[derive(Clone, Copy)]
pub enum Ops<'r> {
    /// This project's, on candle tensors, through `registry`.
    Ours(&'r Registry),
    /// candle-nn's (`ops::rms_norm`, `rotary_emb::rope`, `silu` / `gelu`).
    CandleNn,
}

pub(crate) struct Layer {
    pub(crate) input_norm: Tensor,
    /// The norm of the MLP's input (`post_attention_layernorm`; Gemma 3's
    /// `pre_feedforward_layernorm`).
    pub(crate) pre_mlp_norm: Tensor,
    /// Gemma 3: the norms of the attention's and the MLP's outputs (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`), before each joins the residual stream.
    pub(crate) attn_out_norm: Option<Tensor>,
    pub(crate) mlp_out_norm: Option<Tensor>,
    /// Qwen3 and Gemma 3: the norms of each query and key head (`[head_dim]`).
    pub(crate) q_norm: Option<Tensor>,
    pub(crate) k_norm: Option<Tensor>,
    pub(crate) qkv: Linear,
    pub(crate) o: Linear,
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
}

/// The model's weights, shared by both op sets.
pub struct Model {
    pub(crate) config: Config,
    pub(crate) dtype: DType,
    pub(crate) embed: Embedding,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Linear,
    /// The rotary tables of the global layers.
    pub(crate) rope: Rope,
    /// Gemma 3: those of the sliding layers, when their base differs.
    pub(crate) local_rope: Option<Rope>,
    /// Where this project's fused norm and rotary round ([`Model::set_rounding`]).
    pub(crate) rounding: Rounding,
}

/// One rotary base's tables.
pub(crate) struct Rope {
    /// `[max_position, head_size]`: cos, then sin (this project's rotary).
    pub(crate) cos_sin: Tensor,
    /// `[max_position, head_size / 2]` each (candle-nn's rope).
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
}

impl Rope {
    fn new(
        config: &Config,
        dtype: DType,
        base: f64,
        scaling: Option<&RopeScaling>,
        positions: usize,
    ) -> anyhow::Result<Rope> {
        let head_size = config.head_size();
        let cache = rope_cache(vllm_ir::DType::F32, positions, head_size, base, scaling)?.into_candle()?;
        let cos_sin = cache.to_dtype(dtype)?;
        let (cos, sin) = (
            cos_sin.narrow(1, 0, head_size / 2)?.contiguous()?,
            cos_sin.narrow(1, head_size / 2, head_size / 2)?.contiguous()?,
        );
        Ok(Rope { cos_sin, cos, sin })
    }
}

/// Each layer's keys and values so far, `[1, kv_heads, seen, head_size]`.
#[derive(Default)]
pub struct Cache {
    pub(crate) layers: Vec<Option<(Tensor, Tensor)>>,
}

impl Cache {
    /// An empty cache for `model`.
    pub fn new(model: &Model) -> Cache {
        Cache { layers: vec![None; model.layers.len()] }
    }

    /// Tokens already seen.
    pub fn seen(&self) -> usize {
        self.layers.first().and_then(Option::as_ref).map_or(0, |(k, _)| k.dim(2).unwrap_or(0))
    }
}

/// A projection computing in f32 (candle's CPU matmul has no bf16; bf16 weights widen exactly).
fn linear(weight: Tensor) -> candle_core::Result<Linear> {
    Ok(Linear::new(weight.to_dtype(DType::F32)?, None))
}

/// `[gate; up]` stacked along the output dimension: one projection whose output is `[.., gate |
/// up]`, the layout `silu_and_mul` and `gelu_and_mul` take.
pub fn gate_up_weight(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    Tensor::cat(&[gate, up], 0)
}

impl Model {
    /// The model from Hugging Face-named `weights` (all of one float dtype).
    pub fn new(config: Config, weights: &HashMap<String, Tensor>) -> anyhow::Result<Model> {
        config.check_supported()?;
        let get = |name: &str| weights.get(name).cloned().ok_or_else(|| anyhow::anyhow!("missing weight `{name}`"));
        let embed_weight = get("model.embed_tokens.weight")?;
        let dtype = embed_weight.dtype();
        // Gemma's norm multiplies by (1 + w) in f32: kept as an f32 weight on the activations.
        let norm_weight = |name: &str| -> anyhow::Result<Tensor> {
            let w = get(name)?;
            Ok(if config.is_gemma() { (w.to_dtype(DType::F32)? + 1.0)? } else { w })
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let qkv = Tensor::cat(
                &[
                    get(&format!("{p}.self_attn.q_proj.weight"))?,
                    get(&format!("{p}.self_attn.k_proj.weight"))?,
                    get(&format!("{p}.self_attn.v_proj.weight"))?,
                ],
                0,
            )?;
            let gate_up =
                gate_up_weight(&get(&format!("{p}.mlp.gate_proj.weight"))?, &get(&format!("{p}.mlp.up_proj.weight"))?)?;
            let gemma3 = config.is_gemma3();
            let optional = |present: bool, name: &str| present.then(|| norm_weight(name)).transpose();
            let post_attention = norm_weight(&format!("{p}.post_attention_layernorm.weight"))?;
            let (attn_out_norm, pre_mlp_norm) = if gemma3 {
                (Some(post_attention), norm_weight(&format!("{p}.pre_feedforward_layernorm.weight"))?)
            } else {
                (None, post_attention)
            };
            layers.push(Layer {
                input_norm: norm_weight(&format!("{p}.input_layernorm.weight"))?,
                pre_mlp_norm,
                attn_out_norm,
                mlp_out_norm: optional(gemma3, &format!("{p}.post_feedforward_layernorm.weight"))?,
                q_norm: optional(config.has_qk_norm(), &format!("{p}.self_attn.q_norm.weight"))?,
                k_norm: optional(config.has_qk_norm(), &format!("{p}.self_attn.k_norm.weight"))?,
                qkv: linear(qkv)?,
                o: linear(get(&format!("{p}.self_attn.o_proj.weight"))?)?,
                gate_up: linear(gate_up)?,
                down: linear(get(&format!("{p}.mlp.down_proj.weight"))?)?,
            });
        }
        let lm_head = match weights.get("lm_head.weight") {
            Some(w) if !config.tie_word_embeddings => w.clone(),
            _ => embed_weight.clone(),
        };
        let scaling = config.scaling()?;
        let positions =
            scaling.map_or(config.max_position_embeddings, |s| s.max_position(config.max_position_embeddings));
        let rope = Rope::new(&config, dtype, config.rope_theta, scaling.as_ref(), positions)?;
        // Gemma 3's sliding layers rotate with their own base and no scaling.
        let local_rope = match config.rope_local_base_freq {
            Some(base) if config.is_gemma3() => {
                Some(Rope::new(&config, dtype, base, None, config.max_position_embeddings)?)
            }
            _ => None,
        };
        Ok(Model {
            embed: Embedding::new(embed_weight, config.hidden_size),
            norm: norm_weight("model.norm.weight")?,
            lm_head: linear(lm_head)?,
            layers,
            rope,
            local_rope,
            dtype,
            config,
            rounding: Rounding::Exact,
        })
    }

    /// Where this project's fused norm and rotary round: `Exact` (the default) or `Dtype`, as
    /// PyTorch and vLLM's kernels round (for checking bit parity with them).
    pub fn set_rounding(&mut self, rounding: Rounding) {
        self.rounding = rounding;
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The rotary tables of `layer`.
    pub(crate) fn rope(&self, layer: usize) -> &Rope {
        match &self.local_rope {
            Some(local) if self.config.window(layer).is_some() => local,
            _ => &self.rope,
        }
    }

    /// The logits of every token of `tokens`, which follow the cache's tokens.
    pub fn forward(&self, ops: Ops<'_>, tokens: &[u32], cache: &mut Cache) -> anyhow::Result<Tensor> {
        let device = Device::Cpu;
        let start = cache.seen();
        let t = tokens.len();
        let positions = Tensor::arange(start as u32, (start + t) as u32, &device)?;
        let mut h = self.embed_tokens(tokens)?;
        let mut residual: Option<Tensor> = None;
        // The norm of h before it joins the residual stream (Gemma 3's post-feed-forward norm).
        let mut out_norm: Option<&Tensor> = None;
        for (l, (layer, kv)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let normed = self.add_norm(ops, h, out_norm, &mut residual, &layer.input_norm)?;
            let attn = self.attention(ops, l, layer, &normed, &positions, kv)?;
            let normed = self.add_norm(ops, attn, layer.attn_out_norm.as_ref(), &mut residual, &layer.pre_mlp_norm)?;
            h = self.mlp(ops, layer, &normed)?;
            out_norm = layer.mlp_out_norm.as_ref();
        }
        let normed = self.add_norm(ops, h, out_norm, &mut residual, &self.norm)?;
        self.project(&self.lm_head, &normed)
    }

    /// The tokens' embeddings, `[T, hidden]` (Gemma's scaled by `sqrt(hidden)`).
    pub fn embed_tokens(&self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let h = self.embed.forward(&Tensor::new(tokens, &Device::Cpu)?)?;
        if self.config.is_gemma() { h * (self.config.hidden_size as f64).sqrt() } else { Ok(h) }
    }

    /// `x · wᵀ` in f32, back in the model's dtype.
    fn project(&self, linear: &Linear, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(linear.forward(&x.to_dtype(DType::F32)?)?.to_dtype(self.dtype)?)
    }

    /// `residual ← h + residual` (the first time: `residual ← h`), then the norm of it; with
    /// `out_norm`, h is normalized by it first (Gemma 3's sandwich: one fused call).
    fn add_norm(
        &self,
        ops: Ops<'_>,
        h: Tensor,
        out_norm: Option<&Tensor>,
        residual: &mut Option<Tensor>,
        w: &Tensor,
    ) -> anyhow::Result<Tensor> {
        let eps = self.config.rms_norm_eps;
        match (ops, residual.take()) {
            (Ops::Ours(registry), Some(r)) if out_norm.is_some() => {
                // In place: r holds the sum of h's norm and r, h the norm of the sum.
                let sandwich = |x: Tensor, r: Tensor| {
                    fused_sandwich_rms_norm::call_maybe_inplace(
                        &candle_ops::Candle(registry),
                        x,
                        r,
                        out_norm,
                        Some(w),
                        eps,
                        self.rounding,
                    )
                };
                let (normed, sum) = ours(|| sandwich(h, r))?;
                *residual = Some(sum);
                Ok(normed)
            }
            (Ops::Ours(registry), None) => {
                let h = match out_norm {
                    Some(p) => ours(|| candle_ops::rms_norm(registry, &h, Some(p), eps))?,
                    None => h,
                };
                let normed = ours(|| candle_ops::rms_norm(registry, &h, Some(w), eps))?;
                *residual = Some(h);
                Ok(normed)
            }
            (Ops::Ours(registry), Some(r)) => {
                // In place: r holds the sum, h its norm.
                ours(|| candle_ops::fused_add_rms_norm(registry, &h, &r, Some(w), eps, self.rounding))?;
                *residual = Some(r);
                Ok(h)
            }
            (Ops::CandleNn, previous) => {
                let h = match out_norm {
                    Some(p) => self.candle_nn_norm(&h, p)?,
                    None => h,
                };
                let sum = match previous {
                    None => h,
                    Some(r) => (h + r)?,
                };
                let normed = self.candle_nn_norm(&sum, w)?;
                *residual = Some(sum);
                Ok(normed)
            }
        }
    }

    /// candle-nn's RMS norm of `x` by `w` (Gemma's f32 `1 + w`: in f32, then back).
    fn candle_nn_norm(&self, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        if w.dtype() == x.dtype() {
            candle_nn::ops::rms_norm(x, w, eps)
        } else {
            candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?, w, eps)?.to_dtype(x.dtype())
        }
    }

    fn attention(
        &self,
        ops: Ops<'_>,
        index: usize,
        layer: &Layer,
        x: &Tensor,
        positions: &Tensor,
        kv: &mut Option<(Tensor, Tensor)>,
    ) -> anyhow::Result<Tensor> {
        let c = &self.config;
        let (heads, kv_heads, d) = (c.num_attention_heads, c.kv_heads(), c.head_size());
        let t = x.dim(0)?;
        let qkv = self.project(&layer.qkv, x)?;
        let q = qkv.narrow(1, 0, heads * d)?;
        let k = qkv.narrow(1, heads * d, kv_heads * d)?;
        let v = qkv.narrow(1, (heads + kv_heads) * d, kv_heads * d)?;
        let to_heads = |x: &Tensor, n: usize| x.reshape((1, t, n, d))?.transpose(1, 2)?.contiguous();
        let rope = self.rope(index);
        let eps = self.config.rms_norm_eps;
        // Qwen3 and Gemma 3: each head of q and k normalized (fresh tensors, `[t, n * d]`).
        let head_norm = |x: Tensor, n: usize, w: Option<&Tensor>| -> anyhow::Result<Tensor> {
            let Some(w) = w else { return Ok(x) };
            let heads = x.reshape((t, n, d))?;
            let normed = match ops {
                Ops::Ours(registry) => ours(|| candle_ops::rms_norm(registry, &heads, Some(w), eps))?,
                Ops::CandleNn => self.candle_nn_norm(&heads, w)?,
            };
            Ok(normed.reshape((t, n * d))?)
        };
        let (q, k) = match (ops, &layer.q_norm, &layer.k_norm) {
            (Ops::Ours(registry), Some(q_norm), Some(k_norm)) => {
                // Qwen3 and Gemma 3 with this project's ops: each head normalized and rotated by one
                // op, in place on the column slices of qkv (a call per slice: an in-place call
                // writes one activation per storage).
                let ops = candle_ops::Candle(registry);
                // The op's positions are i64 (candle's are u32 here).
                let positions = &positions.to_dtype(DType::I64)?;
                for (x, w) in [(&q, q_norm), (&k, k_norm)] {
                    ours(|| {
                        fused_qk_norm_rope::call_maybe_inplace(
                            &ops,
                            positions,
                            x.clone(),
                            None,
                            w,
                            None,
                            &rope.cos_sin,
                            eps,
                            d as i64,
                            d as i64,
                            true,
                            self.rounding,
                        )
                    })?;
                }
                (to_heads(&q, heads)?, to_heads(&k, kv_heads)?)
            }
            (Ops::Ours(registry), ..) => {
                let q = head_norm(q, heads, layer.q_norm.as_ref())?;
                let k = head_norm(k, kv_heads, layer.k_norm.as_ref())?;
                // In place on the column slices of qkv.
                ours(|| {
                    candle_ops::rotary_embedding(
                        registry,
                        positions,
                        &q,
                        Some(&k),
                        &rope.cos_sin,
                        d,
                        d,
                        true,
                        self.rounding,
                    )
                })?;
                (to_heads(&q, heads)?, to_heads(&k, kv_heads)?)
            }
            (Ops::CandleNn, ..) => {
                let q = head_norm(q, heads, layer.q_norm.as_ref())?;
                let k = head_norm(k, kv_heads, layer.k_norm.as_ref())?;
                let start = positions.to_vec1::<u32>()?[0] as usize;
                let (cos, sin) = (rope.cos.narrow(0, start, t)?, rope.sin.narrow(0, start, t)?);
                (
                    candle_nn::rotary_emb::rope(&to_heads(&q, heads)?, &cos, &sin)?,
                    candle_nn::rotary_emb::rope(&to_heads(&k, kv_heads)?, &cos, &sin)?,
                )
            }
        };
        let v = to_heads(&v, kv_heads)?;
        let out = attend(c, self.dtype, index, &q, &k, &v, kv)?;
        self.project(&layer.o, &out)
    }

    fn mlp(&self, ops: Ops<'_>, layer: &Layer, x: &Tensor) -> anyhow::Result<Tensor> {
        let gate_up = self.project(&layer.gate_up, x)?;
        let gemma = self.config.is_gemma();
        let activated = match ops {
            Ops::Ours(registry) if gemma => ours(|| candle_ops::gelu_and_mul(registry, &gate_up, Approximate::Tanh))?,
            Ops::Ours(registry) => ours(|| candle_ops::silu_and_mul(registry, &gate_up))?,
            Ops::CandleNn => {
                let i = gate_up.dim(D::Minus1)? / 2;
                let (gate, up) = (gate_up.narrow(1, 0, i)?, gate_up.narrow(1, i, i)?);
                let gate = if gemma { gate.gelu()? } else { candle_nn::ops::silu(&gate)? };
                (gate * up)?
            }
        };
        self.project(&layer.down, &activated)
    }
}

/// Causal grouped-query attention of `layer` for this step's rotated queries, keys and values
/// (`[1, heads, t, d]`, `[1, kv_heads, t, d]` twice) over the cache's keys and values and
/// themselves, which join the cache (a sliding layer's queries see the last
/// [`Config::window`] keys); `[t, heads * d]` in `dtype`. Candle's, shared by every path of the
/// example.
pub fn attend(
    c: &Config,
    dtype: DType,
    layer: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv: &mut Option<(Tensor, Tensor)>,
) -> candle_core::Result<Tensor> {
    let (heads, kv_heads, d) = (c.num_attention_heads, c.kv_heads(), c.head_size());
    let t = q.dim(2)?;
    let (k, v) = match kv.take() {
        None => (k.clone(), v.clone()),
        Some((pk, pv)) => (Tensor::cat(&[&pk, k], 2)?, Tensor::cat(&[&pv, v], 2)?),
    };
    *kv = Some((k.clone(), v.clone()));
    let seen = k.dim(2)?;
    // Grouped-query attention: each key/value head serves heads / kv_heads query heads.
    let repeat = heads / kv_heads;
    let expand = |x: &Tensor| -> candle_core::Result<Tensor> {
        if repeat == 1 {
            return Ok(x.clone());
        }
        x.unsqueeze(2)?.expand((1, kv_heads, repeat, seen, d))?.reshape((1, heads, seen, d))
    };
    let (k, v) = (expand(&k)?, expand(&v)?);
    let scale = c.attention_scale();
    let scores = (q.to_dtype(DType::F32)?.matmul(&k.to_dtype(DType::F32)?.t()?)? * scale)?;
    let window = c.window(layer);
    let scores = if t > 1 || window.is_some_and(|w| seen > w) {
        // Causal: token i of this step sees the cache and tokens up to itself (in a sliding layer,
        // the last `window` of them).
        let offset = seen - t;
        let visible = move |i: usize, j: usize| j <= offset + i && window.is_none_or(|w| offset + i - j < w);
        let mask: Vec<f32> =
            (0..t).flat_map(|i| (0..seen).map(move |j| if visible(i, j) { 0.0 } else { f32::NEG_INFINITY })).collect();
        scores.broadcast_add(&Tensor::from_vec(mask, (t, seen), &Device::Cpu)?)?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    let out = probs.matmul(&v.to_dtype(DType::F32)?.contiguous()?)?.to_dtype(dtype)?;
    out.transpose(1, 2)?.reshape((t, heads * d))
}

/// Hugging Face-named random weights for `config` (a tiny model for tests and demos: no
/// download), reproducible from `seed`.
pub fn random_weights(config: &Config, dtype: DType, seed: u64) -> candle_core::Result<HashMap<String, Tensor>> {
    let device = Device::Cpu;
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut tensor = |shape: &[usize], scale: f64| -> candle_core::Result<Tensor> {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                // Uniform in [-scale, scale).
                ((((state >> 40) as f64) / (1u64 << 24) as f64) * 2.0 - 1.0) as f32 * scale as f32
            })
            .collect();
        Tensor::from_vec(values, shape, &device)?.to_dtype(dtype)
    };
    let (h, i, d) = (config.hidden_size, config.intermediate_size, config.head_size());
    let (heads, kv_heads) = (config.num_attention_heads, config.kv_heads());
    let mut weights = HashMap::new();
    let scale = 1.0 / (h as f64).sqrt();
    weights.insert("model.embed_tokens.weight".to_owned(), tensor(&[config.vocab_size, h], 1.0)?);
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}");
        // Norm weights near 1 (Gemma's near 0: it adds the 1).
        let norm_center = if config.is_gemma() { 0.0 } else { 1.0 };
        for name in ["input_layernorm", "post_attention_layernorm"] {
            weights.insert(format!("{p}.{name}.weight"), (tensor(&[h], 0.1)? + norm_center)?);
        }
        if config.is_gemma3() {
            for name in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                weights.insert(format!("{p}.{name}.weight"), (tensor(&[h], 0.1)? + norm_center)?);
            }
        }
        weights.insert(format!("{p}.self_attn.q_proj.weight"), tensor(&[heads * d, h], scale)?);
        weights.insert(format!("{p}.self_attn.k_proj.weight"), tensor(&[kv_heads * d, h], scale)?);
        weights.insert(format!("{p}.self_attn.v_proj.weight"), tensor(&[kv_heads * d, h], scale)?);
        weights.insert(format!("{p}.self_attn.o_proj.weight"), tensor(&[h, heads * d], scale)?);
        if config.has_qk_norm() {
            for name in ["q_norm", "k_norm"] {
                weights.insert(format!("{p}.self_attn.{name}.weight"), (tensor(&[d], 0.1)? + norm_center)?);
            }
        }
        weights.insert(format!("{p}.mlp.gate_proj.weight"), tensor(&[i, h], scale)?);
        weights.insert(format!("{p}.mlp.up_proj.weight"), tensor(&[i, h], scale)?);
        weights.insert(format!("{p}.mlp.down_proj.weight"), tensor(&[h, i], 1.0 / (i as f64).sqrt())?);
    }
    let norm_center = if config.is_gemma() { 0.0 } else { 1.0 };
    weights.insert("model.norm.weight".to_owned(), (tensor(&[h], 0.1)? + norm_center)?);
    if !config.tie_word_embeddings {
        weights.insert("lm_head.weight".to_owned(), tensor(&[config.vocab_size, h], scale)?);
    }
    Ok(weights)
}

/// A tiny configuration of the architecture (`llama`, `gemma`, `qwen3` or `gemma3_text`). Gemma
/// 3's slides every other layer over 8 keys (the references' 20 tokens see the window move), with
/// another rotary base than its global layers, and scales its attention by a
/// `query_pre_attn_scalar` other than its head size.
pub fn tiny_config(model_type: &str) -> Config {
    let gemma = model_type.starts_with("gemma");
    let gemma3 = model_type == "gemma3_text";
    Config {
        vocab_size: 256,
        hidden_size: 128,
        intermediate_size: 256,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(if gemma { 64 } else { 32 }),
        rms_norm_eps: 1e-6,
        rope_theta: if gemma3 { 1_000_000.0 } else { 10000.0 },
        max_position_embeddings: 1024,
        tie_word_embeddings: gemma,
        model_type: model_type.to_owned(),
        rope_scaling: None,
        query_pre_attn_scalar: gemma3.then_some(32.0),
        sliding_window: gemma3.then_some(8),
        sliding_window_pattern: gemma3.then_some(2),
        rope_local_base_freq: gemma3.then_some(10000.0),
    }
}
