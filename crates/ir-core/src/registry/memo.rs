//! The typed call path's per-thread memo of recent selections.
//!
//! A typed call on a remembered argument-metadata key would still read the op table, the op's
//! installed list and a slot of its selection cache (three `arc_swap` loads, each a pair of atomic
//! read-modify-writes). Each thread keeps its last few selections here instead, stamped with the
//! process-wide [`generation`], which every change that can change a selection advances (an op
//! table or an installed list published): an entry whose stamp is current is what selection would
//! return now, so a hit costs one atomic load and the key comparison.
//!
//! The stamp is read before the op table and the installed list, so an entry made while a change
//! was being published carries the older stamp and is never used after the change completes. During
//! the kernel call the hit entry stays in its slot, lent to the call (no move, no reference count):
//! the slot is marked busy, so a nested call on the same thread can neither take it nor replace it.
//! Moving the entry out and back had cost a `maybe_inplace` call about 20 ns.

use std::cell::{Cell, UnsafeCell};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::op::{ArgMeta, OpDef};
use crate::registry::OpEntry;
use crate::registry::selection::Cached;

/// Advanced by every publication of an op table or an installed list, in any registry.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Registries' identities in memo entries (an address could be reused by a later registry).
static NEXT_REGISTRY: AtomicU64 = AtomicU64::new(0);

/// Entries per thread: a decode step's distinct (op, shape) calls.
const SLOTS: usize = 16;

/// The current generation (read before anything the selection depends on).
#[inline]
pub(crate) fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// Marks every memo entry stale: called after an op table or an installed list is published.
pub(crate) fn advance() {
    GENERATION.fetch_add(1, Ordering::Release);
}

/// A new registry's identity.
pub(crate) fn registry_id() -> u64 {
    NEXT_REGISTRY.fetch_add(1, Ordering::Relaxed)
}

/// A remembered selection.
pub(crate) struct Entry {
    registry: u64,
    def: *const OpDef,
    generation: u64,
    /// The op's entry (its counters and warnings).
    pub(crate) entry: Arc<OpEntry>,
    pub(crate) cached: Arc<Cached>,
}

/// This thread's memo. A slot in use by a call (its entry lent out by [`take`]) is marked busy: no
/// other lookup returns it and nothing replaces it until the call gives it back, so the entry stays
/// where it is and the call reads it there (no move in or out).
struct Memo {
    slots: [UnsafeCell<Option<Entry>>; SLOTS],
    busy: [Cell<bool>; SLOTS],
    next: Cell<usize>,
}

thread_local! {
    static MEMO: Memo = const {
        Memo {
            slots: [const { UnsafeCell::new(None) }; SLOTS],
            busy: [const { Cell::new(false) }; SLOTS],
            next: Cell::new(0),
        }
    };
}

/// Lends this thread's current entry for the call, in its slot, until the returned selection is
/// dropped.
#[inline]
pub(crate) fn take(registry: u64, def: &'static OpDef, generation: u64, metas: &[ArgMeta<'_>]) -> Option<Held> {
    MEMO.try_with(|memo| {
        let index = (0..SLOTS).find(|&index| {
            // SAFETY: a slot that is not busy is only read here and written by `remember`, neither
            // of which keeps a reference past its own access; this thread is the only one.
            !memo.busy[index].get()
                && unsafe { &*memo.slots[index].get() }.as_ref().is_some_and(|entry| {
                    std::ptr::eq(entry.def, def)
                        && entry.registry == registry
                        && entry.generation == generation
                        && entry.cached.matches(metas)
                })
        })?;
        memo.busy[index].set(true);
        // SAFETY: the slot holds an entry (just matched); busy now, so it is neither replaced nor
        // lent again until the selection is dropped, and the memo lives as long as the thread.
        let entry = unsafe { (*memo.slots[index].get()).as_ref().map(NonNull::from) }?;
        Some(Held { state: State::Lent { slot: index, entry } })
    })
    .ok()
    .flatten()
}

impl Entry {
    /// A selection made now, stamped with the generation read before it was made.
    pub(crate) fn new(
        registry: u64,
        def: &'static OpDef,
        generation: u64,
        entry: Arc<OpEntry>,
        cached: Arc<Cached>,
    ) -> Entry {
        Entry { registry, def, generation, entry, cached }
    }
}

/// Remembers a selection made now, in a free slot or the oldest one's that no call is using (the
/// selection is dropped when every slot is in use: calls nested sixteen deep).
fn remember(entry: Entry) {
    let evicted = MEMO.try_with(|memo| {
        let free = (0..SLOTS).find(|&index| {
            // SAFETY: as in `take`.
            !memo.busy[index].get() && unsafe { &*memo.slots[index].get() }.is_none()
        });
        let index =
            free.or_else(|| (0..SLOTS).map(|k| (memo.next.get() + k) % SLOTS).find(|&index| !memo.busy[index].get()))?;
        memo.next.set((index + 1) % SLOTS);
        // SAFETY: the slot is not busy, so no reference to its entry is alive.
        unsafe { (*memo.slots[index].get()).replace(entry) }
    });
    // An evicted entry is dropped here, after the memo's slot was written.
    drop(evicted);
}

/// A selection held by one call: given back to the memo when the call is over (dropped).
pub(crate) struct Held {
    state: State,
}

enum State {
    /// Lent from memo slot `slot`, where it stays.
    Lent { slot: usize, entry: NonNull<Entry> },
    /// Made now: into the memo afterwards when it comes from an installed list, else dropped
    /// (native, chosen for want of one).
    Made { entry: Option<Entry>, remember: bool },
}

impl Held {
    /// A selection made now; remembered afterwards when it comes from an installed list.
    pub(crate) fn made(entry: Entry, installed: bool) -> Held {
        Held { state: State::Made { entry: Some(entry), remember: installed } }
    }

    /// The selection.
    #[inline]
    pub(crate) fn entry(&self) -> &Entry {
        match &self.state {
            // SAFETY: the slot is busy until this selection is dropped (see `take`).
            State::Lent { entry, .. } => unsafe { entry.as_ref() },
            State::Made { entry, .. } => entry.as_ref().expect("held until dropped"),
        }
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        match &mut self.state {
            State::Lent { slot, .. } => {
                let _ = MEMO.try_with(|memo| memo.busy[*slot].set(false));
            }
            State::Made { entry, remember: true } => {
                if let Some(entry) = entry.take() {
                    self::remember(entry);
                }
            }
            State::Made { remember: false, .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generation_only_advances() {
        let before = generation();
        advance();
        assert!(generation() > before);
        assert_ne!(registry_id(), registry_id(), "each registry its own identity");
    }
}
