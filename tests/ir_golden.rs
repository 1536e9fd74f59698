//! Golden tests of the passes: every file under `tests/ir/` holds header comments, an input graph and
//! the expected result as a `//` comment block (so each file is valid IR text). `IR_BLESS=1`
//! rewrites the expectations in place. See `tests/ir/README.md`.

use std::fs;
use std::path::{Path, PathBuf};

use ir_core::{Registry, Tensor};
use ir_graph::{Graph, InterpError, InterpOptions, SafetyChecks, interpret, parse};
use ir_passes::{CloneElimination, PassContext, Pipeline, Snapshots};

struct Case {
    passes: String,
    priority: Option<String>,
    variant: CloneElimination,
    interp: Option<String>,
    /// `// compare: tolerance`: outputs within the producing op's tolerance instead of bit-equal.
    within_tolerance: bool,
    /// `// report: ...` lines: substrings the passes' reports must contain.
    reports: Vec<String>,
    input: String,
    expect: Option<String>,
    error: Option<(usize, String)>,
}

fn read_case(path: &Path) -> Case {
    let text = fs::read_to_string(path).unwrap();
    let header =
        |key: &str| text.lines().find_map(|l| l.strip_prefix(&format!("// {key}: ")).map(|v| v.trim().to_owned()));
    let (input, expect) = match text.split_once("// expect:\n") {
        Some((input, expect)) => {
            let lines: Vec<&str> =
                expect.lines().map(|l| l.strip_prefix("// ").or(l.strip_prefix("//")).unwrap_or(l)).collect();
            (input.to_owned(), Some(lines.join("\n") + "\n"))
        }
        None => (text.clone(), None),
    };
    let error = input
        .lines()
        .enumerate()
        .find_map(|(i, l)| l.split_once("// error: ").map(|(_, e)| (i + 1, e.trim().to_owned())));
    let variant = match header("clone-elimination").as_deref() {
        Some("unsafe") => CloneElimination::Unsafe,
        _ => CloneElimination::AliasAware,
    };
    Case {
        passes: header("test").expect("every golden file names its passes in `// test: ...`"),
        priority: header("priority"),
        variant,
        interp: header("interp"),
        within_tolerance: header("compare").as_deref() == Some("tolerance"),
        reports: text.lines().filter_map(|l| l.strip_prefix("// report: ").map(|v| v.trim().to_owned())).collect(),
        input,
        expect,
        error,
    }
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "ir") {
            out.push(path);
        }
    }
}

fn registry(priority: Option<&str>) -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    if let Some(text) = priority {
        let user = ir_core::UserPriorities::parse(text).unwrap();
        for entry in &user.entries {
            registry.set_default(&entry.op, &entry.providers).unwrap();
        }
    }
    registry
}

fn generated_inputs(graph: &Graph) -> Vec<(String, Tensor)> {
    graph
        .inputs()
        .into_iter()
        .enumerate()
        .map(|(i, (_, value, name, _))| {
            let meta = graph.meta(value);
            let n = meta.layout.storage_end();
            // i64 inputs are positions or indices: 0..8 (every cache a golden file indexes has 8 rows or more).
            let values: Vec<f64> = if meta.dtype == ir_core::DType::I64 {
                (0..n).map(|k| ((k * 7 + i * 13) % 8) as f64).collect()
            } else {
                (0..n).map(|k| (((k * 7 + i * 13) % 23) as f64 - 11.0) / 4.0).collect()
            };
            let storage = Tensor::from_f64(meta.dtype, &[n], &values).unwrap();
            (name.to_owned(), storage.as_strided(meta.layout.clone()).unwrap().deep_clone_storage())
        })
        .collect()
}

trait DeepCloneStorage {
    fn deep_clone_storage(self) -> Tensor;
}

impl DeepCloneStorage for Tensor {
    /// A uniquely owned tensor with this layout (the source storage handle is dropped).
    fn deep_clone_storage(self) -> Tensor {
        let layout = self.layout().clone();
        let whole = self
            .as_strided(ir_core::Layout::compact(&[self.storage().len_bytes() / self.dtype().size_in_bytes()]))
            .unwrap();
        let copy = whole.deep_clone().unwrap();
        drop((self, whole));
        copy.as_strided(layout).unwrap()
    }
}

#[test]
fn golden_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("ir");
    let mut paths = Vec::new();
    files(&root, &mut paths);
    paths.sort();
    assert!(paths.len() >= 20, "the golden corpus is there ({} files)", paths.len());
    let bless = std::env::var("IR_BLESS").is_ok_and(|v| v == "1");
    let mut failures = Vec::new();
    for path in &paths {
        if let Err(message) = run_case(path, bless) {
            failures.push(format!("{}: {message}", path.display()));
        }
    }
    assert!(
        failures.is_empty(),
        "{} golden file(s) failed:\n\n{}\n\nIf the new output is intended, re-bless the expectations with \
         `cargo xtask bless` (the same as `IR_BLESS=1 cargo test -p vllm-ir-tests --test ir_golden`) and review \
         `git diff tests/ir`; an error, report or semantics failure is not blessed away.",
        failures.len(),
        failures.join("\n\n")
    );
}

fn run_case(path: &Path, bless: bool) -> Result<(), String> {
    let case = read_case(path);
    let registry = registry(case.priority.as_deref());
    let mut graph = parse(&case.input).map_err(|e| format!("parse: {e}"))?;
    let reparsed = parse(&graph.to_string()).map_err(|e| format!("reparse: {e}"))?;
    if !reparsed.structurally_eq(&graph) {
        return Err("print/parse does not round-trip".to_owned());
    }
    let original = graph.clone();
    let pipeline = Pipeline::from_names(&case.passes).map_err(|e| e.to_string())?;
    let cx = PassContext::new(&registry).with_clone_elimination(case.variant);
    let result = pipeline.run(&mut graph, &cx, None, Snapshots::Skip);
    match (&case.error, result) {
        (Some((line, expected)), Err(e)) => {
            let message = e.to_string();
            if !message.contains(expected.as_str()) {
                return Err(format!("error `{message}` lacks `{expected}`"));
            }
            let located = message.contains(&format!("{line}:"))
                || statement_at_line(&original, *line).is_some_and(|s| message.contains(&s));
            if !located {
                return Err(format!("error `{message}` does not point at line {line}"));
            }
            return Ok(());
        }
        (Some((_, expected)), Ok(_)) => return Err(format!("expected an error containing `{expected}`")),
        (None, Err(e)) => return Err(format!("pipeline failed: {e}")),
        (None, Ok(report)) => {
            let text: Vec<String> = report.runs.iter().map(|run| run.report.to_string()).collect();
            let text = text.join("\n");
            if let Some(missing) = case.reports.iter().find(|expected| !text.contains(expected.as_str())) {
                return Err(format!("the reports lack `{missing}`:\n{text}"));
            }
        }
    }
    let actual = graph.to_string();
    match &case.expect {
        Some(expected) if *expected == actual => {}
        _ if bless => {
            let text = fs::read_to_string(path).unwrap();
            let head = text.split("// expect:\n").next().unwrap_or(&text).trim_end().to_owned();
            let block: Vec<String> = actual.lines().map(|l| format!("// {l}")).collect();
            fs::write(path, format!("{head}\n// expect:\n{}\n", block.join("\n"))).unwrap();
        }
        Some(expected) => {
            let diff = similar::TextDiff::from_lines(expected.as_str(), actual.as_str());
            return Err(format!("output differs:\n{}", diff.unified_diff().header("expected", "actual")));
        }
        None => return Err(format!("no `// expect:` block; the output is:\n{actual}")),
    }
    check_semantics(&case, &registry, &original, &graph)
}

/// Interprets before and after: equal bits, or the safety check the header names.
fn check_semantics(case: &Case, registry: &Registry, before: &Graph, after: &Graph) -> Result<(), String> {
    let reference = interpret(before, registry, generated_inputs(before), InterpOptions::checked())
        .map_err(|e| format!("interpreting the input: {e}"))?;
    let result = interpret(after, registry, generated_inputs(after), InterpOptions::checked());
    match (case.interp.as_deref(), result) {
        (None, Ok(run)) => {
            for (i, (a, b)) in run.outputs.iter().zip(&reference.outputs).enumerate() {
                if case.within_tolerance {
                    let tolerance = ir_core::op::global_tolerance(a.dtype());
                    ir_core::allclose(a, b, tolerance.atol, tolerance.rtol)
                        .map_err(|e| format!("output {i} is outside the tolerance: {e}"))?;
                } else if !ir_core::bit_eq(a, b) {
                    return Err(format!("output {i} differs from the unoptimized graph"));
                }
            }
            Ok(())
        }
        (None, Err(e)) => Err(format!("interpreting the output: {e}")),
        (Some(expected), Err(e)) => {
            let kind = match e {
                InterpError::AliasHazard { .. } => "AliasHazard",
                InterpError::WriteToNonDonatedInput { .. } => "WriteToNonDonatedInput",
                InterpError::AliasedKernelArgs { .. } => "AliasedKernelArgs",
                _ => "other",
            };
            if kind != expected {
                return Err(format!("expected the interpreter to trip {expected}, got {e}"));
            }
            // With the checks off, the result changes: the hazard was real.
            let unchecked =
                interpret(after, registry, generated_inputs(after), InterpOptions { safety_checks: SafetyChecks::Off });
            if let Ok(run) = unchecked
                && kind == "AliasHazard"
                && run.outputs.iter().zip(&reference.outputs).all(|(a, b)| ir_core::bit_eq(a, b))
            {
                return Err("the unchecked run equals the reference, so the hazard is not demonstrated".to_owned());
            }
            Ok(())
        }
        (Some(expected), Ok(_)) => Err(format!("expected the interpreter to trip {expected}")),
    }
}

/// The printed statement of the node on source line `line`.
fn statement_at_line(graph: &Graph, line: usize) -> Option<String> {
    graph
        .order()
        .iter()
        .find(|&&n| graph.node(n).location.get().is_some_and(|(l, _)| l as usize == line))
        .map(|&n| graph.display_node(n))
}

/// `docs/design/row-programs.md` prints `rms_norm`'s row program (with a weight) as the program
/// prints itself: the page cannot show a text format the code no longer has.
#[test]
fn the_row_program_text_in_the_docs_is_the_programs() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/design/row-programs.md");
    let docs = fs::read_to_string(&docs).unwrap();
    let text = ir_ops::row_program::builtin::rms_norm(true, false).to_string();
    assert!(
        docs.contains(&format!("```text\n{text}```")),
        "docs/design/row-programs.md should show this text of rms_norm's program:\n{text}"
    );
}
