//! The passes end to end on the models of the spec's table, with the in-place `cpu`
//! provider forced, in both clone elimination variants.

use ir_core::op::InputSpec;
use ir_core::{DType, PriorityGuard, Registry, Tensor, bit_eq};
use ir_graph::{Builtin, InterpError, InterpOptions, Interpretation, NodeKind, interpret, parse};
use ir_ops::fused_add_rms_norm::{FUSED_ADD_RMS_NORM, fused_add_rms_norm};
use ir_passes::{CloneElimination, PassContext, PassError, Pipeline, PipelineError, Snapshots};

const HEADER: &str = "graph m(%x: bf16[8,16], %r1: bf16[8,16], %r2: bf16[8,16], %w: bf16[16]) {\n";
const T: &str = "bf16[8,16]";

fn model(body: &str) -> String {
    format!("{HEADER}{}}}\n", body.replace("TT", &format!("{T}, {T}")).replace("T1", T))
}

fn model_a() -> String {
    model(
        "  %o1, %s1 = fused_add_rms_norm.maybe_inplace(%x, %r1, %w, 1e-6, none) : TT
  %o2, %s2 = fused_add_rms_norm.maybe_inplace(%o1, %r2, %w, 1e-6, none) : TT
  output(%o2, %s1, %s2)
",
    )
}

fn model_b() -> String {
    model(
        "  %o1, %s1 = fused_add_rms_norm(%x, %r1, %w, 1e-6, none) : TT
  %o2, %s2 = fused_add_rms_norm(%o1, %r2, %w, 1e-6, none) : TT
  output(%o2, %s1, %s2)
",
    )
}

fn model_c() -> String {
    model(
        "  %o1, %s1 = fused_add_rms_norm.maybe_inplace(%x, %r1, %w, 1e-6, none) : TT
  %o2, %s2 = fused_add_rms_norm(%o1, %r2, %w, 1e-6, none) : TT
  output(%o2, %s1, %s2, %o1)
",
    )
}

fn model_d() -> String {
    model(
        "  %o1, %s1 = fused_add_rms_norm.maybe_inplace(%x, %r1, %w, 1e-6, none) : TT
  %t = scale(%o1, 2.0) : T1
  %o2, %s2 = fused_add_rms_norm(%t, %r2, %w, 1e-6, none) : TT
  output(%o2, %s1, %s2)
",
    )
}

fn registry() -> (Registry, [PriorityGuard; 2]) {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    let guards = [
        registry.override_priority("fused_add_rms_norm", &["cpu", "native"]).unwrap(),
        registry.override_priority("rms_norm", &["cpu", "native"]).unwrap(),
    ];
    (registry, guards)
}

fn inputs() -> Vec<(String, Tensor)> {
    let spec = InputSpec { num_tokens: 8, hidden_size: 16, dtype: DType::BF16, epsilon: 1e-6, seed: 11 };
    let a = (FUSED_ADD_RMS_NORM.generate_inputs)(&spec).unwrap();
    let b = (FUSED_ADD_RMS_NORM.generate_inputs)(&InputSpec { seed: 12, ..spec }).unwrap();
    let t = |args: &[ir_core::op::Value], i: usize| args[i].as_tensor().unwrap().deep_clone().unwrap();
    vec![("x".into(), t(&a, 0)), ("r1".into(), t(&a, 1)), ("r2".into(), t(&b, 1)), ("w".into(), t(&a, 2))]
}

fn input(inputs: &[(String, Tensor)], name: &str) -> Tensor {
    inputs.iter().find(|(n, _)| n == name).unwrap().1.clone()
}

/// The eager reference: the same provider, functional calls.
fn eager(registry: &Registry, inputs: &[(String, Tensor)], scale_between: bool) -> [Tensor; 4] {
    let (x, r1, r2, w) = (input(inputs, "x"), input(inputs, "r1"), input(inputs, "r2"), input(inputs, "w"));
    let (o1, s1) = fused_add_rms_norm(registry, &x, &r1, Some(&w), 1e-6, None, ir_ops::Rounding::Exact).unwrap();
    let t = if scale_between { o1.scale(2.0).unwrap() } else { o1.clone() };
    let (o2, s2) = fused_add_rms_norm(registry, &t, &r2, Some(&w), 1e-6, None, ir_ops::Rounding::Exact).unwrap();
    [o2, s1, s2, o1]
}

struct Outcome {
    functionalized: usize,
    donated: Vec<String>,
    clones_left: usize,
    run: Interpretation,
    text: String,
}

fn compile_and_run(text: &str, variant: CloneElimination) -> Outcome {
    let (registry, _guards) = registry();
    let mut graph = parse(text).unwrap();
    let cx = PassContext::new(&registry).with_clone_elimination(variant);
    let report = Pipeline::standard().run(&mut graph, &cx, None, Snapshots::Skip).unwrap();
    let ir_passes::PassReport::Functionalize(functionalized) = &report.runs[0].report else { panic!("first pass") };
    let clones_left = graph
        .order()
        .iter()
        .filter(|&&n| matches!(graph.node(n).kind, NodeKind::Builtin { op: Builtin::Clone, .. }))
        .count();
    for &node in graph.order() {
        if let NodeKind::ImplCall { provider, .. } = &graph.node(node).kind {
            assert_eq!(graph.provider_name(*provider), "cpu", "{}", graph.display_node(node));
        }
    }
    let run =
        interpret(&graph, &registry, inputs(), InterpOptions::checked()).unwrap_or_else(|e| panic!("{e}\n{graph}"));
    Outcome {
        functionalized: functionalized.total(),
        donated: functionalized.donated.clone(),
        clones_left,
        run,
        text: graph.to_string(),
    }
}

fn check(text: &str, functionalized: usize, donated: &[&str], clones_left: usize, scale_between: bool) -> Vec<Outcome> {
    let (registry, _guards) = registry();
    let expected = eager(&registry, &inputs(), scale_between);
    [CloneElimination::AliasAware, CloneElimination::Unsafe]
        .into_iter()
        .map(|variant| {
            let outcome = compile_and_run(text, variant);
            assert_eq!(outcome.functionalized, functionalized, "{variant:?}");
            assert_eq!(outcome.donated, donated, "{variant:?}");
            assert_eq!(outcome.clones_left, clones_left, "{variant:?}\n{}", outcome.text);
            for (got, want) in outcome.run.outputs.iter().zip(&expected) {
                assert!(bit_eq(got, want), "{variant:?}: outputs equal eager calls of the same provider");
            }
            outcome
        })
        .collect()
}

#[test]
fn model_a_two_donating_calls_run_without_a_copy() {
    for outcome in check(&model_a(), 2, &["x", "r1", "r2"], 0, false) {
        assert_eq!(outcome.run.stats.bytes_allocated, 0, "measured zero-copy");
        assert_eq!(outcome.run.stats.clones_executed, 0);
        assert!(
            outcome
                .text
                .contains("%x: bf16[8,16] donated, %r1: bf16[8,16] donated, %r2: bf16[8,16] donated, %w: bf16[16])")
        );
    }
}

#[test]
fn model_b_functional_calls_keep_three_copies() {
    for outcome in check(&model_b(), 0, &[], 3, false) {
        assert_eq!(outcome.run.stats.clones_executed, 3);
    }
}

#[test]
fn model_c_a_value_used_after_the_write_keeps_its_copy() {
    check(&model_c(), 1, &["x", "r1"], 2, false);
}

#[test]
fn model_d_only_the_residual_copy_stays() {
    check(&model_d(), 1, &["x", "r1"], 1, true);
}

#[test]
fn reusing_a_donated_value_is_an_error_naming_everything() {
    let text = model(
        "  %o1, %s1 = fused_add_rms_norm.maybe_inplace(%x, %r1, %w, 1e-6, none) : TT
  %t = add(%x, %r1) : T1
  output(%o1, %s1, %t)
",
    );
    let (registry, _guards) = registry();
    let mut graph = parse(&text).unwrap();
    let before = graph.to_string();
    let err = Pipeline::standard().run(&mut graph, &PassContext::new(&registry), None, Snapshots::Skip).unwrap_err();
    let PipelineError::Pass { source: PassError::DonatedValueReused { violations }, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(violations.len(), 2, "both violations are reported");
    let message = err.to_string();
    assert!(
        message.contains("%x is donated to `%o1, %s1 = fused_add_rms_norm.maybe_inplace(%x, %r1, %w, 1e-6, none)"),
        "{message}"
    );
    assert!(message.contains("but used later by `%t = add(%x, %r1) : bf16[8,16]`"), "{message}");
    assert!(message.contains("%r1 is donated"), "{message}");
    assert!(message.contains("use the functional call, or clone the value explicitly before the call"), "{message}");
    assert_eq!(graph.to_string(), before, "a failing pass leaves the graph unchanged");
}

#[test]
fn the_same_value_as_both_activations() {
    let text = model(
        "  %o1, %s1 = fused_add_rms_norm.maybe_inplace(%x, %x, %w, 1e-6, none) : TT
  %y = add(%o1, %s1) : bf16[8,16]
  output(%y)
",
    );
    let (registry, _guards) = registry();
    let x = input(&inputs(), "x");
    let (expected_out, expected_res) =
        fused_add_rms_norm(&registry, &x, &x, Some(&input(&inputs(), "w")), 1e-6, None, ir_ops::Rounding::Exact)
            .unwrap();
    let expected = expected_out.add(&expected_res).unwrap();
    let aware = compile_and_run(&text, CloneElimination::AliasAware);
    assert_eq!(aware.clones_left, 1, "{}", aware.text);
    assert!(bit_eq(&aware.run.outputs[0], &expected), "{}", aware.text);

    // The unsafe variant keeps one copy too: once the first is removed, the kernel writes %x while
    // the second copy is still read, which its snapshot rule catches.
    let unsafe_variant = compile_and_run(&text, CloneElimination::Unsafe);
    assert_eq!(unsafe_variant.clones_left, 1, "{}", unsafe_variant.text);
    assert!(bit_eq(&unsafe_variant.run.outputs[0], &expected), "{}", unsafe_variant.text);
}

#[test]
fn donation_is_recorded_by_name_and_the_pipeline_is_stable() {
    let permuted =
        model_a().replace(HEADER, "graph m(%w: bf16[16], %r2: bf16[8,16], %x: bf16[8,16], %r1: bf16[8,16]) {\n");
    let (registry, _guards) = registry();
    let cx = PassContext::new(&registry);
    let mut graph = parse(&permuted).unwrap();
    let report = ir_passes::functionalize(&mut graph, &cx).unwrap();
    assert_eq!(report.donated, vec!["x", "r1", "r2"]);
    let once = graph.to_string();
    let again = ir_passes::functionalize(&mut graph, &cx).unwrap();
    assert_eq!((again.total(), graph.to_string()), (0, once));
    let mut compiled = parse(&model_a()).unwrap();
    Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
    let first = compiled.to_string();
    Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
    assert_eq!(compiled.to_string(), first, "a second run changes nothing");
}

#[test]
fn tracing_a_decoder_records_one_call_per_op_and_interprets_like_eager() {
    use ir_core::{EagerContext, ExecutionContext, ExecutionContextExt, TensorMeta};
    use ir_graph::Tracer;
    use layers::RmsNorm;

    fn decoder<C: ExecutionContext>(ctx: &C, norms: &[RmsNorm], x: C::Tensor) -> (C::Tensor, C::Tensor) {
        let residual = x.clone();
        let mut hidden = norms[0].forward(ctx, &x).unwrap();
        let mut residual = residual;
        for norm in &norms[1..] {
            let (out, new_residual) = norm.forward_residual(ctx, ctx.scale(&hidden, 0.5).unwrap(), residual).unwrap();
            hidden = out;
            residual = new_residual;
        }
        (hidden, residual)
    }

    let (registry, _guards) = registry();
    let norms: Vec<RmsNorm> =
        (0..3).map(|i| RmsNorm::builder(16).name(format!("layers.{i}.norm")).build().unwrap()).collect();
    let x = input(&inputs(), "x");
    let (eager_out, eager_res) = decoder(&EagerContext::new(&registry), &norms, x.deep_clone().unwrap());

    let tracer = Tracer::new(&registry, "decoder");
    let traced_x = tracer.input("x", TensorMeta::compact(DType::BF16, &[8, 16]));
    let (out, res) = decoder(&tracer, &norms, traced_x);
    let traced = tracer.finish(&[out, res]);
    let graph = &traced.graph;
    let calls: Vec<(String, ir_core::op::Overload)> = graph
        .order()
        .iter()
        .filter_map(|&n| match &graph.node(n).kind {
            NodeKind::IrCall { op, overload, .. } => Some((graph.op_name(*op).to_owned(), *overload)),
            _ => None,
        })
        .collect();
    use ir_core::op::Overload::{Default, MaybeInplace};
    assert_eq!(
        calls,
        vec![
            ("rms_norm".into(), Default),
            ("fused_add_rms_norm".into(), MaybeInplace),
            ("fused_add_rms_norm".into(), MaybeInplace)
        ]
    );
    assert_eq!(traced.parameters.len(), 3, "one weight input per layer");
    let mut graph_inputs = vec![("x".to_owned(), x.deep_clone().unwrap())];
    graph_inputs.extend(traced.parameters.iter().cloned());
    let run = interpret(graph, &registry, graph_inputs, InterpOptions::checked()).unwrap();
    assert!(bit_eq(&run.outputs[0], &eager_out) && bit_eq(&run.outputs[1], &eager_res));
}

#[test]
fn the_interpreter_counts_copies_and_bytes() {
    let (registry, _guards) = registry();
    let graph = parse("graph g(%x: f32[4,5]) {\n  %s = slice(%x, 1, 0, 3) : f32[4,3]{5,1}\n  %c = contiguous(%s) : f32[4,3]\n  output(%c)\n}\n").unwrap();
    let x = Tensor::from_f64(DType::F32, &[4, 5], &(0..20).map(f64::from).collect::<Vec<_>>()).unwrap();
    let run = interpret(&graph, &registry, vec![("x".into(), x)], InterpOptions::checked()).unwrap();
    assert_eq!(run.stats.clones_executed, 1);
    assert_eq!(run.stats.bytes_allocated, 4 * 3 * 4);
    assert_eq!(run.outputs[0].strides(), &[3, 1]);
    assert_eq!(run.outputs[0].to_f64_vec().unwrap(), vec![0., 1., 2., 5., 6., 7., 10., 11., 12., 15., 16., 17.]);
    let missing = interpret(&graph, &registry, vec![], InterpOptions::checked()).unwrap_err();
    assert_eq!(missing.to_string(), "missing input `%x`");
    let wrong = Tensor::zeros(DType::F16, &[4, 5]).unwrap();
    let err = interpret(&graph, &registry, vec![("x".into(), wrong)], InterpOptions::checked()).unwrap_err();
    assert_eq!(err.to_string(), "input `%x`: expected f32[4,5], found f16[4,5]");
}

#[test]
fn a_lowered_graph_ignores_later_priority_changes() {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    let mut graph = parse(&model_b()).unwrap();
    {
        let _guard = registry.override_priority("fused_add_rms_norm", &["cpu"]).unwrap();
        Pipeline::standard().run(&mut graph, &PassContext::new(&registry), None, Snapshots::Skip).unwrap();
    }
    let _native = registry.override_priority("fused_add_rms_norm", &["native"]).unwrap();
    let run = interpret(&graph, &registry, inputs(), InterpOptions::checked()).unwrap();
    assert!(run.stats.providers.iter().all(|(_, _, p)| *p == "cpu"), "{:?}", run.stats.providers);
}

#[test]
fn an_unfunctionalized_maybe_inplace_still_runs_correctly() {
    let (registry, _guards) = registry();
    let mut graph = parse(&model_a()).unwrap();
    let report = ir_passes::lower(&mut graph, &PassContext::new(&registry)).unwrap();
    assert_eq!(report.not_lowered.len(), 2);
    let expected = eager(&registry, &inputs(), false);
    let run = interpret(&graph, &registry, inputs(), InterpOptions::checked()).unwrap();
    assert!(bit_eq(&run.outputs[0], &expected[0]) && bit_eq(&run.outputs[2], &expected[2]));
}

#[test]
fn a_shared_donated_input_with_padded_rows_is_copied_with_its_layout() {
    // The caller keeps a handle to a donated, non-dense input: the interpreter copies it before
    // writing, and the copy must keep the declared strides and offset for every view of it.
    let (registry, _guards) = registry();
    let text = "graph g(%x: bf16[3,16]{19,1}+1 donated, %r: bf16[3,16]) {
  %t = transpose(%x, 0, 1) : bf16[16,3]{1,19}+1
  %o, %s = fused_add_rms_norm.maybe_inplace(%x, %r, none, 1e-6, none) : bf16[3,16], bf16[3,16]
  %u = scale(%t, 2.0) : bf16[16,3]
  output(%o, %s, %u)
}
";
    let graph = parse(text).unwrap();
    let meta = graph.meta(graph.inputs()[0].1).clone();
    let x = Tensor::randn(&meta, 1).unwrap();
    let r = Tensor::randn(graph.meta(graph.inputs()[1].1), 2).unwrap();
    let x_before = x.deep_clone().unwrap();
    let kept = x.clone();
    let run = interpret(&graph, &registry, vec![("x".into(), x), ("r".into(), r)], InterpOptions::checked()).unwrap();
    // One copy of the shared donated input, then the call runs functionally (its output layout would
    // differ from x's padded one: an in-place write keeps the argument's layout), copying both
    // activations for the in-place cpu kernel.
    assert_eq!(run.stats.defensive_copies, 3);
    assert!(bit_eq(&kept, &x_before), "the caller's handle still reads the old values");
    assert!(bit_eq(&run.outputs[2], &x_before.transpose(0, 1).unwrap().scale(2.0).unwrap()));
}

/// A `supports` predicate is user code: a panic in it during lowering is a rejection carrying the
/// message, and the pipeline goes on with the next provider: never a panic of the pass.
#[test]
fn a_panicking_predicate_during_the_pipeline_is_a_rejection() {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    let spec = ir_core::ImplSpec::new("flaky")
        .with_supports(|_: &[ir_core::op::ArgMeta<'_>]| -> ir_core::Support { panic!("flaky predicate failed") });
    let functional = ir_ops::fused_add_rms_norm::FusedAddRmsNormImpl::functional(ir_ops::fused_add_rms_norm::native);
    ir_ops::fused_add_rms_norm::register(&registry, spec, functional).unwrap();
    let _guard = registry.override_priority("fused_add_rms_norm", &["flaky", "cpu", "native"]).unwrap();
    let mut graph = parse(&model_b()).unwrap();
    let report = Pipeline::standard().run(&mut graph, &PassContext::new(&registry), None, Snapshots::Skip).unwrap();
    let lowered = report
        .runs
        .iter()
        .find_map(|run| match &run.report {
            ir_passes::PassReport::Lower(lowered) => Some(lowered.clone()),
            _ => None,
        })
        .expect("the pipeline lowers");
    assert_eq!(lowered.selections.len(), 2);
    for selection in &lowered.selections {
        assert_eq!(selection.provider, "cpu");
        let reason = selection.rejected[0].reason.to_string();
        assert!(reason.contains("supports predicate panicked: flaky predicate failed"), "{reason}");
    }
    let run = interpret(&graph, &registry, inputs(), InterpOptions::checked()).unwrap();
    let expected = eager(&registry, &inputs(), false);
    assert!(bit_eq(&run.outputs[0], &expected[0]));
}

/// With the safety checks off, a kernel writing a value and a view of it (two writes into one
/// storage) is an error, not a panic; with them on it is the same `AliasedKernelArgs`.
#[test]
fn a_value_and_its_view_both_written_is_an_error_with_the_checks_off() {
    let text = "graph g(%x: f32[2,8] donated, %w: f32[8]) {
  %v = slice(%x, 0, 0, 2) : f32[2,8]
  %o, %s = impl fused_add_rms_norm[cpu] writes(0, 1) (%x, %v, %w, 1e-6, none) : f32[2,8], f32[2,8]
  output(%o, %s)
}
";
    let (registry, _guards) = registry();
    let graph = parse(text).unwrap();
    let given = || {
        vec![
            ("x".to_owned(), Tensor::from_f64(DType::F32, &[2, 8], &[0.5; 16]).unwrap()),
            ("w".to_owned(), Tensor::ones(DType::F32, &[8]).unwrap()),
        ]
    };
    for safety_checks in [ir_graph::SafetyChecks::On, ir_graph::SafetyChecks::Off] {
        let err = interpret(&graph, &registry, given(), InterpOptions { safety_checks }).unwrap_err();
        assert!(matches!(err, InterpError::AliasedKernelArgs { .. }), "{safety_checks:?}: {err}");
    }
}
