//! The HIP runtime path (feature `rocm`): devices, memory, code objects and launches through hip-sys.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

use hip_sys::hiprt::{
    hipDeviceAttribute_t, hipDeviceGetAttribute, hipError_t, hipFreeAsync, hipFunction_t, hipGetDeviceCount,
    hipGetErrorString, hipMallocAsync, hipMemcpyDtoHAsync, hipMemcpyHtoDAsync, hipMemsetD8Async, hipModule_t,
    hipModuleGetFunction, hipModuleLaunchKernel, hipModuleLoadData, hipSetDevice, hipStream_t, hipStreamSynchronize,
};
use ir_core::storage::{DeviceAllocator, DeviceBuffer, DeviceError};
use ir_core::{Availability, DType, Device, KernelError};
use kernel_support::gpu::Fill;

include!(concat!(env!("OUT_DIR"), "/code_objects.rs"));

use crate::module::KernelVariant;

/// One HIP device with the loaded code object and its kernels.
pub(crate) struct HipDevice {
    ordinal: i32,
    wave_size: i32,
    target: &'static str,
    module: hipModule_t,
    functions: Mutex<HashMap<KernelId, HipFunction>>,
    /// The kernels generated from row programs, each from a module of its own (loaded for the
    /// device's lifetime, like the embedded code object).
    generated: Mutex<kernel_support::program::GeneratedKernels<HipFunction>>,
}

/// A kernel of the code object: a norm variant, or another family's kernel by its base name, its
/// input dtype (none for the strided kernels, whose names say all) and its 16-byte form. Launches
/// find the function by it, without building the symbol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum KernelId {
    Norm(KernelVariant),
    Op { kernel: &'static str, dtype: Option<DType>, vectorized: bool },
}

/// A function of the loaded code object (the module lives as long as the device, which is never
/// unloaded).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HipFunction(usize);

// SAFETY: the module handle is only used through HIP calls, which are thread-safe; the function
// cache is behind a mutex and stores function handles as integers.
unsafe impl Send for HipDevice {}
// SAFETY: as above.
unsafe impl Sync for HipDevice {}

static DEVICE: OnceLock<Result<Arc<HipDevice>, String>> = OnceLock::new();

pub(crate) fn availability() -> Availability {
    match device() {
        Ok(_) => Availability::Available,
        Err(reason) => Availability::Unavailable(reason),
    }
}

pub(crate) fn device() -> Result<&'static Arc<HipDevice>, String> {
    DEVICE
        .get_or_init(|| {
            let found = std::panic::catch_unwind(init).unwrap_or_else(|_| Err("the HIP runtime panicked".to_owned()));
            if let Ok(device) = &found {
                tracing::info!(target: "kernels_rocm", target_isa = device.target, wave = device.wave_size, "HIP device ready");
            }
            found
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn init() -> Result<Arc<HipDevice>, String> {
    if CODE_OBJECTS.is_empty() {
        return Err("no code object was built (hipcc missing at build time)".to_owned());
    }
    let mut count = 0;
    // SAFETY: a valid out-pointer to a local integer.
    check(unsafe { hipGetDeviceCount(&mut count) }).map_err(|e| format!("hipGetDeviceCount: {e}"))?;
    if count < 1 {
        return Err("no HIP device".to_owned());
    }
    // SAFETY: device 0 exists (count >= 1).
    check(unsafe { hipSetDevice(0) }).map_err(|e| format!("hipSetDevice(0): {e}"))?;
    let mut wave_size = 0;
    // SAFETY: a valid out-pointer and an existing device.
    check(unsafe { hipDeviceGetAttribute(&mut wave_size, hipDeviceAttribute_t::hipDeviceAttributeWarpSize, 0) })
        .map_err(|e| format!("querying the wave size: {e}"))?;
    // The runtime refuses code objects for other ISAs, so the first one that loads is the device's.
    for (target, bytes) in CODE_OBJECTS {
        let mut module: hipModule_t = ptr::null_mut();
        // SAFETY: `bytes` is a complete code object embedded at build time and outlives the module.
        let loaded = check(unsafe { hipModuleLoadData(&mut module, bytes.as_ptr() as *const c_void) });
        if loaded.is_ok() {
            return Ok(Arc::new(HipDevice {
                ordinal: 0,
                wave_size,
                target,
                module,
                functions: Mutex::new(HashMap::new()),
                generated: Mutex::new(Default::default()),
            }));
        }
    }
    let built: Vec<&str> = CODE_OBJECTS.iter().map(|(t, _)| *t).collect();
    Err(format!("no embedded code object matches the device (built for {}); set VLLM_IR_HIP_ARCHS", built.join(", ")))
}

impl HipDevice {
    /// The function `id` names, whose symbol is `symbol()`: looked up in the module at first use,
    /// then cached, so a launch builds no symbol.
    pub(crate) fn function(&self, id: KernelId, symbol: impl FnOnce() -> String) -> Result<HipFunction, KernelError> {
        let mut functions = self.functions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(&function) = functions.get(&id) {
            return Ok(function);
        }
        let name = CString::new(symbol()).expect("symbols have no NUL");
        let mut function: hipFunction_t = ptr::null_mut();
        // SAFETY: the module is loaded and `name` is a NUL-terminated symbol name.
        check(unsafe { hipModuleGetFunction(&mut function, self.module, name.as_ptr()) }).map_err(driver)?;
        let function = HipFunction(function as usize);
        functions.insert(id, function);
        Ok(function)
    }

    /// The kernel generated from `program` for a call bound as `binding`: compiled by hipcc for
    /// the device's target (or read from the disk cache) and loaded at its first use, then cached
    /// per program and signature.
    pub(crate) fn generated_function(
        &self,
        program: &ir_ops::row_program::RowProgram,
        binding: &ir_ops::row_program::Binding,
        shape: kernel_support::program::RowShape,
    ) -> Result<HipFunction, KernelError> {
        let mut generated = self.generated.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        generated.get_or_make(program, binding, shape, || {
            let cache = kernel_support::program::DiskCache::from_env();
            let (object, _) =
                crate::program::compile_code_object(program, binding, shape, self.target, cache.as_ref())?;
            let mut module: hipModule_t = ptr::null_mut();
            // SAFETY: `object` is a complete code object hipcc wrote for this device's target; HIP
            // copies what it needs while loading.
            check(unsafe { hipModuleLoadData(&mut module, object.as_ptr() as *const c_void) }).map_err(driver)?;
            let name = CString::new(kernel_support::program::ROW_PROGRAM_KERNEL).expect("no NUL");
            let mut function: hipFunction_t = ptr::null_mut();
            // SAFETY: the module is loaded and `name` is a NUL-terminated symbol name.
            check(unsafe { hipModuleGetFunction(&mut function, module, name.as_ptr()) }).map_err(driver)?;
            Ok(HipFunction(function as usize))
        })
    }

    /// A buffer of `len_bytes`, allocated in order on the launches' stream (the caller's, when the
    /// call's context gives one, else the null stream) and freed in order on it when dropped:
    /// zeroed there, or (for a kernel's output, which the kernel writes whole) left as the
    /// allocator gives it.
    pub(crate) fn allocate(self: &Arc<Self>, len_bytes: usize, fill: Fill) -> Result<HipBuffer, DeviceError> {
        let stream = launch_stream();
        let mut pointer: *mut c_void = ptr::null_mut();
        let size = len_bytes.max(1);
        // SAFETY: a valid out-pointer; the size is non-zero; the stream is the caller's (a live
        // stream of this device, `HipStream`'s contract) or the null stream.
        check(unsafe { hipMallocAsync(&mut pointer, size, stream) }).map_err(|e| self.error("allocate", e))?;
        let buffer = HipBuffer { pointer, len_bytes, device: Arc::clone(self), owner: None, stream };
        if fill == Fill::Zeros {
            // SAFETY: `pointer` was just allocated with `size` bytes, in order on `stream`.
            check(unsafe { hipMemsetD8Async(pointer, 0, size, stream) }).map_err(|e| self.error("allocate", e))?;
        }
        Ok(buffer)
    }

    fn error(&self, operation: &'static str, message: String) -> DeviceError {
        DeviceError { device: Device::Rocm(self.ordinal as u32), operation, message }
    }

    /// Launches `function` with `blocks` blocks of `block_size` threads and the given kernel
    /// parameters (pointers to each argument, in prototype order).
    ///
    /// # Safety
    ///
    /// `params` must point to values of exactly the types the kernel's prototype declares, and every
    /// buffer they reference must cover the elements the kernel touches.
    pub(crate) unsafe fn launch(
        &self,
        function: HipFunction,
        blocks: u32,
        block_size: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), KernelError> {
        let function = function.0 as hipFunction_t;
        let stream = launch_stream();
        // SAFETY: the caller guarantees the parameters; the stream is the caller's (a live stream
        // of this device, `HipStream`'s contract) or the null stream; copies synchronize the
        // device first, so they see every launch on either.
        let launched = unsafe {
            hipModuleLaunchKernel(
                function,
                blocks,
                1,
                1,
                block_size,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        };
        check(launched).map_err(driver)
    }
}

impl HipDevice {
    /// Copies `bytes` bytes from `src` to `dst` on the launches' stream (the caller's, when the
    /// call's context gives one, else the null stream), without a kernel.
    ///
    /// # Safety
    ///
    /// `src` and `dst` are device memory of this device valid for `bytes` bytes, not overlapping.
    pub(crate) unsafe fn copy_device(
        &self,
        dst: *mut c_void,
        src: *mut c_void,
        bytes: usize,
    ) -> Result<(), KernelError> {
        let stream = launch_stream();
        // SAFETY: the caller's contract; the stream is the caller's (a live stream of this device,
        // `HipStream`'s contract) or the null stream, the one the kernels use.
        check(unsafe { hip_sys::hiprt::hipMemcpyDtoDAsync(dst, src, bytes, stream) }).map_err(driver)
    }
}

/// The stream this call's launches, copies and allocations are ordered on: the caller's, when the
/// call's context gives one ([`HipStream`]), else the null stream.
fn launch_stream() -> hipStream_t {
    ir_core::stream::launch_stream::<HipStream>().map_or(ptr::null_mut(), |stream| stream.0)
}

/// An engine's HIP stream, for [`EagerContext::with_stream`](ir_core::EagerContext::with_stream):
/// the calls made through that context launch their kernels on it instead of the default stream,
/// and allocate their outputs on it (`hipMallocAsync`); an output is freed in order on the stream
/// it was allocated on (`hipFreeAsync`), so work the engine queues on another stream that uses it
/// must be ordered before that stream's later work (an event), as with any stream-ordered
/// allocator.
#[derive(Clone, Copy, Debug)]
pub struct HipStream(hip_sys::hiprt::hipStream_t);

// SAFETY: a HIP stream handle may be used from any thread (the HIP runtime is thread-safe).
unsafe impl Send for HipStream {}
// SAFETY: as above; the handle is only passed to HIP calls.
unsafe impl Sync for HipStream {}

impl HipStream {
    /// Wraps an engine's stream handle.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of `rocm:0` for as long as any context carrying it is used and
    /// any buffer allocated on it (the output of a call made through such a context) is alive:
    /// those buffers are freed in order on it when they drop.
    pub unsafe fn from_raw(stream: hip_sys::hiprt::hipStream_t) -> HipStream {
        HipStream(stream)
    }
}

/// Allocates tensors on `rocm:0`.
#[derive(Clone)]
pub struct RocmAllocator {
    device: Arc<HipDevice>,
}

pub(crate) fn allocator() -> Result<RocmAllocator, String> {
    Ok(RocmAllocator { device: Arc::clone(device()?) })
}

impl DeviceAllocator for RocmAllocator {
    fn device(&self) -> Device {
        Device::Rocm(self.device.ordinal as u32)
    }

    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate(len_bytes, Fill::Zeros)?))
    }
}

/// HIP memory of one tensor storage: allocated here in stream order (freed in order on the same
/// stream when dropped, with no wait), or an engine's (kept alive by its owner value, never freed
/// here).
pub struct HipBuffer {
    pub(crate) pointer: *mut c_void,
    len_bytes: usize,
    pub(crate) device: Arc<HipDevice>,
    owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// The stream the memory is ordered on: where it was allocated and is freed, or the one an
    /// engine adopted it on (the null stream by default). Uploads, downloads and an adopted
    /// buffer's drop wait for this stream only, never for the whole device.
    stream: hipStream_t,
}

impl HipBuffer {
    /// Adopts an engine's device memory on `rocm:0` without a copy: `len_bytes` from `pointer`.
    /// `owner` is dropped with the buffer (an engine's allocation handle, or `()` when the engine
    /// frees the memory itself later); this crate never frees the memory.
    ///
    /// The memory is ordered on the default (null) stream: its uploads and downloads, and its
    /// drop, wait for that stream ([`from_raw_parts_on`](HipBuffer::from_raw_parts_on) names
    /// another).
    ///
    /// # Safety
    ///
    /// - `pointer` is device memory of `rocm:0` valid for reads and writes of `len_bytes` until
    ///   `owner` is dropped (with `()`: until the last tensor over the buffer is dropped);
    /// - work the engine queues on other streams that touches the memory is ordered with the
    ///   default stream (a blocking stream, an event, or a synchronization);
    /// - while a tensor over the buffer is alive, nothing but such tensors writes the memory.
    pub unsafe fn from_raw_parts(
        pointer: *mut c_void,
        len_bytes: usize,
        owner: impl std::any::Any + Send + Sync,
    ) -> Result<HipBuffer, DeviceError> {
        // SAFETY: the caller's contract, with the null stream.
        unsafe { Self::adopt(pointer, len_bytes, ptr::null_mut(), owner) }
    }

    /// [`from_raw_parts`](HipBuffer::from_raw_parts), the memory ordered on the engine's `stream`:
    /// uploads and downloads are queued on it and wait for it alone, and the drop waits for it
    /// before `owner` goes.
    ///
    /// # Safety
    ///
    /// As [`from_raw_parts`](HipBuffer::from_raw_parts), with `stream` for the default stream, and
    /// `stream` live while the buffer is.
    pub unsafe fn from_raw_parts_on(
        pointer: *mut c_void,
        len_bytes: usize,
        stream: &HipStream,
        owner: impl std::any::Any + Send + Sync,
    ) -> Result<HipBuffer, DeviceError> {
        // SAFETY: the caller's contract.
        unsafe { Self::adopt(pointer, len_bytes, stream.0, owner) }
    }

    /// # Safety
    ///
    /// As [`from_raw_parts_on`](HipBuffer::from_raw_parts_on).
    unsafe fn adopt(
        pointer: *mut c_void,
        len_bytes: usize,
        stream: hipStream_t,
        owner: impl std::any::Any + Send + Sync,
    ) -> Result<HipBuffer, DeviceError> {
        let device = Arc::clone(device().map_err(|reason| DeviceError {
            device: Device::Rocm(0),
            operation: "adopt",
            message: reason,
        })?);
        Ok(HipBuffer { pointer, len_bytes, device, owner: Some(Box::new(owner)), stream })
    }

    /// A tensor over the buffer (the layout must fit).
    pub fn into_tensor(
        self,
        dtype: ir_core::DType,
        layout: ir_core::Layout,
    ) -> Result<ir_core::Tensor, ir_core::TensorError> {
        ir_core::Tensor::from_storage(ir_core::storage::Storage::Device(Box::new(self)), dtype, layout)
    }
}

// SAFETY: the buffer exclusively owns its device allocation; HIP memory may be used from any thread.
unsafe impl Send for HipBuffer {}
// SAFETY: shared references only read through HIP calls, which are thread-safe.
unsafe impl Sync for HipBuffer {}

impl std::fmt::Debug for HipBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipBuffer({} bytes on rocm:{})", self.len_bytes, self.device.ordinal)
    }
}

impl Drop for HipBuffer {
    fn drop(&mut self) {
        if self.owner.is_none() {
            // SAFETY: memory allocated here came from `hipMallocAsync` on `self.stream` and is freed
            // once, in order on that stream: after every kernel and copy queued there (where this
            // crate queues every use of it, unless the engine ordered another stream's use before).
            let _ = unsafe { hipFreeAsync(self.pointer, self.stream) };
        } else {
            // Adopted memory: its owner (dropped right after this) may free it at once, so the
            // work queued on its stream (where the adoption's contract orders every use) finishes
            // first; other streams and the rest of the device go on.
            // SAFETY: the stream is the null stream or the engine's, live while the buffer is.
            let _ = unsafe { hipStreamSynchronize(self.stream) };
        }
    }
}

/// The runtime whose kernels a `HipBuffer` runs its strided operations with, implemented beside
/// it in `runtime` (this crate's `kernel_support::gpu::BufferRuntime`, which the crate-private
/// runtime cannot implement for the public buffer).
pub(crate) trait StridedRuntime {
    type Runtime: kernel_support::gpu::GpuRuntime<Buffer = Self>;
}

impl DeviceBuffer for HipBuffer {
    fn device(&self) -> Device {
        Device::Rocm(self.device.ordinal as u32)
    }

    fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    fn download(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        let n = self.len_bytes.min(dst.len());
        if n == 0 {
            return Ok(());
        }
        // Queued on the buffer's stream, after the kernels that wrote it (ordered there), then
        // waited for: that stream only, not the device.
        // SAFETY: `dst` has at least `n` bytes and the device buffer holds `len_bytes >= n`; `dst`
        // outlives the copy, which the synchronization completes; the stream is live.
        check(unsafe { hipMemcpyDtoHAsync(dst.as_mut_ptr() as *mut c_void, self.pointer, n, self.stream) })
            .map_err(|e| self.device.error("download", e))?;
        // SAFETY: as above.
        check(unsafe { hipStreamSynchronize(self.stream) }).map_err(|e| self.device.error("download", e))
    }

    fn upload(&mut self, src: &[u8]) -> Result<(), DeviceError> {
        let n = self.len_bytes.min(src.len());
        if n == 0 {
            return Ok(());
        }
        // Queued on the buffer's stream, after the kernels still reading it there.
        // SAFETY: `src` has at least `n` bytes, which fit the device buffer; HIP only reads them,
        // before the synchronization below returns; the stream is live.
        check(unsafe { hipMemcpyHtoDAsync(self.pointer, src.as_ptr() as *mut c_void, n, self.stream) })
            .map_err(|e| self.device.error("upload", e))?;
        // SAFETY: as above.
        check(unsafe { hipStreamSynchronize(self.stream) }).map_err(|e| self.device.error("upload", e))
    }

    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate(len_bytes, Fill::Zeros)?))
    }

    fn allocate_for_overwrite(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate(len_bytes, Fill::Unspecified)?))
    }

    kernel_support::strided_on_device!(<Self as StridedRuntime>::Runtime);

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

fn check(result: hipError_t) -> Result<(), String> {
    if result == hipError_t::hipSuccess {
        return Ok(());
    }
    // SAFETY: hipGetErrorString returns a static NUL-terminated string for any error code.
    let message = unsafe { CStr::from_ptr(hipGetErrorString(result)) };
    Err(message.to_string_lossy().into_owned())
}

fn driver(message: String) -> KernelError {
    KernelError::Driver { backend: "rocm", message }
}
