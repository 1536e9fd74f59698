//! Property tests of the passes on random decoder-like graphs (R83, R140): the pipeline's output
//! verifies, interprets to the same bits as the input graph without tripping a safety check, leaves
//! non-donated inputs unmodified, round-trips through text, and clone elimination is idempotent.
//! `PROPTEST_CASES` raises the number of graphs (default 256 per property); `PROPTEST_RNG_SEED`
//! fixes the seed (CI does).

use ir_core::graph::{Arg, Graph, InterpOptions, NodeKind, ValueId, interpret, parse};
use ir_core::op::Overload;
use ir_core::{DType, Layout, PriorityGuard, Registry, Tensor, TensorMeta, bit_eq};
use ir_passes::{CloneElimination, PassContext, Pipeline, Snapshots, eliminate_clones};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Step {
    FusedMaybeInplace(u8, u8, bool),
    Fused(u8, u8, bool),
    RmsNorm(u8, bool),
    Scale(u8),
    Add(u8, u8),
    RowSlice(u8, u8),
    Clone(u8),
    Contiguous(u8),
    ColumnSlice(u8),
    Transpose(u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, w)| Step::FusedMaybeInplace(a, b, w)),
        2 => (any::<u8>(), any::<u8>(), any::<bool>()).prop_map(|(a, b, w)| Step::Fused(a, b, w)),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(a, w)| Step::RmsNorm(a, w)),
        1 => any::<u8>().prop_map(Step::Scale),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::Add(a, b)),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::RowSlice(a, b)),
        1 => any::<u8>().prop_map(Step::Clone),
        1 => any::<u8>().prop_map(Step::Contiguous),
        1 => any::<u8>().prop_map(Step::ColumnSlice),
        1 => any::<u8>().prop_map(Step::Transpose),
    ]
}

const H: usize = 16;

/// Builds a legal graph: a value donated to a `maybe_inplace` call is never used again (views of it
/// may be: donation through views is the alias-aware elimination's business).
fn build(dtype: DType, tokens: usize, inputs: &[(u8, bool)], steps: &[Step], outputs: &[u8]) -> Graph {
    let mut graph = Graph::new("random");
    let dtypes = [dtype, DType::F32, DType::BF16, DType::F16];
    let mut pool: Vec<ValueId> = inputs
        .iter()
        .enumerate()
        .map(|(i, &(d, padded))| {
            let input_dtype = if d % 3 == 0 { dtypes[d as usize % 4] } else { dtype };
            let row_stride = if padded { H + 3 } else { H };
            let layout = Layout::new(&[tokens, H], &[row_stride, 1], usize::from(padded)).expect("valid layout");
            graph.add_input(format!("in{i}"), TensorMeta { dtype: input_dtype, device: ir_core::Device::Cpu, layout })
        })
        .collect();
    let weight = graph.add_input("w", TensorMeta::compact(dtype, &[H]));
    let pick = |pool: &[ValueId], i: u8| pool[i as usize % pool.len()];
    for step in steps {
        if pool.is_empty() {
            break;
        }
        let m = |g: &Graph, v: ValueId| g.meta(v).clone();
        match *step {
            Step::FusedMaybeInplace(a, b, w) | Step::Fused(a, b, w) => {
                let x = pick(&pool, a);
                let same_shape: Vec<ValueId> =
                    pool.iter().copied().filter(|&v| graph.meta(v).shape() == graph.meta(x).shape()).collect();
                let r = pick(&same_shape, b);
                let overload = if matches!(step, Step::FusedMaybeInplace(..)) {
                    Overload::MaybeInplace
                } else {
                    Overload::Default
                };
                let weight_arg =
                    if w && graph.meta(x).shape().last() == Some(&H) { Arg::Value(weight) } else { Arg::None };
                let out_meta = TensorMeta { layout: m(&graph, x).layout.copy_layout(), ..m(&graph, x) };
                let res_meta = TensorMeta {
                    layout: m(&graph, r).layout.copy_layout(),
                    dtype: graph.meta(x).dtype,
                    ..m(&graph, r)
                };
                let kind = NodeKind::IrCall {
                    op: "fused_add_rms_norm".into(),
                    overload,
                    args: vec![Arg::Value(x), Arg::Value(r), weight_arg, Arg::F64(1e-6), Arg::None],
                };
                let (_, results) = graph.push(kind, vec![out_meta, res_meta]);
                if overload == Overload::MaybeInplace {
                    pool.retain(|&v| v != x && v != r);
                }
                pool.extend(results);
            }
            Step::RmsNorm(a, w) => {
                let x = pick(&pool, a);
                let weight_arg =
                    if w && graph.meta(x).shape().last() == Some(&H) { Arg::Value(weight) } else { Arg::None };
                let out = TensorMeta { layout: m(&graph, x).layout.copy_layout(), ..m(&graph, x) };
                let kind = NodeKind::IrCall {
                    op: "rms_norm".into(),
                    overload: Overload::Default,
                    args: vec![Arg::Value(x), weight_arg, Arg::F64(1e-6), Arg::None],
                };
                pool.extend(graph.push(kind, vec![out]).1);
            }
            Step::Scale(a) => {
                let x = pick(&pool, a);
                let out = TensorMeta { layout: Layout::compact(graph.meta(x).shape()), ..m(&graph, x) };
                pool.extend(graph.push(NodeKind::Scale(x, 0.5), vec![out]).1);
            }
            Step::Add(a, b) => {
                let x = pick(&pool, a);
                let same_kind: Vec<ValueId> = pool
                    .iter()
                    .copied()
                    .filter(|&v| {
                        graph.meta(v).shape() == graph.meta(x).shape() && graph.meta(v).dtype == graph.meta(x).dtype
                    })
                    .collect();
                let y = pick(&same_kind, b);
                let out = TensorMeta { layout: Layout::compact(graph.meta(x).shape()), ..m(&graph, x) };
                pool.extend(graph.push(NodeKind::Add(x, y), vec![out]).1);
            }
            Step::RowSlice(a, b) => {
                let x = pick(&pool, a);
                let rows = graph.meta(x).shape()[0];
                let start = b as usize % rows;
                let layout = graph.meta(x).layout.slice(0, start, rows).expect("in range");
                let out = TensorMeta { layout, ..m(&graph, x) };
                pool.extend(graph.push(NodeKind::Slice { value: x, dim: 0, start, end: rows }, vec![out]).1);
            }
            Step::Clone(a) => {
                let x = pick(&pool, a);
                let out = TensorMeta { layout: graph.meta(x).layout.copy_layout(), ..m(&graph, x) };
                pool.extend(graph.push(NodeKind::Clone(x), vec![out]).1);
            }
            Step::Contiguous(a) => {
                let x = pick(&pool, a);
                let out = TensorMeta { layout: Layout::compact(graph.meta(x).shape()), ..m(&graph, x) };
                pool.extend(graph.push(NodeKind::Contiguous(x), vec![out]).1);
            }
            Step::ColumnSlice(a) => {
                let x = pick(&pool, a);
                let columns = graph.meta(x).shape()[1];
                let end = if columns > 8 { 8 } else { columns };
                let layout = graph.meta(x).layout.slice(1, 0, end).expect("in range");
                let out = TensorMeta { layout, ..m(&graph, x) };
                pool.extend(graph.push(NodeKind::Slice { value: x, dim: 1, start: 0, end }, vec![out]).1);
            }
            Step::Transpose(a) => {
                let x = pick(&pool, a);
                let layout = graph.meta(x).layout.transpose(0, 1).expect("rank 2");
                let out = TensorMeta { layout, ..m(&graph, x) };
                pool.extend(graph.push(NodeKind::Transpose { value: x, d0: 0, d1: 1 }, vec![out]).1);
            }
        }
    }
    let mut outs: Vec<ValueId> = outputs.iter().filter(|_| !pool.is_empty()).map(|&o| pick(&pool, o)).collect();
    outs.dedup();
    if outs.is_empty() {
        outs.push(weight);
    }
    graph.set_output(outs);
    graph
}

/// Graphs per property: 256, or `PROPTEST_CASES`. CI fixes the seed with `PROPTEST_RNG_SEED`.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

fn registry() -> (Registry, [PriorityGuard; 2]) {
    let registry = Registry::with_builtin_ops();
    kernels_cpu::register(&registry).unwrap();
    let guards = [
        registry.override_priority("fused_add_rms_norm", &["cpu", "native"]).unwrap(),
        registry.override_priority("rms_norm", &["cpu", "native"]).unwrap(),
    ];
    (registry, guards)
}

fn inputs(graph: &Graph, seed: u64) -> Vec<(String, Tensor)> {
    graph
        .inputs()
        .into_iter()
        .enumerate()
        .map(|(i, (_, value, name, _))| {
            (name.to_owned(), Tensor::randn(graph.meta(value), seed * 31 + i as u64).unwrap())
        })
        .collect()
}

fn graphs() -> impl Strategy<Value = Graph> {
    (
        prop_oneof![Just(DType::BF16), Just(DType::F32), Just(DType::F16)],
        1usize..5,
        proptest::collection::vec((any::<u8>(), any::<bool>()), 1..4),
        proptest::collection::vec(step(), 1..12),
        proptest::collection::vec(any::<u8>(), 1..4),
    )
        .prop_map(|(dtype, tokens, inputs, steps, outputs)| build(dtype, tokens, &inputs, &steps, &outputs))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn the_alias_aware_pipeline_preserves_results(graph in graphs(), seed in 0u64..1000) {
        let (registry, _guards) = registry();
        ir_core::graph::verify(&graph, &registry).unwrap();
        let text = graph.to_string();
        prop_assert!(parse(&text).unwrap().structurally_eq(&graph), "round trip\n{}", text);

        let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
        let mut compiled = graph.clone();
        let cx = PassContext::new(&registry);
        Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();

        // Non-donated inputs: the caller keeps a handle and must read the same bits afterwards.
        let given = inputs(&compiled, seed);
        let kept: Vec<(String, Tensor, Tensor, bool)> = compiled
            .inputs()
            .into_iter()
            .map(|(_, _, name, donated)| {
                let t = given.iter().find(|(n, _)| n == name).unwrap().1.clone();
                (name.to_owned(), t.clone(), t.deep_clone().unwrap(), donated)
            })
            .collect();
        let run = interpret(&compiled, &registry, given, InterpOptions::checked())
            .unwrap_or_else(|e| panic!("{e}\nbefore:\n{text}\nafter:\n{compiled}"));
        for (a, b) in run.outputs.iter().zip(&reference.outputs) {
            prop_assert!(bit_eq(a, b), "outputs differ\nbefore:\n{}\nafter:\n{}", text, compiled);
        }
        for (name, handle, before, donated) in &kept {
            if !donated {
                prop_assert!(bit_eq(handle, before), "non-donated input %{} was modified", name);
            }
        }
        let again = eliminate_clones(&mut compiled, &cx).unwrap();
        prop_assert!(again.removed.is_empty(), "clone elimination is idempotent");
    }

    #[test]
    fn the_unsafe_pipeline_output_verifies_and_is_idempotent(graph in graphs()) {
        let (registry, _guards) = registry();
        let mut compiled = graph.clone();
        let cx = PassContext::new(&registry).with_clone_elimination(CloneElimination::Unsafe);
        Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
        let again = eliminate_clones(&mut compiled, &cx).unwrap();
        prop_assert!(again.removed.is_empty());
        prop_assert!(parse(&compiled.to_string()).unwrap().structurally_eq(&compiled));
    }
}

/// The counter-check: the same generator finds graphs where the `unsafe` variant changes results or
/// trips the interpreter's safety checks, so the soundness property above is not vacuous.
#[test]
fn the_generator_finds_graphs_the_unsafe_variant_gets_wrong() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let (registry, _guards) = registry();
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = graphs();
    let mut caught = 0;
    for seed in 0..600u64 {
        let graph = strategy.new_tree(&mut runner).expect("graphs generate").current();
        let reference = interpret(&graph, &registry, inputs(&graph, seed), InterpOptions::checked()).unwrap();
        let mut compiled = graph.clone();
        let cx = PassContext::new(&registry).with_clone_elimination(CloneElimination::Unsafe);
        Pipeline::standard().run(&mut compiled, &cx, None, Snapshots::Skip).unwrap();
        match interpret(&compiled, &registry, inputs(&compiled, seed), InterpOptions::checked()) {
            Err(_) => caught += 1,
            Ok(run) => {
                if run.outputs.iter().zip(&reference.outputs).any(|(a, b)| !bit_eq(a, b)) {
                    caught += 1;
                }
            }
        }
    }
    assert!(caught > 0, "the generator never produced a graph the unsafe variant mishandles");
    eprintln!("the unsafe variant was caught on {caught} of 600 generated graphs");
}

/// Graphs with one illegal reuse planted on purpose: a value read after a `maybe_inplace` call that
/// donated it.
fn illegal_graphs() -> impl Strategy<Value = (Graph, String, String, String)> {
    (graphs(), any::<u8>()).prop_filter_map("needs a maybe_inplace call", |(mut graph, pick)| {
        let calls: Vec<_> = graph
            .order()
            .iter()
            .copied()
            .filter(|&n| matches!(graph.node(n).kind, NodeKind::IrCall { overload: Overload::MaybeInplace, .. }))
            .collect();
        let call = *calls.get(pick as usize % calls.len().max(1))?;
        let NodeKind::IrCall { args, .. } = &graph.node(call).kind else { return None };
        let Arg::Value(donated) = args[(pick as usize / 7) % 2] else { return None };
        let meta = TensorMeta { layout: Layout::compact(graph.meta(donated).shape()), ..graph.meta(donated).clone() };
        let (reader, results) = graph.push(NodeKind::Scale(donated, 3.0), vec![meta]);
        let mut outputs = graph.outputs();
        outputs.push(results[0]);
        graph.set_output(outputs);
        let (value, donor, later) =
            (graph.display_value(donated), graph.display_node(call), graph.display_node(reader));
        Some((graph, value, donor, later))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn every_illegal_reuse_is_reported_with_the_right_nodes((graph, value, donor, later) in illegal_graphs()) {
        let (registry, _guards) = registry();
        let mut compiled = graph.clone();
        let err = ir_passes::functionalize(&mut compiled, &PassContext::new(&registry)).unwrap_err();
        let ir_passes::PassError::DonatedValueReused { violations } = &err else { panic!("{err}") };
        prop_assert!(
            violations.iter().any(|v| v.value == value && v.donating_node == donor && v.later_user == later),
            "{:?} lacks ({}, {}, {})", violations, value, donor, later
        );
        prop_assert_eq!(compiled.to_string(), graph.to_string(), "a failing pass leaves the graph unchanged");
    }
}
