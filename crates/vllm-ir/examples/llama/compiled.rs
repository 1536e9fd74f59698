//! The decoder traced into a graph and compiled, with the engine's matmuls and attention inside it.
//!
//! How an engine traces a model whose matmuls and attention are its own:
//!
//! - **Engine ops, declared once**: `llama_linear(x, weight)` (candle's matmul in f32, rounded to
//!   x's dtype) and `llama_attention(q, k, v, layer)` (candle's causal attention over the KV cache)
//!   are declared with `define_op!` and registered as the `engine` provider, first in their priority
//!   lists. To the passes they are opaque functional calls: nothing is fused across them, and the
//!   tensors around them are still written in place where the passes prove it safe.
//! - **State stays in the engine**: the KV cache is not a graph value. The attention provider is a
//!   closure holding [`AttentionState`]; [`Compiled::forward`] puts the step's cache there for the
//!   run and takes it back after, and `layer` (a constant in the graph) picks the layer's entry, as
//!   vLLM's attention op finds its layer's cache by name. One decode graph then serves every step.
//! - **Weights are graph parameters without a copy**: each candle weight is viewed once
//!   ([`vllm_ir::Tensor::from_candle_shared`]) and passed to the context with `ctx.parameter`; every
//!   run hands the graph those views, and `llama_linear` gets the candle tensor itself back with
//!   [`vllm_ir::Tensor::to_candle`]. An activation crossing into candle is copied (candle's CPU
//!   storage owns a `Vec`), as is candle's result crossing back.
//!
//! The same generic code ([`decoder`]) runs eagerly through [`vllm_ir::EagerContext`] and through
//! the tracer; the compiled graph (the standard pipeline, then the interpreter) computes the eager
//! bits.

// Shared by the example and its test (`tests/llama.rs`), each of which uses its own part.
#![allow(unreachable_pub, dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Module, Tensor as CandleTensor};
use candle_nn::Linear;
use vllm_ir::graph::{Builtin, Graph, InterpOptions, InterpStats, NodeKind, Tracer, interpret};
use vllm_ir::op::gelu_and_mul::{self, Approximate};
use vllm_ir::op::{
    ArgMeta, InputSpec, MetaError, OutputMetas, Value, fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul,
};
use vllm_ir::passes::{PassContext, PassReport, Pipeline, Snapshots};
use vllm_ir::{
    CallError, EagerContext, ExecutionContext, ExecutionContextExt, ImplSpec, KernelError, Registry, Tensor, TensorMeta,
};

use crate::model::{Cache, Config, Model, attend};

/// The projection as an engine op.
pub mod linear {
    use super::*;

    vllm_ir::define_op! {
        /// `llama_linear(x, weight) -> y`: `x · weightᵀ` computed in f32 by candle, rounded to
        /// x's dtype.
        op llama_linear {
            def: LLAMA_LINEAR,
            args: LinearArgs,
            params: (
                /// Activations `[T, K]`.
                x: Tensor,
                /// `[N, K]`, f32.
                weight: Tensor,
            ),
            outputs: Tensor,
            inplace: false,
            native: super::linear,
            meta: super::linear_meta,
            generate: super::no_generated_inputs,
            tolerances: &[],
            description: "the engine's projection (candle's matmul)",
        }
    }
}

/// Attention as an engine op.
pub mod attention {
    use super::*;

    vllm_ir::define_op! {
        /// `llama_attention(q, k, v, layer) -> out`: causal grouped-query attention of this step's
        /// rotated queries and keys over layer `layer`'s KV cache, which the keys and values join.
        /// Stateful: only the engine's provider runs it.
        op llama_attention {
            def: LLAMA_ATTENTION,
            args: AttentionArgs,
            params: (
                /// `[T, heads · d]`, rotated.
                q: Tensor,
                /// `[T, kv_heads · d]`, rotated.
                k: Tensor,
                /// `[T, kv_heads · d]`.
                v: Tensor,
                /// Which layer's cache.
                layer: i64,
            ),
            outputs: Tensor,
            inplace: false,
            native: super::attention_outside_engine,
            meta: super::attention_meta,
            generate: super::no_generated_inputs,
            tolerances: &[],
            description: "the engine's attention over its KV cache (candle)",
        }
    }
}

fn engine_error(error: impl std::fmt::Display) -> KernelError {
    KernelError::Engine { library: "candle".to_owned(), message: error.to_string() }
}

/// `x · weightᵀ`, as the eager candle path computes it ([`Model`]'s projections).
fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor, KernelError> {
    let x = x.to_candle().map_err(engine_error)?;
    let dtype = x.dtype();
    let weight = weight.to_candle().map_err(engine_error)?;
    let y = Linear::new(weight, None)
        .forward(&x.to_dtype(DType::F32).map_err(engine_error)?)
        .and_then(|y| y.to_dtype(dtype))
        .map_err(engine_error)?;
    Tensor::from_candle(&y).map_err(engine_error)
}

fn linear_meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<OutputMetas, MetaError> {
    let op = def.name;
    let view = linear::LinearArgs::from_meta(args).ok_or(MetaError::Kind { op, param: "x" })?;
    let (x, w) = (view.x, view.weight);
    if x.shape().len() != 2 {
        return Err(MetaError::Rank { op, param: "x", expected: "rank 2", shape: x.shape().to_vec() });
    }
    if w.shape().len() != 2 || w.shape()[1] != x.shape()[1] {
        return Err(MetaError::Shape {
            op,
            param: "weight",
            shape: w.shape().to_vec(),
            expected: "must be [N, K] for x of [T, K]",
            other: "x",
            other_shape: x.shape().to_vec(),
        });
    }
    if w.dtype != vllm_ir::DType::F32 {
        return Err(MetaError::DType { op, param: "weight", dtype: w.dtype, expected: "f32" });
    }
    Ok(vllm_ir::op::smallvec![TensorMeta::compact(x.dtype, &[x.shape()[0], w.shape()[0]])])
}

fn attention_outside_engine(_: &Tensor, _: &Tensor, _: &Tensor, _: i64) -> Result<Tensor, KernelError> {
    Err(KernelError::Engine {
        library: "llama".to_owned(),
        message: "llama_attention keeps the KV cache in the engine: only its `engine` provider runs it".to_owned(),
    })
}

fn attention_meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<OutputMetas, MetaError> {
    let op = def.name;
    let view = attention::AttentionArgs::from_meta(args).ok_or(MetaError::Kind { op, param: "q" })?;
    for (param, t) in [("q", view.q), ("k", view.k), ("v", view.v)] {
        if t.shape().len() != 2 {
            return Err(MetaError::Rank { op, param, expected: "rank 2", shape: t.shape().to_vec() });
        }
    }
    if view.k.shape() != view.v.shape() || view.k.shape()[0] != view.q.shape()[0] {
        return Err(MetaError::Shape {
            op,
            param: "k",
            shape: view.k.shape().to_vec(),
            expected: "must have q's tokens and v's shape",
            other: "q",
            other_shape: view.q.shape().to_vec(),
        });
    }
    Ok(vllm_ir::op::smallvec![TensorMeta::compact(view.q.dtype, view.q.shape())])
}

/// The engine ops are not in the kernel harness (their kernels are candle's): no generated inputs.
fn no_generated_inputs(_: &InputSpec) -> Result<Vec<Value>, vllm_ir::TensorError> {
    Ok(Vec::new())
}

/// What the attention provider reads: the model's shape and the cache of the forward in flight.
pub struct AttentionState {
    config: Config,
    dtype: DType,
    cache: Mutex<Option<Cache>>,
}

impl AttentionState {
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, layer: i64) -> Result<Tensor, KernelError> {
        let c = &self.config;
        let mut slot = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = slot.as_mut().ok_or_else(|| KernelError::Engine {
            library: "llama".to_owned(),
            message: "no KV cache is installed (run the model through `Compiled`)".to_owned(),
        })?;
        let kv = usize::try_from(layer).ok().and_then(|l| cache.layers.get_mut(l)).ok_or_else(|| {
            KernelError::InvalidArguments { reason: format!("layer {layer} is not one of the model's") }
        })?;
        let t = q.shape()[0];
        let to_heads = |x: &Tensor, n: usize| -> candle_core::Result<CandleTensor> {
            let x = x.to_candle().map_err(candle_core::Error::wrap)?;
            x.reshape((1, t, n, c.head_size()))?.transpose(1, 2)?.contiguous()
        };
        let out = (|| -> candle_core::Result<CandleTensor> {
            let (q, k, v) =
                (to_heads(q, c.num_attention_heads)?, to_heads(k, c.kv_heads())?, to_heads(v, c.kv_heads())?);
            attend(c, self.dtype, layer as usize, &q, &k, &v, kv)
        })()
        .map_err(engine_error)?;
        Tensor::from_candle(&out).map_err(engine_error)
    }
}

/// The registry of the platform's providers with the two engine ops defined and the engine's
/// providers first; the attention provider reads `state`.
pub fn engine_registry(state: &Arc<AttentionState>) -> anyhow::Result<Registry> {
    let builder = vllm_ir::RegistryBuilder::new()?;
    let registry = builder.registry();
    registry.define_op(&linear::LLAMA_LINEAR)?;
    registry.define_op(&attention::LLAMA_ATTENTION)?;
    linear::register(registry, ImplSpec::new("engine"), linear)?;
    let state = Arc::clone(state);
    attention::register(registry, ImplSpec::new("engine"), move |q, k, v, layer| state.attention(q, k, v, layer))?;
    let registry = builder.build()?;
    registry.set_default("llama_linear", &["engine"])?;
    registry.set_default("llama_attention", &["engine"])?;
    Ok(registry)
}

/// The model's weights as tensors viewing candle's memory (no copy), by graph parameter name.
pub struct Weights {
    /// Per layer: input norm, qkv, o, the MLP's input norm, gate_up, down.
    pub(crate) layers: Vec<[(String, Tensor); 6]>,
    /// Per layer, the norms some architectures add ([`LayerNorms`]).
    pub(crate) norms: Vec<LayerNorms>,
    pub(crate) norm: (String, Tensor),
    pub(crate) lm_head: (String, Tensor),
    pub(crate) cos_sin: (String, Tensor),
    /// Gemma 3's sliding layers' rotary table, when its base differs.
    pub(crate) cos_sin_local: Option<(String, Tensor)>,
}

/// A layer's optional norm weights: q and k heads (Qwen3, Gemma 3), the attention's and the MLP's
/// outputs (Gemma 3).
pub struct LayerNorms {
    pub(crate) q: Option<(String, Tensor)>,
    pub(crate) k: Option<(String, Tensor)>,
    pub(crate) attn_out: Option<(String, Tensor)>,
    pub(crate) mlp_out: Option<(String, Tensor)>,
}

impl Weights {
    /// Views of `model`'s candle weights.
    pub fn of(model: &Model) -> anyhow::Result<Weights> {
        // SAFETY: the model never writes its weights in place (no candle in-place op reaches them),
        // so the read-only views never see a write.
        let view = |name: String, t: &CandleTensor| -> anyhow::Result<(String, Tensor)> {
            Ok((name, unsafe { Tensor::from_candle_shared(t)? }))
        };
        let layers = model
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| -> anyhow::Result<[(String, Tensor); 6]> {
                Ok([
                    view(format!("layers.{i}.input_norm"), &l.input_norm)?,
                    view(format!("layers.{i}.qkv"), l.qkv.weight())?,
                    view(format!("layers.{i}.o"), l.o.weight())?,
                    view(format!("layers.{i}.pre_mlp_norm"), &l.pre_mlp_norm)?,
                    view(format!("layers.{i}.gate_up"), l.gate_up.weight())?,
                    view(format!("layers.{i}.down"), l.down.weight())?,
                ])
            })
            .collect::<anyhow::Result<_>>()?;
        let norms = model
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| -> anyhow::Result<LayerNorms> {
                let optional = |name: &str, t: &Option<CandleTensor>| {
                    t.as_ref().map(|t| view(format!("layers.{i}.{name}"), t)).transpose()
                };
                Ok(LayerNorms {
                    q: optional("q_norm", &l.q_norm)?,
                    k: optional("k_norm", &l.k_norm)?,
                    attn_out: optional("attn_out_norm", &l.attn_out_norm)?,
                    mlp_out: optional("mlp_out_norm", &l.mlp_out_norm)?,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Weights {
            layers,
            norms,
            norm: view("norm".to_owned(), &model.norm)?,
            lm_head: view("lm_head".to_owned(), model.lm_head.weight())?,
            cos_sin: view("cos_sin".to_owned(), &model.rope.cos_sin)?,
            cos_sin_local: model
                .local_rope
                .as_ref()
                .map(|r| view("cos_sin_local".to_owned(), &r.cos_sin))
                .transpose()?,
        })
    }
}

/// The decoder from the embedded tokens `h` (`[T, hidden]`) and their `positions` (i64) to the
/// logits, written once against the execution context: eager or traced.
pub fn decoder<C: ExecutionContext>(
    ctx: &C,
    model: &Model,
    weights: &Weights,
    h: C::Tensor,
    positions: &C::Tensor,
) -> Result<C::Tensor, CallError> {
    let c = &model.config;
    let (eps, rounding) = (c.rms_norm_eps, model.rounding);
    let (heads, kv_heads, d) = (c.num_attention_heads, c.kv_heads(), c.head_size());
    let param = |(name, t): &(String, Tensor)| ctx.parameter(name, t);
    let cos_sin = param(&weights.cos_sin)?;
    let cos_sin_local = weights.cos_sin_local.as_ref().map(param).transpose()?;
    let optional = |w: &Option<(String, Tensor)>| w.as_ref().map(param).transpose();
    let mut h = h;
    let mut residual: Option<C::Tensor> = None;
    // `residual ← h + residual` (the first time: `residual ← h`), then its norm; in place. With
    // `out_norm`, h is normalized by it first (Gemma 3's sandwich, unfused: the passes fuse it).
    let add_norm = |h: C::Tensor,
                    out_norm: Option<&C::Tensor>,
                    residual: &mut Option<C::Tensor>,
                    w: &C::Tensor|
     -> Result<C::Tensor, CallError> {
        let h = match out_norm {
            Some(p) => rms_norm::call(ctx, &h, Some(p), eps, None)?,
            None => h,
        };
        match residual.take() {
            None => {
                let normed = rms_norm::call(ctx, &h, Some(w), eps, None)?;
                *residual = Some(h);
                Ok(normed)
            }
            Some(r) => {
                let (normed, sum) = fused_add_rms_norm::call_maybe_inplace(ctx, h, r, Some(w), eps, None, rounding)?;
                *residual = Some(sum);
                Ok(normed)
            }
        }
    };
    let mut out_norm: Option<C::Tensor> = None;
    for (layer, (w, norms)) in weights.layers.iter().zip(&weights.norms).enumerate() {
        let [input_norm, qkv_w, o_w, pre_mlp_norm, gate_up_w, down_w] = w;
        let normed = add_norm(h, out_norm.as_ref(), &mut residual, &param(input_norm)?)?;
        let qkv = linear::call(ctx, &normed, &param(qkv_w)?)?;
        let t = ctx.meta(&qkv).shape()[0];
        let q = ctx.slice(&qkv, 1, 0, heads * d)?;
        let k = ctx.slice(&qkv, 1, heads * d, (heads + kv_heads) * d)?;
        let v = ctx.slice(&qkv, 1, (heads + kv_heads) * d, (heads + 2 * kv_heads) * d)?;
        drop(qkv);
        // Qwen3 and Gemma 3: each head of q and k normalized (a view of the heads; fresh results).
        let head_norm = |x: C::Tensor, n: usize, w: Option<C::Tensor>| -> Result<C::Tensor, CallError> {
            let Some(w) = w else { return Ok(x) };
            let normed = rms_norm::call(ctx, &ctx.reshape(&x, &[t, n, d])?, Some(&w), eps, None)?;
            ctx.reshape(&normed, &[t, n * d])
        };
        let q = head_norm(q, heads, optional(&norms.q)?)?;
        let k = head_norm(k, kv_heads, optional(&norms.k)?)?;
        let table = match &cos_sin_local {
            Some(local) if c.window(layer).is_some() => local,
            _ => &cos_sin,
        };
        let (q, k) = rotary_embedding::call_maybe_inplace(
            ctx,
            positions,
            q,
            Some(k),
            table,
            d as i64,
            d as i64,
            true,
            rounding,
        )?;
        let k = k.expect("a key was given");
        let out = attention::call(ctx, &q, &k, &v, layer as i64)?;
        let attn = linear::call(ctx, &out, &param(o_w)?)?;
        let attn_out_norm = optional(&norms.attn_out)?;
        let normed = add_norm(attn, attn_out_norm.as_ref(), &mut residual, &param(pre_mlp_norm)?)?;
        let gate_up = linear::call(ctx, &normed, &param(gate_up_w)?)?;
        let activated = if c.is_gemma() {
            gelu_and_mul::call(ctx, &gate_up, Approximate::Tanh)?
        } else {
            silu_and_mul::call(ctx, &gate_up)?
        };
        h = linear::call(ctx, &activated, &param(down_w)?)?;
        out_norm = optional(&norms.mlp_out)?;
    }
    let normed = add_norm(h, out_norm.as_ref(), &mut residual, &param(&weights.norm)?)?;
    linear::call(ctx, &normed, &param(&weights.lm_head)?)
}

/// One compiled graph (a number of tokens) and the parameters it runs with.
struct Program {
    graph: Graph,
    parameters: Vec<(String, Tensor)>,
}

/// What the compiled runs did so far.
#[derive(Clone, Debug, Default)]
pub struct CompiledStats {
    /// Graphs traced and compiled (one per distinct number of tokens).
    pub graphs: usize,
    /// Copies lowering inserted in front of in-place kernels, over every compile.
    pub copies_inserted: usize,
    /// `clone` and `contiguous` nodes left after the pipeline, over every compile.
    pub copies_left: usize,
    /// `clone`/`contiguous` nodes run, and copies the interpreter made to protect a value, over
    /// every run.
    pub copies_run: usize,
    /// Calls per (op, provider), over every run.
    pub providers: HashMap<(String, &'static str), usize>,
}

/// The model compiled: a graph per number of tokens, traced on first use.
pub struct Compiled<'m> {
    model: &'m Model,
    registry: Registry,
    state: Arc<AttentionState>,
    weights: Weights,
    programs: HashMap<usize, Program>,
    stats: CompiledStats,
}

impl<'m> Compiled<'m> {
    /// `model` with the engine's registry; nothing traced yet.
    pub fn new(model: &'m Model) -> anyhow::Result<Compiled<'m>> {
        let state =
            Arc::new(AttentionState { config: model.config.clone(), dtype: model.dtype, cache: Mutex::new(None) });
        Ok(Compiled {
            registry: engine_registry(&state)?,
            state,
            weights: Weights::of(model)?,
            model,
            programs: HashMap::new(),
            stats: CompiledStats::default(),
        })
    }

    /// The registry the graphs run through.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// What the compiled runs did so far.
    pub fn stats(&self) -> &CompiledStats {
        &self.stats
    }

    /// The graph for `tokens` tokens, when one was compiled.
    pub fn graph(&self, tokens: usize) -> Option<&Graph> {
        self.programs.get(&tokens).map(|p| &p.graph)
    }

    /// The logits of `tokens` after the cache's tokens, eagerly through the execution context (the
    /// compiled graph's reference).
    pub fn forward_eager(&self, tokens: &[u32], cache: &mut Cache) -> anyhow::Result<CandleTensor> {
        let (h, positions) = self.inputs(tokens, cache)?;
        let ctx = EagerContext::new(&self.registry);
        let logits = self.with_cache(cache, || decoder(&ctx, self.model, &self.weights, h, &positions))?;
        Ok(logits.into_candle()?)
    }

    /// The logits of `tokens` after the cache's tokens, through the compiled graph for their count
    /// (traced and compiled on first use).
    pub fn forward(&mut self, tokens: &[u32], cache: &mut Cache) -> anyhow::Result<CandleTensor> {
        let (h, positions) = self.inputs(tokens, cache)?;
        if !self.programs.contains_key(&tokens.len()) {
            let program = self.compile(&h, &positions)?;
            self.programs.insert(tokens.len(), program);
        }
        let program = &self.programs[&tokens.len()];
        let mut inputs = vec![("h".to_owned(), h), ("positions".to_owned(), positions)];
        inputs.extend(program.parameters.iter().cloned());
        let run =
            self.with_cache(cache, || interpret(&program.graph, &self.registry, inputs, InterpOptions::checked()))?;
        self.account(&run.stats);
        let logits = run.outputs.into_iter().next().expect("the graph has one output");
        Ok(logits.into_candle()?)
    }

    /// The embedded tokens and their positions, as the candle path computes them.
    fn inputs(&self, tokens: &[u32], cache: &Cache) -> anyhow::Result<(Tensor, Tensor)> {
        let start = cache.seen();
        let h = self.model.embed_tokens(tokens)?;
        let positions: Vec<i64> = (start..start + tokens.len()).map(|p| p as i64).collect();
        Ok((Tensor::from_candle(&h)?, Tensor::from_vec(&[tokens.len()], positions)?))
    }

    fn compile(&mut self, h: &Tensor, positions: &Tensor) -> anyhow::Result<Program> {
        let tracer = Tracer::new(&self.registry, format!("decoder_{}", h.shape()[0]));
        let th = tracer.input("h", h.meta().clone());
        let tp = tracer.input("positions", positions.meta().clone());
        let logits = decoder(&tracer, self.model, &self.weights, th, &tp)?;
        let traced = tracer.finish(&[logits]);
        let mut graph = traced.graph;
        let report = Pipeline::standard().run(&mut graph, &PassContext::new(&self.registry), None, Snapshots::Skip)?;
        self.stats.graphs += 1;
        self.stats.copies_inserted += report
            .runs
            .iter()
            .filter_map(|r| match &r.report {
                PassReport::Lower(lowered) => Some(lowered.clones_inserted),
                _ => None,
            })
            .sum::<usize>();
        self.stats.copies_left += count_copies(&graph);
        Ok(Program { graph, parameters: traced.parameters })
    }

    fn account(&mut self, stats: &InterpStats) {
        self.stats.copies_run += stats.clones_executed + stats.defensive_copies;
        for (_, op, provider) in &stats.providers {
            *self.stats.providers.entry((op.clone(), *provider)).or_default() += 1;
        }
    }

    /// Runs `run` with `cache` in the attention provider's slot, and takes it back after.
    fn with_cache<T>(&self, cache: &mut Cache, run: impl FnOnce() -> T) -> T {
        let slot = || self.state.cache.lock().unwrap_or_else(PoisonError::into_inner);
        *slot() = Some(std::mem::take(cache));
        let result = run();
        if let Some(taken) = slot().take() {
            *cache = taken;
        }
        result
    }
}

/// `clone` and `contiguous` nodes in `graph`.
fn count_copies(graph: &Graph) -> usize {
    graph
        .order()
        .iter()
        .filter(|&&n| matches!(graph.node(n).kind, NodeKind::Builtin { op: Builtin::Clone | Builtin::Contiguous, .. }))
        .count()
}
