//! DLPack import and export (through `dlpark`), for host memory.

use std::ptr::NonNull;

use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType};
use dlpark::metadata::Dynamic;
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};

use super::InteropError;
use crate::storage::{CpuBuffer, HostAccess, Storage};
use crate::{DType, Device, Layout, Tensor, TensorMeta};

const LIBRARY: &str = "DLPack";

fn dlpack_error(error: impl std::fmt::Display) -> InteropError {
    InteropError::Library { library: LIBRARY, message: error.to_string() }
}

fn dtype_from_dlpack(dtype: DLDataType) -> Result<DType, InteropError> {
    Ok(match dtype {
        t if t == DLDataType::F32 => DType::F32,
        t if t == DLDataType::F16 => DType::F16,
        t if t == DLDataType::BF16 => DType::BF16,
        t if t == DLDataType::F64 => DType::F64,
        t if t == DLDataType::F8E4M3FN => DType::F8E4M3FN,
        t if t == DLDataType::F8E5M2 => DType::F8E5M2,
        t if t == DLDataType::I8 => DType::I8,
        t if t == DLDataType::I64 => DType::I64,
        other => {
            return Err(InteropError::UnsupportedDType {
                library: LIBRARY,
                dtype: format!("code {} bits {} lanes {}", other.code.0, other.bits, other.lanes),
            });
        }
    })
}

fn dtype_to_dlpack(dtype: DType) -> DLDataType {
    match dtype {
        DType::F32 => DLDataType::F32,
        DType::F16 => DLDataType::F16,
        DType::BF16 => DLDataType::BF16,
        DType::F64 => DLDataType::F64,
        DType::F8E4M3FN => DLDataType::F8E4M3FN,
        DType::F8E5M2 => DLDataType::F8E5M2,
        DType::I8 => DLDataType::I8,
        DType::I64 => DLDataType::I64,
    }
}

fn non_negative(values: &[i64], what: &str) -> Result<Vec<usize>, InteropError> {
    values
        .iter()
        .map(|&value| {
            usize::try_from(value).map_err(|_| InteropError::UnsupportedLayout {
                library: LIBRARY,
                reason: format!("{what} {values:?} has a negative entry"),
            })
        })
        .collect()
}

impl Tensor {
    /// A tensor over a DLPack tensor's host memory, without a copy (`DLPack` from PyTorch, NumPy,
    /// JAX, candle through dlpark, …). The tensor keeps the DLPack tensor and calls its deleter
    /// after the last view is dropped. It is writable unless the producer set `READ_ONLY`: as with
    /// `torch.from_dlpack`, a write through it (only ever an in-place call on a uniquely owned
    /// tensor) is visible to the producer.
    ///
    /// Accepted: CPU (and pinned host) memory; f32, f16, bf16, f64, f8e4m3fn, f8e5m2, i8 and i64; non-negative strides (or
    /// none: compact); a first element aligned to the element size. Anything else is an error
    /// naming it, and the DLPack tensor is released.
    ///
    /// # Safety
    ///
    /// DLPack's exchange contract: the memory the descriptor reaches is valid host memory while
    /// the DLPack tensor lives, and the producer neither writes nor frees it meanwhile.
    pub unsafe fn from_dlpack<M: ManagedTensorBase + 'static>(dlpack: Managed<M>) -> Result<Tensor, InteropError> {
        let (dtype, layout, start, access) = {
            let view = dlpack.validate().map_err(dlpack_error)?;
            let device = view.device();
            let host = [DLDeviceType::CPU, DLDeviceType::CUDAHOST, DLDeviceType::ROCMHOST];
            if !host.contains(&device.device_type) {
                return Err(InteropError::UnsupportedDevice {
                    library: LIBRARY,
                    device: format!("device type {} id {}", device.device_type.0, device.device_id),
                    hint: "device memory goes to its kernel crate; copy it to the host first",
                });
            }
            let dtype = dtype_from_dlpack(view.dtype())?;
            let shape = non_negative(view.shape(), "shape")?;
            let strides = view.strides_or_compact().map_err(dlpack_error)?;
            let strides = non_negative(&strides, "strides")?;
            let layout = Layout::new(&shape, &strides, 0)
                .map_err(|error| InteropError::UnsupportedLayout { library: LIBRARY, reason: error.to_string() })?;
            let offset = usize::try_from(view.byte_offset()).map_err(dlpack_error)?;
            let start = (view.data_ptr() as *const u8).wrapping_add(offset);
            let access = if dlpack.flags().contains(DlpackFlags::READ_ONLY) {
                HostAccess::ReadOnly
            } else {
                HostAccess::ReadWrite
            };
            (dtype, layout, start, access)
        };
        let meta = TensorMeta { dtype, device: Device::Cpu, layout };
        let len_bytes = meta.storage_bytes().ok_or_else(|| InteropError::UnsupportedLayout {
            library: LIBRARY,
            reason: format!("{meta} reaches past isize::MAX bytes"),
        })?;
        let ptr = NonNull::new(start.cast_mut()).unwrap_or(NonNull::dangling());
        // SAFETY: the caller's DLPack contract makes the descriptor's extent valid host memory,
        // untouched by the producer, while `dlpack` (kept as the owner) lives.
        let buffer = unsafe { CpuBuffer::from_external(ptr, len_bytes, access, dlpack) };
        Ok(Tensor::from_storage(Storage::Cpu(buffer), meta.dtype, meta.layout)?)
    }

    /// The tensor as a (versioned) DLPack tensor, without a copy: the DLPack tensor keeps this
    /// tensor's storage alive until its deleter runs. Writable when this handle owned its storage
    /// alone (and the memory is writable); `READ_ONLY` otherwise, as other handles may read it.
    /// Host tensors only: copy a device tensor with [`Tensor::to_cpu`] first.
    ///
    /// ```
    /// use ir_core::Tensor;
    /// let t = Tensor::from_vec(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
    /// let view = t.transpose(0, 1)?;
    /// let exported = view.to_dlpack()?; // `t` still holds the storage: read-only
    /// // SAFETY: the exported tensor keeps the storage alive; nothing writes it.
    /// let back = unsafe { Tensor::from_dlpack(exported)? };
    /// assert_eq!(back.to_vec::<f32>()?, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_dlpack(self) -> Result<dlpark::versioned::Dlpack, InteropError> {
        let Some(buffer) = self.cpu_buffer() else {
            return Err(InteropError::UnsupportedDevice {
                library: LIBRARY,
                device: self.device().to_string(),
                hint: "copy it with `Tensor::to_cpu` first",
            });
        };
        let data = buffer.as_ptr().cast_mut().cast::<std::ffi::c_void>();
        let read_only = !self.is_uniquely_owned();
        let to_i64 = |values: &[usize]| values.iter().map(|&v| v as i64).collect::<Vec<i64>>();
        let (shape, strides) = (to_i64(self.shape()), to_i64(self.strides()));
        let byte_offset = (self.offset() * self.dtype().size_in_bytes()) as u64;
        let dtype = dtype_to_dlpack(self.dtype());
        let mut initialized = Dynamic::new(shape, strides).initialize(Box::new(self)).map_err(dlpack_error)?;
        initialized.set_data(data).set_device(DLDevice::CPU).set_dtype(dtype).set_byte_offset(byte_offset);
        let flags = if read_only { DlpackFlags::READ_ONLY } else { DlpackFlags::empty() };
        initialized.set_flags(flags).map_err(dlpack_error)?;
        // SAFETY: the data pointer is the storage's first byte, kept alive by the boxed tensor
        // (the context, dropped by the deleter); shape and strides are copied into the allocation
        // and describe a layout that fits the storage; the flags say read-only whenever another
        // handle may read the memory.
        Ok(unsafe { initialized.finish() })
    }
}
