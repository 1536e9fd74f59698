//! The `dce` pass ([`dce`] documents it).

use std::fmt;

use cranelift_entity::EntitySet;
use ir_graph::{Graph, NodeId, NodeKind};

use crate::analysis::writes_any;
use crate::{PassContext, PassError};
use ir_graph::OpTable;

/// What DCE removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DceReport {
    /// Removed nodes, in removal order.
    pub removed: Vec<NodeId>,
}

impl fmt::Display for DceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "removed {} dead node(s)", self.removed.len())
    }
}

/// Dead-code elimination: removes, until nothing changes, nodes that write nothing and whose
/// results nobody uses. Inputs, the output node and writing nodes always stay.
///
/// ```
/// use ir_graph::parse;
/// use ir_passes::{PassContext, dce};
///
/// let mut graph = parse(
///     "graph g(%x: f32[4]) {
///        %0 = scale(%x, 2.0) : f32[4]
///        %1 = clone(%0) : f32[4]
///        output(%x)
///      }",
/// )?;
/// let registry = ir_ops::registry();
/// let report = dce(&mut graph, &PassContext::new(&registry))?;
/// assert_eq!(report.removed.len(), 2);
/// assert_eq!(graph.to_string(), "graph g(%x: f32[4]) {\n  output(%x)\n}\n");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Runs dead-code elimination, as described above.
///
/// A worklist over use counts makes it linear: removing a node can only make the definitions of its
/// operands dead.
pub fn dce(graph: &mut Graph, cx: &PassContext<'_>) -> Result<DceReport, PassError> {
    let _span = tracing::info_span!("pass", name = "dce").entered();
    let mut report = DceReport::default();
    let mut remaining = graph.use_counts();
    let ops = OpTable::compute(graph, cx.registry);
    let removable = |graph: &Graph, node: NodeId| {
        let kind = &graph.node(node).kind;
        !matches!(kind, NodeKind::Input { .. } | NodeKind::Output(_)) && !writes_any(graph, &ops, node)
    };
    let mut worklist: Vec<NodeId> = graph
        .order()
        .iter()
        .rev()
        .copied()
        // The use counts first: they rule out almost every node without looking at what it writes.
        .filter(|&n| graph.node(n).results.iter().all(|&r| remaining[r] == 0) && removable(graph, n))
        .collect();
    let mut removed = EntitySet::new();
    while let Some(node) = worklist.pop() {
        if !removed.insert(node) {
            continue;
        }
        report.removed.push(node);
        let mut operands = graph.node(node).kind.operands();
        operands.sort_unstable();
        operands.dedup();
        for value in operands {
            remaining[value] = remaining[value].saturating_sub(1);
            let def = graph.value(value).def;
            let dead = remaining[value] == 0
                && !removed.contains(def)
                && removable(graph, def)
                && graph.node(def).results.iter().all(|&r| remaining[r] == 0);
            if dead {
                worklist.push(def);
            }
        }
    }
    graph.remove_nodes(&removed);
    tracing::debug!(target: "ir_passes::dce", %report);
    Ok(report)
}
