//! The graph data model: nodes and values in arenas addressed by typed ids, the order of live
//! nodes, names, metadata and use lists, and the edits the passes make.

use std::fmt;

use cranelift_entity::{EntitySet, PrimaryMap, SecondaryMap, entity_impl};
use ir_core::TensorMeta;
use ir_core::op::{ArgMeta, OpDef, Overload};

use crate::{Builtin, Effect, print};

/// A node of a graph. Ids come from the graph's node arena in creation order; the numbering is
/// stable (never reused) but arbitrary, and says nothing about execution order.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);
entity_impl!(NodeId, "node");

/// A value of a graph (one result of one node). Ids come from the graph's value arena in creation
/// order; stable but arbitrary. In text and logs a value appears under its name (`%x`, `%3`).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(u32);
entity_impl!(ValueId, "v");

/// An op a graph calls: an index into the graph's op table, so nodes hold no strings and passes
/// look each op up once per graph (a `SecondaryMap<OpRef, _>`), not once per node. Ids come from the
/// table in first-use order; the numbering is stable but arbitrary. In text and logs an op appears
/// under its name ([`Graph::op_name`]).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpRef(u32);
entity_impl!(OpRef, "op");

/// A provider an `impl` node names: an index into the graph's provider table, like [`OpRef`]; it
/// appears under its name ([`Graph::provider_name`]).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProviderRef(u32);
entity_impl!(ProviderRef, "provider");

/// An argument of an op or implementation call: a graph value ([`Arg::Tensor`]) or a constant;
/// the graph's form of the one argument type ([`ir_core::op::Arg`]).
pub type Arg = ir_core::op::Arg<ValueId>;

/// The positions among `activations` whose argument in `args` is a value, in order: the given
/// activations of a call (an absent optional activation, `none`, has no output and is not written).
/// Output i of an in-place call belongs to the i-th of them.
pub fn given_activations(activations: &[usize], args: &[Arg]) -> Vec<usize> {
    activations.iter().copied().filter(|&p| matches!(args.get(p), Some(Arg::Tensor(_)))).collect()
}

/// What a node does.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeKind {
    /// A graph input with a stable name; `donated` inputs may be overwritten.
    Input {
        /// Name, without `%`.
        name: String,
        /// Whether the caller gives the input up.
        donated: bool,
    },
    /// A call of an op, still to dispatch.
    IrCall {
        /// The op ([`Graph::op_name`] spells it).
        op: OpRef,
        /// Functional or `maybe_inplace`.
        overload: Overload,
        /// Positional arguments.
        args: Vec<Arg>,
    },
    /// A call of one implementation. `writes` lists, in activation order, the parameter positions it
    /// writes: output i is written into parameter `writes[i]`. Non-empty iff the implementation is in place.
    ImplCall {
        /// The op ([`Graph::op_name`] spells it).
        op: OpRef,
        /// The provider ([`Graph::provider_name`] spells it).
        provider: ProviderRef,
        /// Written parameter positions.
        writes: Vec<usize>,
        /// Positional arguments.
        args: Vec<Arg>,
    },
    /// A built-in tensor operation: [`Builtin`]'s table gives its parameters, effect and semantics.
    Builtin {
        /// Which.
        op: Builtin,
        /// Its arguments, of the kinds the table lists.
        args: Vec<BuiltinArg>,
    },
    /// The graph's outputs; exactly one, last.
    Output(Vec<ValueId>),
}

/// A node: what it does, its results and, when parsed, its source position.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeData {
    /// What the node does.
    pub kind: NodeKind,
    /// Its results, in order (inline: nodes have at most a few).
    pub results: Results,
    /// Line and column (1-based) of the statement in the source text.
    pub location: SourceLocation,
}

/// A statement's line and column (1-based) in the source text, if it was parsed: 8 bytes (line 0
/// stands for "none"), so a node stays within 96 bytes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceLocation {
    pub(crate) line: u32,
    pub(crate) column: u32,
}

impl SourceLocation {
    /// No location (a node made by a pass or the API).
    pub const NONE: SourceLocation = SourceLocation { line: 0, column: 0 };

    /// Line and column, 1-based; a line of 0 gives [`SourceLocation::NONE`].
    pub fn new(line: u32, column: u32) -> SourceLocation {
        if line == 0 { SourceLocation::NONE } else { SourceLocation { line, column } }
    }

    /// Line and column, if any.
    pub fn get(self) -> Option<(u32, u32)> {
        (self.line != 0).then_some((self.line, self.column))
    }
}

/// A value: where it is defined, its name and its metadata. Names and metadata are kept compactly
/// (a number or an index into the graph's name list; an index into the graph's table of distinct
/// metadata, which a model has few of): read them with [`Graph::value_name`] and [`Graph::meta`].
#[derive(Clone, Debug, PartialEq)]
pub struct ValueData {
    /// Defining node.
    pub def: NodeId,
    /// Result index in the defining node.
    pub index: usize,
    pub(crate) name: NameKey,
    pub(crate) meta: MetaRef,
}

/// A stored value name: a canonical decimal number below [`FRESH_NAME_LIMIT`] (`%12`, the names the
/// tracer and the passes make) kept as the number, or, with the top bit set, an index into the
/// graph's list of other names (`%x`, `%layers.0.norm.weight`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct NameKey(u64);

const TEXT_NAME: u64 = 1 << 63;

/// A distinct `TensorMeta` of a graph: an index into its metadata table.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct MetaRef(u32);
entity_impl!(MetaRef, "meta");

/// A value's name, without the `%` sigil; `Display` writes it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ValueName<'a> {
    /// A numeric name (`%12`).
    Number(u64),
    /// Any other name (`%x`).
    Text(&'a str),
}

impl fmt::Display for ValueName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueName::Number(n) => write!(f, "{n}"),
            ValueName::Text(text) => f.write_str(text),
        }
    }
}

/// The distinct metadata of a graph's values, each stored once.
#[derive(Clone, Debug, Default)]
pub(crate) struct MetaTable {
    pub(crate) metas: PrimaryMap<MetaRef, TensorMeta>,
    pub(crate) index: rustc_hash::FxHashMap<TensorMeta, MetaRef>,
}

impl MetaTable {
    /// The ref of `meta` if some value of the graph has it.
    pub(crate) fn get(&self, meta: &TensorMeta) -> Option<MetaRef> {
        self.index.get(meta).copied()
    }

    fn intern(&mut self, meta: TensorMeta) -> MetaRef {
        // Consecutive values mostly share their metadata: check the newest entry before hashing.
        if let Some((last, newest)) = self.metas.last()
            && *newest == meta
        {
            return last;
        }
        if let Some(&key) = self.index.get(&meta) {
            return key;
        }
        let key = self.metas.push(meta.clone());
        self.index.insert(meta, key);
        key
    }
}

/// A graph. The [crate documentation](crate) describes its text format, verifier and interpreter.
#[derive(Clone, Debug)]
pub struct Graph {
    /// The graph's name.
    pub name: String,
    pub(crate) nodes: PrimaryMap<NodeId, NodeData>,
    pub(crate) values: PrimaryMap<ValueId, ValueData>,
    /// The names of values that are not numbers ([`NameKey`]).
    pub(crate) text_names: Vec<Box<str>>,
    /// The distinct metadata of the values.
    pub(crate) metas: MetaTable,
    pub(crate) order: Vec<NodeId>,
    /// The ops nodes call.
    pub(crate) ops: NameTable<OpRef>,
    /// The providers `impl` nodes name.
    pub(crate) providers: NameTable<ProviderRef>,
    /// The next fresh `%<n>` name; always above every numeric name below `FRESH_NAME_LIMIT` in use.
    pub(crate) next_name: u64,
}

/// Numeric names at or above this bound are never produced by [`Graph::fresh_name`] (the counter
/// would need 2^63 fresh names to get there), so they need no noting and the counter cannot wrap.
const FRESH_NAME_LIMIT: u64 = 1 << 63;

/// A table of names addressed by typed refs, with the reverse index, so each name is stored once
/// and looked up by hash.
#[derive(Clone, Debug)]
pub(crate) struct NameTable<K: cranelift_entity::EntityRef> {
    pub(crate) names: PrimaryMap<K, String>,
    pub(crate) index: rustc_hash::FxHashMap<String, K>,
}

impl<K: cranelift_entity::EntityRef> Default for NameTable<K> {
    fn default() -> NameTable<K> {
        NameTable { names: PrimaryMap::new(), index: Default::default() }
    }
}

impl<K: cranelift_entity::EntityRef> NameTable<K> {
    /// The ref of `name`, adding it on first use.
    fn intern(&mut self, name: &str) -> K {
        if let Some(&key) = self.index.get(name) {
            return key;
        }
        let key = self.names.push(name.to_owned());
        self.index.insert(name.to_owned(), key);
        key
    }
}

/// An argument of a built-in node: a graph value or a scalar.
pub type BuiltinArg = ir_core::builtin::BuiltinArg<ValueId>;

/// The results of one node: inline up to two, so a node's results need no allocation of their own.
pub type Results = smallvec::SmallVec<[ValueId; 2]>;

/// The users of one value, in order: inline up to two (most values), so use lists of large graphs
/// need no allocation per value.
pub type UseList = smallvec::SmallVec<[NodeId; 2]>;

impl NodeKind {
    /// The values this node reads or writes, in argument order (for `Output`, the outputs).
    pub fn operands(&self) -> Vec<ValueId> {
        let mut operands = Vec::new();
        self.for_each_operand(|v| operands.push(v));
        operands
    }

    /// Calls `f` on each operand in argument order, without allocating (the passes' hot loops).
    pub fn for_each_operand(&self, mut f: impl FnMut(ValueId)) {
        match self {
            NodeKind::Input { .. } => {}
            NodeKind::IrCall { args, .. } | NodeKind::ImplCall { args, .. } => {
                for arg in args {
                    if let Arg::Tensor(v) = arg {
                        f(*v);
                    }
                }
            }
            NodeKind::Builtin { args, .. } => args.iter().filter_map(BuiltinArg::value).copied().for_each(f),
            NodeKind::Output(values) => values.iter().copied().for_each(f),
        }
    }

    /// Rewrites every use of `old` into `new`.
    pub fn replace_operand(&mut self, old: ValueId, new: ValueId) {
        let swap = |v: &mut ValueId| {
            if *v == old {
                *v = new;
            }
        };
        match self {
            NodeKind::Input { .. } => {}
            NodeKind::IrCall { args, .. } | NodeKind::ImplCall { args, .. } => {
                for arg in args {
                    if let Arg::Tensor(v) = arg {
                        swap(v);
                    }
                }
            }
            NodeKind::Builtin { args, .. } => {
                for arg in args {
                    if let BuiltinArg::Value(v) = arg {
                        swap(v);
                    }
                }
            }
            NodeKind::Output(values) => values.iter_mut().for_each(swap),
        }
    }

    /// A built-in node.
    pub fn builtin(op: Builtin, args: Vec<BuiltinArg>) -> NodeKind {
        NodeKind::Builtin { op, args }
    }

    /// `clone(value)`.
    pub fn clone_of(value: ValueId) -> NodeKind {
        NodeKind::Builtin { op: Builtin::Clone, args: vec![BuiltinArg::Value(value)] }
    }

    /// The first value of a built-in with this effect (the copied, viewed or written value).
    pub fn builtin_subject(&self, effect: Effect) -> Option<ValueId> {
        match self {
            NodeKind::Builtin { op, args } if op.def().effect == effect => {
                args.first().and_then(BuiltinArg::value).copied()
            }
            _ => None,
        }
    }

    /// Whether this is a view (`slice`, `transpose`, `reshape`), whose result shares its input's storage.
    pub fn is_view(&self) -> bool {
        self.builtin_subject(Effect::View).is_some()
    }
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Graph {
        Graph {
            name: name.into(),
            nodes: PrimaryMap::new(),
            values: PrimaryMap::new(),
            text_names: Vec::new(),
            metas: MetaTable::default(),
            order: Vec::new(),
            ops: NameTable::default(),
            providers: NameTable::default(),
            next_name: 0,
        }
    }

    /// The reference of op `name` in this graph's table, adding it on first use.
    pub fn op_ref(&mut self, name: &str) -> OpRef {
        self.ops.intern(name)
    }

    /// The reference of provider `name` in this graph's table, adding it on first use.
    pub fn provider_ref(&mut self, name: &str) -> ProviderRef {
        self.providers.intern(name)
    }

    /// The name of an op of this graph.
    pub fn op_name(&self, op: OpRef) -> &str {
        &self.ops.names[op]
    }

    /// The name of a provider of this graph.
    pub fn provider_name(&self, provider: ProviderRef) -> &str {
        &self.providers.names[provider]
    }

    /// Every op in the graph's table (also ops no live node calls any more), in first-use order.
    pub fn op_table(&self) -> impl Iterator<Item = (OpRef, &str)> {
        self.ops.names.iter().map(|(op, name)| (op, name.as_str()))
    }

    // --- building ---

    /// Appends an input named `name` (without `%`) and returns its value.
    pub fn add_input(&mut self, name: impl Into<String>, meta: TensorMeta) -> ValueId {
        let (node, value) = self.create_input_detached(name.into(), meta);
        self.place_inputs(&[node]);
        value
    }

    /// Creates an input node without placing it in the order (see [`Graph::place_inputs`]).
    pub(crate) fn create_input_detached(&mut self, name: String, meta: TensorMeta) -> (NodeId, ValueId) {
        self.note_name(&name);
        let key = self.name_key(&name);
        let meta = self.metas.intern(meta);
        let node = self.nodes.push(NodeData {
            kind: NodeKind::Input { name, donated: false },
            results: Results::new(),
            location: SourceLocation::NONE,
        });
        let value = self.values.push(ValueData { name: key, def: node, index: 0, meta });
        self.nodes[node].results.push(value);
        (node, value)
    }

    /// Places detached input nodes after the leading inputs, in the given order; one splice.
    pub(crate) fn place_inputs(&mut self, inputs: &[NodeId]) {
        // While only inputs are placed (parsing a header, the start of a trace) they go at the end:
        // O(1) per input, so a graph with many inputs is read in linear time.
        let only_inputs = self.order.last().is_none_or(|&n| matches!(self.nodes[n].kind, NodeKind::Input { .. }));
        let position = if only_inputs {
            self.order.len()
        } else {
            self.order
                .iter()
                .position(|&n| !matches!(self.nodes[n].kind, NodeKind::Input { .. }))
                .unwrap_or(self.order.len())
        };
        self.order.splice(position..position, inputs.iter().copied());
    }

    /// Appends a node with results of the given metadata (named `%<n>`), before the output node when that
    /// is last (where the verifier requires it), else at the end.
    pub fn push(&mut self, kind: NodeKind, result_metas: Vec<TensorMeta>) -> (NodeId, Vec<ValueId>) {
        // A graph's output node is its last (the verifier requires it): O(1), so tracing is linear.
        let before = self.order.last().copied().filter(|&n| matches!(self.nodes[n].kind, NodeKind::Output(_)));
        self.insert(kind, result_metas, before)
    }

    /// Inserts a node right before `before` (or at the end), with fresh result names.
    pub fn insert(
        &mut self,
        kind: NodeKind,
        result_metas: Vec<TensorMeta>,
        before: Option<NodeId>,
    ) -> (NodeId, Vec<ValueId>) {
        let (node, values) = self.create_detached(kind, result_metas);
        // Anchors are usually the output node, at the end: search from there.
        match before.and_then(|b| self.order.iter().rposition(|&n| n == b)) {
            Some(position) => self.order.insert(position, node),
            None => self.order.push(node),
        }
        (node, values)
    }

    pub(crate) fn insert_named(
        &mut self,
        kind: NodeKind,
        results: Vec<(String, TensorMeta)>,
        before: Option<NodeId>,
        location: SourceLocation,
    ) -> (NodeId, Vec<ValueId>) {
        let node = self.nodes.push(NodeData { kind, results: Results::new(), location });
        for (name, _) in &results {
            self.note_name(name);
        }
        let values: Vec<ValueId> = results
            .into_iter()
            .enumerate()
            .map(|(index, (name, meta))| {
                let (name, meta) = (self.name_key(&name), self.metas.intern(meta));
                self.values.push(ValueData { name, def: node, index, meta })
            })
            .collect();
        self.nodes[node].results = Results::from_slice(&values);
        // Anchors are usually the output node, at the end: search from there.
        match before.and_then(|b| self.order.iter().rposition(|&n| n == b)) {
            Some(position) => self.order.insert(position, node),
            None => self.order.push(node),
        }
        (node, values)
    }

    /// Makes room for exactly `nodes` more nodes and `values` more values: for a pass that knows how
    /// many it will create (the arenas otherwise grow by doubling, which at a million nodes is
    /// hundreds of megabytes held for nothing).
    pub fn reserve_exact(&mut self, nodes: usize, values: usize) {
        self.nodes.reserve_exact(nodes);
        self.values.reserve_exact(values);
    }

    /// Sets the outputs (replacing an existing output node).
    pub fn set_output(&mut self, values: Vec<ValueId>) -> NodeId {
        if let Some(node) = self.output_node() {
            self.nodes[node].kind = NodeKind::Output(values);
            return node;
        }
        self.insert_named(NodeKind::Output(values), Vec::new(), None, SourceLocation::NONE).0
    }

    /// A fresh `%<n>` name that was never used in this graph.
    pub fn fresh_name(&mut self) -> String {
        self.fresh_key().0.to_string()
    }

    /// A fresh numeric name, stored as its number.
    fn fresh_key(&mut self) -> NameKey {
        let key = NameKey(self.next_name);
        self.next_name += 1;
        key
    }

    /// How `name` is stored: a canonical number below the fresh-name limit as itself, else in the
    /// list of text names.
    fn name_key(&mut self, name: &str) -> NameKey {
        if let Ok(n) = name.parse::<u64>()
            && n < FRESH_NAME_LIMIT
            && (n == 0 && name == "0" || !name.starts_with('0'))
            && !name.starts_with('+')
        {
            return NameKey(n);
        }
        let index = self.text_names.len() as u64;
        self.text_names.push(name.into());
        NameKey(TEXT_NAME | index)
    }

    /// A value's name (without `%`).
    pub fn value_name(&self, value: ValueId) -> ValueName<'_> {
        let NameKey(key) = self.values[value].name;
        if key & TEXT_NAME == 0 {
            ValueName::Number(key)
        } else {
            ValueName::Text(&self.text_names[(key & !TEXT_NAME) as usize])
        }
    }

    /// Whether `name` is a `%<n>` name [`Graph::fresh_name`] has already handed out (or skipped).
    pub(crate) fn is_fresh_name_taken(&self, name: &str) -> bool {
        name.parse::<u64>().is_ok_and(|n| n < self.next_name && n.to_string() == name)
    }

    /// Keeps fresh names clear of `name` when it is numeric (`%7` makes the next fresh name `%8` or later).
    pub(crate) fn note_name(&mut self, name: &str) {
        if let Ok(n) = name.parse::<u64>()
            && n < FRESH_NAME_LIMIT
        {
            self.next_name = self.next_name.max(n + 1);
        }
    }

    // --- editing ---

    /// Takes `node` out of the order; its data stays so diagnostics can name it.
    pub fn remove_node(&mut self, node: NodeId) {
        self.order.retain(|&n| n != node);
    }

    /// Takes every node of `nodes` out of the order in one pass (their data stays).
    pub fn remove_nodes(&mut self, nodes: &EntitySet<NodeId>) {
        if nodes.is_empty() {
            return;
        }
        self.order.retain(|&n| !nodes.contains(n));
    }

    /// Redirects the uses of `old` by the given nodes to `new` (callers that keep use lists avoid
    /// scanning the whole graph).
    pub fn replace_uses_in(&mut self, users: &[NodeId], old: ValueId, new: ValueId) {
        for &node in users {
            self.nodes[node].kind.replace_operand(old, new);
        }
    }

    /// Creates a node with fresh result names but does not place it in the order; place it with
    /// [`Graph::insert_detached_before`].
    pub fn create_detached(&mut self, kind: NodeKind, result_metas: Vec<TensorMeta>) -> (NodeId, Vec<ValueId>) {
        let node = self.nodes.push(NodeData { kind, results: Results::new(), location: SourceLocation::NONE });
        let values: Vec<ValueId> = result_metas
            .into_iter()
            .enumerate()
            .map(|(index, meta)| {
                let (name, meta) = (self.fresh_key(), self.metas.intern(meta));
                self.values.push(ValueData { name, def: node, index, meta })
            })
            .collect();
        self.nodes[node].results = Results::from_slice(&values);
        (node, values)
    }

    /// Places detached nodes: each `(anchor, node)` puts `node` right before `anchor`, in the given
    /// order; one pass over the order.
    pub fn insert_detached_before(&mut self, placements: &[(NodeId, NodeId)]) {
        if placements.is_empty() {
            return;
        }
        // Per anchor, a linked list through `placements` (first and next index), so any number of
        // anchors costs no allocation each.
        const NONE: u32 = u32::MAX;
        let mut first: SecondaryMap<NodeId, u32> = SecondaryMap::with_default(NONE);
        let mut last: SecondaryMap<NodeId, u32> = SecondaryMap::with_default(NONE);
        let mut next = vec![NONE; placements.len()];
        for (i, &(anchor, _)) in placements.iter().enumerate() {
            let i = i as u32;
            match last[anchor] {
                NONE => first[anchor] = i,
                tail => next[tail as usize] = i,
            }
            last[anchor] = i;
        }
        let mut order = Vec::with_capacity(self.order.len() + placements.len());
        for &node in &self.order {
            let mut i = first[node];
            while i != NONE {
                order.push(placements[i as usize].1);
                i = next[i as usize];
            }
            order.push(node);
        }
        self.order = order;
    }

    /// Redirects every use of `old` to `new`.
    pub fn replace_all_uses(&mut self, old: ValueId, new: ValueId) {
        for &node in &self.order {
            self.nodes[node].kind.replace_operand(old, new);
        }
    }

    /// Gives `value` another type (a pass that changes what a value is, such as clone elimination
    /// letting a kernel write a view in its own layout; the caller keeps the graph verifying).
    pub fn set_meta(&mut self, value: ValueId, meta: TensorMeta) {
        let meta = self.metas.intern(meta);
        self.values[value].meta = meta;
    }

    /// The node's data, mutably.
    pub fn node_mut(&mut self, node: NodeId) -> &mut NodeData {
        &mut self.nodes[node]
    }

    /// Marks the input `name` donated; returns whether such an input exists.
    pub fn mark_donated(&mut self, name: &str) -> bool {
        for &node in &self.order {
            if let NodeKind::Input { name: n, donated } = &mut self.nodes[node].kind
                && n == name
            {
                *donated = true;
                return true;
            }
        }
        false
    }

    // --- queries ---

    /// The live nodes in order.
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }

    /// A node's data.
    pub fn node(&self, node: NodeId) -> &NodeData {
        &self.nodes[node]
    }

    /// The overload and arguments of `node` when it is an IR call of the op `def` (matched by
    /// definition: passes name the ops they rewrite by their definitions, never by strings).
    pub fn ir_call_of(&self, node: NodeId, def: &OpDef) -> Option<(Overload, &[Arg])> {
        match &self.nodes[node].kind {
            NodeKind::IrCall { op, overload, args } if self.op_name(*op) == def.name => Some((*overload, args)),
            _ => None,
        }
    }

    /// The arguments of `node` when it is a functional IR call of `def` ([`Overload::Default`]).
    pub fn functional_call_of(&self, node: NodeId, def: &OpDef) -> Option<&[Arg]> {
        self.ir_call_of(node, def).and_then(|(overload, args)| (overload == Overload::Default).then_some(args))
    }

    /// The arguments of `node` when it is the built-in `op`.
    pub fn builtin_of(&self, node: NodeId, op: Builtin) -> Option<&[BuiltinArg]> {
        match &self.nodes[node].kind {
            NodeKind::Builtin { op: found, args } if *found == op => Some(args),
            _ => None,
        }
    }

    /// The node defining `value` when it is the built-in `op`, with its arguments.
    pub fn builtin_defining(&self, value: ValueId, op: Builtin) -> Option<(NodeId, &[BuiltinArg])> {
        let node = self.values[value].def;
        self.builtin_of(node, op).map(|args| (node, args))
    }

    /// Whether the graph's op table holds `def` (a pass that rewrites calls of it skips a graph
    /// without any).
    pub fn mentions_op(&self, def: &OpDef) -> bool {
        self.op_table().any(|(_, name)| name == def.name)
    }

    /// A value's data.
    pub fn value(&self, value: ValueId) -> &ValueData {
        &self.values[value]
    }

    /// A value's metadata.
    pub fn meta(&self, value: ValueId) -> &TensorMeta {
        &self.metas.metas[self.values[value].meta]
    }

    /// Every value ever created (live or not), in id order.
    pub fn values(&self) -> impl Iterator<Item = (ValueId, &ValueData)> {
        self.values.iter()
    }

    /// What a predicate or meta function sees of an argument.
    pub fn arg_meta<'a>(&'a self, arg: &'a Arg) -> ArgMeta<'a> {
        arg.meta_with(|v| self.meta(*v))
    }

    /// The output node, if any (the last one if a malformed graph has several; it is normally last).
    pub fn output_node(&self) -> Option<NodeId> {
        self.order.iter().rev().copied().find(|&n| matches!(self.nodes[n].kind, NodeKind::Output(_)))
    }

    /// The graph's outputs (empty without an output node).
    pub fn outputs(&self) -> Vec<ValueId> {
        match self.output_node().map(|n| &self.nodes[n].kind) {
            Some(NodeKind::Output(values)) => values.clone(),
            _ => Vec::new(),
        }
    }

    /// The input nodes in order, with their value, name and donation flag.
    pub fn inputs(&self) -> Vec<(NodeId, ValueId, &str, bool)> {
        self.order
            .iter()
            .filter_map(|&n| match &self.nodes[n].kind {
                NodeKind::Input { name, donated } => Some((n, self.nodes[n].results[0], name.as_str(), *donated)),
                _ => None,
            })
            .collect()
    }

    /// Position of every live node in the order.
    pub fn positions(&self) -> SecondaryMap<NodeId, u32> {
        let mut positions = SecondaryMap::with_default(u32::MAX);
        for (i, &node) in self.order.iter().enumerate() {
            positions[node] = i as u32;
        }
        positions
    }

    /// The live nodes using `value`, in order (the output node included).
    pub fn users(&self, value: ValueId) -> Vec<NodeId> {
        self.order.iter().copied().filter(|&n| self.nodes[n].kind.operands().contains(&value)).collect()
    }

    /// Every live node's users per value, in one pass.
    pub fn use_lists(&self) -> SecondaryMap<ValueId, UseList> {
        let mut uses: SecondaryMap<ValueId, UseList> = SecondaryMap::with_capacity(self.values.len());
        for &node in &self.order {
            self.nodes[node].kind.for_each_operand(|value| {
                if uses[value].last() != Some(&node) {
                    uses[value].push(node);
                }
            });
        }
        uses
    }

    /// The number of distinct live nodes using each value (the output node included): the counts of
    /// [`Graph::use_lists`] without building the lists.
    pub fn use_counts(&self) -> SecondaryMap<ValueId, u32> {
        let mut counts: SecondaryMap<ValueId, u32> = SecondaryMap::with_capacity(self.values.len());
        let mut seen: Vec<ValueId> = Vec::new();
        for &node in &self.order {
            seen.clear();
            self.nodes[node].kind.for_each_operand(|value| {
                if !seen.contains(&value) {
                    seen.push(value);
                    counts[value] += 1;
                }
            });
        }
        counts
    }

    /// The value's name with its `%` sigil.
    pub fn display_value(&self, value: ValueId) -> String {
        format!("%{}", self.value_name(value))
    }

    /// One node printed as its statement.
    pub fn display_node(&self, node: NodeId) -> String {
        let mut text = String::new();
        print::write_node(&mut text, self, node).expect("writing to a String");
        text.trim().to_owned()
    }

    /// Whether two graphs have the same name, statements (by value names) and metadata, in order.
    pub fn structurally_eq(&self, other: &Graph) -> bool {
        self.name == other.name && self.to_string() == other.to_string() && {
            let metas = |g: &Graph| -> Vec<TensorMeta> {
                g.order.iter().flat_map(|&n| g.nodes[n].results.iter().map(|&v| g.meta(v).clone())).collect()
            };
            metas(self) == metas(other)
        }
    }

    /// Number of nodes ever created (the arena size).
    pub fn node_capacity(&self) -> usize {
        self.nodes.len()
    }

    /// Number of values ever created (the arena size): the size of a side table indexed by value.
    pub fn value_capacity(&self) -> usize {
        self.values.len()
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        print::write_graph(f, self)
    }
}

#[cfg(test)]
mod tests {
    use ir_ops::gelu_and_mul::GELU_AND_MUL;
    use ir_ops::rms_norm::{RMS_NORM, RmsNormArgs};

    use super::*;

    #[test]
    fn typed_matches_find_calls_and_builtins_by_definition() {
        let graph = crate::parse(
            "graph g(%a: f32[2,8], %b: f32[2,8], %w: f32[8]) {
               %s = add(%a, %b) : f32[2,8]
               %n = rms_norm(%s, %w, 1e-6, none) : f32[2,8]
               %m = rms_norm.maybe_inplace(%n, %w, 1e-6, none) : f32[2,8]
               output(%m)
             }",
        )
        .unwrap();
        let calls: Vec<NodeId> = graph
            .order()
            .iter()
            .copied()
            .filter(|&n| {
                matches!(graph.node(n).kind, NodeKind::Builtin { op: Builtin::Add, .. } | NodeKind::IrCall { .. })
            })
            .collect();
        let [add, norm, donated] = calls.as_slice() else { panic!("three calls: {calls:?}") };
        let args = graph.functional_call_of(*norm, &RMS_NORM).expect("a functional rms_norm");
        let Arg::Tensor(sum) = &args[RmsNormArgs::x] else { panic!("x is a value") };
        let (defining, add_args) = graph.builtin_defining(*sum, Builtin::Add).expect("the sum comes from add");
        assert_eq!((defining, add_args.len()), (*add, 2));
        assert!(graph.builtin_defining(*sum, Builtin::Mul).is_none());
        assert!(graph.builtin_of(*norm, Builtin::Add).is_none());
        // Another op, or the donating overload, is not a functional call of the definition.
        assert!(graph.ir_call_of(*norm, &GELU_AND_MUL).is_none());
        assert!(graph.functional_call_of(*donated, &RMS_NORM).is_none());
        let (overload, _) = graph.ir_call_of(*donated, &RMS_NORM).unwrap();
        assert_eq!(overload, Overload::MaybeInplace);
        assert!(graph.mentions_op(&RMS_NORM) && !graph.mentions_op(&GELU_AND_MUL));
    }
}
