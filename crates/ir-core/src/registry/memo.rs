//! The typed call path's per-thread memo of recent selections.
//!
//! A typed call on a remembered argument-metadata key would still read the op table, the op's
//! installed list and a slot of its selection cache (three `arc_swap` loads, each a pair of atomic
//! read-modify-writes). Each thread keeps its last few selections here instead, stamped with their
//! registry's [`Generation`], which every change in that registry that can change a selection
//! advances (its op table or an installed list published): an entry whose stamp is current is what
//! selection would return now, so a hit costs one atomic load and the key comparison. Changes in
//! other registries leave the entry current.
//!
//! The stamp is read before the op table and the installed list, so an entry made while a change
//! was being published carries the older stamp and is never used after the change completes.
//!
//! Entries are reference-counted on this thread (`Rc`): a hit lends the call its own handle to the
//! entry, so nothing the call holds points into the memo itself. A nested call may evict the slot,
//! and the thread's memo may be destroyed before a selection kept in another thread-local is
//! dropped; the entry lives until its last handle goes. A selection made again after a change
//! takes the slot of the stale one for the same op, in its allocation when no call holds it, so
//! steady calls allocate nothing. The memo holds no `unsafe`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::op::{ArgMeta, OpDef};
use crate::registry::OpEntry;
use crate::registry::selection::Cached;

/// Registries' identities in memo entries (an address could be reused by a later registry).
static NEXT_REGISTRY: AtomicU64 = AtomicU64::new(0);

/// Entries per thread: a decode step's distinct (op, shape) calls.
const SLOTS: usize = 16;

/// One registry's identity and the count of its publications, shared by the registry and its ops.
#[derive(Debug)]
pub(crate) struct Generation {
    registry: u64,
    count: AtomicU64,
}

impl Generation {
    /// A new registry's: an identity no other registry of the process has.
    pub(crate) fn new() -> Generation {
        Generation { registry: NEXT_REGISTRY.fetch_add(1, Ordering::Relaxed), count: AtomicU64::new(0) }
    }

    /// The registry's identity.
    #[inline]
    pub(crate) fn registry(&self) -> u64 {
        self.registry
    }

    /// The current generation (read before anything the selection depends on).
    #[inline]
    pub(crate) fn current(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }

    /// Marks the registry's memo entries stale: called after its op table or an installed list is
    /// published.
    pub(crate) fn advance(&self) {
        self.count.fetch_add(1, Ordering::Release);
    }
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

/// Remembers a selection made now: in the slot of a stale entry for the same op of the same
/// registry (in place when no call holds that entry), else in a free slot, else in the oldest one's.
fn remember(entry: Entry) {
    let evicted = MEMO.try_with(|memo| {
        let mut slots = memo.slots.borrow_mut();
        let stale = slots.iter().position(|slot| {
            slot.as_ref().is_some_and(|old| {
                old.registry == entry.registry && std::ptr::eq(old.def, entry.def) && old.generation != entry.generation
            })
        });
        let index = stale.or_else(|| slots.iter().position(Option::is_none)).unwrap_or_else(|| {
            let oldest = memo.next.get();
            memo.next.set((oldest + 1) % SLOTS);
            oldest
        });
        match slots[index].as_mut().and_then(Rc::get_mut) {
            Some(place) => Evicted::Entry(std::mem::replace(place, entry)),
            None => Evicted::Shared(slots[index].replace(Rc::new(entry))),
        }
    });
    // An evicted entry (and the memo's answer when the thread is ending) is dropped here, after the
    // borrow ended: dropping it may run anyone's code.
    drop(evicted);
}

/// What [`remember`] took out of a slot, dropped after the slots' borrow ends.
enum Evicted {
    /// A stale entry whose allocation the new one took over.
    Entry(#[expect(dead_code, reason = "held only to be dropped late")] Entry),
    /// The slot's previous handle, if any (calls may still hold the entry).
    Shared(#[expect(dead_code, reason = "held only to be dropped late")] Option<Rc<Entry>>),
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
        let generation = Generation::new();
        let before = generation.current();
        generation.advance();
        assert!(generation.current() > before);
        assert_ne!(Generation::new().registry(), Generation::new().registry(), "each registry its own identity");
    }
}
