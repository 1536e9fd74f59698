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
    pub problem: Problem,
}

/// What is wrong with a graph, one diagnostic's worth: values named as printed (`%x`), types as
/// printed (`f32[2,8]`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// The graph has no `output` node.
    #[error("the graph has no output node")]
    NoOutput,
    /// The one `output` node is not the last node.
    #[error("the output node must be the last node")]
    OutputNotLast,
    /// A second (or later) `output` node.
    #[error("a graph has exactly one output node")]
    ExtraOutput,
    /// A value read before the node that defines it.
    #[error("{value} is used before it is defined")]
    UsedBeforeDefined {
        /// The value.
        value: String,
    },
    /// Two graph inputs of one name.
    #[error("duplicate input name `%{name}`")]
    DuplicateInput {
        /// The name, without `%`.
        name: String,
    },
    /// A value whose storage would exceed `isize::MAX` bytes.
    #[error("{value} of type {meta} is too large: its bytes exceed isize::MAX")]
    TooLarge {
        /// The value.
        value: String,
        /// Its type.
        meta: String,
    },
    /// An op the registry does not define.
    #[error("unknown op `{op}` (known: {known})")]
    UnknownOp {
        /// The op.
        op: String,
        /// The registry's ops, comma-separated.
        known: String,
    },
    /// A `maybe_inplace` call of an op that has no such form.
    #[error("op `{op}` does not allow inplace, so it has no maybe_inplace form")]
    NoInplaceForm {
        /// The op.
        op: String,
    },
    /// A provider not registered for the op.
    #[error("provider `{provider}` is not registered for `{op}` (known: {known})")]
    UnknownProvider {
        /// The op.
        op: String,
        /// The provider.
        provider: String,
        /// The op's providers, comma-separated.
        known: String,
    },
    /// A functional provider's call that says it writes arguments.
    #[error("provider `{provider}` of `{op}` is not inplace, so it writes nothing")]
    FunctionalWrites {
        /// The op.
        op: String,
        /// The provider.
        provider: String,
    },
    /// An in-place provider's call whose written arguments are not the given activations.
    #[error("inplace provider `{provider}` of `{op}` writes {expected:?}, not {found:?}")]
    WrongWrites {
        /// The op.
        op: String,
        /// The provider.
        provider: String,
        /// The argument positions it writes: the given activations.
        expected: Vec<usize>,
        /// The positions the call names.
        found: Vec<usize>,
    },
    /// A written argument that is not a value.
    #[error("written argument {position} is not a value")]
    WrittenNotValue {
        /// Its position.
        position: usize,
    },
    /// A call's arguments the op (or the built-in) refuses: its own message.
    #[error("{0}")]
    Arguments(String),
    /// A call with another number of results than the op gives.
    #[error("expected {expected} results, found {found}")]
    ResultCount {
        /// The op's.
        expected: usize,
        /// The node's.
        found: usize,
    },
    /// A result whose type is not the op's.
    #[error("result {index} has type {found} but the op produces {expected}")]
    ResultType {
        /// Its position.
        index: usize,
        /// The node's type.
        found: String,
        /// The op's.
        expected: String,
    },
    /// An in-place result whose type is not that of the argument it is written into.
    #[error("result {index} has type {found} but writes into {value} of type {written}")]
    WrittenType {
        /// Its position.
        index: usize,
        /// Its type.
        found: String,
        /// The written argument.
        value: String,
        /// That argument's type.
        written: String,
    },
    /// A built-in's result whose type is not the built-in's.
    #[error("result type {found} should be {expected}")]
    BuiltinResultType {
        /// The node's type.
        found: String,
        /// The built-in's.
        expected: String,
    },
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((line, column)) = self.location {
            write!(f, "{line}:{column}: ")?;
        }
        write!(f, "{}", self.problem)?;
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
    let mut problems: Vec<(Option<NodeId>, Problem)> = Vec::new();
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
                problems
                    .push((Some(node), Problem::UsedBeforeDefined { value: graph.display_value(value).to_string() }));
            }
        });
        if let NodeKind::Input { name, .. } = &data.kind
            && !input_names.insert(name.as_str())
        {
            problems.push((Some(node), Problem::DuplicateInput { name: name.clone() }));
        }
        if let Err(problem) = check_node(graph, &mut lookups, node) {
            problems.push((Some(node), problem));
        }
        for &result in &data.results {
            if too_large[graph.values[result].meta] {
                let meta = graph.meta(result);
                let (value, meta) = (graph.display_value(result).to_string(), meta.to_string());
                problems.push((Some(node), Problem::TooLarge { value, meta }));
            }
            defined.insert(result);
        }
    }
    let output_problems: Vec<(Option<NodeId>, Problem)> = match outputs.as_slice() {
        [] => vec![(None, Problem::NoOutput)],
        [single] if order.last() == Some(single) => Vec::new(),
        [single] => vec![(Some(*single), Problem::OutputNotLast)],
        [_, rest @ ..] => rest.iter().map(|&extra| (Some(extra), Problem::ExtraOutput)).collect(),
    };
    problems.splice(0..0, output_problems);
    if problems.is_empty() {
        return Ok(());
    }
    let positions = graph.positions();
    let diagnostics: Vec<Diagnostic> = problems
        .into_iter()
        .map(|(node, problem)| Diagnostic {
            node,
            statement: node.map(|n| graph.display_node(n)).unwrap_or_default(),
            position: node.map(|n| positions[n] as usize),
            location: node.and_then(|n| graph.node(n).location.get()),
            problem,
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
/// function sees it ([`Arg::same_as`]: floats by bits).
type ArgKey<'g> = ir_core::op::Arg<MetaRef, &'g str, &'g [i64]>;

/// The key of `arg`.
fn arg_key<'g>(graph: &'g Graph, arg: &'g Arg) -> ArgKey<'g> {
    match arg {
        Arg::Tensor(v) => ArgKey::Tensor(graph.values[*v].meta),
        constant => graph.arg_meta(constant).map_tensor(|_| unreachable!("a constant")),
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
type MetaMemo<'g> = (OpRef, Vec<ArgKey<'g>>, Result<Expected, Problem>);

/// A remembered built-in: op, its values' interned metadata and its scalars, the one output or the error.
type BuiltinMemo<'g> = (Builtin, Vec<MetaRef>, &'g [BuiltinArg], Result<Expected, Problem>);

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
    fn op_outputs(&mut self, graph: &'g Graph, op: OpRef, args: &'g [Arg]) -> Result<&Expected, Problem> {
        let registry = self.registry;
        let def = self.ops.def(op).ok_or_else(|| unknown_op(registry, graph.op_name(op)))?;
        let known = self.metas.iter().position(|(o, keys, _)| {
            *o == op
                && keys.len() == args.len()
                && keys.iter().zip(args).all(|(key, arg)| key.same_as(&arg_key(graph, arg)))
        });
        let slot = match known {
            Some(slot) => slot,
            None => {
                let metas: Vec<ArgMeta<'g>> = args.iter().map(|arg| graph.arg_meta(arg)).collect();
                let outputs = def
                    .output_metas(metas)
                    .map(|metas| Expected::new(graph, metas))
                    .map_err(|e| Problem::Arguments(e.to_string()));
                let keys = args.iter().map(|arg| arg_key(graph, arg)).collect();
                remember(&mut self.metas, &mut self.next_slot, (op, keys, outputs))
            }
        };
        self.metas[slot].2.as_ref().map_err(Clone::clone)
    }

    /// Checks a built-in's arguments and computes its output (memoized like [`Lookups::op_outputs`]).
    fn builtin_output(&mut self, graph: &'g Graph, op: Builtin, args: &'g [BuiltinArg]) -> Result<&Expected, Problem> {
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
                let output = output.map(|meta| Expected::new(graph, vec![meta])).map_err(Problem::Arguments);
                let entry = (op, value_metas().collect(), args, output);
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
                out.push_str(&format!("  ; error: {}\n", diagnostic.problem));
            }
        }
    }
    out
}

fn check_node<'g>(graph: &'g Graph, lookups: &mut Lookups<'_, 'g>, node: NodeId) -> Result<(), Problem> {
    let data = graph.node(node);
    let meta = |v: ValueId| graph.meta(v);
    let results = &data.results;
    match &data.kind {
        NodeKind::Input { .. } | NodeKind::Output(_) => Ok(()),
        NodeKind::IrCall { op: op_ref, overload, args } => {
            let op = graph.op_name(*op_ref);
            let def = lookups.ops.def(*op_ref).ok_or_else(|| unknown_op(lookups.registry, op))?;
            if *overload == Overload::MaybeInplace && !def.allow_inplace {
                return Err(Problem::NoInplaceForm { op: op.to_owned() });
            }
            let expected = lookups.op_outputs(graph, *op_ref, args)?;
            check_results(graph, results, expected)
        }
        NodeKind::ImplCall { op: op_ref, provider: provider_ref, writes, args } => {
            let (op, provider) = (graph.op_name(*op_ref), graph.provider_name(*provider_ref));
            let registry = lookups.registry;
            lookups.ops.def(*op_ref).ok_or_else(|| unknown_op(registry, op))?;
            let inplace = lookups.provider_inplace(graph, *op_ref, *provider_ref).ok_or_else(|| {
                let known: Vec<&str> = registry.providers(op).iter().map(|p| p.name).collect();
                Problem::UnknownProvider { op: op.to_owned(), provider: provider.to_owned(), known: known.join(", ") }
            })?;
            if !inplace {
                let expected = lookups.op_outputs(graph, *op_ref, args)?;
                if !writes.is_empty() {
                    return Err(Problem::FunctionalWrites { op: op.to_owned(), provider: provider.to_owned() });
                }
                return check_results(graph, results, expected);
            }
            // The given activations, in order (an absent optional activation is not written).
            let activations = crate::given_activations(lookups.ops.activations(*op_ref), args);
            if *writes != activations {
                let (op, provider) = (op.to_owned(), provider.to_owned());
                return Err(Problem::WrongWrites { op, provider, expected: activations, found: writes.clone() });
            }
            let expected = lookups.op_outputs(graph, *op_ref, args)?;
            // Result i is written into argument writes[i]; results after the written ones are fresh.
            if results.len() != expected.len() {
                return Err(Problem::ResultCount { expected: expected.len(), found: results.len() });
            }
            for (index, want) in expected.metas.iter().enumerate().skip(writes.len()) {
                if !expected.matches(graph, index, results[index]) {
                    let (found, expected) = (meta(results[index]).to_string(), want.to_string());
                    return Err(Problem::ResultType { index, found, expected });
                }
            }
            for (index, &position) in writes.iter().enumerate() {
                let Some(Arg::Tensor(written)) = args.get(position) else {
                    return Err(Problem::WrittenNotValue { position });
                };
                if graph.values[results[index]].meta != graph.values[*written].meta {
                    return Err(Problem::WrittenType {
                        index,
                        found: meta(results[index]).to_string(),
                        value: graph.display_value(*written).to_string(),
                        written: meta(*written).to_string(),
                    });
                }
            }
            Ok(())
        }
        NodeKind::Builtin { op, args } => {
            let expected = lookups.builtin_output(graph, *op, args)?;
            match results.as_slice() {
                [only] if expected.matches(graph, 0, *only) => Ok(()),
                [only] => Err(Problem::BuiltinResultType {
                    found: meta(*only).to_string(),
                    expected: expected.metas[0].to_string(),
                }),
                _ => Err(Problem::ResultCount { expected: 1, found: results.len() }),
            }
        }
    }
}

fn check_results(graph: &Graph, results: &[ValueId], expected: &Expected) -> Result<(), Problem> {
    if results.len() != expected.len() {
        return Err(Problem::ResultCount { expected: expected.len(), found: results.len() });
    }
    for (index, &found) in results.iter().enumerate() {
        if !expected.matches(graph, index, found) {
            let (found, expected) = (graph.meta(found).to_string(), expected.metas[index].to_string());
            return Err(Problem::ResultType { index, found, expected });
        }
    }
    Ok(())
}

fn unknown_op(registry: &Registry, op: &str) -> Problem {
    Problem::UnknownOp { op: op.to_owned(), known: registry.ops().join(", ") }
}
