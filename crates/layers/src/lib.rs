//! `layers`: model layers built on `ir-core`, generic over the execution context.
//!
//! The same layer code runs eagerly ([`ir_core::EagerContext`]) or is traced into a graph; it holds no
//! kernel code and no dispatch logic. Layers: [`RmsNorm`], the gated activations ([`SiluAndMul`],
//! [`GeluAndMul`], [`GeluAndMulSparse`]; [`gate_up_weight`] stacks a checkpoint's gate and up
//! weights into the one projection they take), fp8 quantization ([`QuantFp8`]) and
//! [`RotaryEmbedding`] (from a base, with a checkpoint's [`RopeScaling`]: linear, dynamic NTK,
//! Llama 3 or YaRN, or over a given cos/sin cache); [`toy::ToyDecoder`] composes them into a
//! Llama-shaped block for demos and benchmarks. `RmsNorm`'s default weight takes each call's
//! activation dtype; a loaded weight of another dtype (Gemma's f32 `1 + w`) is applied in its own.
//!
//! ```
//! use ir_core::{DType, EagerContext, Registry, Tensor};
//! use layers::RmsNorm;
//!
//! let registry = ir_ops::registry();
//! let ctx = EagerContext::new(&registry);
//! let norm = RmsNorm::builder(8).dtype(DType::BF16).build()?;
//! let x = Tensor::ones(DType::BF16, &[2, 8]).unwrap();
//! let residual = Tensor::zeros(DType::BF16, &[2, 8]).unwrap();
//! let y = norm.forward(&ctx, &x)?;
//! // x and residual are donated: the in-place kernel may reuse their memory.
//! let (out, new_residual) = norm.forward_residual(&ctx, x, residual)?;
//! assert!(ir_core::bit_eq(&out, &y));
//! # let _ = new_residual;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Logging
//!
//! `layers` emits no events of its own; the ops it calls log on `ir_core::dispatch`.

mod activation;
mod error;
mod quant;
mod rms_norm;
mod rope;
mod rotary;
pub mod toy;

pub use crate::activation::{GeluAndMul, GeluAndMulSparse, SiluAndMul, gate_up_weight};
pub use crate::error::{LayerError, RopeScalingError};
pub use crate::quant::{QuantFp8, QuantScale};
pub use crate::rms_norm::{RmsNorm, RmsNormBuilder};
pub use crate::rope::{RopeScaling, inverse_frequencies, rope_cache};
pub use crate::rotary::RotaryEmbedding;
pub use ir_ops::Rounding;
