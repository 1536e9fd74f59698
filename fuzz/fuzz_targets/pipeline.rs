//! Fuzzes parse → verify → standard pipeline → print: no input panics or hangs any stage, and the
//! pipeline's output verifies (the pipeline checks it after every pass).

#![no_main]

use std::sync::OnceLock;

use ir_core::Registry;
use ir_passes::{PassContext, Pipeline, Snapshots};
use libfuzzer_sys::fuzz_target;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry = Registry::with_builtin_ops();
        kernels_cpu::register(&registry).expect("a fresh registry");
        registry.set_default("rms_norm", &["cpu", "native"]).expect("registered");
        registry.set_default("fused_add_rms_norm", &["cpu", "native"]).expect("registered");
        registry
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if text.len() > 4096 {
        return;
    }
    let Ok(mut graph) = ir_core::graph::parse(text) else { return };
    let registry = registry();
    if ir_core::graph::verify(&graph, registry).is_err() {
        return;
    }
    if Pipeline::standard().run(&mut graph, &PassContext::new(registry), None, Snapshots::Skip).is_ok() {
        let _ = graph.to_string();
    }
});
