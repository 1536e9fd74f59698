//! The `functionalize` pass ([`functionalize`] documents it).

use std::fmt;

use indexmap::IndexMap;
use ir_core::op::Overload;
use ir_graph::{Arg, Graph, NodeKind};

use crate::{PassContext, PassError, Violation};

/// What functionalization did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionalizeReport {
    /// Calls retargeted per op.
    pub functionalized: IndexMap<String, usize>,
    /// Graph inputs marked donated, by name, in order.
    pub donated: Vec<String>,
}

impl FunctionalizeReport {
    /// Total number of calls retargeted.
    pub fn total(&self) -> usize {
        self.functionalized.values().sum()
    }
}

impl fmt::Display for FunctionalizeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ops: Vec<String> = self.functionalized.iter().map(|(op, n)| format!("{op}×{n}")).collect();
        let donated: Vec<String> = self.donated.iter().map(|d| format!("%{d}")).collect();
        write!(
            f,
            "functionalized {} call(s) [{}]; donated inputs [{}]",
            self.total(),
            ops.join(", "),
            donated.join(", ")
        )
    }
}

/// Inplace functionalization: turns `maybe_inplace` calls functional after proving that the donated
/// values are dead, and records donated graph inputs.
///
/// # What it does
///
/// A `maybe_inplace` call donates its activations: the caller promises not to read them again, so a
/// kernel may overwrite them. For each such call, in order, and each activation value `v`, every
/// user of `v` positioned after the call (the output node included) is a violation. Users before the
/// call and the call itself are fine, so one value passed as both activations is allowed. If `v` is
/// a graph input, the input is marked `donated` (by name, visible in the text). The call is then
/// retargeted to the functional overload; lowering later decides whether a kernel writes in place.
///
/// # What it does not do
///
/// Only direct users are checked (as vLLM does); donation through views is made safe by the
/// alias-aware clone elimination. Nothing is reordered or removed.
///
/// # Invariants
///
/// After the pass no `maybe_inplace` call is left; on error the graph is unchanged and every
/// violation is reported. The pass is idempotent.
///
/// ```
/// use ir_graph::parse;
/// use ir_passes::{PassContext, functionalize};
///
/// let mut graph = parse(
///     "graph g(%x: bf16[8,16], %r: bf16[8,16], %w: bf16[16]) {
///        %0, %1 = fused_add_rms_norm.maybe_inplace(%x, %r, %w, 1e-6, none) : bf16[8,16], bf16[8,16]
///        output(%0, %1)
///      }",
/// )?;
/// let registry = ir_ops::registry();
/// let report = functionalize(&mut graph, &PassContext::new(&registry))?;
/// assert_eq!(report.donated, vec!["x", "r"]);
/// assert_eq!(graph.to_string(), "\
/// graph g(%x: bf16[8,16] donated, %r: bf16[8,16] donated, %w: bf16[16]) {
///   %0, %1 = fused_add_rms_norm(%x, %r, %w, 1e-6, none) : bf16[8,16], bf16[8,16]
///   output(%0, %1)
/// }
/// ");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Runs inplace functionalization, as described above.
pub fn functionalize(graph: &mut Graph, cx: &PassContext<'_>) -> Result<FunctionalizeReport, PassError> {
    let _span = tracing::info_span!("pass", name = "functionalize").entered();
    let positions = graph.positions();
    let uses = graph.use_lists();
    let mut violations = Vec::new();
    let mut retarget = Vec::new();
    let mut report = FunctionalizeReport::default();
    for &node in graph.order() {
        let NodeKind::IrCall { op, overload: Overload::MaybeInplace, args } = &graph.node(node).kind else { continue };
        let op = graph.op_name(*op);
        let activations = cx.registry.activations(op).ok_or_else(|| PassError::UnknownOp { op: op.to_owned() })?;
        for &position in &activations {
            let Some(Arg::Tensor(value)) = args.get(position) else { continue };
            for &user in &uses[*value] {
                if positions[user] > positions[node] {
                    violations.push(Violation {
                        value: graph.display_value(*value),
                        donating_node: graph.display_node(node),
                        later_user: graph.display_node(user),
                    });
                }
            }
            if let NodeKind::Input { name, donated: false } = &graph.node(graph.value(*value).def).kind
                && !report.donated.contains(name)
            {
                report.donated.push(name.clone());
            }
        }
        *report.functionalized.entry(op.to_owned()).or_default() += 1;
        retarget.push(node);
    }
    if !violations.is_empty() {
        return Err(PassError::DonatedValueReused { violations });
    }
    for node in retarget {
        if let NodeKind::IrCall { overload, .. } = &mut graph.node_mut(node).kind {
            *overload = Overload::Default;
        }
    }
    for name in &report.donated {
        graph.mark_donated(name);
    }
    tracing::debug!(target: "ir_passes::functionalize", %report);
    Ok(report)
}
