//! Shared helpers of the cross-crate tests: an out-of-tree in-place provider registered through the
//! public API, and the backends the kernel harness runs on.

use std::sync::Arc;

use ir_core::storage::DeviceAllocator;
use ir_core::{DType, ImplSpec, KernelError, Registry, RegistryError, Tensor, TensorError, UniqueTensor};
use ir_ops::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
use kernel_support::KernelDTypes;

/// Computes native's values and writes them into the donated buffers.
pub fn inplace_fused_add_rms_norm(
    x: UniqueTensor,
    residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let (out, residual_out) =
        fused_add_rms_norm::native(x.tensor(), residual.tensor(), weight, epsilon, variance_size, rounding)?;
    let (mut x, mut residual) = (x.into_tensor(), residual.into_tensor());
    x.copy_from(&out)?;
    residual.copy_from(&residual_out)?;
    Ok((x, residual))
}

/// Registers [`inplace_fused_add_rms_norm`] under `provider`.
pub fn register_inplace_provider(registry: &Registry, provider: &'static str) -> Result<(), RegistryError> {
    fused_add_rms_norm::register(
        registry,
        ImplSpec::new(provider),
        FusedAddRmsNormImpl::inplace(inplace_fused_add_rms_norm),
    )
}

/// How much of the numeric grid a backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// Every token count.
    Full,
    /// Token counts {1, 7, 257} only (slow emulated devices such as PoCL).
    Subset,
}

/// A kernel provider the harness tests: a registry with it installed first, and where its tensors live.
pub struct Backend {
    /// Provider name.
    pub provider: &'static str,
    /// A registry with the built-in ops and this provider registered.
    pub registry: Registry,
    /// Allocator of the provider's device; `None` for the CPU.
    pub allocator: Option<Arc<dyn DeviceAllocator>>,
    /// How much of the grid to run.
    pub grid: Grid,
    /// The element dtypes the provider's kernels compute on (f64 only where they take it).
    pub dtypes: KernelDTypes,
}

impl Backend {
    /// The element dtypes to test the provider's kernels on: f32, f16, bf16, and f64 where its
    /// kernels compute on it.
    pub fn element_dtypes(&self) -> Vec<DType> {
        let mut dtypes = vec![DType::F32, DType::F16, DType::BF16];
        if self.dtypes == KernelDTypes::WithF64 {
            dtypes.push(DType::F64);
        }
        dtypes
    }

    /// Moves a host tensor to this backend's device in a fresh storage, keeping its layout (strides
    /// and offset: a padded view stays padded, so kernels see the layouts the tests give them).
    pub fn upload(&self, t: &Tensor) -> Result<Tensor, TensorError> {
        let host = t.deep_clone_same_layout()?;
        let Some(allocator) = &self.allocator else { return Ok(host) };
        let buffer = host.cpu_buffer().expect("a host copy");
        let mut device = allocator.allocate(buffer.len_bytes())?;
        device.upload(buffer.bytes())?;
        Tensor::from_storage(ir_core::storage::Storage::Device(device), host.dtype(), host.layout().clone())
    }
}

/// Every kernel backend this machine can run. Backends that cannot run here print `skipped: <reason>`
/// (a failure instead when `VLLM_IR_REQUIRE` names them).
pub fn backends() -> Vec<Backend> {
    let cpu = ir_ops::registry();
    kernels_cpu::register(&cpu).expect("the cpu provider registers once");
    let mut backends = vec![Backend {
        provider: kernels_cpu::PROVIDER,
        registry: cpu,
        allocator: None,
        grid: Grid::Full,
        dtypes: KernelDTypes::Reduced,
    }];

    match kernels_cuda::availability() {
        ir_core::Availability::Available => {
            let registry = ir_ops::registry();
            kernels_cuda::register(&registry).expect("the cuda provider registers once");
            let allocator = kernels_cuda::allocator(0).expect("an available provider has device 0");
            backends.push(Backend {
                provider: kernels_cuda::PROVIDER,
                registry,
                allocator: Some(Arc::new(allocator)),
                grid: Grid::Full,
                dtypes: kernels_cuda::KERNEL_DTYPES,
            });
        }
        ir_core::Availability::Unavailable(reason) => {
            ir_core::testing::skip("cuda", &format!("cuda kernels: {reason}"))
        }
    }

    match kernels_cuda::emu::availability() {
        ir_core::Availability::Available => {
            let registry = ir_ops::registry();
            kernels_cuda::emu::register(&registry).expect("the emulated cuda provider registers once");
            backends.push(Backend {
                provider: kernels_cuda::emu::PROVIDER,
                registry,
                allocator: Some(Arc::new(kernels_cuda::emu::allocator())),
                grid: Grid::Subset,
                dtypes: kernels_cuda::KERNEL_DTYPES,
            });
        }
        ir_core::Availability::Unavailable(reason) => {
            ir_core::testing::skip("cxx", &format!("emulated cuda kernels: {reason}"))
        }
    }

    match kernels_rocm::emu::availability() {
        ir_core::Availability::Available => {
            let wave64 = ir_ops::registry();
            kernels_rocm::emu::register(&wave64).expect("the emulated hip provider registers once");
            backends.push(Backend {
                provider: kernels_rocm::emu::PROVIDER,
                registry: wave64,
                allocator: Some(Arc::new(kernels_rocm::emu::allocator())),
                grid: Grid::Subset,
                dtypes: kernels_rocm::KERNEL_DTYPES,
            });
            let wave32 = ir_ops::registry();
            kernels_rocm::emu::register_wave32(&wave32).expect("the emulated hip provider registers once");
            backends.push(Backend {
                provider: kernels_rocm::emu::PROVIDER_WAVE32,
                registry: wave32,
                allocator: Some(Arc::new(kernels_rocm::emu::allocator_wave32())),
                grid: Grid::Subset,
                dtypes: kernels_rocm::KERNEL_DTYPES,
            });
        }
        ir_core::Availability::Unavailable(reason) => {
            ir_core::testing::skip("cxx", &format!("emulated hip kernels: {reason}"))
        }
    }

    match kernels_rocm::availability() {
        ir_core::Availability::Available => {
            let registry = ir_ops::registry();
            kernels_rocm::register(&registry).expect("the rocm provider registers once");
            let allocator = kernels_rocm::allocator().expect("an available provider has device 0");
            backends.push(Backend {
                provider: kernels_rocm::PROVIDER,
                registry,
                allocator: Some(Arc::from(allocator)),
                grid: Grid::Full,
                dtypes: kernels_rocm::KERNEL_DTYPES,
            });
        }
        ir_core::Availability::Unavailable(reason) => {
            ir_core::testing::skip("rocm", &format!("rocm kernels: {reason}"))
        }
    }

    match kernels_xpu::availability() {
        ir_core::Availability::Available => {
            let registry = ir_ops::registry();
            kernels_xpu::register(&registry).expect("the xpu provider registers once");
            let allocator = kernels_xpu::allocator().expect("an available provider has a device");
            // A CPU OpenCL device (PoCL) is slow: it runs the subset of the grid.
            let grid = if kernels_xpu::is_gpu() { Grid::Full } else { Grid::Subset };
            backends.push(Backend {
                provider: kernels_xpu::PROVIDER,
                registry,
                allocator: Some(Arc::new(allocator)),
                grid,
                dtypes: kernels_xpu::kernel_dtypes(),
            });
        }
        ir_core::Availability::Unavailable(reason) => ir_core::testing::skip("xpu", &format!("xpu kernels: {reason}")),
    }
    backends
}

/// Runs `test` on every device backend this machine has, with the priorities an engine on its
/// platform gets (its provider first, then native); says so when there is none.
pub fn on_each_device(what: &str, mut test: impl FnMut(&Backend)) {
    let mut ran = 0;
    for backend in backends() {
        if backend.allocator.is_none() {
            continue;
        }
        match ir_core::Platform::ALL.into_iter().find(|p| p.provider() == backend.provider) {
            Some(platform) => {
                let config = ir_core::PriorityConfig::platform_default(platform);
                let _priorities = config.apply_scoped(&backend.registry).unwrap();
                test(&backend);
            }
            // An emulated device has no platform of its own: its provider, then native, for every op.
            None => {
                let _priorities: Vec<_> = ir_ops::BUILTIN_OPS
                    .iter()
                    .map(|op| backend.registry.override_priority(op.name, &[backend.provider, "native"]).unwrap())
                    .collect();
                test(&backend);
            }
        }
        ran += 1;
    }
    if ran == 0 {
        ir_core::testing::skip("device", &format!("no device backend on this machine: {what} not run on one"));
    }
}
