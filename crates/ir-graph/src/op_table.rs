//! What the verifier and the passes need of each op a graph calls, looked up once per graph.

use cranelift_entity::SecondaryMap;
use ir_core::Registry;
use ir_core::op::OpDef;

use crate::{Graph, OpRef};

/// Each op of a graph's op table resolved in the registry once (never per node): its definition
/// (`None` when the registry does not define it) and its activations.
pub struct OpTable {
    defs: SecondaryMap<OpRef, Option<&'static OpDef>>,
    activations: SecondaryMap<OpRef, Vec<usize>>,
}

impl OpTable {
    /// Looks up every op of `graph`'s table (an op the registry does not define has no activations).
    pub fn compute(graph: &Graph, registry: &Registry) -> OpTable {
        let mut defs = SecondaryMap::new();
        let mut activations = SecondaryMap::new();
        for (op, name) in graph.op_table() {
            defs[op] = registry.op_def(name);
            activations[op] = registry.activations(name).unwrap_or_default();
        }
        OpTable { defs, activations }
    }

    /// The definition of `op`, if the registry defines it.
    pub fn def(&self, op: OpRef) -> Option<&'static OpDef> {
        self.defs[op]
    }

    /// The parameter positions of `op`'s activations.
    pub fn activations(&self, op: OpRef) -> &[usize] {
        &self.activations[op]
    }
}
