//! The verifier (R66): collects every diagnostic of a graph, each naming the node (its printed
//! statement and position) and, when parsed from text, its line:column.

use std::collections::HashSet;
use std::fmt;

use cranelift_entity::SecondaryMap;

use crate::graph::{Arg, Graph, NodeId, NodeKind, ValueId};
use crate::op::{ArgMeta, Overload, bind_meta};
use crate::{Layout, Registry, TensorMeta};

/// One problem of a graph.
///
/// Problems in graphs written by people (text files, tracers) are caller errors; a problem after a
/// pass is a compiler bug in that pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// The node, if the problem belongs to one.
    pub node: Option<NodeId>,
    /// The node's printed statement.
    pub statement: String,
    /// Position of the node in the order.
    pub position: Option<usize>,
    /// Line and column in the source text, when parsed.
    pub location: Option<(u32, u32)>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((line, column)) = self.location {
            write!(f, "{line}:{column}: ")?;
        }
        write!(f, "{}", self.message)?;
        if !self.statement.is_empty() {
            write!(f, " (in `{}`)", self.statement)?;
        }
        Ok(())
    }
}

/// All diagnostics of a graph; `Display` reprints the graph with each error under its line, and
/// [`VerifyError::summary`] gives them on one line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} verifier error(s):\n{annotated}", diagnostics.len())]
pub struct VerifyError {
    /// The diagnostics, in graph order.
    pub diagnostics: Vec<Diagnostic>,
    /// The graph text with `; error: ...` lines under the offending statements.
    pub annotated: String,
}

impl VerifyError {
    /// The diagnostics on one line, separated by `; `.
    pub fn summary(&self) -> String {
        self.diagnostics.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    }
}

/// Checks `graph` against `registry`; returns every diagnostic, not just the first.
pub fn verify(graph: &Graph, registry: &Registry) -> Result<(), VerifyError> {
    let mut diagnostics = Vec::new();
    let mut defined: HashSet<ValueId> = HashSet::new();
    let mut input_names = HashSet::new();
    let positions = graph.positions();
    let order = graph.order();
    let mut report = |node: Option<NodeId>, message: String| {
        diagnostics.push(Diagnostic {
            node,
            statement: node.map(|n| graph.display_node(n)).unwrap_or_default(),
            position: node.map(|n| positions[n] as usize),
            location: node.and_then(|n| graph.node(n).location),
            message,
        });
    };
    let outputs: Vec<NodeId> =
        order.iter().copied().filter(|&n| matches!(graph.node(n).kind, NodeKind::Output(_))).collect();
    match outputs.as_slice() {
        [] => report(None, "the graph has no output node".to_owned()),
        [single] if order.last() == Some(single) => {}
        [single] => report(Some(*single), "the output node must be the last node".to_owned()),
        [_, rest @ ..] => {
            for &extra in rest {
                report(Some(extra), "a graph has exactly one output node".to_owned());
            }
        }
    }
    for &node in order {
        let data = graph.node(node);
        for value in data.kind.operands() {
            if !defined.contains(&value) {
                report(Some(node), format!("{} is used before it is defined", graph.display_value(value)));
            }
        }
        if let NodeKind::Input { name, .. } = &data.kind
            && !input_names.insert(name.clone())
        {
            report(Some(node), format!("duplicate input name `%{name}`"));
        }
        if let Err(message) = check_node(graph, registry, node) {
            report(Some(node), message);
        }
        defined.extend(data.results.iter().copied());
    }
    if diagnostics.is_empty() {
        return Ok(());
    }
    let annotated = annotate(graph, &diagnostics, &positions);
    Err(VerifyError { diagnostics, annotated })
}

fn annotate(graph: &Graph, diagnostics: &[Diagnostic], positions: &SecondaryMap<NodeId, u32>) -> String {
    let text = graph.to_string();
    let mut out = String::new();
    let mut statement_index = 0;
    let statements: Vec<NodeId> =
        graph.order().iter().copied().filter(|&n| !matches!(graph.node(n).kind, NodeKind::Input { .. })).collect();
    for (line_number, line) in text.lines().enumerate() {
        out.push_str(line);
        out.push('\n');
        let node = if line_number == 0 {
            None
        } else if line == "}" {
            continue;
        } else {
            let node = statements.get(statement_index).copied();
            statement_index += 1;
            node
        };
        for diagnostic in diagnostics {
            let belongs = match (diagnostic.node, node) {
                (Some(d), Some(n)) => d == n,
                (Some(d), None) => matches!(graph.node(d).kind, NodeKind::Input { .. }),
                (None, None) => true,
                (None, Some(_)) => false,
            };
            if belongs && (line_number > 0 || diagnostic.node.is_none_or(|d| positions[d] != u32::MAX)) {
                out.push_str(&format!("  ; error: {}\n", diagnostic.message));
            }
        }
    }
    out
}

fn check_node(graph: &Graph, registry: &Registry, node: NodeId) -> Result<(), String> {
    let data = graph.node(node);
    let meta = |v: ValueId| graph.meta(v);
    let results: Vec<&TensorMeta> = data.results.iter().map(|&r| graph.meta(r)).collect();
    let expect_one = |expected: TensorMeta| -> Result<(), String> {
        match results.as_slice() {
            [only] if **only == expected => Ok(()),
            [only] => Err(format!("result type {only} should be {expected}")),
            _ => Err(format!("expected one result, found {}", results.len())),
        }
    };
    match &data.kind {
        NodeKind::Input { .. } | NodeKind::Output(_) => Ok(()),
        NodeKind::IrCall { op, overload, args } => {
            let def = registry
                .op_def(op)
                .ok_or_else(|| format!("unknown op `{op}` (known: {})", registry.ops().join(", ")))?;
            if *overload == Overload::MaybeInplace && !def.allow_inplace {
                return Err(format!("op `{op}` does not allow inplace, so it has no maybe_inplace form"));
            }
            let expected = op_outputs(graph, registry, op, args)?;
            check_results(&results, &expected)
        }
        NodeKind::ImplCall { op, provider, writes, args } => {
            let def = registry
                .op_def(op)
                .ok_or_else(|| format!("unknown op `{op}` (known: {})", registry.ops().join(", ")))?;
            let info = registry.providers(op).into_iter().find(|p| p.name == provider).ok_or_else(|| {
                let known: Vec<&str> = registry.providers(op).iter().map(|p| p.name).collect();
                format!("provider `{provider}` is not registered for `{op}` (known: {})", known.join(", "))
            })?;
            let expected = op_outputs(graph, registry, op, args)?;
            if !info.inplace {
                if !writes.is_empty() {
                    return Err(format!("provider `{provider}` of `{op}` is not inplace, so it writes nothing"));
                }
                return check_results(&results, &expected);
            }
            let activations = registry.activations(op).unwrap_or_default();
            if *writes != activations {
                return Err(format!("inplace provider `{provider}` of `{op}` writes {activations:?}, not {writes:?}"));
            }
            let _ = def;
            if results.len() != writes.len() {
                return Err(format!("expected {} results, found {}", writes.len(), results.len()));
            }
            for (i, &position) in writes.iter().enumerate() {
                let Some(Arg::Value(written)) = args.get(position) else {
                    return Err(format!("written argument {position} is not a value"));
                };
                if results[i] != meta(*written) {
                    return Err(format!(
                        "result {i} has type {} but writes into {} of type {}",
                        results[i],
                        graph.display_value(*written),
                        meta(*written)
                    ));
                }
            }
            Ok(())
        }
        NodeKind::Clone(v) => expect_one(TensorMeta { layout: meta(*v).layout.copy_layout(), ..meta(*v).clone() }),
        NodeKind::Contiguous(v) => {
            expect_one(TensorMeta { layout: Layout::compact(meta(*v).shape()), ..meta(*v).clone() })
        }
        NodeKind::Slice { value, dim, start, end } => {
            let layout = meta(*value).layout.slice(*dim, *start, *end).map_err(|e| e.to_string())?;
            expect_one(TensorMeta { layout, ..meta(*value).clone() })
        }
        NodeKind::Transpose { value, d0, d1 } => {
            let layout = meta(*value).layout.transpose(*d0, *d1).map_err(|e| e.to_string())?;
            expect_one(TensorMeta { layout, ..meta(*value).clone() })
        }
        NodeKind::Reshape { value, shape } => {
            let layout = meta(*value).layout.reshape(shape).map_err(|e| e.to_string())?;
            expect_one(TensorMeta { layout, ..meta(*value).clone() })
        }
        NodeKind::Add(a, b) | NodeKind::Mul(a, b) => {
            let (a, b) = (meta(*a), meta(*b));
            if a.shape() != b.shape() || a.dtype != b.dtype || a.device != b.device {
                return Err(format!("operands {a} and {b} must have equal shapes, dtypes and devices"));
            }
            expect_one(TensorMeta { layout: Layout::compact(a.shape()), ..a.clone() })
        }
        NodeKind::Scale(v, _) => {
            expect_one(TensorMeta { layout: Layout::compact(meta(*v).shape()), ..meta(*v).clone() })
        }
        NodeKind::Copy { dst, src } => {
            if meta(*dst).shape() != meta(*src).shape() {
                return Err(format!("copy_ needs equal shapes, found {} and {}", meta(*dst), meta(*src)));
            }
            expect_one(meta(*dst).clone())
        }
    }
}

/// Binds an op call's arguments and runs its meta function.
fn op_outputs(graph: &Graph, registry: &Registry, op: &str, args: &[Arg]) -> Result<Vec<TensorMeta>, String> {
    let def = registry.op_def(op).ok_or_else(|| format!("unknown op `{op}`"))?;
    let mut metas = Vec::new();
    for arg in args {
        metas.push(match arg {
            Arg::Value(v) => ArgMeta::Tensor(graph.meta(*v)),
            Arg::None => ArgMeta::None,
            Arg::F64(v) => ArgMeta::F64(*v),
            Arg::I64(v) => ArgMeta::I64(*v),
            Arg::Bool(v) => ArgMeta::Bool(*v),
            Arg::Ints(_) => return Err(format!("op `{op}` takes no integer lists")),
        });
    }
    let bound = bind_meta(def, metas).map_err(|e| e.to_string())?;
    (def.meta)(&bound).map_err(|e| e.to_string())
}

fn check_results(results: &[&TensorMeta], expected: &[TensorMeta]) -> Result<(), String> {
    if results.len() != expected.len() {
        return Err(format!("expected {} results, found {}", expected.len(), results.len()));
    }
    for (i, (found, expected)) in results.iter().zip(expected).enumerate() {
        if *found != expected {
            return Err(format!("result {i} has type {found} but the op produces {expected}"));
        }
    }
    Ok(())
}
