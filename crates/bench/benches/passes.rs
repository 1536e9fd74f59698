//! The standard pipeline (functionalize, fuse-add-rms-norm-exact, fuse-row-programs-exact, fuse-norm-quant, dce, lower, eliminate-clones, dce, each verified) on traced
//! decoder graphs of 1k to 1M nodes: time per node and how it grows; and the interpreter running
//! the same (uncompiled) graphs, which must grow linearly too.

// A benchmark reports on standard output.
#![allow(clippy::print_stdout)]

mod common;

use std::collections::BTreeMap;

use criterion::{BatchSize, BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use ir_core::{DType, Tensor, TensorMeta};
use ir_core::{Platform, PriorityConfig};
use ir_graph::{InterpOptions, interpret};
use ir_passes::{PassContext, Pipeline, Snapshots};
use serde::Serialize;
use vllm_ir_bench::decoder::{GRAPH_SHAPE, decoder_graph};
use vllm_ir_bench::output;

/// Graph sizes (nodes).
const SIZES: [usize; 4] = [1_000, 10_000, 100_000, 1_000_000];

#[derive(Serialize)]
struct PassBreakdown {
    nodes: usize,
    /// Seconds per pass (verification excluded), from one run.
    passes: Vec<(String, f64)>,
}

fn passes(c: &mut Criterion) {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("the cpu platform's priorities");
    let cx = PassContext::new(&registry);
    let mut breakdown = Vec::new();
    let mut group = c.benchmark_group("passes/pipeline");
    for nodes in SIZES {
        let traced = decoder_graph(&registry, nodes).expect("generating the graph");
        let n = traced.graph.order().len();
        let mut once = traced.graph.clone();
        let report = Pipeline::standard().run(&mut once, &cx, None, Snapshots::Skip).expect("the pipeline runs");
        let mut per_pass: BTreeMap<String, f64> = BTreeMap::new();
        for run in &report.runs {
            *per_pass.entry(run.pass.to_string()).or_default() += run.duration.as_secs_f64();
        }
        breakdown.push(PassBreakdown { nodes: n, passes: per_pass.into_iter().collect() });

        if n >= 100_000 {
            group.sampling_mode(SamplingMode::Flat).sample_size(10);
        }
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &traced.graph, |b, graph| {
            b.iter_batched(
                || graph.clone(),
                |mut g| {
                    Pipeline::standard().run(&mut g, &cx, None, Snapshots::Skip).unwrap();
                    g
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();

    // The interpreter on the uncompiled graphs (maybe_inplace calls through dispatch, in place).
    let mut group = c.benchmark_group("passes/interpret");
    // A million-node run takes about ten seconds a sample on 2 cores: full runs only.
    let sizes = if output::quick() { &SIZES[..3] } else { &SIZES[..] };
    for &nodes in sizes {
        let traced = decoder_graph(&registry, nodes).expect("generating the graph");
        let n = traced.graph.order().len();
        let (tokens, hidden) = GRAPH_SHAPE;
        let x_meta = TensorMeta::compact(DType::BF16, &[tokens, hidden]);
        if n >= 100_000 {
            group.sampling_mode(SamplingMode::Flat).sample_size(10);
        }
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &traced, |b, traced| {
            b.iter_batched(
                || {
                    let x = Tensor::randn(&x_meta, 1).expect("a small input");
                    let mut inputs = vec![("x".to_owned(), x)];
                    inputs.extend(traced.parameters.iter().cloned());
                    inputs
                },
                |inputs| interpret(&traced.graph, &registry, inputs, InterpOptions::checked()).unwrap(),
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
    match output::write_json("passes.json", &breakdown) {
        Ok(path) => println!("wrote {}", path.display()),
        Err(e) => println!("warning: {e}"),
    }
}

fn config() -> Criterion {
    common::criterion((0.3, 2.0), (1.0, 5.0), Some(20))
}

criterion_group! { name = benches; config = config(); targets = passes }
criterion_main!(benches);
