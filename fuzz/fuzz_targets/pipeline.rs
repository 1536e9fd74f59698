//! Fuzzes parse → verify → standard pipeline → print, differentially: no input panics or hangs any
//! stage, every graph that verifies compiles (unless it reuses a donated value, the caller's
//! error), the pipeline's output verifies (the pipeline checks it after every pass), and for graphs
//! small enough to run, interpreting before and after the pipeline gives bit-identical outputs and
//! the compiled graph never trips a safety check that the input graph did not trip. A
//! miscompile, or a valid graph the pipeline refuses, is a crash.

#![no_main]

use std::sync::OnceLock;

use ir_graph::{Graph, InterpOptions, interpret};
use ir_core::{Registry, Tensor, bit_eq};
use ir_passes::{PassContext, PassError, Pipeline, PipelineError, Snapshots};
use libfuzzer_sys::fuzz_target;

/// Graphs whose every value stays under this many storage elements are run before and after.
const MAX_ELEMENTS: usize = 1 << 14;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry = ir_ops::registry();
        kernels_cpu::register(&registry).expect("a fresh registry");
        for op in [
            "rms_norm",
            "fused_add_rms_norm",
            "layer_norm",
            "fused_add_layer_norm",
            "fused_sandwich_rms_norm",
            "silu_and_mul",
            "dynamic_per_token_scaled_fp8_quant",
            "silu_and_mul_dynamic_fp8_quant",
            "rotary_embedding",
            "fused_qk_norm_rope",
        ] {
            registry.set_default(op, &["cpu", "native"]).expect("registered");
        }
        registry
    })
}

/// Whether every live value's storage extent is small enough to interpret quickly.
fn small_enough(graph: &Graph) -> bool {
    graph.order().iter().all(|&node| {
        graph.node(node).results.iter().all(|&value| graph.meta(value).layout.storage_end() <= MAX_ELEMENTS)
    })
}

/// Deterministic inputs with the declared layouts: ordinary values mixed with large and tiny
/// magnitudes, so overflow and underflow paths run too.
fn inputs(graph: &Graph) -> Vec<(String, Tensor)> {
    graph
        .inputs()
        .into_iter()
        .enumerate()
        .map(|(i, (_, value, name, _))| {
            let meta = graph.meta(value);
            let n = meta.layout.storage_end();
            let values: Vec<f64> = (0..n)
                .map(|k| {
                    let base = (((k * 7 + i * 13) % 23) as f64 - 11.0) / 4.0;
                    match (k + i) % 17 {
                        5 => base * 1e30,
                        11 => base * 1e-30,
                        _ => base,
                    }
                })
                .collect();
            let whole = Tensor::from_f64(meta.dtype, &[n], &values).expect("a small input");
            let view = whole.as_strided(meta.layout.clone()).expect("the declared layout fits");
            drop(whole);
            (name.to_owned(), view)
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if text.len() > 4096 {
        return;
    }
    let Ok(mut graph) = ir_graph::parse(text) else { return };
    let registry = registry();
    if ir_graph::verify(&graph, registry).is_err() {
        return;
    }
    let original = graph.clone();
    // A graph that verifies compiles: the only refusal left to the pipeline is a donated value used
    // after its donation (functionalization's check, the caller's error). Anything else (a pass
    // that breaks the graph, a selection failure) is a compiler bug, so a crash here.
    match Pipeline::standard().run(&mut graph, &PassContext::new(registry), None, Snapshots::Skip) {
        Ok(_) => {}
        Err(PipelineError::Pass { source: PassError::DonatedValueReused { .. }, .. }) => return,
        Err(e) => panic!("a valid graph fails to compile: {e}\n{original}"),
    }
    let _ = graph.to_string();
    if !small_enough(&original) || !small_enough(&graph) {
        return;
    }
    // A graph that trips a safety check (or fails to run) before the pipeline has no reference.
    let Ok(reference) = interpret(&original, registry, inputs(&original), InterpOptions::checked()) else { return };
    let compiled = match interpret(&graph, registry, inputs(&graph), InterpOptions::checked()) {
        Ok(run) => run,
        Err(e) => panic!("the compiled graph fails where the input ran: {e}\nbefore:\n{original}\nafter:\n{graph}"),
    };
    for (i, (after, before)) in compiled.outputs.iter().zip(&reference.outputs).enumerate() {
        assert!(bit_eq(after, before), "output {i} differs after the pipeline\nbefore:\n{original}\nafter:\n{graph}");
    }
});
