//! Analyses shared by the passes: which nodes write which values, and storage roots.

use cranelift_entity::SecondaryMap;
use ir_core::op::Overload;
use ir_graph::{Arg, Effect, Graph, NodeId, NodeKind, OpTable, ValueId};

/// The values a node writes: an `ImplCall`'s `writes` arguments, a writing built-in's first
/// value (`copy_`'s destination), and a
/// `maybe_inplace` call's activations (it donates them). Nothing else writes.
pub fn written_values(graph: &Graph, ops: &OpTable, node: NodeId) -> Vec<ValueId> {
    match &graph.node(node).kind {
        NodeKind::ImplCall { writes, args, .. } => writes
            .iter()
            .filter_map(|&p| match args.get(p) {
                Some(Arg::Value(v)) => Some(*v),
                _ => None,
            })
            .collect(),
        kind @ NodeKind::Builtin { .. } => kind.builtin_subject(Effect::WriteFirst).into_iter().collect(),
        NodeKind::IrCall { op, overload: Overload::MaybeInplace, args } => ops
            .activations(*op)
            .iter()
            .filter_map(|&p| match args.get(p) {
                Some(Arg::Value(v)) => Some(*v),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// `writes_before[i]`: how many of the first `i` nodes of the order write a value (so the writers
/// strictly between positions `a` and `b` number `writes_before[b] - writes_before[a + 1]`).
pub(crate) fn writes_before(graph: &Graph, ops: &OpTable) -> Vec<u32> {
    let mut counts = Vec::with_capacity(graph.order().len() + 1);
    counts.push(0u32);
    for &node in graph.order() {
        let writes = u32::from(!written_values(graph, ops, node).is_empty());
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
            let written = written_values(graph, ops, node);
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
