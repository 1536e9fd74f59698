//! Byte buffers behind tensors: 64-byte aligned host memory, or device memory from a kernel crate.
//!
//! `ir-core` has no GPU dependency: device memory comes through the [`DeviceBuffer`] and
//! [`DeviceAllocator`] traits, which the kernel crates implement.

use std::any::Any;
use std::fmt;
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
        let size = src.dtype.size_in_bytes();
        let mut src_bytes = vec![0u8; self.len_bytes()];
        self.download(&mut src_bytes)?;
        let mut dst_bytes = vec![0u8; dst.len_bytes()];
        dst.download(&mut dst_bytes)?;
        for (from, to) in src.layout.storage_indices().zip(dst_layout.storage_indices()) {
            dst_bytes[to * size..(to + 1) * size].copy_from_slice(&src_bytes[from * size..(from + 1) * size]);
        }
        dst.upload(&dst_bytes)
    }
    /// For downcasting to the backend's concrete buffer type.
    fn as_any(&self) -> &dyn Any;
    /// For downcasting to the backend's concrete buffer type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
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
}

/// A host allocation the allocator refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("out of memory: cannot allocate {bytes} bytes")]
pub struct OutOfMemory {
    /// The bytes asked for.
    pub bytes: usize,
}

#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Chunk([u8; 64]);

/// A zero-initialized host buffer whose start is 64-byte aligned.
pub struct CpuBuffer {
    chunks: Vec<Chunk>,
    len_bytes: usize,
}

impl CpuBuffer {
    /// A zero-filled buffer of `len_bytes` bytes, or [`OutOfMemory`] when the allocator refuses it
    /// (never an abort). Zeroed pages come from the allocator (`calloc`-style), not written here.
    pub fn zeroed(len_bytes: usize) -> Result<CpuBuffer, OutOfMemory> {
        // The allocation's layout is checked too: a size past `isize::MAX` is refused, not wrapped.
        let chunks = bytemuck::allocation::try_zeroed_slice_box::<Chunk>(len_bytes.div_ceil(64))
            .map_err(|()| OutOfMemory { bytes: len_bytes })?
            .into_vec();
        CPU_BYTES_ALLOCATED.fetch_add(len_bytes as u64, Ordering::Relaxed);
        Ok(CpuBuffer { chunks, len_bytes })
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<Chunk, u8>(&self.chunks)[..self.len_bytes]
    }

    /// The bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<Chunk, u8>(&mut self.chunks)[..self.len_bytes]
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
        write!(f, "CpuBuffer({} bytes)", self.len_bytes)
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
