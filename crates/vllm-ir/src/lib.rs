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
#[non_exhaustive]
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

/// A frozen registry with every built-in op, every provider this build enables registered (those
/// that cannot run here are registered and say why), and the priorities of `VLLM_IR_PLATFORM` (or
/// the detected platform) with `VLLM_IR_PRIORITY`'s entries first, installed;
/// `VLLM_IR_HOST_POOL_MIB`, when set, bounds the host buffer pool. Frozen: no op or provider can be
/// added (priorities can still be overridden); an engine that registers its own builds with
/// [`RegistryBuilder`].
pub fn registry() -> Result<Registry, SetupError> {
    RegistryBuilder::new()?.build()
}

/// The host pool's bound in bytes from `VLLM_IR_HOST_POOL_MIB`'s value.
fn host_pool_bytes(value: &str) -> Result<usize, SetupError> {
    let mib: usize = value.trim().parse().map_err(|_| SetupError::HostPool { value: value.to_owned() })?;
    Ok(mib.saturating_mul(1 << 20))
}

/// [`registry()`] with a configuration from code; reads no environment variable but
/// `VLLM_IR_STRICT` (every registry does), whose value must be a boolean. Frozen, as
/// [`registry()`]'s.
pub fn registry_with(config: PriorityConfig) -> Result<Registry, SetupError> {
    RegistryBuilder::new()?.config(config).build()
}

/// Builds what [`registry()`] gives with an engine's own ops and providers added first: `new` defines
/// every built-in op and registers every provider of this build; define and register yours on
/// [`RegistryBuilder::registry`]; `build` installs the priorities (which may name your providers)
/// and freezes.
///
/// ```
/// use vllm_ir::ImplSpec;
/// use vllm_ir::op::silu_and_mul;
///
/// let builder = vllm_ir::RegistryBuilder::new()?;
/// silu_and_mul::register(builder.registry(), ImplSpec::new("engine"), silu_and_mul::native)?;
/// let registry = builder.build()?;
/// assert!(registry.is_frozen());
/// let _engine_first = registry.override_priority("silu_and_mul", &["engine"])?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct RegistryBuilder {
    registry: Registry,
    config: Option<PriorityConfig>,
}

impl RegistryBuilder {
    /// Every built-in op defined and every provider of this build registered; no priorities
    /// installed yet, not frozen. Fails when `VLLM_IR_STRICT` holds a value that is no boolean.
    pub fn new() -> Result<RegistryBuilder, SetupError> {
        // The registry reads `VLLM_IR_STRICT` when it is created: a value it does not take is an error.
        ir_core::strict_from_env()?;
        let registry = ir_ops::registry();
        register_providers(&registry)?;
        Ok(RegistryBuilder { registry, config: None })
    }

    /// The registry being built: define your ops and register your providers on it.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Priorities from code: `build` installs `config` and reads no environment variable but
    /// `VLLM_IR_STRICT` (as [`registry_with`]). Without it, `build` reads the environment as
    /// [`registry()`] does.
    pub fn config(mut self, config: PriorityConfig) -> RegistryBuilder {
        self.config = Some(config);
        self
    }

    /// Installs the priorities and freezes the registry.
    pub fn build(self) -> Result<Registry, SetupError> {
        let config = match self.config {
            Some(config) => config,
            None => {
                if let Ok(value) = std::env::var(HOST_POOL_ENV) {
                    storage::set_host_pool_capacity(host_pool_bytes(&value)?);
                }
                PriorityConfig::from_env()?
            }
        };
        config.apply(&self.registry)?;
        self.registry.freeze();
        Ok(self.registry)
    }
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
    fn the_facades_registries_come_out_frozen_and_the_builder_takes_an_engines_provider_first() {
        let registry = registry_with(PriorityConfig::platform_default(Platform::Cpu)).unwrap();
        assert!(registry.is_frozen());
        let late = op::silu_and_mul::register(&registry, ImplSpec::new("late"), op::silu_and_mul::native);
        assert!(matches!(late, Err(RegistryError::Frozen { .. })), "{late:?}");

        let builder = RegistryBuilder::new().unwrap();
        assert!(!builder.registry().is_frozen());
        op::silu_and_mul::register(builder.registry(), ImplSpec::new("engine"), op::silu_and_mul::native).unwrap();
        // The configuration may name the engine's provider: it is installed after registration (a
        // provider without a predicate takes every call, so the list ends with it).
        let config = PriorityConfig::from_sources(&ConfigSources {
            env_priority: Some("silu_and_mul=engine,cpu".to_owned()),
            env_platform: Some("cpu".to_owned()),
            ..Default::default()
        })
        .unwrap();
        let registry = builder.config(config).build().unwrap();
        assert!(registry.is_frozen());
        let installed = registry.installed_priority("silu_and_mul").unwrap();
        assert_eq!(installed.first(), Some(&"engine"), "{installed:?}");
        op::silu_and_mul::silu_and_mul(&registry, &Tensor::ones(DType::F32, &[2, 8]).unwrap()).unwrap();
        assert_eq!(registry.selection_record().selections("silu_and_mul", "engine"), 1);
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
        let config = PriorityConfig::from_sources(&ConfigSources {
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
