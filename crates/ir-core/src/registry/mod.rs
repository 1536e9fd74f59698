//! The registry: op definitions, their implementations, installed priorities and dispatch
//! ([`Registry`] documents them).

mod cache;
mod dispatch;
mod error;
mod priority;
mod record;
mod select;

use std::collections::HashSet;
use std::fmt;
use std::panic::{AssertUnwindSafe, Location};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use arc_swap::{ArcSwap, ArcSwapOption};
use indexmap::IndexMap;

use crate::implementation::ImplFunc;
use crate::op::{OpDef, ParamKind, is_reserved, is_valid_name};
pub use crate::registry::dispatch::{Call, Dispatch};
pub use crate::registry::error::CallError;
pub use crate::registry::priority::{PriorityError, PriorityGuard, merge_priorities};
pub use crate::registry::record::{OpRecord, ProviderRecord, SelectionRecord};
pub use crate::registry::select::{OpRef, Rejection, Selection};
use crate::{Availability, ImplSpec, SupportsFn};

/// The provider name of every op's reference implementation.
pub const NATIVE: &str = "native";
/// Provider names no implementation may register under.
pub const RESERVED_PROVIDERS: &[&str] = &[NATIVE, "unfused"];

/// What a name names, for error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameKind {
    /// An op.
    Op,
    /// An op parameter.
    Param,
    /// A provider.
    Provider,
}

impl fmt::Display for NameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NameKind::Op => "op",
            NameKind::Param => "parameter",
            NameKind::Provider => "provider",
        })
    }
}

/// Errors of op definition and implementation registration. A failed registration leaves nothing behind.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    // --- environment ---
    /// An environment variable the registry reads holds a value it does not take.
    #[error("{var}={value:?} is not a boolean: use 1, true, yes or on (or 0, false, no, off, or leave it unset)")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },

    // --- names ---
    /// A name that does not match `^[a-z_][a-z_0-9]*$`.
    #[error("invalid {kind} name `{name}`: names match ^[a-z_][a-z_0-9]*$")]
    InvalidName {
        /// What it names.
        kind: NameKind,
        /// The name.
        name: String,
    },
    /// A reserved word of the text format, or a reserved provider name.
    #[error("{kind} name `{name}` is reserved")]
    ReservedName {
        /// What it names.
        kind: NameKind,
        /// The name.
        name: String,
    },

    // --- op definitions ---
    /// An op name defined twice.
    #[error("op `{name}` is already defined (first defined at {first})")]
    DuplicateOp {
        /// The op.
        name: String,
        /// Where the first definition was registered.
        first: &'static Location<'static>,
    },
    /// A parameter name used twice in one op.
    #[error("op `{op}` has two parameters named `{name}`")]
    DuplicateParam {
        /// The op.
        op: String,
        /// The parameter.
        name: String,
    },
    /// A string parameter whose allowed values include one the text format cannot spell.
    #[error(
        "op `{op}`: parameter `{param}` allows {choice:?}, which is empty or holds a quote, backslash or control character"
    )]
    InvalidChoice {
        /// The op.
        op: String,
        /// The parameter.
        param: String,
        /// The allowed value.
        choice: String,
    },
    /// A default that does not fit its parameter's kind (or allowed values).
    #[error("op `{op}`: the default of parameter `{param}` is not a {kind}")]
    InvalidDefault {
        /// The op.
        op: String,
        /// The parameter.
        param: String,
        /// The parameter's kind.
        kind: ParamKind,
    },
    /// An op without outputs.
    #[error("op `{op}` declares no outputs")]
    NoOutputs {
        /// The op.
        op: String,
    },
    /// An explicit activation list that does not fit the parameters.
    #[error(transparent)]
    Activation(#[from] crate::op::ActivationError),
    /// `allow_inplace` without activations, or with more activations than outputs (each activation
    /// receives the output of its index).
    #[error(
        "op `{op}` allows inplace but has {outputs} outputs and {activations} activations (in-place ops need at \
         least one activation and no more activations than outputs)"
    )]
    InplaceArity {
        /// The op.
        op: String,
        /// Number of outputs.
        outputs: usize,
        /// Number of activations.
        activations: usize,
    },

    // --- implementations ---
    /// An implementation for an op the registry does not define.
    #[error("unknown op `{op}` (known: {})", known.join(", "))]
    UnknownOp {
        /// The op.
        op: String,
        /// Ops the registry defines.
        known: Vec<String>,
    },
    /// A provider registered twice for one op.
    #[error(
        "provider `{provider}` is already registered for op `{op}` (first registered at {first}); \
         to swap its implementation, call `Registry::replace_impl`"
    )]
    DuplicateProvider {
        /// The op.
        op: String,
        /// The provider.
        provider: String,
        /// Where the first registration happened.
        first: &'static Location<'static>,
    },
    /// `replace_impl` for a provider that is not registered.
    #[error(
        "provider `{provider}` is not registered for op `{op}`, so it cannot be replaced; register it with `Registry::register_impl`"
    )]
    NotRegistered {
        /// The op.
        op: String,
        /// The provider.
        provider: String,
    },
    /// A definition, registration or replacement after [`Registry::freeze`].
    #[error(
        "the registry is frozen: {change} is refused (define every op and register every provider before \
         `Registry::freeze`)"
    )]
    Frozen {
        /// The change refused (`registering provider `mine` of op `rms_norm``).
        change: String,
    },
    /// An in-place implementation of an op without `allow_inplace`.
    #[error("provider `{provider}` registers an inplace implementation of `{op}`, which does not allow inplace")]
    InplaceNotAllowed {
        /// The op.
        op: String,
        /// The provider.
        provider: String,
    },
}

/// The registry: op definitions, their implementations, installed priorities and dispatch.
///
/// Registries are independent and `Send + Sync`; tests build their own and run in parallel threads.
///
/// # Registering a provider, installing priorities, dispatching
///
/// A provider is a closure (it may hold state) plus an [`ImplSpec`]: its name, an
/// optional availability probe and an optional `supports` predicate over argument metadata. The
/// installed priority list of an op picks, per call, the first available provider whose predicate
/// accepts the arguments; every rejection is recorded with its reason.
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
///
/// use ir_ops::silu_and_mul::{self, SiluAndMulArgs};
/// use ir_core::{DType, ImplSpec, Registry, Support, Tensor};
///
/// let registry = ir_ops::registry();
/// // State: a call counter. The predicate sees metadata only: this provider takes f32.
/// let calls = Arc::new(AtomicU64::new(0));
/// let counter = Arc::clone(&calls);
/// let spec = ImplSpec::new("mine").with_supports(|args| match SiluAndMulArgs::from_meta(args) {
///     Some(view) if view.x.dtype == DType::F32 => Support::Yes,
///     _ => Support::No("f32 only".into()),
/// });
/// silu_and_mul::register(&registry, spec, move |x| {
///     counter.fetch_add(1, Ordering::Relaxed);
///     silu_and_mul::native(x)
/// })?;
/// // Priorities: `mine` first, the list installed before (here none: `native`) after it.
/// let _guard = registry.override_priority("silu_and_mul", &["mine"])?;
/// assert_eq!(registry.installed_priority("silu_and_mul").unwrap(), ["mine", "native"]);
///
/// silu_and_mul::silu_and_mul(&registry, &Tensor::ones(DType::F32, &[2, 8])?)?;
/// silu_and_mul::silu_and_mul(&registry, &Tensor::ones(DType::BF16, &[2, 8])?)?; // rejected: native
/// assert_eq!(calls.load(Ordering::Relaxed), 1);
/// let record = registry.selection_record();
/// assert_eq!(record.selections("silu_and_mul", "native"), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Engines install every op's list at once from a per-platform
/// [`PriorityConfig`](crate::PriorityConfig).
///
/// # Providers registered after priorities are installed
///
/// A list keeps which of its names a user wrote: every name given to [`Registry::set_default`] or
/// [`Registry::override_priority`], the entries of `VLLM_IR_PRIORITY` (or a
/// [`PriorityConfig`](crate::PriorityConfig)'s user overrides), and the names a guard's list
/// inherits pinned from the list below it; the platform's defaults that the configuration appends
/// are not pinned. A provider registered later joins each installed list right after its last
/// pinned name, before the platform's `native` that follows (at the end when none does). It never
/// goes in front of a name a user wrote, so a user list ending in `native` (`rms_norm=native`:
/// "`native` first disables the rest") stays what it was, and on a platform's own list
/// (`[cpu, native]`) the new provider takes what `cpu` rejects before `native` does.
///
/// ```
/// # use ir_ops::rms_norm;
/// # use ir_core::{ImplSpec, Registry};
/// let registry = ir_ops::registry();
/// let _pinned = registry.override_priority("rms_norm", &["native"])?;
/// rms_norm::register(&registry, ImplSpec::new("late"), |x, w, eps, v| rms_norm::native(x, w, eps, v))?;
/// assert_eq!(registry.installed_priority("rms_norm").unwrap(), ["native"]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Calling an op
///
/// There are four ways to run an op, and all of them take one execution path (the `dispatch`
/// module: the same validation, selection cache, records and output checks):
///
/// 1. **The typed functions** an op's [`define_op!`](crate::define_op) declaration generates:
///    `rms_norm::rms_norm(&registry, …)` (functional) and `maybe_inplace(&registry, …)` (donating
///    the activations) on a registry, `rms_norm::call(ctx, …)` and `call_maybe_inplace(ctx, …)` on
///    any [`OpCaller`](crate::OpCaller): an [`ExecutionContext`](crate::ExecutionContext) (model
///    code that runs eagerly or is traced) or a tensor library's binding (way 4). For code that
///    knows the op it calls: typed arguments, the cheapest call.
/// 2. **[`Registry::run`]** with a [`Call`]: the op by definition or by name ([`OpRef`]), the
///    [`Overload`](crate::op::Overload) (functional, or `maybe_inplace`, which donates the
///    activations), the positional arguments, and optionally a named provider (a lowered graph's
///    `impl` node) and a launch stream. For code that holds an op only as data (a graph's node, a
///    configuration, an engine's op table).
/// 3. **A graph** (`vllm-ir-graph`'s `interpret`): a traced or parsed graph, usually after the
///    passes, whose calls run through [`Registry::run`].
/// 4. **Candle tensors** (`vllm-ir-ops`' `candle_ops`): every op's generated context calls on
///    `candle::Tensor`s through `candle_ops::Candle(&registry)`, an [`OpCaller`](crate::OpCaller)
///    (and `candle_ops::call`, the op as data), written in place under candle's locks; their calls
///    run through [`Registry::run`].
///
/// ```
/// use ir_core::op::{Overload, Value};
/// use ir_core::{Call, DType, Tensor};
///
/// let registry = ir_ops::registry();
/// let x = Tensor::ones(DType::F32, &[2, 8])?;
/// let args = || vec![Value::Tensor(x.clone()), Value::None, Value::F64(1e-6)];
/// let by_name = registry.run(Call::new("rms_norm", Overload::Default, args()))?;
/// let def = &ir_ops::rms_norm::RMS_NORM;
/// // `variance_size`, a trailing parameter with a default, may be left out.
/// let by_def = registry.run(Call::new(def, Overload::Default, args()))?;
/// assert!(ir_core::bit_eq(&by_name[0], &by_def[0]));
/// let typed = ir_ops::rms_norm::rms_norm(&registry, &x, None, 1e-6, None)?;
/// assert!(ir_core::bit_eq(&by_name[0], &typed));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`Registry::implementation`] hands out a registered function for a benchmark to time without
/// the registry (none of its checks run): it is not a way to run an op.
///
/// # Native fallbacks
///
/// A call whose arguments every provider listed before `native` rejects runs `native`: correct, and
/// often one or two orders of magnitude slower. Such a fallback is counted per call
/// ([`OpRecord::native_fallbacks`](crate::OpRecord)) and said once per op and reason at WARN level
/// (target `ir_core::dispatch`), naming each provider's reason and the fixes. A strict registry
/// ([`Registry::set_strict`], or `VLLM_IR_STRICT=1` when it is created) refuses the call instead
/// with [`CallError::NativeFallback`]. A list whose first entry is `native` (a user's
/// `rms_norm=native`) chooses it knowingly: nothing is rejected first, so nothing is said.
///
/// ```
/// use ir_ops::silu_and_mul;
/// use ir_core::{CallError, DType, ImplSpec, Registry, Support, Tensor};
///
/// let registry = ir_ops::registry();
/// let f32_only = ImplSpec::new("mine").with_supports(|args| match silu_and_mul::SiluAndMulArgs::from_meta(args) {
///     Some(view) if view.x.dtype == DType::F32 => Support::Yes,
///     _ => Support::No("f32 only".into()),
/// });
/// silu_and_mul::register(&registry, f32_only, silu_and_mul::native)?;
/// let _guard = registry.override_priority("silu_and_mul", &["mine", "native"])?;
/// let bf16 = Tensor::ones(DType::BF16, &[2, 8])?;
/// silu_and_mul::silu_and_mul(&registry, &bf16)?; // native, counted and warned about
/// assert_eq!(registry.selection_record().op("silu_and_mul").unwrap().native_fallbacks, 1);
/// registry.set_strict(true);
/// let err = silu_and_mul::silu_and_mul(&registry, &bf16).unwrap_err();
/// assert!(matches!(err, CallError::NativeFallback { .. }), "{err}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # The selection cache, freezing and locks
///
/// Selection is a pure function of the registry's state and the call's argument metadata
/// (predicates see metadata only; meta functions are plain functions of it), so each thread
/// remembers its selections in one cache, keyed by the registry, the op, the provider a call names
/// (none for the installed priorities), the registry's generation and the complete argument
/// metadata. Every change a selection could see (an op defined, a provider replaced, an installed
/// list published) advances the generation, so a remembered selection is what selection would
/// return now. A repeated call (typed, dynamic, [`Registry::select`] in lowering, or a lowered
/// graph's `impl` node, [`Call::provider`](crate::Call::provider)) runs no predicate and no meta function, reads
/// no shared table, takes no lock and allocates nothing of its own: one atomic load of the
/// generation and the key comparison. Each thread keeps up to 64 selections, 8 per set of ops; a
/// remembered selection keeps its implementations alive until its slot is reused or the thread
/// ends. The typed functional calls run an implementation registered through its op's typed
/// `register` on the caller's borrowed arguments.
///
/// A registry is built (ops defined, providers registered), then frozen ([`Registry::freeze`]):
/// later definitions, registrations and replacements are refused, and a call that misses the cache
/// reads the frozen op table as plain data. Before freezing, the op table and each op's installed
/// priority list are immutable snapshots read through [`arc_swap`] and replaced whole when they
/// change; installed lists stay swappable after freezing (priorities choose among the registered
/// providers).
///
/// User code (availability probes, `supports` predicates, meta functions, kernels) never runs while
/// a registry lock is held, so a predicate may call back into the registry (select, override a
/// priority) without deadlock. A panic in a predicate is caught and becomes a rejection whose reason
/// carries the panic message, as a panicking probe makes its provider unavailable.
///
/// The writers' locks nest in this order and are released in reverse: `Registry::defining` (op
/// definitions, registrations, replacements, freezing), an op's priority stack (`OpEntry::priority`, held while a new list is published),
/// its implementation list (`OpEntry::impls`), and last the leaf locks (`OpEntry::warned`,
/// `ImplEntry::last_rejection`), which are never held while another is taken. No guard is held across
/// a call of user code, and no read guard is taken twice in one statement (a waiting writer would
/// block the second read).
pub struct Registry {
    /// Keyed by op name with a fast non-cryptographic hash (names are ours, not adversarial). Read
    /// by every call without a lock; defining an op publishes a new map.
    ops: ArcSwap<OpMap>,
    /// Serializes op definitions, registrations and freezing (readers never take it).
    defining: Mutex<()>,
    /// The op table once the registry is frozen ([`Registry::freeze`]): read without an atomic
    /// read-modify-write, as nothing changes it any more.
    frozen: OnceLock<Arc<OpMap>>,
    /// What the registry's ops share: the selection cache's generation and the strict flag.
    shared: Arc<Shared>,
}

/// What a registry shares with its op entries.
#[derive(Debug)]
pub(crate) struct Shared {
    /// This registry's identity and count of changes in the threads' selection caches (advanced
    /// when an op is defined and when an op publishes an installed list).
    pub(crate) generation: cache::Generation,
    /// Whether a call that falls past the providers listed before `native` to `native` is an error
    /// ([`Registry::set_strict`]).
    strict: AtomicBool,
}

/// Makes every registry created afterwards strict when set to `1`, `true`, `yes` or `on` (any
/// case; `0`, `false`, `no`, `off` or empty leave it lenient): a call that would fall back to
/// `native` past a provider listed before it (one that rejected the call, or is unavailable here)
/// fails instead ([`Registry::set_strict`]). Any other value is an error ([`strict_from_env`]); a
/// registry created while it is set makes itself strict.
pub const STRICT_ENV: &str = "VLLM_IR_STRICT";

type OpMap = IndexMap<&'static str, Arc<OpEntry>, rustc_hash::FxBuildHasher>;

/// One defined op and everything registered for it.
pub(crate) struct OpEntry {
    pub(crate) def: &'static OpDef,
    pub(crate) activations: Vec<usize>,
    defined_at: &'static Location<'static>,
    /// Implementations in registration order, native first.
    impls: RwLock<Vec<Arc<ImplEntry>>>,
    priority: Mutex<priority::PriorityStack>,
    /// The top of the priority stack, read by a selection without a lock; `None` when nothing is installed. Replaced whole on every change ([`OpEntry::publish`]).
    installed: ArcSwapOption<priority::Resolved>,
    /// Whether "priority not set" was logged.
    logged_no_priority: AtomicBool,
    /// Warnings already given (warn once per registry, op and kind).
    warned: Mutex<HashSet<Box<str>>>,
    pub(crate) inplace_writes: AtomicU64,
    pub(crate) defensive_copies: AtomicU64,
    /// Calls that fell past the providers listed before `native` to `native`.
    pub(crate) native_fallbacks: AtomicU64,
    /// The registry's selection-cache generation (advanced when this op publishes an installed list) and
    /// strict flag.
    pub(crate) shared: Arc<Shared>,
}

/// One registered implementation.
pub(crate) struct ImplEntry {
    pub(crate) provider: &'static str,
    registered_at: &'static Location<'static>,
    probe: crate::Probe,
    availability: OnceLock<Availability>,
    detects_platform: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
    pub(crate) supports: Option<SupportsFn>,
    pub(crate) inplace: bool,
    /// The function, stored once (typed, or over bound arguments).
    pub(crate) func: ImplFunc,
    pub(crate) selections: AtomicU64,
    pub(crate) last_rejection: Mutex<Option<Arc<str>>>,
}

/// A provider as the registry reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderInfo {
    /// Provider name.
    pub name: &'static str,
    /// Whether it can run here, and why not.
    pub availability: Availability,
    /// Whether it writes its outputs into its activations.
    pub inplace: bool,
    /// Whether it has a `supports` predicate.
    pub has_predicate: bool,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry {
            ops: ArcSwap::from_pointee(OpMap::default()),
            defining: Mutex::new(()),
            frozen: OnceLock::new(),
            shared: Arc::new(Shared {
                generation: cache::Generation::new(),
                strict: AtomicBool::new(strict_from_env().unwrap_or_else(|error| {
                    tracing::error!(target: "ir_core::registry", "{error}; the registry is strict");
                    true
                })),
            }),
        }
    }

    /// Makes calls that would fall back to `native` past the providers listed before it fail with
    /// [`CallError::NativeFallback`](crate::CallError) (`true`), or run `native`
    /// with a warning (`false`, the default unless [`STRICT_ENV`] was set when the registry was
    /// created). Takes effect for the next call, remembered selections included.
    pub fn set_strict(&self, strict: bool) {
        self.shared.strict.store(strict, Ordering::Relaxed);
    }

    /// Whether native fallbacks are refused ([`Registry::set_strict`]).
    pub fn is_strict(&self) -> bool {
        self.shared.strict.load(Ordering::Relaxed)
    }

    /// Defines an op; registers its `native` implementation.
    #[track_caller]
    pub fn define_op(&self, def: &'static OpDef) -> Result<(), RegistryError> {
        let location = Location::caller();
        check_name(NameKind::Op, def.name)?;
        if is_reserved(def.name) {
            return Err(RegistryError::ReservedName { kind: NameKind::Op, name: def.name.to_owned() });
        }
        let mut seen = HashSet::new();
        for param in def.params {
            check_name(NameKind::Param, param.name)?;
            if !seen.insert(param.name) {
                return Err(RegistryError::DuplicateParam { op: def.name.to_owned(), name: param.name.to_owned() });
            }
            check_param(def, param)?;
        }
        if def.n_outputs == 0 {
            return Err(RegistryError::NoOutputs { op: def.name.to_owned() });
        }
        let activations = def.activation_indices()?;
        if def.allow_inplace && (activations.is_empty() || activations.len() > def.n_outputs) {
            return Err(RegistryError::InplaceArity {
                op: def.name.to_owned(),
                outputs: def.n_outputs,
                activations: activations.len(),
            });
        }
        let native_fn = def.native;
        let native = Arc::new(ImplEntry {
            provider: NATIVE,
            registered_at: location,
            probe: Arc::new(|| Availability::Available),
            availability: OnceLock::from(Availability::Available),
            detects_platform: None,
            supports: None,
            inplace: false,
            func: ImplFunc::typed(false, Box::new(native_fn), |native, args| native(args)),
            selections: AtomicU64::new(0),
            last_rejection: Mutex::new(None),
        });
        let _defining = self.unfrozen(|| format!("defining op `{}`", def.name))?;
        let mut ops = OpMap::clone(&self.ops.load());
        if let Some(existing) = ops.get(def.name) {
            return Err(RegistryError::DuplicateOp { name: def.name.to_owned(), first: existing.defined_at });
        }
        let entry = OpEntry {
            def,
            activations,
            defined_at: location,
            impls: RwLock::new(vec![native]),
            priority: Mutex::new(priority::PriorityStack::default()),
            installed: ArcSwapOption::empty(),
            logged_no_priority: AtomicBool::new(false),
            warned: Mutex::new(HashSet::new()),
            inplace_writes: AtomicU64::new(0),
            defensive_copies: AtomicU64::new(0),
            native_fallbacks: AtomicU64::new(0),
            shared: Arc::clone(&self.shared),
        };
        ops.insert(def.name, Arc::new(entry));
        self.ops.store(Arc::new(ops));
        self.shared.generation.advance();
        tracing::debug!(target: "ir_core::registry", op = def.name, "defined op");
        Ok(())
    }

    /// Registers an implementation (the dynamic form; ops have typed `register` functions).
    ///
    /// Checks, in order: reserved provider name, name syntax, duplicate provider (naming the first
    /// registration and [`Registry::replace_impl`]), in-place on an op without `allow_inplace`.
    #[track_caller]
    pub fn register_impl(&self, op: &str, spec: ImplSpec, func: ImplFunc) -> Result<(), RegistryError> {
        let location = Location::caller();
        let (entry, implementation) = self.checked_impl(op, spec, func, location)?;
        let (provider, func_inplace) = (implementation.provider, implementation.inplace);
        let defining = self.unfrozen(|| format!("registering provider `{provider}` of op `{op}`"))?;
        let mut impls = write(&entry.impls);
        if let Some(first) = impls.iter().find(|i| i.provider == provider) {
            return Err(RegistryError::DuplicateProvider {
                op: op.to_owned(),
                provider: provider.to_owned(),
                first: first.registered_at,
            });
        }
        impls.push(implementation);
        drop(impls);
        drop(defining);
        tracing::debug!(target: "ir_core::registry", op, provider, inplace = func_inplace, "registered implementation");
        if entry.installed.load().is_some() {
            // The probe is user code: evaluate it before the lock, so resolving below reads a cached answer.
            for registered in read(&entry.impls).clone().iter() {
                registered.availability();
            }
            let mut stack = lock(&entry.priority);
            stack.join(&entry, provider);
            entry.publish(stack.top());
            drop(stack);
            tracing::info!(
                target: "ir_core::priority",
                op,
                provider,
                "provider registered after priorities were installed joins every installed list after the entries users \
                 listed (before the platform's `native`); put it first with `Registry::override_priority` or `PriorityConfig`"
            );
        }
        Ok(())
    }

    /// Replaces the implementation a provider registered for `op` (spec and function), keeping its
    /// place: every installed priority list naming the provider is resolved again, so the next call
    /// runs the new function (or skips it if its probe says it cannot run here).
    #[track_caller]
    pub fn replace_impl(&self, op: &str, spec: ImplSpec, func: ImplFunc) -> Result<(), RegistryError> {
        let location = Location::caller();
        let (entry, implementation) = self.checked_impl(op, spec, func, location)?;
        let provider = implementation.provider;
        // Probes are user code: evaluate every one before any lock is taken, so resolving again
        // below only reads cached answers.
        implementation.availability();
        for other in read(&entry.impls).clone().iter() {
            other.availability();
        }
        let defining = self.unfrozen(|| format!("replacing provider `{provider}` of op `{op}`"))?;
        let mut stack = lock(&entry.priority);
        let mut impls = write(&entry.impls);
        let Some(slot) = impls.iter_mut().find(|i| i.provider == provider) else {
            return Err(RegistryError::NotRegistered { op: op.to_owned(), provider: provider.to_owned() });
        };
        *slot = implementation;
        drop(impls);
        stack.resolve_again(&entry);
        entry.publish(stack.top());
        drop((stack, defining));
        tracing::debug!(target: "ir_core::registry", op, provider, "replaced implementation");
        Ok(())
    }

    /// The op's entry and a new implementation entry, after the checks registration and
    /// replacement share (the provider name is interned here, after it was validated).
    fn checked_impl(
        &self,
        op: &str,
        spec: ImplSpec,
        func: ImplFunc,
        location: &'static Location<'static>,
    ) -> Result<(Arc<OpEntry>, Arc<ImplEntry>), RegistryError> {
        let entry = self.entry(op).map_err(|known| RegistryError::UnknownOp { op: op.to_owned(), known })?;
        if RESERVED_PROVIDERS.contains(&spec.provider.as_ref()) {
            return Err(RegistryError::ReservedName { kind: NameKind::Provider, name: spec.provider.into_owned() });
        }
        check_name(NameKind::Provider, &spec.provider)?;
        if func.inplace && !entry.def.allow_inplace {
            return Err(RegistryError::InplaceNotAllowed { op: op.to_owned(), provider: spec.provider.into_owned() });
        }
        let implementation = Arc::new(ImplEntry {
            provider: intern_provider_name(spec.provider),
            registered_at: location,
            probe: spec.probe,
            availability: OnceLock::new(),
            detects_platform: spec.detects_platform,
            supports: spec.supports,
            inplace: func.inplace,
            func,
            selections: AtomicU64::new(0),
            last_rejection: Mutex::new(None),
        });
        Ok((entry, implementation))
    }

    // --- queries ---

    /// Names of the defined ops, in definition order.
    pub fn ops(&self) -> Vec<&'static str> {
        self.with_ops(|ops| ops.keys().copied().collect())
    }

    /// The definition of `op`.
    pub fn op_def(&self, op: &str) -> Option<&'static OpDef> {
        self.with_ops(|ops| ops.get(op).map(|entry| entry.def))
    }

    /// Parameter indices of `op`'s activations.
    pub fn activations(&self, op: &str) -> Option<Vec<usize>> {
        self.with_ops(|ops| ops.get(op).map(|entry| entry.activations.clone()))
    }

    /// The providers of `op` in registration order (native first), with availability.
    pub fn providers(&self, op: &str) -> Vec<ProviderInfo> {
        let Ok(entry) = self.entry(op) else { return Vec::new() };
        let impls = read(&entry.impls).clone();
        impls
            .iter()
            .map(|i| ProviderInfo {
                name: i.provider,
                availability: i.availability().clone(),
                inplace: i.inplace,
                has_predicate: i.supports.is_some(),
            })
            .collect()
    }

    /// The available providers of `op`, in registration order.
    pub fn available_providers(&self, op: &str) -> Vec<&'static str> {
        self.providers(op).into_iter().filter(|p| p.availability == Availability::Available).map(|p| p.name).collect()
    }

    /// Whether `provider` is registered for any op and available here.
    pub fn provider_available(&self, provider: &str) -> bool {
        self.ops().iter().any(|op| self.available_providers(op).contains(&provider))
    }

    /// Whether `provider` is available for some op and, when it has a platform-detection check, that
    /// check agrees (used by `Platform::detect`; never panics).
    pub fn provider_detects_platform(&self, provider: &str) -> bool {
        self.ops().iter().any(|op| {
            let Ok(entry) = self.entry(op) else { return false };
            let impls = read(&entry.impls).clone();
            impls.iter().filter(|i| i.provider == provider).any(|i| {
                let available = *i.availability() == Availability::Available;
                let detects = match &i.detects_platform {
                    None => true,
                    Some(check) => std::panic::catch_unwind(AssertUnwindSafe(|| check())).unwrap_or(false),
                };
                available && detects
            })
        })
    }

    /// Whether `provider` is registered for any op.
    pub fn provider_registered(&self, provider: &str) -> bool {
        self.ops().iter().any(|op| self.providers(op).iter().any(|p| p.name == provider))
    }

    pub(crate) fn entry(&self, op: &str) -> Result<Arc<OpEntry>, Vec<String>> {
        self.with_ops(|ops| match ops.get(op) {
            Some(entry) => Ok(Arc::clone(entry)),
            None => Err(ops.keys().map(|k| (*k).to_owned()).collect()),
        })
    }

    /// Runs `f` on the op table: the frozen one, or the current snapshot.
    #[inline]
    pub(crate) fn with_ops<R>(&self, f: impl FnOnce(&OpMap) -> R) -> R {
        match self.frozen.get() {
            Some(ops) => f(ops),
            None => f(&self.ops.load()),
        }
    }

    // --- freezing ---

    /// Freezes the registry: its ops and their providers are final from now on. Defining an op,
    /// registering a provider or replacing one afterwards fails with [`RegistryError::Frozen`];
    /// priorities may still be installed and overridden (they choose among the registered
    /// providers), and the selection record still counts. An engine freezes its registry once it has
    /// registered its own providers, before serving: a late registration is then an error at the
    /// place that made it rather than a change of the kernels running under its model. Freezing
    /// twice is harmless.
    ///
    /// ```
    /// use ir_core::{ImplSpec, RegistryError};
    /// let registry = ir_ops::registry();
    /// registry.freeze();
    /// let late = ir_ops::silu_and_mul::register(&registry, ImplSpec::new("late"), ir_ops::silu_and_mul::native);
    /// assert!(matches!(late, Err(RegistryError::Frozen { .. })));
    /// let _guard = registry.override_priority("silu_and_mul", &["native"])?; // still allowed
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn freeze(&self) {
        let _defining = lock(&self.defining);
        if self.frozen.set(self.ops.load_full()).is_ok() {
            tracing::debug!(target: "ir_core::registry", ops = self.ops.load().len(), "froze the registry");
        }
    }

    /// Whether the registry is frozen ([`Registry::freeze`]).
    pub fn is_frozen(&self) -> bool {
        self.frozen.get().is_some()
    }

    /// The definitions lock, unless the registry is frozen: then the change `describe` names is
    /// refused.
    fn unfrozen(&self, describe: impl FnOnce() -> String) -> Result<MutexGuard<'_, ()>, RegistryError> {
        let defining = lock(&self.defining);
        if self.is_frozen() {
            return Err(RegistryError::Frozen { change: describe() });
        }
        Ok(defining)
    }
}

/// Whether [`STRICT_ENV`] asks for strict registries: `1`, `true`, `yes`, `on` (any case, spaces
/// around ignored) ask for them; unset, empty, `0`, `false`, `no` and `off` do not; anything else is
/// [`RegistryError::InvalidEnv`]. Entry points that may fail (the `vllm-ir` crate's `registry()`,
/// the command line) call it first; [`Registry::new`], which cannot fail, logs the error and makes
/// the registry strict.
pub fn strict_from_env() -> Result<bool, RegistryError> {
    let Some(value) = std::env::var_os(STRICT_ENV) else { return Ok(false) };
    let invalid = || RegistryError::InvalidEnv { var: STRICT_ENV, value: value.to_string_lossy().into_owned() };
    let text = value.to_str().ok_or_else(invalid)?.trim();
    match text.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(invalid()),
    }
}

impl Default for Registry {
    fn default() -> Registry {
        Registry::new()
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry").field("ops", &self.ops()).finish()
    }
}

impl OpEntry {
    /// Publishes the top of the priority stack as the list dispatch reads (with an empty selection
    /// cache). Called with the priority stack's lock held, so publications follow the stack's order.
    pub(crate) fn publish(&self, top: Option<priority::Resolved>) {
        self.installed.store(top.map(Arc::new));
        self.shared.generation.advance();
    }

    /// Whether the registry refuses native fallbacks ([`Registry::set_strict`]).
    pub(crate) fn strict(&self) -> bool {
        self.shared.strict.load(Ordering::Relaxed)
    }

    /// Emits `message` at warn level unless this op already warned with `kind`.
    pub(crate) fn warn_once(&self, kind: &str, message: impl FnOnce() -> String) {
        let first = {
            let mut warned = lock(&self.warned);
            !warned.contains(kind) && warned.insert(kind.into())
        };
        if first {
            tracing::warn!(target: "ir_core::priority", op = self.def.name, "{}", message());
        }
    }
}

impl ImplEntry {
    /// Whether the probe says the provider can run here.
    pub(crate) fn is_available(&self) -> bool {
        matches!(self.availability(), Availability::Available)
    }

    /// The probe's answer, evaluated once; a panic inside the probe is reported as unavailable.
    pub(crate) fn availability(&self) -> &Availability {
        self.availability.get_or_init(|| {
            let answer = std::panic::catch_unwind(AssertUnwindSafe(|| (self.probe)()));
            let availability = answer.unwrap_or_else(|panic| {
                Availability::Unavailable(format!("availability probe panicked: {}", panic_message(&*panic)))
            });
            tracing::debug!(target: "ir_core::registry", provider = self.provider, ?availability, "probed availability");
            availability
        })
    }
}

impl ImplEntry {
    /// Runs the `supports` predicate (none: supported). The caller holds no registry lock; a panic
    /// in the predicate is a rejection that carries the panic message.
    pub(crate) fn check_supports(&self, args: &[crate::op::ArgMeta<'_>]) -> crate::Support {
        let Some(supports) = &self.supports else { return crate::Support::Yes };
        match std::panic::catch_unwind(AssertUnwindSafe(|| supports(args))) {
            Ok(verdict) => verdict,
            Err(panic) => crate::Support::No(std::borrow::Cow::Owned(format!(
                "supports predicate panicked: {}",
                panic_message(&*panic)
            ))),
        }
    }
}

/// A provider name with the life of the process: literals as they are; a name made at run time is
/// stored once (the same name registered again reuses it), so a process holds one copy per distinct
/// provider name it ever registered.
fn intern_provider_name(name: std::borrow::Cow<'static, str>) -> &'static str {
    static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    match name {
        std::borrow::Cow::Borrowed(name) => name,
        std::borrow::Cow::Owned(name) => {
            let mut names = lock(&NAMES);
            if let Some(&interned) = names.iter().find(|&&n| n == name) {
                return interned;
            }
            let interned: &'static str = Box::leak(name.into_boxed_str());
            names.push(interned);
            interned
        }
    }
}

/// The message of a caught panic payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// A parameter's string choices are spellable in the text format, and its default fits its kind.
fn check_param(def: &OpDef, param: &crate::op::ParamDef) -> Result<(), RegistryError> {
    if let ParamKind::Str(choices) | ParamKind::OptStr(choices) = param.kind {
        let spellable = |c: &str| !c.is_empty() && !c.chars().any(|ch| ch == '"' || ch == '\\' || ch.is_control());
        if let Some(choice) = choices.iter().find(|c| !spellable(c)) {
            return Err(RegistryError::InvalidChoice {
                op: def.name.to_owned(),
                param: param.name.to_owned(),
                choice: (*choice).to_owned(),
            });
        }
    }
    if !crate::op::default_fits(def.name, param) {
        return Err(RegistryError::InvalidDefault {
            op: def.name.to_owned(),
            param: param.name.to_owned(),
            kind: param.kind,
        });
    }
    Ok(())
}

fn check_name(kind: NameKind, name: &str) -> Result<(), RegistryError> {
    if is_valid_name(name) {
        return Ok(());
    }
    Err(RegistryError::InvalidName { kind, name: name.to_owned() })
}

// Locks are never held while user code (probes, predicates, kernels) runs, but a panic elsewhere
// must not make the registry unusable, so poisoning is ignored.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}
