//! `ir-core`: the mechanism of vllm-ir-rs, the API boundary an engine and a kernel crate program
//! against: the tensor model, how an op is declared ([`define_op!`], [`op::OpDef`], parameter
//! kinds), the registry of implementations, priorities and dispatch, execution contexts, the
//! built-in tensor operations and platforms. It declares no op of its own: the built-in ops
//! (`rms_norm`, `fused_add_rms_norm`, the gated activations, the fp8 quantizations, rotary) live in
//! `vllm-ir-ops`, what kernel crates share (standard predicates, row geometry, family launch
//! plumbing) in `vllm-ir-kernel-support`.
//!
//! An op is declared once with its semantics, a plain Rust reference registered as provider
//! `native`. Kernel crates register more implementations, each with an availability probe, a
//! metadata-only `supports` predicate and an in-place flag. A per-op priority list, installed from
//! a per-platform [`PriorityConfig`], picks the implementation for each call.
//!
//! Each public item has one path. At the root: the tensor types, the [`Registry`] and what running
//! an op through it takes ([`Call`], the errors, the selection record), the execution contexts models
//! are written against ([`ExecutionContext`], [`EagerContext`], [`OpCaller`]), platforms and
//! priority configuration ([`Platform`], [`PriorityConfig`]) and layouts ([`Layout`]). Modules: [`op`]
//! (how ops are declared and called), [`builtin`] (the built-in tensor operations), [`interop`]
//! (candle and DLPack tensors); for kernel crates [`storage`] (host and device buffers) and
//! [`stream`] (the caller's launch stream). [`testing`] holds test helpers; feature `testing` adds `Tensor::randn`
//! and the input generators (without it the generators say so), so engines do not depend on the
//! random-number crates.
//!
//! ```
//! use ir_core::op::{Activation, InputSpec, MetaError, Value, smallvec};
//! use ir_core::{DType, KernelError, Registry, Tensor};
//!
//! ir_core::define_op! {
//!     /// `negate(x) -> out`.
//!     op negate {
//!         def: NEGATE,
//!         args: NegateArgs,
//!         params: (x: Activation),
//!         outputs: Tensor,
//!         inplace: false,
//!         native: |x: &Tensor| -> Result<Tensor, KernelError> { Ok(x.scale(-1.0)?) },
//!         meta: |def, args| Ok(smallvec![args[0].tensor().ok_or(MetaError::Kind { op: def.name, param: "x" })?.clone()]),
//!         generate: |spec: &InputSpec| Ok(vec![Value::Tensor(Tensor::ones(spec.dtype, &[2, 4])?)]),
//!         tolerances: &[],
//!         description: "negation",
//!     }
//! }
//!
//! let registry = Registry::new();
//! registry.define_op(&NEGATE)?;
//! let x = Tensor::from_f32(DType::BF16, &[2, 2], &[1.0, -2.0, 0.5, 0.0])?;
//! let y = negate(&registry, &x)?;
//! assert_eq!(y.to_f64_vec()?, vec![-1.0, 2.0, -0.5, 0.0]);
//! // Only `native` is registered: the registry records the choice.
//! assert_eq!(registry.selection_record().selections("negate", "native"), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Logging
//!
//! Libraries only emit `tracing` events; binaries install a subscriber honouring `RUST_LOG`. Targets:
//! `ir_core::registry` (definitions, registrations, probes), `ir_core::priority` (resolution,
//! installed lists, the applied configuration, warnings), `ir_core::dispatch` (one debug event per
//! selection, naming the chosen provider and every rejected one with its reason).

pub mod builtin;
mod context;
mod define;
mod device;
mod dtype;
mod implementation;
pub mod interop;
mod layout;
mod meta;
pub mod op;
mod platform;
mod registry;
pub mod storage;
pub mod stream;
mod tensor;
pub mod testing;

/// What [`define_op!`] and [`str_enum!`] expand to: the parameter markers' and outputs' traits and
/// the compile-time helpers. Not an API: generated code names these, callers never need to.
#[doc(hidden)]
pub mod __macro_support {
    pub use crate::context::output_count;
    pub use crate::op::declare::{OpOutputs, OpParam, TensorRefs, count_donated, donated_names};
}

pub use crate::context::{CallArg, CallArgs, EagerContext, ExecutionContext, ExecutionContextExt, OpCaller, outputs};
pub use crate::device::{Device, DeviceKind, UnknownDevice};
pub use crate::dtype::{DType, Element, F8E4M3, F8E5M2, FP8_NAN, UnknownDType};
pub use crate::implementation::{Availability, ImplFunc, ImplSpec, Probe, Support, SupportsFn};
pub use crate::layout::{Layout, LayoutError, compact_strides, numel};
pub use crate::meta::{MAX_TENSOR_BYTES, TensorMeta};
pub use crate::op::error::{KernelError, OperandMismatch};
pub use crate::platform::{
    ConfigError, ConfigGuard, ConfigSources, OpPriority, PLATFORM_ENV, PRIORITY_ENV, Platform, PlatformChoice,
    PriorityConfig, ResolvedConfig, UserEntry, UserPriorities,
};
pub use crate::registry::{
    Call, CallError, Dispatch, NATIVE, NameKind, OpRecord, OpRef, PriorityError, PriorityGuard, ProviderInfo,
    ProviderRecord, RESERVED_PROVIDERS, Registry, RegistryError, Rejection, STRICT_ENV, Selection, SelectionRecord,
    merge_priorities, strict_from_env,
};
pub use crate::tensor::{
    AllcloseError, StorageId, Tensor, TensorError, UniqueTensor, allclose, bit_eq, shares_storage,
};
/// The `half` crate, whose `f16` and `bf16` are this crate's 16-bit element types.
pub use half;
