//! Graphviz DOT export of a graph: one box per node (its statement), edges from definitions to users.

use std::fmt::Write;

use crate::{Effect, Graph, NodeKind};

impl Graph {
    /// The graph in Graphviz DOT syntax.
    pub fn to_dot(&self) -> String {
        let mut out = String::new();
        let escape = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
        writeln!(out, "digraph \"{}\" {{", escape(&self.name)).expect("writing to a String");
        out.push_str("  node [shape=box, fontname=\"monospace\"];\n");
        for &node in self.order() {
            let data = self.node(node);
            let style = match data.kind {
                NodeKind::Input { donated: true, .. } => ", style=filled, fillcolor=\"#ffe0b0\"",
                NodeKind::Input { .. } => ", style=filled, fillcolor=\"#e0e0ff\"",
                NodeKind::ImplCall { ref writes, .. } if !writes.is_empty() => ", color=red",
                NodeKind::Builtin { op, .. } => match op.def().effect {
                    Effect::Copy => ", style=dashed",
                    Effect::WriteFirst => ", color=red",
                    Effect::View | Effect::Compute => "",
                },
                _ => "",
            };
            writeln!(out, "  {node} [label=\"{}\"{style}];", escape(&self.display_node(node)))
                .expect("writing to a String");
        }
        for &node in self.order() {
            for value in self.node(node).kind.operands() {
                let def = self.value(value).def;
                writeln!(out, "  {def} -> {node} [label=\"{}\"];", escape(&self.display_value(value)))
                    .expect("writing to a String");
            }
        }
        out.push_str("}\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use crate::parse;

    #[test]
    fn dot_lists_nodes_and_edges() {
        let graph = parse("graph g(%x: f32[2] donated) {\n  %y = scale(%x, 2.0) : f32[2]\n  output(%y)\n}\n").unwrap();
        let dot = graph.to_dot();
        assert!(dot.starts_with("digraph \"g\" {"), "{dot}");
        assert!(dot.contains("label=\"%y = scale(%x, 2.0) : f32[2]\""), "{dot}");
        assert!(dot.contains("node0 -> node1 [label=\"%x\"]"), "{dot}");
        assert!(dot.contains("fillcolor=\"#ffe0b0\""), "donated inputs are highlighted: {dot}");
    }
}
