//! CUDA devices, their streams and module caches, and device memory behind tensors.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError};
use ir_core::storage::{DeviceAllocator, DeviceBuffer, DeviceError};
use ir_core::{Availability, DType, Device, KernelError};

use crate::module::{KernelVariant, arch_for, compile_ptx, nvrtc_availability};
use ir_core::kernel::GatedKernel;

/// One CUDA device: its context, the stream every operation of this crate uses, and compiled kernels.
pub struct CudaDeviceState {
    ordinal: usize,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Option<&'static str>,
    functions: Mutex<HashMap<KernelVariant, CudaFunction>>,
    gated_functions: Mutex<HashMap<(&'static str, DType), CudaFunction>>,
}

impl std::fmt::Debug for CudaDeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDeviceState").field("ordinal", &self.ordinal).field("arch", &self.arch).finish()
    }
}

static DEVICES: OnceLock<Result<Vec<Arc<CudaDeviceState>>, String>> = OnceLock::new();

/// Whether the driver loads and at least one device exists, and NVRTC loads. Never panics.
pub fn availability() -> Availability {
    match devices() {
        Ok(_) => nvrtc_availability(),
        Err(reason) => Availability::Unavailable(reason),
    }
}

/// The devices of this machine, initialized once.
pub fn devices() -> Result<&'static [Arc<CudaDeviceState>], String> {
    let devices = DEVICES.get_or_init(|| {
        let found =
            std::panic::catch_unwind(init_devices).unwrap_or_else(|_| Err("the CUDA driver panicked".to_owned()));
        match &found {
            Ok(devices) => tracing::info!(target: "kernels_cuda", count = devices.len(), "CUDA devices found"),
            Err(reason) => tracing::debug!(target: "kernels_cuda", reason = reason.as_str(), "CUDA unavailable"),
        }
        found
    });
    devices.as_deref().map_err(Clone::clone)
}

fn init_devices() -> Result<Vec<Arc<CudaDeviceState>>, String> {
    // Every driver call panics when cudarc cannot find the library, so probe first: with this
    // crate's default `dynamic-loading`, by cudarc's own search; with the engine's cudarc choice
    // (which may load or link the driver), by opening it ourselves.
    #[cfg(feature = "dynamic-loading")]
    // SAFETY: `is_culib_present` only tries to open the driver library by its candidate names.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    #[cfg(not(feature = "dynamic-loading"))]
    let present = crate::module::library_present(&["libcuda.so.1", "libcuda.so", "nvcuda.dll"]);
    if !present {
        return Err("libcuda.so not found".to_owned());
    }
    let count = CudaContext::device_count().map_err(|e| format!("cuInit or cuDeviceGetCount failed: {e}"))?;
    if count < 1 {
        return Err("no CUDA device".to_owned());
    }
    (0..count as usize)
        .map(|ordinal| {
            let context =
                CudaContext::new(ordinal).map_err(|e| format!("creating a context on cuda:{ordinal}: {e}"))?;
            let stream = context.new_stream().map_err(|e| format!("creating a stream on cuda:{ordinal}: {e}"))?;
            let (major, minor) = context.compute_capability().map_err(|e| format!("cuda:{ordinal}: {e}"))?;
            let arch = arch_for(major, minor);
            Ok(Arc::new(CudaDeviceState {
                ordinal,
                context,
                stream,
                arch,
                functions: Mutex::new(HashMap::new()),
                gated_functions: Mutex::new(HashMap::new()),
            }))
        })
        .collect()
}

impl CudaDeviceState {
    /// The device index.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The stream every kernel, copy and allocation of this crate uses on this device.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's name and compute capability, for benchmark headers.
    pub fn describe(&self) -> String {
        let name = self.context.name().unwrap_or_else(|e| format!("unknown ({e})"));
        let arch = self.arch.unwrap_or("no matching arch");
        format!("{name} (cuda:{}, {arch})", self.ordinal)
    }

    /// The kernel for `variant`, compiled and loaded at first use.
    pub(crate) fn function(&self, variant: &KernelVariant) -> Result<CudaFunction, KernelError> {
        let mut functions = self.functions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(function) = functions.get(variant) {
            return Ok(function.clone());
        }
        let ptx = compile_ptx(variant, self.arch)?;
        let module = self.context.load_module(ptx).map_err(driver_error)?;
        let function = module.load_function(&variant.kernel_name()).map_err(driver_error)?;
        tracing::debug!(target: "kernels_cuda", %variant, ordinal = self.ordinal, "loaded kernel");
        functions.insert(*variant, function.clone());
        Ok(function)
    }

    /// The kernel of a gated op for `dtype`, compiled and loaded at first use.
    pub(crate) fn gated_function(&self, op: &GatedKernel, dtype: DType) -> Result<CudaFunction, KernelError> {
        let mut functions = self.gated_functions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(function) = functions.get(&(op.def.name, dtype)) {
            return Ok(function.clone());
        }
        tracing::debug!(target: "kernels_cuda", op = op.def.name, %dtype, arch = ?self.arch, "compiling with NVRTC");
        let ptx = crate::gated::compile_ptx(op, dtype, self.arch)?;
        let module = self.context.load_module(ptx).map_err(driver_error)?;
        let function = module.load_function(&op.kernel_name(dtype)).map_err(driver_error)?;
        functions.insert((op.def.name, dtype), function.clone());
        Ok(function)
    }

    fn allocate(self: &Arc<Self>, len_bytes: usize) -> Result<CudaBuffer, DeviceError> {
        // Zero-byte allocations are not allowed by the driver; keep one byte and report the real size.
        let slice = self.stream.alloc_zeros::<u8>(len_bytes.max(1)).map_err(|e| self.device_error("allocate", e))?;
        Ok(CudaBuffer { slice, len_bytes, device: Arc::clone(self) })
    }

    fn device_error(&self, operation: &'static str, error: DriverError) -> DeviceError {
        DeviceError { device: Device::Cuda(self.ordinal as u32), operation, message: error.to_string() }
    }
}

/// Allocates tensors on one CUDA device.
#[derive(Clone, Debug)]
pub struct CudaAllocator {
    device: Arc<CudaDeviceState>,
}

/// An allocator for `cuda:<ordinal>`, or why there is none.
pub fn allocator(ordinal: usize) -> Result<CudaAllocator, String> {
    let devices = devices()?;
    let device = devices.get(ordinal).ok_or_else(|| format!("no device cuda:{ordinal} ({} found)", devices.len()))?;
    Ok(CudaAllocator { device: Arc::clone(device) })
}

impl DeviceAllocator for CudaAllocator {
    fn device(&self) -> Device {
        Device::Cuda(self.device.ordinal as u32)
    }

    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate(len_bytes)?))
    }
}

/// Device memory of one tensor storage.
pub struct CudaBuffer {
    pub(crate) slice: CudaSlice<u8>,
    len_bytes: usize,
    pub(crate) device: Arc<CudaDeviceState>,
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBuffer(cuda:{}, {} bytes)", self.device.ordinal, self.len_bytes)
    }
}

impl DeviceBuffer for CudaBuffer {
    fn device(&self) -> Device {
        Device::Cuda(self.device.ordinal as u32)
    }

    fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    fn download(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        if self.len_bytes == 0 {
            return Ok(());
        }
        let stream = &self.device.stream;
        stream
            .memcpy_dtoh(&self.slice.slice(..self.len_bytes), dst)
            .map_err(|e| self.device.device_error("download", e))?;
        stream.synchronize().map_err(|e| self.device.device_error("download", e))
    }

    fn upload(&mut self, src: &[u8]) -> Result<(), DeviceError> {
        if src.is_empty() {
            return Ok(());
        }
        let stream = Arc::clone(&self.device.stream);
        stream
            .memcpy_htod(src, &mut self.slice.slice_mut(..src.len()))
            .map_err(|e| self.device.device_error("upload", e))?;
        stream.synchronize().map_err(|e| self.device.device_error("upload", e))
    }

    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate(len_bytes)?))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub(crate) fn driver_error(error: DriverError) -> KernelError {
    KernelError::Driver { backend: "cuda", message: error.to_string() }
}
