//! DLPack import and export (through `dlpark`), for host memory.

use std::ptr::NonNull;

use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType};
use dlpark::metadata::Dynamic;
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};

use super::{AddressProblem, InteropError};
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

/// The first byte of a DLPack tensor's elements: `data + byte_offset`, checked so that the
/// `len_bytes` from it are an address range memory can have. An empty tensor (no bytes) may have
/// any pointer, null or unaligned included; it gets a dangling one aligned for every dtype (8
/// bytes), which nothing reads.
fn checked_start(data: *const u8, byte_offset: u64, len_bytes: usize) -> Result<NonNull<u8>, InteropError> {
    let address = data as usize;
    if len_bytes == 0 {
        return Ok(NonNull::<u64>::dangling().cast());
    }
    if data.is_null() {
        return Err(InteropError::BadAddress { library: LIBRARY, problem: AddressProblem::NullData { len_bytes } });
    }
    // One allocation spans at most `isize::MAX` bytes and never wraps around the address space.
    let within = usize::try_from(byte_offset)
        .ok()
        .and_then(|offset| offset.checked_add(len_bytes))
        .filter(|&extent| extent <= isize::MAX as usize && address.checked_add(extent).is_some());
    if within.is_none() {
        return Err(InteropError::BadAddress {
            library: LIBRARY,
            problem: AddressProblem::PastAddressSpace { address, byte_offset, len_bytes },
        });
    }
    // The offset stays inside the producer's allocation (the caller's contract); `wrapping_add`
    // computes the same address without asserting that here.
    Ok(NonNull::new(data.wrapping_add(byte_offset as usize).cast_mut()).expect("checked: no wrap past zero"))
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
    /// What the descriptor alone shows is checked before its memory is trusted: the shape and
    /// strides are non-negative and the extent they reach fits `isize::MAX` bytes; a tensor with
    /// elements has a non-null data pointer; `data + byte_offset` and the extent after it neither
    /// pass `isize::MAX` bytes nor wrap around the address space; the first element is aligned.
    /// Whether the memory in that range is really the producer's, alive and not written meanwhile
    /// cannot be checked: that is the contract below.
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
            let access = if dlpack.flags().contains(DlpackFlags::READ_ONLY) {
                HostAccess::ReadOnly
            } else {
                HostAccess::ReadWrite
            };
            (dtype, layout, (view.data_ptr() as *const u8, view.byte_offset()), access)
        };
        let meta = TensorMeta { dtype, device: Device::Cpu, layout };
        let len_bytes = meta.storage_bytes().ok_or_else(|| InteropError::UnsupportedLayout {
            library: LIBRARY,
            reason: format!("{meta} reaches past isize::MAX bytes"),
        })?;
        let ptr = checked_start(start.0, start.1, len_bytes)?;
        // SAFETY: the caller's DLPack contract makes the descriptor's extent valid host memory,
        // untouched by the producer, while `dlpack` (kept as the owner) lives; `checked_start`
        // refused what the descriptor alone shows cannot be memory (a null pointer with elements,
        // an extent past `isize::MAX` or the end of the address space).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A compact DLPack descriptor of `dtype` and `shape` over `data + byte_offset`; its context owns
    /// nothing, so the deleter frees only the descriptor.
    fn descriptor(
        dtype: DType,
        shape: &[i64],
        data: *mut std::ffi::c_void,
        byte_offset: u64,
    ) -> dlpark::versioned::Dlpack {
        let mut strides = vec![1i64; shape.len()];
        for dim in (0..shape.len().saturating_sub(1)).rev() {
            strides[dim] = strides[dim + 1] * shape[dim + 1];
        }
        let mut initialized = Dynamic::new(shape.to_vec(), strides).initialize(Box::new(())).unwrap();
        initialized
            .set_data(data)
            .set_device(DLDevice::CPU)
            .set_dtype(dtype_to_dlpack(dtype))
            .set_byte_offset(byte_offset);
        // SAFETY: shape and strides were copied into the descriptor; its data pointer is only
        // ever read by the tests below after `from_dlpack` accepted it.
        unsafe { initialized.finish() }
    }

    fn bad_address(result: Result<Tensor, InteropError>) -> AddressProblem {
        match result {
            Err(InteropError::BadAddress { problem, .. }) => problem,
            Err(other) => panic!("another error: {other}"),
            Ok(t) => panic!("accepted: {}", t.meta()),
        }
    }

    #[test]
    fn descriptors_whose_addresses_cannot_be_memory_are_refused_before_any_read() {
        let mut values = [1.0f32, 2.0, 3.0, 4.0];
        let data = values.as_mut_ptr().cast::<std::ffi::c_void>();
        // SAFETY (every call below): `from_dlpack` refuses these descriptors from their fields
        // alone, before it reads or keeps their memory; the accepted ones point at `values` or
        // hold no element.
        let far = bad_address(unsafe { Tensor::from_dlpack(descriptor(DType::F32, &[4], data, 1 << 63)) });
        assert!(matches!(far, AddressProblem::PastAddressSpace { byte_offset, .. } if byte_offset == 1 << 63), "{far}");
        let null = bad_address(unsafe { Tensor::from_dlpack(descriptor(DType::I8, &[4], std::ptr::null_mut(), 0)) });
        assert_eq!(null, AddressProblem::NullData { len_bytes: 4 });
        assert_eq!(null.to_string(), "a null data pointer for 4 bytes of elements");
        let top = (usize::MAX - 7) as *mut std::ffi::c_void;
        let wraps = bad_address(unsafe { Tensor::from_dlpack(descriptor(DType::I8, &[16], top, 0)) });
        assert!(matches!(wraps, AddressProblem::PastAddressSpace { len_bytes: 16, .. }), "{wraps}");
        let past_isize =
            bad_address(unsafe { Tensor::from_dlpack(descriptor(DType::I8, &[4], data, isize::MAX as u64 - 2)) });
        assert!(matches!(past_isize, AddressProblem::PastAddressSpace { .. }), "{past_isize}");

        // An empty tensor of any dtype may have any pointer, null or unaligned included, and it
        // goes back out.
        for dtype in [DType::I8, DType::F32, DType::BF16, DType::F16, DType::F64, DType::I64, DType::F8E4M3FN] {
            for pointer in [std::ptr::null_mut(), std::ptr::without_provenance_mut::<std::ffi::c_void>(3), data] {
                let empty = unsafe { Tensor::from_dlpack(descriptor(dtype, &[0, 4], pointer, 0)) }
                    .unwrap_or_else(|error| panic!("{dtype} at {pointer:?}: {error}"));
                assert_eq!((empty.dtype(), empty.shape()), (dtype, &[0usize, 4][..]));
                let back = unsafe { Tensor::from_dlpack(empty.to_dlpack().unwrap()) }.unwrap();
                assert_eq!((back.dtype(), back.numel()), (dtype, 0));
            }
        }
        let ok = unsafe { Tensor::from_dlpack(descriptor(DType::F32, &[2], data, 8)) }.unwrap();
        assert_eq!(ok.to_vec::<f32>().unwrap(), [3.0, 4.0]);
    }
}
