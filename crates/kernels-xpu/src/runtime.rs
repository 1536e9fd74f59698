//! The OpenCL runtime behind the shared family host code ([`kernel_support::gpu`]): command
//! queues, buffers, programs built at first use and `clEnqueueNDRangeKernel`.

use std::sync::{Arc, Mutex};

use ir_core::{DType, KernelError};
use ir_ops::rotary_embedding::ROTARY_EMBEDDING;
use kernel_support::gpu::{
    BufferArg, Fill, GpuRuntime, Grid, KernelArgs, KernelKey, NORM_QUANT_KERNEL, NormKey, NormShape, Resolved, Scalar,
    StridedKey,
};
use kernel_support::kernel_int;
use opencl3::command_queue::CommandQueue;
use opencl3::kernel::{ExecuteKernel, Kernel};
use opencl3::memory::ClMem;
use opencl3::types::cl_mem;

use crate::FORCE_TREE_ENV;
use crate::device::{XpuBuffer, cl_error};
use crate::module::{KernelVariant, group_size, threads_per_row, use_subgroups};

/// OpenCL through opencl3 (the `xpu` provider).
#[derive(Debug)]
pub struct OpenCl;

impl kernel_support::gpu::BufferRuntime for XpuBuffer {
    type Runtime = OpenCl;
}

impl GpuRuntime for OpenCl {
    const MEMORY: &'static str = "xpu";
    const QUANT_GROUP: u32 = crate::quant::QUANT_GROUP as u32;
    const COPY_GROUP: u32 = 128;
    const GENERATED_CHUNKS: bool = false;

    type Buffer = XpuBuffer;
    type Queue = Arc<CommandQueue>;
    type Kernel = Arc<Mutex<Kernel>>;

    fn gated_group(_d: usize, _dtype: DType) -> u32 {
        crate::gated::GATED_GROUP as u32
    }

    fn queue(first: &XpuBuffer) -> Result<Arc<CommandQueue>, KernelError> {
        first.call_queue()
    }

    fn allocate(like: &XpuBuffer, queue: &Arc<CommandQueue>, len_bytes: usize) -> Result<XpuBuffer, KernelError> {
        Ok(like.device.allocate_on(queue, len_bytes, Fill::Unspecified).map_err(ir_core::TensorError::from)?)
    }

    fn kernel(like: &XpuBuffer, key: KernelKey<'_>) -> Result<Arc<Mutex<Kernel>>, KernelError> {
        // One kernel for both forms: OpenCL's vector loads need only the element's alignment, so
        // the kernels read 16-byte chunks wherever the rows start, and the host's 16-byte choice
        // names the same (scalar-named) kernel.
        let key = match key {
            KernelKey::Gated { op, dtype, .. } => KernelKey::Gated { op, dtype, vectorized: false },
            KernelKey::Quant { kernel, dtype, .. } => KernelKey::Quant { kernel, dtype, vectorized: false },
            other => other,
        };
        match key {
            KernelKey::Gated { op, dtype, .. } => like.device.gated_kernel(op, dtype),
            KernelKey::Rotary { dtype } => {
                like.device.op_kernel(ROTARY_EMBEDDING.name, dtype, || key.symbol(), crate::rotary::program)
            }
            KernelKey::Quant { kernel, dtype, .. } if mixed_weight(kernel).is_some() => {
                let weight = mixed_weight(kernel).expect("matched above");
                let source = crate::quant::mixed_norm_quant_program(weight)?;
                like.device.op_kernel(kernel, dtype, || key.symbol(), || source)
            }
            KernelKey::Quant { kernel: NORM_QUANT_KERNEL, dtype, .. } => {
                like.device.op_kernel(NORM_QUANT_KERNEL, dtype, || key.symbol(), crate::quant::norm_quant_program)
            }
            KernelKey::Quant { kernel, dtype, .. } => {
                like.device.op_kernel(kernel, dtype, || key.symbol(), crate::quant::program)
            }
            KernelKey::RowProgram { program, binding, .. } => like.device.generated_kernel(program, binding),
        }
    }

    fn norm_kernel(like: &XpuBuffer, key: &NormKey) -> Result<(Arc<Mutex<Kernel>>, NormShape), KernelError> {
        let device = &like.device;
        let threads_per_row = threads_per_row(key.hidden, device.max_work_group_size());
        let force_tree = force_tree();
        let variant = KernelVariant {
            op: key.op,
            dtype: key.dtype,
            weight: key.weight,
            threads_per_row,
            subgroups: use_subgroups(device.extensions(), device.max_sub_group_size(), threads_per_row, force_tree),
        };
        let shape = NormShape { group_size: group_size(threads_per_row), rows_per_group: variant.rows_per_group() };
        Ok((device.kernel(&variant)?, shape))
    }

    fn strided_kernel(like: &XpuBuffer, key: StridedKey) -> Result<Option<Arc<Mutex<Kernel>>>, KernelError> {
        match key {
            StridedKey::Copy { element_size } => like.device.copy_kernel(element_size).map(Some),
            StridedKey::Convert { src, dst } => like.device.convert_kernel(src, dst),
            StridedKey::Binary { dtype, op } => like.device.binary_kernel(dtype, op),
        }
    }

    unsafe fn copy_bytes(
        queue: &Arc<CommandQueue>,
        from: &XpuBuffer,
        from_offset: usize,
        to: &mut XpuBuffer,
        to_offset: usize,
        bytes: usize,
    ) -> Result<(), KernelError> {
        from.use_on(queue)?;
        to.use_on(queue)?;
        // SAFETY: both ranges lie inside their buffers (the caller's contract); `to` is borrowed
        // mutably, so they are distinct buffers.
        unsafe { queue.enqueue_copy_buffer(&from.buffer, &mut to.buffer, from_offset, to_offset, bytes, &[]) }
            .map_err(cl_error)?;
        Ok(())
    }

    fn buffer_queue(buffer: &XpuBuffer) -> Arc<CommandQueue> {
        buffer.queue()
    }

    fn same_device(a: &XpuBuffer, b: &XpuBuffer) -> bool {
        Arc::ptr_eq(&a.device, &b.device)
    }

    fn note_device_copy(like: &XpuBuffer) {
        like.device.note_device_copy();
    }

    /// The device's buffer base alignment (every OpenCL buffer starts there), which the wide
    /// strided copy needs; the norm, gated and quantization kernels read 16-byte chunks at any
    /// alignment and have one form.
    fn base_alignment(buffer: &XpuBuffer) -> usize {
        buffer.device.base_alignment()
    }

    unsafe fn launch(
        queue: &Arc<CommandQueue>,
        kernel: &Arc<Mutex<Kernel>>,
        grid: Grid,
        args: KernelArgs<'_, XpuBuffer>,
    ) -> Result<(), KernelError> {
        let global = grid.global_work_size()?;
        let params = args.resolve(|arg| {
            let (buffer, offset) = match arg {
                BufferArg::Read { buffer, offset, .. } => (Some(buffer), offset),
                BufferArg::Write { buffer, offset, .. } => (Some(&*buffer), offset),
                BufferArg::Null => (None, 0),
            };
            // The kernel's work on `queue` follows the buffer's earlier work on its own queue.
            if let Some(buffer) = buffer {
                buffer.use_on(queue)?;
            }
            let mem: cl_mem = buffer.map_or(std::ptr::null_mut(), |buffer| buffer.buffer.get());
            Ok((mem, kernel_int::<i64>(offset, "storage offset")?))
        })?;
        // Arguments are set on the kernel object itself: its lock keeps another launch from
        // setting them between these calls and the enqueue.
        let kernel = kernel.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut execute = ExecuteKernel::new(&kernel);
        for param in &params {
            // SAFETY: the caller's contract: each parameter has this type; a buffer parameter (a
            // null one, which OpenCL passes as a null pointer, is never dereferenced) is followed
            // by its `long` element offset.
            unsafe {
                match param {
                    Resolved::Buffer((mem, offset)) => execute.set_arg(mem).set_arg(offset),
                    Resolved::Scalar(Scalar::I32(v)) => execute.set_arg(v),
                    Resolved::Scalar(Scalar::I64(v)) => execute.set_arg(v),
                    Resolved::Scalar(Scalar::F32(v)) => execute.set_arg(v),
                    Resolved::Scalar(Scalar::F64(v)) => execute.set_arg(v),
                    Resolved::Scalar(Scalar::I64x8(v)) => execute.set_arg(v),
                }
            };
        }
        // SAFETY: every argument is set as the caller's contract says; the buffers cover what the
        // kernel touches; the work-group size is the one the kernel requires.
        unsafe {
            execute.set_global_work_size(global).set_local_work_size(grid.group_size as usize).enqueue_nd_range(queue)
        }
        .map_err(cl_error)?;
        Ok(())
    }
}

/// Whether `VLLM_IR_XPU_FORCE_TREE=1` asks for the local-memory tree reduction: read once, not at
/// every norm launch.
fn force_tree() -> bool {
    static FORCE_TREE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FORCE_TREE.get_or_init(|| std::env::var(FORCE_TREE_ENV).is_ok_and(|v| v == "1"))
}

/// The weight dtype of a norm + quantization kernel for a weight of another dtype than x
/// ([`kernel_support::NORM_QUANT_MIXED_KERNELS`]), or `None` for any other kernel.
fn mixed_weight(kernel: &str) -> Option<DType> {
    kernel_support::NORM_QUANT_MIXED_KERNELS.iter().find(|(_, name)| *name == kernel).map(|(dtype, _)| *dtype)
}
