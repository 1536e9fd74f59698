//! Tensors to and from candle (`candle-core` 0.9), on the CPU.

use std::ptr::NonNull;

use candle_core as candle;
use candle_core::backend::BackendStorage;

use super::InteropError;
use crate::storage::PooledBlock;
use crate::storage::{CpuBuffer, HostAccess, Storage};
use crate::{DType, Device, Element, Layout, Tensor};

const LIBRARY: &str = "candle";

fn candle_error(error: candle::Error) -> InteropError {
    InteropError::Library { library: LIBRARY, message: error.to_string() }
}

/// The dtype, first byte and byte length of a candle CPU storage.
fn host_memory(storage: &candle::CpuStorage) -> Result<(DType, *const u8, usize), InteropError> {
    fn parts<T>(values: &[T], dtype: DType) -> (DType, *const u8, usize) {
        (dtype, values.as_ptr().cast(), size_of_val(values))
    }
    Ok(match storage {
        candle::CpuStorage::F32(values) => parts(values, DType::F32),
        candle::CpuStorage::F16(values) => parts(values, DType::F16),
        candle::CpuStorage::BF16(values) => parts(values, DType::BF16),
        candle::CpuStorage::F64(values) => parts(values, DType::F64),
        candle::CpuStorage::F8E4M3(values) => parts(values, DType::F8E4M3FN),
        candle::CpuStorage::I64(values) => parts(values, DType::I64),
        other => {
            return Err(InteropError::UnsupportedDType { library: LIBRARY, dtype: format!("{:?}", other.dtype()) });
        }
    })
}

/// A read-only tensor over `tensor`'s memory, given its storage (under a read lock the caller holds)
/// and layout; the tensor keeps a clone of `tensor`, so the memory outlives it.
///
/// # Safety
///
/// As [`Tensor::from_candle_shared`]: no candle in-place write to the storage while the view lives.
unsafe fn view(
    tensor: &candle::Tensor,
    storage: &candle::Storage,
    layout: &candle::Layout,
) -> Result<Tensor, InteropError> {
    let candle::Storage::Cpu(cpu) = storage else {
        return Err(InteropError::UnsupportedDevice {
            library: LIBRARY,
            device: format!("{:?}", tensor.device().location()),
            hint: "move it with `to_device(&candle_core::Device::Cpu)`",
        });
    };
    let (dtype, ptr, len_bytes) = host_memory(cpu)?;
    let layout = Layout::new(layout.dims(), layout.stride(), layout.start_offset())
        .map_err(|error| InteropError::UnsupportedLayout { library: LIBRARY, reason: error.to_string() })?;
    // A candle storage's vector never moves or shrinks while a tensor over it lives (the clone
    // below keeps it), and the caller promises no in-place candle write meanwhile.
    let ptr = NonNull::new(ptr.cast_mut()).unwrap_or(NonNull::dangling());
    // SAFETY: as above; the buffer is read-only, so this crate never writes it either.
    let buffer = unsafe { CpuBuffer::from_external(ptr, len_bytes, HostAccess::ReadOnly, tensor.clone()) };
    Ok(Tensor::from_storage(Storage::Cpu(buffer), dtype, layout)?)
}

impl Tensor {
    /// A tensor viewing a candle CPU tensor's memory, without a copy: the same elements, strides
    /// and offset, read-only (an in-place call copies it first), keeping the candle tensor alive
    /// until the last view is dropped.
    ///
    /// # Safety
    ///
    /// Candle tensors are immutable except through candle's explicit in-place operations
    /// (`slice_set`, `inplace_op1`/`2`/`3`, custom in-place ops), which write the shared storage
    /// under candle's lock that this tensor does not take. None of them may write this storage
    /// while the returned tensor or a view of it is alive. [`Tensor::from_candle`] copies instead
    /// and has no such condition.
    ///
    /// ```
    /// use ir_core::Tensor;
    /// let weight = candle_core::Tensor::new(&[1.0f32, 2.0, 3.0], &candle_core::Device::Cpu)?;
    /// // SAFETY: nothing writes `weight` in place while `w` lives.
    /// let w = unsafe { Tensor::from_candle_shared(&weight)? };
    /// assert_eq!(w.to_vec::<f32>()?, [1.0, 2.0, 3.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub unsafe fn from_candle_shared(tensor: &candle::Tensor) -> Result<Tensor, InteropError> {
        let (storage, layout) = tensor.storage_and_layout();
        // SAFETY: the caller's contract.
        unsafe { view(tensor, &storage, layout) }
    }

    /// A copy of a candle CPU tensor (compact, writable), taken while holding candle's storage
    /// lock; [`Tensor::from_candle_shared`] views the memory without a copy.
    pub fn from_candle(tensor: &candle::Tensor) -> Result<Tensor, InteropError> {
        // The lock is taken once: a second read lock on this thread could wait behind a writer
        // queued in between, which waits for the first.
        let (storage, layout) = tensor.storage_and_layout();
        // SAFETY: candle's read lock is held until the copy is made, so no in-place candle
        // operation can write the storage meanwhile; the view is dropped before the lock.
        let shared = unsafe { view(tensor, &storage, layout)? };
        let copy = shared.contiguous();
        drop(shared);
        drop(storage);
        Ok(copy?)
    }

    /// The tensor as a candle CPU tensor, keeping this handle. Without a copy when the tensor is a
    /// [`Tensor::from_candle_shared`] view with the candle tensor's own layout (a weight an engine
    /// handed to a traced graph as a parameter, say): that candle tensor. A compact copy otherwise,
    /// as [`Tensor::into_candle`] of a shared handle.
    ///
    /// ```
    /// use ir_core::Tensor;
    /// let weight = candle_core::Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &candle_core::Device::Cpu)?;
    /// // SAFETY: nothing writes `weight` in place while `w` lives.
    /// let w = unsafe { Tensor::from_candle_shared(&weight)? };
    /// assert_eq!(w.to_candle()?.id(), weight.id(), "the candle tensor itself");
    /// assert_ne!(w.transpose(0, 1)?.to_candle()?.id(), weight.id(), "another layout: a copy");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_candle(&self) -> Result<candle::Tensor, InteropError> {
        if let Some(source) = self.cpu_buffer().and_then(|buffer| buffer.owner().downcast_ref::<candle::Tensor>()) {
            let layout = source.layout();
            if layout.dims() == self.shape()
                && layout.stride() == self.strides()
                && layout.start_offset() == self.offset()
                && source.device().is_cpu()
            {
                return Ok(source.clone());
            }
        }
        self.clone().into_candle()
    }

    /// The tensor as a candle CPU tensor. Without a copy when this handle owns its storage alone
    /// and the tensor is compact (row-major from some offset): the storage's vector moves into
    /// candle, which views the tensor's elements of it. A copy otherwise (a shared storage, a
    /// strided view, a device tensor).
    ///
    /// ```
    /// use ir_core::Tensor;
    /// let t = Tensor::from_vec(&[2, 2], vec![1.0f32, 2.0, 3.0, 4.0])?;
    /// let c = t.into_candle()?;
    /// assert_eq!(c.to_vec2::<f32>()?, [[1.0, 2.0], [3.0, 4.0]]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn into_candle(self) -> Result<candle::Tensor, InteropError> {
        match self.dtype() {
            DType::F32 => into_candle_typed::<f32>(self),
            DType::F16 => into_candle_typed::<half::f16>(self),
            DType::BF16 => into_candle_typed::<half::bf16>(self),
            DType::F64 => into_candle_typed::<f64>(self),
            DType::F8E4M3FN => into_candle_typed::<crate::F8E4M3>(self),
            DType::I64 => into_candle_typed::<i64>(self),
            // candle 0.9 has no E5M2 and no i8.
            DType::F8E5M2 | DType::I8 => {
                Err(InteropError::UnsupportedDType { library: LIBRARY, dtype: self.dtype().to_string() })
            }
        }
    }
}

/// Up to this many bytes, a fresh output's elements are moved to the front of its vector so that
/// candle wraps the vector as it is (one tensor); a larger output becomes a narrowed view of the
/// whole vector (three tensors, no copy). Measured on the CPU the benchmarks run on: at 1 KiB the
/// move saves about 140 ns of the narrowed view's 300; they cost the same at 16 KiB.
const MOVE_TO_FRONT_BYTES: usize = 8 * 1024;

fn into_candle_typed<T: Element + candle::WithDType>(tensor: Tensor) -> Result<candle::Tensor, InteropError> {
    let shape = tensor.shape().to_vec();
    let tensor = if tensor.device() == Device::Cpu { tensor } else { tensor.to_cpu()? };
    if !tensor.layout().is_compact() {
        return copy_into_candle::<T>(&tensor);
    }
    match tensor.into_unique_storage() {
        Ok((Storage::Cpu(buffer), meta))
            if buffer.owner().is::<Vec<T>>()
                || buffer.owner().downcast_ref::<PooledBlock>().is_some_and(PooledBlock::holds::<T>) =>
        {
            let (ptr, owner) = match buffer.into_owner() {
                Ok(owned) => owned,
                // A shared owner (a view's): the memory is not the tensor's to give.
                Err(buffer) => {
                    return copy_into_candle::<T>(&Tensor::from_storage(
                        Storage::Cpu(buffer),
                        meta.dtype,
                        meta.layout,
                    )?);
                }
            };
            // A pooled buffer's vector leaves the pool: candle owns it from here.
            let mut vec: Vec<T> = match owner.downcast::<Vec<T>>() {
                Ok(vec) => *vec,
                Err(owner) => {
                    owner.downcast::<PooledBlock>().expect("checked above").take_vec::<T>().expect("checked above")
                }
            };
            // The buffer starts inside the vector (at its first 64-byte boundary, or at its start).
            let skipped = (ptr.as_ptr() as usize - vec.as_ptr() as usize) / size_of::<T>();
            let start = skipped + meta.layout.offset();
            let numel = meta.layout.numel();
            if numel * size_of::<T>() <= MOVE_TO_FRONT_BYTES {
                // One candle tensor of exactly the elements: moving them to the front costs less
                // than the two more tensors a narrowed view makes.
                vec.copy_within(start..start + numel, 0);
                vec.truncate(numel);
                return candle::Tensor::from_vec(vec, shape, &candle::Device::Cpu).map_err(candle_error);
            }
            let len = vec.len();
            let whole = candle::Tensor::from_vec(vec, len, &candle::Device::Cpu).map_err(candle_error)?;
            whole.narrow(0, start, numel).and_then(|elements| elements.reshape(shape)).map_err(candle_error)
        }
        // Memory someone else lent, or a vector of bytes: copied.
        Ok((storage, meta)) => copy_into_candle::<T>(&Tensor::from_storage(storage, meta.dtype, meta.layout)?),
        Err(tensor) => copy_into_candle::<T>(&tensor),
    }
}

fn copy_into_candle<T: Element + candle::WithDType>(tensor: &Tensor) -> Result<candle::Tensor, InteropError> {
    candle::Tensor::from_vec(tensor.to_vec::<T>()?, tensor.shape(), &candle::Device::Cpu).map_err(candle_error)
}
