//! The emulated HIP provider (feature `emu`): this crate's host code and code object, run on the
//! CPU by [`kernel_support::emu`], for tests on machines without a GPU.
//!
//! [`EmuHip`] implements [`GpuRuntime`] as the HIP runtime does (the same family host code, kernel
//! symbols, norm variants and widths, block sizes, and HIP's grid caps with grid-stride rows), but
//! the code object is built for the CPU: every `kernels/*.hip` source as one translation unit, in
//! the order `hipcc` gets them, with the CPU portability header in place of `port.hip.h` (whose
//! shared part, `kernels/gpu/compute.h`, stays). Reductions run in waves of 64 lanes (CDNA, provider
//! `emu_hip`) or 32 (RDNA, provider `emu_hip_wave32`). Device memory is host memory aligned to 256
//! bytes, as `hipMalloc`'s is; a fresh kernel output is filled with `0xff` bytes (a NaN in every
//! float dtype), so an element a kernel fails to write shows.
//!
//! Register a provider in a registry of its own ([`register`], [`register_wave32`]) with tensors
//! from its allocator ([`allocator`], [`allocator_wave32`]): they are `rocm:0` tensors, but no real
//! HIP memory.

use std::sync::{Arc, OnceLock};

use ir_core::{DType, Device, DeviceKind, ImplSpec, KernelError, Registry, RegistryError};
use kernel_support::emu::{self, Dialect, EmuDevice, EmuError, EmuGrid, EmuProgram};
use kernel_support::gpu::{GpuBackend, GpuRuntime, Grid, KernelArgs, KernelKey, NormKey, NormShape, StridedKey};

use crate::module::norm_launch;

/// The provider emulating a GPU with waves of 64 lanes (CDNA: MI200, MI300).
pub const PROVIDER: &str = "emu_hip";

/// The provider emulating a GPU with waves of 32 lanes (RDNA).
pub const PROVIDER_WAVE32: &str = "emu_hip_wave32";

/// The provider name of waves of `WAVE` lanes.
const fn provider(wave: u32) -> &'static str {
    if wave == 32 { PROVIDER_WAVE32 } else { PROVIDER }
}

/// The kernel sources of the code object, as `build.rs` gives them to hipcc: every `kernels/*.hip`,
/// sorted by name.
pub const SOURCES: [(&str, &str); 7] = [
    ("gelu_and_mul.hip", include_str!("../kernels/gelu_and_mul.hip")),
    ("gelu_and_mul_sparse.hip", include_str!("../kernels/gelu_and_mul_sparse.hip")),
    ("quant.hip", include_str!("../kernels/quant.hip")),
    ("rms_norm.hip", include_str!("../kernels/rms_norm.hip")),
    ("rotary.hip", include_str!("../kernels/rotary.hip")),
    ("silu_and_mul.hip", include_str!("../kernels/silu_and_mul.hip")),
    ("strided_copy.hip", include_str!("../kernels/strided_copy.hip")),
];

/// The headers the sources include, by the name they include them by. `port.hip.h` is the CPU
/// port's business (prepended by the emulator) but for its last line, the shared operations.
const HEADERS: [(&str, &str); 15] = [
    ("element.hip.h", include_str!("../kernels/element.hip.h")),
    ("port.hip.h", "#include \"gpu/compute.h\"\n"),
    ("gpu/compute.h", include_str!("../kernels/gpu/compute.h")),
    ("gpu/elem.h", include_str!("../kernels/gpu/elem.h")),
    ("gpu/fp8.h", include_str!("../kernels/gpu/fp8.h")),
    ("gpu/gated.h", include_str!("../kernels/gpu/gated.h")),
    ("gpu/gelu_and_mul.h", include_str!("../kernels/gpu/gelu_and_mul.h")),
    ("gpu/gelu_and_mul_sparse.h", include_str!("../kernels/gpu/gelu_and_mul_sparse.h")),
    ("gpu/norm_quant.h", include_str!("../kernels/gpu/norm_quant.h")),
    ("gpu/quant.h", include_str!("../kernels/gpu/quant.h")),
    ("gpu/rms_norm.h", include_str!("../kernels/gpu/rms_norm.h")),
    ("gpu/rotary.h", include_str!("../kernels/gpu/rotary.h")),
    ("gpu/silu_and_mul.h", include_str!("../kernels/gpu/silu_and_mul.h")),
    ("gpu/strided_copy.h", include_str!("../kernels/gpu/strided_copy.h")),
    ("gpu/strided_convert.h", include_str!("../kernels/gpu/strided_convert.h")),
];

/// `source` with each `#include "<header>"` replaced by the header (itself expanded), each header
/// once (they are `#pragma once`); a header this crate does not know is an error.
fn expand(source: &str, seen: &mut Vec<&'static str>, out: &mut String) -> Result<(), String> {
    for line in source.lines() {
        let trimmed = line.trim();
        if trimmed == "#pragma once" {
            continue;
        }
        let Some(name) = trimmed.strip_prefix("#include \"").and_then(|rest| rest.strip_suffix('"')) else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let &(name, text) = HEADERS
            .iter()
            .find(|(header, _)| *header == name)
            .ok_or_else(|| format!("the kernel source includes \"{name}\", which the emulated code object lacks"))?;
        if !seen.contains(&name) {
            seen.push(name);
            expand(text, seen, out)?;
        }
    }
    Ok(())
}

/// The code object's source for the emulator: every source as one translation unit, as hipcc
/// compiles it, its includes expanded.
pub fn code_object_source() -> Result<String, String> {
    let (mut seen, mut out) = (Vec::new(), String::new());
    for (name, source) in SOURCES {
        out.push_str(&format!("// {name}\n"));
        expand(source, &mut seen, &mut out)?;
    }
    Ok(out)
}

/// The code object, built for the CPU once per process.
fn code_object() -> Result<Arc<EmuProgram>, KernelError> {
    static BUILT: OnceLock<Result<Arc<EmuProgram>, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let source = code_object_source()?;
        EmuProgram::build(Dialect::Hip, &[], &source).map_err(|error| match error {
            EmuError::Compile { compiler, stderr, .. } => format!("`{compiler}` rejected the code object:\n{stderr}"),
            other => other.to_string(),
        })
    });
    built.clone().map_err(|message| KernelError::Driver { backend: PROVIDER, message })
}

/// Emulated HIP memory (`rocm:0`) of a GPU with waves of `WAVE` lanes: host memory whose first
/// byte is 256-byte aligned.
pub type EmuHipBuffer<const WAVE: u32> = kernel_support::emu::EmuBuffer<EmuHip<WAVE>>;

impl<const WAVE: u32> EmuDevice for EmuHip<WAVE> {
    const DEVICE: Device = Device::Rocm(0);
}

/// Allocates zeroed emulated memory (`rocm:0`) of a GPU with waves of `WAVE` lanes.
pub type EmuHipAllocator<const WAVE: u32> = kernel_support::emu::EmuAllocator<EmuHip<WAVE>>;

/// The allocator of the `emu_hip` tensors (waves of 64).
pub fn allocator() -> EmuHipAllocator<64> {
    EmuHipAllocator::new()
}

/// The allocator of the `emu_hip_wave32` tensors (waves of 32).
pub fn allocator_wave32() -> EmuHipAllocator<32> {
    EmuHipAllocator::new()
}

/// Whether the emulator can build the code object here (a C++ compiler).
pub use kernel_support::emu::availability;

fn backend<const WAVE: u32>() -> GpuBackend {
    GpuBackend {
        device: DeviceKind::Rocm,
        dtypes: || crate::KERNEL_DTYPES,
        spec: || ImplSpec::new(provider(WAVE)).with_probe(availability),
        gated: crate::gated::GATED_OPS,
    }
}

fn register_wave<const WAVE: u32>(registry: &Registry) -> Result<(), RegistryError> {
    kernel_support::gpu::register::<EmuHip<WAVE>>(registry, backend::<WAVE>())
}

/// Registers the `emu_hip` provider (waves of 64) for every built-in op, as [`crate::register`]
/// does `rocm`.
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    register_wave::<64>(registry)
}

/// Registers the `emu_hip_wave32` provider (waves of 32) for every built-in op.
pub fn register_wave32(registry: &Registry) -> Result<(), RegistryError> {
    register_wave::<32>(registry)
}

/// A kernel of the emulated code object.
#[derive(Clone, Debug)]
pub struct EmuHipKernel {
    program: Arc<EmuProgram>,
    symbol: String,
}

fn kernel_of(symbol: String) -> Result<EmuHipKernel, KernelError> {
    Ok(EmuHipKernel { program: code_object()?, symbol })
}

/// The kernel generated from `program` for a call bound as `binding`, built for the CPU once per
/// process (as hipcc gets it but for the portability header) and cached per program and signature.
fn generated_kernel(
    program: &ir_ops::row_program::RowProgram,
    binding: &ir_ops::row_program::Binding,
    shape: kernel_support::program::RowShape,
) -> Result<EmuHipKernel, KernelError> {
    use kernel_support::program::{GeneratedKernels, ROW_PROGRAM_HEADERS, ROW_PROGRAM_KERNEL, gpu_source};
    static BUILT: std::sync::Mutex<Option<GeneratedKernels<Arc<EmuProgram>>>> = std::sync::Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let emu = built.get_or_insert_with(GeneratedKernels::new).get_or_make(program, binding, shape, || {
        let source = gpu_source(program, binding, shape)?;
        let defines = kernel_support::program::shape_defines(shape);
        EmuProgram::build(Dialect::Hip, &defines, &format!("{ROW_PROGRAM_HEADERS}{source}")).map_err(
            |error| match error {
                EmuError::Compile { compiler, stderr, .. } => KernelError::Compile {
                    kernel: format!("row program `{}`", program.name()),
                    options: vec![compiler],
                    log: stderr,
                },
                other => KernelError::Driver { backend: PROVIDER, message: other.to_string() },
            },
        )
    })?;
    Ok(EmuHipKernel { program: emu, symbol: ROW_PROGRAM_KERNEL.to_owned() })
}

/// HIP emulated on the CPU, in waves of `WAVE` lanes.
#[derive(Debug)]
pub struct EmuHip<const WAVE: u32>;

impl<const WAVE: u32> GpuRuntime for EmuHip<WAVE> {
    const MEMORY: &'static str = "emulated HIP";
    const QUANT_GROUP: u32 = crate::quant::QUANT_BLOCK;
    /// `COPY_BLOCK` in `kernels/gpu/strided_copy.h`.
    const COPY_GROUP: u32 = 256;

    type Buffer = EmuHipBuffer<WAVE>;
    type Queue = ();
    type Kernel = EmuHipKernel;

    fn gated_group(d: usize, dtype: DType) -> u32 {
        kernel_support::gated_block(d, dtype)
    }

    fn queue(_first: &Self::Buffer) -> Result<(), KernelError> {
        Ok(())
    }

    fn allocate(_like: &Self::Buffer, _queue: &(), len_bytes: usize) -> Result<Self::Buffer, KernelError> {
        Ok(EmuHipBuffer::filled(len_bytes, 0xff))
    }

    fn kernel(_like: &Self::Buffer, key: KernelKey<'_>) -> Result<EmuHipKernel, KernelError> {
        match key {
            KernelKey::RowProgram { program, binding, shape } => generated_kernel(program, binding, shape),
            _ => kernel_of(key.symbol()),
        }
    }

    fn norm_kernel(_like: &Self::Buffer, key: &NormKey) -> Result<(EmuHipKernel, NormShape), KernelError> {
        let (variant, shape) = norm_launch(key);
        Ok((kernel_of(variant.symbol())?, shape))
    }

    fn strided_kernel(_like: &Self::Buffer, key: StridedKey) -> Result<Option<EmuHipKernel>, KernelError> {
        key.symbol().map(|symbol| kernel_of(symbol.to_owned())).transpose()
    }

    unsafe fn copy_bytes(
        _queue: &(),
        from: &Self::Buffer,
        from_offset: usize,
        to: &mut Self::Buffer,
        to_offset: usize,
        bytes: usize,
    ) -> Result<(), KernelError> {
        to.memory_mut().copy_from(to_offset, from.memory(), from_offset, bytes)
    }

    fn buffer_queue(_buffer: &Self::Buffer) {}

    fn same_device(_a: &Self::Buffer, _b: &Self::Buffer) -> bool {
        true
    }

    fn base_alignment(_buffer: &Self::Buffer) -> usize {
        emu::ALIGN
    }

    unsafe fn launch(
        _queue: &(),
        kernel: &EmuHipKernel,
        grid: Grid,
        args: KernelArgs<'_, Self::Buffer>,
    ) -> Result<(), KernelError> {
        let shape = EmuGrid { blocks: grid.hip_blocks()?, threads: grid.group_size, warp: WAVE };
        // SAFETY: the caller's contract (`GpuRuntime::launch`).
        unsafe {
            emu::launch(
                provider(WAVE),
                &kernel.program,
                &kernel.symbol,
                shape,
                args,
                EmuHipBuffer::memory,
                EmuHipBuffer::memory_mut,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_object_holds_every_hip_source_and_every_variant_the_host_picks() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .expect("the kernel directory")
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|name| name.ends_with(".hip"))
            .collect();
        on_disk.sort();
        let embedded: Vec<&str> = SOURCES.iter().map(|(name, _)| *name).collect();
        assert_eq!(embedded, on_disk, "every kernels/*.hip is part of the emulated code object, sorted");
        let source = code_object_source().unwrap_or_else(|e| panic!("{e}"));
        assert!(!source.lines().any(|l| l.trim_start().starts_with("#include")), "every include expanded");
        match kernel_support::emu::available() {
            Ok(()) => {}
            Err(e) => {
                return ir_core::testing::skip("cxx", &format!("the emulated GPU cannot build programs: {e}"));
            }
        }
        let program = code_object().unwrap_or_else(|e| panic!("{e}"));
        let kernels = program.kernels();
        for variant in crate::all_variants() {
            assert!(kernels.contains(&variant.symbol().as_str()), "{} missing", variant.symbol());
        }
    }
}
