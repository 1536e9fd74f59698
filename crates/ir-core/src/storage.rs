//! Byte buffers behind tensors: 64-byte aligned host memory, or device memory from a kernel crate.
//!
//! `ir-core` has no GPU dependency: device memory comes through the [`DeviceBuffer`] and
//! [`DeviceAllocator`] traits, which the kernel crates implement.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Device, Layout, TensorMeta};

static CPU_BYTES_ALLOCATED: AtomicU64 = AtomicU64::new(0);

/// Total bytes of host storage allocated by this process so far (monotonic; for reports and demos).
pub fn cpu_bytes_allocated() -> u64 {
    CPU_BYTES_ALLOCATED.load(Ordering::Relaxed)
}

/// An error from device memory management, reported by a kernel crate.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{device}: {operation} failed: {message}")]
pub struct DeviceError {
    /// The device involved.
    pub device: Device,
    /// What was attempted (`allocate`, `upload`, `download`, `copy`).
    pub operation: &'static str,
    /// The driver's description.
    pub message: String,
}

/// Device memory owned by one tensor storage. Implemented by the kernel crates.
pub trait DeviceBuffer: Send + Sync + fmt::Debug + Any {
    /// The device holding the memory.
    fn device(&self) -> Device;
    /// Size in bytes.
    fn len_bytes(&self) -> usize;
    /// Copies the whole buffer to host memory (`dst.len() == self.len_bytes()`); synchronizes.
    fn download(&self, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Copies host bytes into the start of the buffer.
    fn upload(&mut self, src: &[u8]) -> Result<(), DeviceError>;
    /// Allocates another buffer on the same device.
    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError>;
    /// Copies the elements `src` describes in this buffer into `dst` with `dst_layout` (same shape and dtype).
    ///
    /// The default goes through host memory; backends override it with a device-side copy.
    fn copy_strided(
        &self,
        src: &TensorMeta,
        dst: &mut dyn DeviceBuffer,
        dst_layout: &Layout,
    ) -> Result<(), DeviceError> {
        copy_strided_through_host(self, src, dst, dst_layout)
    }
    /// For downcasting to the backend's concrete buffer type.
    fn as_any(&self) -> &dyn Any;
    /// For downcasting to the backend's concrete buffer type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// [`DeviceBuffer::copy_strided`] through host memory: both buffers downloaded, the elements moved
/// on the host, the destination uploaded. The default of the trait, and the fallback of backends
/// whose device-side copy does not cover a case.
pub fn copy_strided_through_host(
    src_buffer: &(impl DeviceBuffer + ?Sized),
    src: &TensorMeta,
    dst: &mut dyn DeviceBuffer,
    dst_layout: &Layout,
) -> Result<(), DeviceError> {
    let size = src.dtype.size_in_bytes();
    let mut src_bytes = vec![0u8; src_buffer.len_bytes()];
    src_buffer.download(&mut src_bytes)?;
    let mut dst_bytes = vec![0u8; dst.len_bytes()];
    dst.download(&mut dst_bytes)?;
    for (from, to) in src.layout.storage_indices().zip(dst_layout.storage_indices()) {
        dst_bytes[to * size..(to + 1) * size].copy_from_slice(&src_bytes[from * size..(from + 1) * size]);
    }
    dst.upload(&dst_bytes)
}

/// Allocates device memory on one device. Implemented by the kernel crates.
pub trait DeviceAllocator: Send + Sync {
    /// The device allocated on.
    fn device(&self) -> Device;
    /// A zero-filled buffer of `len_bytes` bytes.
    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError>;
}

/// The memory behind one or more tensors.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuBuffer),
    /// Device memory.
    Device(Box<dyn DeviceBuffer>),
}

impl Storage {
    /// The device holding the memory.
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Device(buffer) => buffer.device(),
        }
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        match self {
            Storage::Cpu(buffer) => buffer.len_bytes(),
            Storage::Device(buffer) => buffer.len_bytes(),
        }
    }

    /// Whether tensors may write this memory (read-only host memory from another library is not).
    pub fn is_writable(&self) -> bool {
        match self {
            Storage::Cpu(buffer) => buffer.access() == HostAccess::ReadWrite,
            Storage::Device(_) => true,
        }
    }
}

/// A host allocation the allocator refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("out of memory: cannot allocate {bytes} bytes")]
pub struct OutOfMemory {
    /// The bytes asked for.
    pub bytes: usize,
}

/// Who may write a host buffer's memory through tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostAccess {
    /// Tensors may write the memory when they own it uniquely (in-place kernels, `copy_`).
    ReadWrite,
    /// Tensors never write the memory: an in-place call copies first, `copy_` into it is refused.
    ReadOnly,
}

/// Host memory: where it starts, and what keeps it alive.
///
/// Buffers allocated here own a `Vec<T>` of the dtype's element type, with the start moved to the
/// first 64-byte boundary (so the vector can be handed to another library without a copy);
/// buffers over someone else's memory (a moved-in vector, a candle tensor, a DLPack producer) own
/// whatever keeps that memory alive.
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    len_bytes: usize,
    access: HostAccess,
    owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the memory is plain bytes reachable from any thread; `owner` is `Send + Sync`, and the
// unsafe constructor's contract makes the memory valid for access from any thread while it lives.
unsafe impl Send for CpuBuffer {}
// SAFETY: as above; shared access only reads (`bytes`), writes need `&mut self`.
unsafe impl Sync for CpuBuffer {}

/// The alignment of buffers allocated here.
pub const CPU_ALIGNMENT: usize = 64;

impl CpuBuffer {
    /// A zero-filled buffer of `len_bytes` bytes starting at a 64-byte boundary, or
    /// [`OutOfMemory`] when the allocator refuses it (never an abort). Zeroed pages come from the
    /// allocator (`calloc`-style), not written here.
    pub fn zeroed(len_bytes: usize) -> Result<CpuBuffer, OutOfMemory> {
        CpuBuffer::zeroed_elements::<u8>(len_bytes)
    }

    /// A zero-filled buffer for `len_bytes` bytes of `dtype` elements, owning a `Vec` of the
    /// dtype's element type (so [`CpuBuffer::into_vec`] and the candle conversion can hand it over
    /// without a copy). `len_bytes` is rounded up to whole elements.
    pub fn zeroed_for(dtype: crate::DType, len_bytes: usize) -> Result<CpuBuffer, OutOfMemory> {
        let elements = len_bytes.div_ceil(dtype.size_in_bytes());
        let mut buffer = match dtype {
            crate::DType::F32 => CpuBuffer::zeroed_elements::<f32>(elements)?,
            crate::DType::F16 => CpuBuffer::zeroed_elements::<half::f16>(elements)?,
            crate::DType::BF16 => CpuBuffer::zeroed_elements::<half::bf16>(elements)?,
            crate::DType::F64 => CpuBuffer::zeroed_elements::<f64>(elements)?,
            crate::DType::F8E4M3FN => CpuBuffer::zeroed_elements::<crate::F8E4M3>(elements)?,
            crate::DType::F8E5M2 => CpuBuffer::zeroed_elements::<crate::F8E5M2>(elements)?,
            crate::DType::I8 => CpuBuffer::zeroed_elements::<i8>(elements)?,
            crate::DType::I64 => CpuBuffer::zeroed_elements::<i64>(elements)?,
        };
        buffer.len_bytes = len_bytes;
        Ok(buffer)
    }

    fn zeroed_elements<T: bytemuck::Pod + Send + Sync>(elements: usize) -> Result<CpuBuffer, OutOfMemory> {
        let size = size_of::<T>();
        let len_bytes = elements.checked_mul(size).ok_or(OutOfMemory { bytes: usize::MAX })?;
        // Room to move the start to the next 64-byte boundary.
        let padding = CPU_ALIGNMENT / size;
        // The allocation's layout is checked too: a size past `isize::MAX` is refused, not wrapped.
        let total = elements.checked_add(padding).ok_or(OutOfMemory { bytes: len_bytes })?;
        let mut vec =
            bytemuck::allocation::try_zeroed_vec::<T>(total).map_err(|()| OutOfMemory { bytes: len_bytes })?;
        let base = vec.as_mut_ptr();
        let skip = base.align_offset(CPU_ALIGNMENT).min(padding);
        // SAFETY: `skip <= padding`, inside the allocation of `elements + padding` elements.
        let start = unsafe { base.add(skip) }.cast::<u8>();
        CPU_BYTES_ALLOCATED.fetch_add(len_bytes as u64, Ordering::Relaxed);
        Ok(CpuBuffer {
            ptr: NonNull::new(start).expect("a vector's pointer is never null"),
            len_bytes,
            access: HostAccess::ReadWrite,
            owner: Box::new(vec),
        })
    }

    /// A buffer over a vector's elements, without a copy (writable; the start is wherever the
    /// vector's allocation is, aligned to `T`).
    pub fn from_vec<T: crate::Element>(mut vec: Vec<T>) -> CpuBuffer {
        let len_bytes = size_of_val(vec.as_slice());
        let ptr = NonNull::new(vec.as_mut_ptr().cast::<u8>()).expect("a vector's pointer is never null");
        CpuBuffer { ptr, len_bytes, access: HostAccess::ReadWrite, owner: Box::new(vec) }
    }

    /// A buffer over memory someone else owns, without a copy. `owner` is kept alive as long as
    /// the buffer (and every tensor over it) and dropped after the last one.
    ///
    /// # Safety
    ///
    /// For as long as `owner` is alive:
    /// - `ptr` is valid for reads of `len_bytes` bytes (and, with [`HostAccess::ReadWrite`], for
    ///   writes) from any thread, and the memory does not move;
    /// - nothing but tensors over this buffer writes the memory while a tensor over it is alive
    ///   (with `ReadOnly`: nothing writes it at all), so kernels reading it never race a writer;
    /// - `len_bytes <= isize::MAX`.
    pub unsafe fn from_external(
        ptr: NonNull<u8>,
        len_bytes: usize,
        access: HostAccess,
        owner: impl Any + Send + Sync,
    ) -> CpuBuffer {
        CpuBuffer { ptr, len_bytes, access, owner: Box::new(owner) }
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Whether tensors may write this memory.
    pub fn access(&self) -> HostAccess {
        self.access
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// What keeps the memory alive (the vector allocated here, a moved-in vector, a candle tensor,
    /// a DLPack tensor, or an engine's owner value).
    pub fn owner(&self) -> &(dyn Any + Send + Sync) {
        &*self.owner
    }

    /// The vector behind the buffer, when it is a `Vec<T>` whose elements the buffer covers from
    /// its first (a buffer from [`CpuBuffer::from_vec`]); the buffer back otherwise.
    pub fn into_vec<T: crate::Element>(self) -> Result<Vec<T>, CpuBuffer> {
        match self.owner.downcast_ref::<Vec<T>>() {
            Some(vec)
                if vec.as_ptr().cast::<u8>() == self.ptr.as_ptr() && size_of_val(vec.as_slice()) == self.len_bytes =>
            {
                Ok(*self.owner.downcast::<Vec<T>>().expect("checked above"))
            }
            _ => Err(self),
        }
    }

    /// The first byte and what keeps the memory alive, giving the buffer up.
    #[cfg(feature = "candle")]
    pub(crate) fn into_owner(self) -> (NonNull<u8>, Box<dyn Any + Send + Sync>) {
        (self.ptr, self.owner)
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for reads of `len_bytes` while `owner` lives (allocated here, or
        // the contract of `from_external`); writes need `&mut self`, which this borrow excludes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }

    /// The bytes, mutably.
    ///
    /// Tensors never hand out a read-only buffer mutably ([`Tensor::storage_mut`] refuses it),
    /// and a read-only buffer is only made by [`CpuBuffer::from_external`], whose caller owns it.
    ///
    /// # Panics
    ///
    /// On a [`HostAccess::ReadOnly`] buffer.
    ///
    /// [`Tensor::storage_mut`]: crate::Tensor::storage_mut
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(self.access == HostAccess::ReadWrite, "a read-only host buffer cannot be written");
        // SAFETY: valid for writes (allocated here, or `ReadWrite` under `from_external`'s
        // contract), and `&mut self` excludes every other access through this buffer.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }

    /// The buffer as elements of `T` (the whole buffer, `len_bytes / size_of::<T>()` elements).
    ///
    /// This is the whole storage, not a tensor's view of it: read a tensor's own elements with
    /// [`Tensor::to_vec`](crate::Tensor::to_vec).
    pub fn typed<T: bytemuck::Pod>(&self) -> &[T] {
        let whole = self.bytes();
        let n = whole.len() / size_of::<T>();
        bytemuck::cast_slice(&whole[..n * size_of::<T>()])
    }

    /// The buffer as elements of `T`, mutably.
    pub fn typed_mut<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        let whole = self.bytes_mut();
        let n = whole.len() / size_of::<T>();
        bytemuck::cast_slice_mut(&mut whole[..n * size_of::<T>()])
    }
}

impl fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuBuffer({} bytes, {:?})", self.len_bytes, self.access)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_buffers_are_aligned_and_zeroed() {
        for len in [0, 1, 63, 64, 65, 4096] {
            let buffer = CpuBuffer::zeroed(len).unwrap();
            assert_eq!(buffer.bytes().len(), len);
            assert_eq!(buffer.bytes().as_ptr() as usize % 64, 0);
            assert!(buffer.bytes().iter().all(|&b| b == 0));
        }
        let mut buffer = CpuBuffer::zeroed(12).unwrap();
        buffer.typed_mut::<f32>()[2] = 1.5;
        assert_eq!(buffer.typed::<f32>(), &[0.0, 0.0, 1.5]);
    }
}
