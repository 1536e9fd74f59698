//! The memory study (not timed): the decoder traced and interpreted without passes and after the
//! standard pipeline, at L = 1, 8, 32; writes `memory.json` for `cargo xtask bench`.

// A benchmark reports on standard output.
#![allow(clippy::print_stdout)]

use ir_core::{Platform, PriorityConfig};
use vllm_ir_bench::memory::{LAYERS, SHAPE, study};
use vllm_ir_bench::output;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("the cpu platform's priorities");
    let (tokens, hidden) = SHAPE;
    let study = study(&registry, &LAYERS, tokens, hidden).expect("the memory study runs");
    println!("memory: decoder {tokens}x{hidden} {}, fused norms on `{}`", study.dtype, study.fused_provider);
    println!(
        "{:>4} {:>16} {:>16} {:>8} {:>8} {:>16}",
        "L", "uncompiled B", "compiled B", "copies", "copies'", "saved B"
    );
    for row in &study.rows {
        println!(
            "{:>4} {:>16} {:>16} {:>8} {:>8} {:>16}",
            row.layers,
            row.uncompiled.bytes_allocated,
            row.compiled.bytes_allocated,
            row.uncompiled.copies(),
            row.compiled.copies(),
            row.saved_bytes
        );
    }
    match output::write_json("memory.json", &study) {
        Ok(path) => println!("wrote {}", path.display()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
