//! Analyses shared by the passes: which nodes write which values, and storage roots.

use cranelift_entity::SecondaryMap;
use ir_core::op::Overload;
use ir_graph::{Arg, Effect, Graph, NodeId, NodeKind, OpTable, ValueId};

/// The values a node writes: an `ImplCall`'s `writes` arguments, a writing built-in's first
/// value (`copy_`'s destination), and a
/// `maybe_inplace` call's activations (it donates them). Nothing else writes.
pub fn written_values(graph: &Graph, ops: &OpTable, node: NodeId) -> Vec<ValueId> {
    let mut written = Vec::new();
    for_each_written_value(graph, ops, node, |value| written.push(value));
    written
}

/// The written values of [`written_values`], in order, without allocating (the passes' hot loops).
pub(crate) fn for_each_written_value(graph: &Graph, ops: &OpTable, node: NodeId, mut f: impl FnMut(ValueId)) {
    let values_at = |positions: &[usize], args: &[Arg], f: &mut dyn FnMut(ValueId)| {
        for &p in positions {
            if let Some(Arg::Tensor(v)) = args.get(p) {
                f(*v);
            }
        }
    };
    match &graph.node(node).kind {
        NodeKind::ImplCall { writes, args, .. } => values_at(writes, args, &mut f),
        kind @ NodeKind::Builtin { .. } => kind.builtin_subject(Effect::WriteFirst).into_iter().for_each(f),
        NodeKind::IrCall { op, overload: Overload::MaybeInplace, args } => {
            values_at(ops.activations(*op), args, &mut f)
        }
        _ => {}
    }
}

/// Whether the node writes any value ([`written_values`] is not empty).
pub(crate) fn writes_any(graph: &Graph, ops: &OpTable, node: NodeId) -> bool {
    let mut any = false;
    for_each_written_value(graph, ops, node, |_| any = true);
    any
}

/// `writes_before[i]`: how many of the first `i` nodes of the order write a value (so the writers
/// strictly between positions `a` and `b` number `writes_before[b] - writes_before[a + 1]`).
pub(crate) fn writes_before(graph: &Graph, ops: &OpTable) -> Vec<u32> {
    let mut counts = Vec::with_capacity(graph.order().len() + 1);
    counts.push(0u32);
    for &node in graph.order() {
        let writes = u32::from(writes_any(graph, ops, node));
        counts.push(counts.last().copied().unwrap_or(0) + writes);
    }
    counts
}

/// Rewires every use of a value with a replacement to the replacement, in one pass over the order.
pub(crate) fn replace_uses(graph: &mut Graph, replacement: &SecondaryMap<ValueId, Option<ValueId>>) {
    let order = graph.order().to_vec();
    for node in order {
        let mut operands = graph.node(node).kind.operands();
        operands.sort_unstable();
        operands.dedup();
        for old in operands {
            if let Some(new) = replacement[old] {
                graph.node_mut(node).kind.replace_operand(old, new);
            }
        }
    }
}

/// Storage roots: an input is its own root; a view's root is its input's root; a writing
/// node's result i has the root of what it wrote; every other value is its own root.
pub struct StorageRoots {
    roots: SecondaryMap<ValueId, Option<ValueId>>,
}

impl StorageRoots {
    /// Computes the roots of every live value, in graph order.
    pub fn compute(graph: &Graph, ops: &OpTable) -> StorageRoots {
        let mut roots: SecondaryMap<ValueId, Option<ValueId>> = SecondaryMap::with_capacity(graph.value_capacity());
        for &node in graph.order() {
            let data = graph.node(node);
            let root_of = |roots: &SecondaryMap<ValueId, Option<ValueId>>, v: ValueId| roots[v].unwrap_or(v);
            let mut written: smallvec::SmallVec<[ValueId; 4]> = smallvec::SmallVec::new();
            for_each_written_value(graph, ops, node, |value| written.push(value));
            for (i, &result) in data.results.iter().enumerate() {
                let root = match &data.kind {
                    kind @ NodeKind::Builtin { .. } => {
                        match kind.builtin_subject(Effect::View).or(kind.builtin_subject(Effect::WriteFirst)) {
                            Some(subject) => root_of(&roots, subject),
                            None => result,
                        }
                    }
                    NodeKind::ImplCall { .. } | NodeKind::IrCall { .. } if i < written.len() => {
                        root_of(&roots, written[i])
                    }
                    _ => result,
                };
                roots[result] = Some(root);
            }
        }
        StorageRoots { roots }
    }

    /// The root of `value`.
    pub fn root(&self, value: ValueId) -> ValueId {
        self.roots[value].unwrap_or(value)
    }
}

/// What a fusion pass reads of the unmodified graph before it decides: each node's position, each
/// value's users, and the writes before each position ([`writes_before`]).
pub(crate) struct FusionFacts {
    pub(crate) positions: SecondaryMap<NodeId, u32>,
    pub(crate) uses: SecondaryMap<ValueId, ir_graph::UseList>,
    pub(crate) writes_before: Vec<u32>,
}

impl FusionFacts {
    /// The facts of `graph`.
    pub(crate) fn compute(graph: &Graph, cx: &crate::PassContext<'_>) -> FusionFacts {
        let ops = OpTable::compute(graph, cx.registry);
        let writes_before = writes_before(graph, &ops);
        FusionFacts { positions: graph.positions(), uses: graph.use_lists(), writes_before }
    }
}

/// One fusion as [`split_misplaced`] sees it: the fused call stands right before `anchor`, takes
/// `args`, and replaces the nodes `removed` (whose results `replaced` it redefines).
pub(crate) struct FusionSite<'a> {
    /// The node the fused call goes right before.
    pub(crate) anchor: NodeId,
    /// The fused call's arguments.
    pub(crate) args: &'a [Arg],
    /// The nodes the fusion removes.
    pub(crate) removed: smallvec::SmallVec<[NodeId; 3]>,
    /// The values the fused call's results replace.
    pub(crate) replaced: &'a [ValueId],
}

/// A fusion decided by a pass, before it is applied.
pub(crate) trait DecidedFusion {
    /// Where the fused call goes and what it reads and replaces.
    fn site(&self) -> FusionSite<'_>;
}

/// Splits off the fusions whose call would read a value that is not there yet, each with that
/// operand printed: an operand that one of the fusion's own removed nodes defines (the norm's
/// weight is the add's sum), one that depends on them through nodes between (a value computed
/// from the sum), or one defined at or after the place the call takes, counting a value another
/// fusion replaces as defined where that fusion's call stands (an earlier pair's sum as the weight
/// of a call moved up to its own add, above the earlier pair's fused call).
///
/// Dropping a fusion moves the values it would have replaced back to their own definitions, which
/// can make another fusion's operand available or not; the check is repeated until no fusion is
/// dropped (each round drops one at least). Returns the fusions to apply, in their order, and the
/// dropped ones.
pub(crate) fn split_misplaced<F: DecidedFusion>(
    graph: &Graph,
    positions: &SecondaryMap<NodeId, u32>,
    fusions: Vec<F>,
) -> (Vec<F>, Vec<(F, String)>) {
    let mut misplaced: Vec<Option<ValueId>> = vec![None; fusions.len()];
    let sites: Vec<FusionSite<'_>> = fusions.iter().map(DecidedFusion::site).collect();
    loop {
        // Where each value a kept fusion replaces is defined once the fusions are applied.
        let mut moved: SecondaryMap<ValueId, Option<u32>> = SecondaryMap::new();
        for (site, _) in sites.iter().zip(&misplaced).filter(|(_, misplaced)| misplaced.is_none()) {
            for &value in site.replaced {
                moved[value] = Some(positions[site.anchor]);
            }
        }
        let mut dropped_now = false;
        for (site, misplaced) in sites.iter().zip(misplaced.iter_mut()) {
            if misplaced.is_some() {
                continue;
            }
            *misplaced = site.args.iter().find_map(|arg| match arg {
                Arg::Tensor(value) if !operand_ready(graph, positions, &moved, site, *value) => Some(*value),
                _ => None,
            });
            dropped_now |= misplaced.is_some();
        }
        if !dropped_now {
            break;
        }
    }
    drop(sites);
    let (mut kept, mut dropped) = (Vec::new(), Vec::new());
    for (fusion, misplaced) in fusions.into_iter().zip(misplaced) {
        match misplaced {
            None => kept.push(fusion),
            Some(operand) => dropped.push((fusion, graph.display_value(operand))),
        }
    }
    (kept, dropped)
}

/// Whether `value` is defined before `site.anchor` once the kept fusions (`moved`) are applied,
/// and neither is nor depends on a result of the nodes the site removes.
fn operand_ready(
    graph: &Graph,
    positions: &SecondaryMap<NodeId, u32>,
    moved: &SecondaryMap<ValueId, Option<u32>>,
    site: &FusionSite<'_>,
    value: ValueId,
) -> bool {
    let anchor_at = positions[site.anchor];
    let defined_at = moved[value].unwrap_or(positions[graph.value(value).def]);
    if anchor_at <= defined_at {
        return false;
    }
    // A value defined before the first removed node cannot depend on one; only the nodes after it
    // are walked (the few between the pair).
    let first_removed = site.removed.iter().map(|&node| positions[node]).min().unwrap_or(u32::MAX);
    let mut visited = std::collections::HashSet::new();
    let mut stack = vec![graph.value(value).def];
    while let Some(node) = stack.pop() {
        if positions[node] < first_removed || !visited.insert(node) {
            continue;
        }
        if site.removed.contains(&node) {
            return false;
        }
        graph.node(node).kind.for_each_operand(|operand| stack.push(graph.value(operand).def));
    }
    true
}

/// A fusion to apply: a call of the fused op `op` with `args`, right before `anchor`, replacing
/// the nodes `removed`, whose results `replaced` (in the fused call's result order) it redefines.
pub(crate) struct FusedCall {
    /// The fused op.
    pub(crate) op: &'static str,
    /// The node the fused call goes right before.
    pub(crate) anchor: NodeId,
    /// The fused call's arguments.
    pub(crate) args: Vec<Arg>,
    /// The nodes the call replaces.
    pub(crate) removed: smallvec::SmallVec<[NodeId; 3]>,
    /// The values its results replace.
    pub(crate) replaced: Vec<ValueId>,
}

/// Applies decided fusions (checked by [`split_misplaced`]) at once: creates each fused call with
/// the metadata of the values it replaces, places it, removes the replaced nodes and rewires every
/// use, the fused calls' own operands included (one fusion's call may read a value another's
/// replaces). Returns the created nodes, in the fusions' order.
pub(crate) fn apply_fusions(graph: &mut Graph, fusions: Vec<FusedCall>) -> Vec<NodeId> {
    if fusions.is_empty() {
        return Vec::new();
    }
    let mut replacement: SecondaryMap<ValueId, Option<ValueId>> = SecondaryMap::new();
    let mut placements = Vec::with_capacity(fusions.len());
    let mut removed = cranelift_entity::EntitySet::new();
    let mut created = Vec::with_capacity(fusions.len());
    for fusion in fusions {
        let metas = fusion.replaced.iter().map(|&v| graph.meta(v).clone()).collect();
        let kind = NodeKind::IrCall { op: graph.op_ref(fusion.op), overload: Overload::Default, args: fusion.args };
        let (node, results) = graph.create_detached(kind, metas);
        for (&old, &new) in fusion.replaced.iter().zip(&results) {
            replacement[old] = Some(new);
        }
        placements.push((fusion.anchor, node));
        for node in fusion.removed {
            removed.insert(node);
        }
        created.push(node);
    }
    graph.insert_detached_before(&placements);
    graph.remove_nodes(&removed);
    replace_uses(graph, &replacement);
    created
}
