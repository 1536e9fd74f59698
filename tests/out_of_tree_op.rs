//! An op defined outside `ir-core`, as an engine would define its own: one `OpDef`, a provider
//! registered with a closure that captures state, and nothing else. It runs eagerly, traces, prints
//! and parses back, verifies, lowers to the provider's in-place kernel, survives clone elimination
//! and interprets to the eager bits, all through the generic `ExecutionContext::call`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ir_core::op::{
    Activations, ArgMeta, InputSpec, Literal, MetaError, OpDef, Outputs, Overload, ParamDef, ParamKind, Value, smallvec,
};
use ir_core::{
    CallArg, CallError, DType, EagerContext, ExecutionContext, ExecutionContextExt, ImplFunc, ImplSpec, KernelError,
    Registry, Tensor, TensorError, TensorMeta, bit_eq,
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

fn native(args: &[Value]) -> Result<Outputs, KernelError> {
    let (x, shift) = arguments(args)?;
    Ok(smallvec![shifted_square_values(x, shift)?])
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let x = args[0].tensor().ok_or(MetaError::Kind { op: def.name, param: "x" })?;
    Ok(ir_core::op::smallvec![TensorMeta { layout: x.layout.copy_layout(), ..x.clone() }])
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let x = Tensor::randn(&TensorMeta::compact(spec.dtype, &[spec.num_tokens, spec.hidden_size]), spec.seed)?;
    Ok(vec![Value::Tensor(x), Value::F64(0.5)])
}

/// The engine's registry: the built-in ops, the new op, and an in-place `plugin` provider whose
/// closure counts its calls.
fn registry(calls: Arc<AtomicUsize>) -> Registry {
    let registry = ir_ops::registry();
    registry.define_op(&SHIFTED_SQUARE).unwrap();
    let kernel = ImplFunc::inplace(move |args| {
        calls.fetch_add(1, Ordering::Relaxed);
        // The activation is uniquely owned: take it out of the bound arguments to write it.
        let (Value::Tensor(mut x), &Value::F64(shift)) = (std::mem::replace(&mut args[0], Value::None), &args[1])
        else {
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
    let [squared] = ir_core::outputs::<_, 1>(
        &SHIFTED_SQUARE,
        ctx.call(&SHIFTED_SQUARE, Overload::MaybeInplace, vec![CallArg::Tensor(scaled), CallArg::F64(0.25)])?,
    )?;
    let [again] = ir_core::outputs::<_, 1>(
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
    assert_eq!(report.runs.len(), Pipeline::standard().passes.len());
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
    let bare = ir_ops::registry();
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

// --- every parameter kind, through the same path ---

const MODES: &[&str] = &["exact", "fast"];

/// `kinds_probe(x, mode = "exact", scale = none, flag = none, out_dtype = none, dims = none)`: x times
/// `scale` (1 if none; negated when `flag`), in `out_dtype` (x's if none), reshaped to `dims` (x's
/// shape if none). Exercises every parameter kind.
static KINDS_PROBE: OpDef = OpDef {
    name: "kinds_probe",
    params: &[
        ParamDef { name: "x", kind: ParamKind::Tensor, default: None },
        ParamDef { name: "mode", kind: ParamKind::Str(MODES), default: Some(Literal::Str("exact")) },
        ParamDef { name: "scale", kind: ParamKind::OptF64, default: Some(Literal::None) },
        ParamDef { name: "flag", kind: ParamKind::OptBool, default: Some(Literal::None) },
        ParamDef { name: "out_dtype", kind: ParamKind::OptDType, default: Some(Literal::None) },
        ParamDef { name: "dims", kind: ParamKind::OptInts, default: Some(Literal::None) },
    ],
    n_outputs: 1,
    activations: Activations::Default,
    allow_inplace: false,
    native: kinds_native,
    meta: kinds_meta,
    generate_inputs: generate,
    tolerances: &[],
    description: "a probe of every parameter kind",
};

fn kinds_shape_and_dtype(args: &[ArgMeta<'_>]) -> Result<(Vec<usize>, DType), MetaError> {
    let x = args[0].tensor().ok_or(MetaError::Kind { op: "kinds_probe", param: "x" })?;
    let dtype = args[4].dtype().unwrap_or(x.dtype);
    let shape = match args[5].ints() {
        None => x.shape().to_vec(),
        Some(dims) => {
            let dims: Vec<usize> = dims.iter().map(|&d| usize::try_from(d).unwrap_or(usize::MAX)).collect();
            if dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) != Some(x.numel()) {
                return Err(MetaError::Kind { op: "kinds_probe", param: "dims" });
            }
            dims
        }
    };
    Ok((shape, dtype))
}

fn kinds_meta(_: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let (shape, dtype) = kinds_shape_and_dtype(args)?;
    Ok(ir_core::op::smallvec![TensorMeta::compact(dtype, &shape)])
}

fn kinds_native(args: &[Value]) -> Result<Outputs, KernelError> {
    let metas: Vec<ArgMeta<'_>> = args.iter().map(Value::meta).collect();
    // A refusal of the meta function becomes `KernelError::Meta`.
    let (shape, dtype) = kinds_shape_and_dtype(&metas)?;
    let x = args[0].as_tensor().expect("bound");
    let sign = if metas[3].bool() == Some(true) { -1.0 } else { 1.0 };
    let factor = metas[2].f64().unwrap_or(1.0) * sign;
    let exact = metas[1].str() == Some("exact");
    let values: Vec<f64> =
        x.to_f64_vec()?.into_iter().map(|v| if exact { v * factor } else { (v * factor) as f32 as f64 }).collect();
    Ok(smallvec![Tensor::from_f64(dtype, &shape, &values)?])
}

/// A call of `kinds_probe` giving every parameter a value.
fn every_kind<T>(x: T) -> Vec<CallArg<T>> {
    vec![
        CallArg::Tensor(x),
        CallArg::Str("fast".to_owned()),
        CallArg::F64(2.0),
        CallArg::Bool(true),
        CallArg::DType(DType::F32),
        CallArg::Ints(vec![8, 4]),
    ]
}

#[test]
fn every_parameter_kind_traces_prints_parses_and_runs() {
    let registry = ir_ops::registry();
    registry.define_op(&KINDS_PROBE).unwrap();
    let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[4, 8]), 3).unwrap();
    let eager_ctx = EagerContext::new(&registry);
    let eager = eager_ctx.call(&KINDS_PROBE, Overload::Default, every_kind(x.clone())).unwrap();
    let eager_defaults = eager_ctx.call(&KINDS_PROBE, Overload::Default, vec![CallArg::Tensor(x.clone())]).unwrap();
    assert_eq!((eager[0].dtype(), eager[0].shape()), (DType::F32, &[8, 4][..]));

    let tracer = Tracer::new(&registry, "kinds");
    let input = tracer.input("x", x.meta().clone());
    let all = tracer.call(&KINDS_PROBE, Overload::Default, every_kind(input.clone())).unwrap();
    let defaults = tracer.call(&KINDS_PROBE, Overload::Default, vec![CallArg::Tensor(input)]).unwrap();
    let traced = tracer.finish(&[all[0].clone(), defaults[0].clone()]);
    let text = traced.graph.to_string();
    assert!(text.contains(r#"= kinds_probe(%x, "fast", 2.0, true, f32, [8, 4]) : f32[8,4]"#), "{text}");
    assert!(text.contains(r#"= kinds_probe(%x, "exact", none, none, none, none) : bf16[4,8]"#), "{text}");
    let reparsed = parse(&text).unwrap();
    assert!(reparsed.structurally_eq(&traced.graph), "{text}");
    let run = interpret(&reparsed, &registry, vec![("x".to_owned(), x.clone())], InterpOptions::checked()).unwrap();
    assert!(bit_eq(&run.outputs[0], &eager[0]) && bit_eq(&run.outputs[1], &eager_defaults[0]));
    assert_eq!(KINDS_PROBE.params[1].kind.to_string(), r#"Literal["exact", "fast"]"#);
    assert_eq!(KINDS_PROBE.params[4].kind.to_string(), "Optional[dtype]");
    assert_eq!(KINDS_PROBE.params[5].kind.to_string(), "Optional[list[int]]");

    // A string outside the allowed values is refused by name, eagerly, when tracing and in text.
    let err = eager_ctx
        .call(&KINDS_PROBE, Overload::Default, vec![CallArg::Tensor(x.clone()), CallArg::Str("slow".to_owned())])
        .unwrap_err();
    assert_eq!(err.to_string(), r#"op `kinds_probe`: parameter `mode` expects one of "exact", "fast", found "slow""#);
    let bad = text.replace(r#""fast""#, r#""slow""#);
    let err = ir_graph::verify(&parse(&bad).unwrap(), &registry).unwrap_err().to_string();
    assert!(err.contains(r#"found "slow""#), "{err}");
    let err = parse(&text.replace(r#""fast""#, r#""fast"#)).unwrap_err().to_string();
    assert!(err.contains("strings have no escapes"), "{err}");
}

#[test]
fn definitions_with_unspellable_choices_or_misfit_defaults_are_refused() {
    static BAD_CHOICE: OpDef = OpDef {
        name: "bad_choice",
        params: &[
            ParamDef { name: "x", kind: ParamKind::Tensor, default: None },
            ParamDef { name: "mode", kind: ParamKind::Str(&["ok", "a\"b"]), default: None },
        ],
        ..KINDS_PROBE
    };
    static BAD_DEFAULT: OpDef = OpDef {
        name: "bad_default",
        params: &[
            ParamDef { name: "x", kind: ParamKind::Tensor, default: None },
            ParamDef { name: "mode", kind: ParamKind::Str(MODES), default: Some(Literal::Str("slow")) },
        ],
        ..KINDS_PROBE
    };
    static BAD_KIND: OpDef = OpDef {
        name: "bad_kind",
        params: &[
            ParamDef { name: "x", kind: ParamKind::Tensor, default: None },
            ParamDef { name: "dims", kind: ParamKind::Ints, default: Some(Literal::F64(1.0)) },
        ],
        ..KINDS_PROBE
    };
    let registry = ir_ops::registry();
    let err = registry.define_op(&BAD_CHOICE).unwrap_err().to_string();
    assert!(err.contains(r#"allows "a\"b""#), "{err}");
    let err = registry.define_op(&BAD_DEFAULT).unwrap_err().to_string();
    assert_eq!(err, r#"op `bad_default`: the default of parameter `mode` is not a Literal["exact", "fast"]"#);
    let err = registry.define_op(&BAD_KIND).unwrap_err().to_string();
    assert_eq!(err, "op `bad_kind`: the default of parameter `dims` is not a list[int]");
    let builtins: Vec<&str> = ir_ops::BUILTIN_OPS.iter().map(|d| d.name).collect();
    assert_eq!(registry.ops(), builtins, "nothing was defined");
}
