//! The graph IR's text format: round trips, parse errors with positions, verifier diagnostics.

use ir_core::{DType, TensorMeta};
use ir_graph::{Graph, Problem, parse, verify};

const STEP: &str = "\
graph step(%x: bf16[8,16], %res: bf16[8,16], %w: bf16[16]) {
  %0, %1 = fused_add_rms_norm.maybe_inplace(%x, %res, %w, 1e-6, none) : bf16[8,16], bf16[8,16]
  %2 = slice(%0, 1, 0, 8) : bf16[8,8]{16,1}
  output(%2, %1)
}
";

const LOWERED: &str = "\
graph step(%x: bf16[8,16] donated, %res: bf16[8,16] donated, %w: bf16[16]) {
  %0, %1 = impl fused_add_rms_norm[native] (%x, %res, %w, 1e-6, none) : bf16[8,16], bf16[8,16]
  %2 = slice(%0, 1, 0, 8) : bf16[8,8]{16,1}
  output(%2, %1)
}
";

/// A corpus with every node kind, non-default layouts and devices, donated inputs and special floats.
const CORPUS: &str = "\
graph everything(%a: f32[4,5], %b: f16[2,3,4]{12,1,3}+2 donated, %c: bf16[8,16]@cuda:0, %d: f64[], %e: f32[0,8]) {
  %0 = clone(%a) : f32[4,5]
  %1 = contiguous(%b) : f16[2,3,4]
  %2 = slice(%a, 1, 0, 3) : f32[4,3]{5,1}
  %3 = transpose(%a, 0, 1) : f32[5,4]{1,5}
  %4 = reshape(%0, [20]) : f32[20]
  %5 = add(%0, %0) : f32[4,5]
  %6 = mul(%5, %0) : f32[4,5]
  %7 = scale(%6, -0.0) : f32[4,5]
  %8 = scale(%7, 1e300) : f32[4,5]
  %9 = scale(%8, 0.1) : f32[4,5]
  %10 = scale(%9, inf) : f32[4,5]
  %11 = scale(%10, nan) : f32[4,5]
  %12 = scale(%11, -inf) : f32[4,5]
  %13 = copy_(%0, %12) : f32[4,5]
  %14 = rms_norm(%a, none, 1e-6, 3) : f32[4,5]
  %15 = impl rms_norm[native] (%c, none, 1e-5, none) : bf16[8,16]@cuda:0
  output(%13, %14, %15, %2, %3, %4, %1, %d, %e)
}
";

#[test]
fn canonical_text_round_trips() {
    for text in [STEP, LOWERED, CORPUS] {
        let graph = parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(graph.to_string(), text);
        let again = parse(&graph.to_string()).unwrap();
        assert!(again.structurally_eq(&graph));
    }
}

#[test]
fn parsed_graphs_verify() {
    let registry = ir_ops::registry();
    for text in [STEP, LOWERED, CORPUS] {
        let graph = parse(text).unwrap();
        verify(&graph, &registry).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn comments_and_free_whitespace() {
    let text = "// a header comment\ngraph g( %x : f32[2, 3] ) { // trailing\n  %y = scale( %x , 2.0 ) : f32[2,3]\n\n output( %y ) }";
    let graph = parse(text).unwrap();
    assert_eq!(graph.to_string(), "graph g(%x: f32[2,3]) {\n  %y = scale(%x, 2.0) : f32[2,3]\n  output(%y)\n}\n");
}

#[test]
fn new_names_continue_after_the_largest_numeric_name() {
    let mut graph = parse(STEP).unwrap();
    assert_eq!(graph.fresh_name(), "3");
    let x = graph.inputs()[0].1;
    let meta = graph.meta(x).clone();
    let (_, values) = graph.push(ir_graph::NodeKind::clone_of(x), vec![meta]);
    assert_eq!(graph.display_value(values[0]), "%4");
}

fn error(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}

#[test]
fn parse_errors_have_positions_and_say_what_was_expected() {
    assert_eq!(
        error("graph g(%x: f32[2]) {\n  %y = scale(%x, 2.0 : f32[2]\n  output(%y)\n}"),
        "2:22: expected ',' or ')', found ':'"
    );
    assert_eq!(
        error("graph g(%x: f8[2]) {\n  output(%x)\n}"),
        "1:13: expected a dtype (f32, f16, bf16, f64, f8e4m3fn, f8e5m2, i8, i64), found 'f8'"
    );
    assert_eq!(
        error("graph g(%x: f32[2]) {\n  %y = scale(%z, 2.0) : f32[2]\n  output(%y)\n}"),
        "2:14: expected a defined value, found undefined value '%z'"
    );
    assert_eq!(
        error("graph g(%x: f32[2]) {\n  %x = scale(%x, 2.0) : f32[2]\n  output(%x)\n}"),
        "2:3: expected a new value name, found duplicate name '%x'"
    );
    assert_eq!(error("graph g(%x: f32[2]) {\n  output(%x)\n} extra"), "3:3: expected end of input, found 'extra'");
    assert_eq!(
        error("graph g(%x: f32[2]) {\n  %y = scale(%x, 2.0) : f32[2], f32[2]\n  output(%y)\n}")
            .split(':')
            .take(2)
            .collect::<Vec<_>>(),
        vec!["2", "23"]
    );
    assert!(error("graph g(%x: f32[2]) {\n  %y = slice(%x, 0, 1) : f32[1]\n  output(%y)\n}").contains("3 argument(s)"));
    assert!(error("").starts_with("1:1: expected 'graph'"));
    assert!(error("graph g(%x: f32[99999999999999999999]) {}").contains("64 bits"));
    assert!(
        error("graph g(%x: f32[2]{1,1}) {}").starts_with("1:13"),
        "rank mismatch of strides: {}",
        error("graph g(%x: f32[2]{1,1}) {}")
    );
}

#[test]
fn columns_count_characters_and_the_first_error_in_the_text_is_reported() {
    // A string and a comment with non-ASCII text: columns after them count characters, not bytes.
    let text = "graph g(%x: f32[2]) { // größe ✓\n  %y = gelu_and_mul(%x, \"tänh\", %q) : f32[1]\n  output(%y)\n}";
    assert_eq!(error(text), "2:33: expected a defined value, found undefined value '%q'");
    // A character no token starts with, at its own column.
    assert_eq!(error("graph g(%x: f32[2]) {\n  %y = scale(%x, ✓) : f32[2]\n}"), "2:18: expected a token, found '✓'");
    // Invisible characters are named, never printed as they are.
    assert_eq!(
        error("\u{feff}graph g(%x: f32[2]) {\n  output(%x)\n}"),
        "1:1: expected a token, found a byte-order mark (U+FEFF; save the file without one)"
    );
    assert_eq!(
        error("graph g(%x: f32[2]) {\n  %y = scale(%x,\u{200b} 2.0) : f32[2]\n}"),
        "2:17: expected a token, found the invisible character U+200B"
    );
    assert_eq!(
        error("graph g(%x: f32[2]) {\n  %y = scale(%, 2.0)\n}"),
        "2:15: expected a value name after '%', found ','"
    );
    assert_eq!(
        error("graph g(%x: f32[2]) {\n  %y = gelu(%x, \"open\n}"),
        "2:17: expected a closing '\"' (strings have no escapes), found '\\n'"
    );
    // An error earlier in the text wins over an unreadable token after it.
    assert_eq!(error("graph g(%x f32[2]) { ✓ }"), "1:12: expected ':', found 'f32'");
    // Unicode whitespace separates tokens like ASCII whitespace.
    assert!(parse("graph\u{a0}g(%x: f32[2])\u{2003}{\n  output(%x)\n}").is_ok());
}

#[test]
fn an_integer_for_a_float_parameter_is_a_verifier_diagnostic_with_its_location() {
    let text = "graph g(%x: f32[2,8]) {\n  %y = rms_norm(%x, none, 1, none) : f32[2,8]\n  output(%y)\n}\n";
    let graph = parse(text).unwrap();
    let err = verify(&graph, &ir_ops::registry()).unwrap_err();
    assert_eq!(err.diagnostics.len(), 1);
    let d = &err.diagnostics[0];
    assert_eq!(d.location, Some((2, 3)));
    assert!(
        matches!(&d.problem, Problem::Arguments(m) if m.contains("parameter `epsilon` expects float, found an integer")),
        "{d}"
    );
}

#[test]
fn five_planted_errors_give_five_diagnostics() {
    let text = "\
graph g(%x: f32[2,8], %r: f32[2,8]) {
  %0 = rms_norm.maybe_inplace(%x, none, 1e-6, none) : f32[2,8]
  %1 = group_norm(%x) : f32[2,8]
  %2 = add(%x, %r) : f32[2,7]
  %3 = impl rms_norm[cuda] (%x, none, 1e-6, none) : f32[2,8]
  %4 = scale(%x, 2.0) : f16[2,8]
  output(%0, %1, %2, %3, %4)
}
";
    let graph = parse(text).unwrap();
    let err = verify(&graph, &ir_ops::registry()).unwrap_err();
    let lines: Vec<u32> = err.diagnostics.iter().map(|d| d.location.unwrap().0).collect();
    assert_eq!(lines, vec![2, 3, 4, 5, 6], "{err}");
    let problems: Vec<&Problem> = err.diagnostics.iter().map(|d| &d.problem).collect();
    assert!(matches!(problems[0], Problem::NoInplaceForm { op } if op == "rms_norm"), "{err}");
    assert!(matches!(problems[1], Problem::UnknownOp { op, .. } if op == "group_norm"), "{err}");
    assert!(matches!(problems[2], Problem::BuiltinResultType { expected, .. } if expected == "f32[2,8]"), "{err}");
    assert!(matches!(problems[3], Problem::UnknownProvider { provider, .. } if provider == "cuda"), "{err}");
    assert!(problems[3].to_string().contains("provider `cuda` is not registered"));
    assert!(problems[4].to_string().contains("should be f32[2,8]"));
    let rendered = err.to_string();
    assert!(rendered.contains("  %1 = group_norm(%x) : f32[2,8]\n  ; error: unknown op `group_norm`"), "{rendered}");
}

#[test]
fn repeated_calls_are_each_checked_although_their_meta_results_are_remembered() {
    // The verifier memoizes meta functions on equal argument metadata; a later call with the same
    // arguments but a wrong declared result must still be reported, and so must a later failing one.
    let text = "\
graph g(%x: f32[2,8], %w: f32[8], %v: f32[4]) {
  %0 = rms_norm(%x, %w, 1e-6, none) : f32[2,8]
  %1 = rms_norm(%x, %w, 1e-6, none) : f32[2,8]
  %2 = rms_norm(%x, %w, 1e-6, none) : bf16[2,8]
  %3 = rms_norm(%x, %v, 1e-6, none) : f32[2,8]
  %4 = rms_norm(%x, %v, 1e-6, none) : f32[2,8]
  output(%0, %1, %2, %3, %4)
}
";
    let graph = parse(text).unwrap();
    let err = verify(&graph, &ir_ops::registry()).unwrap_err();
    let lines: Vec<u32> = err.diagnostics.iter().map(|d| d.location.unwrap().0).collect();
    assert_eq!(lines, vec![4, 5, 6], "{err}");
    assert_eq!(
        err.diagnostics[0].problem,
        Problem::ResultType { index: 0, found: "bf16[2,8]".to_owned(), expected: "f32[2,8]".to_owned() },
        "{err}"
    );
    assert_eq!(err.diagnostics[0].problem.to_string(), "result 0 has type bf16[2,8] but the op produces f32[2,8]");
    assert!(err.diagnostics[1].problem.to_string().contains("weight"), "{err}");
    assert_eq!(err.diagnostics[1].problem, err.diagnostics[2].problem, "the remembered error is the same");
}

#[test]
fn structural_checks() {
    let registry = ir_ops::registry();
    let mut graph = Graph::new("g");
    let x = graph.add_input("x", TensorMeta::compact(DType::F32, &[2]));
    let err = verify(&graph, &registry).unwrap_err();
    assert!(err.diagnostics[0].problem.to_string().contains("no output node"));
    graph.set_output(vec![x]);
    verify(&graph, &registry).unwrap();
    let (clone, _) = graph.push(ir_graph::NodeKind::clone_of(x), vec![TensorMeta::compact(DType::F32, &[2])]);
    verify(&graph, &registry).unwrap();
    let y = graph.node(clone).results[0];
    graph.set_output(vec![y]);
    graph.remove_node(clone);
    let err = verify(&graph, &registry).unwrap_err();
    assert!(err.diagnostics[0].problem.to_string().contains("used before it is defined"), "{err}");
}

mod never_panics {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn on_arbitrary_text(text in "\\PC{0,200}") {
            let _ = parse(&text);
        }

        #[test]
        fn on_mutated_graphs(cut in 0usize..1000, insert in "[%(){}\\[\\],:=+@.a-z0-9 \\n-]{0,8}") {
            let chars: Vec<char> = CORPUS.chars().collect();
            let cut = cut % chars.len();
            let mutated: String = chars[..cut].iter().chain(insert.chars().collect::<Vec<_>>().iter()).chain(chars[cut..].iter().skip(1)).collect();
            if let Ok(graph) = parse(&mutated) {
                let _ = verify(&graph, &ir_ops::registry());
                let reparsed = parse(&graph.to_string()).expect("printed graphs parse");
                prop_assert!(reparsed.structurally_eq(&graph));
            }
        }
    }
}

#[test]
fn the_verifier_rejects_values_past_isize_max_bytes() {
    // Built through the API (the parser already refuses the type): 2^62 f32 elements are 2^64 bytes.
    let mut graph = Graph::new("g");
    let x = graph.add_input("x", TensorMeta::compact(DType::F32, &[1 << 62]));
    graph.set_output(vec![x]);
    let err = verify(&graph, &ir_ops::registry()).unwrap_err().to_string();
    assert!(err.contains("%x of type f32[4611686018427387904] is too large: its bytes exceed isize::MAX"), "{err}");
}

#[test]
fn fresh_names_skip_numeric_input_names_given_through_the_api() {
    let mut graph = Graph::new("g");
    let x = graph.add_input("7", TensorMeta::compact(DType::F32, &[2]));
    let (_, results) = graph.push(
        ir_graph::NodeKind::builtin(
            ir_graph::Builtin::Scale,
            vec![ir_graph::BuiltinArg::Value(x), ir_graph::BuiltinArg::Float(2.0)],
        ),
        vec![TensorMeta::compact(DType::F32, &[2])],
    );
    graph.set_output(results);
    let text = graph.to_string();
    assert!(text.contains("%8 = scale(%7, 2.0)"), "{text}");
    assert!(parse(&text).unwrap().structurally_eq(&graph));
}

#[test]
fn built_ins_are_each_checked_although_their_results_are_remembered() {
    // Built-ins are memoized on (op, scalars, value metadata) too: equal inputs with different
    // scalars, or a later wrong declared result, must each be checked on their own.
    let text = "\
graph g(%x: f32[4,8]) {
  %0 = slice(%x, 1, 0, 4) : f32[4,4]{8,1}
  %1 = slice(%x, 1, 0, 4) : f32[4,4]{8,1}
  %2 = slice(%x, 1, 4, 8) : f32[4,4]{8,1}
  %3 = slice(%x, 1, 0, 4) : f32[4,4]
  %4 = slice(%x, 1, 0, 9) : f32[4,9]{8,1}
  output(%0, %1, %2, %3, %4)
}
";
    let graph = parse(text).unwrap();
    let error = verify(&graph, &ir_ops::registry()).unwrap_err();
    let lines: Vec<u32> = error.diagnostics.iter().filter_map(|d| d.location).map(|(line, _)| line).collect();
    // %2 is an offset of 4, so its layout is `+4`: a mismatch; %3 claims a compact layout; %4 is out of range.
    assert_eq!(lines, vec![4, 5, 6], "{}", error.summary());
}

#[test]
fn value_names_keep_their_spelling_through_the_compact_storage() {
    // Numbers are stored as numbers only when that loses nothing: leading zeros, 2^63 and above,
    // and text names keep their spelling, and fresh names continue above the numeric ones.
    let text = "\
graph g(%0: f32[2], %007: f32[2], %9223372036854775808: f32[2], %18446744073709551615: f32[2], %x.y_z: f32[2]) {
  %00 = scale(%0, 2.0) : f32[2]
  %41 = scale(%007, 2.0) : f32[2]
  output(%00, %41, %9223372036854775808, %18446744073709551615, %x.y_z)
}
";
    let mut graph = parse(text).unwrap();
    assert_eq!(graph.to_string(), text);
    let spelled: Vec<String> = graph
        .order()
        .iter()
        .flat_map(|&n| graph.node(n).results.clone())
        .map(|v| graph.value_name(v).to_string())
        .collect();
    assert_eq!(spelled, ["0", "007", "9223372036854775808", "18446744073709551615", "x.y_z", "00", "41"]);
    assert_eq!(graph.fresh_name(), "42");
}

#[test]
fn values_with_equal_metadata_share_it_and_different_metadata_stays_apart() {
    let mut graph = Graph::new("g");
    let a = graph.add_input("a", TensorMeta::compact(DType::F32, &[2, 3]));
    let b = graph.add_input("b", TensorMeta::compact(DType::BF16, &[2, 3]));
    let c = graph.add_input("c", TensorMeta::compact(DType::F32, &[2, 3]));
    assert_eq!(graph.meta(a), &TensorMeta::compact(DType::F32, &[2, 3]));
    assert_eq!(graph.meta(b), &TensorMeta::compact(DType::BF16, &[2, 3]));
    assert_eq!(graph.meta(c), graph.meta(a));
    assert!(std::ptr::eq(graph.meta(a), graph.meta(c)), "one stored copy");
}
