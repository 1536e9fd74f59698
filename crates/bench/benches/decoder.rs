//! The toy decoder (`layers::toy`: per layer a fused add + norm with fp8 quantization, rotary
//! embedding of q and k slices of one qkv buffer, a second norm + quantization and `SiluAndMul`,
//! with copy stand-ins for the GEMMs and the attention) at 64×4096 bf16, two layers, on the cpu
//! providers: eager functional, eager with donated activations, and the donating trace compiled by
//! the standard pipeline and interpreted (the interpreter's safety checks on); plus compiling it.

mod common;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use ir_core::{DType, EagerContext, Platform, PriorityConfig, Tensor, TensorMeta, bit_eq};
use ir_graph::{InterpOptions, Tracer, interpret};
use ir_passes::{PassContext, Pipeline, Snapshots};
use layers::toy::{ToyDecoder, ToyDecoderConfig};

/// Tokens and hidden size.
const SHAPE: (usize, usize) = (64, 4096);
/// Decoder layers.
const LAYERS: usize = 2;

fn inputs() -> (Tensor, Tensor, Tensor) {
    let (tokens, hidden) = SHAPE;
    let meta = TensorMeta::compact(DType::BF16, &[tokens, hidden]);
    let x = Tensor::randn(&meta, 1).expect("a small input");
    let residual = Tensor::randn(&meta, 2).expect("a small input");
    let positions = Tensor::from_vec(&[tokens], (0..tokens as i64).collect()).expect("positions");
    (x, residual, positions)
}

fn decoder(c: &mut Criterion) {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("the cpu platform's priorities");
    let (tokens, hidden) = SHAPE;
    let config = ToyDecoderConfig { layers: LAYERS, hidden, max_position: 4096, dtype: DType::BF16, seed: 0 };
    let model = ToyDecoder::new(config).expect("the toy decoder builds");
    let ctx = EagerContext::new(&registry);

    let tracer = Tracer::new(&registry, "toy");
    let meta = TensorMeta::compact(DType::BF16, &[tokens, hidden]);
    let (x, residual) = (tracer.input("x", meta.clone()), tracer.input("residual", meta));
    let positions = tracer.input("positions", TensorMeta::compact(DType::I64, &[tokens]));
    let (out, res) = model.forward(&tracer, (x, residual), &positions, true).expect("the decoder traces");
    let traced = tracer.finish(&[out, res]);
    let compile = |graph: &mut ir_graph::Graph| {
        Pipeline::standard().run(graph, &PassContext::new(&registry), None, Snapshots::Skip).expect("compiles")
    };
    let mut compiled = traced.graph.clone();
    compile(&mut compiled);
    let graph_inputs = || {
        let (x, residual, positions) = inputs();
        let mut named =
            vec![("x".to_owned(), x), ("residual".to_owned(), residual), ("positions".to_owned(), positions)];
        named.extend(traced.parameters.iter().cloned());
        named
    };
    // Every form computes the same bits (checked before timing).
    let (x, residual, positions) = inputs();
    let (expected, _) = model.forward(&ctx, (x, residual), &positions, false).expect("eager runs");
    let run = interpret(&compiled, &registry, graph_inputs(), InterpOptions::checked()).expect("compiled runs");
    assert!(bit_eq(&run.outputs[0], &expected), "the compiled decoder differs from the eager one");

    let mut group = c.benchmark_group(format!("decoder/toy/{tokens}x{hidden}x{LAYERS}"));
    group.bench_function("eager_functional", |b| {
        b.iter_batched(
            inputs,
            |(x, residual, positions)| model.forward(&ctx, (x, residual), &positions, false).unwrap(),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("eager_maybe_inplace", |b| {
        b.iter_batched(
            inputs,
            |(x, residual, positions)| model.forward(&ctx, (x, residual), &positions, true).unwrap(),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("compiled", |b| {
        b.iter_batched(
            graph_inputs,
            |named| interpret(&compiled, &registry, named, InterpOptions::checked()).unwrap(),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("compile", |b| {
        b.iter_batched(|| traced.graph.clone(), |mut graph| compile(&mut graph), BatchSize::PerIteration)
    });
    group.finish();
}

fn config() -> Criterion {
    common::criterion((0.3, 2.0), (1.0, 5.0), Some(20))
}

criterion_group! { name = benches; config = config(); targets = decoder }
criterion_main!(benches);
