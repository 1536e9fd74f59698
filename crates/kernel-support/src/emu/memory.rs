//! Emulated device memory, and a [`GpuRuntime`](crate::gpu::GpuRuntime) launch's arguments turned
//! into the emulator's: what an emulated provider's runtime shares with every other.

use ir_core::KernelError;

use super::{EmuArg, EmuError, EmuGrid, EmuProgram};
use crate::gpu::{BufferArg, KernelArgs, Resolved, Scalar};

/// The alignment of every buffer's first byte, as `cuMemAlloc` and `hipMalloc` give.
pub const ALIGN: usize = 256;

#[repr(C, align(256))]
#[derive(Clone, Copy)]
struct Block([u8; ALIGN]);

/// Emulated device memory: host memory whose first byte is [`ALIGN`]-byte aligned.
pub struct EmuMemory {
    blocks: Vec<Block>,
    len_bytes: usize,
}

impl std::fmt::Debug for EmuMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuMemory").field("len_bytes", &self.len_bytes).finish()
    }
}

impl EmuMemory {
    /// `len_bytes` bytes, each `byte`.
    pub fn filled(len_bytes: usize, byte: u8) -> EmuMemory {
        EmuMemory { blocks: vec![Block([byte; ALIGN]); len_bytes.div_ceil(ALIGN)], len_bytes }
    }

    /// The length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `blocks` holds at least `len_bytes` initialized bytes (plain byte arrays).
        unsafe { std::slice::from_raw_parts(self.blocks.as_ptr().cast::<u8>(), self.len_bytes) }
    }

    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.blocks.as_mut_ptr().cast::<u8>(), self.len_bytes) }
    }

    /// The address of element `offset` of `element_size` bytes, for a kernel argument; an error when
    /// it lies past the buffer's end.
    fn element_address(&self, offset: usize, element_size: usize) -> Result<*const u8, KernelError> {
        let byte = self.element_byte(offset, element_size)?;
        Ok(self.blocks.as_ptr().cast::<u8>().wrapping_add(byte))
    }

    /// As `element_address`, for a kernel that writes the buffer.
    fn element_address_mut(&mut self, offset: usize, element_size: usize) -> Result<*mut u8, KernelError> {
        let byte = self.element_byte(offset, element_size)?;
        Ok(self.blocks.as_mut_ptr().cast::<u8>().wrapping_add(byte))
    }

    fn element_byte(&self, offset: usize, element_size: usize) -> Result<usize, KernelError> {
        offset.checked_mul(element_size).filter(|&byte| byte <= self.len_bytes).ok_or_else(|| {
            KernelError::InvalidArguments {
                reason: format!(
                    "element {offset} of {element_size} bytes lies past the end of a buffer of {} bytes",
                    self.len_bytes
                ),
            }
        })
    }

    /// Copies `bytes` bytes from `from` (from byte `from_offset`) to byte `to_offset` on, as a
    /// device copy does; an error, with nothing copied, when either range leaves its buffer.
    pub fn copy_from(
        &mut self,
        to_offset: usize,
        from: &EmuMemory,
        from_offset: usize,
        bytes: usize,
    ) -> Result<(), KernelError> {
        let range = |offset: usize, len: usize| {
            offset.checked_add(bytes).filter(|&end| end <= len).map(|end| offset..end).ok_or_else(|| {
                KernelError::InvalidArguments {
                    reason: format!("a copy of {bytes} bytes from {offset} leaves its buffer of {len} bytes"),
                }
            })
        };
        let (src, dst) = (range(from_offset, from.len_bytes)?, range(to_offset, self.len_bytes)?);
        self.bytes_mut()[dst].copy_from_slice(&from.bytes()[src]);
        Ok(())
    }
}

/// Runs `kernel` of `program` on `grid` with a [`GpuRuntime`](crate::gpu::GpuRuntime) launch's
/// arguments, each buffer's memory given by `memory` (`memory_mut` for a buffer the kernel writes);
/// a failure is the backend's driver error.
///
/// # Safety
///
/// As [`GpuRuntime::launch`](crate::gpu::GpuRuntime::launch): the arguments follow the kernel's
/// prototype (which the emulator checks again) and every access the kernel makes lies in its
/// buffer.
pub unsafe fn launch<B>(
    backend: &'static str,
    program: &EmuProgram,
    kernel: &str,
    grid: EmuGrid,
    args: KernelArgs<'_, B>,
    memory: impl Fn(&B) -> &EmuMemory,
    memory_mut: impl Fn(&mut B) -> &mut EmuMemory,
) -> Result<(), KernelError> {
    let values = args.resolve(|arg| {
        Ok(match arg {
            BufferArg::Read { buffer, offset, element_size } => {
                EmuArg::buffer(memory(buffer).element_address(offset, element_size)?, element_size)
            }
            BufferArg::Write { buffer, offset, element_size } => {
                EmuArg::buffer(memory_mut(buffer).element_address_mut(offset, element_size)?, element_size)
            }
            BufferArg::Null => EmuArg::null(),
        })
    })?;
    let args: Vec<EmuArg> = values
        .into_iter()
        .map(|value| match value {
            Resolved::Buffer(arg) => arg,
            Resolved::Scalar(Scalar::I32(v)) => EmuArg::i32(v),
            Resolved::Scalar(Scalar::I64(v)) => EmuArg::i64(v),
            Resolved::Scalar(Scalar::F32(v)) => EmuArg::f32(v),
            Resolved::Scalar(Scalar::F64(v)) => EmuArg::f64(v),
            Resolved::Scalar(Scalar::I64x8(v)) => EmuArg::i64x8(v),
        })
        .collect();
    // SAFETY: the caller's contract; the buffers written are held uniquely for the call, which
    // returns after the last block.
    unsafe { program.launch(kernel, grid, &args) }
        .map_err(|error: EmuError| KernelError::Driver { backend, message: error.to_string() })
}
