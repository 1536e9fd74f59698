//! The verifier: collects every diagnostic of a graph, each naming the node (its printed
//! statement and position) and, when parsed from text, its line:column.

use rustc_hash::FxHashSet as HashSet;
use std::fmt;

use cranelift_entity::{EntitySet, SecondaryMap};

use crate::{Arg, Builtin, BuiltinArg, Graph, MetaRef, NodeId, NodeKind, OpRef, OpTable, ProviderRef, ValueId};
use ir_core::op::{ArgMeta, Overload};
use ir_core::{Registry, TensorMeta};

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
///
/// Linear in the graph and allocation-free per node in the common case: registry lookups and meta
/// functions are memoized per run (a model's layers repeat the same calls on the same metadata).
pub fn verify(graph: &Graph, registry: &Registry) -> Result<(), VerifyError> {
    let mut problems: Vec<(Option<NodeId>, String)> = Vec::new();
    let mut defined: EntitySet<ValueId> = EntitySet::with_capacity(graph.values.len());
    // Sized for the leading inputs (where inputs are) at once: growing a set of a large graph's
    // parameter names rehashes it several times per run.
    let inputs = graph.order().iter().take_while(|&&n| matches!(graph.node(n).kind, NodeKind::Input { .. })).count();
    let mut input_names: HashSet<&str> = HashSet::with_capacity_and_hasher(inputs, Default::default());
    let mut lookups = Lookups::new(registry, graph);
    // Each distinct metadata is checked once (a graph has few), not once per value.
    let too_large: SecondaryMap<MetaRef, bool> = {
        let mut too_large = SecondaryMap::with_capacity(graph.metas.metas.len());
        for (key, meta) in graph.metas.metas.iter() {
            too_large[key] = meta.storage_bytes().is_none();
        }
        too_large
    };
    let order = graph.order();
    // Output nodes are found in the one pass over the nodes below; their problems come first.
    let mut outputs: Vec<NodeId> = Vec::new();
    for &node in order {
        let data = graph.node(node);
        if matches!(data.kind, NodeKind::Output(_)) {
            outputs.push(node);
        }
        data.kind.for_each_operand(|value| {
            if !defined.contains(value) {
                problems.push((Some(node), format!("{} is used before it is defined", graph.display_value(value))));
            }
        });
        if let NodeKind::Input { name, .. } = &data.kind
            && !input_names.insert(name.as_str())
        {
            problems.push((Some(node), format!("duplicate input name `%{name}`")));
        }
        if let Err(message) = check_node(graph, &mut lookups, node) {
            problems.push((Some(node), message));
        }
        for &result in &data.results {
            if too_large[graph.values[result].meta] {
                let meta = graph.meta(result);
                problems.push((
                    Some(node),
                    format!("{} of type {meta} is too large: its bytes exceed isize::MAX", graph.display_value(result)),
                ));
            }
            defined.insert(result);
        }
    }
    let output_problems: Vec<(Option<NodeId>, String)> = match outputs.as_slice() {
        [] => vec![(None, "the graph has no output node".to_owned())],
        [single] if order.last() == Some(single) => Vec::new(),
        [single] => vec![(Some(*single), "the output node must be the last node".to_owned())],
        [_, rest @ ..] => {
            rest.iter().map(|&extra| (Some(extra), "a graph has exactly one output node".to_owned())).collect()
        }
    };
    problems.splice(0..0, output_problems);
    if problems.is_empty() {
        return Ok(());
    }
    let positions = graph.positions();
    let diagnostics: Vec<Diagnostic> = problems
        .into_iter()
        .map(|(node, message)| Diagnostic {
            node,
            statement: node.map(|n| graph.display_node(n)).unwrap_or_default(),
            position: node.map(|n| positions[n] as usize),
            location: node.and_then(|n| graph.node(n).location.get()),
            message,
        })
        .collect();
    let annotated = annotate(graph, &diagnostics, &positions);
    Err(VerifyError { diagnostics, annotated })
}

/// Registry facts for the ops and providers a graph names, looked up once per entry of the graph's
/// op and provider tables (typed refs, never names), and small memos of meta-function results keyed
/// by the graph's interned metadata (comparing a value's metadata is comparing two indices).
struct Lookups<'r, 'g> {
    registry: &'r Registry,
    ops: OpTable,
    /// Whether (op, provider) is in place; `None` when the provider is not registered for the op.
    inplace: rustc_hash::FxHashMap<(OpRef, ProviderRef), Option<bool>>,
    /// Recent (op, argument keys) → outputs; a small ring, since layers repeat.
    metas: Vec<MetaMemo<'g>>,
    next_slot: usize,
    /// The same for built-ins.
    builtins: Vec<BuiltinMemo<'g>>,
    next_builtin_slot: usize,
}

/// What a memo compares an argument by: a value by its interned metadata, a constant as a meta
/// function sees it ([`ArgMeta::same_as`]: floats by bits).
enum ArgKey<'g> {
    Value(MetaRef),
    Constant(ArgMeta<'g>),
}

impl ArgKey<'_> {
    fn of<'g>(graph: &'g Graph, arg: &'g Arg) -> ArgKey<'g> {
        match arg {
            Arg::Value(v) => ArgKey::Value(graph.values[*v].meta),
            constant => ArgKey::Constant(graph.arg_meta(constant)),
        }
    }

    fn matches(&self, graph: &Graph, arg: &Arg) -> bool {
        match (self, arg) {
            (ArgKey::Value(meta), Arg::Value(v)) => *meta == graph.values[*v].meta,
            (ArgKey::Constant(_), Arg::Value(_)) | (ArgKey::Value(_), _) => false,
            (ArgKey::Constant(remembered), constant) => remembered.same_as(&graph.arg_meta(constant)),
        }
    }
}

/// The outputs a meta function gives, with their interned form in the graph (`None`: no value of
/// the graph has that metadata, so no result can match it).
struct Expected {
    metas: Vec<TensorMeta>,
    refs: Vec<Option<MetaRef>>,
}

impl Expected {
    fn new(graph: &Graph, metas: Vec<TensorMeta>) -> Expected {
        let refs = metas.iter().map(|meta| graph.metas.get(meta)).collect();
        Expected { metas, refs }
    }

    fn len(&self) -> usize {
        self.metas.len()
    }

    /// Whether value `found` has output `i`'s metadata.
    fn matches(&self, graph: &Graph, i: usize, found: ValueId) -> bool {
        self.refs[i] == Some(graph.values[found].meta)
    }
}

/// A remembered meta-function call: op, argument keys, outputs or the error.
type MetaMemo<'g> = (OpRef, Vec<ArgKey<'g>>, Result<Expected, String>);

/// A remembered built-in: op, its values' interned metadata and its scalars, the one output or the error.
type BuiltinMemo<'g> = (Builtin, Vec<MetaRef>, &'g [BuiltinArg], Result<Expected, String>);

/// Distinct calls remembered per run.
const META_MEMO: usize = 8;

/// Puts `entry` in a ring of at most `META_MEMO` entries; returns its slot.
fn remember<T>(ring: &mut Vec<T>, next_slot: &mut usize, entry: T) -> usize {
    if ring.len() < META_MEMO {
        ring.push(entry);
        return ring.len() - 1;
    }
    let slot = *next_slot;
    *next_slot = (slot + 1) % META_MEMO;
    ring[slot] = entry;
    slot
}

/// Whether two built-in scalar arguments are the same (floats by bits); values are compared by
/// their metadata separately.
fn same_scalars(a: &[BuiltinArg], b: &[BuiltinArg]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| match (x, y) {
            (BuiltinArg::Value(_), BuiltinArg::Value(_)) => true,
            (BuiltinArg::Float(x), BuiltinArg::Float(y)) => x.to_bits() == y.to_bits(),
            (x, y) => x == y,
        })
}

impl<'r, 'g> Lookups<'r, 'g> {
    fn new(registry: &'r Registry, graph: &Graph) -> Lookups<'r, 'g> {
        let ops = OpTable::compute(graph, registry);
        Lookups {
            registry,
            ops,
            inplace: Default::default(),
            metas: Vec::new(),
            next_slot: 0,
            builtins: Vec::new(),
            next_builtin_slot: 0,
        }
    }

    /// Whether `provider` of `op` is inplace; `None` when it is not registered.
    fn provider_inplace(&mut self, graph: &Graph, op: OpRef, provider: ProviderRef) -> Option<bool> {
        let registry = self.registry;
        *self
            .inplace
            .entry((op, provider))
            .or_insert_with(|| registry.is_inplace(graph.op_name(op), graph.provider_name(provider)))
    }

    /// Binds an op call's arguments and runs its meta function (memoized on equal metadata).
    fn op_outputs(&mut self, graph: &'g Graph, op: OpRef, args: &'g [Arg]) -> Result<&Expected, String> {
        let def = self.ops.def(op).ok_or_else(|| format!("unknown op `{}`", graph.op_name(op)))?;
        let known = self.metas.iter().position(|(o, keys, _)| {
            *o == op && keys.len() == args.len() && keys.iter().zip(args).all(|(key, arg)| key.matches(graph, arg))
        });
        let slot = match known {
            Some(slot) => slot,
            None => {
                let metas: Vec<ArgMeta<'g>> = args.iter().map(|arg| graph.arg_meta(arg)).collect();
                let outputs =
                    def.output_metas(metas).map(|metas| Expected::new(graph, metas)).map_err(|e| e.to_string());
                let keys = args.iter().map(|arg| ArgKey::of(graph, arg)).collect();
                remember(&mut self.metas, &mut self.next_slot, (op, keys, outputs))
            }
        };
        self.metas[slot].2.as_ref().map_err(Clone::clone)
    }

    /// Checks a built-in's arguments and computes its output (memoized like [`Lookups::op_outputs`]).
    fn builtin_output(&mut self, graph: &'g Graph, op: Builtin, args: &'g [BuiltinArg]) -> Result<&Expected, String> {
        let value_metas = || args.iter().filter_map(BuiltinArg::value).map(|v| graph.values[*v].meta);
        let known = self.builtins.iter().position(|(o, metas, scalars, _)| {
            *o == op && same_scalars(scalars, args) && metas.iter().copied().eq(value_metas())
        });
        let slot = match known {
            Some(slot) => slot,
            None => {
                let output = ir_core::builtin::check_args(op, args).map_err(|e| e.to_string()).and_then(|()| {
                    let metas: smallvec::SmallVec<[&TensorMeta; 2]> =
                        args.iter().filter_map(BuiltinArg::value).map(|v| graph.meta(*v)).collect();
                    (op.def().meta)(&metas, &ir_core::builtin::Scalars(args)).map_err(|e| e.to_string())
                });
                let entry = (op, value_metas().collect(), args, output.map(|meta| Expected::new(graph, vec![meta])));
                remember(&mut self.builtins, &mut self.next_builtin_slot, entry)
            }
        };
        self.builtins[slot].3.as_ref().map_err(Clone::clone)
    }
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

fn check_node<'g>(graph: &'g Graph, lookups: &mut Lookups<'_, 'g>, node: NodeId) -> Result<(), String> {
    let data = graph.node(node);
    let meta = |v: ValueId| graph.meta(v);
    let results = &data.results;
    match &data.kind {
        NodeKind::Input { .. } | NodeKind::Output(_) => Ok(()),
        NodeKind::IrCall { op: op_ref, overload, args } => {
            let op = graph.op_name(*op_ref);
            let def = lookups
                .ops
                .def(*op_ref)
                .ok_or_else(|| format!("unknown op `{op}` (known: {})", lookups.registry.ops().join(", ")))?;
            if *overload == Overload::MaybeInplace && !def.allow_inplace {
                return Err(format!("op `{op}` does not allow inplace, so it has no maybe_inplace form"));
            }
            let expected = lookups.op_outputs(graph, *op_ref, args)?;
            check_results(graph, results, expected)
        }
        NodeKind::ImplCall { op: op_ref, provider: provider_ref, writes, args } => {
            let (op, provider) = (graph.op_name(*op_ref), graph.provider_name(*provider_ref));
            let registry = lookups.registry;
            lookups
                .ops
                .def(*op_ref)
                .ok_or_else(|| format!("unknown op `{op}` (known: {})", registry.ops().join(", ")))?;
            let inplace = lookups.provider_inplace(graph, *op_ref, *provider_ref).ok_or_else(|| {
                let known: Vec<&str> = registry.providers(op).iter().map(|p| p.name).collect();
                format!("provider `{provider}` is not registered for `{op}` (known: {})", known.join(", "))
            })?;
            if !inplace {
                let expected = lookups.op_outputs(graph, *op_ref, args)?;
                if !writes.is_empty() {
                    return Err(format!("provider `{provider}` of `{op}` is not inplace, so it writes nothing"));
                }
                return check_results(graph, results, expected);
            }
            // The given activations, in order (an absent optional activation is not written).
            let activations = crate::given_activations(lookups.ops.activations(*op_ref), args);
            if *writes != activations {
                return Err(format!("inplace provider `{provider}` of `{op}` writes {activations:?}, not {writes:?}"));
            }
            let expected = lookups.op_outputs(graph, *op_ref, args)?;
            // Result i is written into argument writes[i]; results after the written ones are fresh.
            if results.len() != expected.len() {
                return Err(format!("expected {} results, found {}", expected.len(), results.len()));
            }
            for (i, want) in expected.metas.iter().enumerate().skip(writes.len()) {
                if !expected.matches(graph, i, results[i]) {
                    return Err(format!("result {i} has type {} but the op gives {want}", meta(results[i])));
                }
            }
            for (i, &position) in writes.iter().enumerate() {
                let Some(Arg::Value(written)) = args.get(position) else {
                    return Err(format!("written argument {position} is not a value"));
                };
                if graph.values[results[i]].meta != graph.values[*written].meta {
                    return Err(format!(
                        "result {i} has type {} but writes into {} of type {}",
                        meta(results[i]),
                        graph.display_value(*written),
                        meta(*written)
                    ));
                }
            }
            Ok(())
        }
        NodeKind::Builtin { op, args } => {
            let expected = lookups.builtin_output(graph, *op, args)?;
            match results.as_slice() {
                [only] if expected.matches(graph, 0, *only) => Ok(()),
                [only] => Err(format!("result type {} should be {}", meta(*only), expected.metas[0])),
                _ => Err(format!("expected one result, found {}", results.len())),
            }
        }
    }
}

fn check_results(graph: &Graph, results: &[ValueId], expected: &Expected) -> Result<(), String> {
    if results.len() != expected.len() {
        return Err(format!("expected {} results, found {}", expected.len(), results.len()));
    }
    for (i, &found) in results.iter().enumerate() {
        if !expected.matches(graph, i, found) {
            let (found, expected) = (graph.meta(found), &expected.metas[i]);
            return Err(format!("result {i} has type {found} but the op produces {expected}"));
        }
    }
    Ok(())
}
