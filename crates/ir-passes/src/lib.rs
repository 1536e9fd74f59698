//! `ir-passes`: the graph passes that make donation safe and free.
//!
//! Each pass is a function of the same name; its module holds its essay (the rules, with IR
//! examples).
//!
//! - [`functionalize`](fn@functionalize): `maybe_inplace` calls become functional after the donated values are proven
//!   dead; donated graph inputs are marked.
//! - [`lower`](fn@lower): each op call becomes the implementation the installed priorities select; in-place
//!   implementations get copies of their activations.
//! - [`eliminate_clones`](fn@eliminate_clones): copies nothing needs are removed, with vLLM's rules (`unsafe`) or with
//!   storage roots (`alias-aware`, the default).
//! - [`dce`](fn@dce): dead nodes are removed.
//! - [`fuse_add_rms_norm`](fn@fuse_add_rms_norm): an `add` whose sum an `rms_norm` normalizes
//!   becomes one `fused_add_rms_norm`; the standard pipeline runs its exact form
//!   (`fuse-add-rms-norm-exact`: f32 and f64 pairs, whose results stay bit-identical), and
//!   `fuse-add-rms-norm` by name fuses 16-bit pairs too (last-bit differences, within tolerance).
//! - [`fuse_norm_quant`](fn@fuse_norm_quant): an fp8 quantization of an RMS norm's output becomes one
//!   norm + quantization op (in the standard pipeline, right after functionalize: the fused ops'
//!   semantics are the pair's).
//! - [`fuse_row_programs`](fn@fuse_row_programs): chains that one row-program op computes become
//!   that op (add + `layer_norm`, Gemma's sandwich norms, `silu_and_mul` + per-token fp8
//!   quantization); the standard pipeline runs its exact form (`fuse-row-programs-exact`: the
//!   chains whose results keep their bits on the provider that runs them).
//!
//! [`Pipeline::standard`] runs functionalize, fuse-add-rms-norm-exact, fuse-row-programs-exact,
//! fuse-norm-quant, dce, lower, eliminate-clones and dce, and verifies after each pass.
//!
//! ```
//! use ir_graph::parse;
//! use ir_passes::{PassContext, Pipeline, Snapshots};
//!
//! let registry = ir_ops::registry();
//! let mut graph = parse(
//!     "graph g(%x: bf16[8,16], %r: bf16[8,16], %w: bf16[16]) {
//!        %0, %1 = fused_add_rms_norm.maybe_inplace(%x, %r, %w, 1e-6, none) : bf16[8,16], bf16[8,16]
//!        output(%0, %1)
//!      }",
//! )?;
//! let report = Pipeline::standard().run(&mut graph, &PassContext::new(&registry), None, Snapshots::Skip)?;
//! assert_eq!(report.runs.len(), 8);
//! assert!(graph.to_string().contains("impl fused_add_rms_norm[native] (%x, %r, %w, 1e-6, none)"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Logging
//!
//! Each pass runs inside `info_span!("pass", name = ..)` and logs its report on
//! `ir_passes::<pass>` at debug level; the pipeline logs each pass's duration on
//! `ir_passes::pipeline`; lowering warns about `maybe_inplace` calls it leaves.

mod analysis;
mod dce;
mod eliminate_clones;
mod functionalize;
mod fuse_add_rms_norm;
mod fuse_norm_quant;
mod fuse_row_programs;
mod fusion;
mod lower;
mod pipeline;

use std::fmt;

use ir_core::{CallError, Registry};

pub use crate::analysis::{StorageRoots, written_values};
pub use crate::dce::{DceReport, dce};
pub use crate::eliminate_clones::{CloneReport, KeepReason, KeptCopy, eliminate_clones};
pub use crate::functionalize::{FunctionalizeReport, functionalize};
pub use crate::fuse_add_rms_norm::{fuse_add_rms_norm, fuse_add_rms_norm_exact};
pub use crate::fuse_norm_quant::fuse_norm_quant;
pub use crate::fuse_row_programs::{fuse_row_programs, fuse_row_programs_exact};
pub use crate::fusion::{FusionReport, FusionSkip};
pub use crate::lower::{LowerReport, Lowered, lower};
pub use crate::pipeline::{
    PASSES, PassDef, PassName, PassReport, PassRun, Pipeline, PipelineError, PipelineReport, Snapshots, known_passes,
};
pub use ir_graph::OpTable;

/// Which clone elimination to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloneElimination {
    /// Storage-root aware and sound; the default.
    AliasAware,
    /// vLLM's rules; ignores aliasing through views and duplicate activations.
    Unsafe,
}

/// What every pass receives: the registry (whose installed priorities lowering uses) and options.
#[derive(Clone, Copy, Debug)]
pub struct PassContext<'r> {
    /// The registry.
    pub registry: &'r Registry,
    /// The clone elimination variant.
    pub clone_elimination: CloneElimination,
}

impl<'r> PassContext<'r> {
    /// A context with the alias-aware clone elimination.
    pub fn new(registry: &'r Registry) -> PassContext<'r> {
        PassContext { registry, clone_elimination: CloneElimination::AliasAware }
    }

    /// The same context with another clone elimination variant.
    pub fn with_clone_elimination(self, clone_elimination: CloneElimination) -> PassContext<'r> {
        PassContext { clone_elimination, ..self }
    }
}

/// A donated value used after the call it was donated to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The value, printed (`%x`).
    pub value: String,
    /// The donating call, printed.
    pub donating_node: String,
    /// The later user, printed.
    pub later_user: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is donated to `{}` but used later by `{}`; activations passed to maybe_inplace are donated and may be \
             overwritten; use the functional call, or clone the value explicitly before the call",
            self.value, self.donating_node, self.later_user
        )
    }
}

/// Pass errors. On error a pass leaves the graph unchanged.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PassError {
    /// Donated values used after their donation; every violation is listed.
    #[error("{}", violations.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    DonatedValueReused {
        /// The violations.
        violations: Vec<Violation>,
    },
    /// An op the registry does not define.
    #[error("unknown op `{op}`")]
    UnknownOp {
        /// The op.
        op: String,
    },
    /// Selection failed while lowering a node.
    #[error("lowering `{node}`: {source}")]
    Selection {
        /// The node, printed.
        node: String,
        /// Why.
        source: Box<CallError>,
    },
    /// A pass name that does not exist.
    #[error("unknown pass `{name}` (known: {})", crate::pipeline::known_passes())]
    UnknownPass {
        /// The name.
        name: String,
    },
}
