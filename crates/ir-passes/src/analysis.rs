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
            if let Some(Arg::Value(v)) = args.get(p) {
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
