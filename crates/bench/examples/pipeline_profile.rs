//! Prints the time of each pass (and of verification) on a generated decoder graph:
//! `cargo run --release -p vllm-ir-bench --example pipeline_profile -- 100000`.

// A benchmark reports on standard output.
#![allow(clippy::print_stdout)]

use std::time::Instant;

use ir_core::{Platform, PriorityConfig};
use ir_passes::{PassContext, Pipeline, Snapshots};
use vllm_ir_bench::decoder::decoder_graph;

fn main() {
    let nodes: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("priorities");
    let started = Instant::now();
    let traced = decoder_graph(&registry, nodes).expect("generating the graph");
    let n = traced.graph.order().len();
    println!("generated {n} nodes in {:.3} s", started.elapsed().as_secs_f64());
    let mut graph = traced.graph.clone();
    let started = Instant::now();
    let report =
        Pipeline::standard().run(&mut graph, &PassContext::new(&registry), None, Snapshots::Skip).expect("pipeline");
    let total = started.elapsed().as_secs_f64();
    let mut passes = 0.0;
    for run in &report.runs {
        let s = run.duration.as_secs_f64();
        passes += s;
        println!("{:>18} {:>10.3} ms {:>8.3} us/node", run.pass.as_str(), s * 1e3, s * 1e6 / n as f64);
    }
    println!(
        "{:>18} {:>10.3} ms {:>8.3} us/node",
        "verify (6x)",
        (total - passes) * 1e3,
        (total - passes) * 1e6 / n as f64
    );
    println!("{:>18} {:>10.3} ms {:>8.3} us/node", "total", total * 1e3, total * 1e6 / n as f64);
}
