//! `ir-graph`: the graph IR of vllm-ir-rs — traced models as SSA graphs with concrete metadata on
//! every value, their text format, the verifier, the interpreter and the tracer.
//!
//! Definitions are kept apart from order: nodes and values live in arenas addressed by typed ids,
//! and `order` lists the live nodes. Ids are never reused; removing a node takes it out of the order
//! and keeps its data, so diagnostics can still name it. Every value knows its defining node, its
//! result index and its `TensorMeta`.
//!
//! The text format is produced by [`Graph`]'s `Display` and read by [`parse`]; [`verify`]
//! checks a graph against a registry; [`interpret`] runs it on real tensors through the registry,
//! with safety checks; [`Tracer`] is an execution context that records a graph from model code
//! written against `ir_core::ExecutionContext`. The passes live in `ir-passes`.
//!
//! ```
//! use ir_core::{DType, Registry, Tensor};
//! use ir_graph::{InterpOptions, interpret, parse, verify};
//!
//! let graph = parse(
//!     "graph g(%x: f32[2,4]) {
//!        %y = rms_norm(%x, none, 1e-6, none) : f32[2,4]
//!        output(%y)
//!      }",
//! )?;
//! let registry = ir_ops::registry();
//! verify(&graph, &registry)?;
//! let x = Tensor::from_f32(DType::F32, &[2, 4], &[1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 2.0])?;
//! let run = interpret(&graph, &registry, vec![("x".to_owned(), x)], InterpOptions::checked())?;
//! assert_eq!(run.outputs[0].shape(), &[2, 4]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Logging
//!
//! Libraries only emit `tracing` events; binaries install a subscriber honouring `RUST_LOG`. Targets:
//! `ir_graph::interp` (a run's statistics, defensive copies of shared donated inputs),
//! `ir_graph::trace` (renamed inputs, parameter names shared by distinct tensors).

mod dot;
mod graph;
mod interp;
mod op_table;
mod parse;
mod print;
mod trace;
mod verify;

pub(crate) use crate::graph::MetaRef;
pub use crate::graph::*;
pub use crate::interp::{InterpError, InterpOptions, InterpStats, Interpretation, SafetyChecks, interpret};
pub use crate::op_table::OpTable;
pub use crate::parse::{ParseError, parse};
pub use crate::print::format_float;
pub use crate::trace::{Traced, TracedGraph, Tracer};
pub use crate::verify::{Diagnostic, Problem, VerifyError, verify};
pub use ir_core::builtin::{Builtin, BuiltinDef, BuiltinParam, Effect};
