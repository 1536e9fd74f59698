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
//! the kernel call the hit entry is out of the memo (moved, no reference count), so a nested call on
//! the same thread can neither see nor free it.

use std::cell::RefCell;
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

struct Memo {
    slots: [Option<Entry>; SLOTS],
    next: usize,
}

thread_local! {
    static MEMO: RefCell<Memo> = const { RefCell::new(Memo { slots: [const { None }; SLOTS], next: 0 }) };
}

/// Takes this thread's current entry for the call out of the memo: its slot and the entry, to give
/// back with [`restore`] after the kernel ran.
#[inline]
pub(crate) fn take(
    registry: u64,
    def: &'static OpDef,
    generation: u64,
    metas: &[ArgMeta<'_>],
) -> Option<(usize, Entry)> {
    MEMO.try_with(|memo| {
        let mut memo = memo.try_borrow_mut().ok()?;
        let index = memo.slots.iter().position(|slot| {
            slot.as_ref().is_some_and(|entry| {
                std::ptr::eq(entry.def, def)
                    && entry.registry == registry
                    && entry.generation == generation
                    && entry.cached.matches(metas)
            })
        })?;
        memo.slots[index].take().map(|entry| (index, entry))
    })
    .ok()
    .flatten()
}

/// Gives a taken entry back to its slot (unless a nested call filled the slot meanwhile).
#[inline]
fn restore(index: usize, entry: Entry) {
    let _ = MEMO.try_with(|memo| {
        if let Ok(mut memo) = memo.try_borrow_mut()
            && memo.slots[index].is_none()
        {
            memo.slots[index] = Some(entry);
        }
    });
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
        let mut memo = memo.try_borrow_mut().ok()?;
        let index = memo.slots.iter().position(Option::is_none).unwrap_or_else(|| {
            let index = memo.next;
            memo.next = (index + 1) % SLOTS;
            index
        });
        memo.slots[index].replace(entry)
    });
    // An evicted entry is dropped here, after the memo's borrow ended.
    drop(evicted);
}

/// A selection held by one call: given back to the memo when the call is over (dropped).
pub(crate) struct Held {
    entry: Option<Entry>,
    origin: Origin,
}

/// Where a held selection goes afterwards.
enum Origin {
    /// Back to the memo slot it was taken from.
    Slot(usize),
    /// Into the memo (made now from an installed list).
    Remember,
    /// Nowhere (native, chosen for want of an installed list).
    Drop,
}

impl Held {
    /// An entry taken from slot `slot` by [`take`].
    #[inline]
    pub(crate) fn taken(slot: usize, entry: Entry) -> Held {
        Held { entry: Some(entry), origin: Origin::Slot(slot) }
    }

    /// A selection made now; remembered afterwards when it comes from an installed list.
    pub(crate) fn made(entry: Entry, installed: bool) -> Held {
        Held { entry: Some(entry), origin: if installed { Origin::Remember } else { Origin::Drop } }
    }

    /// The selection.
    #[inline]
    pub(crate) fn entry(&self) -> &Entry {
        self.entry.as_ref().expect("held until dropped")
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        let Some(entry) = self.entry.take() else { return };
        match self.origin {
            Origin::Slot(slot) => restore(slot, entry),
            Origin::Remember => remember(entry),
            Origin::Drop => {}
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
