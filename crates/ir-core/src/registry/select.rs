//! Selection: which implementation runs a call, by the installed priorities or a named provider,
//! decided on the arguments' metadata and remembered per thread ([`cache`]). The eager calls, the
//! graph interpreter and lowering ([`Registry::select`]) all select here; every call then runs
//! through `dispatch`.
//!
//! Every selection runs the op's meta function first, so every provider receives validated
//! arguments.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use crate::op::{ArgMeta, OpDef, bind_meta};
use crate::registry::cache::{self, Choice};
use crate::registry::{CallError, ImplEntry, NATIVE, OpEntry, OpMap, Registry, lock, read};
use crate::{Support, TensorMeta};

/// Argument metadata of one call, inline for every op's parameter count (no allocation per call).
pub(crate) type ArgMetas<'a> = SmallVec<[ArgMeta<'a>; crate::op::INLINE_ARGS]>;

/// A provider the dispatcher skipped, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// The provider.
    pub provider: &'static str,
    /// Its predicate's reason.
    pub reason: Cow<'static, str>,
}

/// The outcome of selection on metadata (what lowering records).
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    /// The chosen provider.
    pub provider: &'static str,
    /// Whether it writes its outputs into the activations.
    pub inplace: bool,
    /// Providers tried before it, with reasons.
    pub rejected: Vec<Rejection>,
    /// Output metadata from the meta function.
    pub outputs: Vec<TensorMeta>,
    /// Whether a priority list was installed (otherwise native was chosen by default).
    pub from_priority_list: bool,
    /// Positions of device tensor arguments whose layouts the provider's predicate rejects: a call
    /// gives it compact copies made on their device, and puts the results back in the declared
    /// layouts (in-place outputs into the original activations), so the call stays on the device
    /// instead of falling back to native. Usually empty.
    pub compacted: Vec<usize>,
}

/// Names the op of a [`Call`](crate::Call): its definition (what code holds), or its name
/// (what a graph's text or a configuration holds).
#[derive(Clone, Copy, Debug)]
pub enum OpRef<'a> {
    /// The definition; it must be the one registered under its name.
    Def(&'static OpDef),
    /// The name the op is registered under.
    Name(&'a str),
}

impl From<&'static OpDef> for OpRef<'_> {
    fn from(def: &'static OpDef) -> Self {
        OpRef::Def(def)
    }
}

impl<'a> From<&'a str> for OpRef<'a> {
    fn from(name: &'a str) -> Self {
        OpRef::Name(name)
    }
}

impl Registry {
    /// Validates argument metadata and selects a provider with the installed priorities, without
    /// running anything (lowering uses this; eager calls follow the same rules and share the
    /// selection cache).
    pub fn select(&self, op: &str, args: &[ArgMeta<'_>]) -> Result<Selection, CallError> {
        let def = self.call_def(op)?;
        let args = bind_meta(def, args.to_vec())?;
        let held = self.hold(def, None, &args)?;
        let choice = &held.entry().choice;
        if choice.chosen.provider == NATIVE && !choice.rejected.is_empty() && self.is_strict() {
            return Err(CallError::NativeFallback {
                op: def.name,
                rejected: DisplayRejections(&choice.rejected).to_string(),
            });
        }
        Ok(Selection {
            provider: choice.chosen.provider,
            inplace: choice.chosen.inplace,
            rejected: choice
                .rejected
                .iter()
                .map(|(provider, reason)| Rejection {
                    provider: provider.provider,
                    reason: Cow::Owned(reason.to_string()),
                })
                .collect(),
            outputs: choice.outputs.to_vec(),
            from_priority_list: choice.from_priority_list,
            compacted: choice.compacted.to_vec(),
        })
    }

    /// The selection for a call of `def` on `metas` (by the installed priorities, or of the named
    /// `provider`), held while the call runs: this thread's remembered one when current (logged as a
    /// selection is), else one made now from the op table, which the cache keeps when the call is
    /// done ([`cache::Held`]).
    #[inline(always)]
    pub(crate) fn hold(
        &self,
        def: &'static OpDef,
        provider: Option<&str>,
        metas: &[ArgMeta<'_>],
    ) -> Result<cache::Held, CallError> {
        // Read before the op table and the installed list (see `cache`).
        let key = cache::Key {
            registry: self.shared.generation.registry(),
            def,
            provider,
            generation: self.shared.generation.current(),
        };
        if let Some(held) = cache::take(key, metas) {
            let choice = &held.entry().choice;
            log_choice(def.name, &choice.chosen, &choice.rejected, metas);
            return Ok(held);
        }
        let entry = self.with_ops(|ops| declared_entry(ops, def).map(Arc::clone))?;
        let choice = match provider {
            None => choose(&entry, metas)?,
            Some(provider) => named(&entry, provider, metas)?,
        };
        Ok(cache::Held::made(cache::Entry::new(key, entry, choice)))
    }

    /// The definition of the op named `op`, read from the op table without taking a reference.
    pub(crate) fn call_def(&self, op: &str) -> Result<&'static OpDef, CallError> {
        self.with_ops(|ops| match ops.get(op) {
            Some(entry) => Ok(entry.def),
            None => {
                Err(CallError::UnknownOp { op: op.to_owned(), known: ops.keys().map(|k| (*k).to_owned()).collect() })
            }
        })
    }

    pub(crate) fn call_entry(&self, op: &str) -> Result<Arc<OpEntry>, CallError> {
        self.entry(op).map_err(|known| CallError::UnknownOp { op: op.to_owned(), known })
    }
}

/// The entry of the op `def` (defined under its name as this definition).
fn declared_entry<'a>(ops: &'a OpMap, def: &'static OpDef) -> Result<&'a Arc<OpEntry>, CallError> {
    ops.get(def.name).filter(|entry| std::ptr::eq(entry.def, def)).ok_or_else(|| CallError::UnknownOp {
        op: def.name.to_owned(),
        known: ops.keys().map(|s| (*s).to_owned()).collect(),
    })
}

/// Whether any tensor argument lives on a device.
#[inline]
pub(crate) fn on_device(metas: &[ArgMeta<'_>]) -> bool {
    metas.iter().any(|m| m.tensor().is_some_and(|t| !t.device.is_cpu()))
}

/// Whether one of `candidates` (in order) takes the call when the non-compact device tensors among
/// `args` are made compact on their device: the first such candidate's index and the positions to
/// compact. `None` when no argument is a non-compact device tensor or no candidate takes them.
fn compacting(args: &[ArgMeta<'_>], candidates: &[Arc<ImplEntry>]) -> Option<(usize, SmallVec<[usize; 2]>)> {
    let mut positions = SmallVec::<[usize; 2]>::new();
    let mut compact = SmallVec::<[TensorMeta; 2]>::new();
    for (position, arg) in args.iter().enumerate() {
        if let Some(t) = arg.tensor()
            && !t.device.is_cpu()
            && !t.layout.is_compact()
        {
            positions.push(position);
            compact.push(t.compact_like());
        }
    }
    if positions.is_empty() {
        return None;
    }
    let adapted: ArgMetas<'_> = args
        .iter()
        .enumerate()
        .map(|(i, arg)| match positions.iter().position(|&p| p == i) {
            Some(k) => ArgMeta::Tensor(&compact[k]),
            None => *arg,
        })
        .collect();
    let index = candidates.iter().position(|candidate| {
        candidate.provider != NATIVE && candidate.is_available() && candidate.check_supports(&adapted) == Support::Yes
    })?;
    Some((index, positions))
}

/// Chooses the first installed provider whose predicate accepts the arguments (native when nothing
/// is installed) and runs the meta function. Notes each rejected provider's reason in the record.
fn choose(entry: &OpEntry, args: &[ArgMeta<'_>]) -> Result<Choice, CallError> {
    let op = entry.def.name;
    // The installed list is a snapshot: predicates (user code) run with no registry lock held and
    // may themselves edit priorities, which publishes a new snapshot for the next call.
    let installed = entry.installed.load_full();
    let Some(installed) = installed else {
        let impls = read(&entry.impls).clone();
        if !entry.logged_no_priority.swap(true, Ordering::Relaxed) {
            let others = impls.len() - 1;
            tracing::warn!(
                target: "ir_core::dispatch",
                op,
                "priority not set for op {op}, using native ({others} other provider(s) registered); install the \
                 platform's priorities with `PriorityConfig::detected().apply(&registry)` (or build the registry \
                 with the `vllm-ir` crate's `registry()`)"
            );
        }
        let outputs = (entry.def.meta)(entry.def, args)?;
        let native = Arc::clone(&impls[0]);
        log_choice(op, &native, &[], args);
        return Ok(Choice::new(args, &entry.activations, native, outputs, SmallVec::new(), false));
    };
    let outputs = (entry.def.meta)(entry.def, args)?;
    let mut rejected: SmallVec<[(Arc<ImplEntry>, Arc<str>); 2]> = SmallVec::new();
    for candidate in installed.iter() {
        // An unavailable provider listed here is skipped as a rejection: falling past it to
        // native is a fallback like any other.
        if let crate::Availability::Unavailable(reason) = candidate.availability() {
            rejected.push((Arc::clone(candidate), Arc::<str>::from(format!("unavailable: {reason}"))));
            continue;
        }
        match candidate.check_supports(args) {
            Support::Yes => {
                // Rather than native on device tensors (a host round trip), a provider before it
                // that takes compact copies of the arguments whose layouts it rejects.
                if candidate.provider == NATIVE
                    && on_device(args)
                    && let Some((index, positions)) =
                        compacting(args, &rejected.iter().map(|(p, _)| Arc::clone(p)).collect::<Vec<_>>())
                {
                    let chosen = Arc::clone(&rejected[index].0);
                    rejected.truncate(index);
                    log_choice(op, &chosen, &rejected, args);
                    note_rejections(&rejected);
                    let choice = Choice::new(args, &entry.activations, chosen, outputs, rejected, true);
                    return Ok(choice.compacting(positions));
                }
                log_choice(op, candidate, &rejected, args);
                note_rejections(&rejected);
                return Ok(Choice::new(args, &entry.activations, Arc::clone(candidate), outputs, rejected, true));
            }
            Support::No(reason) => rejected.push((Arc::clone(candidate), Arc::<str>::from(reason.as_ref()))),
        }
    }
    Err(CallError::DispatchExhausted { op })
}

/// The selection of the named `provider` (a lowered graph's `impl` node): it must be registered,
/// available and take the arguments, or take compact copies of the device tensors among them whose
/// layouts it rejects (as a graph lowered to it on such copies runs it).
fn named(entry: &OpEntry, provider: &str, args: &[ArgMeta<'_>]) -> Result<Choice, CallError> {
    let op = entry.def.name;
    // One read of the implementation list, dropped at the end of the statement, before any user
    // code (probe, predicate) runs: see the lock order in the module documentation.
    let found = read(&entry.impls).iter().find(|i| i.provider == provider).cloned();
    let Some(implementation) = found else {
        return Err(CallError::UnknownProvider {
            op,
            provider: provider.to_owned(),
            known: read(&entry.impls).iter().map(|i| i.provider.to_owned()).collect(),
        });
    };
    if let crate::Availability::Unavailable(reason) = implementation.availability() {
        return Err(CallError::ProviderUnavailable { op, provider: provider.to_owned(), reason: reason.clone() });
    }
    let outputs = (entry.def.meta)(entry.def, args)?;
    let compacted = match implementation.check_supports(args) {
        Support::Yes => SmallVec::new(),
        Support::No(reason) => match compacting(args, std::slice::from_ref(&implementation)) {
            Some((_, positions)) => positions,
            None => {
                return Err(CallError::Unsupported { op, provider: provider.to_owned(), reason: reason.into_owned() });
            }
        },
    };
    log_choice(op, &implementation, &[], args);
    Ok(Choice::new(args, &entry.activations, implementation, outputs, SmallVec::new(), false).compacting(compacted))
}

fn log_choice(op: &'static str, chosen: &ImplEntry, rejected: &[(Arc<ImplEntry>, Arc<str>)], args: &[ArgMeta<'_>]) {
    tracing::debug!(
        target: "ir_core::dispatch",
        op,
        provider = chosen.provider,
        inplace = chosen.inplace,
        rejected = %DisplayRejections(rejected),
        args = %DisplayArgs(args),
        "selected {} for {op}",
        chosen.provider
    );
}

pub(crate) struct DisplayRejections<'a>(pub(crate) &'a [(Arc<ImplEntry>, Arc<str>)]);

impl fmt::Display for DisplayRejections<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, (provider, reason)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}: {reason}", provider.provider)?;
        }
        f.write_str("]")
    }
}

struct DisplayArgs<'a, 'm>(&'a [ArgMeta<'m>]);

impl fmt::Display for DisplayArgs<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("(")?;
        for (i, arg) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{arg}")?;
        }
        f.write_str(")")
    }
}

/// Stores the last rejection reason of each rejected provider (for the selection record): a reference
/// count and an uncontended leaf lock per rejection, no allocation.
fn note_rejections(rejected: &[(Arc<ImplEntry>, Arc<str>)]) {
    for (provider, reason) in rejected {
        *lock(&provider.last_rejection) = Some(Arc::clone(reason));
    }
}
