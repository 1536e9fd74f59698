//! The gated activation layers in a model: written once against the execution context, run eagerly
//! on the cpu provider, traced, printed and parsed back, compiled by the standard pipeline and
//! interpreted to the eager bits.

use ir_core::{
    CallError, DType, EagerContext, ExecutionContext, ExecutionContextExt, Platform, PriorityConfig, Registry, Tensor,
    TensorMeta, bit_eq,
};
use ir_graph::{InterpOptions, Tracer, interpret, parse};
use ir_ops::gelu_and_mul::Approximate;
use ir_passes::{PassContext, Pipeline, Snapshots};
use layers::{GeluAndMul, GeluAndMulSparse, LayerError, SiluAndMul};

fn registry() -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).unwrap();
    registry
}

/// Three gated activations of a `[T, 4H]` projection's two halves, summed.
fn model<C: ExecutionContext>(ctx: &C, x: &C::Tensor, hidden: usize) -> Result<C::Tensor, LayerError> {
    let first = ctx.slice(x, 1, 0, 2 * hidden)?;
    let second = ctx.contiguous(&ctx.slice(x, 1, 2 * hidden, 4 * hidden)?)?;
    let silu = SiluAndMul.forward(ctx, &first)?;
    let gelu = GeluAndMul::new(Approximate::Tanh).forward(ctx, &second)?;
    let sparse = GeluAndMulSparse::new(0.95, Approximate::None)?.forward(ctx, &second)?;
    Ok(ctx.add(&ctx.add(&silu, &gelu)?, &sparse)?)
}

#[test]
fn gated_activation_layers_trace_compile_and_run_like_eager() {
    let registry = registry();
    let hidden = 64;
    let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[5, 4 * hidden]), 11).unwrap();
    let eager = model(&EagerContext::new(&registry), &x, hidden).unwrap();
    let record = registry.selection_record();
    for op in ["silu_and_mul", "gelu_and_mul", "gelu_and_mul_sparse"] {
        assert_eq!(record.selections(op, "cpu"), 1, "{op} ran on the cpu provider (the strided half included)");
    }

    let tracer = Tracer::new(&registry, "gated_mlp");
    let input = tracer.input("x", x.meta().clone());
    let out = model(&tracer, &input, hidden).unwrap();
    let traced = tracer.finish(&[out]);
    let text = traced.graph.to_string();
    assert!(text.contains(r#"gelu_and_mul(%"#) && text.contains(r#", "tanh") : bf16[5,64]"#), "{text}");
    assert!(text.contains("gelu_and_mul_sparse(%"), "{text}");
    let reparsed = parse(&text).unwrap();
    assert!(reparsed.structurally_eq(&traced.graph), "the multiplier prints exactly\n{text}");
    ir_graph::verify(&reparsed, &registry).unwrap();
    let run = |graph: &ir_graph::Graph| {
        interpret(graph, &registry, vec![("x".to_owned(), x.clone())], InterpOptions::checked()).unwrap()
    };
    assert!(bit_eq(&run(&reparsed).outputs[0], &eager), "the graph runs like eager");
    let mut compiled = reparsed.clone();
    Pipeline::standard().run(&mut compiled, &PassContext::new(&registry), None, Snapshots::Skip).unwrap();
    let compiled_text = compiled.to_string();
    assert!(compiled_text.contains("impl gelu_and_mul_sparse[cpu]"), "{compiled_text}");
    assert!(bit_eq(&run(&compiled).outputs[0], &eager), "compiled\n{compiled_text}");
}

#[test]
fn odd_widths_are_refused_by_the_layer_and_by_the_op() {
    let registry = registry();
    let ctx = EagerContext::new(&registry);
    let x = Tensor::zeros(DType::F32, &[2, 7]).unwrap();
    let err = GeluAndMul::default().forward(&ctx, &x).unwrap_err();
    assert!(matches!(err, LayerError::GatedInput { layer: "GeluAndMul", .. }), "{err}");
    let err = ir_ops::silu_and_mul::silu_and_mul(&registry, &x).unwrap_err();
    assert!(matches!(err, CallError::Meta(_)) && err.to_string().contains("even last dimension"), "{err}");
    let err = ir_ops::gelu_and_mul_sparse::gelu_and_mul_sparse(
        &registry,
        &Tensor::zeros(DType::F32, &[2, 8]).unwrap(),
        f64::NAN,
        Approximate::None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("`std_multiplier` = NaN is invalid: must be finite"), "{err}");
}
