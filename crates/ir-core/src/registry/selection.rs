//! The installed priority list as dispatch reads it, with its selection cache.
//!
//! Dispatch reads an op's installed list without a lock: the list is an immutable snapshot swapped
//! whole ([`arc_swap`]) whenever priorities change (install, guard drop, registration, replacement).
//! Each snapshot carries a small cache of the selections made on it, keyed by the call's complete
//! argument metadata: predicates are pure functions of that metadata and meta functions are
//! plain functions of it, so the same metadata always selects the same provider with the same output
//! metadata. A new snapshot starts with an empty cache, so a priority change is seen by the next call.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwapOption;
use smallvec::SmallVec;

use crate::TensorMeta;
use crate::op::{Arg, ArgMeta, OutputMetas};
use crate::registry::ImplEntry;
use crate::registry::priority::Resolved;

/// How many distinct argument-metadata keys one installed list remembers (a decoder's norms see one
/// or two per step: the batch's shape, the same in every layer).
const CACHE_SLOTS: usize = 4;

/// An installed, resolved priority list and the selections made on it.
pub(crate) struct Installed {
    /// The resolved providers, in priority order.
    pub(crate) list: Resolved,
    cache: [ArcSwapOption<Cached>; CACHE_SLOTS],
    /// The slot the next miss fills (round robin).
    next_slot: AtomicUsize,
}

/// One remembered selection.
pub(crate) struct Cached {
    key: SmallVec<[KeyArg; crate::op::INLINE_ARGS]>,
    /// The chosen provider.
    pub(crate) chosen: Arc<ImplEntry>,
    /// The meta function's output metadata.
    pub(crate) outputs: OutputMetas,
    /// The providers rejected before the chosen one, with their reasons.
    pub(crate) rejected: SmallVec<[(Arc<ImplEntry>, Arc<str>); 2]>,
    /// Whether a priority list was installed (otherwise native was chosen by default).
    pub(crate) from_priority_list: bool,
    /// Whether each output an in-place implementation writes into a given activation has that
    /// activation's dtype, device and shape: decided once from the key, which holds the activations'
    /// metadata, so a call on matching arguments need not compare them again.
    pub(crate) activations_fit: bool,
    /// Positions of device tensor arguments the chosen provider takes as compact copies made on
    /// their device (its predicate rejects their layouts; see `dispatch::compacting`); empty for
    /// most selections.
    pub(crate) compacted: SmallVec<[usize; 2]>,
}

/// An owned argument metadata, compared against a call's [`ArgMeta`] as a meta function sees it
/// (floats by bits: `-0.0` and each NaN are their own keys).
type KeyArg = Arg<TensorMeta, Box<str>, Box<[i64]>>;

/// The key of one argument.
fn key_of(arg: &ArgMeta<'_>) -> KeyArg {
    arg.map(TensorMeta::clone, Box::from, Box::from)
}

/// Whether a remembered key is this argument ([`Arg::same_as`], compared in place: this runs for
/// every argument of every call that misses the thread's memo).
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

impl Cached {
    /// A selection to remember for `args`.
    /// `activations` are the op's activation positions.
    pub(crate) fn new(
        args: &[ArgMeta<'_>],
        activations: &[usize],
        chosen: Arc<ImplEntry>,
        outputs: OutputMetas,
        rejected: SmallVec<[(Arc<ImplEntry>, Arc<str>); 2]>,
    ) -> Cached {
        let activations_fit = activations_fit(args, activations, &outputs);
        let key = args.iter().map(key_of).collect();
        Cached { key, chosen, outputs, rejected, from_priority_list: true, activations_fit, compacted: SmallVec::new() }
    }

    /// The same selection, its provider taking compact copies of the tensors at `positions`.
    pub(crate) fn compacting(self, positions: SmallVec<[usize; 2]>) -> Cached {
        Cached { compacted: positions, ..self }
    }

    /// Native, chosen because nothing is installed (never remembered).
    pub(crate) fn unkeyed(
        args: &[ArgMeta<'_>],
        activations: &[usize],
        native: Arc<ImplEntry>,
        outputs: OutputMetas,
    ) -> Cached {
        let activations_fit = activations_fit(args, activations, &outputs);
        Cached {
            key: SmallVec::new(),
            chosen: native,
            outputs,
            rejected: SmallVec::new(),
            from_priority_list: false,
            activations_fit,
            compacted: SmallVec::new(),
        }
    }

    #[inline]
    pub(crate) fn matches(&self, args: &[ArgMeta<'_>]) -> bool {
        self.key.len() == args.len() && self.key.iter().zip(args).all(|(key, arg)| key_matches(key, arg))
    }
}

/// Whether output i has the dtype, device and shape of the i-th activation given in `args` (an
/// absent optional activation, `none`, has no output and is skipped).
fn activations_fit(args: &[ArgMeta<'_>], activations: &[usize], outputs: &[TensorMeta]) -> bool {
    let given = activations.iter().filter_map(|&position| args.get(position).and_then(ArgMeta::tensor));
    given.zip(outputs).all(|(activation, output)| output.same_kind_and_shape(activation))
}

impl Installed {
    /// A snapshot of `list` with an empty cache.
    pub(crate) fn new(list: Resolved) -> Installed {
        Installed { list, cache: Default::default(), next_slot: AtomicUsize::new(0) }
    }

    /// The selection remembered for exactly these argument metadata, if any. Takes no lock and
    /// allocates nothing.
    pub(crate) fn cached(&self, args: &[ArgMeta<'_>]) -> Option<arc_swap::Guard<Option<Arc<Cached>>>> {
        self.cache.iter().map(ArcSwapOption::load).find(|slot| slot.as_ref().is_some_and(|cached| cached.matches(args)))
    }

    /// Remembers a selection, replacing the oldest one.
    pub(crate) fn remember(&self, cached: Arc<Cached>) {
        let slot = self.next_slot.fetch_add(1, Ordering::Relaxed) % CACHE_SLOTS;
        self.cache[slot].store(Some(cached));
    }
}
