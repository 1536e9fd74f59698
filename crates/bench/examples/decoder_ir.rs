//! Writes a generated decoder graph (the passes benchmark's, [`vllm_ir_bench::decoder`]) as IR text
//! to standard output: `cargo run --release -p vllm-ir-bench --example decoder_ir -- 1000000 > g.ir`.
//! `0` nodes gives the smallest graph (the first norm only), the baseline of memory measurements.
//! The node count goes to standard error, as `nodes <n>`.

// The graph text is this program's output.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Write;

use ir_core::{Platform, PriorityConfig};
use vllm_ir_bench::decoder::decoder_graph;

fn main() -> std::io::Result<()> {
    let nodes: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("priorities");
    let traced = decoder_graph(&registry, nodes).expect("generating the graph");
    eprintln!("nodes {}", traced.graph.order().len());
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    write!(out, "{}", traced.graph)?;
    out.flush()
}
