//! The error of a call: what dispatch refuses and why, named.

use crate::op::{BindError, MetaError};
use crate::{KernelError, TensorError, TensorMeta};

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
    /// ([`Registry::set_strict`](crate::Registry::set_strict)).
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
