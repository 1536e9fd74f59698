//! Op definitions, implementation registration, priority resolution, guards and dispatch.

mod common;

use ir_core::Call;
use std::borrow::Cow;

use common::{capture, register_inplace, register_scaled_rms_norm, sample};
use ir_core::op::{
    ActivationError, Activations, ArgMeta, InputSpec, MetaError, OpDef, Overload, ParamDef, ParamKind, Value,
};
use ir_core::{
    Availability, CallError, DType, ImplFunc, ImplSpec, KernelError, NameKind, PriorityError, Registry, RegistryError,
    Support, Tensor, TensorError, TensorMeta, bit_eq,
};
use ir_ops::rms_norm::{self, RmsNormArgs, rms_norm};
use tracing::Level;

// --- throwaway ops defined at run time ---

fn identity_native(args: &[Value]) -> Result<ir_core::op::Outputs, KernelError> {
    let x = args[0].as_tensor().expect("bound");
    Ok(ir_core::op::smallvec![x.deep_clone()?])
}

fn identity_meta(
    def: &'static ir_core::op::OpDef,
    args: &[ArgMeta<'_>],
) -> Result<ir_core::op::OutputMetas, MetaError> {
    let x = args[0].tensor().ok_or(MetaError::Kind { op: def.name, param: "x" })?;
    Ok(ir_core::op::smallvec![TensorMeta { layout: x.layout.copy_layout(), ..x.clone() }])
}

fn no_inputs(_: &InputSpec) -> Result<Vec<Value>, TensorError> {
    Ok(vec![Value::Tensor(Tensor::zeros(DType::F32, &[1]).unwrap())])
}

const X: ParamDef = ParamDef { name: "x", kind: ParamKind::Tensor, default: None };

const fn op(
    name: &'static str,
    params: &'static [ParamDef],
    n_outputs: usize,
    activations: Activations,
    allow_inplace: bool,
) -> OpDef {
    OpDef {
        name,
        params,
        n_outputs,
        activations,
        allow_inplace,
        native: identity_native,
        meta: identity_meta,
        generate_inputs: no_inputs,
        tolerances: &[],
        description: "a test op",
    }
}

static GOOD_A1: OpDef = op("_a1", &[X], 1, Activations::Default, false);
static BAD_CAMEL: OpDef = op("RmsNorm", &[X], 1, Activations::Default, false);
static BAD_DIGIT: OpDef = op("1abc", &[X], 1, Activations::Default, false);
static BAD_DASH: OpDef = op("a-b", &[X], 1, Activations::Default, false);
static BAD_EMPTY: OpDef = op("", &[X], 1, Activations::Default, false);
static BAD_RESERVED: OpDef = op("clone", &[X], 1, Activations::Default, false);
static DUPLICATE_RMS_NORM: OpDef = op("rms_norm", &[X], 1, Activations::Default, false);

static TWO_TENSORS: &[ParamDef] = &[
    X,
    ParamDef { name: "y", kind: ParamKind::Tensor, default: None },
    ParamDef { name: "maybe", kind: ParamKind::OptTensor, default: None },
    ParamDef { name: "eps", kind: ParamKind::F64, default: None },
];
static EXPLICIT: OpDef = op("explicit_act", TWO_TENSORS, 2, Activations::Explicit(&["y", "x"]), true);
static UNKNOWN_ACT: OpDef = op("unknown_act", TWO_TENSORS, 1, Activations::Explicit(&["z"]), false);
static OPTIONAL_ACT: OpDef = op("optional_act", TWO_TENSORS, 1, Activations::Explicit(&["maybe"]), false);
static SCALAR_ACT: OpDef = op("scalar_act", TWO_TENSORS, 1, Activations::Explicit(&["eps"]), false);
static BAD_ARITY: OpDef = op("bad_arity", TWO_TENSORS, 1, Activations::Explicit(&["x", "y"]), true);
/// In place with no activation: nothing to write into.
static NO_ACT_INPLACE: OpDef = op(
    "no_act_inplace",
    &[ParamDef { name: "y", kind: ParamKind::Tensor, default: None }],
    1,
    Activations::Default,
    true,
);
static NO_OUTPUTS: OpDef = op("no_outputs", &[X], 0, Activations::Default, false);

#[test]
fn op_names_are_checked() {
    let line = line!() + 1;
    let registry = ir_ops::registry();
    registry.define_op(&GOOD_A1).unwrap();
    for (def, expected) in [
        (&BAD_CAMEL, "invalid op name `RmsNorm`"),
        (&BAD_DIGIT, "invalid op name `1abc`"),
        (&BAD_DASH, "invalid op name `a-b`"),
        (&BAD_EMPTY, "invalid op name ``"),
        (&BAD_RESERVED, "op name `clone` is reserved"),
    ] {
        let err = registry.define_op(def).unwrap_err();
        assert!(err.to_string().contains(expected), "{err}");
    }
    let err = registry.define_op(&DUPLICATE_RMS_NORM).unwrap_err();
    let RegistryError::DuplicateOp { name, first } = &err else { panic!("expected DuplicateOp, got {err}") };
    assert_eq!(name, "rms_norm");
    // `ir_ops::registry` is `#[track_caller]`: the location is the caller's line.
    assert_eq!((first.file(), first.line()), (file!(), line), "first definition at {first}");
    assert!(err.to_string().contains("first defined at"), "{err}");
    let builtins: Vec<&str> = ir_ops::BUILTIN_OPS.iter().map(|d| d.name).collect();
    assert_eq!(registry.ops(), [builtins, vec!["_a1"]].concat());
    // The duplicate did not replace the original.
    assert!(std::ptr::eq(registry.op_def("rms_norm").unwrap(), &rms_norm::RMS_NORM));
}

#[test]
fn duplicate_op_names_the_location_of_a_user_definition() {
    let registry = Registry::new();
    let line = line!() + 1;
    registry.define_op(&GOOD_A1).unwrap();
    let err = registry.define_op(&GOOD_A1).unwrap_err();
    let RegistryError::DuplicateOp { first, .. } = err else { panic!("expected DuplicateOp") };
    assert_eq!((first.file(), first.line()), (file!(), line));
}

#[test]
fn activations() {
    let registry = ir_ops::registry();
    assert_eq!(registry.activations("rms_norm"), Some(vec![0]));
    assert_eq!(registry.activations("fused_add_rms_norm"), Some(vec![0, 1]));
    registry.define_op(&EXPLICIT).unwrap();
    assert_eq!(registry.activations("explicit_act"), Some(vec![1, 0]));
    let err = registry.define_op(&UNKNOWN_ACT).unwrap_err();
    assert_eq!(err, RegistryError::Activation(ActivationError::Unknown { op: "unknown_act".into(), name: "z".into() }));
    // An optional tensor may be an activation (donated when given, like rotary_embedding's key).
    registry.define_op(&OPTIONAL_ACT).unwrap();
    assert_eq!(registry.activations("optional_act"), Some(vec![2]));
    let err = registry.define_op(&SCALAR_ACT).unwrap_err();
    assert!(matches!(err, RegistryError::Activation(ActivationError::NotTensor { kind: ParamKind::F64, .. })), "{err}");
    let err = registry.define_op(&BAD_ARITY).unwrap_err();
    assert_eq!(err, RegistryError::InplaceArity { op: "bad_arity".into(), outputs: 1, activations: 2 });
    let err = registry.define_op(&NO_ACT_INPLACE).unwrap_err();
    assert_eq!(err, RegistryError::InplaceArity { op: "no_act_inplace".into(), outputs: 1, activations: 0 });
    // Fewer activations than outputs: the first outputs are written in place, the rest are fresh.
    assert_eq!(registry.activations("fused_add_rms_norm_static_fp8_quant"), Some(vec![1]));
    assert!(matches!(registry.define_op(&NO_OUTPUTS), Err(RegistryError::NoOutputs { .. })));
    assert!(registry.op_def("bad_arity").is_none(), "a failed definition leaves nothing behind");
}

// --- implementation registration ---

fn spec(name: &'static str) -> ImplSpec {
    ImplSpec::new(name)
}

#[test]
fn implementation_registration_failures_leave_nothing_behind() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("alpha"), 2.0);
    let before = registry.providers("rms_norm");

    let reserved = rms_norm::register(&registry, spec("native"), rms_norm::native).unwrap_err();
    assert_eq!(reserved, RegistryError::ReservedName { kind: NameKind::Provider, name: "native".into() });
    let reserved = rms_norm::register(&registry, spec("unfused"), rms_norm::native).unwrap_err();
    assert!(matches!(reserved, RegistryError::ReservedName { .. }));
    let bad = rms_norm::register(&registry, spec("Bad-Name"), rms_norm::native).unwrap_err();
    assert!(matches!(bad, RegistryError::InvalidName { kind: NameKind::Provider, .. }), "{bad}");
    let duplicate = rms_norm::register(&registry, spec("alpha"), rms_norm::native).unwrap_err();
    let RegistryError::DuplicateProvider { first, .. } = &duplicate else { panic!("{duplicate}") };
    assert!(first.file().ends_with("common/mod.rs"), "{first}");
    let inplace = registry
        .register_impl(
            "rms_norm",
            spec("writer"),
            ImplFunc::inplace(|args| Ok(vec![args[0].as_tensor().unwrap().clone()])),
        )
        .unwrap_err();
    assert_eq!(inplace, RegistryError::InplaceNotAllowed { op: "rms_norm".into(), provider: "writer".into() });
    let unknown =
        registry.register_impl("no_such_op", spec("alpha"), ImplFunc::functional(|_| Ok(vec![]))).unwrap_err();
    assert!(unknown.to_string().contains("known: rms_norm, fused_add_rms_norm"), "{unknown}");

    assert_eq!(registry.providers("rms_norm"), before, "failed registrations change nothing");
    // The original `alpha` still runs: it doubles native's result.
    let _guard = registry.override_priority("rms_norm", &["alpha"]).unwrap();
    let x = sample(DType::F32, 2, 8, 1);
    let y = rms_norm(&registry, &x, None, 1e-6, None).unwrap();
    let expected = rms_norm::native(&x, None, 1e-6, None).unwrap().scale(2.0).unwrap();
    assert!(bit_eq(&y, &expected));
}

#[test]
fn registering_twice_in_one_registry_fails_but_registries_are_independent() {
    let a = ir_ops::registry();
    let b = ir_ops::registry();
    register_inplace(&a, "p");
    register_inplace(&b, "p");
    let again = ir_ops::fused_add_rms_norm::register(
        &a,
        spec("p"),
        ir_ops::fused_add_rms_norm::FusedAddRmsNormImpl::inplace(common::inplace_fused),
    );
    assert!(matches!(again, Err(RegistryError::DuplicateProvider { .. })));
}

// --- no priority installed ---

#[test]
fn without_priorities_native_runs_and_is_logged_once() {
    let registry = ir_ops::registry();
    let x = sample(DType::BF16, 4, 16, 2);
    let w = sample(DType::BF16, 1, 16, 3).reshape(&[16]).unwrap();
    let expected = rms_norm::native(&x, Some(&w), 1e-6, None).unwrap();
    let (results, events) =
        capture(|| (0..10).map(|_| rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap()).collect::<Vec<_>>());
    for y in &results {
        assert!(bit_eq(y, &expected));
    }
    let warning = "priority not set for op rms_norm, using native (0 other provider(s) registered); install the \
                   platform's priorities with `PriorityConfig::detected().apply(&registry)`";
    assert_eq!(events.count(Level::WARN, warning), 1, "warned once, naming the fix");
    register_scaled_rms_norm(&registry, spec("extra"), 3.0);
    let y = rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap();
    assert!(bit_eq(&y, &expected), "registering a provider does not install it");
    assert_eq!(registry.installed_priority("rms_norm"), None);
}

// --- guards ---

#[test]
fn nested_guards_restore_in_order() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("a"), 2.0);
    register_scaled_rms_norm(&registry, spec("b"), 4.0);
    {
        let _outer = registry.override_priority("rms_norm", &["a"]).unwrap();
        assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["a"]));
        {
            let _inner = registry.override_priority("rms_norm", &["b", "native"]).unwrap();
            assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["b"]));
        }
        assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["a"]));
    }
    assert_eq!(registry.installed_priority("rms_norm"), None);
}

#[test]
fn guards_dropped_out_of_order_remove_their_own_layer() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("a"), 2.0);
    register_scaled_rms_norm(&registry, spec("b"), 4.0);
    registry.set_default("rms_norm", &["native"]).unwrap();
    let outer = registry.override_priority("rms_norm", &["a"]).unwrap();
    let inner = registry.override_priority("rms_norm", &["b"]).unwrap();
    drop(outer);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["b"]));
    // set_default replaces the bottom without disturbing live guards.
    registry.set_default("rms_norm", &["a"]).unwrap();
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["b"]));
    drop(inner);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["a"]));
}

#[test]
fn guards_restore_after_a_panic() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("a"), 2.0);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _guard = registry.override_priority("rms_norm", &["a"]).unwrap();
        assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["a"]));
        panic!("boom");
    }));
    assert!(result.is_err());
    assert_eq!(registry.installed_priority("rms_norm"), None);
    // The registry still works after the panic.
    let x = sample(DType::F32, 1, 8, 0);
    assert!(rms_norm(&registry, &x, None, 1e-6, None).is_ok());
}

#[test]
fn guards_restore_on_early_return() {
    fn early(registry: &Registry) -> Result<(), PriorityError> {
        let _guard = registry.override_priority("rms_norm", &["a"])?;
        let _second = registry.override_priority("rms_norm", &["missing"])?;
        unreachable!("the second override fails");
    }
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("a"), 2.0);
    assert!(early(&registry).is_err());
    assert_eq!(registry.installed_priority("rms_norm"), None);
}

// --- order and availability ---

#[test]
fn order_decides_through_typed_and_dynamic_entry_points() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("a"), 2.0);
    register_scaled_rms_norm(&registry, spec("b"), 4.0);
    let x = sample(DType::F32, 3, 8, 4);
    let native = rms_norm::native(&x, None, 1e-6, None).unwrap();
    let scaled = |f: f64| native.scale(f).unwrap();
    let dynamic = |registry: &Registry| {
        registry
            .run(Call::new(
                "rms_norm",
                Overload::Default,
                vec![Value::Tensor(x.clone()), Value::None, Value::F64(1e-6)],
            ))
            .unwrap()
            .remove(0)
    };

    let _outer = registry.override_priority("rms_norm", &["b", "a"]).unwrap();
    assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(4.0)));
    assert!(bit_eq(&dynamic(&registry), &scaled(4.0)));
    {
        let _inner = registry.override_priority("rms_norm", &["a"]).unwrap();
        assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(2.0)));
        assert!(bit_eq(&dynamic(&registry), &scaled(2.0)));
    }
    assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(4.0)));
}

#[test]
fn unavailable_providers_are_skipped_with_the_reason_logged() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(
        &registry,
        spec("gone").with_probe(|| Availability::Unavailable("libgone.so not found".into())),
        8.0,
    );
    register_scaled_rms_norm(&registry, spec("a"), 2.0);
    let (resolved, events) = capture(|| registry.resolve_priority("rms_norm", &["gone", "a"]).unwrap());
    assert_eq!(resolved, vec!["a"]);
    let skipped = events.events().into_iter().find(|e| e.message.contains("skipping unavailable provider")).unwrap();
    assert!(skipped.fields.contains("libgone.so not found"), "{skipped:?}");
    let info = registry.providers("rms_norm").into_iter().find(|p| p.name == "gone").unwrap();
    assert_eq!(info.availability, Availability::Unavailable("libgone.so not found".into()));
    assert_eq!(registry.available_providers("rms_norm"), vec!["native", "a"]);
}

#[test]
fn a_panicking_probe_is_unavailable() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("crashy").with_probe(|| panic!("libcuda missing")), 2.0);
    let info = registry.providers("rms_norm").into_iter().find(|p| p.name == "crashy").unwrap();
    let Availability::Unavailable(reason) = info.availability else { panic!("expected unavailable") };
    assert!(reason.contains("libcuda missing"), "{reason}");
    assert_eq!(registry.resolve_priority("rms_norm", &["crashy", "native"]).unwrap(), vec!["native"]);
}

#[test]
fn the_probe_runs_at_most_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let registry = ir_ops::registry();
    register_scaled_rms_norm(
        &registry,
        spec("counted").with_probe(|| {
            CALLS.fetch_add(1, Ordering::SeqCst);
            Availability::Available
        }),
        2.0,
    );
    for _ in 0..5 {
        registry.resolve_priority("rms_norm", &["counted"]).unwrap();
        registry.providers("rms_norm");
    }
    assert_eq!(CALLS.load(Ordering::SeqCst), 1);
}

// --- resolution rules ---

fn even_only(args: &[ArgMeta<'_>]) -> Support {
    let args = RmsNormArgs::from_meta(args).expect("bound rms_norm arguments");
    if args.x.layout.last_dim().is_multiple_of(2) {
        Support::Yes
    } else {
        Support::No(Cow::Owned(format!("hidden size {} is odd", args.x.layout.last_dim())))
    }
}

#[test]
fn resolution_examples() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("even").with_supports(even_only), 2.0);
    register_scaled_rms_norm(&registry, spec("a"), 2.0);
    register_scaled_rms_norm(&registry, spec("cpu"), 3.0);
    register_scaled_rms_norm(&registry, spec("off").with_probe(|| Availability::Unavailable("no device".into())), 3.0);
    let cases: &[(&[&str], &[&str])] = &[
        (&["even"], &["even", "native"]),
        (&["off", "a"], &["a"]),
        (&[], &["native"]),
        (&["native", "cpu"], &["native"]),
        (&["even", "a", "cpu"], &["even", "a"]),
        (&["even", "even", "a"], &["even", "even", "a"]),
        (&["off"], &["native"]),
    ];
    for (names, expected) in cases {
        assert_eq!(registry.resolve_priority("rms_norm", names).unwrap(), *expected, "{names:?}");
    }
}

#[test]
fn empty_list_resolves_to_native_with_the_warning() {
    let registry = ir_ops::registry();
    let (guard, events) = capture(|| registry.override_priority("rms_norm", &[] as &[&str]).unwrap());
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["native"]));
    assert_eq!(events.count(Level::WARN, "no provider in the priority list supports all arguments"), 1);
    drop(guard);
}

#[test]
fn a_conditional_provider_alone_gets_native_appended_and_one_warning() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("even").with_supports(even_only), 2.0);
    let (guard, install_events) = capture(|| registry.override_priority("rms_norm", &["even"]).unwrap());
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["even", "native"]));
    let warning = "op rms_norm: no provider in the priority list supports all arguments; calls may fall back to \
                   native; add `native` at the end of the list to silence this";
    assert_eq!(install_events.count(Level::WARN, warning), 1);

    let even = sample(DType::F32, 3, 8, 5);
    let odd = sample(DType::F32, 3, 7, 6);
    let (results, call_events) = capture(|| {
        (0..5)
            .map(|_| {
                (
                    rms_norm(&registry, &even, None, 1e-6, None).unwrap(),
                    rms_norm(&registry, &odd, None, 1e-6, None).unwrap(),
                )
            })
            .collect::<Vec<_>>()
    });
    let even_expected = rms_norm::native(&even, None, 1e-6, None).unwrap().scale(2.0).unwrap();
    let odd_expected = rms_norm::native(&odd, None, 1e-6, None).unwrap();
    for (e, o) in &results {
        assert!(bit_eq(e, &even_expected), "even H runs the conditional provider");
        assert!(bit_eq(o, &odd_expected), "odd H falls back to native");
    }
    // Five odd calls fell back to native: said once (one reason), counted five times.
    assert_eq!(call_events.events().iter().filter(|e| e.level == Level::WARN).count(), 1);
    assert_eq!(call_events.count(Level::WARN, "even: "), 1, "names the provider and its reason");
    assert_eq!(registry.selection_record().op("rms_norm").unwrap().native_fallbacks, 5);
    // Installing the same kind of list again does not warn again (warn once per registry and op).
    let (again, again_events) = capture(|| registry.override_priority("rms_norm", &["even"]).unwrap());
    assert_eq!(again_events.count(Level::WARN, "no provider"), 0);
    drop(again);
    drop(guard);
}

#[test]
fn unknown_providers_are_an_error_and_install_nothing() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("a"), 2.0);
    let err = registry.override_priority("rms_norm", &["a", "bogus", "nope"]).unwrap_err();
    assert_eq!(
        err,
        PriorityError::UnknownProvider {
            op: "rms_norm".into(),
            unknown: vec!["bogus".into(), "nope".into()],
            known: vec!["native".into(), "a".into()],
        }
    );
    assert_eq!(err.to_string(), "unknown providers `bogus`, `nope` in priority list for `rms_norm` (known: native, a)");
    assert_eq!(registry.installed_priority("rms_norm"), None);
    assert!(matches!(registry.set_default("rms_norm", &["bogus"]), Err(PriorityError::UnknownProvider { .. })));
    assert_eq!(registry.installed_priority("rms_norm"), None);
    let unknown_op = registry.set_default("group_norm", &["native"]).unwrap_err();
    assert!(unknown_op.to_string().starts_with("unknown op `group_norm`"), "{unknown_op}");
}

#[test]
fn a_provider_registered_after_installation_joins_after_the_pinned_names() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("even").with_supports(even_only), 2.0);
    registry.set_default("rms_norm", &["even", "native"]).unwrap();
    let guard = registry.override_priority("rms_norm", &["native"]).unwrap();
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["native"]), "native is unconditional");
    let ((), events) = capture(|| register_scaled_rms_norm(&registry, spec("late"), 3.0));
    assert_eq!(events.count(Level::INFO, "joins every installed list after the entries users listed"), 1);
    // Both lists were written by the caller: the late provider goes after their names, where native
    // (unconditional) already ends them, so neither list changes.
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["native"]), "override_priority pins");
    drop(guard);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["even", "native"]), "set_default pins");
    let odd = sample(DType::F32, 2, 7, 1);
    let y = rms_norm(&registry, &odd, None, 1e-6, None).unwrap();
    assert!(bit_eq(&y, &rms_norm::native(&odd, None, 1e-6, None).unwrap()), "odd H: `even` rejects, native runs");

    // A guard's own names and those pinned below it stay in front; a name the user did not end with
    // native leaves room before the platform's native (here a default list without pinned names).
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("even").with_supports(even_only), 2.0);
    register_scaled_rms_norm(&registry, spec("mine").with_supports(even_only), 5.0);
    ir_core::PriorityConfig::platform_default(ir_core::Platform::Cpu).apply(&registry).unwrap();
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["native"]), "no cpu provider registered");
    let _mine = registry.override_priority("rms_norm", &["mine", "even"]).unwrap();
    register_scaled_rms_norm(&registry, spec("late"), 3.0);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["mine", "even", "late"]));
    let y = rms_norm(&registry, &odd, None, 1e-6, None).unwrap();
    let expected = rms_norm::native(&odd, None, 1e-6, None).unwrap().scale(3.0).unwrap();
    assert!(bit_eq(&y, &expected), "odd H: `mine` and `even` reject, the late provider runs before native");
}

#[test]
fn overrides_in_code_put_their_entries_first_and_keep_the_list_below() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("even").with_supports(even_only), 2.0);
    register_scaled_rms_norm(&registry, spec("mine").with_supports(even_only), 5.0);
    registry.set_default("rms_norm", &["even", "native"]).unwrap();
    let guard = registry.override_priority("rms_norm", &["mine"]).unwrap();
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["mine", "even", "native"]), "even is kept");
    {
        let _inner = registry.override_priority("rms_norm", &["even"]).unwrap();
        assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["even", "mine", "native"]));
    }
    drop(guard);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["even", "native"]));
}

// --- predicates, threads, records ---

#[test]
fn predicates_do_not_depend_on_the_number_of_tokens() {
    // Every provider registers under a unique, well-formed name: checked for the providers of this
    // crate's tests; kernel crates run the same check on theirs.
    for tokens in [1, 7, 2048, 65536] {
        for hidden in [7, 8, 4096] {
            let shapes = [vec![tokens, hidden], vec![2, tokens, hidden]];
            for shape in shapes {
                let meta = TensorMeta::compact(DType::BF16, &shape);
                let args = [ArgMeta::Tensor(&meta), ArgMeta::None, ArgMeta::F64(1e-6), ArgMeta::None];
                let expected = hidden.is_multiple_of(2);
                assert_eq!(even_only(&args) == Support::Yes, expected, "{shape:?}");
            }
        }
    }
}

#[test]
fn registries_in_many_threads_do_not_interfere() {
    let x = sample(DType::F32, 4, 8, 9);
    let native = rms_norm::native(&x, None, 1e-6, None).unwrap();
    std::thread::scope(|scope| {
        for factor in [2.0, 4.0, 8.0, 16.0] {
            let x = &x;
            let native = &native;
            scope.spawn(move || {
                let registry = ir_ops::registry();
                register_scaled_rms_norm(&registry, spec("p"), factor);
                let _guard = registry.override_priority("rms_norm", &["p"]).unwrap();
                for _ in 0..50 {
                    let y = rms_norm(&registry, x, None, 1e-6, None).unwrap();
                    assert!(bit_eq(&y, &native.scale(factor).unwrap()));
                }
            });
        }
    });
}

#[test]
fn one_registry_shared_by_threads_with_guards_on_different_ops() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("p"), 2.0);
    register_inplace(&registry, "q");
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..100 {
                let _guard = registry.override_priority("rms_norm", &["p"]).unwrap();
            }
        });
        scope.spawn(|| {
            for _ in 0..100 {
                let _guard = registry.override_priority("fused_add_rms_norm", &["q"]).unwrap();
            }
        });
    });
    assert_eq!(registry.installed_priority("rms_norm"), None);
    assert_eq!(registry.installed_priority("fused_add_rms_norm"), None);
}

#[test]
fn the_selection_record_and_debug_event_name_chosen_and_rejected_providers() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("even").with_supports(even_only), 2.0);
    let _guard = registry.override_priority("rms_norm", &["even", "native"]).unwrap();
    let odd = sample(DType::F32, 2, 7, 1);
    let even = sample(DType::F32, 2, 8, 1);
    let (_, events) = capture(|| {
        rms_norm(&registry, &odd, None, 1e-6, None).unwrap();
        rms_norm(&registry, &even, None, 1e-6, None).unwrap();
        rms_norm(&registry, &even, None, 1e-6, None).unwrap();
    });
    let dispatch: Vec<_> = events.events().into_iter().filter(|e| e.target == "ir_core::dispatch").collect();
    assert_eq!(dispatch.len(), 3);
    assert!(dispatch[0].message.contains("selected native for rms_norm"), "{:?}", dispatch[0]);
    assert!(dispatch[0].fields.contains("rejected=[even: hidden size 7 is odd]"), "{:?}", dispatch[0]);
    assert!(dispatch[0].fields.contains("args=(f32[2,7], none, 1e-6, none)"), "{:?}", dispatch[0]);
    assert!(dispatch[1].message.contains("selected even"), "{:?}", dispatch[1]);

    let record = registry.selection_record();
    assert_eq!(record.selections("rms_norm", "native"), 1);
    assert_eq!(record.selections("rms_norm", "even"), 2);
    let even_record = record.op("rms_norm").unwrap().providers.iter().find(|p| p.provider == "even").unwrap();
    assert_eq!(even_record.last_rejection.as_deref(), Some("hidden size 7 is odd"));
    registry.reset_selection_record();
    assert_eq!(registry.selection_record().selections("rms_norm", "even"), 0);
}

#[test]
fn selection_on_metadata_follows_the_same_rules() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("even").with_supports(even_only), 2.0);
    let _guard = registry.override_priority("rms_norm", &["even"]).unwrap();
    let odd = TensorMeta::compact(DType::BF16, &[4, 9]);
    let selection = registry.select("rms_norm", &[ArgMeta::Tensor(&odd), ArgMeta::None, ArgMeta::F64(1e-6)]).unwrap();
    assert_eq!(selection.provider, "native");
    assert_eq!(selection.rejected.len(), 1);
    assert_eq!(selection.outputs, vec![odd.clone()]);
    let err = registry.select("rms_norm", &[ArgMeta::F64(1.0)]).unwrap_err();
    assert!(matches!(err, CallError::Bind(_)), "{err}");
}

#[test]
fn bind_fills_defaults_and_checks_kinds() {
    let registry = ir_ops::registry();
    let x = sample(DType::F32, 2, 4, 0);
    let ok = registry.run(Call::new(
        "rms_norm",
        Overload::Default,
        vec![Value::Tensor(x.clone()), Value::None, Value::F64(1e-6)],
    ));
    assert!(ok.is_ok());
    let err = registry
        .run(Call::new("rms_norm", Overload::Default, vec![Value::Tensor(x.clone()), Value::None]))
        .unwrap_err();
    assert_eq!(err.to_string(), "op `rms_norm`: missing argument for parameter `epsilon`");
    let err = registry
        .run(Call::new("rms_norm", Overload::Default, vec![Value::Tensor(x.clone()), Value::None, Value::I64(1)]))
        .unwrap_err();
    assert_eq!(err.to_string(), "op `rms_norm`: parameter `epsilon` expects float, found an integer");
    let err = registry
        .run(Call::new(
            "rms_norm",
            Overload::Default,
            vec![Value::Tensor(x.clone()), Value::None, Value::F64(1e-6), Value::None, Value::None],
        ))
        .unwrap_err();
    assert_eq!(err.to_string(), "op `rms_norm` takes 4 arguments but 5 were given");
    let err = registry.run(Call::new("group_norm", Overload::Default, vec![])).unwrap_err();
    assert!(matches!(err, CallError::UnknownOp { .. }));
    let err = registry
        .run(Call::new("rms_norm", Overload::MaybeInplace, vec![Value::Tensor(x), Value::None, Value::F64(1e-6)]))
        .unwrap_err();
    assert_eq!(err, CallError::NotInplaceOp { op: "rms_norm" });
}

#[test]
fn generators_are_deterministic_and_tolerances_exist() {
    for def in ir_ops::BUILTIN_OPS {
        for dtype in DType::COMPUTE {
            let spec = InputSpec { num_tokens: 3, hidden_size: 8, dtype, epsilon: 1e-6, seed: 42 };
            let a = (def.generate_inputs)(&spec).unwrap();
            let b = (def.generate_inputs)(&spec).unwrap();
            assert_eq!(a.len(), def.params.len(), "{}: a complete argument list", def.name);
            let activations = def.activation_indices().unwrap();
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                match (x, y) {
                    (Value::Tensor(x), Value::Tensor(y)) => {
                        assert!(bit_eq(x, y));
                        if activations.contains(&i) {
                            assert_eq!(x.dtype(), dtype, "{}: activations have the spec's dtype", def.name);
                        }
                    }
                    (x, y) if x.as_tensor().is_none() => {
                        assert_eq!(x.meta(), y.meta(), "{}: scalars are deterministic", def.name)
                    }
                    other => panic!("{}: generator results differ: {other:?}", def.name),
                }
            }
            let other = (def.generate_inputs)(&InputSpec { seed: 43, ..spec }).unwrap();
            assert!(!bit_eq(a[0].as_tensor().unwrap(), other[0].as_tensor().unwrap()), "the seed matters");
            let tolerance = ir_core::op::tolerance(def, dtype).unwrap();
            assert!(tolerance.atol > 0.0 && tolerance.rtol > 0.0);
        }
    }
}

// --- predicates are user code: no registry lock is held while they run ---

/// A registry that predicates can capture.
fn leaked_registry() -> &'static Registry {
    Box::leak(Box::new(ir_ops::registry()))
}

/// Runs `f` on another thread; a deadlock fails the test after `seconds` instead of hanging it.
fn within_seconds<T: Send + 'static>(seconds: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    receiver.recv_timeout(std::time::Duration::from_secs(seconds)).expect("the call returns (no deadlock, no panic)")
}

fn rms_norm_meta_select(registry: &Registry) -> Result<ir_core::Selection, CallError> {
    let x = TensorMeta::compact(DType::F32, &[2, 8]);
    registry.select("rms_norm", &[ArgMeta::Tensor(&x), ArgMeta::None, ArgMeta::F64(1e-6), ArgMeta::None])
}

#[test]
fn a_predicate_may_edit_priorities_of_its_own_op() {
    let registry = leaked_registry();
    let predicate = move |_: &[ArgMeta<'_>]| {
        let guard = registry.override_priority("rms_norm", &["native"]).expect("a valid list installs");
        drop(guard);
        Support::Yes
    };
    register_scaled_rms_norm(registry, spec("meddler").with_supports(predicate), 2.0);
    registry.set_default("rms_norm", &["meddler"]).unwrap();
    let x = sample(DType::F32, 2, 8, 1);
    let (provider, out) = within_seconds(20, move || {
        let provider = rms_norm_meta_select(registry).unwrap().provider;
        (provider, rms_norm(registry, &x, None, 1e-6, None).unwrap())
    });
    assert_eq!(provider, "meddler");
    let expected = rms_norm::native(&sample(DType::F32, 2, 8, 1), None, 1e-6, None).unwrap().scale(2.0).unwrap();
    assert!(bit_eq(&out, &expected), "the meddler ran");
    assert_eq!(registry.installed_priority("rms_norm").unwrap(), ["meddler", "native"], "its guard restored the list");
}

#[test]
fn a_predicate_reentering_the_registry_while_a_writer_waits_does_not_deadlock() {
    let registry = leaked_registry();
    let (entered, entered_receiver) = std::sync::mpsc::channel::<()>();
    let entered = std::sync::Mutex::new(Some(entered));
    let predicate = move |_: &[ArgMeta<'_>]| {
        if let Some(entered) = entered.lock().unwrap().take() {
            entered.send(()).unwrap();
            // Let the writer queue up behind whatever lock dispatch might still hold.
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        assert!(registry.installed_priority("rms_norm").is_some());
        assert!(!registry.providers("rms_norm").is_empty());
        Support::Yes
    };
    register_scaled_rms_norm(registry, spec("reentrant").with_supports(predicate), 2.0);
    registry.set_default("rms_norm", &["reentrant"]).unwrap();
    let writer = std::thread::spawn(move || {
        entered_receiver.recv().unwrap();
        registry.set_default("rms_norm", &["reentrant", "native"]).unwrap();
    });
    let provider = within_seconds(20, move || rms_norm_meta_select(registry).unwrap().provider);
    assert_eq!(provider, "reentrant");
    writer.join().unwrap();
}

fn panicking_predicate(_: &[ArgMeta<'_>]) -> Support {
    panic!("the flaky predicate failed")
}

#[test]
fn a_panicking_predicate_is_a_rejection_with_the_panic_message() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("flaky").with_supports(panicking_predicate), 2.0);
    registry.set_default("rms_norm", &["flaky"]).unwrap();
    let selection = rms_norm_meta_select(&registry).unwrap();
    assert_eq!(selection.provider, "native");
    assert_eq!(selection.rejected.len(), 1);
    let reason = selection.rejected[0].reason.to_string();
    assert!(reason.contains("supports predicate panicked: the flaky predicate failed"), "{reason}");

    let x = sample(DType::F32, 2, 8, 3);
    let out = rms_norm(&registry, &x, None, 1e-6, None).unwrap();
    assert!(bit_eq(&out, &rms_norm::native(&x, None, 1e-6, None).unwrap()), "eager dispatch fell back to native");

    let args = vec![Value::Tensor(x), Value::None, Value::F64(1e-6), Value::None];
    let err = registry.run(Call::new("rms_norm", Overload::Default, args).provider("flaky")).unwrap_err();
    assert!(
        matches!(&err, CallError::Unsupported { reason, .. } if reason.contains("the flaky predicate failed")),
        "{err}"
    );
    assert!(rms_norm_meta_select(&registry).is_ok(), "the registry stays usable");
}

// --- providers made at run time, closures, replacement ---

fn scaled_native(factor: f64) -> ImplFunc {
    ImplFunc::functional(move |args| {
        let x = args[0].as_tensor().expect("bound");
        Ok(vec![rms_norm::native(x, None, 1e-6, None)?.scale(factor)?])
    })
}

#[test]
fn a_provider_name_made_at_run_time_registers_dispatches_and_cannot_be_registered_twice() {
    let registry = ir_ops::registry();
    let plugin = format!("plugin_{}", 3);
    registry.register_impl("rms_norm", ImplSpec::new(plugin.clone()), scaled_native(2.0)).unwrap();
    registry.set_default("rms_norm", &[plugin.as_str()]).unwrap();
    let x = sample(DType::F32, 2, 8, 5);
    let out = rms_norm(&registry, &x, None, 1e-6, None).unwrap();
    assert!(bit_eq(&out, &rms_norm::native(&x, None, 1e-6, None).unwrap().scale(2.0).unwrap()));
    assert_eq!(registry.installed_priority("rms_norm").unwrap(), ["plugin_3"]);

    let err = registry.register_impl("rms_norm", ImplSpec::new(plugin.clone()), scaled_native(3.0)).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("provider `plugin_3` is already registered for op `rms_norm`"), "{message}");
    assert!(message.contains("to swap its implementation, call `Registry::replace_impl`"), "{message}");
    let err = registry.register_impl("rms_norm", ImplSpec::new(String::from("Bad-Name")), scaled_native(1.0));
    assert!(matches!(err, Err(RegistryError::InvalidName { kind: NameKind::Provider, .. })), "{err:?}");
}

#[test]
fn replacing_an_implementation_keeps_its_place_in_every_installed_list() {
    let registry = ir_ops::registry();
    registry.register_impl("rms_norm", spec("mine"), scaled_native(2.0)).unwrap();
    registry.set_default("rms_norm", &["mine"]).unwrap();
    let guard = registry.override_priority("rms_norm", &["mine", "native"]).unwrap();
    let x = sample(DType::F32, 2, 8, 6);
    let reference = rms_norm::native(&x, None, 1e-6, None).unwrap();
    let run = || rms_norm(&registry, &x, None, 1e-6, None).unwrap();
    assert!(bit_eq(&run(), &reference.scale(2.0).unwrap()));

    registry.replace_impl("rms_norm", spec("mine"), scaled_native(3.0)).unwrap();
    assert!(bit_eq(&run(), &reference.scale(3.0).unwrap()), "the scoped list runs the new function");
    drop(guard);
    assert!(bit_eq(&run(), &reference.scale(3.0).unwrap()), "so does the default list");

    // A replacement that cannot run here is skipped, as resolution skips any unavailable provider.
    let offline = spec("mine").with_probe(|| Availability::Unavailable("unplugged".into()));
    registry.replace_impl("rms_norm", offline, scaled_native(4.0)).unwrap();
    assert_eq!(registry.installed_priority("rms_norm").unwrap(), ["native"]);
    assert!(bit_eq(&run(), &reference));

    let err = registry.replace_impl("rms_norm", spec("absent"), scaled_native(1.0)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "provider `absent` is not registered for op `rms_norm`, so it cannot be replaced; register it with \
         `Registry::register_impl`"
    );
}

#[test]
fn typed_implementations_are_closures_that_may_capture_state() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let registry = ir_ops::registry();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let kernel = ir_ops::fused_add_rms_norm::FusedAddRmsNormImpl::inplace(move |x, r, w, eps, v, rounding| {
        counted.fetch_add(1, Ordering::Relaxed);
        common::inplace_fused(x, r, w, eps, v, rounding)
    });
    ir_ops::fused_add_rms_norm::register(&registry, spec("counted"), kernel).unwrap();
    registry.set_default("fused_add_rms_norm", &["counted"]).unwrap();
    let (x, r) = (sample(DType::F32, 2, 8, 7), sample(DType::F32, 2, 8, 8));
    ir_ops::fused_add_rms_norm::maybe_inplace(&registry, x, r, None, 1e-6, None, ir_ops::Rounding::Exact).unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}

// --- the typed call path and each thread's remembered selections ---

/// The result of `factor · native` for `x`.
fn scaled(x: &Tensor, factor: f64) -> Tensor {
    rms_norm::native(x, None, 1e-6, None).unwrap().scale(factor).unwrap()
}

#[test]
fn a_remembered_selection_never_outlives_a_priority_change() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("p"), 2.0);
    register_scaled_rms_norm(&registry, spec("q"), 3.0);
    registry.set_default("rms_norm", &["p", "native"]).unwrap();
    let x = sample(DType::F32, 2, 8, 1);
    for _ in 0..3 {
        assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 2.0)));
    }
    {
        let _q = registry.override_priority("rms_norm", &["q"]).unwrap();
        for _ in 0..3 {
            assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 3.0)), "the override");
        }
    }
    assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 2.0)), "the guard dropped");
    let record = registry.selection_record();
    assert_eq!(record.selections("rms_norm", "p"), 4);
    assert_eq!(record.selections("rms_norm", "q"), 3);
    // A provider replaced in place runs its new function at the next call.
    registry
        .replace_impl(
            "rms_norm",
            spec("p"),
            ImplFunc::functional(|args: &[Value]| Ok(vec![scaled(args[0].as_tensor().expect("bound"), 5.0)])),
        )
        .unwrap();
    assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 5.0)), "the replacement");
    assert_eq!(registry.selection_record().selections("rms_norm", "p"), 1, "the replacement's own count");
}

#[test]
fn two_registries_on_one_thread_keep_their_own_selections() {
    let (first, second) = (ir_ops::registry(), ir_ops::registry());
    register_scaled_rms_norm(&first, spec("p"), 2.0);
    register_scaled_rms_norm(&second, spec("p"), 3.0);
    first.set_default("rms_norm", &["p"]).unwrap();
    second.set_default("rms_norm", &["p"]).unwrap();
    let x = sample(DType::F32, 3, 16, 2);
    for _ in 0..4 {
        assert!(bit_eq(&rms_norm(&first, &x, None, 1e-6, None).unwrap(), &scaled(&x, 2.0)));
        assert!(bit_eq(&rms_norm(&second, &x, None, 1e-6, None).unwrap(), &scaled(&x, 3.0)));
    }
    assert_eq!(first.selection_record().selections("rms_norm", "p"), 4);
    assert_eq!(second.selection_record().selections("rms_norm", "p"), 4);
}

#[test]
fn a_kernel_may_dispatch_on_its_own_thread_while_its_selection_runs() {
    let registry = std::sync::Arc::new(ir_ops::registry());
    register_scaled_rms_norm(&registry, spec("inner"), 2.0);
    let weak = std::sync::Arc::downgrade(&registry);
    // `outer` runs `rms_norm` again (through `inner`) from inside its kernel, on rows of another width.
    rms_norm::register(&registry, spec("outer"), move |x, w, eps, v| {
        let registry = weak.upgrade().expect("the registry outlives its calls");
        let _inner = registry.override_priority("rms_norm", &["inner"]).unwrap();
        let wider = Tensor::zeros(DType::F32, &[1, 64]).unwrap();
        rms_norm(&registry, &wider, None, 1e-6, None)
            .map_err(|e| KernelError::InvalidArguments { reason: e.to_string() })?;
        rms_norm::native(x, w, eps, v)
    })
    .unwrap();
    registry.set_default("rms_norm", &["outer"]).unwrap();
    let x = sample(DType::F32, 2, 8, 3);
    for _ in 0..3 {
        assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 1.0)));
    }
    let record = registry.selection_record();
    assert_eq!(record.selections("rms_norm", "outer"), 3);
    assert_eq!(record.selections("rms_norm", "inner"), 3);
}

#[test]
fn typed_and_dynamically_registered_functions_give_one_result_and_one_record() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("typed"), 2.0);
    registry.register_impl("rms_norm", spec("dynamic"), scaled_native(2.0)).unwrap();
    let x = sample(DType::F32, 4, 8, 4);
    for provider in ["typed", "dynamic"] {
        let _first = registry.override_priority("rms_norm", &[provider]).unwrap();
        for _ in 0..2 {
            let out = rms_norm(&registry, &x, None, 1e-6, None).unwrap();
            assert!(bit_eq(&out, &scaled(&x, 2.0)), "{provider}");
        }
        // The dynamic form of the same call selects the same provider.
        let out = registry
            .run(Call::new(
                "rms_norm",
                Overload::Default,
                vec![Value::Tensor(x.clone()), Value::None, Value::F64(1e-6)],
            ))
            .unwrap();
        assert!(bit_eq(&out[0], &scaled(&x, 2.0)), "{provider}, dynamic call");
        assert_eq!(registry.selection_record().selections("rms_norm", provider), 3, "{provider}");
    }
    // A kernel error on the typed path names the op and the provider.
    rms_norm::register(&registry, spec("failing"), |_, _, _, _| {
        Err(KernelError::InvalidArguments { reason: "no".to_owned() })
    })
    .unwrap();
    let _failing = registry.override_priority("rms_norm", &["failing"]).unwrap();
    let err = rms_norm(&registry, &x, None, 1e-6, None).unwrap_err();
    assert!(matches!(err, CallError::Kernel { op: "rms_norm", provider: "failing", .. }), "{err}");
}

// --- the selection cache and freezing ---

/// A `spec(name)` whose predicate accepts everything and counts its runs.
fn counted(name: &'static str) -> (ImplSpec, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&runs);
    let spec = spec(name).with_supports(move |_| {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Support::Yes
    });
    (spec, runs)
}

#[test]
fn each_selection_is_made_once_per_thread_and_metadata_whatever_the_call_form() {
    use std::sync::atomic::Ordering::Relaxed;
    let registry = ir_ops::registry();
    let (spec, runs) = counted("p");
    register_scaled_rms_norm(&registry, spec, 2.0);
    registry.set_default("rms_norm", &["p", "native"]).unwrap();
    let x = sample(DType::F32, 2, 8, 1);
    let values = || vec![Value::Tensor(x.clone()), Value::None, Value::F64(1e-6)];
    let metas = [ArgMeta::Tensor(x.meta()), ArgMeta::None, ArgMeta::F64(1e-6), ArgMeta::None];
    for _ in 0..3 {
        assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 2.0)));
        assert!(bit_eq(
            &registry.run(Call::new("rms_norm", Overload::Default, values())).unwrap()[0],
            &scaled(&x, 2.0)
        ));
        assert_eq!(registry.select("rms_norm", &metas).unwrap().provider, "p");
    }
    assert_eq!(runs.load(Relaxed), 1, "typed, dynamic and lowering calls share one remembered selection");
    // A lowered graph's call of the named provider is remembered under its own key.
    for _ in 0..3 {
        let out = registry.run(Call::new("rms_norm", Overload::Default, values()).provider("p")).unwrap();
        assert!(bit_eq(&out[0], &scaled(&x, 2.0)));
    }
    assert_eq!(runs.load(Relaxed), 2, "the named provider's predicate ran once for three calls");
    // Other metadata is a new selection; so is every call after a priority change.
    let wider = sample(DType::F32, 2, 16, 2);
    rms_norm(&registry, &wider, None, 1e-6, None).unwrap();
    assert_eq!(runs.load(Relaxed), 3);
    {
        let _native = registry.override_priority("rms_norm", &["native"]).unwrap();
        assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 1.0)), "the override");
    }
    rms_norm(&registry, &x, None, 1e-6, None).unwrap();
    assert_eq!(runs.load(Relaxed), 4, "the list installed again is selected on afresh");
    // Another thread keeps its own selections.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..2 {
                assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 2.0)));
            }
        });
    });
    assert_eq!(runs.load(Relaxed), 5);
    // An unknown provider is an error at every call, never remembered.
    for _ in 0..2 {
        let err = registry.run(Call::new("rms_norm", Overload::Default, values()).provider("missing")).unwrap_err();
        assert!(matches!(&err, CallError::UnknownProvider { provider, .. } if provider == "missing"), "{err}");
    }
}

#[test]
fn native_chosen_for_want_of_priorities_is_remembered_until_a_list_is_installed() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("p"), 2.0);
    let x = sample(DType::F32, 2, 8, 3);
    for _ in 0..3 {
        assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 1.0)), "native");
    }
    registry.set_default("rms_norm", &["p"]).unwrap();
    assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 2.0)), "the installed list");
    let record = registry.selection_record();
    assert_eq!((record.selections("rms_norm", "native"), record.selections("rms_norm", "p")), (3, 1));
}

#[test]
fn a_frozen_registry_refuses_new_ops_and_providers_and_still_takes_priorities() {
    let registry = ir_ops::registry();
    register_scaled_rms_norm(&registry, spec("p"), 2.0);
    registry.set_default("rms_norm", &["p", "native"]).unwrap();
    let x = sample(DType::F32, 2, 8, 4);
    assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 2.0)));
    assert!(!registry.is_frozen());
    registry.freeze();
    registry.freeze();
    assert!(registry.is_frozen());

    let refused = |result: Result<(), RegistryError>, change: &str| match result {
        Err(RegistryError::Frozen { change: said }) => {
            assert!(said.contains(change), "{said}");
            let message = RegistryError::Frozen { change: said }.to_string();
            assert!(message.contains("frozen") && message.contains("Registry::freeze"), "{message}");
        }
        other => panic!("expected a frozen-registry error naming {change}, got {other:?}"),
    };
    refused(registry.register_impl("rms_norm", spec("late"), scaled_native(3.0)), "provider `late` of op `rms_norm`");
    refused(registry.replace_impl("rms_norm", spec("p"), scaled_native(3.0)), "replacing provider `p`");
    refused(registry.define_op(&rms_norm::RMS_NORM), "defining op `rms_norm`");
    assert_eq!(registry.providers("rms_norm").len(), 2, "nothing was added");

    // Calls, priorities and the record work as before.
    assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 2.0)));
    {
        let _native = registry.override_priority("rms_norm", &["native"]).unwrap();
        assert!(bit_eq(&rms_norm(&registry, &x, None, 1e-6, None).unwrap(), &scaled(&x, 1.0)));
    }
    assert_eq!(registry.ops(), ir_ops::registry().ops(), "the frozen table lists every op");
    let record = registry.selection_record();
    assert_eq!((record.selections("rms_norm", "p"), record.selections("rms_norm", "native")), (2, 1));
    registry.reset_selection_record();
    assert_eq!(registry.selection_record().selections("rms_norm", "p"), 0);
}

// --- the selection cache lends its entries in place ---

#[test]
fn kernels_may_call_the_registry_again_deeper_than_the_cache_holds() {
    // More levels than the cache's 8 ways per set, each on its own shape: every nested selection is
    // made and remembered while the outer ones are lent out, so the cache evicts; a lent entry replaced
    // under its call would give that call another shape's output metadata, a contract violation.
    const DEPTH: usize = 20;
    thread_local! {
        static LEVEL: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }
    let registry = leaked_registry();
    let recursive = move |x: &Tensor, w: Option<&Tensor>, eps: f64, v: Option<i64>| {
        let level = LEVEL.with(|level| level.get());
        if level < DEPTH {
            LEVEL.with(|l| l.set(level + 1));
            let inner = sample(DType::F32, level + 3, 8, level as u64);
            let out = rms_norm(registry, &inner, None, 1e-6, None).expect("the nested call");
            assert!(bit_eq(&out, &rms_norm::native(&inner, None, 1e-6, None)?), "level {level}");
            LEVEL.with(|l| l.set(level));
        }
        rms_norm::native(x, w, eps, v)
    };
    let spec = spec("recursive").with_supports(|args| kernel_support::rms_norm_support(args, ir_core::DeviceKind::Cpu));
    rms_norm::register(registry, spec, recursive).unwrap();
    registry.set_default("rms_norm", &["recursive", "native"]).unwrap();
    let x = sample(DType::F32, 2, 8, 1);
    let expected = rms_norm::native(&x, None, 1e-6, None).unwrap();
    for call in 1..=3 {
        registry.reset_selection_record();
        let out = rms_norm(registry, &x, None, 1e-6, None).unwrap();
        assert!(bit_eq(&out, &expected), "call {call}");
        let selections = registry.selection_record().selections("rms_norm", "recursive");
        assert_eq!(selections, DEPTH as u64 + 1, "call {call}: every level selected");
        assert_eq!(LEVEL.with(|l| l.get()), 0);
    }
}
