//! The `eliminate_clones` pass ([`eliminate_clones`] documents it).

use std::collections::BTreeSet;
use std::fmt;

use cranelift_entity::{EntitySet, SecondaryMap};
use ir_graph::{Effect, Graph, NodeId, NodeKind, ValueId};

use crate::analysis::{StorageRoots, for_each_written_value, written_values};
use crate::{CloneElimination, PassContext, PassError};
use ir_graph::OpTable;

/// Why a copy was kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeepReason {
    /// The copy changes strides or storage offset.
    LayoutChange,
    /// More than one node writes the copy (or its storage).
    MultipleWriters,
    /// The original (or an alias of it) is read after the copy is written.
    OriginalUsedAfterWrite,
    /// The original is a graph input the caller did not donate.
    NonDonatedInput,
    /// Another argument of the writer shares the original's storage.
    AliasedWriterArgument,
    /// The original (or an alias of it) is written while the copy is still read: the copy is a snapshot.
    OriginalWrittenWhileCopyLive,
    /// Removing the copy would make a graph output share storage with a non-donated input or another output.
    GraphIoAlias,
}

impl fmt::Display for KeepReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeepReason::LayoutChange => "copy changes layout",
            KeepReason::MultipleWriters => "more than one writer",
            KeepReason::OriginalUsedAfterWrite => "original used after the write",
            KeepReason::NonDonatedInput => "original is a non-donated input",
            KeepReason::AliasedWriterArgument => "another argument of the writer shares the storage",
            KeepReason::OriginalWrittenWhileCopyLive => "original written while the copy is still read",
            KeepReason::GraphIoAlias => "a graph output would alias an input or another output",
        })
    }
}

/// What clone elimination did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CloneReport {
    /// Removed copies.
    pub removed: Vec<NodeId>,
    /// Kept copies with their reasons.
    pub kept: Vec<KeptCopy>,
}

/// A copy the pass kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptCopy {
    /// The copy's node.
    pub node: NodeId,
    /// The copy as printed (`%c = clone(%x) : f32[4,8]`), so reports read like the IR.
    pub statement: String,
    /// Why it stays.
    pub reason: KeepReason,
}

impl fmt::Display for CloneReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kept: Vec<String> = self.kept.iter().map(|k| format!("`{}`: {}", k.statement, k.reason)).collect();
        write!(f, "removed {} copy(ies), kept {}", self.removed.len(), self.kept.len())?;
        if !kept.is_empty() {
            write!(f, " ({})", kept.join("; "))?;
        }
        Ok(())
    }
}

/// Clone elimination: removes `clone` and `contiguous` copies that nothing needs, in two variants.
///
/// # The question
///
/// Lowering puts a copy in front of every activation of an in-place kernel, so the kernel never
/// writes a value someone can still read. Most of those copies are unnecessary: the original is dead
/// after the call, or was donated by the caller. This pass removes a copy `c` of `o` (redirecting
/// every use of `c` to `o`) unless one of the rules below keeps it.
///
/// Removing `c` makes two storages one: from the copy's position on, whatever reads or writes `c`
/// (or a view of it) reads or writes `o`'s storage instead. That is harmless exactly when the two
/// storages would have held the same bytes wherever either is read, and when no caller can tell
/// that they became one.
///
/// # Notation
///
/// `p` is the copy's position in the graph order. A *storage class* is a set of values sharing one
/// storage: a value, its views, and the results of nodes writing it (their storage roots), merged as copies
/// are removed. `C` is the copy's class and `O` the original's. A node *reads* a class when any of
/// its operands belongs to it (a writer reads what it writes; the output node reads every output).
///
/// # The rules of the `alias-aware` variant (the default)
///
/// **Layout change** — a copy whose layout (strides or storage offset) differs from its input's is
/// kept, since its users see another layout (unless its kernel writes the original where it is,
/// below):
///
/// ```text
/// %s = slice(%x, 1, 0, 3) : f32[4,3]{5,1}
/// %c = contiguous(%s) : f32[4,3]          // kept: strides (5, 1) become (3, 1)
/// ```
///
/// **Written where it is** — the exception: a copy that changes the layout and whose one user is an
/// in-place kernel writing it is removed when the kernel can write the original in its own layout
/// (checked after every other copy is decided, and again until no more go). The kernel's provider
/// must accept the original's layout; the written result takes that layout, so every reader of it
/// must give the same results with it (a `reshape` into heads would not; the graph's output would
/// change its type) and none may write it. The written copy's rules below hold too, judged element
/// by element rather than per storage: a value of the original's storage is a hazard only if it
/// shares an element with the original ([`ir_core::Layout::disjoint_from`]), and a view reads no
/// element itself. So q and k, column slices of one `qkv` buffer rotated by two calls (lowering
/// splits such a call), are both written in the buffer:
///
/// ```text
/// %q = slice(%qkv, 1, 0, 32) : bf16[4,32]{64,1}
/// %k = slice(%qkv, 1, 32, 48) : bf16[4,16]{64,1}+32
/// %0 = impl rotary_embedding[cpu] writes(1) (%pos, %k, none, %cache, 16, 16, true) : bf16[4,16]{64,1}+32
/// %q2 = impl rotary_embedding[cpu] writes(1) (%pos, %q, none, %cache, 16, 16, true) : bf16[4,32]{64,1}
/// ```
///
/// **Read after write, copy written** (`OriginalUsedAfterWrite`) — a write to `C` after which `O`
/// is still read: merged, the reader would see the write.
///
/// ```text
/// %c = clone(%a) : bf16[8,16]
/// %o, %r = impl fused_add_rms_norm[cpu] writes(0, 1) (%c, ...)
/// output(%o, %a)                          // %a is read after %c is written: %c stays
/// ```
///
/// The same holds when the later reader is a view of `%a`, or a value of the same storage such as
/// a sibling slice of one `qkv` buffer:
///
/// ```text
/// %q = reshape(slice(%qkv, 0, 0, 1), [8, 16])
/// %c = clone(%q)                          // kept: %qkv (same storage) is read after the write
/// %o, %r = impl fused_add_rms_norm[cpu] writes(0, 1) (%c, ...)
/// output(%o, %qkv)
/// ```
///
/// **Writer reads both** (`AliasedWriterArgument`) — the node writing `C` also reads `O` through
/// another argument: merged, the kernel's arguments would alias.
///
/// ```text
/// %c1 = clone(%x)                         // removed first: %x is dead after the kernel
/// %c2 = clone(%x)                         // kept: merged, the kernel would get %x twice
/// %o, %r = impl fused_add_rms_norm[cpu] writes(0, 1) (%c1, %c2, ...)
/// ```
///
/// **Read after write, original written** (`OriginalWrittenWhileCopyLive`) — a write to `O` after
/// the copy while `C` is still read: the copy is a snapshot.
///
/// ```text
/// %c = clone(%a) : f32[2,8]
/// %o = copy_(%a, %z) : f32[2,8]           // writes %a's storage
/// output(%c, %o)                          // %c is read after that: %c stays
/// ```
///
/// It applies when the write goes through a view, when it is an in-place kernel writing `%a` or an
/// alias of it, and when the later reader of `%c` is a kernel rather than the output node:
///
/// ```text
/// %c = clone(%a) : f32[2,8]
/// %v = slice(%a, 0, 1, 2) : f32[1,8]{8,1}+8
/// %o = copy_(%v, %z)                      // writes row 1 of %a's storage
/// %n = impl rms_norm[cpu] (%c, ...)       // reads the snapshot afterwards: %c stays
/// ```
///
/// A written copy whose original is written between the copy and the copy's writer is kept by the
/// same rule (merged, the kernel would read the new bytes):
///
/// ```text
/// %c = clone(%a)
/// %b = copy_(%a, %z)                      // %c is read below, by its writer
/// %o, %r = impl fused_add_rms_norm[cpu] writes(0, 1) (%c, ...)
/// ``` Any two writes after the copy, one to each class, trip one of the
/// two read-after-write rules, since each writer reads what it writes.
///
/// **Non-donated input** (`NonDonatedInput`) — a written copy of storage the caller did not donate
/// is kept, so the caller's tensor is never modified:
///
/// ```text
/// graph g(%x: f32[4,5]) {                 // %x not donated
///   %c = clone(%x)                        // kept: merged, the kernel would write %x
///   %o, %r = impl fused_add_rms_norm[cpu] writes(0, 1) (%c, ...)
/// ```
///
/// **More than one writer** (`MultipleWriters`) — a copy whose storage is written by more than one
/// node is kept (a conservative rule that keeps the analysis to one write per decision):
///
/// ```text
/// %c = clone(%a)                          // kept: two kernels write %c's storage
/// %o1, %r1 = impl fused_add_rms_norm[cpu] writes(0, 1) (%c, %p, ...)
/// %o2, %r2 = impl fused_add_rms_norm[cpu] writes(0, 1) (%o1, %q, ...)
/// ```
///
/// **Graph outputs stay fresh** (`GraphIoAlias`) — a copy is kept when removing it would make
/// a graph output share storage with a graph input not marked donated, or with another output.
/// Callers may mutate outputs in place, so an output must not be a window onto an input they kept
/// or onto another output. Aliasing a donated input is the point of in-place execution and stays
/// allowed.
///
/// ```text
/// %c = clone(%x)                          // kept: output(%x) would alias the input
/// output(%c)
/// %c1 = clone(%y)                         // removed: %y is an intermediate returned once
/// %c2 = clone(%y)                         // kept: output(%y, %y) would alias two outputs
/// output(%c1, %c2)
/// ```
///
/// Otherwise the copy is removed; read-only copies are removed even of a non-donated input:
///
/// ```text
/// %c = clone(%x) : f32[4,5]               // removed; users of %c read %x
/// %1 = scale(%c, 2.0)
/// ```
///
/// # Phases of the alias-aware variant
///
/// Phase 1 takes, in graph order, the copies whose storage nobody writes; phase 2 takes the written
/// copies, in graph order; phase 3 the copies that change the layout and the written copies phase 2
/// kept only because their original's storage is read after the write (written where they are when
/// no element they share is, or kept), repeated until none goes. Every decision reads the classes
/// as earlier removals left them (merged writes, reads and outputs), so each removal is judged on
/// the graph it applies to, and
/// the sequence is sound by induction. Writes are kept per class as sorted positions and reads as
/// the last reading position, merged small into large: phases 1 and 2 are `O(n log n)` in the graph
/// size. Phase 3 judges element by element with a scan of the graph after the copy, `O(n)` for each
/// copy it judges (two per layer's rotary on qkv slices), and a round more only when a removal made
/// another copy a candidate.
///
/// # `unsafe` (vLLM's rules)
///
/// Candidates are taken in graph order with positions computed once, looking only at direct users
/// of the copy and the original: a copy with more than one writer is kept; a written copy is kept
/// if the original is used after the writer, or is a non-donated input. The snapshot rule and the
/// graph-output rule hold as above, on storage classes; the snapshot rule applies to
/// written copies as well, which keeps the variant idempotent (a snapshot kept in one run becomes a
/// written copy once the clone lowering put after it is gone) and also keeps one of two copies of a
/// value passed as both activations of a kernel. It ignores reads of the original through other
/// views of the same storage after a write to the copy, so it can remove a copy whose removal
/// changes results; the interpreter's safety checks catch those cases.
///
/// # Invariants
///
/// Before: the graph verifies. After: it verifies, every remaining copy has a reason in the report,
/// and for every graph that does not trip the interpreter's safety checks the alias-aware variant
/// gives bit-identical outputs and does not make it trip them. Both variants are idempotent;
/// on error the graph is unchanged.
///
/// ```
/// use ir_graph::parse;
/// use ir_passes::{CloneElimination, PassContext, eliminate_clones};
///
/// let mut graph = parse(
///     "graph g(%x: f32[4,5]) {
///        %0 = clone(%x) : f32[4,5]
///        %1 = scale(%0, 2.0) : f32[4,5]
///        output(%1)
///      }",
/// )?;
/// let registry = ir_ops::registry();
/// let cx = PassContext::new(&registry).with_clone_elimination(CloneElimination::AliasAware);
/// let report = eliminate_clones(&mut graph, &cx)?;
/// assert_eq!(report.removed.len(), 1);
/// assert!(graph.to_string().contains("%1 = scale(%x, 2.0)"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Runs clone elimination with the context's variant, by the rules above.
pub fn eliminate_clones(graph: &mut Graph, cx: &PassContext<'_>) -> Result<CloneReport, PassError> {
    let _span = tracing::info_span!("pass", name = "eliminate-clones").entered();
    let report = match cx.clone_elimination {
        CloneElimination::Unsafe => unsafe_variant(graph, cx),
        CloneElimination::AliasAware => alias_aware(graph, cx),
    };
    tracing::debug!(target: "ir_passes::eliminate_clones", variant = ?cx.clone_elimination, %report);
    Ok(report)
}

fn copy_input(graph: &Graph, node: NodeId) -> Option<ValueId> {
    graph.node(node).kind.builtin_subject(Effect::Copy)
}

fn candidates(graph: &Graph) -> Vec<NodeId> {
    graph.order().iter().copied().filter(|&n| copy_input(graph, n).is_some()).collect()
}

fn changes_layout(graph: &Graph, node: NodeId, original: ValueId) -> bool {
    let copy = graph.node(node).results[0];
    graph.meta(copy).layout != graph.meta(original).layout
}

fn is_non_donated_input(graph: &Graph, value: ValueId) -> bool {
    matches!(graph.node(graph.value(value).def).kind, NodeKind::Input { donated: false, .. })
}

fn keep(graph: &Graph, node: NodeId, reason: KeepReason, report: &mut CloneReport) {
    let statement = graph.display_node(node);
    tracing::debug!(target: "ir_passes::eliminate_clones", node = statement.as_str(), %reason, "copy kept");
    report.kept.push(KeptCopy { node, statement, reason });
}

/// Use lists kept up to date while copies are removed, so each removal costs only the copy's uses.
struct Edits {
    users: SecondaryMap<ValueId, ir_graph::UseList>,
    removed: EntitySet<NodeId>,
}

impl Edits {
    fn new(graph: &Graph) -> Edits {
        Edits { users: graph.use_lists(), removed: EntitySet::new() }
    }

    /// Live users of `value` (removed copies filtered out).
    fn users(&self, value: ValueId) -> impl Iterator<Item = NodeId> + '_ {
        self.users[value].iter().copied().filter(|&u| !self.removed.contains(u))
    }

    fn remove(&mut self, graph: &mut Graph, node: NodeId, original: ValueId, report: &mut CloneReport) {
        let copy = graph.node(node).results[0];
        let moved = std::mem::take(&mut self.users[copy]);
        graph.replace_uses_in(&moved, copy, original);
        self.users[original].extend(moved);
        self.removed.insert(node);
        report.removed.push(node);
    }
}

/// vLLM's rules plus the snapshot and graph-output rules.
fn unsafe_variant(graph: &mut Graph, cx: &PassContext<'_>) -> CloneReport {
    let mut report = CloneReport::default();
    let positions = graph.positions();
    let mut edits = Edits::new(graph);
    let ops = OpTable::compute(graph, cx.registry);
    let mut classes = Classes::compute(graph, &ops, &positions, &edits);
    for node in candidates(graph) {
        let original = copy_input(graph, node).expect("candidates are copies");
        if changes_layout(graph, node, original) {
            keep(graph, node, KeepReason::LayoutChange, &mut report);
            continue;
        }
        let copy = graph.node(node).results[0];
        let writers: Vec<NodeId> =
            edits.users(copy).filter(|&u| written_values(graph, &ops, u).contains(&copy)).collect();
        let (copy_class, original_class) = (classes.find(copy), classes.find(original));
        let decision = match writers.as_slice() {
            [] => None,
            [writer] => {
                let w = positions[*writer];
                if edits.users(original).any(|u| positions[u] > w) {
                    Some(KeepReason::OriginalUsedAfterWrite)
                } else if is_non_donated_input(graph, original) {
                    Some(KeepReason::NonDonatedInput)
                } else {
                    None
                }
            }
            _ => Some(KeepReason::MultipleWriters),
        };
        // The snapshot rule (a copy read after its original is written stays) on storage classes, so
        // writes through views count. It applies to written
        // copies too: a copy kept as a snapshot becomes a written copy once the clone lowering put
        // after it is removed, and without the rule a second run would remove it (not idempotent).
        let p = positions[node];
        let snapshot = || {
            let written_while_read = classes.write_between(original_class, p, classes.last_read[copy_class]);
            written_while_read.map(|_| KeepReason::OriginalWrittenWhileCopyLive)
        };
        let decision = decision.or_else(snapshot);
        let decision = decision.or_else(|| classes.graph_io_alias(graph, copy_class, original_class));
        match decision {
            Some(reason) => keep(graph, node, reason, &mut report),
            None => {
                edits.remove(graph, node, original, &mut report);
                classes.merge(copy_class, original_class);
            }
        }
    }
    graph.remove_nodes(&edits.removed);
    report
}

/// Storage classes: the storage roots, merged as copies are removed (union-find), with the positions
/// of the nodes writing each class, the last position at which any value of the class is read, and
/// the number of graph output slots holding a value of the class.
struct Classes {
    /// Union-find parent links (`None`: the class's representative), seeded with the storage roots.
    parent: SecondaryMap<ValueId, Option<ValueId>>,
    /// Positions of the distinct nodes writing the class, sorted (one entry per writer node).
    writes: WriteSets,
    /// Last reading position + 1 (0: never read).
    last_read: SecondaryMap<ValueId, u32>,
    /// Graph output slots whose value is in the class.
    outputs: SecondaryMap<ValueId, u32>,
}

/// The writer positions of each class, in 4 bytes per value for the common cases: no writer, or
/// one (most written classes); only a class with several writers gets a set.
struct WriteSets {
    /// 0: no writer; `1..SET`: one writer, at this position - 1; `SET | i`: the positions are `sets[i]`.
    slot: SecondaryMap<ValueId, u32>,
    sets: Vec<BTreeSet<u32>>,
}

/// The tag of a slot that refers to a set.
const SET: u32 = 1 << 31;

impl WriteSets {
    fn new(values: usize) -> WriteSets {
        WriteSets { slot: SecondaryMap::with_capacity(values), sets: Vec::new() }
    }

    /// The set behind `slot`, creating one (holding the single writer, if any) when there is none.
    fn set_mut(&mut self, class: ValueId) -> &mut BTreeSet<u32> {
        let slot = self.slot[class];
        if slot & SET != 0 {
            return &mut self.sets[(slot & !SET) as usize];
        }
        let mut set = BTreeSet::new();
        if slot != 0 {
            set.insert(slot - 1);
        }
        self.slot[class] = SET | self.sets.len() as u32;
        self.sets.push(set);
        self.sets.last_mut().expect("just pushed")
    }

    fn insert(&mut self, class: ValueId, position: u32) {
        match self.slot[class] {
            0 if position < SET - 1 => self.slot[class] = position + 1,
            single if single != 0 && single & SET == 0 && single - 1 == position => {}
            _ => {
                self.set_mut(class).insert(position);
            }
        }
    }

    /// Distinct writer positions of the class.
    fn len(&self, class: ValueId) -> usize {
        match self.slot[class] {
            0 => 0,
            slot if slot & SET != 0 => self.sets[(slot & !SET) as usize].len(),
            _ => 1,
        }
    }

    /// The first writer position after `after`.
    fn first_after(&self, class: ValueId, after: u32) -> Option<u32> {
        match self.slot[class] {
            0 => None,
            slot if slot & SET != 0 => self.sets[(slot & !SET) as usize].range(after + 1..).next().copied(),
            single => Some(single - 1).filter(|&position| position > after),
        }
    }

    /// Moves the writes of `from` into `into` (the smaller set into the larger).
    fn merge(&mut self, from: ValueId, into: ValueId) {
        let moved = std::mem::take(&mut self.slot[from]);
        if moved == 0 {
            return;
        }
        if self.slot[into] == 0 {
            self.slot[into] = moved;
            return;
        }
        if moved & SET == 0 {
            self.insert(into, moved - 1);
            return;
        }
        let mut moved = std::mem::take(&mut self.sets[(moved & !SET) as usize]);
        let into_set = self.set_mut(into);
        if into_set.len() < moved.len() {
            std::mem::swap(into_set, &mut moved);
        }
        into_set.extend(moved);
    }
}

impl Classes {
    fn compute(graph: &Graph, ops: &OpTable, positions: &SecondaryMap<NodeId, u32>, edits: &Edits) -> Classes {
        let roots = StorageRoots::compute(graph, ops);
        // Side tables sized once for every value (growing them would double their capacity).
        let values = graph.value_capacity();
        let mut classes = Classes {
            parent: SecondaryMap::with_capacity(values),
            writes: WriteSets::new(values),
            last_read: SecondaryMap::with_capacity(values),
            outputs: SecondaryMap::with_capacity(values),
        };
        for &node in graph.order() {
            for &value in &graph.node(node).results {
                let root = roots.root(value);
                classes.parent[value] = (root != value).then_some(root);
            }
        }
        for &node in graph.order() {
            for_each_written_value(graph, ops, node, |value| {
                let class = classes.find(value);
                classes.writes.insert(class, positions[node]);
            });
            for &value in &graph.node(node).results {
                let last = edits.users(value).map(|u| positions[u] + 1).max().unwrap_or(0);
                let class = classes.find(value);
                classes.last_read[class] = classes.last_read[class].max(last);
            }
        }
        for value in graph.outputs() {
            let class = classes.find(value);
            classes.outputs[class] += 1;
        }
        classes
    }

    /// The class representative of `value`, halving the path on the way.
    fn find(&mut self, value: ValueId) -> ValueId {
        let mut class = value;
        while let Some(parent) = self.parent[class] {
            if let Some(grandparent) = self.parent[parent] {
                self.parent[class] = Some(grandparent);
            }
            class = parent;
        }
        class
    }

    /// The first write to `class` at a position in `after + 1 .. until_read` (`until_read` in the
    /// encoding of `last_read`: a write there happens while a reader is still to come).
    fn write_between(&self, class: ValueId, after: u32, until_read: u32) -> Option<u32> {
        self.writes.first_after(class, after).filter(|&w| w < until_read)
    }

    /// The graph-output rule: whether merging the copy's class into the original's would make a graph
    /// output share storage with a non-donated input or with another output.
    fn graph_io_alias(&self, graph: &Graph, copy_class: ValueId, original_class: ValueId) -> Option<KeepReason> {
        let copy_returned = 0 < self.outputs[copy_class];
        let original_exposed = is_non_donated_input(graph, original_class) || 0 < self.outputs[original_class];
        (copy_returned && original_exposed).then_some(KeepReason::GraphIoAlias)
    }

    /// Merges the class of a removed copy into its original's class (`into` stays the representative,
    /// so a class rooted at an input keeps that input as its representative).
    fn merge(&mut self, copy_class: ValueId, into: ValueId) {
        if copy_class == into {
            return;
        }
        self.parent[copy_class] = Some(into);
        self.writes.merge(copy_class, into);
        self.last_read[into] = self.last_read[into].max(std::mem::take(&mut self.last_read[copy_class]));
        self.outputs[into] += std::mem::take(&mut self.outputs[copy_class]);
    }
}

/// Storage-aware rules, in two phases so no decision is undone by a later one.
fn alias_aware(graph: &mut Graph, cx: &PassContext<'_>) -> CloneReport {
    let mut report = CloneReport::default();
    let positions = graph.positions();
    let mut edits = Edits::new(graph);
    let ops = OpTable::compute(graph, cx.registry);
    let mut classes = Classes::compute(graph, &ops, &positions, &edits);
    let mut written = Vec::new();
    let mut layout_changes = Vec::new();
    // Removes the copy and returns `None`, or returns why it stays (the caller keeps it or defers it).
    let decide =
        |graph: &mut Graph, edits: &mut Edits, classes: &mut Classes, report: &mut CloneReport, node: NodeId| {
            let original = copy_input(graph, node).expect("candidates are copies");
            let copy = graph.node(node).results[0];
            let (copy_class, original_class) = (classes.find(copy), classes.find(original));
            let p = positions[node];
            let copy_writes = classes.writes.len(copy_class);
            let reason = if 1 < copy_writes {
                Some(KeepReason::MultipleWriters)
            } else if let Some(w) = classes.write_between(copy_class, p, classes.last_read[original_class]) {
                // The original's last read is the writer itself when it reads the original through
                // another argument, and later otherwise.
                let writer_reads_original = classes.last_read[original_class] == w + 1;
                Some(if writer_reads_original {
                    KeepReason::AliasedWriterArgument
                } else {
                    KeepReason::OriginalUsedAfterWrite
                })
            } else if 0 < copy_writes && is_non_donated_input(graph, original_class) {
                Some(KeepReason::NonDonatedInput)
            } else if classes.write_between(original_class, p, classes.last_read[copy_class]).is_some() {
                Some(KeepReason::OriginalWrittenWhileCopyLive)
            } else {
                classes.graph_io_alias(graph, copy_class, original_class)
            };
            if reason.is_none() {
                edits.remove(graph, node, original, report);
                classes.merge(copy_class, original_class);
            }
            reason
        };
    // Phase 1: copies whose storage nobody writes; copies that change the layout wait for phase 3.
    for node in candidates(graph) {
        let original = copy_input(graph, node).expect("candidates are copies");
        if changes_layout(graph, node, original) {
            layout_changes.push(node);
            continue;
        }
        let copy = graph.node(node).results[0];
        let copy_class = classes.find(copy);
        if classes.writes.len(copy_class) == 0 {
            if let Some(reason) = decide(graph, &mut edits, &mut classes, &mut report, node) {
                keep(graph, node, reason, &mut report);
            }
        } else {
            written.push(node);
        }
    }
    // Phase 2: written copies in graph order; classes and uses reflect every earlier removal. A
    // copy kept only because its original's storage is read after the write waits for phase 3,
    // which looks at the elements read (the query slice of a one-token qkv is compact, so its
    // copy keeps the layout, and the key and value slices after it are other elements).
    let mut pending: Vec<(NodeId, KeepReason)> =
        layout_changes.into_iter().map(|node| (node, KeepReason::LayoutChange)).collect();
    for node in written {
        match decide(graph, &mut edits, &mut classes, &mut report, node) {
            None => {}
            Some(KeepReason::OriginalUsedAfterWrite) => pending.push((node, KeepReason::OriginalUsedAfterWrite)),
            Some(reason) => keep(graph, node, reason, &mut report),
        }
    }
    // Phase 3: copies that change the layout and the deferred ones, which only the view-write rule
    // removes; repeated until none goes (a removal gives the original its copy's writer, which can
    // make an earlier copy of the original a candidate), so a second run finds nothing more.
    loop {
        let before = pending.len();
        pending.retain_mut(|(node, reason)| {
            match decide_view_write(graph, cx, &ops, &positions, &mut edits, &mut classes, &mut report, *node) {
                Ok(()) => false,
                // A copy keeping the layout was deferred for its storage-level reason, which stays
                // the reason when the rule does not apply.
                Err(KeepReason::LayoutChange) if *reason != KeepReason::LayoutChange => true,
                Err(why) => {
                    *reason = why;
                    true
                }
            }
        });
        if pending.len() == before {
            break;
        }
    }
    for (node, reason) in pending {
        keep(graph, node, reason, &mut report);
    }
    graph.remove_nodes(&edits.removed);
    report.kept.sort_by_key(|k| positions[k.node]);
    report
}

/// The in-place kernel call writing the copy `node` (its one live user, an `ImplCall` that
/// writes it, once), with the index of the written result: the candidate of the view-write rule.
fn view_writer(graph: &Graph, edits: &Edits, node: NodeId) -> Option<(NodeId, usize)> {
    let copy = graph.node(node).results[0];
    let mut users = edits.users(copy);
    let writer = users.next()?;
    if users.any(|other| other != writer) {
        return None;
    }
    let NodeKind::ImplCall { writes, args, .. } = &graph.node(writer).kind else { return None };
    let read_once = args.iter().filter(|arg| matches!(arg, ir_graph::Arg::Tensor(v) if *v == copy)).count() == 1;
    let index = writes.iter().position(|&p| matches!(args.get(p), Some(ir_graph::Arg::Tensor(v)) if *v == copy))?;
    read_once.then_some((writer, index))
}

/// Whether `writer` takes, besides `copy`, a tensor argument of storage class `class`.
fn writer_reads_class(graph: &Graph, classes: &mut Classes, writer: NodeId, copy: ValueId, class: ValueId) -> bool {
    let NodeKind::ImplCall { args, .. } = &graph.node(writer).kind else { return false };
    args.iter().any(|arg| matches!(arg, ir_graph::Arg::Tensor(v) if *v != copy && classes.find(*v) == class))
}

/// The view-write rule: a copy that changes the layout, written by an in-place kernel whose
/// provider takes the original's layout, is removed when the kernel can write the original where
/// it is. Besides the rules every written copy obeys (one writer, not a non-donated input, graph
/// outputs kept apart, no other argument of the writer in the original's storage, which the kernel
/// then could not own), it is judged element by element: no value of the original's storage that
/// shares an element with the original is read at or after the write or written while the copy is
/// read ([`ir_core::Layout::disjoint_from`]: q and k as column slices of one `qkv` buffer are
/// apart), and the kernel's result takes the original's layout, which every reader of it must
/// accept without changing its own results (and it may not be a graph output).
#[allow(clippy::too_many_arguments)]
fn decide_view_write(
    graph: &mut Graph,
    cx: &PassContext<'_>,
    ops: &OpTable,
    positions: &SecondaryMap<NodeId, u32>,
    edits: &mut Edits,
    classes: &mut Classes,
    report: &mut CloneReport,
    node: NodeId,
) -> Result<(), KeepReason> {
    let original = copy_input(graph, node).expect("candidates are copies");
    let copy = graph.node(node).results[0];
    let (writer, index) = view_writer(graph, edits, node).ok_or(KeepReason::LayoutChange)?;
    let (copy_class, original_class) = (classes.find(copy), classes.find(original));
    let reason = if 1 < classes.writes.len(copy_class) {
        Some(KeepReason::MultipleWriters)
    } else if copy_class == original_class {
        Some(KeepReason::OriginalUsedAfterWrite)
    } else if is_non_donated_input(graph, original_class) {
        Some(KeepReason::NonDonatedInput)
    } else if writer_reads_class(graph, classes, writer, copy, original_class) {
        // A kernel owns what it writes (the interpreter and every executor hand it the storage
        // uniquely): another argument of the writer in the original's storage keeps the copy,
        // even where their elements are apart (sibling column slices of one buffer).
        Some(KeepReason::AliasedWriterArgument)
    } else if !retypes_cleanly(graph, cx, edits, writer, index, copy, original) {
        Some(KeepReason::LayoutChange)
    } else {
        element_hazard(graph, ops, positions, edits, classes, node, writer, original)
            .or_else(|| classes.graph_io_alias(graph, copy_class, original_class))
    };
    if let Some(reason) = reason {
        return Err(reason);
    }
    let result = graph.node(writer).results[index];
    edits.remove(graph, node, original, report);
    graph.set_meta(result, graph.meta(original).clone());
    classes.merge(copy_class, original_class);
    tracing::debug!(target: "ir_passes::eliminate_clones", node = graph.display_node(writer), "written in place in the original's layout");
    Ok(())
}

/// Whether the writer's provider takes `original` in the copy's place, its fresh results keep
/// their metadata, and every reader of the written result gives the same results when that result
/// has the original's layout (none is the graph's output, none writes it).
fn retypes_cleanly(
    graph: &Graph,
    cx: &PassContext<'_>,
    edits: &Edits,
    writer: NodeId,
    index: usize,
    copy: ValueId,
    original: ValueId,
) -> bool {
    let NodeKind::ImplCall { op, provider, writes, args } = &graph.node(writer).kind else { return false };
    let (op, provider) = (graph.op_name(*op), graph.provider_name(*provider));
    let metas: Vec<ir_core::op::ArgMeta<'_>> = args
        .iter()
        .map(|arg| match arg {
            ir_graph::Arg::Tensor(v) if *v == copy => ir_core::op::ArgMeta::Tensor(graph.meta(original)),
            other => graph.arg_meta(other),
        })
        .collect();
    let Some(def) = cx.registry.op_def(op) else { return false };
    // Bound: omitted trailing parameters take their defaults, as a predicate expects them.
    let Ok(bound) = ir_core::op::bind_meta(def, metas.clone()) else { return false };
    if !matches!(cx.registry.implementation_supports(op, provider, &bound), Some(ir_core::Support::Yes)) {
        return false;
    }
    let Ok(expected) = def.output_metas(metas) else { return false };
    let results = &graph.node(writer).results;
    let fresh_kept = results.iter().zip(&expected).skip(writes.len()).all(|(&r, want)| graph.meta(r) == want);
    if !fresh_kept {
        return false;
    }
    let result = results[index];
    let retyped = graph.meta(original);
    edits.users(result).all(|user| reader_unchanged(graph, cx, user, result, retyped))
}

/// Whether `user` gives the results it has when `value` has the metadata `retyped` (an op call or a
/// built-in that neither writes `value` nor is the graph's output).
fn reader_unchanged(
    graph: &Graph,
    cx: &PassContext<'_>,
    user: NodeId,
    value: ValueId,
    retyped: &ir_core::TensorMeta,
) -> bool {
    let data = graph.node(user);
    let expected: Vec<ir_core::TensorMeta> = match &data.kind {
        NodeKind::IrCall { op, args, .. } | NodeKind::ImplCall { op, args, .. } => {
            if let NodeKind::ImplCall { writes, .. } = &data.kind {
                let writes_value =
                    writes.iter().any(|&p| matches!(args.get(p), Some(ir_graph::Arg::Tensor(v)) if *v == value));
                if writes_value {
                    return false;
                }
            }
            let Some(def) = cx.registry.op_def(graph.op_name(*op)) else { return false };
            let metas = args
                .iter()
                .map(|arg| match arg {
                    ir_graph::Arg::Tensor(v) if *v == value => ir_core::op::ArgMeta::Tensor(retyped),
                    other => graph.arg_meta(other),
                })
                .collect();
            let Ok(mut expected) = def.output_metas(metas) else { return false };
            // The results an in-place call writes keep their arguments' metadata.
            if let NodeKind::ImplCall { writes, .. } = &data.kind {
                for (slot, &position) in writes.iter().enumerate() {
                    if let (Some(ir_graph::Arg::Tensor(v)), Some(want)) = (args.get(position), expected.get_mut(slot)) {
                        *want = graph.meta(*v).clone();
                    }
                }
            }
            expected
        }
        NodeKind::Builtin { op, args } => {
            if data.kind.builtin_subject(Effect::WriteFirst) == Some(value) {
                return false;
            }
            let metas: smallvec::SmallVec<[&ir_core::TensorMeta; 2]> = args
                .iter()
                .filter_map(ir_core::builtin::BuiltinArg::value)
                .map(|v| if *v == value { retyped } else { graph.meta(*v) })
                .collect();
            match (op.def().meta)(&metas, &ir_core::builtin::Scalars(args)) {
                Ok(meta) => vec![meta],
                Err(_) => return false,
            }
        }
        NodeKind::Input { .. } | NodeKind::Output(_) => return false,
    };
    expected.len() == data.results.len() && data.results.iter().zip(&expected).all(|(&r, want)| graph.meta(r) == want)
}

/// The element-level read-after-write rules of the view-write rule: a value of the original's
/// class sharing an element with the original that is read at or after the write (by the writer
/// through another argument, or later), or written after the copy while the copy is still read.
#[allow(clippy::too_many_arguments)]
fn element_hazard(
    graph: &Graph,
    ops: &OpTable,
    positions: &SecondaryMap<NodeId, u32>,
    edits: &Edits,
    classes: &mut Classes,
    node: NodeId,
    writer: NodeId,
    original: ValueId,
) -> Option<KeepReason> {
    let region = &graph.meta(original).layout;
    let original_class = classes.find(original);
    let copy_class = classes.find(graph.node(node).results[0]);
    let (p, w) = (positions[node], positions[writer]);
    let copy_read_until = classes.last_read[copy_class];
    // Positions are indices into the order (removed copies stay in it until the pass ends).
    for &later in &graph.order()[p as usize + 1..] {
        let q = positions[later];
        if edits.removed.contains(later) {
            continue;
        }
        let mut overlaps =
            |value: ValueId| classes.find(value) == original_class && !graph.meta(value).layout.disjoint_from(region);
        // A view reads no element: what reads through it is checked where it happens.
        if q >= w && !graph.node(later).kind.is_view() {
            let mut read = None;
            graph.node(later).kind.for_each_operand(|value| {
                if read.is_none() && overlaps(value) {
                    read = Some(value);
                }
            });
            if read.is_some() {
                return Some(if later == writer {
                    KeepReason::AliasedWriterArgument
                } else {
                    KeepReason::OriginalUsedAfterWrite
                });
            }
        }
        if q < copy_read_until {
            let mut written = false;
            for_each_written_value(graph, ops, later, |value| written |= overlaps(value));
            if written {
                return Some(KeepReason::OriginalWrittenWhileCopyLive);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use cranelift_entity::EntityRef;
    use ir_graph::ValueId;
    use proptest::prelude::*;

    use super::{SET, WriteSets};

    /// One step on four classes: insert a position, or merge one class into another.
    #[derive(Clone, Debug)]
    enum Step {
        Insert(usize, u32),
        Merge(usize, usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        // Positions near the top of the single-writer range exercise its fallback to a set.
        let position = prop_oneof![0u32..40, (SET - 3)..(SET + 2), Just(u32::MAX - 1), Just(u32::MAX)];
        prop_oneof![
            (0usize..4, position).prop_map(|(class, p)| Step::Insert(class, p)),
            (0usize..4, 0usize..4).prop_map(|(from, into)| Step::Merge(from, into)),
        ]
    }

    proptest! {
        /// The compact sets answer like one `BTreeSet` per class under any mix of inserts and merges.
        #[test]
        fn write_sets_behave_like_btree_sets(steps in proptest::collection::vec(step(), 0..60)) {
            let mut sets = WriteSets::new(4);
            let mut model: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); 4];
            let class = ValueId::new;
            for step in steps {
                match step {
                    Step::Insert(c, p) => {
                        sets.insert(class(c), p);
                        model[c].insert(p);
                    }
                    Step::Merge(from, into) if from != into => {
                        sets.merge(class(from), class(into));
                        let moved = std::mem::take(&mut model[from]);
                        model[into].extend(moved);
                    }
                    Step::Merge(..) => {}
                }
                for (c, expected) in model.iter().enumerate() {
                    prop_assert_eq!(sets.len(class(c)), expected.len());
                    for after in [0u32, 5, 20, SET - 3, SET, u32::MAX - 2] {
                        let want = expected.range(after + 1..).next().copied();
                        prop_assert_eq!(sets.first_after(class(c), after), want, "class {} after {}", c, after);
                    }
                }
            }
        }
    }
}
