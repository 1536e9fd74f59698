//! An engine's view, through the `vllm-ir` crate alone: a two-layer gated MLP block (norm, gated
//! activation, residual norm) written once against the execution context, run eagerly, traced,
//! compiled by the standard pipeline and run again, with the providers each call chose.
//!
//! `cargo run -p vllm-ir --example engine`

// An example reports on standard output.
#![allow(clippy::print_stdout)]

use vllm_ir::graph::{InterpOptions, Tracer, interpret};
use vllm_ir::layers::{GeluAndMul, RmsNorm, SiluAndMul};
use vllm_ir::op::gelu_and_mul::Approximate;
use vllm_ir::passes::{PassContext, Pipeline, Snapshots};
use vllm_ir::{DType, EagerContext, ExecutionContext, ExecutionContextExt, Tensor, bit_eq, half::bf16};

const HIDDEN: usize = 64;

struct Block {
    norm: RmsNorm,
    residual_norm: RmsNorm,
}

impl Block {
    /// `x: [T, 2H]` (a gate-up projection's output) and the residual `[T, H]`.
    fn forward<C: ExecutionContext>(
        &self,
        ctx: &C,
        gate_up: &C::Tensor,
        residual: C::Tensor,
        layer: usize,
    ) -> Result<(C::Tensor, C::Tensor), Box<dyn std::error::Error>> {
        let activated = if layer.is_multiple_of(2) {
            SiluAndMul.forward(ctx, gate_up)?
        } else {
            GeluAndMul::new(Approximate::Tanh).forward(ctx, gate_up)?
        };
        let normed = self.norm.forward(ctx, &activated)?;
        Ok(self.residual_norm.forward_residual(ctx, normed, residual)?)
    }
}

fn model<C: ExecutionContext>(
    ctx: &C,
    blocks: &[Block],
    gate_up: &C::Tensor,
    residual: C::Tensor,
) -> Result<C::Tensor, Box<dyn std::error::Error>> {
    let mut residual = residual;
    let mut out = None;
    for (layer, block) in blocks.iter().enumerate() {
        let (o, r) = block.forward(ctx, gate_up, residual, layer)?;
        out = Some(o);
        residual = r;
    }
    Ok(ctx.add(&out.expect("at least one block"), &residual)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Frozen: every op and provider is registered; nothing registers later.
    let registry = vllm_ir::registry()?;
    let blocks: Vec<Block> = (0..2)
        .map(|_| -> Result<Block, vllm_ir::layers::LayerError> {
            Ok(Block {
                norm: RmsNorm::builder(HIDDEN).dtype(DType::BF16).build()?,
                residual_norm: RmsNorm::builder(HIDDEN).dtype(DType::BF16).build()?,
            })
        })
        .collect::<Result<_, _>>()?;
    let gate_up: Vec<bf16> = (0..4 * 2 * HIDDEN).map(|i| bf16::from_f32(((i % 17) as f32 - 8.0) / 8.0)).collect();
    let gate_up = Tensor::from_vec(&[4, 2 * HIDDEN], gate_up)?;
    let residual = Tensor::from_vec(&[4, HIDDEN], vec![bf16::from_f32(0.25); 4 * HIDDEN])?;

    let eager = model(&EagerContext::new(&registry), &blocks, &gate_up, residual.deep_clone()?)?;

    let tracer = Tracer::new(&registry, "gated_mlp");
    let x = tracer.input("gate_up", gate_up.meta().clone());
    let r = tracer.input("residual", residual.meta().clone());
    let out = model(&tracer, &blocks, &x, r)?;
    let traced = tracer.finish(&[out]);
    let mut graph = traced.graph.clone();
    let report = Pipeline::standard().run(&mut graph, &PassContext::new(&registry), None, Snapshots::Skip)?;
    println!("{graph}");
    for run in &report.runs {
        println!("pass {:?}: {:?}", run.pass, run.duration);
    }

    let mut inputs = vec![("gate_up".to_owned(), gate_up), ("residual".to_owned(), residual)];
    inputs.extend(traced.parameters.iter().map(|(name, t)| (name.clone(), t.clone())));
    let run = interpret(&graph, &registry, inputs, InterpOptions::checked())?;
    assert!(bit_eq(&run.outputs[0], &eager), "the compiled graph computes what eager did");
    println!("compiled run matches eager; providers per node:");
    for (node, op, provider) in &run.stats.providers {
        println!("  {op} -> {provider}: {}", graph.display_node(*node));
    }
    println!("eager selections:");
    for record in registry.selection_record().ops {
        for p in record.providers.iter().filter(|p| p.selections > 0) {
            println!("  {}: {} x{}", record.op, p.provider, p.selections);
        }
    }
    Ok(())
}
