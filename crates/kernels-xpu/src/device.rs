//! The OpenCL device behind `xpu:0`, its queue and built kernels, and device memory behind tensors.

use std::any::Any;
use std::collections::HashMap;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use ir_core::storage::{BinaryOp, DeviceAllocator, DeviceBuffer, DeviceError};
use ir_core::{Availability, DType, Device, KernelError};
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::{CL_DEVICE_TYPE_CPU, CL_DEVICE_TYPE_GPU, Device as ClDevice};
use opencl3::kernel::Kernel;
use opencl3::memory::{Buffer, CL_MEM_READ_WRITE};
use opencl3::program::Program;
use opencl3::types::CL_BLOCKING;

use crate::module::{KernelVariant, SOURCE, base_options};
use kernel_support::gpu::Fill;
use kernel_support::{GatedKernel, converts_through_f64};

/// Environment variable allowing a CPU OpenCL device (PoCL), for tests on machines without a GPU.
pub const ALLOW_CPU_ENV: &str = "VLLM_IR_XPU_ALLOW_CPU";

/// The OpenCL device, context, in-order queue and kernel cache behind `xpu:0`.
pub struct XpuDevice {
    name: String,
    is_gpu: bool,
    extensions: String,
    max_sub_group_size: Option<u32>,
    /// The most work-items a work-group may have.
    max_work_group_size: usize,
    /// The alignment of every buffer's first byte (`CL_DEVICE_MEM_BASE_ADDR_ALIGN`, in bytes).
    base_alignment: usize,
    context: Context,
    queue: Arc<CommandQueue>,
    kernels: KernelCache<KernelVariant>,
    op_kernels: KernelCache<(&'static str, DType)>,
    /// The strided copy kernel by element size.
    copy_kernels: KernelCache<usize>,
    /// The strided conversion kernel by (source, destination) dtype.
    convert_kernels: KernelCache<(DType, DType)>,
    /// The `add`/`mul` kernel by dtype and operation.
    binary_kernels: KernelCache<(DType, BinaryOp)>,
    /// The kernels generated from row programs, by program and signature.
    generated: Mutex<kernel_support::program::GeneratedKernels<Arc<Mutex<Kernel>>>>,
    /// Strided copies and conversions done on the device (`clone`, `contiguous`, `cat`, `copy_`,
    /// `scale` of xpu tensors).
    device_copies: AtomicU64,
}

/// Built kernels by key, each behind the lock its launches take.
type KernelCache<K> = Mutex<HashMap<K, Arc<Mutex<Kernel>>>>;

impl std::fmt::Debug for XpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XpuDevice").field("name", &self.name).field("is_gpu", &self.is_gpu).finish()
    }
}

static DEVICE: OnceLock<Result<Arc<XpuDevice>, String>> = OnceLock::new();

/// Whether an OpenCL device usable as `xpu:0` exists. Never panics.
pub fn availability() -> Availability {
    match device() {
        Ok(_) => Availability::Available,
        Err(reason) => Availability::Unavailable(reason),
    }
}

/// Whether `xpu:0` is a GPU (a CPU device never makes the platform Xpu).
pub fn is_gpu() -> bool {
    device().is_ok_and(|d| d.is_gpu)
}

/// The device behind `xpu:0`, selected once: an Intel GPU if any, else another GPU, else (only with
/// `VLLM_IR_XPU_ALLOW_CPU=1`) a CPU device.
pub fn device() -> Result<&'static Arc<XpuDevice>, String> {
    DEVICE
        .get_or_init(|| {
            let allow_cpu = std::env::var(ALLOW_CPU_ENV).is_ok_and(|v| v == "1");
            let found = std::panic::catch_unwind(|| select_device(allow_cpu))
                .unwrap_or_else(|_| Err("the OpenCL runtime panicked".to_owned()));
            match &found {
                Ok(device) => tracing::info!(target: "kernels_xpu", name = device.name.as_str(), gpu = device.is_gpu, "OpenCL device selected"),
                Err(reason) => tracing::debug!(target: "kernels_xpu", reason = reason.as_str(), "xpu unavailable"),
            }
            found
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The strided copy kernel's source (`kernels/strided_copy.cl`).
const STRIDED_COPY: &str = include_str!("../kernels/strided_copy.cl");

/// The strided conversion kernel's source (`kernels/strided_convert.cl`), built after `element.cl`
/// and the strided copy's indexing.
const STRIDED_CONVERT: &str = include_str!("../kernels/strided_convert.cl");

/// The `add`/`mul` kernel's source (`kernels/strided_binary.cl`), built after `element.cl` and the
/// strided copy's indexing.
const STRIDED_BINARY: &str = include_str!("../kernels/strided_binary.cl");

pub use kernel_support::COPY_MAX_RANK;

/// `CL_DEVICE_SUB_GROUP_SIZES_INTEL` (extension `cl_intel_required_subgroup_size`): the sub-group
/// sizes the device supports, an array of `size_t`.
const CL_DEVICE_SUB_GROUP_SIZES_INTEL: u32 = 0x4108;

/// The largest sub-group size `device` lists, when it lists them (Intel devices); a device with only
/// `cl_khr_subgroups` says a size per built kernel, too late to choose the reduction.
fn max_sub_group_size(device: &ClDevice, extensions: &str) -> Option<u32> {
    let intel =
        extensions.split_whitespace().any(|e| e == "cl_intel_subgroups" || e == "cl_intel_required_subgroup_size");
    if !intel {
        return None;
    }
    let bytes = device.get_data(CL_DEVICE_SUB_GROUP_SIZES_INTEL).ok()?;
    let sizes =
        bytes.chunks_exact(size_of::<usize>()).map(|c| usize::from_ne_bytes(c.try_into().expect("chunks_exact")));
    sizes.max().and_then(|m| u32::try_from(m).ok()).filter(|&m| m > 0)
}

fn select_device(allow_cpu: bool) -> Result<Arc<XpuDevice>, String> {
    let platforms = opencl3::platform::get_platforms()
        .map_err(|e| format!("OpenCL ICD loader (libOpenCL.so.1) not found or no platform: {e}"))?;
    let mut gpus = Vec::new();
    let mut cpus = Vec::new();
    for platform in &platforms {
        gpus.extend(platform.get_devices(CL_DEVICE_TYPE_GPU).unwrap_or_default());
        cpus.extend(platform.get_devices(CL_DEVICE_TYPE_CPU).unwrap_or_default());
    }
    let is_intel = |id: &opencl3::types::cl_device_id| ClDevice::new(*id).vendor().is_ok_and(|v| v.contains("Intel"));
    let chosen = match gpus.iter().find(|id| is_intel(id)).or(gpus.first()) {
        Some(id) => (ClDevice::new(*id), true),
        None if allow_cpu => match cpus.first() {
            Some(id) => (ClDevice::new(*id), false),
            None => return Err("no OpenCL GPU or CPU device".to_owned()),
        },
        None => {
            return Err(format!(
                "no OpenCL GPU device ({} CPU device(s) found; set {ALLOW_CPU_ENV}=1 to use one)",
                cpus.len()
            ));
        }
    };
    let (cl_device, is_gpu) = chosen;
    let name = cl_device.name().unwrap_or_else(|_| "unknown OpenCL device".to_owned());
    let extensions = cl_device.extensions().unwrap_or_default();
    let max_sub_group_size = max_sub_group_size(&cl_device, &extensions);
    // OpenCL guarantees at least 1; the norm kernels' smallest work-group is 128 work-items.
    let max_work_group_size = cl_device.max_work_group_size().unwrap_or(128);
    // In bits; unknown counts as none, so no call takes a path that needs it.
    let base_alignment = cl_device.mem_base_addr_align().map_or(0, |bits| bits as usize / 8);
    let context = Context::from_device(&cl_device).map_err(|e| format!("creating an OpenCL context on {name}: {e}"))?;
    #[allow(deprecated)]
    let queue = CommandQueue::create_default(&context, 0).map_err(|e| format!("creating a queue on {name}: {e}"))?;
    Ok(Arc::new(XpuDevice {
        name,
        is_gpu,
        extensions,
        max_sub_group_size,
        max_work_group_size,
        base_alignment,
        context,
        queue: Arc::new(queue),
        kernels: Mutex::new(HashMap::new()),
        op_kernels: Mutex::new(HashMap::new()),
        copy_kernels: Mutex::new(HashMap::new()),
        convert_kernels: Mutex::new(HashMap::new()),
        binary_kernels: Mutex::new(HashMap::new()),
        generated: Mutex::new(Default::default()),
        device_copies: AtomicU64::new(0),
    }))
}

impl XpuDevice {
    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's extensions (space separated).
    pub fn extensions(&self) -> &str {
        &self.extensions
    }

    /// The largest sub-group size the device's compiler may give a kernel, when the device says
    /// before any kernel is built (Intel's `CL_DEVICE_SUB_GROUP_SIZES_INTEL`); `None` otherwise.
    pub fn max_sub_group_size(&self) -> Option<u32> {
        self.max_sub_group_size
    }

    /// The alignment of the first byte of every buffer on the device (OpenCL's
    /// `CL_DEVICE_MEM_BASE_ADDR_ALIGN`, which `clCreateBuffer` memory, an engine's included, keeps).
    pub fn base_alignment(&self) -> usize {
        self.base_alignment
    }

    /// The most work-items a work-group may have on this device.
    pub fn max_work_group_size(&self) -> usize {
        self.max_work_group_size
    }

    /// How many strided copies and conversions (`clone`, `contiguous`, `cat`, `copy_`, `scale` of
    /// xpu tensors) ran on the device.
    pub fn device_copies(&self) -> u64 {
        self.device_copies.load(Ordering::Relaxed)
    }

    /// Counts one strided copy, conversion or `add`/`mul` done on the device.
    pub(crate) fn note_device_copy(&self) {
        self.device_copies.fetch_add(1, Ordering::Relaxed);
    }

    /// The strided copy kernel for elements of `element_size` bytes, built at first use.
    pub(crate) fn copy_kernel(&self, element_size: usize) -> Result<Arc<Mutex<Kernel>>, KernelError> {
        let element = match element_size {
            1 => "uchar",
            2 => "ushort",
            4 => "uint",
            8 => "ulong",
            kernel_support::WIDE_COPY_BYTES => "uint4",
            other => return Err(KernelError::ElementSize { backend: "xpu", bytes: other }),
        };
        let mut kernels = self.copy_kernels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(kernel) = kernels.get(&element_size) {
            return Ok(Arc::clone(kernel));
        }
        let options = format!("-cl-std=CL1.2 -DELEM={element}");
        let kernel = self.build(STRIDED_COPY, &options, "strided_copy", format!("strided_copy[{element}]"))?;
        kernels.insert(element_size, Arc::clone(&kernel));
        Ok(kernel)
    }

    /// The strided conversion kernel from `src` to `dst` elements, built at first use; `None` for a
    /// pair that needs f64 arithmetic ([`converts_through_f64`]) on a device without
    /// `cl_khr_fp64`.
    pub(crate) fn convert_kernel(&self, src: DType, dst: DType) -> Result<Option<Arc<Mutex<Kernel>>>, KernelError> {
        if converts_through_f64(src, dst) && !self.has_fp64() {
            return Ok(None);
        }
        let mut kernels = self.convert_kernels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(kernel) = kernels.get(&(src, dst)) {
            return Ok(Some(Arc::clone(kernel)));
        }
        let options = format!(
            "-cl-std=CL1.2 -DSDTYPE={} -DDDTYPE={}",
            kernel_support::element_code(src),
            kernel_support::element_code(dst)
        );
        let source = format!("{}\n{STRIDED_COPY}\n{STRIDED_CONVERT}", crate::module::ELEMENT);
        let kernel = self.build(&source, &options, "strided_convert", format!("strided_convert[{src} -> {dst}]"))?;
        kernels.insert((src, dst), Arc::clone(&kernel));
        Ok(Some(kernel))
    }

    /// The `add`/`mul` kernel of `dtype`, built at first use; `None` for f64 or i64 on a device
    /// without `cl_khr_fp64`.
    pub(crate) fn binary_kernel(&self, dtype: DType, op: BinaryOp) -> Result<Option<Arc<Mutex<Kernel>>>, KernelError> {
        if converts_through_f64(dtype, dtype) && !self.has_fp64() {
            return Ok(None);
        }
        let mut kernels = self.binary_kernels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(kernel) = kernels.get(&(dtype, op)) {
            return Ok(Some(Arc::clone(kernel)));
        }
        let op_code = match op {
            BinaryOp::Add => 0,
            BinaryOp::Mul => 1,
        };
        let code = kernel_support::element_code(dtype);
        let options = format!("-cl-std=CL1.2 -DSDTYPE={code} -DDDTYPE={code} -DOP={op_code}");
        let source = format!("{}\n{STRIDED_COPY}\n{STRIDED_CONVERT}\n{STRIDED_BINARY}", crate::module::ELEMENT);
        let kernel =
            self.build(&source, &options, "strided_binary", format!("strided_binary[{} {dtype}]", op.name()))?;
        kernels.insert((dtype, op), Arc::clone(&kernel));
        Ok(Some(kernel))
    }

    /// The kernel generated from `program` for a call bound as `binding`
    /// (`kernel_support::program::opencl_source`), built at its first use on this device (which
    /// needs `cl_khr_fp64`: row values are double) and cached per program and signature.
    pub(crate) fn generated_kernel(
        &self,
        program: &ir_ops::row_program::RowProgram,
        binding: &ir_ops::row_program::Binding,
    ) -> Result<Arc<Mutex<Kernel>>, KernelError> {
        use kernel_support::program::{OPENCL_HEADERS, ROW_PROGRAM_KERNEL, RowShape, Signature, opencl_source};
        let mut generated = self.generated.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // OpenCL kernels walk their rows (`opencl_source`).
        generated.get_or_make(program, binding, RowShape::Walk, || {
            if !self.has_fp64() {
                return Err(KernelError::InvalidArguments {
                    reason: format!(
                        "row program `{}` needs cl_khr_fp64 (its row values are double), which {} lacks",
                        program.name(),
                        self.name
                    ),
                });
            }
            let source = opencl_source(program, binding)?;
            let label = format!("row program `{}` ({})", program.name(), Signature::of(binding, RowShape::Walk));
            tracing::debug!(target: "kernels_xpu", %label, "building a generated OpenCL program");
            self.build(
                &format!("{OPENCL_HEADERS}\n{source}"),
                "-cl-std=CL1.2 -cl-fp32-correctly-rounded-divide-sqrt",
                ROW_PROGRAM_KERNEL,
                label,
            )
        })
    }

    /// Whether the device computes in f64 (`cl_khr_fp64`).
    pub fn has_fp64(&self) -> bool {
        self.extensions.split_whitespace().any(|e| e == "cl_khr_fp64")
    }

    /// The in-order queue this crate uses when the caller gives none (see [`XpuBuffer`]).
    pub fn queue(&self) -> &Arc<CommandQueue> {
        &self.queue
    }

    /// Whether `queue` belongs to this device's context (the kernels are built in it).
    fn check_queue(&self, queue: &CommandQueue) -> Result<(), KernelError> {
        let context = queue.context().map_err(cl_error)?;
        if context == self.context.get() {
            return Ok(());
        }
        Err(KernelError::Driver {
            backend: "xpu",
            message: "the queue belongs to another OpenCL context; create it in kernels_xpu::device()?.context()"
                .to_owned(),
        })
    }

    /// The OpenCL context the kernels are built in: memory an engine hands over
    /// ([`XpuBuffer::from_cl_mem`]) is allocated in it.
    pub fn context(&self) -> &Context {
        &self.context
    }

    /// The kernel for `variant`, built at first use. Setting arguments and enqueueing happen under
    /// its lock, since an OpenCL kernel object is not safe to configure from two threads at once.
    pub fn kernel(&self, variant: &KernelVariant) -> Result<Arc<Mutex<Kernel>>, KernelError> {
        let mut kernels = self.kernels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(kernel) = kernels.get(variant) {
            return Ok(Arc::clone(kernel));
        }
        tracing::debug!(target: "kernels_xpu", %variant, "building OpenCL program");
        let kernel = self.build(SOURCE, &variant.build_options()?, &variant.kernel_name(), variant.to_string())?;
        kernels.insert(*variant, Arc::clone(&kernel));
        Ok(kernel)
    }

    /// The kernel of a gated op for `dtype`, built at first use (locked like [`XpuDevice::kernel`]).
    pub fn gated_kernel(&self, op: &GatedKernel, dtype: DType) -> Result<Arc<Mutex<Kernel>>, KernelError> {
        self.op_kernel(op.def.name, dtype, || op.kernel_name(dtype), || crate::gated::program(op))
    }

    /// The kernel `name()` of op `op` for `dtype`, from the program `program` makes, built with the
    /// dtype's base options at first use and cached per (op, dtype) (locked like
    /// [`XpuDevice::kernel`]); a launch that finds it cached builds neither the name nor the program.
    pub(crate) fn op_kernel(
        &self,
        op: &'static str,
        dtype: DType,
        name: impl FnOnce() -> String,
        program: impl FnOnce() -> String,
    ) -> Result<Arc<Mutex<Kernel>>, KernelError> {
        let mut kernels = self.op_kernels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(kernel) = kernels.get(&(op, dtype)) {
            return Ok(Arc::clone(kernel));
        }
        tracing::debug!(target: "kernels_xpu", op, %dtype, "building OpenCL program");
        let name = name();
        let kernel = self.build(&program(), &base_options(dtype)?, &name, name.clone())?;
        kernels.insert((op, dtype), Arc::clone(&kernel));
        Ok(kernel)
    }

    fn build(&self, source: &str, options: &str, name: &str, label: String) -> Result<Arc<Mutex<Kernel>>, KernelError> {
        let program = Program::create_and_build_from_source(&self.context, source, options).map_err(|log| {
            KernelError::Compile {
                kernel: label,
                options: options.split_whitespace().map(str::to_owned).collect(),
                log,
            }
        })?;
        let kernel = Kernel::create(&program, name).map_err(cl_error)?;
        Ok(Arc::new(Mutex::new(kernel)))
    }

    fn allocate(self: &Arc<Self>, len_bytes: usize) -> Result<XpuBuffer, DeviceError> {
        self.allocate_on(&self.queue, len_bytes, Fill::Zeros)
    }

    /// A buffer belonging to `queue`: zeroed there, or (for a kernel's output, which the kernel
    /// writes whole) left as OpenCL gives it.
    pub(crate) fn allocate_on(
        self: &Arc<Self>,
        queue: &Arc<CommandQueue>,
        len_bytes: usize,
        fill: Fill,
    ) -> Result<XpuBuffer, DeviceError> {
        // SAFETY: no host pointer is passed, so OpenCL allocates and owns the memory (its contents
        // unspecified until written).
        let mut buffer =
            unsafe { Buffer::<u8>::create(&self.context, CL_MEM_READ_WRITE, len_bytes.max(1), ptr::null_mut()) }
                .map_err(|e| self.device_error("allocate", e.to_string()))?;
        // Debug builds fill a kernel's output with 0xff bytes (NaN in every float dtype) instead of
        // leaving it: an element a kernel failed to write then fails the tests' comparisons.
        let pattern = match fill {
            Fill::Zeros => Some(0u8),
            Fill::Unspecified if cfg!(debug_assertions) => Some(0xff),
            Fill::Unspecified => None,
        };
        if let Some(byte) = pattern {
            let bytes = vec![byte; len_bytes.max(1)];
            // SAFETY: a blocking write of exactly the buffer's size from a live host slice.
            unsafe { queue.enqueue_write_buffer(&mut buffer, CL_BLOCKING, 0, &bytes, &[]) }
                .map_err(|e| self.device_error("allocate", e.to_string()))?;
        }
        Ok(XpuBuffer { buffer, len_bytes, device: Arc::clone(self), queue: Mutex::new(Arc::clone(queue)) })
    }

    fn device_error(&self, operation: &'static str, message: String) -> DeviceError {
        DeviceError { device: Device::Xpu(0), operation, message }
    }
}

/// Allocates tensors on `xpu:0`.
#[derive(Clone, Debug)]
pub struct XpuAllocator {
    device: Arc<XpuDevice>,
}

/// The allocator of `xpu:0`, or why there is none.
pub fn allocator() -> Result<XpuAllocator, String> {
    Ok(XpuAllocator { device: Arc::clone(device()?) })
}

impl DeviceAllocator for XpuAllocator {
    fn device(&self) -> Device {
        Device::Xpu(0)
    }

    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate(len_bytes)?))
    }
}

/// OpenCL memory of one tensor storage, and the in-order queue of its last use.
///
/// A call launches on the queue its caller gives through the execution context
/// ([`EagerContext::with_stream`](ir_core::EagerContext::with_stream) with an `Arc<CommandQueue>`
/// of this crate's context), else on its first activation's queue. Before a buffer is used on a
/// queue other than its last one, that queue waits for everything enqueued on the old one (a
/// marker and a barrier), and the buffer moves to the new queue; so uses of one buffer on several
/// queues stay in order. Downloads and uploads run on the buffer's current queue.
pub struct XpuBuffer {
    pub(crate) buffer: Buffer<u8>,
    len_bytes: usize,
    pub(crate) device: Arc<XpuDevice>,
    queue: Mutex<Arc<CommandQueue>>,
}

impl XpuBuffer {
    /// Adopts an engine's OpenCL buffer without a copy: the first `len_bytes` of `mem`, which must
    /// be allocated in this crate's context ([`XpuDevice::context`]). The buffer takes its own
    /// reference (`clRetainMemObject`), released when the buffer is dropped; the engine keeps its own.
    ///
    /// Its first queue is this crate's ([`XpuDevice::queue`]); see [`XpuBuffer`] for how calls pick
    /// theirs.
    ///
    /// # Safety
    ///
    /// - `mem` is a valid OpenCL memory object (checked further: its context and size);
    /// - work the engine enqueues itself that touches the memory is ordered with the buffer's
    ///   queue by the engine (the same queue, events, `clFinish`);
    /// - while a tensor over the buffer is alive, nothing but such tensors writes the memory.
    pub unsafe fn from_cl_mem(mem: opencl3::types::cl_mem, len_bytes: usize) -> Result<XpuBuffer, DeviceError> {
        let device = Arc::clone(device().map_err(|reason| DeviceError {
            device: Device::Xpu(0),
            operation: "adopt",
            message: reason,
        })?);
        let info = |name| {
            opencl3::memory::get_mem_object_info(mem, name).map_err(|code| {
                device.device_error("adopt", format!("clGetMemObjectInfo: {}", opencl3::error_codes::ClError(code)))
            })
        };
        let context: isize = info(opencl3::memory::CL_MEM_CONTEXT)?.into();
        let context = context as opencl3::types::cl_context;
        if context != device.context.get() {
            return Err(device.device_error(
                "adopt",
                "the memory belongs to another OpenCL context; allocate it in kernels_xpu::device()?.context()"
                    .to_owned(),
            ));
        }
        let size: usize = info(opencl3::memory::CL_MEM_SIZE)?.into();
        if size < len_bytes {
            return Err(device.device_error(
                "adopt",
                format!("the memory holds {size} bytes, fewer than the {len_bytes} asked for"),
            ));
        }
        // SAFETY: `mem` is a valid memory object (the caller's contract, and the queries above
        // succeeded); the reference taken here is released by `Buffer`'s drop.
        unsafe { opencl3::memory::retain_mem_object(mem) }.map_err(|code| {
            device.device_error("adopt", format!("clRetainMemObject: {}", opencl3::error_codes::ClError(code)))
        })?;
        let queue = Mutex::new(Arc::clone(&device.queue));
        Ok(XpuBuffer { buffer: Buffer::new(mem), len_bytes, device, queue })
    }

    /// The queue of the buffer's last use.
    pub fn queue(&self) -> Arc<CommandQueue> {
        Arc::clone(&self.queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// Moves the buffer to `queue` for its next use: when it differs from the buffer's current
    /// queue, `queue` first waits for everything enqueued on the current one.
    pub(crate) fn use_on(&self, queue: &Arc<CommandQueue>) -> Result<(), KernelError> {
        let mut current = self.queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if Arc::ptr_eq(&current, queue) {
            return Ok(());
        }
        // SAFETY: a marker with no wait list on a live queue, and a barrier on a live queue of
        // the same context waiting for that marker's event (kept alive until both calls return).
        let marker = unsafe { current.enqueue_marker_with_wait_list(&[]) }.map_err(cl_error)?;
        // SAFETY: as above: `marker` is a live event of this context.
        unsafe { queue.enqueue_barrier_with_wait_list(&[marker.get()]) }.map_err(cl_error)?;
        *current = Arc::clone(queue);
        Ok(())
    }

    /// The queue a call whose first activation is this buffer launches on: the caller's, when the
    /// call came through an execution context given an `Arc<CommandQueue>`, else this buffer's.
    pub(crate) fn call_queue(&self) -> Result<Arc<CommandQueue>, KernelError> {
        match ir_core::stream::launch_stream::<Arc<CommandQueue>>() {
            Some(queue) => {
                self.device.check_queue(&queue)?;
                Ok(queue)
            }
            None => Ok(self.queue()),
        }
    }

    /// A tensor over the buffer (the layout must fit).
    pub fn into_tensor(self, dtype: DType, layout: ir_core::Layout) -> Result<ir_core::Tensor, ir_core::TensorError> {
        ir_core::Tensor::from_storage(ir_core::storage::Storage::Device(Box::new(self)), dtype, layout)
    }

    /// The OpenCL memory object (this buffer keeps its own reference to it).
    pub fn cl_mem(&self) -> opencl3::types::cl_mem {
        opencl3::memory::ClMem::get(&self.buffer)
    }
}

impl std::fmt::Debug for XpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "XpuBuffer({} bytes on {})", self.len_bytes, self.device.name)
    }
}

impl DeviceBuffer for XpuBuffer {
    fn device(&self) -> Device {
        Device::Xpu(0)
    }

    fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    fn download(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        if self.len_bytes == 0 {
            return Ok(());
        }
        let dst = &mut dst[..self.len_bytes];
        // SAFETY: a blocking read of `len_bytes` (at most the buffer's size) into a live host slice;
        // the buffer's in-order queue runs it after every use enqueued before.
        unsafe { self.queue().enqueue_read_buffer(&self.buffer, CL_BLOCKING, 0, dst, &[]) }
            .map_err(|e| self.device.device_error("download", e.to_string()))?;
        Ok(())
    }

    fn upload(&mut self, src: &[u8]) -> Result<(), DeviceError> {
        if src.is_empty() {
            return Ok(());
        }
        let device = Arc::clone(&self.device);
        // SAFETY: a blocking write of `src.len()` bytes (at most the buffer's size) from a live slice.
        let queue = self.queue();
        unsafe { queue.enqueue_write_buffer(&mut self.buffer, CL_BLOCKING, 0, src, &[]) }
            .map_err(|e| device.device_error("upload", e.to_string()))?;
        Ok(())
    }

    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate_on(&self.queue(), len_bytes, Fill::Zeros)?))
    }

    fn allocate_for_overwrite(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(self.device.allocate_on(&self.queue(), len_bytes, Fill::Unspecified)?))
    }

    kernel_support::strided_on_device!();

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub(crate) fn cl_error(error: opencl3::error_codes::ClError) -> KernelError {
    KernelError::Driver { backend: "xpu", message: error.to_string() }
}
