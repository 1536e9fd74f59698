//! The CUDA runtime behind the shared family host code ([`kernel_support::gpu`]): streams, stream
//! ordered allocation, NVRTC-compiled functions and cudarc launches.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use ir_core::{DType, KernelError};
use ir_ops::rotary_embedding::ROTARY_EMBEDDING;
use kernel_support::gpu::{
    BufferArg, Fill, GpuRuntime, Grid, KernelArgs, KernelKey, NormKey, NormShape, Resolved, Scalar, StridedKey,
};
use kernel_support::gpu_threads_per_row;
use smallvec::SmallVec;

use crate::device::{CudaBuffer, DeviceAddress, FunctionKey, ProgramKey, driver_error};
use crate::module::NormProgram;

/// CUDA through cudarc.
#[derive(Debug)]
pub struct Cuda;

impl kernel_support::gpu::BufferRuntime for CudaBuffer {
    type Runtime = Cuda;
}

impl GpuRuntime for Cuda {
    const MEMORY: &'static str = "CUDA";
    const QUANT_GROUP: u32 = crate::quant::QUANT_BLOCK;
    const COPY_GROUP: u32 = crate::copy::COPY_BLOCK;

    type Buffer = CudaBuffer;
    type Queue = Arc<CudaStream>;
    type Kernel = CudaFunction;

    fn queue(first: &CudaBuffer) -> Result<Arc<CudaStream>, KernelError> {
        first.call_stream()
    }

    fn allocate(like: &CudaBuffer, queue: &Arc<CudaStream>, len_bytes: usize) -> Result<CudaBuffer, KernelError> {
        Ok(like.device.allocate_on(queue, len_bytes, Fill::Unspecified).map_err(ir_core::TensorError::from)?)
    }

    fn kernel(like: &CudaBuffer, key: KernelKey<'_>) -> Result<CudaFunction, KernelError> {
        let device = &like.device;
        match key {
            KernelKey::Gated { op, dtype, vectorized } => {
                let program = ProgramKey { source: op.def.name, dtype: Some(dtype) };
                let function = FunctionKey { program, kernel: op.def.name, vectorized };
                device.op_function(function, || key.symbol(), || crate::gated::compile_ptx(op, dtype, device.arch))
            }
            KernelKey::Rotary { dtype } => {
                let program = ProgramKey { source: "rotary", dtype: Some(dtype) };
                let function = FunctionKey { program, kernel: ROTARY_EMBEDDING.name, vectorized: false };
                device.op_function(function, || key.symbol(), || crate::rotary::compile_ptx(dtype, device.arch))
            }
            // One program per dtype holds every quantization kernel.
            KernelKey::Quant { kernel, dtype, vectorized } => {
                let program = ProgramKey { source: "quant", dtype: Some(dtype) };
                let function = FunctionKey { program, kernel, vectorized };
                device.op_function(function, || key.symbol(), || crate::quant::compile_ptx(dtype, device.arch))
            }
            KernelKey::RowProgram { program, binding, shape } => device.generated_function(program, binding, shape),
        }
    }

    fn gated_group(d: usize, dtype: DType) -> u32 {
        kernel_support::gated_block(d, dtype)
    }

    fn norm_kernel(like: &CudaBuffer, key: &NormKey) -> Result<(CudaFunction, NormShape), KernelError> {
        let threads_per_row = gpu_threads_per_row(key.hidden);
        let program = NormProgram { dtype: key.dtype, weight: key.weight, vectorized: key.vectorized, threads_per_row };
        let group_size = program.block_size();
        let shape = NormShape { group_size, rows_per_group: group_size / threads_per_row };
        Ok((like.device.function(&program.kernel(key.op))?, shape))
    }

    fn strided_kernel(like: &CudaBuffer, key: StridedKey) -> Result<Option<CudaFunction>, KernelError> {
        let (device, arch) = (&like.device, like.device.arch);
        let Some(symbol) = key.symbol() else { return Ok(None) };
        // One program holds every copy, another every conversion and `add`/`mul`.
        let (source, compile): (_, fn(_) -> _) = match key {
            StridedKey::Copy { .. } => ("strided_copy", crate::copy::compile_ptx),
            StridedKey::Convert { .. } | StridedKey::Binary { .. } => {
                ("strided_convert", crate::copy::compile_convert_ptx)
            }
        };
        let function = FunctionKey { program: ProgramKey { source, dtype: None }, kernel: symbol, vectorized: false };
        let function = device.op_function(function, || symbol.to_owned(), || compile(arch))?;
        Ok(Some(function))
    }

    unsafe fn copy_bytes(
        queue: &Arc<CudaStream>,
        from: &CudaBuffer,
        from_offset: usize,
        to: &mut CudaBuffer,
        to_offset: usize,
        bytes: usize,
    ) -> Result<(), KernelError> {
        let (src, dst) = (from.read_address(queue), to.write_address(queue));
        queue.context().bind_to_thread().map_err(driver_error)?;
        // SAFETY: both ranges lie inside their buffers (the caller's contract), valid device memory
        // of the stream's context; `to` is borrowed mutably, so the ranges do not overlap. The
        // address guards record both uses on the stream for cudarc's ordering.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.offset(to_offset),
                src.offset(from_offset),
                bytes,
                queue.cu_stream(),
            )
        }
        .map_err(driver_error)
    }

    fn buffer_queue(buffer: &CudaBuffer) -> Arc<CudaStream> {
        Arc::clone(buffer.stream())
    }

    fn same_device(a: &CudaBuffer, b: &CudaBuffer) -> bool {
        Arc::ptr_eq(&a.device, &b.device)
    }

    fn base_alignment(buffer: &CudaBuffer) -> usize {
        buffer.base_alignment()
    }

    unsafe fn launch(
        queue: &Arc<CudaStream>,
        kernel: &CudaFunction,
        grid: Grid,
        args: KernelArgs<'_, CudaBuffer>,
    ) -> Result<(), KernelError> {
        let config = LaunchConfig {
            grid_dim: (grid.cuda_blocks()?, 1, 1),
            block_dim: (grid.group_size, 1, 1),
            shared_mem_bytes: 0,
        };
        // The address guards record each use on the stream for cudarc's ordering when they drop,
        // after the launch.
        let mut guards: SmallVec<[DeviceAddress<'_>; 6]> = SmallVec::new();
        let values = args.resolve(|arg| {
            Ok(match arg {
                BufferArg::Read { buffer, offset, element_size } => {
                    let address = buffer.read_address(queue);
                    let pointer = address.offset(offset * element_size);
                    guards.push(address);
                    pointer
                }
                BufferArg::Write { buffer, offset, element_size } => {
                    let address = buffer.write_address(queue);
                    let pointer = address.offset(offset * element_size);
                    guards.push(address);
                    pointer
                }
                BufferArg::Null => 0,
            })
        })?;
        let mut builder = queue.launch_builder(kernel);
        for value in &values {
            match value {
                Resolved::Buffer(pointer) => builder.arg(pointer),
                Resolved::Scalar(Scalar::I32(v)) => builder.arg(v),
                Resolved::Scalar(Scalar::I64(v)) => builder.arg(v),
                Resolved::Scalar(Scalar::F32(v)) => builder.arg(v),
                Resolved::Scalar(Scalar::F64(v)) => builder.arg(v),
                Resolved::Scalar(Scalar::I64x8(v)) => builder.arg(v),
            };
        }
        // SAFETY: the caller's contract (`GpuRuntime::launch`): the values follow the kernel's
        // prototype, a buffer as its element address, and the buffers cover what the kernel
        // touches. The launch is on `queue`, where the guards record the buffers' uses.
        unsafe { builder.launch(config) }.map_err(driver_error)?;
        drop(guards);
        Ok(())
    }
}
