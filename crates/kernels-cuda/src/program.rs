//! Row programs compiled by NVRTC: the CUDA source `kernel_support::program::gpu_source`
//! generates from a program, after this backend's portability header and the shared headers, the
//! same program the emulated GPU runs (`kernel_support::emu::run_row_program`).
//!
//! A device keeps the functions it loaded per program and
//! [`Signature`]; the PTX is also kept on disk
//! ([`DiskCache::from_env`]: `VLLM_IR_KERNEL_CACHE`, else `~/.cache/vllm-ir/kernels`), keyed by the
//! whole source, the target architecture and the NVRTC version, so a process compiles a program
//! once per machine, not once per run.

use std::time::Instant;

use cudarc::nvrtc::Ptx;
use ir_core::KernelError;
use ir_ops::row_program::{Binding, RowProgram};
use kernel_support::program::{DiskCache, ROW_PROGRAM_HEADERS, RowShape, Signature, gpu_source};

use crate::module::{PORT_HEADER, Program, compile_program, nvrtc_availability};

/// The file name of every generated program.
pub const FILE: &str = "row_program.cu";

/// The NVRTC program of `program` for a call bound as `binding` and launched in `shape` (kernel
/// [`ROW_PROGRAM_KERNEL`](kernel_support::program::ROW_PROGRAM_KERNEL)); its defines name the
/// shape ([`shape_defines`](kernel_support::program::shape_defines)).
pub fn row_program(program: &RowProgram, binding: &Binding, shape: RowShape) -> Result<Program, KernelError> {
    let generated = gpu_source(program, binding, shape)?;
    let defines = kernel_support::program::shape_defines(shape);
    Ok(Program {
        source: format!("{PORT_HEADER}\n{ROW_PROGRAM_HEADERS}{generated}"),
        file: FILE.to_owned(),
        name: format!("row program `{}` ({})", program.name(), Signature::of(binding, shape)),
        defines: defines.into_iter().map(|(name, value)| format!("-D{name}={value}")).collect(),
    })
}

/// Compiles `program` for a call bound as `binding` and launched in `shape` to PTX for `arch`
/// (`compute_90`, …; `None` for NVRTC's default).
pub fn compile_ptx(
    program: &RowProgram,
    binding: &Binding,
    shape: RowShape,
    arch: Option<&'static str>,
) -> Result<Ptx, KernelError> {
    compile_program(&row_program(program, binding, shape)?, arch)
}

/// Where a generated kernel's PTX came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PtxOrigin {
    /// Compiled by NVRTC now (and stored in the cache, where there is one).
    Compiled,
    /// Read from the on-disk cache.
    Cached,
}

/// The NVRTC version, `major.minor` (part of a cache key: another NVRTC compiles anew).
fn nvrtc_version() -> Result<String, KernelError> {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        return Err(KernelError::Driver { backend: "cuda", message: reason });
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loadable (checked above, so cudarc's loader does not panic); `nvrtcVersion`
    // writes two ints through the pointers, which point at live locals.
    let result = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if result != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(KernelError::Driver { backend: "cuda", message: format!("nvrtcVersion failed: {result:?}") });
    }
    Ok(format!("{major}.{minor}"))
}

/// [`compile_ptx`] through `cache`: the PTX stored under the program's whole source, `arch` and
/// the NVRTC version if present, else compiled and stored. A cache that cannot be written is
/// logged and costs nothing but the next compile.
pub fn compile_ptx_cached(
    program: &RowProgram,
    binding: &Binding,
    shape: RowShape,
    arch: Option<&'static str>,
    cache: Option<&DiskCache>,
) -> Result<(Ptx, PtxOrigin), KernelError> {
    let nvrtc = row_program(program, binding, shape)?;
    let key = match cache {
        Some(_) => format!("nvrtc {}\narch {arch:?}\noptions {:?}\n{}", nvrtc_version()?, nvrtc.defines, nvrtc.source),
        None => String::new(),
    };
    if let Some(cache) = cache
        && let Some(bytes) = cache.get(&key)
        && let Ok(text) = String::from_utf8(bytes)
    {
        tracing::debug!(target: "kernels_cuda", program = program.name(), dir = %cache.dir().display(), "PTX from the disk cache");
        return Ok((Ptx::from_src(text), PtxOrigin::Cached));
    }
    let start = Instant::now();
    let ptx = compile_program(&nvrtc, arch)?;
    tracing::info!(
        target: "kernels_cuda",
        program = program.name(),
        signature = %Signature::of(binding, shape),
        ?arch,
        elapsed_ms = start.elapsed().as_secs_f64() * 1e3,
        "generated kernel compiled with NVRTC"
    );
    if let Some(cache) = cache
        && let Err(error) = cache.put(&key, ptx.to_src().as_bytes())
    {
        tracing::warn!(target: "kernels_cuda", dir = %cache.dir().display(), %error, "PTX not stored in the disk cache");
    }
    Ok((ptx, PtxOrigin::Compiled))
}
