//! The emulated CUDA provider (feature `emu`): this crate's host code and NVRTC programs, run on
//! the CPU by [`kernel_support::emu`], for tests on machines without a GPU.
//!
//! [`EmuCuda`] implements [`GpuRuntime`] as [`Cuda`](crate::runtime::Cuda) does (the same family
//! host code, kernel keys, norm programs, block sizes and grid limits), but each program is built
//! for the CPU: the source NVRTC gets ([`Program`]) with the CPU portability header in place of
//! `port.cuh`, the same `-D` defines, warps of 32 lanes. Device memory is host memory aligned to
//! 256 bytes, as `cuMemAlloc`'s is. A fresh kernel output is filled with `0xff` bytes (a NaN in
//! every float dtype) rather than left as whatever memory held, so an element a kernel fails to
//! write shows.
//!
//! The provider is `emu_cuda`, on `cuda:0` tensors made by [`allocator`]; register it in a registry
//! of its own ([`register`]), since its tensors are no real CUDA memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use ir_core::{DType, Device, DeviceKind, ImplSpec, KernelError, Registry, RegistryError};
use kernel_support::emu::{self, Dialect, EmuDevice, EmuError, EmuGrid, EmuProgram};
use kernel_support::gpu::{GpuBackend, GpuRuntime, Grid, KernelArgs, KernelKey, NormKey, NormShape, StridedKey};
use kernel_support::gpu_threads_per_row;

use crate::module::{NormProgram, PORT_HEADER, Program, norm_program};

/// The provider name.
pub const PROVIDER: &str = "emu_cuda";

/// Lanes per warp.
const WARP: u32 = 32;

/// Emulated device memory (`cuda:0`): host memory whose first byte is 256-byte aligned.
pub type EmuBuffer = kernel_support::emu::EmuBuffer<EmuCuda>;

impl EmuDevice for EmuCuda {
    const DEVICE: Device = Device::Cuda(0);

    fn zeroed_allocation() {
        ZEROED.set(ZEROED.get() + 1);
    }
}

thread_local! {
    /// Buffers this thread allocated zeroed through a buffer ([`DeviceBuffer::allocate_like`](ir_core::storage::DeviceBuffer::allocate_like)).
    static ZEROED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many buffers the calling thread has allocated zeroed through another buffer
/// ([`DeviceBuffer::allocate_like`](ir_core::storage::DeviceBuffer::allocate_like), which a real device pays a fill pass for), so a test can
/// show that an operation writing its whole output allocates it unspecified instead.
pub fn zeroed_allocations() -> usize {
    ZEROED.get()
}

/// Allocates zeroed emulated memory (`cuda:0`).
pub type EmuAllocator = kernel_support::emu::EmuAllocator<EmuCuda>;

/// The allocator of the emulated device's tensors.
pub fn allocator() -> EmuAllocator {
    EmuAllocator::new()
}

/// Whether the emulator can build programs here (a C++ compiler).
pub use kernel_support::emu::availability;

fn backend() -> GpuBackend {
    GpuBackend {
        device: DeviceKind::Cuda,
        dtypes: || crate::KERNEL_DTYPES,
        spec: || ImplSpec::new(PROVIDER).with_probe(availability),
        gated: crate::gated::GATED_OPS,
    }
}

/// Registers the `emu_cuda` provider for every built-in op, as [`crate::register`] does `cuda`.
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    kernel_support::gpu::register::<EmuCuda>(registry, backend())
}

/// A kernel of a built program.
#[derive(Clone, Debug)]
pub struct EmuKernel {
    program: Arc<EmuProgram>,
    symbol: String,
}

fn emu_error(error: EmuError) -> KernelError {
    KernelError::Driver { backend: PROVIDER, message: error.to_string() }
}

/// A planted bug: in every program whose source holds `find`, its first occurrence replaced by
/// `replace` (see [`plant`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SourceEdit {
    /// The text to replace.
    pub find: &'static str,
    /// What replaces it.
    pub replace: &'static str,
}

/// The edit programs are built with now, and how many programs it changed.
static EDIT: Mutex<(Option<SourceEdit>, usize)> = Mutex::new((None, 0));

/// While held, every program this provider builds has `edit` applied: for the tests that prove the
/// kernel harness catches a bug planted in the kernel source. The edit applies process-wide (so
/// such tests live in a test binary of their own), and one edit is planted at a time (a second
/// `plant` waits for the first guard to drop).
pub fn plant(edit: SourceEdit) -> PlantedEdit {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let serial = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    *EDIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = (Some(edit), 0);
    PlantedEdit { _serial: serial }
}

/// An edit planted by [`plant`], removed on drop.
#[derive(Debug)]
pub struct PlantedEdit {
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl PlantedEdit {
    /// How many kernel lookups since it was planted found its text in their program (0: no kernel
    /// that ran was built from a program holding it).
    pub fn programs_changed(&self) -> usize {
        EDIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).1
    }
}

impl Drop for PlantedEdit {
    fn drop(&mut self) {
        *EDIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = (None, 0);
    }
}

/// Builds `program` for the CPU (once per process and planted edit), as NVRTC gets it but for the
/// portability header, and takes its kernel `symbol`. A program is known by its file, name and
/// defines, and a generated one (`row_program.cu`) by its whole source.
fn kernel_of(program: Program, symbol: String) -> Result<EmuKernel, KernelError> {
    type Key = (String, String, Vec<String>, Option<SourceEdit>, Option<String>);
    static BUILT: OnceLock<Mutex<HashMap<Key, Arc<EmuProgram>>>> = OnceLock::new();
    let edit = {
        let mut planted = EDIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let edit = planted.0.filter(|e| program.source.contains(e.find));
        planted.1 += usize::from(edit.is_some());
        edit
    };
    let generated = (program.file == crate::program::FILE).then(|| program.source.clone());
    let key = (program.file.clone(), program.name.clone(), program.defines.clone(), edit, generated);
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let emu = match built.get(&key) {
        Some(emu) => Arc::clone(emu),
        None => {
            let edited = edit.map(|e| program.source.replacen(e.find, e.replace, 1));
            let source = edited.as_deref().unwrap_or(&program.source);
            let source = source.strip_prefix(PORT_HEADER).ok_or_else(|| KernelError::InvalidArguments {
                reason: format!("program {} does not start with the portability header", program.name),
            })?;
            let defines: Vec<(&str, String)> = program
                .defines
                .iter()
                .map(|d| {
                    let d = d.strip_prefix("-D").unwrap_or(d);
                    d.split_once('=').map_or((d, "1".to_owned()), |(n, v)| (n, v.to_owned()))
                })
                .collect();
            let emu = EmuProgram::build(Dialect::Cuda, &defines, source).map_err(|error| match error {
                EmuError::Compile { compiler, stderr, .. } => KernelError::Compile {
                    kernel: program.name.clone(),
                    options: std::iter::once(compiler).chain(program.defines.iter().cloned()).collect(),
                    log: stderr,
                },
                other => emu_error(other),
            })?;
            built.insert(key, Arc::clone(&emu));
            emu
        }
    };
    Ok(EmuKernel { program: emu, symbol })
}

/// CUDA emulated on the CPU.
#[derive(Debug)]
pub struct EmuCuda;

impl GpuRuntime for EmuCuda {
    const MEMORY: &'static str = "emulated CUDA";
    const QUANT_GROUP: u32 = crate::quant::QUANT_BLOCK;
    const COPY_GROUP: u32 = crate::copy::COPY_BLOCK;

    type Buffer = EmuBuffer;
    type Queue = ();
    type Kernel = EmuKernel;

    fn gated_group(d: usize, dtype: DType) -> u32 {
        kernel_support::gated_block(d, dtype)
    }

    fn queue(_first: &EmuBuffer) -> Result<(), KernelError> {
        Ok(())
    }

    fn allocate(_like: &EmuBuffer, _queue: &(), len_bytes: usize) -> Result<EmuBuffer, KernelError> {
        Ok(EmuBuffer::filled(len_bytes, 0xff))
    }

    fn kernel(_like: &EmuBuffer, key: KernelKey<'_>) -> Result<EmuKernel, KernelError> {
        let program = match key {
            KernelKey::Gated { op, dtype, .. } => crate::gated::dtype_program(op, dtype)?,
            KernelKey::Rotary { dtype } => crate::rotary::program(dtype)?,
            KernelKey::Quant { dtype, .. } => crate::quant::program(dtype)?,
            KernelKey::RowProgram { program, binding, shape } => crate::program::row_program(program, binding, shape)?,
        };
        kernel_of(program, key.symbol())
    }

    fn norm_kernel(_like: &EmuBuffer, key: &NormKey) -> Result<(EmuKernel, NormShape), KernelError> {
        let threads_per_row = gpu_threads_per_row(key.hidden);
        let program = NormProgram { dtype: key.dtype, weight: key.weight, vectorized: key.vectorized, threads_per_row };
        let group_size = program.block_size();
        let shape = NormShape { group_size, rows_per_group: group_size / threads_per_row };
        let kernel = kernel_of(norm_program(&program)?, program.kernel(key.op).kernel_name())?;
        Ok((kernel, shape))
    }

    fn strided_kernel(_like: &EmuBuffer, key: StridedKey) -> Result<Option<EmuKernel>, KernelError> {
        let Some(symbol) = key.symbol() else { return Ok(None) };
        let program = match key {
            StridedKey::Copy { .. } => crate::copy::copy_program(),
            StridedKey::Convert { .. } | StridedKey::Binary { .. } => crate::copy::convert_program(),
        };
        kernel_of(program, symbol.to_owned()).map(Some)
    }

    unsafe fn copy_bytes(
        _queue: &(),
        from: &EmuBuffer,
        from_offset: usize,
        to: &mut EmuBuffer,
        to_offset: usize,
        bytes: usize,
    ) -> Result<(), KernelError> {
        to.memory_mut().copy_from(to_offset, from.memory(), from_offset, bytes)
    }

    fn buffer_queue(_buffer: &EmuBuffer) {}

    fn same_device(_a: &EmuBuffer, _b: &EmuBuffer) -> bool {
        true
    }

    fn base_alignment(_buffer: &EmuBuffer) -> usize {
        emu::ALIGN
    }

    unsafe fn launch(
        _queue: &(),
        kernel: &EmuKernel,
        grid: Grid,
        args: KernelArgs<'_, EmuBuffer>,
    ) -> Result<(), KernelError> {
        let shape = EmuGrid { blocks: grid.cuda_blocks()?, threads: grid.group_size, warp: WARP };
        // SAFETY: the caller's contract (`GpuRuntime::launch`).
        unsafe {
            emu::launch(
                PROVIDER,
                &kernel.program,
                &kernel.symbol,
                shape,
                args,
                EmuBuffer::memory,
                EmuBuffer::memory_mut,
            )
        }
    }
}
