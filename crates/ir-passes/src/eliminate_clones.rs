//! Clone elimination: removes `clone` and `contiguous` copies that nothing needs, in two variants.
//!
//! # The question
//!
//! Lowering puts a copy in front of every activation of an in-place kernel, so the kernel never
//! writes a value someone can still read. Most of those copies are unnecessary: the original is dead
//! after the call, or was donated by the caller. This pass removes a copy `c` of `o` (redirecting
//! every use of `c` to `o`) unless one of the rules below keeps it.
//!
//! # The rules of both variants
//!
//! **Layout change** — a copy whose layout (strides or storage offset) differs from its input's is
//! kept, since its users see another layout:
//!
//! ```text
//! %s = slice(%x, 1, 0, 3) : f32[4,3]{5,1}
//! %c = contiguous(%s) : f32[4,3]          // kept: strides (5, 1) become (3, 1)
//! ```
//!
//! **Read-only copies** — a copy nobody writes is always removed, even of a non-donated input:
//!
//! ```text
//! %c = clone(%x) : f32[4,5]               // removed; users of %c read %x
//! ```
//!
//! **Original used after the write** — a written copy whose original is read after the writer is kept:
//!
//! ```text
//! %c = clone(%a) : bf16[8,16]
//! %o, %r = impl fused_add_rms_norm[cpu] writes(0, 1) (%c, ...)
//! output(%o, %a)                          // %a is read after the write: %c stays
//! ```
//!
//! **Non-donated input** — a written copy of a graph input the caller did not donate is kept.
//!
//! # `unsafe` (vLLM's exact rules, R80)
//!
//! Candidates are taken in graph order with positions computed once. A copy with more than one
//! writer is kept. It ignores aliasing through other views of the same storage and through one value
//! passed as two activations of a kernel, so it can remove a copy whose removal changes results; the
//! interpreter's safety checks catch those cases.
//!
//! # `alias-aware` (the default, R81–R82)
//!
//! Works on storage roots (a view's root is its input's root; a writer's result has the root of what
//! it wrote). Phase 1 removes every copy whose storage nobody writes. Phase 2 takes the written copies
//! in graph order, recomputing roots and users after each removal, and keeps a copy if more than one
//! node writes its storage, if any value sharing the original's root is read after the write, if the
//! original's root is a non-donated input, or if another argument of the writer shares that root:
//!
//! ```text
//! %qkv = ... : bf16[3,8,16]
//! %q = reshape(slice(%qkv, 0, 0, 1), [8, 16])
//! %c = clone(%q)                          // kept: %qkv (same root) is read after the write
//! %o, %r = impl fused_add_rms_norm[cpu] writes(0, 1) (%c, ...)
//! output(%o, %qkv)
//! ```
//!
//! Both variants are idempotent; on error the graph is unchanged.
//!
//! ```
//! use ir_core::graph::parse;
//! use ir_passes::{CloneElimination, PassContext, eliminate_clones};
//!
//! let mut graph = parse(
//!     "graph g(%x: f32[4,5]) {
//!        %0 = clone(%x) : f32[4,5]
//!        %1 = scale(%0, 2.0) : f32[4,5]
//!        output(%1)
//!      }",
//! )?;
//! let registry = ir_core::Registry::with_builtin_ops();
//! let cx = PassContext::new(&registry).with_clone_elimination(CloneElimination::AliasAware);
//! let report = eliminate_clones(&mut graph, &cx)?;
//! assert_eq!(report.removed.len(), 1);
//! assert!(graph.to_string().contains("%1 = scale(%x, 2.0)"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use cranelift_entity::{EntitySet, SecondaryMap};
use ir_core::graph::{Graph, NodeId, NodeKind, ValueId};

use crate::analysis::{StorageRoots, written_values};
use crate::{CloneElimination, PassContext, PassError};

/// Why a copy was kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepReason {
    /// The copy changes strides or storage offset.
    LayoutChange,
    /// More than one node writes the copy (or its storage).
    MultipleWriters,
    /// The original (or an alias of it) is read after the write.
    OriginalUsedAfterWrite,
    /// The original is a graph input the caller did not donate.
    NonDonatedInput,
    /// Another argument of the writer shares the original's storage.
    AliasedWriterArgument,
}

impl fmt::Display for KeepReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeepReason::LayoutChange => "copy changes layout",
            KeepReason::MultipleWriters => "more than one writer",
            KeepReason::OriginalUsedAfterWrite => "original used after the write",
            KeepReason::NonDonatedInput => "original is a non-donated input",
            KeepReason::AliasedWriterArgument => "another argument of the writer shares the storage",
        })
    }
}

/// What clone elimination did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CloneReport {
    /// Removed copies.
    pub removed: Vec<NodeId>,
    /// Kept copies with their reasons.
    pub kept: Vec<(NodeId, KeepReason)>,
}

impl fmt::Display for CloneReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kept: Vec<String> = self.kept.iter().map(|(n, r)| format!("{n}: {r}")).collect();
        write!(f, "removed {} copy(ies), kept {}", self.removed.len(), self.kept.len())?;
        if !kept.is_empty() {
            write!(f, " ({})", kept.join("; "))?;
        }
        Ok(())
    }
}

/// Runs clone elimination with the context's variant. See the module documentation.
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
    match graph.node(node).kind {
        NodeKind::Clone(o) | NodeKind::Contiguous(o) => Some(o),
        _ => None,
    }
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

/// Use lists kept up to date while copies are removed, so each removal costs only the copy's uses.
struct Edits {
    users: SecondaryMap<ValueId, ir_core::graph::UseList>,
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

/// vLLM's rules (R80).
fn unsafe_variant(graph: &mut Graph, cx: &PassContext<'_>) -> CloneReport {
    let mut report = CloneReport::default();
    let positions = graph.positions();
    let mut edits = Edits::new(graph);
    for node in candidates(graph) {
        let original = copy_input(graph, node).expect("candidates are copies");
        if changes_layout(graph, node, original) {
            tracing::debug!(target: "ir_passes::eliminate_clones", node = %graph.display_node(node), "copy changes layout");
            report.kept.push((node, KeepReason::LayoutChange));
            continue;
        }
        let copy = graph.node(node).results[0];
        let writers: Vec<NodeId> =
            edits.users(copy).filter(|&u| written_values(graph, cx.registry, u).contains(&copy)).collect();
        let keep = match writers.as_slice() {
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
        match keep {
            Some(reason) => report.kept.push((node, reason)),
            None => edits.remove(graph, node, original, &mut report),
        }
    }
    graph.remove_nodes(&edits.removed);
    report
}

/// The distinct nodes writing a storage class, as far as the rules need them: none, exactly one
/// (which), or several. Merging is O(1), so long chains of removed copies stay linear.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Writers {
    #[default]
    None,
    One(NodeId),
    Several,
}

impl Writers {
    fn add(self, writer: NodeId) -> Writers {
        match self {
            Writers::None => Writers::One(writer),
            Writers::One(w) if w == writer => self,
            _ => Writers::Several,
        }
    }

    fn union(self, other: Writers) -> Writers {
        match other {
            Writers::None => self,
            Writers::One(w) => self.add(w),
            Writers::Several => Writers::Several,
        }
    }
}

/// Storage classes: the roots of R81, merged as copies are removed (union-find), with the nodes
/// writing each class and the last position at which any value of the class is read.
struct Classes {
    root: SecondaryMap<ValueId, Option<ValueId>>,
    /// Union-find parent links of merged classes (`None`: a class of its own).
    merged: SecondaryMap<ValueId, Option<ValueId>>,
    writers: SecondaryMap<ValueId, Writers>,
    /// Last reading position + 1 (0: never read).
    last_use: SecondaryMap<ValueId, u32>,
}

impl Classes {
    fn compute(graph: &Graph, cx: &PassContext<'_>, positions: &SecondaryMap<NodeId, u32>, edits: &Edits) -> Classes {
        let roots = StorageRoots::compute(graph, cx.registry);
        let mut classes = Classes {
            root: SecondaryMap::new(),
            merged: SecondaryMap::new(),
            writers: SecondaryMap::new(),
            last_use: SecondaryMap::new(),
        };
        for &node in graph.order() {
            for &value in &graph.node(node).results {
                classes.root[value] = Some(roots.root(value));
            }
        }
        for &node in graph.order() {
            for value in written_values(graph, cx.registry, node) {
                let class = classes.class(value);
                classes.writers[class] = classes.writers[class].add(node);
            }
            for &value in &graph.node(node).results {
                let last = edits.users(value).map(|u| positions[u] + 1).max().unwrap_or(0);
                let class = classes.class(value);
                classes.last_use[class] = classes.last_use[class].max(last);
            }
        }
        classes
    }

    fn class(&self, value: ValueId) -> ValueId {
        let mut class = self.root[value].unwrap_or(value);
        while let Some(next) = self.merged[class] {
            class = next;
        }
        class
    }

    fn writers(&self, class: ValueId) -> Writers {
        self.writers[class]
    }

    /// Whether a value of `class` is read after position `position`.
    fn read_after(&self, class: ValueId, position: u32) -> bool {
        self.last_use[class] > position + 1
    }

    /// Merges the class of a removed copy into its original's class.
    fn merge(&mut self, copy_class: ValueId, into: ValueId) {
        if copy_class == into {
            return;
        }
        self.merged[copy_class] = Some(into);
        self.writers[into] = self.writers[into].union(std::mem::take(&mut self.writers[copy_class]));
        self.last_use[into] = self.last_use[into].max(std::mem::take(&mut self.last_use[copy_class]));
    }
}

/// Storage-root aware rules (R81–R82), in two phases so no decision is undone by a later one.
fn alias_aware(graph: &mut Graph, cx: &PassContext<'_>) -> CloneReport {
    let mut report = CloneReport::default();
    let positions = graph.positions();
    let mut edits = Edits::new(graph);
    let mut classes = Classes::compute(graph, cx, &positions, &edits);
    // Phase 1: copies whose storage nobody writes.
    let mut written = Vec::new();
    for node in candidates(graph) {
        let original = copy_input(graph, node).expect("candidates are copies");
        if changes_layout(graph, node, original) {
            report.kept.push((node, KeepReason::LayoutChange));
            continue;
        }
        let copy = graph.node(node).results[0];
        let copy_class = classes.class(copy);
        if classes.writers(copy_class) == Writers::None {
            let into = classes.class(original);
            edits.remove(graph, node, original, &mut report);
            classes.merge(copy_class, into);
        } else {
            written.push(node);
        }
    }
    // Phase 2: written copies in graph order; classes and uses reflect every earlier removal.
    for node in written {
        let original = copy_input(graph, node).expect("candidates are copies");
        let copy = graph.node(node).results[0];
        let (copy_class, original_class) = (classes.class(copy), classes.class(original));
        let keep = match classes.writers(copy_class) {
            Writers::One(writer) => {
                let w = positions[writer];
                let read_later = classes.read_after(original_class, w);
                let aliased_argument =
                    graph.node(writer).kind.operands().iter().any(|&a| a != copy && classes.class(a) == original_class);
                if read_later {
                    Some(KeepReason::OriginalUsedAfterWrite)
                } else if is_non_donated_input(graph, original_class) {
                    Some(KeepReason::NonDonatedInput)
                } else if aliased_argument {
                    Some(KeepReason::AliasedWriterArgument)
                } else {
                    None
                }
            }
            _ => Some(KeepReason::MultipleWriters),
        };
        match keep {
            Some(reason) => report.kept.push((node, reason)),
            None => {
                edits.remove(graph, node, original, &mut report);
                classes.merge(copy_class, original_class);
            }
        }
    }
    graph.remove_nodes(&edits.removed);
    report.kept.sort_by_key(|(n, _)| positions[*n]);
    report
}
