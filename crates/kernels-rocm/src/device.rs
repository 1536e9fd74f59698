//! The HIP runtime path (feature `rocm`): devices, memory, code objects and launches through hip-sys.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

use hip_sys::hiprt::{
    hipDeviceAttribute_t, hipDeviceGetAttribute, hipDeviceSynchronize, hipError_t, hipFree, hipFunction_t,
    hipGetDeviceCount, hipGetErrorString, hipMalloc, hipMemcpyDtoH, hipMemcpyHtoD, hipMemsetD8, hipModule_t,
    hipModuleGetFunction, hipModuleLaunchKernel, hipModuleLoadData, hipSetDevice,
};
use ir_core::storage::{BinaryOp, DeviceAllocator, DeviceBuffer, DeviceError, copy_strided_through_host};
use ir_core::{Availability, Device, KernelError};
use ir_core::{Layout, TensorMeta};

include!(concat!(env!("OUT_DIR"), "/code_objects.rs"));

/// One HIP device with the loaded code object and its kernels.
pub(crate) struct HipDevice {
    ordinal: i32,
    wave_size: i32,
    target: &'static str,
    module: hipModule_t,
    functions: Mutex<HashMap<String, usize>>,
}

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
            }));
        }
    }
    let built: Vec<&str> = CODE_OBJECTS.iter().map(|(t, _)| *t).collect();
    Err(format!("no embedded code object matches the device (built for {}); set VLLM_IR_HIP_ARCHS", built.join(", ")))
}

impl HipDevice {
    fn function(&self, symbol: &str) -> Result<hipFunction_t, KernelError> {
        let mut functions = self.functions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(&handle) = functions.get(symbol) {
            return Ok(handle as hipFunction_t);
        }
        let name = CString::new(symbol).expect("symbols have no NUL");
        let mut function: hipFunction_t = ptr::null_mut();
        // SAFETY: the module is loaded and `name` is a NUL-terminated symbol name.
        check(unsafe { hipModuleGetFunction(&mut function, self.module, name.as_ptr()) }).map_err(driver)?;
        functions.insert(symbol.to_owned(), function as usize);
        Ok(function)
    }

    pub(crate) fn allocate(self: &Arc<Self>, len_bytes: usize) -> Result<HipBuffer, DeviceError> {
        let mut pointer: *mut c_void = ptr::null_mut();
        let size = len_bytes.max(1);
        // SAFETY: a valid out-pointer; the size is non-zero.
        check(unsafe { hipMalloc(&mut pointer, size) }).map_err(|e| self.error("allocate", e))?;
        // SAFETY: `pointer` was just allocated with `size` bytes.
        check(unsafe { hipMemsetD8(pointer, 0, size) }).map_err(|e| self.error("allocate", e))?;
        Ok(HipBuffer { pointer, len_bytes, device: Arc::clone(self), owner: None })
    }

    fn error(&self, operation: &'static str, message: String) -> DeviceError {
        DeviceError { device: Device::Rocm(self.ordinal as u32), operation, message }
    }

    /// Launches kernel `symbol` with `blocks` blocks of `block_size` threads and the given kernel parameters (pointers to each argument, in prototype order).
    ///
    /// # Safety
    ///
    /// `params` must point to values of exactly the types the kernel's prototype declares, and every
    /// buffer they reference must cover the elements the kernel touches.
    pub(crate) unsafe fn launch(
        &self,
        symbol: &str,
        blocks: u32,
        block_size: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), KernelError> {
        let function = self.function(symbol)?;
        let stream = ir_core::stream::launch_stream::<HipStream>().map_or(ptr::null_mut(), |stream| stream.0);
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

/// An engine's HIP stream, for [`EagerContext::with_stream`](ir_core::EagerContext::with_stream):
/// the calls made through that context launch their kernels on it instead of the default stream.
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
    /// `stream` is a live stream of `rocm:0` for as long as any context carrying it is used.
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
        Ok(Box::new(self.device.allocate(len_bytes)?))
    }
}

/// HIP memory of one tensor storage: allocated here (freed on drop), or an engine's (kept alive
/// by its owner value, never freed here).
pub struct HipBuffer {
    pub(crate) pointer: *mut c_void,
    len_bytes: usize,
    device: Arc<HipDevice>,
    owner: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl HipBuffer {
    /// Adopts an engine's device memory on `rocm:0` without a copy: `len_bytes` from `pointer`.
    /// `owner` is dropped with the buffer (an engine's allocation handle, or `()` when the engine
    /// frees the memory itself later); this crate never frees the memory.
    ///
    /// Kernels and copies of this crate run on the default (null) stream.
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
        let device = Arc::clone(device().map_err(|reason| DeviceError {
            device: Device::Rocm(0),
            operation: "adopt",
            message: reason,
        })?);
        Ok(HipBuffer { pointer, len_bytes, device, owner: Some(Box::new(owner)) })
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
        // SAFETY: pending kernels finish first; memory allocated here came from hipMalloc and is
        // freed once, adopted memory is left to its owner (dropped after this).
        unsafe {
            let _ = hipDeviceSynchronize();
            if self.owner.is_none() {
                let _ = hipFree(self.pointer);
            }
        }
    }
}

use kernel_support::ConvertFactor;

/// Blocks of 256 threads for one thread per element of a piece of `n` elements.
fn blocks_for(n: i64) -> Result<u32, KernelError> {
    u32::try_from((n as u64).div_ceil(256)).map_err(|_| KernelError::GridLimit { what: "elements", count: n as usize })
}

impl HipBuffer {
    /// Copies the elements `src` describes in this buffer into `to` with `to_layout`, on the device.
    fn copy_on_device(&self, src: &TensorMeta, to: &HipBuffer, to_layout: &Layout) -> Result<(), KernelError> {
        let symbol = format!("strided_copy_{}", src.dtype.size_in_bytes());
        self.launch_strided(&symbol, src, to, to_layout, src.dtype.size_in_bytes(), None)
    }

    /// Converts the elements `src` describes in this buffer into `to` as `to_meta` describes them, on
    /// the device (see [`DeviceBuffer::convert_strided`]); `false` when no kernel converts this pair.
    fn convert_on_device(
        &self,
        src: &TensorMeta,
        to: &HipBuffer,
        to_meta: &TensorMeta,
        factor: Option<f64>,
    ) -> Result<bool, KernelError> {
        let Some(&(_, _, name)) =
            crate::CONVERT_KERNELS.iter().find(|(s, d, _)| *s == src.dtype && *d == to_meta.dtype)
        else {
            return Ok(false);
        };
        let scale = (ConvertFactor::for_source(src.dtype, factor), i32::from(factor.is_some()));
        self.launch_strided(name, src, to, &to_meta.layout, to_meta.dtype.size_in_bytes(), Some(scale))?;
        Ok(true)
    }

    /// Launches the strided copy (`scale` `None`) or conversion kernel `symbol` (`Some((factor,
    /// scaled))`) over the elements `src` describes, into `to` with `to_layout` (elements of
    /// `to_size` bytes).
    fn launch_strided(
        &self,
        symbol: &str,
        src: &TensorMeta,
        to: &HipBuffer,
        to_layout: &Layout,
        to_size: usize,
        scale: Option<(ConvertFactor, i32)>,
    ) -> Result<(), KernelError> {
        let n = src.numel();
        if n == 0 {
            return Ok(());
        }
        let src_size = src.dtype.size_in_bytes();
        for piece in kernel_support::CopyDims::pieces(src, to_layout)? {
            let kernel_support::CopyDims { mut shape, mut src_strides, mut dst_strides, n: mut n_elements, .. } = piece;
            let [src_offset, dst_offset, _] = piece.element_offsets()?;
            let mut src_ptr = self.pointer.wrapping_byte_add(src_offset * src_size);
            let mut dst_ptr = to.pointer.wrapping_byte_add(dst_offset * to_size);
            let (mut factor, mut scaled) = scale.unwrap_or((ConvertFactor::F32(1.0), 0));
            let factor_param = match &mut factor {
                ConvertFactor::F32(f) => f as *mut f32 as *mut c_void,
                ConvertFactor::F64(f) => f as *mut f64 as *mut c_void,
            };
            // strided_copy_<bytes>(const T* src, T* dst, long long n, Dims8 shape, Dims8 src_strides,
            //                      Dims8 dst_strides), Dims8 being eight long longs by value;
            // strided_convert_<src>_<dst>(the same, C factor, int scaled), C double for f64 and i64
            // sources (ConvertFactor::F64), float for the others.
            let mut params: [*mut c_void; 8] = [
                &mut src_ptr as *mut _ as *mut c_void,
                &mut dst_ptr as *mut _ as *mut c_void,
                &mut n_elements as *mut _ as *mut c_void,
                &mut shape as *mut _ as *mut c_void,
                &mut src_strides as *mut _ as *mut c_void,
                &mut dst_strides as *mut _ as *mut c_void,
                factor_param,
                &mut scaled as *mut _ as *mut c_void,
            ];
            let count = if scale.is_some() { 8 } else { 6 };
            // SAFETY: the first `count` parameters point to locals of the kernel's declared types in
            // prototype order (each [i64; 8] laid out as `Dims8`; the conversion's two more only for
            // it, which `scale` is given for, the factor in the kernel's compute type), every integer
            // converted without loss. Every element the piece describes is one `src` describes, in
            // this buffer (its layout was checked against the storage), or one of `to_layout`, in
            // `to` (allocated for it by the caller, distinct from this one).
            unsafe { self.device.launch(symbol, blocks_for(piece.n)?, 256, &mut params[..count]) }?;
        }
        Ok(())
    }
}

impl HipBuffer {
    /// `add`/`mul` (`op`) of the elements `a` describes in this buffer and `b` describes in `other`
    /// into the compact `to`, on the device (see [`DeviceBuffer::binary_strided`]); `false` when no
    /// kernel computes this dtype.
    fn binary_on_device(
        &self,
        a: &TensorMeta,
        other: &HipBuffer,
        b: &TensorMeta,
        op: BinaryOp,
        to: &HipBuffer,
    ) -> Result<bool, KernelError> {
        let Some(&(_, _, name)) = crate::BINARY_KERNELS.iter().find(|(d, o, _)| *d == a.dtype && *o == op) else {
            return Ok(false);
        };
        let n = a.numel();
        if n == 0 {
            return Ok(true);
        }
        // a's strides as the source's, b's as the destination's: the kernel walks both.
        let size = a.dtype.size_in_bytes();
        for piece in kernel_support::CopyDims::pieces(a, &b.layout)? {
            let kernel_support::CopyDims { mut shape, mut src_strides, mut dst_strides, n: mut n_elements, .. } = piece;
            let [a_offset, b_offset, first] = piece.element_offsets()?;
            let mut a_ptr = self.pointer.wrapping_byte_add(a_offset * size);
            let mut b_ptr = other.pointer.wrapping_byte_add(b_offset * size);
            let mut dst_ptr = to.pointer.wrapping_byte_add(first * size);
            // strided_<op>_<dtype>(const T* a, const T* b, T* dst, long long n, Dims8 shape,
            //                      Dims8 a_strides, Dims8 b_strides)
            let mut params: [*mut c_void; 7] = [
                &mut a_ptr as *mut _ as *mut c_void,
                &mut b_ptr as *mut _ as *mut c_void,
                &mut dst_ptr as *mut _ as *mut c_void,
                &mut n_elements as *mut _ as *mut c_void,
                &mut shape as *mut _ as *mut c_void,
                &mut src_strides as *mut _ as *mut c_void,
                &mut dst_strides as *mut _ as *mut c_void,
            ];
            // SAFETY: the parameters point to locals of the kernel's declared types in prototype
            // order (each [i64; 8] laid out as `Dims8`), every integer converted without loss; the
            // kernel is the one for this dtype and operation. Every element the piece describes is
            // one `a` and `b` describe, in this buffer and `other` (their layouts were checked
            // against their storages); `to`, distinct from both, holds the `n` compact elements, of
            // which the piece writes those from `first` on.
            unsafe { self.device.launch(name, blocks_for(piece.n)?, 256, &mut params) }?;
        }
        Ok(true)
    }
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
        // Kernels may have run on an engine's stream, which the default stream does not wait for.
        // SAFETY: no preconditions.
        check(unsafe { hipDeviceSynchronize() }).map_err(|e| self.device.error("download", e))?;
        // SAFETY: `dst` has at least `n` bytes and the device buffer holds `len_bytes >= n`; every
        // earlier kernel has finished (above).
        check(unsafe { hipMemcpyDtoH(dst.as_mut_ptr() as *mut c_void, self.pointer, n) })
            .map_err(|e| self.device.error("download", e))
    }

    fn upload(&mut self, src: &[u8]) -> Result<(), DeviceError> {
        let n = self.len_bytes.min(src.len());
        if n == 0 {
            return Ok(());
        }
        // Kernels on an engine's stream may still read the memory.
        // SAFETY: no preconditions.
        check(unsafe { hipDeviceSynchronize() }).map_err(|e| self.device.error("upload", e))?;
        // SAFETY: `src` has at least `n` bytes, which fit the device buffer; HIP only reads them.
        check(unsafe { hipMemcpyHtoD(self.pointer, src.as_ptr() as *mut c_void, n) })
            .map_err(|e| self.device.error("upload", e))
    }

    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate(len_bytes)?))
    }

    /// On the device (`kernels/strided_copy.hip`, any rank) when `dst` is memory of this device;
    /// through the host otherwise.
    fn copy_strided(
        &self,
        src: &TensorMeta,
        dst: &mut dyn DeviceBuffer,
        dst_layout: &Layout,
    ) -> Result<(), DeviceError> {
        if let Some(target) = dst.as_any().downcast_ref::<HipBuffer>()
            && Arc::ptr_eq(&target.device, &self.device)
        {
            return self.copy_on_device(src, target, dst_layout).map_err(|e| self.device.error("copy", e.to_string()));
        }
        copy_strided_through_host(self, src, dst, dst_layout)
    }

    /// On the device (`strided_<op>_<dtype>` in `kernels/strided_copy.hip`) when `other` and `dst`
    /// are memory of this device (every dtype).
    fn binary_strided(
        &self,
        a: &TensorMeta,
        other: &dyn DeviceBuffer,
        b: &TensorMeta,
        op: BinaryOp,
        dst: &mut dyn DeviceBuffer,
        dst_meta: &TensorMeta,
    ) -> Result<bool, DeviceError> {
        let (Some(other), Some(target)) =
            (other.as_any().downcast_ref::<HipBuffer>(), dst.as_any().downcast_ref::<HipBuffer>())
        else {
            return Ok(false);
        };
        let same_device = Arc::ptr_eq(&other.device, &self.device) && Arc::ptr_eq(&target.device, &self.device);
        if !same_device || !dst_meta.layout.is_compact_at_zero() {
            return Ok(false);
        }
        self.binary_on_device(a, other, b, op, target).map_err(|e| self.device.error(op.name(), e.to_string()))
    }

    /// On the device (`strided_convert_*` in `kernels/strided_copy.hip`) when `dst` is memory of this
    /// device and the pair of dtypes one of
    /// [`CONVERT_KERNELS`](crate::CONVERT_KERNELS).
    fn convert_strided(
        &self,
        src: &TensorMeta,
        dst: &mut dyn DeviceBuffer,
        dst_meta: &TensorMeta,
        factor: Option<f64>,
    ) -> Result<bool, DeviceError> {
        let Some(target) = dst.as_any().downcast_ref::<HipBuffer>() else {
            return Ok(false);
        };
        if !Arc::ptr_eq(&target.device, &self.device) {
            return Ok(false);
        }
        self.convert_on_device(src, target, dst_meta, factor).map_err(|e| self.device.error("convert", e.to_string()))
    }

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
