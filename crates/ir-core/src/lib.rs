//! `ir-core`: the tensor model, op definitions, the registry of implementations, priorities and
//! dispatch, and the native reference ops of vllm-ir-rs.
//!
//! An op (`rms_norm`, `fused_add_rms_norm`, `silu_and_mul`, `gelu_and_mul`, `gelu_and_mul_sparse`,
//! or one of an engine's own) is declared once ([`define_op!`]) with its semantics, a plain Rust
//! reference registered as provider `native`. Kernel crates register more implementations, each
//! with an availability probe, a metadata-only `supports` predicate and an in-place flag. A per-op
//! priority list, installed from a per-platform [`PriorityConfig`], picks the implementation for
//! each call.
//!
//! Modules for models and engines: [`op`] (declarations and typed calls), [`context`] (the
//! execution-context trait models are written against), [`builtin`] (the built-in tensor
//! operations), [`platform`]; the registry and tensor types at the root. Modules for kernel crates:
//! [`kernel`] (standard predicates, row geometry, device buffers) and [`storage`]. [`testing`] holds
//! test helpers; feature `testing` adds `Tensor::randn` and the ops' input generators (without it
//! the generators say so), so engines do not depend on the random-number crates.
//!
//! ```
//! use ir_core::op::Rounding;
//! use ir_core::op::fused_add_rms_norm;
//! use ir_core::op::rms_norm::rms_norm;
//! use ir_core::{DType, Registry, Tensor};
//!
//! let registry = Registry::with_builtin_ops();
//! let x = Tensor::from_f32(DType::BF16, &[2, 4], &[1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.25, 2.0])?;
//! let weight = Tensor::ones(DType::BF16, &[4]).unwrap();
//! let y = rms_norm(&registry, &x, Some(&weight), 1e-6, None)?;
//! assert_eq!(y.shape(), &[2, 4]);
//!
//! // `maybe_inplace` takes the activations by value: the caller donates them.
//! let residual = Tensor::zeros(DType::BF16, &[2, 4]).unwrap();
//! let (out, new_residual) =
//!     fused_add_rms_norm::maybe_inplace(&registry, x, residual, Some(&weight), 1e-6, None, Rounding::Exact)?;
//! assert!(ir_core::bit_eq(&out, &y));
//! assert_eq!(new_residual.shape(), &[2, 4]);
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
pub mod context;
mod device;
mod dtype;
mod implementation;
pub mod interop;
pub mod kernel;
pub mod layout;
mod meta;
pub mod op;
pub mod platform;
pub mod registry;
pub mod storage;
mod tensor;
pub mod testing;

pub use crate::builtin::{Builtin, BuiltinArg};
pub use crate::context::{CallArg, EagerContext, ExecutionContext};
pub use crate::device::{Device, DeviceKind, UnknownDevice};
pub use crate::dtype::{DType, Element, F8E4M3, F8E5M2, FP8_NAN, UnknownDType};
pub use crate::implementation::{
    Availability, ImplFunc, ImplSpec, KernelError, Probe, Support, SupportsFn, UniqueTensor,
};
pub use crate::interop::InteropError;
pub use crate::layout::{Layout, LayoutError};
pub use crate::meta::{MAX_TENSOR_BYTES, TensorMeta};
pub use crate::platform::{ConfigError, Platform, PriorityConfig};
pub use crate::registry::{
    CallError, NATIVE, NameKind, OpRecord, PriorityError, PriorityGuard, ProviderInfo, ProviderRecord,
    RESERVED_PROVIDERS, Registry, RegistryError, Rejection, Selected, Selection, SelectionRecord,
};
pub use crate::tensor::{AllcloseError, StorageId, Tensor, TensorError, allclose, bit_eq, shares_storage};
/// The `half` crate, whose `f16` and `bf16` are this crate's 16-bit element types.
pub use half;
