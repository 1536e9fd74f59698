//! The device buffer every emulated provider's runtime uses: [`EmuMemory`] on the emulated device
//! of its runtime.

use std::any::Any;
use std::marker::PhantomData;

use ir_core::Device;
use ir_core::storage::{DeviceAllocator, DeviceBuffer, DeviceError};

use super::EmuMemory;
use crate::gpu::GpuRuntime;

/// An emulated GPU runtime whose buffers are [`EmuBuffer`]s of its own.
pub trait EmuDevice: GpuRuntime<Buffer = EmuBuffer<Self>> + Sized + 'static {
    /// The device its tensors are on (`cuda:0`, `rocm:0`).
    const DEVICE: Device;

    /// Told each time a buffer allocates zeroed memory through another
    /// ([`DeviceBuffer::allocate_like`], a fill pass on a real device), so a provider can count them.
    fn zeroed_allocation() {}
}

/// Emulated device memory of runtime `R`: host memory whose first byte is 256-byte aligned. A
/// buffer allocated for overwriting is filled with `0xff` bytes (a NaN in every float dtype), so a
/// byte a kernel leaves unwritten shows.
pub struct EmuBuffer<R> {
    memory: EmuMemory,
    _runtime: PhantomData<fn() -> R>,
}

impl<R> std::fmt::Debug for EmuBuffer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuBuffer").field("memory", &self.memory).finish()
    }
}

impl<R> EmuBuffer<R> {
    /// `len_bytes` bytes, each `byte`.
    pub fn filled(len_bytes: usize, byte: u8) -> Self {
        EmuBuffer { memory: EmuMemory::filled(len_bytes, byte), _runtime: PhantomData }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        self.memory.bytes()
    }

    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.memory.bytes_mut()
    }

    /// The memory, for a launch's arguments and device copies.
    pub fn memory(&self) -> &EmuMemory {
        &self.memory
    }

    /// The memory, writable.
    pub fn memory_mut(&mut self) -> &mut EmuMemory {
        &mut self.memory
    }
}

/// Allocates zeroed emulated memory of runtime `R` (its [`EmuDevice::DEVICE`]).
pub struct EmuAllocator<R>(PhantomData<fn() -> R>);

impl<R> EmuAllocator<R> {
    /// The allocator.
    pub const fn new() -> Self {
        EmuAllocator(PhantomData)
    }
}

impl<R> Default for EmuAllocator<R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<R> Clone for EmuAllocator<R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R> Copy for EmuAllocator<R> {}

impl<R> std::fmt::Debug for EmuAllocator<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EmuAllocator")
    }
}

impl<R: EmuDevice> DeviceAllocator for EmuAllocator<R> {
    fn device(&self) -> Device {
        R::DEVICE
    }

    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(EmuBuffer::<R>::filled(len_bytes, 0)))
    }
}

impl<R: EmuDevice> DeviceBuffer for EmuBuffer<R> {
    fn device(&self) -> Device {
        R::DEVICE
    }

    fn len_bytes(&self) -> usize {
        self.memory.len_bytes()
    }

    fn download(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        let n = dst.len().min(self.memory.len_bytes());
        dst[..n].copy_from_slice(&self.bytes()[..n]);
        Ok(())
    }

    fn upload(&mut self, src: &[u8]) -> Result<(), DeviceError> {
        let n = src.len().min(self.memory.len_bytes());
        self.bytes_mut()[..n].copy_from_slice(&src[..n]);
        Ok(())
    }

    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        R::zeroed_allocation();
        Ok(Box::new(Self::filled(len_bytes, 0)))
    }

    /// Filled with `0xff` bytes (a NaN in every float dtype), so a byte left unwritten shows.
    fn allocate_for_overwrite(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        Ok(Box::new(Self::filled(len_bytes, 0xff)))
    }

    crate::strided_on_device!(R);

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
