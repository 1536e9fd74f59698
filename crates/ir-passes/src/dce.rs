//! Dead-code elimination (R84): removes, until nothing changes, nodes that write nothing and whose
//! results nobody uses. Inputs, the output node and writing nodes always stay.
//!
//! ```
//! use ir_core::graph::parse;
//! use ir_passes::{PassContext, dce};
//!
//! let mut graph = parse(
//!     "graph g(%x: f32[4]) {
//!        %0 = scale(%x, 2.0) : f32[4]
//!        %1 = clone(%0) : f32[4]
//!        output(%x)
//!      }",
//! )?;
//! let registry = ir_core::Registry::with_builtin_ops();
//! let report = dce(&mut graph, &PassContext::new(&registry))?;
//! assert_eq!(report.removed.len(), 2);
//! assert_eq!(graph.to_string(), "graph g(%x: f32[4]) {\n  output(%x)\n}\n");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use ir_core::graph::{Graph, NodeId, NodeKind};

use crate::analysis::written_values;
use crate::{PassContext, PassError};

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

/// Runs dead-code elimination. See the module documentation.
pub fn dce(graph: &mut Graph, cx: &PassContext<'_>) -> Result<DceReport, PassError> {
    let _span = tracing::info_span!("pass", name = "dce").entered();
    let mut report = DceReport::default();
    loop {
        let uses = graph.use_lists();
        let dead: Vec<NodeId> = graph
            .order()
            .iter()
            .copied()
            .filter(|&node| {
                let data = graph.node(node);
                let keep = matches!(data.kind, NodeKind::Input { .. } | NodeKind::Output(_))
                    || !written_values(graph, cx.registry, node).is_empty();
                !keep && data.results.iter().all(|&r| uses[r].is_empty())
            })
            .collect();
        if dead.is_empty() {
            break;
        }
        for node in dead {
            graph.remove_node(node);
            report.removed.push(node);
        }
    }
    tracing::debug!(target: "ir_passes::dce", %report);
    Ok(report)
}
