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
//! was being published carries the older stamp and is never used after the change completes.
//!
//! Entries are reference-counted on this thread (`Rc`): a hit lends the call its own handle to the
//! entry, so nothing the call holds points into the memo itself. A nested call may evict the slot,
//! and the thread's memo may be destroyed before a selection kept in another thread-local is
//! dropped; the entry lives until its last handle goes. The memo holds no `unsafe`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
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

/// This thread's memo. The slots are borrowed only inside [`take`] and [`remember`], which run no
/// code of anyone else's while they hold the borrow (an evicted entry is dropped after it ends),
/// so the borrow never fails.
struct Memo {
    slots: RefCell<[Option<Rc<Entry>>; SLOTS]>,
    next: Cell<usize>,
}

thread_local! {
    static MEMO: Memo = const { Memo { slots: RefCell::new([const { None }; SLOTS]), next: Cell::new(0) } };
}

/// This thread's current entry for the call, if it remembers one.
#[inline]
pub(crate) fn take(registry: u64, def: &'static OpDef, generation: u64, metas: &[ArgMeta<'_>]) -> Option<Held> {
    MEMO.try_with(|memo| {
        let slots = memo.slots.borrow();
        let entry = slots.iter().flatten().find(|entry| {
            std::ptr::eq(entry.def, def)
                && entry.registry == registry
                && entry.generation == generation
                && entry.cached.matches(metas)
        })?;
        Some(Held { state: State::Lent(Rc::clone(entry)) })
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

/// Remembers a selection made now, in a free slot or the oldest one's.
fn remember(entry: Entry) {
    let evicted = MEMO.try_with(|memo| {
        let mut slots = memo.slots.borrow_mut();
        let index = slots.iter().position(Option::is_none).unwrap_or_else(|| memo.next.get());
        memo.next.set((index + 1) % SLOTS);
        slots[index].replace(Rc::new(entry))
    });
    // An evicted entry (and the memo's answer when the thread is ending) is dropped here, after the
    // borrow ended: dropping it may run anyone's code.
    drop(evicted);
}

/// A selection held by one call.
pub(crate) struct Held {
    state: State,
}

enum State {
    /// Lent from this thread's memo: the call's own handle to the entry.
    Lent(Rc<Entry>),
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
            State::Lent(entry) => entry,
            State::Made { entry, .. } => entry.as_ref().expect("held until dropped"),
        }
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        if let State::Made { entry, remember: true } = &mut self.state
            && let Some(entry) = entry.take()
        {
            self::remember(entry);
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
