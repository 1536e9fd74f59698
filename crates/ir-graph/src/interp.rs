//! The interpreter: runs a graph on real tensors through a registry, with safety checks
//! and statistics.
//!
//! Handles are moved into a value's last user and dropped after it, so donated buffers can be
//! written in place. The IR has mutation: after an in-place write, every alias of the written
//! storage inside the interpreter reads the new contents (the interpreter rebinds them to the
//! written storage).
//!
//! The run is linear in the graph: an index from each live storage to the values bound to it finds
//! a write's aliases without scanning the environment, and keeps the live bytes as a running sum.

use ir_core::Call;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cranelift_entity::SecondaryMap;

use crate::{Arg, Builtin, BuiltinArg, Effect, Graph, NodeId, NodeKind, ValueId, VerifyError, verify};
use ir_core::builtin::{Eval, Scalars};
use ir_core::op::{ArgMeta, Outputs, Overload, Value};
use ir_core::{CallError, Registry, StorageId, Tensor, TensorError, TensorMeta};

/// Whether the interpreter checks writes for hazards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SafetyChecks {
    /// Check (the default everywhere).
    On,
    /// Do not check, to demonstrate what the checks catch.
    Off,
}

/// Interpreter options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InterpOptions {
    /// Safety checks.
    pub safety_checks: SafetyChecks,
}

impl InterpOptions {
    /// Safety checks on.
    pub fn checked() -> InterpOptions {
        InterpOptions { safety_checks: SafetyChecks::On }
    }
}

/// What one run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InterpStats {
    /// Bytes of storages created during the run (defensive copies included, inputs excluded).
    pub bytes_allocated: u64,
    /// Maximum over node boundaries of the distinct storage bytes referenced by live values.
    pub peak_live_bytes: u64,
    /// `clone` and `contiguous` nodes run.
    pub clones_executed: usize,
    /// Copies made because a kernel could not write into a value someone could still read.
    pub defensive_copies: usize,
    /// The provider each op node ran: (node, op, provider).
    pub providers: Vec<(NodeId, String, &'static str)>,
}

/// The outputs and statistics of a run.
#[derive(Clone, Debug)]
pub struct Interpretation {
    /// The graph's outputs, in order.
    pub outputs: Vec<Tensor>,
    /// Statistics.
    pub stats: InterpStats,
}

/// Why a run failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum InterpError {
    // --- inputs ---
    /// A graph input without a tensor.
    #[error("missing input `%{name}`")]
    MissingInput {
        /// Input name.
        name: String,
    },
    /// A tensor for an input the graph does not have.
    #[error("unknown input `%{name}` (graph inputs: {})", known.join(", "))]
    UnknownInput {
        /// The name given.
        name: String,
        /// The graph's inputs.
        known: Vec<String>,
    },
    /// A tensor whose metadata differs from the input's declaration.
    #[error("input `%{name}`: expected {expected}, found {found}")]
    InputMeta {
        /// Input name.
        name: String,
        /// Declared metadata.
        expected: Box<TensorMeta>,
        /// The tensor's metadata.
        found: Box<TensorMeta>,
    },
    /// The graph does not verify.
    #[error(transparent)]
    Verify(Box<VerifyError>),

    // --- nodes ---
    /// An op or implementation call failed.
    #[error("`{statement}`: {source}")]
    Call {
        /// The node.
        node: NodeId,
        /// Its statement.
        statement: String,
        /// The error.
        source: Box<CallError>,
    },
    /// A built-in failed.
    #[error("`{statement}`: {source}")]
    Tensor {
        /// The node.
        node: NodeId,
        /// Its statement.
        statement: String,
        /// The error.
        source: TensorError,
    },

    // --- safety checks ---
    /// A write into a graph input that is not donated.
    #[error("`{statement}` writes into `%{input}`, a graph input not marked donated")]
    WriteToNonDonatedInput {
        /// The writing node.
        node: NodeId,
        /// Its statement.
        statement: String,
        /// The input.
        input: String,
    },
    /// An in-place kernel whose written arguments share storage with each other or another argument.
    #[error("`{statement}`: arguments of an in-place kernel share storage")]
    AliasedKernelArgs {
        /// The node.
        node: NodeId,
        /// Its statement.
        statement: String,
    },
    /// An in-place kernel overwrites a storage that a later node still reads through another value.
    #[error("`{statement}` overwrites the storage of `{value}`, which `{later_user}` reads afterwards")]
    AliasHazard {
        /// The writing node.
        node: NodeId,
        /// Its statement.
        statement: String,
        /// The value still read.
        value: String,
        /// The later reader, printed.
        later_user: String,
    },
}

/// Runs `graph` on `inputs` (by input name, without `%`; owned tensors).
pub fn interpret(
    graph: &Graph,
    registry: &Registry,
    inputs: Vec<(String, Tensor)>,
    options: InterpOptions,
) -> Result<Interpretation, InterpError> {
    verify(graph, registry).map_err(|e| InterpError::Verify(Box::new(e)))?;
    let mut run = Run::new(graph, registry, options);
    run.bind_inputs(inputs)?;
    let order = graph.order().to_vec();
    let mut outputs = Vec::new();
    for (position, &node) in order.iter().enumerate() {
        if let NodeKind::Output(values) = &graph.node(node).kind {
            outputs = values.iter().map(|&v| run.get(v).clone()).collect();
            continue;
        }
        run.execute(node, position)?;
        run.release_dead(node, position);
        run.account();
    }
    tracing::debug!(target: "ir_graph::interp", graph = graph.name.as_str(), stats = ?run.stats, "interpreted");
    Ok(Interpretation { outputs, stats: run.stats })
}

struct Run<'g> {
    graph: &'g Graph,
    registry: &'g Registry,
    options: InterpOptions,
    env: SecondaryMap<ValueId, Option<Tensor>>,
    /// Every storage some value of `env` holds: its bytes and those values (kept in step with `env`).
    bound: HashMap<StorageId, Bound>,
    /// Σ bytes of the storages in `bound`.
    live_bytes: u64,
    uses: SecondaryMap<ValueId, crate::UseList>,
    positions: SecondaryMap<NodeId, u32>,
    /// Each value's last reading position (0 when unread), computed once.
    last_use: SecondaryMap<ValueId, u32>,
    kept: HashSet<ValueId>,
    inputs: HashMap<StorageId, (String, bool)>,
    seen: HashSet<StorageId>,
    stats: InterpStats,
}

impl<'g> Run<'g> {
    fn new(graph: &'g Graph, registry: &'g Registry, options: InterpOptions) -> Run<'g> {
        let (uses, positions) = (graph.use_lists(), graph.positions());
        let mut last_use = SecondaryMap::new();
        for (value, users) in uses.iter() {
            last_use[value] = users.iter().map(|&n| positions[n]).max().unwrap_or(0);
        }
        Run {
            graph,
            registry,
            options,
            env: SecondaryMap::new(),
            bound: HashMap::default(),
            live_bytes: 0,
            uses,
            positions,
            last_use,
            kept: graph.outputs().into_iter().collect(),
            inputs: HashMap::default(),
            seen: HashSet::default(),
            stats: InterpStats::default(),
        }
    }

    fn bind_inputs(&mut self, inputs: Vec<(String, Tensor)>) -> Result<(), InterpError> {
        let declared = self.graph.inputs();
        let known: HashSet<&str> = declared.iter().map(|(_, _, name, _)| *name).collect();
        let mut given: HashMap<String, Tensor> = HashMap::default();
        for (name, tensor) in inputs {
            if !known.contains(name.as_str()) {
                let known = declared.iter().map(|(_, _, name, _)| (*name).to_owned()).collect();
                return Err(InterpError::UnknownInput { name, known });
            }
            given.insert(name, tensor);
        }
        for (_, value, name, donated) in declared {
            let tensor = given.remove(name).ok_or_else(|| InterpError::MissingInput { name: name.to_owned() })?;
            let expected = self.graph.meta(value);
            if tensor.meta() != expected {
                return Err(InterpError::InputMeta {
                    name: name.to_owned(),
                    expected: Box::new(expected.clone()),
                    found: Box::new(tensor.meta().clone()),
                });
            }
            let tensor = if donated && !tensor.is_uniquely_owned() {
                // The caller kept a handle: copy before anything can write into it.
                tracing::debug!(target: "ir_graph::interp", input = name, "donated input is shared; copying it");
                self.stats.defensive_copies += 1;
                let copy = tensor.deep_clone_same_layout().map_err(|source| InterpError::Tensor {
                    node: self.graph.value(value).def,
                    statement: format!("%{name}"),
                    source,
                })?;
                self.stats.bytes_allocated += copy.storage().len_bytes() as u64;
                self.seen.insert(copy.storage_id());
                copy
            } else {
                tensor
            };
            self.inputs.insert(tensor.storage_id(), (name.to_owned(), donated));
            self.seen.insert(tensor.storage_id());
            self.bind(value, tensor);
        }
        self.account();
        Ok(())
    }

    /// Binds `value` to `tensor` in the environment (replacing what it held).
    fn bind(&mut self, value: ValueId, tensor: Tensor) {
        self.unbind(value);
        let bytes = tensor.storage().len_bytes() as u64;
        let entry =
            self.bound.entry(tensor.storage_id()).or_insert_with(|| Bound { bytes, values: Default::default() });
        if entry.values.is_empty() {
            self.live_bytes += bytes;
        }
        entry.values.push(value);
        self.env[value] = Some(tensor);
    }

    /// Takes `value`'s tensor out of the environment.
    fn unbind(&mut self, value: ValueId) -> Option<Tensor> {
        let tensor = self.env[value].take()?;
        let storage = tensor.storage_id();
        if let Some(entry) = self.bound.get_mut(&storage) {
            entry.values.retain(|v| *v != value);
            if entry.values.is_empty() {
                self.live_bytes -= entry.bytes;
                self.bound.remove(&storage);
            }
        }
        Some(tensor)
    }

    /// The values of the environment holding `storage`, in binding order.
    fn holders(&self, storage: StorageId) -> smallvec::SmallVec<[ValueId; 2]> {
        self.bound.get(&storage).map(|entry| entry.values.clone()).unwrap_or_default()
    }

    fn get(&self, value: ValueId) -> &Tensor {
        self.env[value].as_ref().expect("verified graphs define values before use and keep them until their last use")
    }

    fn last_position(&self, value: ValueId) -> u32 {
        self.last_use[value]
    }

    fn statement(&self, node: NodeId) -> String {
        self.graph.display_node(node)
    }

    fn call_error(&self, node: NodeId, source: CallError) -> InterpError {
        InterpError::Call { node, statement: self.statement(node), source: Box::new(source) }
    }

    fn tensor_error(&self, node: NodeId, source: TensorError) -> InterpError {
        InterpError::Tensor { node, statement: self.statement(node), source }
    }

    fn execute(&mut self, node: NodeId, position: usize) -> Result<(), InterpError> {
        let data = self.graph.node(node);
        let results = data.results.clone();
        let produced: Vec<Tensor> = match &data.kind {
            NodeKind::Input { .. } | NodeKind::Output(_) => return Ok(()),
            NodeKind::Builtin { op, args } => vec![self.builtin(node, position, *op, args)?],
            NodeKind::IrCall { op, overload, args } => {
                self.ir_call(node, position, self.graph.op_name(*op), *overload, args)?
            }
            NodeKind::ImplCall { op, provider, writes, args } => {
                let (op, provider) = (self.graph.op_name(*op), self.graph.provider_name(*provider));
                self.impl_call(node, position, op, provider, writes, args)?
            }
        };
        for (value, tensor) in results.into_iter().zip(produced) {
            if self.seen.insert(tensor.storage_id()) {
                self.stats.bytes_allocated += tensor.storage().len_bytes() as u64;
            }
            self.bind(value, tensor);
        }
        Ok(())
    }

    /// Runs a built-in through its table entry: copies are counted, writes go through the same
    /// checks as in-place kernels' (never into a non-donated input, never into a value read later).
    fn builtin(
        &mut self,
        node: NodeId,
        position: usize,
        op: Builtin,
        args: &[BuiltinArg],
    ) -> Result<Tensor, InterpError> {
        let def = op.def();
        let values: smallvec::SmallVec<[ValueId; 2]> = args.iter().filter_map(BuiltinArg::value).copied().collect();
        match def.eval {
            Eval::Result(eval) => {
                if def.effect == Effect::Copy {
                    self.stats.clones_executed += 1;
                }
                let tensors: smallvec::SmallVec<[&Tensor; 2]> = values.iter().map(|&v| self.get(v)).collect();
                eval(&tensors, &Scalars(args)).map_err(|e| self.tensor_error(node, e))
            }
            Eval::Write(write) => {
                let (target, sources) = values.split_first().expect("the table's first parameter is a value");
                self.check_input_write(node, self.get(*target).storage_id())?;
                let sources: Vec<Tensor> = sources.iter().map(|&v| self.get(v).clone()).collect();
                self.write_through(node, *target, position, |target| {
                    let sources: Vec<&Tensor> = sources.iter().collect();
                    write(target, &sources, &Scalars(args)).map_err(CallError::Tensor)
                })
            }
        }
    }

    fn arg_metas<'a>(&'a self, args: &'a [Arg]) -> Vec<ArgMeta<'a>> {
        args.iter().map(|arg| self.graph.arg_meta(arg)).collect()
    }

    fn constant(arg: &Arg) -> Value {
        arg.constant().expect("values are handled by the caller")
    }

    fn ir_call(
        &mut self,
        node: NodeId,
        position: usize,
        op: &str,
        overload: Overload,
        args: &[Arg],
    ) -> Result<Vec<Tensor>, InterpError> {
        let selection = self.registry.select(op, &self.arg_metas(args)).map_err(|e| self.call_error(node, e))?;
        self.stats.providers.push((node, op.to_owned(), selection.provider));
        // The given activations (an absent optional one has no output), in output order.
        let activations = crate::given_activations(&self.registry.activations(op).unwrap_or_default(), args);
        // Write in place only when the result would have the declared layout.
        let layouts_match =
            activations.iter().zip(&selection.outputs).all(|(&position, declared)| match &args[position] {
                Arg::Tensor(v) => self.graph.meta(*v) == declared,
                _ => false,
            });
        let in_place = overload == Overload::MaybeInplace && layouts_match;
        // Every argument gets a handle; a donated activation at its last use (and not an output)
        // then loses the environment's handle, so the call may own it uniquely.
        let mut values: Vec<Value> = args
            .iter()
            .map(|arg| match arg {
                Arg::Tensor(v) => Value::Tensor(self.get(*v).clone()),
                constant => Self::constant(constant),
            })
            .collect();
        if in_place {
            for &index in &activations {
                let Some(Arg::Tensor(v)) = args.get(index) else { continue };
                // The same value passed twice: its handle was already released for the first slot.
                let Some(held) = self.env[*v].as_ref() else { continue };
                // A graph input the caller did not donate is never written: keeping the
                // environment's handle makes the call copy it.
                let non_donated_input = self.inputs.get(&held.storage_id()).is_some_and(|(_, donated)| !donated);
                if self.last_position(*v) as usize == position && !self.kept.contains(v) && !non_donated_input {
                    self.unbind(*v);
                }
            }
        }
        if selection.inplace {
            for &index in &activations {
                let Some(Value::Tensor(tensor)) = values.get(index) else { continue };
                if !(in_place && tensor.is_uniquely_owned()) {
                    self.stats.defensive_copies += 1;
                }
            }
        }
        let values = std::mem::take(&mut values);
        let result =
            self.registry.run(Call::new(op, if in_place { Overload::MaybeInplace } else { Overload::Default }, values));
        result.map(Outputs::into_vec).map_err(|e| self.call_error(node, e))
    }

    fn impl_call(
        &mut self,
        node: NodeId,
        position: usize,
        op: &str,
        provider: &str,
        writes: &[usize],
        args: &[Arg],
    ) -> Result<Vec<Tensor>, InterpError> {
        let provider_name =
            self.registry.providers(op).into_iter().find(|p| p.name == provider).map(|p| p.name).unwrap_or("?");
        self.stats.providers.push((node, op.to_owned(), provider_name));
        if writes.is_empty() {
            let values = args.iter().map(|arg| match arg {
                Arg::Tensor(v) => Value::Tensor(self.get(*v).clone()),
                constant => Self::constant(constant),
            });
            let values: Vec<Value> = values.collect();
            return self
                .registry
                .run(Call::new(op, Overload::Default, values).provider(provider))
                .map(Outputs::into_vec)
                .map_err(|e| self.call_error(node, e));
        }
        let written: Vec<ValueId> = writes
            .iter()
            .filter_map(|&p| match args.get(p) {
                Some(Arg::Tensor(v)) => Some(*v),
                _ => None,
            })
            .collect();
        if self.options.safety_checks == SafetyChecks::On {
            self.check_kernel_writes(node, position, &written, args)?;
        }
        // Take every alias of the written storages out of the environment, so the kernel owns them
        // uniquely; afterwards they are rebound to the written storage.
        let mut aliases: Vec<(ValueId, usize, ir_core::Layout)> = Vec::new();
        let mut values: Vec<Option<Value>> = vec![None; args.len()];
        let mut taken: HashMap<ValueId, Tensor> = HashMap::default();
        for (slot, &value) in writes.iter().zip(&written) {
            if let Some(again) = taken.get(&value) {
                // The same value written twice (only with the checks off): the second slot gets a copy.
                self.stats.defensive_copies += 1;
                let copy = again.deep_clone_same_layout().map_err(|e| self.tensor_error(node, e))?;
                values[*slot] = Some(Value::Tensor(copy));
                continue;
            }
            // A value already taken as an alias of an earlier written slot: two writes into one
            // storage by one call (only with the checks off) have no defined result.
            let Some(mut tensor) = self.unbind(value) else {
                return Err(InterpError::AliasedKernelArgs { node, statement: self.statement(node) });
            };
            for alias in self.holders(tensor.storage_id()) {
                let held = self.unbind(alias).expect("holders are bound");
                aliases.push((alias, *slot, held.layout().clone()));
            }
            let keep_original = self.kept.contains(&value) || self.last_position(value) as usize > position;
            if keep_original {
                aliases.push((value, *slot, tensor.layout().clone()));
            }
            if !tensor.is_uniquely_owned() {
                // Held outside the interpreter (a non-donated input with the checks off): write a copy.
                self.stats.defensive_copies += 1;
                tensor = tensor.deep_clone_same_layout().map_err(|e| self.tensor_error(node, e))?;
            }
            taken.insert(value, tensor.clone());
            values[*slot] = Some(Value::Tensor(tensor));
        }
        // The kernel must own what it writes: drop the bookkeeping handles again.
        drop(taken);
        for (index, arg) in args.iter().enumerate() {
            if values[index].is_none() {
                values[index] = Some(match arg {
                    Arg::Tensor(v) => match &self.env[*v] {
                        Some(t) => Value::Tensor(t.clone()),
                        // Read and written by the same call (only with the checks off): read a copy
                        // of what is written.
                        None => {
                            let written_slot = writes.iter().zip(&written).find(|(_, w)| **w == *v).map(|(s, _)| *s);
                            let source = written_slot.and_then(|s| values[s].as_ref()).and_then(Value::as_tensor);
                            let source = source.ok_or_else(|| {
                                self.call_error(
                                    node,
                                    CallError::Tensor(TensorError::SharedStorage {
                                        meta: Box::new(self.graph.meta(*v).clone()),
                                        handles: 2,
                                    }),
                                )
                            })?;
                            Value::Tensor(source.deep_clone_same_layout().map_err(|e| self.tensor_error(node, e))?)
                        }
                    },
                    constant => Self::constant(constant),
                });
            }
        }
        let values: Vec<Value> = values.into_iter().map(|v| v.expect("every slot filled")).collect();
        let outputs = self
            .registry
            .run(Call::new(op, Overload::MaybeInplace, values).provider(provider))
            .map_err(|e| self.call_error(node, e))?;
        for (alias, slot, layout) in aliases {
            let index = writes.iter().position(|&w| w == slot).expect("aliases belong to written slots");
            let rebound = outputs[index].as_strided(layout).map_err(|e| self.tensor_error(node, e))?;
            self.bind(alias, rebound);
        }
        Ok(outputs.into_vec())
    }

    /// Writes through `dst` with `write`, rebinding its aliases to the written storage.
    fn write_through(
        &mut self,
        node: NodeId,
        dst: ValueId,
        position: usize,
        write: impl FnOnce(&mut Tensor) -> Result<(), CallError>,
    ) -> Result<Tensor, InterpError> {
        let mut target = self.unbind(dst).expect("verified graphs define values before use");
        let mut aliases = Vec::new();
        for alias in self.holders(target.storage_id()) {
            let held = self.unbind(alias).expect("holders are bound");
            aliases.push((alias, held.layout().clone()));
        }
        if self.kept.contains(&dst) || self.last_position(dst) as usize > position {
            aliases.push((dst, target.layout().clone()));
        }
        if !target.is_uniquely_owned() {
            self.stats.defensive_copies += 1;
            target = target.deep_clone_same_layout().map_err(|e| self.tensor_error(node, e))?;
        }
        write(&mut target).map_err(|e| self.call_error(node, e))?;
        for (alias, layout) in aliases {
            let rebound = target.as_strided(layout).map_err(|e| self.tensor_error(node, e))?;
            self.bind(alias, rebound);
        }
        Ok(target)
    }

    fn check_input_write(&self, node: NodeId, storage: StorageId) -> Result<(), InterpError> {
        if self.options.safety_checks == SafetyChecks::Off {
            return Ok(());
        }
        match self.inputs.get(&storage) {
            Some((name, false)) => {
                Err(InterpError::WriteToNonDonatedInput { node, statement: self.statement(node), input: name.clone() })
            }
            _ => Ok(()),
        }
    }

    fn check_kernel_writes(
        &self,
        node: NodeId,
        position: usize,
        written: &[ValueId],
        args: &[Arg],
    ) -> Result<(), InterpError> {
        let storages: Vec<StorageId> = written.iter().map(|&v| self.get(v).storage_id()).collect();
        for &storage in &storages {
            self.check_input_write(node, storage)?;
        }
        let argument_storages: Vec<(ValueId, StorageId)> = args
            .iter()
            .filter_map(|a| match a {
                Arg::Tensor(v) => Some((*v, self.get(*v).storage_id())),
                _ => None,
            })
            .collect();
        for (i, (&value, &storage)) in written.iter().zip(&storages).enumerate() {
            let shared_with_written = storages.iter().enumerate().any(|(j, &s)| j != i && s == storage);
            let shared_with_other = argument_storages.iter().any(|&(v, s)| v != value && s == storage);
            if shared_with_written || shared_with_other {
                return Err(InterpError::AliasedKernelArgs { node, statement: self.statement(node) });
            }
        }
        for (&written_value, &storage) in written.iter().zip(&storages) {
            let region = self.get(written_value).layout();
            for value in self.holders(storage) {
                // A view of other elements of the storage (a sibling column slice of one buffer)
                // keeps its bytes.
                if value != written_value && self.get(value).layout().disjoint_from(region) {
                    continue;
                }
                // A later view of elements apart from the written ones reads none of them (its
                // views cover a subset of its elements).
                let view_apart = |user: NodeId| {
                    let node = self.graph.node(user);
                    node.kind.is_view() && node.results.iter().all(|&r| self.graph.meta(r).layout.disjoint_from(region))
                };
                let later = self.uses[value]
                    .iter()
                    .copied()
                    .find(|&user| self.positions[user] as usize > position && !view_apart(user));
                if let Some(later_user) = later {
                    return Err(InterpError::AliasHazard {
                        node,
                        statement: self.statement(node),
                        value: self.graph.display_value(value),
                        later_user: self.statement(later_user),
                    });
                }
            }
        }
        Ok(())
    }

    fn release_dead(&mut self, node: NodeId, position: usize) {
        let mut operands = self.graph.node(node).kind.operands();
        operands.extend(self.graph.node(node).results.iter().copied());
        for value in operands {
            let dead = !self.kept.contains(&value) && self.last_position(value) as usize <= position;
            if dead {
                self.unbind(value);
            }
        }
    }

    fn account(&mut self) {
        self.stats.peak_live_bytes = self.stats.peak_live_bytes.max(self.live_bytes);
    }
}

/// A storage held by the environment: its size and the values holding it.
struct Bound {
    bytes: u64,
    values: smallvec::SmallVec<[ValueId; 2]>,
}
