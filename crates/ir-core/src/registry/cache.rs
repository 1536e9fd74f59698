//! The selection cache: each thread's remembered selections, the only cache dispatch has.
//!
//! Selection (predicates, meta function, the compacting fallback) is a pure function of the
//! registry's state and the call's complete argument metadata: predicates see metadata only and
//! meta functions are plain functions of it. So a selection is remembered under a key of the
//! registry, the op, the provider a call names (a lowered graph's `impl` node) or none (the
//! installed priorities), the registry's [`Generation`] and the argument metadata (floats by bits:
//! `-0.0` and each NaN are their own keys).
//!
//! Every change of a registry that can change a selection advances its generation: an op
//! defined, a provider registered or replaced, an installed list published. An entry whose stamp
//! is current is therefore what selection would return now, and a hit costs one atomic load and
//! the key comparison: no lock, no reference count, no allocation. Changes in other registries
//! leave the entry current. The stamp is read before the op table and the installed list, so an
//! entry made while a change was being published carries the older stamp and is never used after
//! the change completes.
//!
//! The table is per thread (threads never contend for it) and set-associative: an op's entries
//! live in the set its definition's address picks, [`WAYS`] of them, so a lookup compares at most
//! that many stamps. A selection made again after a change takes the slot of the stale one for
//! the same op; a steady call (a hit) allocates nothing.
//!
//! Entries are reference-counted on this thread (`Rc`): a hit lends the call its own handle to the
//! entry, so nothing the call holds points into the table itself. A nested call may evict the
//! slot, and the thread's table may be destroyed before a selection kept in another thread-local
//! is dropped; the entry lives until its last handle goes. The module holds no `unsafe`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use smallvec::SmallVec;

use crate::TensorMeta;
use crate::op::{Arg, ArgMeta, OpDef, OutputMetas};
use crate::registry::{ImplEntry, OpEntry};

/// Registries' identities in cache entries (an address could be reused by a later registry).
static NEXT_REGISTRY: AtomicU64 = AtomicU64::new(0);

/// Sets per thread; an op's entries share the set its definition picks.
const SETS: usize = 8;
/// Entries per set: the distinct argument metadata one op (and the ops sharing its set) keeps.
pub(crate) const WAYS: usize = 8;

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

    /// Marks the registry's cache entries stale: called after anything a selection reads changed.
    pub(crate) fn advance(&self) {
        self.count.fetch_add(1, Ordering::Release);
    }
}

/// One selection: the chosen provider and everything a call on the key's metadata needs from it.
pub(crate) struct Choice {
    key: SmallVec<[KeyArg; crate::op::INLINE_ARGS]>,
    /// The chosen provider.
    pub(crate) chosen: Arc<ImplEntry>,
    /// The meta function's output metadata.
    pub(crate) outputs: OutputMetas,
    /// The providers rejected before the chosen one, with their reasons.
    pub(crate) rejected: SmallVec<[(Arc<ImplEntry>, Arc<str>); 2]>,
    /// Whether a priority list was installed (otherwise native was chosen by default, or the call
    /// named its provider).
    pub(crate) from_priority_list: bool,
    /// Whether each output an in-place implementation writes into a given activation has that
    /// activation's dtype, device and shape: decided once from the key, which holds the activations'
    /// metadata, so a call on matching arguments need not compare them again.
    pub(crate) activations_fit: bool,
    /// Positions of device tensor arguments the chosen provider takes as compact copies made on
    /// their device (its predicate rejects their layouts; see `dispatch::compacting`); empty for
    /// most selections.
    pub(crate) compacted: SmallVec<[usize; 2]>,
    /// What this thread already said of this selection (the op's own once-per-reason check takes
    /// a lock; this spares a repeated call that lock).
    pub(crate) said: Said,
}

/// The warnings a selection's calls give, once each per op and reason.
#[derive(Default)]
pub(crate) struct Said {
    /// That native runs past the providers listed before it.
    pub(crate) fallback: Cell<bool>,
    /// That native runs on device tensors (a host round trip).
    pub(crate) round_trip: Cell<bool>,
}

/// An owned argument metadata, compared against a call's [`ArgMeta`] as a meta function sees it.
type KeyArg = Arg<TensorMeta, Box<str>, Box<[i64]>>;

/// Whether a remembered key is this argument ([`Arg::same_as`], compared in place: this runs for
/// every argument of every call).
#[inline]
fn key_matches(key: &KeyArg, arg: &ArgMeta<'_>) -> bool {
    match (key, arg) {
        (Arg::Tensor(key), Arg::Tensor(meta)) => key == *meta,
        (Arg::F64(key), Arg::F64(value)) => key.to_bits() == value.to_bits(),
        (Arg::I64(key), Arg::I64(value)) => key == value,
        (Arg::Bool(key), Arg::Bool(value)) => key == value,
        (Arg::Str(key), Arg::Str(value)) => **key == **value,
        (Arg::DType(key), Arg::DType(value)) => key == value,
        (Arg::Ints(key), Arg::Ints(value)) => **key == **value,
        (Arg::None, Arg::None) => true,
        _ => false,
    }
}

impl Choice {
    /// A selection made for `args`; `activations` are the op's activation positions.
    pub(crate) fn new(
        args: &[ArgMeta<'_>],
        activations: &[usize],
        chosen: Arc<ImplEntry>,
        outputs: OutputMetas,
        rejected: SmallVec<[(Arc<ImplEntry>, Arc<str>); 2]>,
        from_priority_list: bool,
    ) -> Choice {
        let activations_fit = activations_fit(args, activations, &outputs);
        let key = args.iter().map(|arg| arg.map(TensorMeta::clone, Box::from, Box::from)).collect();
        Choice {
            key,
            chosen,
            outputs,
            rejected,
            from_priority_list,
            activations_fit,
            compacted: SmallVec::new(),
            said: Said::default(),
        }
    }

    /// The same selection, its provider taking compact copies of the tensors at `positions`.
    pub(crate) fn compacting(self, positions: SmallVec<[usize; 2]>) -> Choice {
        Choice { compacted: positions, ..self }
    }

    #[inline]
    fn matches(&self, args: &[ArgMeta<'_>]) -> bool {
        self.key.len() == args.len() && self.key.iter().zip(args).all(|(key, arg)| key_matches(key, arg))
    }
}

/// Whether output i has the dtype, device and shape of the i-th activation given in `args` (an
/// absent optional activation, `none`, has no output and is skipped).
fn activations_fit(args: &[ArgMeta<'_>], activations: &[usize], outputs: &[TensorMeta]) -> bool {
    let given = activations.iter().filter_map(|&position| args.get(position).and_then(ArgMeta::tensor));
    given.zip(outputs).all(|(activation, output)| output.same_kind_and_shape(activation))
}

/// What a selection is remembered under, apart from the argument metadata.
#[derive(Clone, Copy)]
pub(crate) struct Key<'a> {
    /// The registry's identity.
    pub(crate) registry: u64,
    /// The op.
    pub(crate) def: &'static OpDef,
    /// The provider the call names, or `None` for the installed priorities.
    pub(crate) provider: Option<&'a str>,
    /// The registry's generation, read before anything the selection depends on.
    pub(crate) generation: u64,
}

/// A remembered selection.
pub(crate) struct Entry {
    registry: u64,
    def: *const OpDef,
    provider: Option<&'static str>,
    generation: u64,
    /// The op's entry (its counters and warnings).
    pub(crate) entry: Arc<OpEntry>,
    /// The selection.
    pub(crate) choice: Choice,
}

impl Entry {
    /// A selection made now under `key` (whose provider, if any, is the chosen one's name).
    pub(crate) fn new(key: Key<'_>, entry: Arc<OpEntry>, choice: Choice) -> Entry {
        let provider = key.provider.map(|_| choice.chosen.provider);
        Entry { registry: key.registry, def: key.def, provider, generation: key.generation, entry, choice }
    }

    /// Whether this entry is `key`'s, current or stale.
    #[inline]
    fn same_call(&self, registry: u64, def: *const OpDef, provider: Option<&str>) -> bool {
        std::ptr::eq(self.def, def) && self.registry == registry && self.provider == provider
    }
}

/// One set: its entries and the way the next eviction takes.
struct Set {
    ways: RefCell<[Option<Rc<Entry>>; WAYS]>,
    next: Cell<usize>,
}

/// This thread's table. A set's entries are borrowed only inside [`take`] and [`remember`], which
/// run no code of anyone else's while they hold the borrow (an evicted entry is dropped after it
/// ends), so the borrow never fails.
struct Table {
    sets: [Set; SETS],
}

thread_local! {
    static TABLE: Table = const {
        Table { sets: [const { Set { ways: RefCell::new([const { None }; WAYS]), next: Cell::new(0) } }; SETS] }
    };
}

/// The set of an op's entries: from its definition's address (definitions are statics).
#[inline]
fn set_of(def: *const OpDef) -> usize {
    // Fibonacci hashing: the top bits of the product spread nearby addresses over the sets.
    ((def.addr() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SETS.trailing_zeros())) as usize
}

/// This thread's current entry for the call, if it remembers one.
#[inline]
pub(crate) fn take(key: Key<'_>, metas: &[ArgMeta<'_>]) -> Option<Held> {
    let def: *const OpDef = key.def;
    TABLE
        .try_with(|table| {
            let ways = table.sets[set_of(def)].ways.borrow();
            let entry = ways.iter().flatten().find(|entry| {
                entry.generation == key.generation
                    && entry.same_call(key.registry, def, key.provider)
                    && entry.choice.matches(metas)
            })?;
            Some(Held { entry: Rc::clone(entry), made: false })
        })
        .ok()
        .flatten()
}

/// Remembers a selection made now: in the way of a stale entry for the same call, else in a free
/// way, else in the set's next one round robin.
fn remember(entry: Rc<Entry>) {
    let evicted = TABLE.try_with(|table| {
        let set = &table.sets[set_of(entry.def)];
        let mut ways = set.ways.borrow_mut();
        let stale = ways.iter().position(|way| {
            way.as_ref().is_some_and(|old| {
                old.same_call(entry.registry, entry.def, entry.provider) && old.generation != entry.generation
            })
        });
        let index = stale.or_else(|| ways.iter().position(Option::is_none)).unwrap_or_else(|| {
            let oldest = set.next.get();
            set.next.set((oldest + 1) % WAYS);
            oldest
        });
        ways[index].replace(entry)
    });
    // An evicted entry (and the table's answer when the thread is ending) is dropped here, after
    // the borrow ended: dropping it may run anyone's code.
    drop(evicted);
}

/// A selection held by one call: a handle to the entry (small, so the call moves no selection
/// around), lent from this thread's table or made now.
pub(crate) struct Held {
    entry: Rc<Entry>,
    /// Made now: into the table when the call is done.
    made: bool,
}

impl Held {
    /// A selection made now; remembered when the call is done.
    pub(crate) fn made(entry: Entry) -> Held {
        Held { entry: Rc::new(entry), made: true }
    }

    /// The selection.
    #[inline]
    pub(crate) fn entry(&self) -> &Entry {
        &self.entry
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        if self.made {
            self::remember(Rc::clone(&self.entry));
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

    #[test]
    fn sets_spread_nearby_definitions() {
        // Definitions are statics a few hundred bytes apart: eight of them reach several sets.
        let base = 0x5555_0000_usize;
        let sets: std::collections::HashSet<usize> =
            (0..8).map(|i| set_of(std::ptr::without_provenance(base + i * 256))).collect();
        assert!(sets.len() >= 4, "eight neighbouring definitions share {} sets", sets.len());
        assert!((0..64).all(|i| set_of(std::ptr::without_provenance(base + i * 8)) < SETS));
    }
}
