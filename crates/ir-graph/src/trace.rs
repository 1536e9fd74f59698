//! The tracer: an execution context that records graph nodes instead of running kernels, so
//! the same model source produces eager results and graphs.
//!
//! ```
//! use ir_ops::{Rounding, fused_add_rms_norm, rms_norm};
//! use ir_core::{CallError, DType, EagerContext, ExecutionContext, Registry, Tensor, bit_eq};
//! use ir_graph::{InterpOptions, Tracer, interpret};
//!
//! // A model written once against the execution context.
//! fn model<C: ExecutionContext>(ctx: &C, x: &C::Tensor, r: &C::Tensor) -> Result<C::Tensor, CallError> {
//!     let (y, _residual) = fused_add_rms_norm::call(ctx, x, r, None, 1e-6, None, Rounding::Exact)?;
//!     rms_norm::call(ctx, &y, None, 1e-6, None)
//! }
//!
//! let registry = ir_ops::registry();
//! let x = Tensor::from_f32(DType::F32, &[2, 4], &[1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 2.0])?;
//! let r = Tensor::ones(DType::F32, &[2, 4])?;
//! let eager = model(&EagerContext::new(&registry), &x, &r)?;
//!
//! let tracer = Tracer::new(&registry, "block");
//! let (tx, tr) = (tracer.input("x", x.meta().clone()), tracer.input("r", r.meta().clone()));
//! let out = model(&tracer, &tx, &tr)?;
//! let traced = tracer.finish(&[out]);
//! assert!(traced.graph.to_string().contains(r#"fused_add_rms_norm(%x, %r, none, 1e-6, none, "exact")"#));
//! let inputs = vec![("x".to_owned(), x), ("r".to_owned(), r)];
//! let run = interpret(&traced.graph, &registry, inputs, InterpOptions::checked())?;
//! assert!(bit_eq(&run.outputs[0], &eager));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Parameters are identified by the tensor (storage and layout), never by name alone: the same
//! tensor used twice is one graph input, and two distinct tensors under one name get two inputs,
//! the second renamed (`rms_norm.weight`, `rms_norm.weight.1`) with a warning. Every name the tracer
//! gives an input prints as a value name the parser reads back: characters outside `A-Z a-z 0-9 _ .`
//! become `_`, and a name already taken (by an input or a fresh `%<n>` name) gets a `.<k>` suffix.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::cell::RefCell;

use crate::{Arg, Builtin, BuiltinArg, Graph, NodeKind, ValueId};
use ir_core::builtin::{Scalars, check_args};
use ir_core::op::{ArgMeta, OpDef, Overload, bind_meta};
use ir_core::{CallArg, ExecutionContext};
use ir_core::{CallError, Layout, Registry, StorageId, Tensor, TensorMeta};

/// A traced value: another handle to the same SSA value when cloned.
#[derive(Clone, Debug, PartialEq)]
pub struct Traced {
    value: ValueId,
    meta: TensorMeta,
}

impl Traced {
    /// The graph value.
    pub fn value(&self) -> ValueId {
        self.value
    }
}

/// Records a graph; validates every call exactly like eager calls (meta functions, argument kinds).
pub struct Tracer<'r> {
    registry: &'r Registry,
    graph: RefCell<Graph>,
    parameters: RefCell<Vec<(String, Tensor)>>,
    /// Parameter inputs by tensor identity: storage and layout.
    parameter_values: RefCell<HashMap<(StorageId, Layout), Traced>>,
    /// Names given to inputs so far (declared inputs and parameters).
    input_names: RefCell<HashSet<String>>,
    /// Per spelled name, the next `.<k>` suffix to try, so renaming many inputs of one name stays linear.
    next_suffix: RefCell<HashMap<String, u64>>,
    /// Names parameters were requested under, to warn when distinct tensors share one.
    parameter_names: RefCell<HashSet<String>>,
    /// Parameter input nodes, placed after the declared inputs when the trace finishes (placing each
    /// at once would shift the whole order per parameter).
    pending_inputs: RefCell<Vec<crate::NodeId>>,
}

/// A finished trace: the graph and the parameter tensors its parameter inputs stand for.
#[derive(Clone, Debug)]
pub struct TracedGraph {
    /// The graph.
    pub graph: Graph,
    /// Parameter inputs by name, in the order they were first used.
    pub parameters: Vec<(String, Tensor)>,
}

impl<'r> Tracer<'r> {
    /// A tracer recording a graph called `name`.
    pub fn new(registry: &'r Registry, name: impl Into<String>) -> Tracer<'r> {
        Tracer {
            registry,
            graph: RefCell::new(Graph::new(name)),
            parameters: RefCell::new(Vec::new()),
            parameter_values: RefCell::new(HashMap::default()),
            input_names: RefCell::new(HashSet::default()),
            next_suffix: RefCell::new(HashMap::default()),
            parameter_names: RefCell::new(HashSet::default()),
            pending_inputs: RefCell::new(Vec::new()),
        }
    }

    /// Declares a graph input named `name`, made printable and unique as the module documentation
    /// says (the graph's inputs list the final names).
    pub fn input(&self, name: &str, meta: TensorMeta) -> Traced {
        let name = self.unique_input_name(name);
        let value = self.graph.borrow_mut().add_input(name, meta.clone());
        Traced { value, meta }
    }

    /// `name` with characters the text format cannot spell replaced by `_`, and a `.<k>` suffix when
    /// an input or a fresh value already has that name; the result is reserved.
    fn unique_input_name(&self, name: &str) -> String {
        let spelled: String =
            name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '.' { c } else { '_' }).collect();
        let base = if spelled.is_empty() { "input".to_owned() } else { spelled };
        let graph = self.graph.borrow();
        let mut names = self.input_names.borrow_mut();
        let taken = |candidate: &str| names.contains(candidate) || graph.is_fresh_name_taken(candidate);
        let mut unique = base.clone();
        if taken(&unique) {
            let mut next_suffix = self.next_suffix.borrow_mut();
            let suffix = next_suffix.entry(base.clone()).or_insert(1);
            while taken(&unique) {
                unique = format!("{base}.{suffix}");
                *suffix += 1;
            }
        }
        if unique != name {
            tracing::debug!(target: "ir_graph::trace", requested = name, given = unique.as_str(), "renamed a graph input");
        }
        names.insert(unique.clone());
        unique
    }

    /// Finishes the trace with these outputs.
    pub fn finish(self, outputs: &[Traced]) -> TracedGraph {
        let mut graph = self.graph.into_inner();
        graph.place_inputs(&self.pending_inputs.into_inner());
        graph.set_output(outputs.iter().map(|t| t.value).collect());
        TracedGraph { graph, parameters: self.parameters.into_inner() }
    }
}

impl ExecutionContext for Tracer<'_> {
    type Tensor = Traced;

    fn meta<'t>(&self, t: &'t Traced) -> &'t TensorMeta {
        &t.meta
    }

    fn parameter(&self, name: &str, value: &Tensor) -> Result<Traced, CallError> {
        let identity = (value.storage_id(), value.layout().clone());
        if let Some(existing) = self.parameter_values.borrow().get(&identity) {
            return Ok(existing.clone());
        }
        let unique = self.unique_input_name(name);
        if !self.parameter_names.borrow_mut().insert(name.to_owned()) {
            tracing::warn!(
                target: "ir_graph::trace",
                "two distinct parameter tensors are named `{name}`; the later one is traced as `%{unique}` \
                 (give each layer its own name)"
            );
        }
        let (node, value_id) = self.graph.borrow_mut().create_input_detached(unique.clone(), value.meta().clone());
        self.pending_inputs.borrow_mut().push(node);
        let traced = Traced { value: value_id, meta: value.meta().clone() };
        self.parameters.borrow_mut().push((unique, value.clone()));
        self.parameter_values.borrow_mut().insert(identity, traced.clone());
        Ok(traced)
    }

    fn call(
        &self,
        op: &'static OpDef,
        overload: Overload,
        args: Vec<CallArg<Traced>>,
    ) -> Result<Vec<Traced>, CallError> {
        if overload == Overload::MaybeInplace && !op.allow_inplace {
            return Err(CallError::NotInplaceOp { op: op.name });
        }
        let metas: Vec<ArgMeta<'_>> = args.iter().map(|arg| arg.meta_with(|t| &t.meta)).collect();
        // Binding fills the omitted trailing parameters, so the graph spells every argument.
        let bound = bind_meta(op, metas)?;
        if !self.registry.op_def(op.name).is_some_and(|registered| std::ptr::eq(registered, op)) {
            return Err(CallError::UnknownOp {
                op: op.name.to_owned(),
                known: self.registry.ops().iter().map(|s| (*s).to_owned()).collect(),
            });
        }
        let selection = self.registry.select(op.name, &bound)?;
        let graph_args = bound
            .iter()
            .enumerate()
            .map(|(index, meta)| match args.get(index) {
                Some(CallArg::Tensor(t)) => Arg::Tensor(t.value),
                // A constant argument, or a default (defaults are constants).
                _ => meta.map(|_| unreachable!("tensors are the caller's"), str::to_owned, <[i64]>::to_vec),
            })
            .collect();
        let mut graph = self.graph.borrow_mut();
        let kind = NodeKind::IrCall { op: graph.op_ref(op.name), overload, args: graph_args };
        let (_, values) = graph.push(kind, selection.outputs.clone());
        Ok(values.into_iter().zip(selection.outputs).map(|(value, meta)| Traced { value, meta }).collect())
    }

    /// Records a built-in node, with the result metadata from the built-in table.
    fn builtin(&self, op: Builtin, args: Vec<ir_core::builtin::BuiltinArg<Traced>>) -> Result<Traced, CallError> {
        check_args(op, &args).map_err(|reason| CallError::BuiltinArgs { builtin: op.name(), reason })?;
        let metas: Vec<&TensorMeta> = args.iter().filter_map(|a| a.value()).map(|t| &t.meta).collect();
        let meta = (op.def().meta)(&metas, &Scalars(&args))?;
        let graph_args: Vec<BuiltinArg> = args
            .iter()
            .map(|arg| match arg {
                ir_core::builtin::BuiltinArg::Value(t) => BuiltinArg::Value(t.value),
                ir_core::builtin::BuiltinArg::Index(i) => BuiltinArg::Index(*i),
                ir_core::builtin::BuiltinArg::Shape(dims) => BuiltinArg::Shape(dims.clone()),
                ir_core::builtin::BuiltinArg::Float(f) => BuiltinArg::Float(*f),
            })
            .collect();
        let (_, values) = self.graph.borrow_mut().push(NodeKind::builtin(op, graph_args), vec![meta.clone()]);
        Ok(Traced { value: values[0], meta })
    }
}
