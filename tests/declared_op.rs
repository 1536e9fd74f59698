//! An op declared outside `ir-core` with `define_op!`, as an engine would: the declaration alone gives
//! the typed eager calls, the context calls a model is written with, typed registration of a
//! functional and an in-place provider (closures that capture state), and a typed argument view for
//! predicates; the op then traces, prints, parses, verifies, lowers, survives clone elimination and
//! interprets to the eager bits like a built-in one.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ir_core::op::{ArgMeta, InputSpec, Literal, MetaError, StrEnum, Value};
use ir_core::{
    CallError, DType, EagerContext, ExecutionContext, ExecutionContextExt, ImplSpec, KernelError, Registry, Support,
    Tensor, TensorError, TensorMeta, UniqueTensor, bit_eq,
};
use ir_graph::{InterpOptions, Tracer, interpret, parse};
use ir_passes::{PassContext, Pipeline, Snapshots};

ir_core::str_enum! {
    /// How `soft_cap` bounds its input.
    pub enum CapMode { Tanh = "tanh", Clamp = "clamp" }
}

mod soft_cap {
    use super::*;
    use ir_core::op::Activation;

    ir_core::define_op! {
        /// `soft_cap(x, cap = 30.0, mode = "tanh", bias = none) -> out`: `cap * tanh(x / cap)` or
        /// `clamp(x, -cap, cap)`, plus `bias` (broadcast over rows) when given; computed in f64 and
        /// rounded once. In-place capable: `maybe_inplace` donates `x`.
        op soft_cap {
            def: SOFT_CAP,
            args: SoftCapArgs,
            params: (
                /// Input, donated by `maybe_inplace`.
                x: Activation,
                /// The bound.
                cap: f64 = Literal::F64(30.0),
                /// How the bound is applied.
                mode: CapMode = Literal::Str("tanh"),
                /// An optional bias over the last dimension.
                bias: Option<Tensor> = Literal::None,
            ),
            outputs: Tensor,
            inplace: true,
            native: super::native,
            meta: super::meta,
            generate: super::generate,
            tolerances: &[],
            description: "a bounded activation",
        }
    }
}

use soft_cap::{SOFT_CAP, SoftCapArgs};

fn capped(x: &Tensor, cap: f64, mode: CapMode, bias: Option<&Tensor>) -> Result<Tensor, TensorError> {
    let hidden = *x.shape().last().unwrap_or(&1);
    let bias = bias.map(Tensor::to_f64_vec).transpose()?;
    let values: Vec<f64> = x
        .to_f64_vec()?
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let bounded = match mode {
                CapMode::Tanh => cap * (v / cap).tanh(),
                CapMode::Clamp => v.clamp(-cap, cap),
            };
            bounded + bias.as_ref().map_or(0.0, |b| b[i % hidden])
        })
        .collect();
    let compact = Tensor::from_f64(x.dtype(), x.shape(), &values)?;
    let mut out = Tensor::zeros_with_layout(x.dtype(), x.layout().copy_layout())?;
    out.copy_from(&compact)?;
    Ok(out)
}

fn native(x: &Tensor, cap: f64, mode: CapMode, bias: Option<&Tensor>) -> Result<Tensor, KernelError> {
    Ok(capped(x, cap, mode, bias)?)
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let view = SoftCapArgs::from_meta(args).ok_or(MetaError::Kind { op: def.name, param: "x" })?;
    if view.cap.is_nan() || view.cap <= 0.0 {
        return Err(MetaError::Scalar {
            op: def.name,
            param: "cap",
            value: view.cap.to_string(),
            reason: "must be positive".to_owned(),
        });
    }
    if let Some(bias) = view.bias
        && bias.shape() != [*view.x.shape().last().unwrap_or(&0)]
    {
        return Err(MetaError::Shape {
            op: def.name,
            param: "bias",
            shape: bias.shape().to_vec(),
            expected: "must be [H]",
            other: "x",
            other_shape: view.x.shape().to_vec(),
        });
    }
    Ok(ir_core::op::smallvec![TensorMeta { layout: view.x.layout.copy_layout(), ..view.x.clone() }])
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let x = Tensor::randn(&TensorMeta::compact(spec.dtype, &[spec.num_tokens, spec.hidden_size]), spec.seed)?;
    Ok(vec![Value::Tensor(x.scale(40.0)?), Value::F64(30.0), Value::Str("tanh".to_owned()), Value::None])
}

/// The engine's registry: the op, a functional `counted` provider for every mode, and an in-place
/// `tanh_only` provider whose predicate reads the typed view; both closures count their calls.
fn registry(functional_calls: Arc<AtomicUsize>, inplace_calls: Arc<AtomicUsize>) -> Registry {
    let registry = ir_ops::registry();
    registry.define_op(&SOFT_CAP).unwrap();
    soft_cap::register(
        &registry,
        ImplSpec::new("counted"),
        soft_cap::Impl::functional(move |x, cap, mode, bias| {
            functional_calls.fetch_add(1, Ordering::Relaxed);
            native(x, cap, mode, bias)
        }),
    )
    .unwrap();
    let only_tanh = |args: &[ArgMeta<'_>]| match SoftCapArgs::from_meta(args) {
        Some(view) if view.mode == CapMode::Tanh => Support::Yes,
        _ => Support::No("tanh only".into()),
    };
    soft_cap::register(
        &registry,
        ImplSpec::new("tanh_only").with_supports(only_tanh),
        soft_cap::Impl::inplace(move |x: UniqueTensor, cap, mode, bias| {
            inplace_calls.fetch_add(1, Ordering::Relaxed);
            let result = capped(x.tensor(), cap, mode, bias)?;
            let mut x = x.into_tensor();
            x.copy_from(&result)?;
            Ok(x)
        }),
    )
    .unwrap();
    registry.set_default("soft_cap", &["tanh_only", "counted"]).unwrap();
    registry
}

/// A model written once against the context with the generated calls: donated tanh (in place),
/// then a functional clamp with a bias, then a built-in.
fn model<C: ExecutionContext>(ctx: &C, x: C::Tensor, bias: &C::Tensor) -> Result<C::Tensor, CallError> {
    let scaled = ctx.scale(&x, 2.0)?;
    let tanh = soft_cap::call_maybe_inplace(ctx, scaled, 20.0, CapMode::Tanh, None)?;
    let clamped = soft_cap::call(ctx, &tanh, 10.0, CapMode::Clamp, Some(bias))?;
    ctx.add(&tanh, &clamped)
}

#[test]
fn the_declaration_gives_the_definition_and_typed_calls() {
    assert_eq!(
        SOFT_CAP.to_string(),
        r#"soft_cap(x: Tensor, cap: float, mode: Literal["tanh", "clamp"], bias: Optional[Tensor]) -> 1 output"#
    );
    assert_eq!(SOFT_CAP.activation_indices().unwrap(), [0]);
    // Each parameter's position, by name.
    assert_eq!([SoftCapArgs::x, SoftCapArgs::cap, SoftCapArgs::mode, SoftCapArgs::bias], [0, 1, 2, 3]);
    assert!(SOFT_CAP.allow_inplace);
    assert_eq!(CapMode::ALLOWED, ["tanh", "clamp"]);

    let (functional, inplace) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let registry = registry(Arc::clone(&functional), Arc::clone(&inplace));
    let x = Tensor::randn(&TensorMeta::compact(DType::F32, &[3, 8]), 5).unwrap().scale(30.0).unwrap();
    let expected = native(&x, 30.0, CapMode::Tanh, None).unwrap();

    let out = soft_cap::soft_cap(&registry, &x, 30.0, CapMode::Tanh, None).unwrap();
    assert!(bit_eq(&out, &expected));
    assert_ne!(out.storage_id(), x.storage_id(), "the functional call never writes its input");
    let clamped = soft_cap::soft_cap(&registry, &x, 30.0, CapMode::Clamp, None).unwrap();
    assert!(bit_eq(&clamped, &native(&x, 30.0, CapMode::Clamp, None).unwrap()));
    assert_eq!(functional.load(Ordering::Relaxed), 1, "the predicate sent clamp to the functional provider");

    let donated = x.deep_clone().unwrap();
    let storage = donated.storage_id();
    let out = soft_cap::maybe_inplace(&registry, donated, 30.0, CapMode::Tanh, None).unwrap();
    assert_eq!(out.storage_id(), storage, "written into the donated input");
    assert!(bit_eq(&out, &expected));
    assert_eq!(
        inplace.load(Ordering::Relaxed),
        2,
        "both tanh calls ran the in-place provider (on a copy when functional)"
    );

    // Validation comes from the same declaration.
    let err = soft_cap::soft_cap(&registry, &x, -1.0, CapMode::Tanh, None).unwrap_err().to_string();
    assert!(err.contains("`cap` = -1 is invalid: must be positive"), "{err}");
    let bias = Tensor::zeros(DType::F32, &[4]).unwrap();
    let err = soft_cap::soft_cap(&registry, &x, 1.0, CapMode::Tanh, Some(&bias)).unwrap_err().to_string();
    assert!(err.contains("`bias` has shape [4] but must be [H]"), "{err}");
}

#[test]
fn a_declared_op_traces_compiles_and_runs_like_a_built_in() {
    let (functional, inplace) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let registry = registry(Arc::clone(&functional), Arc::clone(&inplace));
    let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[4, 16]), 7).unwrap().scale(20.0).unwrap();
    let bias = Tensor::randn(&TensorMeta::compact(DType::BF16, &[16]), 8).unwrap();

    let eager = model(&EagerContext::new(&registry), x.clone(), &bias).unwrap();
    assert_eq!((inplace.load(Ordering::Relaxed), functional.load(Ordering::Relaxed)), (1, 1));

    let tracer = Tracer::new(&registry, "capped_model");
    let input = tracer.input("x", x.meta().clone());
    let bias_value = tracer.parameter("bias", &bias).unwrap();
    let out = model(&tracer, input, &bias_value).unwrap();
    let traced = tracer.finish(&[out]);
    let text = traced.graph.to_string();
    assert!(text.contains(r#"soft_cap.maybe_inplace(%0, 20.0, "tanh", none) : bf16[4,16]"#), "{text}");
    assert!(text.contains(r#"soft_cap(%1, 10.0, "clamp", %bias) : bf16[4,16]"#), "{text}");
    let reparsed = parse(&text).unwrap();
    assert!(reparsed.structurally_eq(&traced.graph), "{text}");
    ir_graph::verify(&reparsed, &registry).unwrap();
    let inputs = || vec![("x".to_owned(), x.clone()), ("bias".to_owned(), bias.clone())];
    let run = |graph: &ir_graph::Graph| interpret(graph, &registry, inputs(), InterpOptions::checked()).unwrap();
    assert!(bit_eq(&run(&reparsed).outputs[0], &eager), "the uncompiled graph runs like eager");

    let mut compiled = reparsed.clone();
    Pipeline::standard().run(&mut compiled, &PassContext::new(&registry), None, Snapshots::Skip).unwrap();
    let compiled_text = compiled.to_string();
    assert!(
        compiled_text.contains(r#"impl soft_cap[tanh_only] writes(0) (%0, 20.0, "tanh", none)"#),
        "the donated call lowers to the in-place kernel without a copy\n{compiled_text}"
    );
    assert!(compiled_text.contains("impl soft_cap[counted]"), "clamp goes to the functional provider\n{compiled_text}");
    assert!(bit_eq(&run(&compiled).outputs[0], &eager), "the compiled graph runs like eager\n{compiled_text}");
}

/// The declaration alone puts the engine's op on candle tensors: its generated context calls run
/// on `candle_ops::Candle`, the functional one reading its tensors, the donating one writing the
/// given activation in place (the same candle tensor comes back), both through the registry's
/// priorities and checks.
#[test]
fn a_declared_op_runs_on_candle_tensors_through_its_generated_calls() {
    use ir_ops::candle_ops::{Candle, CandleOpError};
    let (functional, inplace) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let registry = registry(Arc::clone(&functional), Arc::clone(&inplace));
    let ops = Candle(&registry);
    let x = Tensor::randn(&TensorMeta::compact(DType::F32, &[3, 8]), 9).unwrap().scale(30.0).unwrap();
    let to_candle = |t: &Tensor| t.deep_clone().unwrap().into_candle().unwrap();
    let ours = |t: &candle_core::Tensor| Tensor::from_candle(t).unwrap();
    let (cx, bias) = (to_candle(&x), Tensor::randn(&TensorMeta::compact(DType::F32, &[8]), 10).unwrap());
    let cbias = to_candle(&bias);

    // Functional: a fresh tensor, the input untouched; the clamp goes to the functional provider.
    let clamped = soft_cap::call(&ops, &cx, 10.0, CapMode::Clamp, Some(&cbias)).unwrap();
    assert!(bit_eq(&ours(&clamped), &native(&x, 10.0, CapMode::Clamp, Some(&bias)).unwrap()));
    assert!(bit_eq(&ours(&cx), &x), "the functional call never writes its input");
    assert_eq!(functional.load(Ordering::Relaxed), 1);

    // Donating: written in place by the in-place provider, and the same candle tensor returned.
    let out = soft_cap::call_maybe_inplace(&ops, cx.clone(), 30.0, CapMode::Tanh, None).unwrap();
    assert_eq!(out.id(), cx.id(), "the given activation comes back");
    assert!(bit_eq(&ours(&cx), &native(&x, 30.0, CapMode::Tanh, None).unwrap()), "written in place");
    assert_eq!(inplace.load(Ordering::Relaxed), 1);
    let record = registry.selection_record();
    assert_eq!(record.op("soft_cap").unwrap().inplace_writes, 1);

    // The declaration's validation, before anything is written.
    let before = ours(&cx);
    let err = soft_cap::call_maybe_inplace(&ops, cx.clone(), -1.0, CapMode::Tanh, None).unwrap_err();
    assert!(matches!(err, CandleOpError::Call(_)), "{err}");
    assert!(err.to_string().contains("`cap` = -1 is invalid: must be positive"), "{err}");
    assert!(bit_eq(&ours(&cx), &before), "nothing written");
}
