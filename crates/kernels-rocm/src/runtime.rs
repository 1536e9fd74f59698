//! The HIP runtime behind the shared family host code ([`kernel_support::gpu`]): the embedded code
//! object's kernels launched with `hipModuleLaunchKernel` (feature `rocm`). Without the feature,
//! a runtime whose memory cannot exist: the provider is registered unavailable, and a call made
//! to it anyway stops at its first tensor, which is not in HIP memory.

#[cfg(feature = "rocm")]
pub(crate) use hip::Hip;
#[cfg(not(feature = "rocm"))]
pub(crate) use unbuilt::Hip;

#[cfg(feature = "rocm")]
mod hip {

    use std::ffi::c_void;
    use std::sync::Arc;

    use ir_core::KernelError;
    use kernel_support::gpu::{
        BufferArg, Fill, GpuRuntime, Grid, KernelArgs, KernelKey, NormKey, NormShape, Resolved, Scalar, StridedKey,
        address_alignment,
    };
    use smallvec::SmallVec;

    use crate::device::{HipBuffer, HipDevice, HipFunction, KernelId, device};
    use crate::module::norm_launch;

    /// HIP through hip-sys (the `rocm` provider).
    #[derive(Debug)]
    pub(crate) struct Hip;

    impl crate::device::StridedRuntime for HipBuffer {
        type Runtime = Hip;
    }

    fn driver(message: String) -> KernelError {
        KernelError::Driver { backend: "rocm", message }
    }

    impl GpuRuntime for Hip {
        const MEMORY: &'static str = "HIP";
        const QUANT_GROUP: u32 = crate::quant::QUANT_BLOCK;
        /// `COPY_BLOCK` in `kernels/gpu/strided_copy.h`.
        const COPY_GROUP: u32 = 256;

        type Buffer = HipBuffer;
        /// The device: its launches take the caller's stream when the call's context gives one
        /// ([`HipStream`](crate::HipStream)), else the null stream.
        type Queue = Arc<HipDevice>;
        /// A function of the embedded code object.
        type Kernel = HipFunction;

        fn gated_group(d: usize, dtype: ir_core::DType) -> u32 {
            kernel_support::gated_block(d, dtype)
        }

        fn queue(_first: &HipBuffer) -> Result<Arc<HipDevice>, KernelError> {
            device().map(Arc::clone).map_err(driver)
        }

        fn allocate(_like: &HipBuffer, queue: &Arc<HipDevice>, len_bytes: usize) -> Result<HipBuffer, KernelError> {
            Ok(queue.allocate(len_bytes, Fill::Unspecified).map_err(ir_core::TensorError::from)?)
        }

        fn kernel(like: &HipBuffer, key: KernelKey<'_>) -> Result<HipFunction, KernelError> {
            let id = match key {
                KernelKey::Gated { op, dtype, vectorized } => {
                    KernelId::Op { kernel: op.def.name, dtype: Some(dtype), vectorized }
                }
                KernelKey::Rotary { dtype } => {
                    KernelId::Op { kernel: crate::rotary::KERNEL, dtype: Some(dtype), vectorized: false }
                }
                KernelKey::Quant { kernel, dtype, vectorized } => {
                    KernelId::Op { kernel, dtype: Some(dtype), vectorized }
                }
                KernelKey::RowProgram { program, binding, shape } => {
                    return like.device.generated_function(program, binding, shape);
                }
            };
            like.device.function(id, || key.symbol())
        }

        fn norm_kernel(like: &HipBuffer, key: &NormKey) -> Result<(HipFunction, NormShape), KernelError> {
            let (variant, shape) = norm_launch(key);
            let function = like.device.function(KernelId::Norm(variant), || variant.symbol())?;
            Ok((function, shape))
        }

        fn strided_kernel(like: &HipBuffer, key: StridedKey) -> Result<Option<HipFunction>, KernelError> {
            let Some(symbol) = key.symbol() else { return Ok(None) };
            let id = KernelId::Op { kernel: symbol, dtype: None, vectorized: false };
            like.device.function(id, || symbol.to_owned()).map(Some)
        }

        unsafe fn copy_bytes(
            queue: &Arc<HipDevice>,
            from: &HipBuffer,
            from_offset: usize,
            to: &mut HipBuffer,
            to_offset: usize,
            bytes: usize,
        ) -> Result<(), KernelError> {
            // SAFETY: both ranges lie inside their buffers (the caller's contract); `to` is borrowed
            // mutably, so they do not overlap.
            unsafe {
                queue.copy_device(
                    to.pointer.wrapping_byte_add(to_offset),
                    from.pointer.wrapping_byte_add(from_offset),
                    bytes,
                )
            }
        }

        fn buffer_queue(buffer: &HipBuffer) -> Arc<HipDevice> {
            Arc::clone(&buffer.device)
        }

        fn same_device(a: &HipBuffer, b: &HipBuffer) -> bool {
            Arc::ptr_eq(&a.device, &b.device)
        }

        fn base_alignment(buffer: &HipBuffer) -> usize {
            address_alignment(buffer.pointer as u64)
        }

        unsafe fn launch(
            queue: &Arc<HipDevice>,
            kernel: &HipFunction,
            grid: Grid,
            args: KernelArgs<'_, HipBuffer>,
        ) -> Result<(), KernelError> {
            let blocks = grid.hip_blocks()?;
            let mut values = args.resolve(|arg| {
                Ok(match arg {
                    BufferArg::Read { buffer, offset, element_size } => {
                        buffer.pointer.wrapping_byte_add(offset * element_size)
                    }
                    BufferArg::Write { buffer, offset, element_size } => {
                        buffer.pointer.wrapping_byte_add(offset * element_size)
                    }
                    BufferArg::Null => std::ptr::null_mut(),
                })
            })?;
            // `values` is not moved or grown from here on, so these pointers stay valid for the launch.
            let mut params: SmallVec<[*mut c_void; 20]> = values
                .iter_mut()
                .map(|value| match value {
                    Resolved::Buffer(pointer) => pointer as *mut *mut c_void as *mut c_void,
                    Resolved::Scalar(Scalar::I32(v)) => v as *mut i32 as *mut c_void,
                    Resolved::Scalar(Scalar::I64(v)) => v as *mut i64 as *mut c_void,
                    Resolved::Scalar(Scalar::F32(v)) => v as *mut f32 as *mut c_void,
                    Resolved::Scalar(Scalar::F64(v)) => v as *mut f64 as *mut c_void,
                    Resolved::Scalar(Scalar::I64x8(v)) => v as *mut [i64; 8] as *mut c_void,
                })
                .collect();
            // SAFETY: the caller's contract (`GpuRuntime::launch`): the parameters point to values of
            // the kernel's declared types in prototype order, a buffer as its element address, and the
            // buffers cover what the kernel touches.
            unsafe { queue.launch(*kernel, blocks, grid.group_size, &mut params) }
        }
    }
}

#[cfg(not(feature = "rocm"))]
mod unbuilt {
    use std::any::Any;

    use ir_core::storage::{DeviceBuffer, DeviceError};
    use ir_core::{Device, KernelError};
    use kernel_support::gpu::{GpuRuntime, Grid, KernelArgs, KernelKey, NormKey, NormShape, StridedKey};

    /// The HIP runtime of a build without feature `rocm`.
    #[derive(Debug)]
    pub(crate) struct Hip;

    /// HIP memory in a build without feature `rocm`: none can exist.
    #[derive(Debug)]
    pub(crate) enum NoHipMemory {}

    impl DeviceBuffer for NoHipMemory {
        fn device(&self) -> Device {
            match *self {}
        }
        fn len_bytes(&self) -> usize {
            match *self {}
        }
        fn download(&self, _dst: &mut [u8]) -> Result<(), DeviceError> {
            match *self {}
        }
        fn upload(&mut self, _src: &[u8]) -> Result<(), DeviceError> {
            match *self {}
        }
        fn allocate_like(&self, _len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
            match *self {}
        }
        fn as_any(&self) -> &dyn Any {
            match *self {}
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            match *self {}
        }
    }

    impl GpuRuntime for Hip {
        const MEMORY: &'static str = "HIP";
        const QUANT_GROUP: u32 = crate::quant::QUANT_BLOCK;
        const COPY_GROUP: u32 = 256;

        type Buffer = NoHipMemory;
        type Queue = ();
        type Kernel = ();

        fn gated_group(d: usize, dtype: ir_core::DType) -> u32 {
            kernel_support::gated_block(d, dtype)
        }
        fn queue(first: &NoHipMemory) -> Result<(), KernelError> {
            match *first {}
        }
        fn allocate(like: &NoHipMemory, _queue: &(), _len_bytes: usize) -> Result<NoHipMemory, KernelError> {
            match *like {}
        }
        fn kernel(like: &NoHipMemory, _key: KernelKey<'_>) -> Result<(), KernelError> {
            match *like {}
        }
        fn norm_kernel(like: &NoHipMemory, _key: &NormKey) -> Result<((), NormShape), KernelError> {
            match *like {}
        }
        fn strided_kernel(like: &NoHipMemory, _key: StridedKey) -> Result<Option<()>, KernelError> {
            match *like {}
        }
        unsafe fn copy_bytes(
            _queue: &(),
            from: &NoHipMemory,
            _from_offset: usize,
            _to: &mut NoHipMemory,
            _to_offset: usize,
            _bytes: usize,
        ) -> Result<(), KernelError> {
            match *from {}
        }

        fn buffer_queue(buffer: &NoHipMemory) {
            match *buffer {}
        }
        fn same_device(a: &NoHipMemory, _b: &NoHipMemory) -> bool {
            match *a {}
        }
        fn base_alignment(buffer: &NoHipMemory) -> usize {
            match *buffer {}
        }
        unsafe fn launch(
            _queue: &(),
            _kernel: &(),
            _grid: Grid,
            _args: KernelArgs<'_, NoHipMemory>,
        ) -> Result<(), KernelError> {
            Err(crate::not_built())
        }
    }
}
