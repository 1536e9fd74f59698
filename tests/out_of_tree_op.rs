//! An op defined outside `ir-core`, as an engine would define its own: one `OpDef`, a provider
//! registered with a closure that captures state, and nothing else. It runs eagerly, traces, prints
//! and parses back, verifies, lowers to the provider's in-place kernel, survives clone elimination
//! and interprets to the eager bits, all through the generic `ExecutionContext::call`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ir_core::op::{Activations, ArgMeta, InputSpec, Literal, MetaError, OpDef, Overload, ParamDef, ParamKind, Value};
use ir_core::{
    CallArg, CallError, DType, EagerContext, ExecutionContext, ImplFunc, ImplSpec, KernelError, Registry, Tensor,
    TensorError, TensorMeta, bit_eq,
};
use ir_graph::{InterpOptions, Tracer, interpret, parse};
use ir_passes::{PassContext, Pipeline, Snapshots};

/// `shifted_square(x, shift = 0.0) -> out`: `out = (x + shift)²` elementwise, computed in f64 and
/// rounded once to x's dtype. In-place capable: `maybe_inplace` donates `x`.
static SHIFTED_SQUARE: OpDef = OpDef {
    name: "shifted_square",
    params: &[
        ParamDef { name: "x", kind: ParamKind::Tensor, default: None },
        ParamDef { name: "shift", kind: ParamKind::F64, default: Some(Literal::F64(0.0)) },
    ],
    n_outputs: 1,
    activations: Activations::Default,
    allow_inplace: true,
    native,
    meta,
    generate_inputs: generate,
    tolerances: &[],
    description: "(x + shift) squared, elementwise",
};

fn shifted_square_values(x: &Tensor, shift: f64) -> Result<Tensor, TensorError> {
    let values: Vec<f64> = x.to_f64_vec()?.into_iter().map(|v| (v + shift) * (v + shift)).collect();
    let compact = Tensor::from_f64(x.dtype(), x.shape(), &values)?;
    let mut out = Tensor::zeros_with_layout(x.dtype(), x.layout().copy_layout())?;
    out.copy_from(&compact)?;
    Ok(out)
}

fn arguments(args: &[Value]) -> Result<(&Tensor, f64), KernelError> {
    match args {
        [Value::Tensor(x), Value::F64(shift)] => Ok((x, *shift)),
        _ => Err(KernelError::InvalidArguments { reason: "shifted_square takes (x, shift)".to_owned() }),
    }
}

fn native(args: &[Value]) -> Result<Vec<Tensor>, KernelError> {
    let (x, shift) = arguments(args)?;
    Ok(vec![shifted_square_values(x, shift)?])
}

fn meta(args: &[ArgMeta<'_>]) -> Result<Vec<TensorMeta>, MetaError> {
    let x = args[0].tensor().ok_or(MetaError::Kind { op: "shifted_square", param: "x" })?;
    Ok(vec![TensorMeta { layout: x.layout.copy_layout(), ..x.clone() }])
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let x = Tensor::randn(&TensorMeta::compact(spec.dtype, &[spec.num_tokens, spec.hidden_size]), spec.seed)?;
    Ok(vec![Value::Tensor(x), Value::F64(0.5)])
}

/// The engine's registry: the built-in ops, the new op, and an in-place `plugin` provider whose
/// closure counts its calls.
fn registry(calls: Arc<AtomicUsize>) -> Registry {
    let registry = Registry::with_builtin_ops();
    registry.define_op(&SHIFTED_SQUARE).unwrap();
    let kernel = ImplFunc::inplace(move |args| {
        calls.fetch_add(1, Ordering::Relaxed);
        // Bound arguments arrive by value; the activation is uniquely owned, so it can be written.
        let mut args = args.into_iter();
        let (Some(Value::Tensor(mut x)), Some(Value::F64(shift))) = (args.next(), args.next()) else {
            return Err(KernelError::InvalidArguments { reason: "shifted_square takes (x, shift)".to_owned() });
        };
        let result = shifted_square_values(&x, shift)?;
        x.copy_from(&result)?;
        Ok(vec![x])
    });
    registry.register_impl("shifted_square", ImplSpec::new("plugin"), kernel).unwrap();
    registry.set_default("shifted_square", &["plugin", "native"]).unwrap();
    registry
}

/// A model written once against the context: the new op donating its input, then functional with
/// the default shift, then a built-in.
fn model<C: ExecutionContext>(ctx: &C, x: C::Tensor) -> Result<C::Tensor, CallError> {
    let scaled = ctx.scale(&x, 0.5)?;
    let [squared] = ir_core::context::outputs::<_, 1>(
        &SHIFTED_SQUARE,
        ctx.call(&SHIFTED_SQUARE, Overload::MaybeInplace, vec![CallArg::Tensor(scaled), CallArg::F64(0.25)])?,
    )?;
    let [again] = ir_core::context::outputs::<_, 1>(
        &SHIFTED_SQUARE,
        ctx.call(&SHIFTED_SQUARE, Overload::Default, vec![CallArg::Tensor(squared.clone())])?,
    )?;
    ctx.add(&squared, &again)
}

#[test]
fn an_op_defined_outside_ir_core_traces_compiles_and_runs_like_a_built_in() {
    let calls = Arc::new(AtomicUsize::new(0));
    let registry = registry(Arc::clone(&calls));
    let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[4, 16]), 7).unwrap();

    let eager = model(&EagerContext::new(&registry), x.clone()).unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 2, "both eager calls ran the plugin");

    let tracer = Tracer::new(&registry, "engine_model");
    let input = tracer.input("x", x.meta().clone());
    let out = model(&tracer, input).unwrap();
    let traced = tracer.finish(&[out]);
    let text = traced.graph.to_string();
    assert!(text.contains("= shifted_square.maybe_inplace(%0, 0.25) : bf16[4,16]"), "{text}");
    assert!(text.contains("= shifted_square(%1, 0.0) : bf16[4,16]"), "the default is spelled out\n{text}");
    let reparsed = parse(&text).unwrap();
    assert!(reparsed.structurally_eq(&traced.graph), "{text}");
    ir_graph::verify(&reparsed, &registry).unwrap();

    let run = |graph: &ir_graph::Graph| {
        interpret(graph, &registry, vec![("x".to_owned(), x.clone())], InterpOptions::checked()).unwrap()
    };
    assert!(bit_eq(&run(&reparsed).outputs[0], &eager), "the uncompiled graph runs like eager");

    let mut compiled = reparsed.clone();
    let report = Pipeline::standard().run(&mut compiled, &PassContext::new(&registry), None, Snapshots::Skip).unwrap();
    let compiled_text = compiled.to_string();
    assert!(
        compiled_text.contains("impl shifted_square[plugin] writes(0) (%0, 0.25)"),
        "the donated call lowers to the in-place kernel on the dead value, without a copy\n{compiled_text}"
    );
    assert!(
        compiled_text.contains("clone("),
        "the functional call's input is read afterwards: its copy stays\n{compiled_text}"
    );
    assert_eq!(report.runs.len(), 5);
    let before = calls.load(Ordering::Relaxed);
    let compiled_run = run(&compiled);
    assert!(bit_eq(&compiled_run.outputs[0], &eager), "the compiled graph runs like eager\n{compiled_text}");
    assert_eq!(calls.load(Ordering::Relaxed), before + 2, "the compiled graph called the plugin twice");
    assert!(
        compiled_run.stats.providers.iter().all(|(_, op, provider)| op != "shifted_square" || *provider == "plugin")
    );
}

#[test]
fn an_out_of_tree_op_is_validated_like_a_built_in() {
    let registry = registry(Arc::new(AtomicUsize::new(0)));
    let tracer = Tracer::new(&registry, "bad");
    let input = tracer.input("x", TensorMeta::compact(DType::F32, &[2, 4]));
    let err = tracer.call(&SHIFTED_SQUARE, Overload::Default, vec![CallArg::F64(1.0)]).unwrap_err();
    assert!(err.to_string().contains("parameter `x` expects Tensor"), "{err}");
    let err = tracer
        .call(
            &SHIFTED_SQUARE,
            Overload::Default,
            vec![CallArg::Tensor(input.clone()), CallArg::F64(1.0), CallArg::None],
        )
        .unwrap_err();
    assert!(err.to_string().contains("takes 2 arguments but 3 were given"), "{err}");

    // An op the registry does not define cannot be traced or called.
    let bare = Registry::with_builtin_ops();
    let tracer = Tracer::new(&bare, "unknown");
    let input = tracer.input("x", TensorMeta::compact(DType::F32, &[2, 4]));
    let err = tracer.call(&SHIFTED_SQUARE, Overload::Default, vec![CallArg::Tensor(input)]).unwrap_err();
    assert!(matches!(err, CallError::UnknownOp { .. }), "{err}");
    let eager = EagerContext::new(&bare).call(
        &SHIFTED_SQUARE,
        Overload::Default,
        vec![CallArg::Tensor(Tensor::zeros(DType::F32, &[2, 4]).unwrap())],
    );
    assert!(matches!(eager, Err(CallError::UnknownOp { .. })), "{eager:?}");
}
