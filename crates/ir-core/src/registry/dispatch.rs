//! Dispatch and the eager call paths: the functional call and `maybe_inplace`.
//!
//! Every call runs the op's meta function first, so every provider receives validated arguments.
//! The selection rules are the same in eager calls and in lowering ([`Registry::select`]).

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use crate::op::declare::OpOutputs;
use crate::op::{
    ArgMeta, BindError, INLINE_ARGS, INLINE_OUTPUTS, MetaError, OpDef, Outputs, Overload, Value, bind, bind_meta,
};
use crate::registry::cache::{self, Choice};
use crate::registry::{ImplEntry, NATIVE, OpEntry, OpMap, Registry, lock, read};
use crate::{KernelError, Support, Tensor, TensorError, TensorMeta};

/// Errors of calls and dispatch. Validation happens before any write: an error leaves every
/// caller-visible tensor untouched.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    // --- the call itself ---
    /// The op is not defined in this registry.
    #[error("unknown op `{op}` (known: {})", known.join(", "))]
    UnknownOp {
        /// The op.
        op: String,
        /// Ops the registry defines.
        known: Vec<String>,
    },
    /// `maybe_inplace` on an op without `allow_inplace`.
    #[error("op `{op}` does not allow inplace, so it has no maybe_inplace form")]
    NotInplaceOp {
        /// The op.
        op: &'static str,
    },
    /// Arguments that do not fit the parameters.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// Arguments the meta function rejects (shapes, dtypes, devices, ranges).
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// A built-in called with arguments of the wrong number or kinds.
    #[error("built-in `{builtin}`: {reason}")]
    BuiltinArgs {
        /// The built-in.
        builtin: &'static str,
        /// What does not fit.
        reason: String,
    },

    // --- provider selection ---
    /// A provider forced by name does not support the arguments.
    #[error("provider `{provider}` does not support these arguments of `{op}`: {reason}")]
    Unsupported {
        /// The op.
        op: &'static str,
        /// The provider.
        provider: String,
        /// The predicate's reason.
        reason: String,
    },
    /// A provider forced by name cannot run here.
    #[error("provider `{provider}` of `{op}` is unavailable: {reason}")]
    ProviderUnavailable {
        /// The op.
        op: &'static str,
        /// The provider.
        provider: String,
        /// The probe's reason.
        reason: String,
    },
    /// A provider name not registered for the op.
    #[error("unknown provider `{provider}` for op `{op}` (known: {})", known.join(", "))]
    UnknownProvider {
        /// The op.
        op: &'static str,
        /// The provider.
        provider: String,
        /// Providers registered for the op.
        known: Vec<String>,
    },
    /// No installed provider supports the arguments (cannot happen with lists built by resolution).
    #[error("internal error: no provider in the installed list of `{op}` supports these arguments")]
    DispatchExhausted {
        /// The op.
        op: &'static str,
    },

    // --- the implementation's contract ---
    /// An in-place implementation was chosen for outputs that cannot live in the activations.
    #[error(
        "inplace provider `{provider}` of `{op}` was chosen, but output {index} ({output}) cannot be written into \
         activation {index} ({activation}); its predicate must reject such arguments"
    )]
    InplaceMetaMismatch {
        /// The op.
        op: &'static str,
        /// The provider.
        provider: &'static str,
        /// Output (and activation) index.
        index: usize,
        /// Declared output metadata.
        output: Box<TensorMeta>,
        /// The activation's metadata.
        activation: Box<TensorMeta>,
    },
    /// A donated activation an in-place implementation would write maps several elements to one
    /// address (a broadcast view): a caller error.
    #[error(
        "op `{op}`: donated activation {index} ({activation}) maps several elements to one address (a broadcast \
         view?), so an in-place write would keep only one value per address; donate a contiguous copy"
    )]
    OverlappingActivation {
        /// The op.
        op: &'static str,
        /// Activation index.
        index: usize,
        /// The activation's metadata.
        activation: Box<TensorMeta>,
    },
    /// An implementation returned outputs other than declared.
    #[error("provider `{provider}` of `{op}` broke its contract: {problem}")]
    ContractViolation {
        /// The op.
        op: &'static str,
        /// The provider.
        provider: &'static str,
        /// What was wrong.
        problem: String,
    },
    /// The implementation failed.
    #[error("provider `{provider}` failed on `{op}`: {source}")]
    Kernel {
        /// The op.
        op: &'static str,
        /// The provider.
        provider: &'static str,
        /// The kernel's error.
        source: KernelError,
    },
    /// Native would run on device tensors, a host round trip, which this process refuses
    /// ([`refuse_host_round_trips`](crate::storage::refuse_host_round_trips)).
    #[error(
        "op `{op}`: no provider runs these device tensors on the device ({rejected}); native would move them \
         through host memory, which is refused (ir_core::storage::refuse_host_round_trips)"
    )]
    HostRoundTripRefused {
        /// The op.
        op: &'static str,
        /// Each provider tried before native, with its reason.
        rejected: String,
    },
    /// Every provider listed before `native` rejected the call, and the registry is strict
    /// ([`Registry::set_strict`]).
    #[error(
        "op `{op}`: the providers listed before native rejected the call {rejected}; native would run instead (correct, slow), which this strict registry refuses. Give \
         the arguments a form a provider takes, register a provider that takes them, or list `native` first in the \
         op's priorities to choose it knowingly"
    )]
    NativeFallback {
        /// The op.
        op: &'static str,
        /// Each provider tried before native, with its reason.
        rejected: String,
    },
    /// A copy made by the call path failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// Argument metadata of one call, inline for every op's parameter count (no allocation per call).
type ArgMetas<'a> = SmallVec<[ArgMeta<'a>; INLINE_ARGS]>;
/// Argument positions or storages of one call's activations, inline.
type PerOutput<T> = SmallVec<[T; INLINE_OUTPUTS]>;

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

/// Names the op of a dynamic [`Registry::call`]: its definition (what code holds), or its name
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
    /// The dynamic call: binds the positional `args` (filling trailing defaults), validates them,
    /// selects a provider and runs it; with [`Overload::MaybeInplace`] the activations in `args` are
    /// donated. The functions [`define_op!`](crate::define_op) generates are the typed form of this
    /// call: the same rules, selection cache and records.
    pub fn call<'a>(
        &self,
        op: impl Into<OpRef<'a>>,
        overload: Overload,
        args: Vec<Value>,
    ) -> Result<Vec<Tensor>, CallError> {
        let def = match op.into() {
            OpRef::Def(def) => def,
            OpRef::Name(name) => self.call_def(name)?,
        };
        let mut args = bind(def, args)?;
        Ok(self.call_op(def, &mut args, overload)?.into_vec())
    }

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

    /// Calls one named implementation directly (a graph's `impl` node): binds and validates the
    /// arguments, and fails if the provider is unavailable or its predicate rejects them. An in-place
    /// implementation writes into the activations given, which must be uniquely owned.
    pub fn call_implementation(&self, op: &str, provider: &str, args: Vec<Value>) -> Result<Vec<Tensor>, CallError> {
        let def = self.call_def(op)?;
        let mut args = bind(def, args)?;
        let (held, on_device) = {
            let metas: ArgMetas<'_> = args.iter().map(Value::meta).collect();
            (self.hold(def, Some(provider), &metas)?, on_device(&metas))
        };
        let (entry, choice) = (&held.entry().entry, &held.entry().choice);
        let implementation = &choice.chosen;
        if on_device && implementation.provider == NATIVE {
            native_on_device(entry, choice)?;
        }
        let mut written = PerOutput::new();
        if implementation.inplace {
            for position in given_activations(entry, &args) {
                let tensor = args[position].as_tensor().expect("given activations are tensors");
                if !tensor.is_uniquely_owned() {
                    return Err(CallError::Tensor(tensor.write_refusal()));
                }
                written.push(tensor.storage_id());
            }
        }
        let outputs = run_compacted(entry, implementation, &mut args, &choice.compacted, &choice.outputs)?;
        check_outputs(def, implementation, &choice.outputs, &outputs, &written)?;
        Ok(outputs.into_vec())
    }

    /// `provider`'s implementation of `op` as registered, to call without dispatch
    /// ([`ImplFunc::invoke`](crate::ImplFunc::invoke)); fails if the op or provider is unknown or the
    /// provider is unavailable here.
    pub fn implementation(&self, op: &str, provider: &str) -> Result<crate::ImplFunc, CallError> {
        let entry = self.call_entry(op)?;
        let impls = read(&entry.impls).clone();
        let Some(implementation) = impls.iter().find(|i| i.provider == provider) else {
            return Err(CallError::UnknownProvider {
                op: entry.def.name,
                provider: provider.to_owned(),
                known: impls.iter().map(|i| i.provider.to_owned()).collect(),
            });
        };
        if let crate::Availability::Unavailable(reason) = implementation.availability() {
            return Err(CallError::ProviderUnavailable {
                op: entry.def.name,
                provider: provider.to_owned(),
                reason: reason.clone(),
            });
        }
        Ok(crate::ImplFunc {
            inplace: implementation.inplace,
            call: Arc::clone(&implementation.call),
            typed: implementation.typed.clone(),
        })
    }

    /// What `provider`'s `supports` predicate says of `op` called with `args` (`None` if the
    /// provider is not registered for the op): for a pass that changes the arguments of a call
    /// already lowered to the provider.
    pub fn implementation_supports(&self, op: &str, provider: &str, args: &[ArgMeta<'_>]) -> Option<Support> {
        let entry = self.entry(op).ok()?;
        // The list's read lock is released before the predicate (user code) runs.
        let found = read(&entry.impls).iter().find(|i| i.provider == provider).cloned()?;
        Some(found.check_supports(args))
    }

    /// Whether `provider`'s implementation of `op` is in place (`None` if not registered).
    pub fn is_inplace(&self, op: &str, provider: &str) -> Option<bool> {
        let entry = self.entry(op).ok()?;
        read(&entry.impls).iter().find(|i| i.provider == provider).map(|i| i.inplace)
    }

    /// The typed functional path of the calls [`define_op!`](crate::define_op) generates: selects on
    /// `metas` (the metadata of the caller's borrowed arguments, every parameter in order) with the
    /// same rules, cache and records as every call. When the chosen implementation is functional and
    /// was registered with its typed function `Arc<F>`
    /// ([`ImplFunc::with_typed`](crate::ImplFunc::with_typed)), runs it through `call` on the
    /// borrowed arguments (no argument values are built) and checks its outputs; otherwise (an
    /// in-place implementation, native, one registered dynamically) builds the bound arguments with
    /// `values` and runs the selection as the calls `define_op!` generates do.
    ///
    /// Support for `define_op!`'s generated functions, hidden from the documentation: code calls
    /// the generated typed functions or [`Registry::call`].
    #[doc(hidden)]
    pub fn call_typed<F: ?Sized + 'static, O: OpOutputs, A: AsMut<[Value]>>(
        &self,
        def: &'static OpDef,
        metas: &[ArgMeta<'_>],
        call: impl FnOnce(&F) -> Result<O, KernelError>,
        values: impl FnOnce() -> A,
    ) -> Result<O, CallError> {
        debug_assert_eq!(metas.len(), def.params.len(), "declared calls pass every parameter");
        let held = self.hold(def, None, metas)?;
        run_typed(&held.entry().entry, &held.entry().choice, metas, call, values)
    }

    /// Selects for a typed `maybe_inplace` call of `def` on `metas` (the metadata of the caller's
    /// arguments, every parameter in order) with the same rules, cache and records as every
    /// call, and holds the selection while the call runs ([`Selected`]). The calls
    /// [`define_op!`](crate::define_op) generates use it; the selection is recorded as run.
    ///
    /// Support for `define_op!`'s generated functions, hidden from the documentation.
    #[doc(hidden)]
    #[inline]
    pub fn select_declared(&self, def: &'static OpDef, metas: &[ArgMeta<'_>]) -> Result<Selected<'_>, CallError> {
        if !def.allow_inplace {
            return Err(CallError::NotInplaceOp { op: def.name });
        }
        let held = self.hold(def, None, metas)?;
        record(&held.entry().entry, &held.entry().choice, on_device(metas))?;
        Ok(Selected {
            held,
            written: RefCell::new(PerOutput::new()),
            in_place: std::cell::Cell::new(0),
            _registry: self,
        })
    }

    /// The typed entry points' path: `args` is already complete. Reads the op table without a lock
    /// and keeps no reference count on the entry.
    fn call_op(&self, def: &'static OpDef, args: &mut [Value], overload: Overload) -> Result<Outputs, CallError> {
        if overload == Overload::MaybeInplace && !def.allow_inplace {
            return Err(CallError::NotInplaceOp { op: def.name });
        }
        let (held, on_device) = {
            let metas: ArgMetas<'_> = args.iter().map(Value::meta).collect();
            (self.hold(def, None, &metas)?, on_device(&metas))
        };
        run_chosen(&held.entry().entry, &held.entry().choice, args, overload, on_device)
    }

    /// The selection for a call of `def` on `metas` (by the installed priorities, or of the named
    /// `provider`), held while the call runs: this thread's remembered one when current (logged as a
    /// selection is), else one made now from the op table, which the cache keeps when the call is
    /// done ([`cache::Held`]).
    #[inline(always)]
    fn hold(
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
    fn call_def(&self, op: &str) -> Result<&'static OpDef, CallError> {
        self.with_ops(|ops| match ops.get(op) {
            Some(entry) => Ok(entry.def),
            None => {
                Err(CallError::UnknownOp { op: op.to_owned(), known: ops.keys().map(|k| (*k).to_owned()).collect() })
            }
        })
    }

    fn call_entry(&self, op: &str) -> Result<Arc<OpEntry>, CallError> {
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
fn on_device(metas: &[ArgMeta<'_>]) -> bool {
    metas.iter().any(|m| m.tensor().is_some_and(|t| !t.device.is_cpu()))
}

/// Runs a selection: records it, prepares the activations of an in-place implementation, runs the
/// kernel and checks its outputs.
fn run_chosen(
    entry: &OpEntry,
    choice: &Choice,
    args: &mut [Value],
    overload: Overload,
    on_device: bool,
) -> Result<Outputs, CallError> {
    record(entry, choice, on_device)?;
    execute(entry, choice, args, overload)
}

/// Records a selection that runs: the provider's count, and the warning when native runs past
/// rejections or on device tensors. (The rejections' reasons were noted when the selection was made.)
#[inline]
fn record(entry: &OpEntry, choice: &Choice, on_device: bool) -> Result<(), CallError> {
    // Rejections are rare on a platform's list: checked first, so the common call compares nothing.
    if !choice.rejected.is_empty() && choice.chosen.provider == NATIVE {
        native_fallback(entry, choice)?;
    }
    if on_device && choice.chosen.provider == NATIVE {
        native_on_device(entry, choice)?;
    }
    choice.chosen.selections.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Native chosen because every provider listed before it rejected the call: refused by a strict
/// registry, else counted and said once per op and reason at WARN level (a selection this thread
/// already said it of skips the op's lock).
#[cold]
fn native_fallback(entry: &OpEntry, choice: &Choice) -> Result<(), CallError> {
    let op = entry.def.name;
    if entry.strict() {
        return Err(CallError::NativeFallback { op, rejected: DisplayRejections(&choice.rejected).to_string() });
    }
    entry.native_fallbacks.fetch_add(1, Ordering::Relaxed);
    if choice.said.fallback.replace(true) {
        return Ok(());
    }
    warn_native_fallback(entry, &DisplayRejections(&choice.rejected).to_string());
    Ok(())
}

/// Says once per op and reason at WARN level that native runs past the providers listed before it.
pub(crate) fn warn_native_fallback(entry: &OpEntry, rejected: &str) {
    let op = entry.def.name;
    entry.warn_once(&format!("native-fallback: {rejected}"), || {
        format!(
            "op {op}: the providers listed before native rejected the call {rejected}; native runs instead (correct, slow). Give the arguments a form a provider takes, \
             register a provider that takes them, or list `native` first in the op's priorities to choose it \
             knowingly; {env}=1 makes this an error",
            env = crate::registry::STRICT_ENV
        )
    });
}

/// Native chosen for device tensors: counted as a host round trip and said once per op, or refused.
#[cold]
fn native_on_device(entry: &OpEntry, choice: &Choice) -> Result<(), CallError> {
    if crate::storage::host_round_trips_refused() {
        return Err(CallError::HostRoundTripRefused {
            op: entry.def.name,
            rejected: DisplayRejections(&choice.rejected).to_string(),
        });
    }
    crate::storage::count_host_round_trip(entry.def.name);
    if !choice.said.round_trip.replace(true) {
        warn_host_round_trip(entry);
    }
    Ok(())
}

/// Prepares the activations of an in-place implementation, runs the kernel on bound arguments and
/// checks its outputs.
fn execute(entry: &OpEntry, choice: &Choice, args: &mut [Value], overload: Overload) -> Result<Outputs, CallError> {
    let def = entry.def;
    let chosen = &choice.chosen;
    let mut written = PerOutput::new();
    if chosen.inplace {
        let given: PerOutput<usize> = given_activations(entry, args).collect();
        // The selection decided this from its key, these arguments' metadata; only a misfit is
        // looked for, to name the activation.
        if !choice.activations_fit {
            for (index, &position) in given.iter().enumerate() {
                let activation = args[position].as_tensor().expect("given activations are tensors").meta();
                if !choice.outputs[index].same_kind_and_shape(activation) {
                    return Err(CallError::InplaceMetaMismatch {
                        op: def.name,
                        provider: chosen.provider,
                        index,
                        output: Box::new(choice.outputs[index].clone()),
                        activation: Box::new(activation.clone()),
                    });
                }
            }
        }
        let mut written_in_place = 0;
        for (index, &position) in given.iter().enumerate() {
            let Value::Tensor(tensor) = &mut args[position] else { unreachable!("given activations are tensors") };
            if overload == Overload::MaybeInplace && tensor.is_uniquely_owned() {
                overlapping_activation(def, index, tensor)?;
                written_in_place += 1;
            } else {
                *tensor = defensive_copy(entry, overload, index, tensor)?;
            }
            written.push(tensor.storage_id());
        }
        // One count per call, not per activation: each is an atomic read-modify-write.
        if written_in_place > 0 {
            entry.inplace_writes.fetch_add(written_in_place, Ordering::Relaxed);
        }
    }

    let outputs = run_compacted(entry, chosen, args, &choice.compacted, &choice.outputs)?;
    check_outputs(def, chosen, &choice.outputs, &outputs, &written)?;
    Ok(outputs)
}

/// Runs `chosen` on `args`, first replacing the tensors at `compacted` (usually none) by compact
/// copies made on their device; then each output of such a call gets its declared layout back: an
/// in-place output is copied into the original activation it was written for (which becomes the
/// output, so the call stays in place), a fresh one into a fresh tensor of its declared layout.
/// The other compacted arguments are put back into `args`.
#[inline]
fn run_compacted(
    entry: &OpEntry,
    chosen: &ImplEntry,
    args: &mut [Value],
    compacted: &[usize],
    declared: &[TensorMeta],
) -> Result<Outputs, CallError> {
    let def = entry.def;
    let kernel_error = |source| CallError::Kernel { op: def.name, provider: chosen.provider, source };
    if compacted.is_empty() {
        return (chosen.call)(args).map_err(kernel_error);
    }
    let given: PerOutput<usize> =
        if chosen.inplace { given_activations(entry, args).collect() } else { PerOutput::new() };
    let mut originals: SmallVec<[(usize, Option<Tensor>); 2]> = SmallVec::new();
    for &position in compacted {
        if let Some(Value::Tensor(tensor)) = args.get_mut(position) {
            let compact = tensor.contiguous()?;
            originals.push((position, Some(std::mem::replace(tensor, compact))));
        }
    }
    tracing::debug!(
        target: "ir_core::dispatch",
        op = def.name,
        provider = chosen.provider,
        positions = ?compacted,
        "running {} on compact copies of arguments {compacted:?}",
        chosen.provider
    );
    let mut outputs = (chosen.call)(args).map_err(kernel_error)?;
    for (index, output) in outputs.iter_mut().enumerate() {
        let original = given
            .get(index)
            .and_then(|position| originals.iter_mut().find(|(p, _)| p == position))
            .and_then(|(_, original)| original.take());
        match original {
            Some(mut original) => {
                original.copy_from(output)?;
                *output = original;
            }
            None => {
                if let Some(declared) = declared.get(index)
                    && output.meta() != declared
                {
                    *output = output.copy_into_layout(declared.layout.clone())?;
                }
            }
        }
    }
    for (position, original) in originals {
        if let Some(original) = original {
            args[position] = Value::Tensor(original);
        }
    }
    Ok(outputs)
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

/// A selection held by a typed `maybe_inplace` call ([`Registry::select_declared`]): the call checks
/// and prepares its donated activations through it (a uniquely owned activation is written in place,
/// any other copied, as `maybe_inplace` promises), runs the chosen implementation's typed function
/// on its arguments, or, for an implementation without one, the bound arguments, and checks the
/// outputs. Dropping it gives a selection made for the call to this thread's cache.
///
/// Support for `define_op!`'s generated functions, hidden from the documentation.
#[doc(hidden)]
pub struct Selected<'r> {
    /// The selection (a new one goes into the cache on drop).
    held: cache::Held,
    /// The storages of the prepared activations, in order.
    written: RefCell<PerOutput<crate::tensor::StorageId>>,
    /// Activations kept for writing in place, counted into the op's record once, on drop.
    in_place: std::cell::Cell<u64>,
    _registry: &'r Registry,
}

impl Selected<'_> {
    fn remembered(&self) -> &cache::Entry {
        self.held.entry()
    }

    /// The chosen in-place implementation's typed function `Arc<F>`, if it is in place and has one.
    pub fn typed_inplace<F: ?Sized + 'static>(&self) -> Option<&Arc<F>> {
        let cached = &self.remembered().choice;
        let chosen = &cached.chosen;
        // A compacting selection runs through the bound arguments (`run_compacted`).
        chosen
            .typed
            .as_ref()
            .filter(|_| chosen.inplace && cached.compacted.is_empty())
            .and_then(|typed| typed.downcast_ref::<Arc<F>>())
    }

    /// The chosen functional implementation's typed function `Arc<F>`, if it is functional and has one.
    pub fn typed_functional<F: ?Sized + 'static>(&self) -> Option<&Arc<F>> {
        typed_impl::<F>(&self.remembered().choice)
    }

    /// Checks donated activation `index` (the index-th given) against the output the in-place
    /// implementation writes into it: call for every activation before preparing any.
    #[inline]
    pub fn check_activation(&self, index: usize, activation: &Tensor) -> Result<(), CallError> {
        let (entry, cached) = (&self.remembered().entry, &self.remembered().choice);
        if activation.is_uniquely_owned() {
            overlapping_activation(entry.def, index, activation)?;
        }
        // The selection's key is these arguments' metadata, so its answer is this call's.
        if cached.activations_fit {
            return Ok(());
        }
        let output = &cached.outputs[index];
        if output.same_kind_and_shape(activation.meta()) {
            return Ok(());
        }
        Err(CallError::InplaceMetaMismatch {
            op: entry.def.name,
            provider: cached.chosen.provider,
            index,
            output: Box::new(output.clone()),
            activation: Box::new(activation.meta().clone()),
        })
    }

    /// Makes the next donated activation writable by the in-place implementation: kept when nothing
    /// else refers to its storage, else replaced by a copy.
    #[inline]
    pub fn prepare_activation(&self, activation: &mut Tensor) -> Result<(), CallError> {
        let entry = &self.remembered().entry;
        let mut written = self.written.borrow_mut();
        if activation.is_uniquely_owned() {
            self.in_place.set(self.in_place.get() + 1);
        } else {
            *activation = defensive_copy(entry, Overload::MaybeInplace, written.len(), activation)?;
        }
        written.push(activation.storage_id());
        Ok(())
    }

    /// The typed function's outputs, checked where they are (an error names the op and the
    /// provider).
    #[inline]
    pub fn finish<O: OpOutputs>(&self, outputs: Result<O, KernelError>) -> Result<O, CallError> {
        let outputs = outputs.map_err(|source| self.kernel_error(source))?;
        self.check(&outputs.tensors())?;
        Ok(outputs)
    }

    /// Checks the outputs against the declared metadata and the written storages.
    #[inline]
    fn check(&self, outputs: &[&Tensor]) -> Result<(), CallError> {
        let (entry, cached) = (&self.remembered().entry, &self.remembered().choice);
        check_outputs(entry.def, &cached.chosen, &cached.outputs, outputs, &self.written.borrow())
    }

    /// A failure of the chosen implementation, named.
    fn kernel_error(&self, source: KernelError) -> CallError {
        let (entry, cached) = (&self.remembered().entry, &self.remembered().choice);
        CallError::Kernel { op: entry.def.name, provider: cached.chosen.provider, source }
    }

    /// Runs an implementation without a typed function of the call's types on the bound arguments.
    pub fn run_bound(&self, args: &mut [Value]) -> Result<Outputs, CallError> {
        let remembered = self.remembered();
        execute(&remembered.entry, &remembered.choice, args, Overload::MaybeInplace)
    }
}

impl Drop for Selected<'_> {
    #[inline]
    fn drop(&mut self) {
        let in_place = self.in_place.get();
        if in_place > 0 {
            self.held.entry().entry.inplace_writes.fetch_add(in_place, Ordering::Relaxed);
        }
    }
}

/// The chosen implementation's typed function of type `F`, when it is functional and has one.
fn typed_impl<F: ?Sized + 'static>(cached: &Choice) -> Option<&Arc<F>> {
    let chosen = &cached.chosen;
    // A compacting selection runs through the bound arguments (`run_compacted`).
    chosen
        .typed
        .as_ref()
        .filter(|_| !chosen.inplace && cached.compacted.is_empty())
        .and_then(|typed| typed.downcast_ref::<Arc<F>>())
}

/// Runs a selection for [`Registry::call_typed`]: its typed function on the borrowed arguments, or,
/// without one, the bound arguments `values` builds.
fn run_typed<F: ?Sized + 'static, O: OpOutputs, A: AsMut<[Value]>>(
    entry: &OpEntry,
    cached: &Choice,
    metas: &[ArgMeta<'_>],
    call: impl FnOnce(&F) -> Result<O, KernelError>,
    values: impl FnOnce() -> A,
) -> Result<O, CallError> {
    let Some(typed) = typed_impl::<F>(cached) else {
        let mut args = values();
        let outputs = run_chosen(entry, cached, args.as_mut(), Overload::Default, on_device(metas))?;
        return Ok(O::from_outputs(outputs).expect("the registry checks the number of outputs"));
    };
    let (def, chosen) = (entry.def, &cached.chosen);
    record(entry, cached, on_device(metas))?;
    let outputs =
        call(typed).map_err(|source| CallError::Kernel { op: def.name, provider: chosen.provider, source })?;
    check_outputs(def, chosen, &cached.outputs, &outputs.tensors(), &[])?;
    Ok(outputs)
}

/// Refuses activation `index`, about to be written in place, when its layout maps several elements
/// to one address.
#[inline]
fn overlapping_activation(def: &OpDef, index: usize, activation: &Tensor) -> Result<(), CallError> {
    if activation.layout().overlaps_itself() {
        return Err(CallError::OverlappingActivation {
            op: def.name,
            index,
            activation: Box::new(activation.meta().clone()),
        });
    }
    Ok(())
}

/// Native chosen for device tensors: said once per op.
fn warn_host_round_trip(entry: &OpEntry) {
    entry.warn_once("native-host-round-trip", || {
        format!("op {}: native runs on device tensors through a host round trip (correct, slow)", entry.def.name)
    });
}

/// The positions of the activations given in `args` (an absent optional activation, `none`, has no
/// output and is skipped), in order: output i belongs to the i-th of them.
fn given_activations<'a>(entry: &'a OpEntry, args: &'a [Value]) -> impl Iterator<Item = usize> + 'a {
    entry.activations.iter().copied().filter(|&position| matches!(args.get(position), Some(Value::Tensor(_))))
}

/// A copy of an activation an in-place kernel may write: for the functional call, or for
/// `maybe_inplace` when something else refers to the donated tensor's storage (or it is read-only).
fn defensive_copy(entry: &OpEntry, overload: Overload, index: usize, tensor: &Tensor) -> Result<Tensor, CallError> {
    if overload == Overload::MaybeInplace {
        tracing::debug!(
            target: "ir_core::dispatch",
            op = entry.def.name,
            activation = index,
            handles = tensor.storage_handles(),
            writable = tensor.storage().is_writable(),
            "activation {index} of op {} is shared or read-only; copying instead of writing in place",
            entry.def.name
        );
    }
    entry.defensive_copies.fetch_add(1, Ordering::Relaxed);
    Ok(tensor.deep_clone()?)
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
        let outputs = (entry.def.meta)(args)?;
        let native = Arc::clone(&impls[0]);
        log_choice(op, &native, &[], args);
        return Ok(Choice::new(args, &entry.activations, native, outputs, SmallVec::new(), false));
    };
    let outputs = (entry.def.meta)(args)?;
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
    let outputs = (entry.def.meta)(args)?;
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

fn check_outputs(
    def: &OpDef,
    chosen: &ImplEntry,
    declared: &[TensorMeta],
    outputs: &[impl std::borrow::Borrow<Tensor>],
    written: &[crate::tensor::StorageId],
) -> Result<(), CallError> {
    let violation = |problem: String| CallError::ContractViolation { op: def.name, provider: chosen.provider, problem };
    // The meta function's list: as many as declared, fewer when an optional activation is absent.
    if outputs.len() != declared.len() {
        return Err(violation(format!("returned {} outputs, expected {}", outputs.len(), declared.len())));
    }
    // An in-place kernel writes output i into activation i's storage for each activation; outputs
    // after those are fresh and must not share a written storage.
    for (index, (output, expected)) in outputs.iter().zip(declared).enumerate() {
        let output: &Tensor = output.borrow();
        match written.get(index) {
            Some(&storage) if chosen.inplace => {
                if output.storage_id() != storage {
                    return Err(violation(format!("output {index} was not written into activation {index}'s storage")));
                }
                if !output.meta().same_kind_and_shape(expected) {
                    return Err(violation(format!("output {index} is {}, declared {expected}", output.meta())));
                }
            }
            _ => {
                if output.meta() != expected {
                    return Err(violation(format!("output {index} is {}, declared {expected}", output.meta())));
                }
                if written.contains(&output.storage_id()) {
                    return Err(violation(format!("output {index} is fresh but shares an activation's storage")));
                }
            }
        }
    }
    Ok(())
}

struct DisplayRejections<'a>(&'a [(Arc<ImplEntry>, Arc<str>)]);

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
