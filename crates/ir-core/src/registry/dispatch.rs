//! The one execution path: every way to run an op ends here. A call is described once ([`Call`]:
//! the op, its arguments, the overload, optionally a named provider and a launch stream); the
//! typed functions [`define_op!`](crate::define_op) generates, [`Registry::run`], the graph
//! interpreter and the candle bindings all hold a [`Dispatch`] for it, which records the
//! selection, prepares the donated activations, runs the chosen implementation (its typed function
//! on the caller's arguments, or its function on bound arguments) and checks the outputs against
//! the declared contract. Which implementation runs is decided in `select`.

use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use crate::op::declare::OpOutputs;
use crate::op::{ArgMeta, INLINE_OUTPUTS, OpDef, Outputs, Overload, Value, Values};
use crate::registry::cache::{self, Choice};
use crate::registry::select::{ArgMetas, DisplayRejections, on_device};
use crate::registry::{CallError, ImplEntry, NATIVE, OpEntry, OpRef, Registry, read};
use crate::stream::LaunchStream;
use crate::{KernelError, Support, Tensor, TensorMeta};

/// Argument positions or storages of one call's activations, inline.
type PerOutput<T> = SmallVec<[T; INLINE_OUTPUTS]>;

/// One call of an op, described once: what [`Registry::run`] runs.
///
/// ```
/// use ir_core::op::{Overload, Value};
/// use ir_core::{Call, DType, Tensor};
///
/// let registry = ir_ops::registry();
/// let x = Tensor::ones(DType::F32, &[2, 8])?;
/// let args = vec![Value::Tensor(x), Value::None, Value::F64(1e-6)];
/// // By name (a graph's text, a configuration) or by definition (`&rms_norm::RMS_NORM`), with the
/// // installed priorities choosing the provider, or with `.provider("native")` naming it.
/// let out = registry.run(Call::new("rms_norm", Overload::Default, args).provider("native"))?;
/// assert_eq!(out[0].shape(), &[2, 8]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Call<'a> {
    op: OpRef<'a>,
    overload: Overload,
    args: Values,
    provider: Option<&'a str>,
    stream: Option<LaunchStream>,
}

impl<'a> Call<'a> {
    /// A call of `op` (its definition or its name) on the positional `args` (trailing parameters
    /// with defaults may be left out); with [`Overload::MaybeInplace`] the activations among `args`
    /// are donated.
    pub fn new(op: impl Into<OpRef<'a>>, overload: Overload, args: impl Into<Values>) -> Call<'a> {
        Call { op: op.into(), overload, args: args.into(), provider: None, stream: None }
    }

    /// Runs `provider`'s implementation instead of the one the installed priorities choose (a
    /// lowered graph's `impl` node): it must be registered and available here and take the
    /// arguments, or take compact copies of the device tensors among them whose layouts it rejects.
    pub fn provider(self, provider: &'a str) -> Call<'a> {
        Call { provider: Some(provider), ..self }
    }

    /// Device kernels launch on `stream` (a device provider reads it back in its own stream type
    /// with [`launch_stream`](crate::stream::launch_stream)).
    pub fn stream(self, stream: LaunchStream) -> Call<'a> {
        Call { stream: Some(stream), ..self }
    }

    pub(crate) fn with_stream(self, stream: Option<LaunchStream>) -> Call<'a> {
        Call { stream, ..self }
    }
}

impl std::fmt::Debug for Call<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call")
            .field("op", &self.op)
            .field("overload", &self.overload)
            .field("args", &self.args.len())
            .field("provider", &self.provider)
            .field("stream", &self.stream.is_some())
            .finish()
    }
}

impl Registry {
    /// Runs a call: binds its positional arguments (filling trailing defaults), validates them,
    /// selects a provider (or takes the named one) and runs it on the call's launch stream. The
    /// typed functions [`define_op!`](crate::define_op) generates are the typed form of this call:
    /// the same rules, selection cache and records. The outputs are inline up to
    /// [`INLINE_OUTPUTS`] (`.into_vec()` makes a `Vec`).
    pub fn run(&self, call: Call<'_>) -> Result<Outputs, CallError> {
        let Call { op, overload, mut args, provider, stream } = call;
        let def = match op {
            OpRef::Def(def) => def,
            OpRef::Name(name) => self.call_def(name)?,
        };
        crate::op::fill_defaults(def, &mut args)?;
        crate::stream::with_launch_stream(stream.as_ref(), || {
            let dispatch = {
                let metas: ArgMetas<'_> = args.iter().map(Value::meta).collect();
                self.dispatch_with(def, provider, overload, &metas)?
            };
            dispatch.run_bound(&mut args)
        })
    }

    /// The dynamic call of `op` with the installed priorities.
    #[deprecated(since = "0.2.0", note = "use `registry.run(Call::new(op, overload, args))`")]
    pub fn call<'a>(
        &self,
        op: impl Into<OpRef<'a>>,
        overload: Overload,
        args: Vec<Value>,
    ) -> Result<Vec<Tensor>, CallError> {
        Ok(self.run(Call::new(op, overload, args))?.into_vec())
    }

    /// Calls one named implementation (a graph's `impl` node).
    #[deprecated(
        since = "0.2.0",
        note = "use `registry.run(Call::new(op, overload, args).provider(provider))`: `Overload::MaybeInplace` donates the activations an in-place implementation writes"
    )]
    pub fn call_implementation(&self, op: &str, provider: &str, args: Vec<Value>) -> Result<Vec<Tensor>, CallError> {
        let overload = match self.is_inplace(op, provider) {
            Some(true) => Overload::MaybeInplace,
            _ => Overload::Default,
        };
        Ok(self.run(Call::new(op, overload, args).provider(provider))?.into_vec())
    }

    /// `provider`'s implementation of `op` as registered, whose [`ImplFunc::invoke`](crate::ImplFunc::invoke)
    /// runs it with none of the registry's checks: for a benchmark measuring the registry's own cost
    /// against the kernel's, never to run an op. Fails if the op or provider is unknown or the
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
        Ok(implementation.func.clone())
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

    /// Holds the selection for a typed call of `def` on `metas` (the metadata of the caller's
    /// arguments, every parameter in order) with `overload`, made by the same rules, cache and
    /// records as every call, while the call runs ([`Dispatch`]); the selection is recorded as run.
    ///
    /// Support for `define_op!`'s generated functions and the candle bindings, hidden from the
    /// documentation: code calls the generated typed functions or [`Registry::run`].
    #[doc(hidden)]
    #[inline]
    pub fn dispatch(
        &self,
        def: &'static OpDef,
        overload: Overload,
        metas: &[ArgMeta<'_>],
    ) -> Result<Dispatch<'_>, CallError> {
        self.dispatch_with(def, None, overload, metas)
    }

    #[inline(always)]
    fn dispatch_with(
        &self,
        def: &'static OpDef,
        provider: Option<&str>,
        overload: Overload,
        metas: &[ArgMeta<'_>],
    ) -> Result<Dispatch<'_>, CallError> {
        if overload == Overload::MaybeInplace && !def.allow_inplace {
            return Err(CallError::NotInplaceOp { op: def.name });
        }
        let held = self.hold(def, provider, metas)?;
        record(&held.entry().entry, &held.entry().choice, on_device(metas))?;
        Ok(Dispatch {
            held,
            overload,
            written: RefCell::new(PerOutput::new()),
            in_place: Cell::new(0),
            _registry: self,
        })
    }
}

/// A call's selection, held while the call runs: the only way an implementation runs. The call
/// checks and prepares its donated activations through it (with `maybe_inplace`, a uniquely owned
/// activation is written in place, any other copied), runs the chosen implementation's typed
/// function on its arguments or its function on the bound arguments, and checks the outputs.
/// Dropping it gives a selection made for the call to this thread's cache.
///
/// Support for `define_op!`'s generated functions and the candle bindings, hidden from the
/// documentation.
#[doc(hidden)]
pub struct Dispatch<'r> {
    /// The selection (a new one goes into the cache on drop).
    held: cache::Held,
    /// The overload the call was made with.
    overload: Overload,
    /// The storages of the prepared activations, in order.
    written: RefCell<PerOutput<crate::tensor::StorageId>>,
    /// Activations kept for writing in place, counted into the op's record once, on drop.
    in_place: Cell<u64>,
    _registry: &'r Registry,
}

impl Dispatch<'_> {
    fn remembered(&self) -> &cache::Entry {
        self.held.entry()
    }

    /// The chosen implementation's typed function `F` (an op's typed `dyn Fn` over its in-place
    /// argument types), if it is in place and has one, and the call donates its activations.
    #[inline]
    pub fn typed_inplace<F: ?Sized + 'static>(&self) -> Option<&F> {
        let cached = &self.remembered().choice;
        let chosen = &cached.chosen;
        // A compacting selection runs through the bound arguments (`run_compacted`).
        if !chosen.inplace || !cached.compacted.is_empty() || self.overload != Overload::MaybeInplace {
            return None;
        }
        chosen.func.typed_as::<F>()
    }

    /// The chosen implementation's typed function `F` (an op's typed `dyn Fn` over its functional
    /// argument types), if it is functional and has one.
    #[inline]
    pub fn typed_functional<F: ?Sized + 'static>(&self) -> Option<&F> {
        let cached = &self.remembered().choice;
        let chosen = &cached.chosen;
        if chosen.inplace || !cached.compacted.is_empty() {
            return None;
        }
        chosen.func.typed_as::<F>()
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

    /// Runs the chosen implementation on the bound arguments (complete, in parameter order): what
    /// runs when the call has no typed function of the implementation's types.
    pub fn run_bound(&self, args: &mut [Value]) -> Result<Outputs, CallError> {
        let remembered = self.remembered();
        execute(&remembered.entry, &remembered.choice, args, self.overload)
    }
}

impl Drop for Dispatch<'_> {
    #[inline]
    fn drop(&mut self) {
        let in_place = self.in_place.get();
        if in_place > 0 {
            self.held.entry().entry.inplace_writes.fetch_add(in_place, Ordering::Relaxed);
        }
    }
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
        return chosen.func.run(args).map_err(kernel_error);
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
    let mut outputs = chosen.func.run(args).map_err(kernel_error)?;
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
