//! `vllm-ir-bench`: the performance suite of vllm-ir-rs.
//!
//! The criterion benchmarks under `benches/` measure four things, each beside a baseline measured in
//! the same run, because machines are noisy and only ratios travel between them:
//!
//! - `kernels`: every op the registry defines × every available provider at the decode and prefill
//!   shapes in f32, f16 and bf16, from each op's input generator, as throughput from the bytes each
//!   call moves ([`kernels::bytes_moved`]), beside a plain copy of the activation bytes and
//!   (feature `candle`, norms only) candle-nn's CPU `rms_norm` on the same data, and (norm +
//!   quantization ops) the unfused pair on the cpu provider ([`unfused`]);
//! - `dispatch`: `rms_norm` through the registry against the selected kernel called directly, and
//!   selection alone;
//! - `passes`: the standard pipeline on generated decoder graphs of 1k to 1M nodes ([`decoder`]);
//! - `memory`: the interpreter's statistics for the traced decoder before and after the pipeline
//!   ([`memory`]), written as JSON (not timed).
//!
//! `cargo xtask bench [--quick]` runs them and writes `docs/benchmarks.md` with plots. This library
//! holds what the benchmarks share, so its pieces (input generation, correctness checks, the copy
//! baseline, the graph generator, the memory study) are unit-tested by `cargo test --workspace`;
//! candle is compiled only with the `candle` feature, which tests never turn on.

pub mod cases;
pub mod decoder;
pub mod kernels;
pub mod memory;
pub mod output;
pub mod unfused;

#[cfg(feature = "candle")]
mod candle;

/// Why a benchmark could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The registry refused a registration or a priority list.
    #[error(transparent)]
    Registry(#[from] ir_core::RegistryError),
    /// A priority list could not be installed.
    #[error(transparent)]
    Priority(#[from] ir_core::PriorityError),
    /// A call failed.
    #[error(transparent)]
    Call(#[from] ir_core::CallError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] ir_core::KernelError),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] ir_core::TensorError),
    /// A layer refused its configuration.
    #[error(transparent)]
    Layer(#[from] layers::LayerError),
    /// The pass pipeline failed.
    #[error(transparent)]
    Pipeline(#[from] ir_passes::PipelineError),
    /// The interpreter failed.
    #[error(transparent)]
    Interp(#[from] ir_graph::InterpError),
    /// A provider's result differs from native's beyond the op's tolerance.
    #[error("{provider} {case}: result differs from native: {detail}")]
    Mismatch {
        /// The provider.
        provider: String,
        /// The benchmark case.
        case: String,
        /// What differs.
        detail: String,
    },
    /// A provider's predicate rejects the case (it would fall back to another provider).
    #[error("{provider} {case}: rejected by its predicate: {reason}")]
    Rejected {
        /// The provider.
        provider: String,
        /// The benchmark case.
        case: String,
        /// The predicate's reason.
        reason: String,
    },
    /// A provider cannot run here (no device, no driver) or is not built in.
    #[error("{provider}: {reason}")]
    Unavailable {
        /// The provider.
        provider: String,
        /// Why.
        reason: String,
    },
    /// Writing results failed.
    #[error("writing {path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        message: String,
    },
}
