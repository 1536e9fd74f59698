//! `vllm-ir`: the one dependency an inference engine adds. It re-exports the op layer (`ir-core`:
//! tensors, ops, the registry, priorities, execution contexts), the layers, the graph IR and the
//! passes, the kernel providers its features enable (`cpu` by default; `cuda`, `rocm`, `xpu`), and
//! the external crates their APIs expose (`half`). One call, [`registry()`], gives a registry with
//! every op, every provider of this build registered, and the platform's priorities installed, so
//! the first call already runs the fast kernel.
//!
//! ```
//! use vllm_ir::layers::{RmsNorm, SiluAndMul};
//! use vllm_ir::{DType, EagerContext, Tensor};
//!
//! let registry = vllm_ir::registry()?;
//! let ctx = EagerContext::new(&registry);
//! let x = Tensor::from_vec(&[2, 8], vec![vllm_ir::half::bf16::ONE; 16])?;
//! let y = RmsNorm::builder(8).dtype(DType::BF16).build()?.forward(&ctx, &x)?;
//! let gated = SiluAndMul.forward(&ctx, &y)?;
//! assert_eq!(gated.shape(), &[2, 4]);
//! // The cpu provider ran both ops (the registry records every choice).
//! assert_eq!(registry.selection_record().selections("rms_norm", "cpu"), 1);
//! assert_eq!(registry.selection_record().selections("silu_and_mul", "cpu"), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Priorities: [`registry()`] applies the detected platform's lists with `VLLM_IR_PLATFORM` and
//! `VLLM_IR_PRIORITY` on top (your entries first, the platform's after); [`registry_with`] takes a
//! configuration from code instead. `Registry::override_priority` installs a list for a scope.
//!
//! Host memory: freed host buffers of at least 1 MiB are kept for the next allocation of the same
//! dtype and size, up to 1 GiB by default; [`registry()`] applies `VLLM_IR_HOST_POOL_MIB` (`0` turns
//! the pool off), code calls [`storage::set_host_pool_capacity`].

pub use ir_core::*;

/// The ops: how one is declared (`ir-core`'s [`OpDef`](ir_core::op::OpDef), parameter kinds,
/// argument values) and the built-in ops themselves (`ir-ops`: one module per op, with its typed
/// calls, its semantics and [`Rounding`](ir_ops::Rounding)), in one place.
pub mod op {
    /// `ir_ops::registry()` (the ops with `native` only) would otherwise be reachable here as
    /// `op::registry`, a name an engine would read as the facade's [`registry()`](crate::registry);
    /// the name means the facade's function here too.
    #[doc(hidden)]
    pub use crate::registry;
    pub use ir_core::op::*;
    pub use ir_ops::*;
}

/// Exchanging tensors with other libraries (`ir-core`'s candle and DLPack conversions) and, with
/// feature `candle`, the ops on candle tensors (`candle_ops`).
pub mod interop {
    pub use ir_core::interop::*;
    #[cfg(feature = "candle")]
    pub use ir_ops::candle_ops;
}

/// The graph IR: graphs, the text format, the verifier, the interpreter and the tracer.
pub use ir_graph as graph;
/// The passes: functionalization, lowering, clone elimination, DCE and the pipeline.
pub use ir_passes as passes;
/// Model layers, generic over the execution context.
pub use layers;

#[cfg(feature = "cpu")]
pub use kernels_cpu;
#[cfg(feature = "cuda")]
pub use kernels_cuda;
#[cfg(feature = "rocm")]
pub use kernels_rocm;
#[cfg(feature = "xpu")]
pub use kernels_xpu;

/// Why a registry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A provider could not be registered.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The priority configuration is invalid or does not resolve.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `VLLM_IR_HOST_POOL_MIB` is not a whole number of MiB.
    #[error("{HOST_POOL_ENV}={value:?} is not a whole number of MiB (0 turns the host buffer pool off)")]
    HostPool {
        /// The value given.
        value: String,
    },
}

/// The environment variable [`registry()`] reads for the host buffer pool's bound, in MiB.
pub const HOST_POOL_ENV: &str = "VLLM_IR_HOST_POOL_MIB";

/// A registry with every built-in op, every provider this build enables registered (those that
/// cannot run here are registered and say why), and the priorities of `VLLM_IR_PLATFORM` (or the
/// detected platform) with `VLLM_IR_PRIORITY`'s entries first, installed; `VLLM_IR_HOST_POOL_MIB`,
/// when set, bounds the host buffer pool.
pub fn registry() -> Result<Registry, SetupError> {
    if let Ok(value) = std::env::var(HOST_POOL_ENV) {
        storage::set_host_pool_capacity(host_pool_bytes(&value)?);
    }
    registry_with(PriorityConfig::from_env()?)
}

/// The host pool's bound in bytes from `VLLM_IR_HOST_POOL_MIB`'s value.
fn host_pool_bytes(value: &str) -> Result<usize, SetupError> {
    let mib: usize = value.trim().parse().map_err(|_| SetupError::HostPool { value: value.to_owned() })?;
    Ok(mib.saturating_mul(1 << 20))
}

/// [`registry()`] with a configuration from code; reads no environment variable but
/// `VLLM_IR_STRICT` (every registry does), whose value must be a boolean.
pub fn registry_with(config: PriorityConfig) -> Result<Registry, SetupError> {
    // The registry reads `VLLM_IR_STRICT` when it is created: a value it does not take is an error.
    ir_core::registry::strict_from_env()?;
    let registry = ir_ops::registry();
    register_providers(&registry)?;
    config.apply(&registry)?;
    Ok(registry)
}

/// Registers every provider this build enables into `registry`.
pub fn register_providers(registry: &Registry) -> Result<(), RegistryError> {
    #[cfg(feature = "cpu")]
    kernels_cpu::register(registry)?;
    #[cfg(feature = "cuda")]
    kernels_cuda::register(registry)?;
    #[cfg(feature = "rocm")]
    kernels_rocm::register(registry)?;
    #[cfg(feature = "xpu")]
    kernels_xpu::register(registry)?;
    let _ = registry;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_registry_is_the_facade_registry() {
        // `ir_ops::registry()` has native only; through the facade the name gives the providers.
        let via_op: fn() -> Result<Registry, SetupError> = op::registry;
        let registry = via_op().unwrap();
        assert!(registry.providers("rms_norm").iter().any(|p| p.name == "cpu"), "the cpu provider is registered");
    }

    #[test]
    fn one_call_installs_the_fast_provider_first() {
        let registry = registry_with(PriorityConfig::platform_default(Platform::Cpu)).unwrap();
        for op in registry.ops() {
            let list = registry.installed_priority(op).expect("every op has a list");
            assert_eq!(list.first(), Some(&"cpu"), "{op}: {list:?}");
        }
        let x = Tensor::from_vec(&[4, 64], vec![half::bf16::from_f32(0.5); 256]).unwrap();
        let out = op::rms_norm::rms_norm(&registry, &x, None, 1e-6, None).unwrap();
        assert_eq!(out.shape(), &[4, 64]);
        assert_eq!(registry.selection_record().selections("rms_norm", "cpu"), 1, "the cpu kernel ran");
        assert_eq!(registry.selection_record().selections("rms_norm", "native"), 0);
    }

    #[test]
    fn the_host_pool_bound_is_a_number_of_mib() {
        assert_eq!(host_pool_bytes("512").unwrap(), 512 << 20);
        assert_eq!(host_pool_bytes(" 0 ").unwrap(), 0);
        let err = host_pool_bytes("lots").unwrap_err();
        assert_eq!(
            err.to_string(),
            "VLLM_IR_HOST_POOL_MIB=\"lots\" is not a whole number of MiB (0 turns the host buffer pool off)"
        );
    }

    #[test]
    fn a_bad_configuration_is_an_error_naming_it() {
        let config = PriorityConfig::from_sources(&platform::ConfigSources {
            env_priority: Some("rms_norm=warp_drive".to_owned()),
            env_platform: Some("cpu".to_owned()),
            cli_priority: None,
            cli_platform: None,
        })
        .unwrap();
        let err = registry_with(config).unwrap_err().to_string();
        assert!(err.contains("warp_drive"), "{err}");
    }
}
