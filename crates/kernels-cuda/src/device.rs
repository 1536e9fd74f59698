//! CUDA devices, their streams and module caches, and device memory behind tensors.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
    SyncOnDrop,
};
use ir_core::storage::{DeviceAllocator, DeviceBuffer, DeviceError};
use ir_core::{Availability, DType, Device, KernelError};

use crate::module::{KernelVariant, NormProgram, arch_for, compile_ptx, nvrtc_availability};
use kernel_support::gpu::Fill;

/// One CUDA device: its context, the stream every operation of this crate uses, and compiled kernels.
pub struct CudaDeviceState {
    ordinal: usize,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub(crate) arch: Option<&'static str>,
    norms: Mutex<KernelCache<NormProgram, KernelVariant>>,
    op_kernels: Mutex<KernelCache<ProgramKey, FunctionKey>>,
    generated: Mutex<kernel_support::program::GeneratedKernels<CudaFunction>>,
}

impl std::fmt::Debug for CudaDeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDeviceState").field("ordinal", &self.ordinal).field("arch", &self.arch).finish()
    }
}

/// Kernels loaded on one device: each program's module (compiled once for every kernel it holds)
/// and the functions taken from them, by program key `P` and function key `F`.
struct KernelCache<P, F> {
    modules: HashMap<P, Arc<CudaModule>>,
    functions: HashMap<F, CudaFunction>,
}

impl<P, F> Default for KernelCache<P, F> {
    fn default() -> Self {
        KernelCache { modules: HashMap::new(), functions: HashMap::new() }
    }
}

impl<P: Copy + Eq + std::hash::Hash, F: Copy + Eq + std::hash::Hash> KernelCache<P, F> {
    /// The function `key` names, whose symbol is `name()`, from `program`'s module, which
    /// `compile` makes at the program's first use: a lookup that finds the function builds
    /// neither the name nor the program.
    fn function(
        &mut self,
        context: &Arc<CudaContext>,
        (program, key): (P, F),
        name: impl FnOnce() -> String,
        compile: impl FnOnce() -> Result<cudarc::nvrtc::Ptx, KernelError>,
    ) -> Result<CudaFunction, KernelError> {
        if let Some(function) = self.functions.get(&key) {
            return Ok(function.clone());
        }
        let module = match self.modules.get(&program) {
            Some(module) => Arc::clone(module),
            None => {
                let module = context.load_module(compile()?).map_err(driver_error)?;
                self.modules.insert(program, Arc::clone(&module));
                module
            }
        };
        let function = module.load_function(&name()).map_err(driver_error)?;
        self.functions.insert(key, function.clone());
        Ok(function)
    }
}

/// An NVRTC program of the other op families: its source (`"quant"`, an op's name for a gated op)
/// and, for a program compiled per dtype, the dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ProgramKey {
    pub(crate) source: &'static str,
    pub(crate) dtype: Option<DType>,
}

/// A function of such a program: the kernel's base name and whether it is the 16-byte variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct FunctionKey {
    pub(crate) program: ProgramKey,
    pub(crate) kernel: &'static str,
    pub(crate) vectorized: bool,
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
                norms: Mutex::new(KernelCache::default()),
                op_kernels: Mutex::new(KernelCache::default()),
                generated: Mutex::new(Default::default()),
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

    /// The kernel for `variant`, loaded at first use from its program's module, which is compiled
    /// once for both norm ops.
    pub(crate) fn function(&self, variant: &KernelVariant) -> Result<CudaFunction, KernelError> {
        let mut norms = self.norms.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let program = variant.program;
        norms.function(
            &self.context,
            (program, *variant),
            || variant.kernel_name(),
            || {
                tracing::debug!(target: "kernels_cuda", %program, ordinal = self.ordinal, "compiling with NVRTC");
                compile_ptx(&program, self.arch)
            },
        )
    }

    /// The function generated from `program` for a call bound as `binding`, compiled (or read
    /// from the disk cache) and loaded at its first use on this device, then cached per program
    /// and signature.
    pub(crate) fn generated_function(
        &self,
        program: &ir_ops::row_program::RowProgram,
        binding: &ir_ops::row_program::Binding,
        shape: kernel_support::program::RowShape,
    ) -> Result<CudaFunction, KernelError> {
        let mut generated = self.generated.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        generated.get_or_make(program, binding, shape, || {
            let cache = kernel_support::program::DiskCache::from_env();
            let (ptx, _) = crate::program::compile_ptx_cached(program, binding, shape, self.arch, cache.as_ref())?;
            let module = self.context.load_module(ptx).map_err(driver_error)?;
            module.load_function(kernel_support::program::ROW_PROGRAM_KERNEL).map_err(driver_error)
        })
    }

    /// The function `key` names, whose symbol is `name()`, from its program's module, which
    /// `compile` makes at the program's first use; both are cached, so a launch that finds the
    /// function builds neither the name nor the program, and a program holding several kernels
    /// is compiled once for all of them.
    pub(crate) fn op_function(
        &self,
        key: FunctionKey,
        name: impl FnOnce() -> String,
        compile: impl FnOnce() -> Result<cudarc::nvrtc::Ptx, KernelError>,
    ) -> Result<CudaFunction, KernelError> {
        let mut kernels = self.op_kernels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        kernels.function(&self.context, (key.program, key), name, || {
            let ProgramKey { source, dtype } = key.program;
            tracing::debug!(target: "kernels_cuda", source, ?dtype, arch = ?self.arch, "compiling with NVRTC");
            compile()
        })
    }

    fn allocate(self: &Arc<Self>, len_bytes: usize) -> Result<CudaBuffer, DeviceError> {
        self.allocate_on(&self.stream, len_bytes, Fill::Zeros)
    }

    /// A buffer allocated in stream order on `stream`, which its kernels then use: zeroed, or (for
    /// a kernel's output, which the kernel writes whole) left as the driver gives it.
    pub(crate) fn allocate_on(
        self: &Arc<Self>,
        stream: &Arc<CudaStream>,
        len_bytes: usize,
        fill: Fill,
    ) -> Result<CudaBuffer, DeviceError> {
        // Zero-byte allocations are not allowed by the driver; keep one byte and report the real size.
        let len = len_bytes.max(1);
        let slice = match fill {
            Fill::Zeros => stream.alloc_zeros::<u8>(len),
            // SAFETY: device memory of `u8`, for which every bit pattern is a value; its contents
            // are unspecified until written, and every caller asking for it writes the elements it
            // hands out before they are read, in order on `stream` (`GpuRuntime::allocate`).
            Fill::Unspecified => unsafe { stream.alloc::<u8>(len) },
        }
        .map_err(|e| self.device_error("allocate", e))?;
        Ok(CudaBuffer { memory: Memory::Owned(slice), len_bytes, device: Arc::clone(self), stream: Arc::clone(stream) })
    }

    /// Whether `stream` runs in this device's primary context, where this crate's kernels are loaded.
    fn check_stream(&self, stream: &CudaStream) -> Result<(), DeviceError> {
        if stream.context().cu_ctx() == self.context.cu_ctx() {
            return Ok(());
        }
        Err(DeviceError {
            device: Device::Cuda(self.ordinal as u32),
            operation: "adopt",
            message: "the stream belongs to another CUDA context than the device's primary context, where this \
                      crate's kernels are loaded (cudarc's CudaContext::new uses the primary context)"
                .to_owned(),
        })
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

/// Device memory of one tensor storage, and the stream its kernels, copies and outputs use.
///
/// Memory allocated here is a cudarc slice on the device's own stream. An engine hands its own
/// memory over with [`CudaBuffer::from_cuda_slice`] (a cudarc slice, safe) or
/// [`CudaBuffer::from_raw_parts`] (a device pointer, `unsafe`); kernels on tensors over it launch on
/// the stream given with it, so they are ordered with the engine's own work on that stream, and
/// their outputs are allocated on it too.
pub struct CudaBuffer {
    memory: Memory,
    len_bytes: usize,
    pub(crate) device: Arc<CudaDeviceState>,
    stream: Arc<CudaStream>,
}

enum Memory {
    /// Allocated here; cudarc orders its uses across streams.
    Owned(CudaSlice<u8>),
    /// An engine's memory: its address, and what keeps it allocated.
    External { ptr: CUdeviceptr, _owner: Box<dyn Any + Send + Sync> },
}

/// A device address to pass to a kernel, with cudarc's stream-ordering guard (for memory it
/// manages) that records the use when dropped after the launch.
pub(crate) struct DeviceAddress<'a> {
    pub(crate) ptr: CUdeviceptr,
    _guard: Option<SyncOnDrop<'a>>,
}

impl<'a> DeviceAddress<'a> {
    /// The address `bytes` past this one.
    pub(crate) fn offset(&self, bytes: usize) -> CUdeviceptr {
        self.ptr + bytes as CUdeviceptr
    }
}

impl CudaBuffer {
    /// Adopts an engine's cudarc slice without a copy: the buffer keeps the slice, and kernels on
    /// tensors over it launch on the slice's stream. The stream must run in the device's primary
    /// context (cudarc's `CudaContext::new` gives that context; candle's CUDA device uses it).
    pub fn from_cuda_slice<T: DeviceRepr + Send + Sync + 'static>(
        slice: CudaSlice<T>,
    ) -> Result<CudaBuffer, DeviceError> {
        let stream = Arc::clone(slice.stream());
        let device = device_of_stream(&stream)?;
        let len_bytes = slice.len() * size_of::<T>();
        let (ptr, guard) = slice.device_ptr(&stream);
        drop(guard);
        Ok(CudaBuffer { memory: Memory::External { ptr, _owner: Box::new(slice) }, len_bytes, device, stream })
    }

    /// Adopts device memory an engine owns, without a copy: `len_bytes` from `ptr` on the device of
    /// `stream`, on which kernels on tensors over it launch. `owner` is dropped with the buffer (an
    /// engine's allocation handle, or `()` when the engine frees the memory itself later).
    ///
    /// # Safety
    ///
    /// - `ptr` is a device address in the stream's context valid for reads and writes of
    ///   `len_bytes` until `owner` is dropped (or, with `()`, until the last tensor over the buffer
    ///   is dropped and every kernel queued on it has finished);
    /// - work on other streams that touches the memory is ordered with `stream` by the engine
    ///   (events or synchronization): this crate orders only its own uses, on `stream`;
    /// - while a tensor over the buffer is alive, nothing but such tensors writes the memory.
    pub unsafe fn from_raw_parts(
        ptr: CUdeviceptr,
        len_bytes: usize,
        stream: Arc<CudaStream>,
        owner: impl Any + Send + Sync,
    ) -> Result<CudaBuffer, DeviceError> {
        let device = device_of_stream(&stream)?;
        Ok(CudaBuffer { memory: Memory::External { ptr, _owner: Box::new(owner) }, len_bytes, device, stream })
    }

    /// A tensor over the whole buffer (or part of it: the layout must fit).
    pub fn into_tensor(self, dtype: DType, layout: ir_core::Layout) -> Result<ir_core::Tensor, ir_core::TensorError> {
        ir_core::Tensor::from_storage(ir_core::storage::Storage::Device(Box::new(self)), dtype, layout)
    }

    /// Gives the memory up, to be owned and freed in stream order on `stream` by whoever takes the
    /// address (an engine's slice): `stream` first waits for the work queued on this buffer's
    /// stream. Memory this buffer does not own is copied into a fresh allocation on `stream`.
    #[cfg(feature = "candle")]
    pub(crate) fn into_device_ptr(self, stream: &Arc<CudaStream>) -> Result<CUdeviceptr, DeviceError> {
        let error = |operation: &'static str, e: DriverError| self.device.device_error(operation, e);
        if stream.cu_stream() != self.stream.cu_stream() {
            stream.join(&self.stream).map_err(|e| error("hand over", e))?;
        }
        match self.memory {
            // `leak` also waits, on the slice's stream, for the uses cudarc recorded.
            Memory::Owned(slice) => Ok(slice.leak()),
            Memory::External { ptr, .. } => {
                // Overwritten whole by the copy below.
                let fresh = self.device.allocate_on(stream, self.len_bytes, Fill::Unspecified)?;
                let Memory::Owned(slice) = fresh.memory else { unreachable!("allocated here") };
                let (dst, guard) = slice.device_ptr(stream);
                drop(guard);
                stream.context().bind_to_thread().map_err(|e| error("hand over", e))?;
                // SAFETY: both addresses are valid for `len_bytes` in the stream's context (this
                // buffer's contract, and a fresh allocation of that size); the copy is queued on
                // `stream`, after the work it waits for above, before anything later uses `dst`.
                unsafe { cudarc::driver::result::memcpy_dtod_async(dst, ptr, self.len_bytes, stream.cu_stream()) }
                    .map_err(|e| error("hand over", e))?;
                Ok(slice.leak())
            }
        }
    }

    /// The stream kernels on this memory launch on (unless the call's context gives another).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The alignment of the buffer's first byte, up to 256: the driver's for memory allocated here,
    /// the address's own for adopted memory (an engine may hand over any address). A kernel takes
    /// its 16-byte path only where this and the tensor's offset allow it.
    pub(crate) fn base_alignment(&self) -> usize {
        match &self.memory {
            Memory::Owned(_) => ALLOCATION_ALIGNMENT,
            Memory::External { ptr, .. } => kernel_support::gpu::address_alignment(*ptr),
        }
    }

    /// The stream a call whose first activation is this buffer launches on: the caller's, when
    /// the call came through an [`EagerContext::with_stream`](ir_core::EagerContext::with_stream)
    /// given an `Arc<CudaStream>`, else this memory's.
    pub(crate) fn call_stream(&self) -> Result<Arc<CudaStream>, KernelError> {
        match ir_core::stream::launch_stream::<Arc<CudaStream>>() {
            Some(stream) => {
                self.device
                    .check_stream(&stream)
                    .map_err(|e| KernelError::Driver { backend: "cuda", message: e.message })?;
                Ok(stream)
            }
            None => Ok(Arc::clone(&self.stream)),
        }
    }

    /// The address to read from in work queued on `stream`.
    pub(crate) fn read_address<'a>(&'a self, stream: &'a CudaStream) -> DeviceAddress<'a> {
        match &self.memory {
            Memory::Owned(slice) => {
                let (ptr, guard) = slice.device_ptr(stream);
                DeviceAddress { ptr, _guard: Some(guard) }
            }
            Memory::External { ptr, .. } => DeviceAddress { ptr: *ptr, _guard: None },
        }
    }

    /// The address to write to in work queued on `stream`.
    pub(crate) fn write_address<'a>(&'a mut self, stream: &'a CudaStream) -> DeviceAddress<'a> {
        match &mut self.memory {
            Memory::Owned(slice) => {
                let (ptr, guard) = slice.device_ptr_mut(stream);
                DeviceAddress { ptr, _guard: Some(guard) }
            }
            Memory::External { ptr, .. } => DeviceAddress { ptr: *ptr, _guard: None },
        }
    }
}

/// Alignment of device allocations (the driver returns at least 256-byte aligned memory).
pub(crate) const ALLOCATION_ALIGNMENT: usize = 256;

/// The device whose primary context runs `stream`.
fn device_of_stream(stream: &CudaStream) -> Result<Arc<CudaDeviceState>, DeviceError> {
    let ordinal = stream.context().ordinal();
    let error = |message: String| DeviceError { device: Device::Cuda(ordinal as u32), operation: "adopt", message };
    let devices = devices().map_err(error)?;
    let device = devices.get(ordinal).ok_or_else(|| error(format!("no device cuda:{ordinal}")))?;
    device.check_stream(stream)?;
    Ok(Arc::clone(device))
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.memory {
            Memory::Owned(_) => "allocated here",
            Memory::External { .. } => "adopted",
        };
        write!(f, "CudaBuffer(cuda:{}, {} bytes, {kind})", self.device.ordinal, self.len_bytes)
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
        let stream = &self.stream;
        match &self.memory {
            Memory::Owned(slice) => stream
                .memcpy_dtoh(&slice.slice(..self.len_bytes), dst)
                .map_err(|e| self.device.device_error("download", e))?,
            Memory::External { ptr, .. } => {
                let dst = &mut dst[..self.len_bytes];
                stream.context().bind_to_thread().map_err(|e| self.device.device_error("download", e))?;
                // SAFETY: `ptr` is valid for `len_bytes` reads in the stream's context
                // (`from_raw_parts`'s contract, or a slice this buffer keeps); `dst` holds as many
                // bytes and outlives the copy, which the synchronization below completes.
                unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, *ptr, stream.cu_stream()) }
                    .map_err(|e| self.device.device_error("download", e))?
            }
        }
        stream.synchronize().map_err(|e| self.device.device_error("download", e))
    }

    fn upload(&mut self, src: &[u8]) -> Result<(), DeviceError> {
        if src.is_empty() {
            return Ok(());
        }
        let stream = Arc::clone(&self.stream);
        match &mut self.memory {
            Memory::Owned(slice) => stream
                .memcpy_htod(src, &mut slice.slice_mut(..src.len()))
                .map_err(|e| self.device.device_error("upload", e))?,
            Memory::External { ptr, .. } => {
                let src = &src[..src.len().min(self.len_bytes)];
                stream.context().bind_to_thread().map_err(|e| self.device.device_error("upload", e))?;
                // SAFETY: `ptr` is valid for writes of `len_bytes` (at least `src.len()`) in the
                // stream's context; `src` outlives the copy, which the synchronization completes.
                unsafe { cudarc::driver::result::memcpy_htod_async(*ptr, src, stream.cu_stream()) }
                    .map_err(|e| self.device.device_error("upload", e))?
            }
        }
        stream.synchronize().map_err(|e| self.device.device_error("upload", e))
    }

    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate_on(&self.stream, len_bytes, Fill::Zeros)?))
    }

    fn allocate_for_overwrite(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate_on(&self.stream, len_bytes, Fill::Unspecified)?))
    }

    kernel_support::strided_on_device!();

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
