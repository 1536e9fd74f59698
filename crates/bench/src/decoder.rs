//! The decoder the passes and memory benchmarks trace: a first `rms_norm`, then L layers of
//! `scale` (a stand-in for attention and the MLP) and `forward_residual` (a fused add + norm), the
//! shape of a transformer's norm traffic. One generic forward serves eager runs and the tracer.

use ir_core::{DType, ExecutionContext, ExecutionContextExt, Registry, Tensor, TensorMeta};
use ir_graph::{TracedGraph, Tracer};
use layers::RmsNorm;

use crate::BenchError;

/// An L-layer decoder of `RmsNorm`s (unit weights).
#[derive(Debug)]
pub struct Decoder {
    first: RmsNorm,
    layers: Vec<RmsNorm>,
    tokens: usize,
    hidden: usize,
    dtype: DType,
}

impl Decoder {
    /// `layers` fused layers after the first norm, on `tokens × hidden` activations of `dtype`.
    pub fn new(layers: usize, tokens: usize, hidden: usize, dtype: DType) -> Result<Decoder, BenchError> {
        let norm = |name: String| RmsNorm::builder(hidden).dtype(dtype).name(name).build();
        Ok(Decoder {
            first: norm("input_norm.weight".to_owned())?,
            layers: (0..layers).map(|i| norm(format!("layers.{i}.norm.weight"))).collect::<Result<_, _>>()?,
            tokens,
            hidden,
            dtype,
        })
    }

    /// The number of fused layers.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of one activation (T·H·s).
    pub fn activation_bytes(&self) -> u64 {
        (self.tokens * self.hidden * self.dtype.size_in_bytes()) as u64
    }

    /// The forward pass: with `donate`, the fused norms are `maybe_inplace` calls that donate x and
    /// the residual; without, functional calls. Returns (hidden, residual).
    pub fn forward<C: ExecutionContext>(
        &self,
        ctx: &C,
        x: C::Tensor,
        donate: bool,
    ) -> Result<(C::Tensor, C::Tensor), BenchError> {
        let mut hidden = self.first.forward(ctx, &x)?;
        let mut residual = x;
        for norm in &self.layers {
            let scaled = ctx.scale(&hidden, 0.5)?;
            (hidden, residual) = if donate {
                norm.forward_residual(ctx, scaled, residual)?
            } else {
                norm.forward_residual_functional(ctx, &scaled, &residual)?
            };
        }
        Ok((hidden, residual))
    }

    /// The traced graph (input `%x`, one parameter input per weight).
    pub fn trace(&self, registry: &Registry, donate: bool) -> Result<TracedGraph, BenchError> {
        let tracer = Tracer::new(registry, if donate { "decoder" } else { "decoder_functional" });
        let x = tracer.input("x", TensorMeta::compact(self.dtype, &[self.tokens, self.hidden]));
        let (hidden, residual) = self.forward(&tracer, x, donate)?;
        Ok(tracer.finish(&[hidden, residual]))
    }

    /// Graph inputs for `traced`: a random x (from `seed`) and the parameters.
    pub fn graph_inputs(&self, traced: &TracedGraph, seed: u64) -> Result<Vec<(String, Tensor)>, BenchError> {
        let x = Tensor::randn(&TensorMeta::compact(self.dtype, &[self.tokens, self.hidden]), seed)?;
        let mut inputs = vec![("x".to_owned(), x)];
        inputs.extend(traced.parameters.iter().cloned());
        Ok(inputs)
    }
}

/// The activation shape of the generated pass-benchmark graphs: metadata only matters to the passes,
/// so a small hidden size keeps a million-node graph's weights at a few hundred MB.
pub const GRAPH_SHAPE: (usize, usize) = (16, 256);

/// Nodes a traced decoder graph has with `layers` fused layers (inputs, calls, output).
pub fn nodes_for_layers(registry: &Registry, layers: usize) -> Result<usize, BenchError> {
    let (tokens, hidden) = GRAPH_SHAPE;
    Ok(Decoder::new(layers, tokens, hidden, DType::BF16)?.trace(registry, true)?.graph.order().len())
}

/// A traced, donating decoder graph with at least `nodes` nodes (and fewer than one layer more).
pub fn decoder_graph(registry: &Registry, nodes: usize) -> Result<TracedGraph, BenchError> {
    let base = nodes_for_layers(registry, 0)?;
    let per_layer = nodes_for_layers(registry, 1)? - base;
    let layers = nodes.saturating_sub(base).div_ceil(per_layer);
    let (tokens, hidden) = GRAPH_SHAPE;
    Decoder::new(layers, tokens, hidden, DType::BF16)?.trace(registry, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::{EagerContext, bit_eq};
    use ir_graph::{InterpOptions, interpret};

    fn registry() -> Registry {
        let registry = ir_ops::registry();
        kernels_cpu::register(&registry).unwrap();
        ir_core::PriorityConfig::platform_default(ir_core::Platform::Cpu).apply(&registry).unwrap();
        registry
    }

    #[test]
    fn generated_graphs_have_the_asked_size_and_grow_linearly() {
        let registry = registry();
        let per_layer = nodes_for_layers(&registry, 2).unwrap() - nodes_for_layers(&registry, 1).unwrap();
        assert!(per_layer >= 3, "scale, fused call, weight input: {per_layer}");
        for nodes in [100, 1000, 1001] {
            let n = decoder_graph(&registry, nodes).unwrap().graph.order().len();
            assert!(n >= nodes && n < nodes + per_layer, "asked {nodes}, got {n}");
        }
    }

    #[test]
    fn the_traced_decoder_interprets_like_the_eager_one() {
        let registry = registry();
        let decoder = Decoder::new(3, 4, 64, DType::BF16).unwrap();
        for donate in [true, false] {
            let traced = decoder.trace(&registry, donate).unwrap();
            let inputs = decoder.graph_inputs(&traced, 1).unwrap();
            let x = inputs[0].1.deep_clone().unwrap();
            let (hidden, residual) = decoder.forward(&EagerContext::new(&registry), x, donate).unwrap();
            let run = interpret(&traced.graph, &registry, inputs, InterpOptions::checked()).unwrap();
            assert!(bit_eq(&run.outputs[0], &hidden) && bit_eq(&run.outputs[1], &residual), "donate {donate}");
        }
    }
}
