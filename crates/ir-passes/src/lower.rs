//! The `lower` pass ([`lower`] documents it).

use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

use indexmap::IndexMap;
use ir_core::op::{ArgMeta, Overload};
use ir_core::{NATIVE, Rejection, TensorMeta};
use ir_graph::{Arg, Graph, NodeId, NodeKind, OpRef, OpTable};
use ir_ops::fused_qk_norm_rope::{FUSED_QK_NORM_ROPE, FusedQkNormRopeArgs};
use ir_ops::rotary_embedding::{ROTARY_EMBEDDING, RotaryEmbeddingArgs};

use crate::analysis::StorageRoots;
use crate::{PassContext, PassError};

/// The selection recorded for one lowered node.
#[derive(Clone, Debug, PartialEq)]
pub struct Lowered {
    /// The node (now an `ImplCall`).
    pub node: NodeId,
    /// The op.
    pub op: &'static str,
    /// The chosen provider.
    pub provider: &'static str,
    /// Whether it writes in place (clones were inserted).
    pub inplace: bool,
    /// Providers rejected before it, with reasons (shared by the nodes of one selection).
    pub rejected: Arc<[Rejection]>,
}

/// What lowering did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LowerReport {
    /// One entry per lowered node, in order.
    pub selections: Vec<Lowered>,
    /// `maybe_inplace` calls left as they are.
    pub not_lowered: Vec<NodeId>,
    /// Clones inserted for inplace implementations.
    pub clones_inserted: usize,
    /// Rotary calls split in two because their query and key are disjoint views of one storage.
    pub rotary_splits: usize,
}

impl fmt::Display for LowerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut counts: IndexMap<String, usize> = IndexMap::new();
        for s in &self.selections {
            *counts.entry(format!("{}={}", s.op, s.provider)).or_default() += 1;
        }
        let summary: Vec<String> = counts.iter().map(|(k, n)| format!("{k}×{n}")).collect();
        write!(f, "lowered {} call(s): {}", self.selections.len(), summary.join(", "))?;
        if self.rotary_splits > 0 {
            write!(f, "; {} rotary call(s) on one storage split in two", self.rotary_splits)?;
        }
        if !self.not_lowered.is_empty() {
            write!(f, "; {} maybe_inplace call(s) not lowered", self.not_lowered.len())?;
        }
        Ok(())
    }
}

/// Lowering: replaces each functional op call by the implementation the installed priorities select.
///
/// # What it does
///
/// For each functional `IrCall`, selection runs on the graph's metadata with the registry's
/// installed priorities (the same rules as eager dispatch). A non-inplace choice becomes an
/// `ImplCall` with the same arguments. For an inplace choice, a `clone` of each activation is inserted
/// right before the call and the `ImplCall` receives the clones, with `writes` = the activation
/// positions; clone elimination later removes the clones nothing needs. The `ImplCall` keeps the
/// node's results, so their names and uses stay. Choosing native gives `impl <op>[native]`; when
/// the providers listed before native rejected the call or are unavailable here, that is a native
/// fallback, as in eager dispatch: counted in the selection record and said once, or refused by a
/// strict registry (the pass fails, naming the node and each provider's reason).
///
/// An in-place kernel writes one activation per storage, so a `rotary_embedding` (or
/// `fused_qk_norm_rope`) call whose query and key are disjoint views of one storage (column slices
/// of one `qkv` buffer) and whose provider is in place becomes two calls, the key rotated (and
/// normalized, with its weight) as the query of its own call (every head is treated alike: the
/// same bits), placed before the query's; clone elimination can then let each write its slice
/// where it is ([`LowerReport::rotary_splits`] counts them).
///
/// # What it does not do
///
/// `maybe_inplace` calls (not functionalized) are not lowered: the pass warns once, listing them, and
/// the interpreter still runs them through dispatch. A lowered graph does not change when priorities
/// change later.
///
/// ```
/// use ir_graph::parse;
/// use ir_passes::{PassContext, lower};
///
/// let mut graph = parse(
///     "graph g(%x: f32[2,8]) {
///        %0 = rms_norm(%x, none, 1e-6, none) : f32[2,8]
///        output(%0)
///      }",
/// )?;
/// let registry = ir_ops::registry();
/// let report = lower(&mut graph, &PassContext::new(&registry))?;
/// assert_eq!(report.to_string(), "lowered 1 call(s): rms_norm=native×1");
/// assert!(graph.to_string().contains("%0 = impl rms_norm[native] (%x, none, 1e-6, none) : f32[2,8]"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Runs lowering, as described above.
pub fn lower(graph: &mut Graph, cx: &PassContext<'_>) -> Result<LowerReport, PassError> {
    let _span = tracing::info_span!("pass", name = "lower").entered();
    let mut report = LowerReport { rotary_splits: split_rotary_on_one_storage(graph, cx)?, ..LowerReport::default() };
    let mut plan = Vec::new();
    // Selection depends only on the op and the argument metadata, which a model's layers repeat:
    // remember the last few (selection runs the same rules either way).
    let mut memo: Vec<SelectionMemo<'_>> = Vec::new();
    let mut next_slot = 0;
    for &node in graph.order() {
        let NodeKind::IrCall { op: op_ref, overload, args } = &graph.node(node).kind else { continue };
        let op = graph.op_name(*op_ref);
        if *overload == Overload::MaybeInplace {
            report.not_lowered.push(node);
            continue;
        }
        // Integer lists (no op takes one) reach selection as `none`, which the meta function rejects.
        let metas: Vec<ArgMeta<'_>> = args.iter().map(|a| graph.arg_meta(a)).collect();
        let slot = match memo.iter().position(|(o, m, _)| *o == *op_ref && same_metas(m, &metas)) {
            Some(slot) => slot,
            None => {
                let selection = cx.registry.select(op, &metas).map_err(|source| PassError::Selection {
                    node: graph.display_node(node),
                    source: Box::new(source),
                })?;
                // The given activations: an absent optional one is neither cloned nor written.
                let activations = if selection.inplace {
                    ir_graph::given_activations(&cx.registry.activations(op).unwrap_or_default(), args)
                } else {
                    Vec::new()
                };
                let chosen = Chosen {
                    op: cx.registry.op_def(op).map_or("?", |def| def.name),
                    provider: selection.provider,
                    inplace: selection.inplace,
                    rejected: selection.rejected.into(),
                    activations,
                };
                let entry = (*op_ref, metas, Rc::new(chosen));
                if memo.len() < SELECTION_MEMO {
                    memo.push(entry);
                    memo.len() - 1
                } else {
                    let slot = next_slot;
                    next_slot = (slot + 1) % SELECTION_MEMO;
                    memo[slot] = entry;
                    slot
                }
            }
        };
        let chosen = &memo[slot].2;
        // Lowering to native past the providers listed before it is a fallback, as an eager call's
        // is: counted and said once (a strict registry refused it in `select`).
        if chosen.provider == NATIVE && !chosen.rejected.is_empty() {
            cx.registry
                .count_native_fallback(op, &chosen.rejected)
                .map_err(|source| PassError::Selection { node: graph.display_node(node), source: Box::new(source) })?;
        }
        plan.push((node, *op_ref, Rc::clone(chosen)));
    }
    if !report.not_lowered.is_empty() {
        let listed: Vec<String> = report.not_lowered.iter().map(|&n| graph.display_node(n)).collect();
        tracing::warn!(
            target: "ir_passes::lower",
            "{} maybe_inplace call(s) were not functionalized and stay unlowered: {}",
            listed.len(),
            listed.join("; ")
        );
    }
    let mut placements = Vec::new();
    // The clones to come, made room for exactly (the arenas would otherwise double).
    let clones: usize = plan.iter().map(|(_, _, chosen)| chosen.activations.len()).sum();
    graph.reserve_exact(clones, clones);
    report.selections.reserve_exact(plan.len());
    for (node, op, chosen) in plan {
        let mut args = match &mut graph.node_mut(node).kind {
            NodeKind::IrCall { args, .. } => std::mem::take(args),
            _ => unreachable!("planned nodes are op calls"),
        };
        let activations = &chosen.activations;
        for &position in activations {
            let Some(Arg::Tensor(value)) = args.get(position) else { continue };
            let meta = graph.meta(*value);
            let clone_meta = TensorMeta { layout: meta.layout.copy_layout(), ..meta.clone() };
            let (clone_node, clone) = graph.create_detached(NodeKind::clone_of(*value), vec![clone_meta]);
            placements.push((node, clone_node));
            args[position] = Arg::Tensor(clone[0]);
            report.clones_inserted += 1;
        }
        let provider = graph.provider_ref(chosen.provider);
        graph.node_mut(node).kind = NodeKind::ImplCall { op, provider, writes: activations.clone(), args };
        report.selections.push(Lowered {
            node,
            op: chosen.op,
            provider: chosen.provider,
            inplace: chosen.inplace,
            rejected: Arc::clone(&chosen.rejected),
        });
    }
    // One pass over the order places every clone right before its call.
    graph.insert_detached_before(&placements);
    tracing::debug!(target: "ir_passes::lower", %report);
    Ok(report)
}

/// What lowering records of one selection: the op, the choice, the rejections and the given
/// activations (cloned and written when the choice is in place).
struct Chosen {
    op: &'static str,
    provider: &'static str,
    inplace: bool,
    rejected: Arc<[Rejection]>,
    activations: Vec<usize>,
}

/// A remembered selection: op, argument metadata, and what was chosen.
type SelectionMemo<'g> = (OpRef, Vec<ArgMeta<'g>>, Rc<Chosen>);

/// Distinct (op, metadata) selections remembered per run.
const SELECTION_MEMO: usize = 8;

/// Argument metadata equal for selection ([`ArgMeta::same_as`]).
fn same_metas(a: &[ArgMeta<'_>], b: &[ArgMeta<'_>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_as(y))
}

/// A rotation an in-place kernel runs on the query and the key: the positions of its query and
/// key, and of the query's and the key's norm weights when it has them.
struct Rotation {
    def: &'static ir_core::op::OpDef,
    query: usize,
    key: usize,
    weights: Option<(usize, usize)>,
}

/// The rotations whose calls on one storage are split.
static ROTATIONS: [Rotation; 2] = [
    Rotation {
        def: &ROTARY_EMBEDDING,
        query: RotaryEmbeddingArgs::query,
        key: RotaryEmbeddingArgs::key,
        weights: None,
    },
    Rotation {
        def: &FUSED_QK_NORM_ROPE,
        query: FusedQkNormRopeArgs::query,
        key: FusedQkNormRopeArgs::key,
        weights: Some((FusedQkNormRopeArgs::q_weight, FusedQkNormRopeArgs::k_weight)),
    },
];

/// Splits each functional `rotary_embedding` (or `fused_qk_norm_rope`) call whose query and key are disjoint views of one
/// storage (column slices of one `qkv` buffer) and whose selected provider is in place into two
/// calls, the key rotated as the query of a call of its own (rotary treats every head alike, so the
/// results are the same bits). An in-place kernel writes one activation per storage, so after the
/// split each call can write its slice where it is once clone elimination proves the slices apart.
/// Returns the number of calls split.
fn split_rotary_on_one_storage(graph: &mut Graph, cx: &PassContext<'_>) -> Result<usize, PassError> {
    if !ROTATIONS.iter().any(|rotation| graph.mentions_op(rotation.def)) {
        return Ok(0);
    }
    let ops = OpTable::compute(graph, cx.registry);
    let roots = StorageRoots::compute(graph, &ops);
    let mut splits = Vec::new();
    for &node in graph.order() {
        let Some((rotation, args)) =
            ROTATIONS.iter().find_map(|r| graph.functional_call_of(node, r.def).map(|args| (r, args)))
        else {
            continue;
        };
        let (query, key) = (rotation.query, rotation.key);
        let (Some(Arg::Tensor(query)), Some(Arg::Tensor(key))) = (args.get(query), args.get(key)) else { continue };
        let (q, k) = (&graph.meta(*query).layout, &graph.meta(*key).layout);
        if roots.root(*query) != roots.root(*key) || !q.disjoint_from(k) {
            continue;
        }
        let metas: Vec<ArgMeta<'_>> = args.iter().map(|a| graph.arg_meta(a)).collect();
        let selection = cx
            .registry
            .select(rotation.def.name, &metas)
            .map_err(|source| PassError::Selection { node: graph.display_node(node), source: Box::new(source) })?;
        if selection.inplace {
            splits.push((rotation, node));
        }
    }
    if splits.is_empty() {
        return Ok(0);
    }
    let uses = graph.use_lists();
    let mut placements = Vec::with_capacity(splits.len());
    for &(rotation, node) in &splits {
        let NodeKind::IrCall { op, args, .. } = &mut graph.node_mut(node).kind else {
            unreachable!("split nodes are rotary calls")
        };
        let op = *op;
        // The query's call keeps no key (nor the key's weight); the key's call rotates the key as
        // its query (with the key's weight as the query's).
        let mut key_args = args.clone();
        for (query_at, key_at) in std::iter::once((rotation.query, rotation.key)).chain(rotation.weights) {
            key_args[query_at] = std::mem::replace(&mut args[key_at], Arg::None);
            key_args[key_at] = Arg::None;
        }
        let key_result = graph.node(node).results[1];
        let key_meta = graph.meta(key_result).clone();
        let kind = NodeKind::IrCall { op, overload: Overload::Default, args: key_args };
        let (key_node, rotated) = graph.create_detached(kind, vec![key_meta]);
        graph.node_mut(node).results.truncate(1);
        graph.replace_uses_in(&uses[key_result], key_result, rotated[0]);
        placements.push((node, key_node));
    }
    graph.insert_detached_before(&placements);
    tracing::debug!(target: "ir_passes::lower", calls = splits.len(), "rotary calls on one storage split in two");
    Ok(splits.len())
}
