//! Norm programs and kernel variants, and their NVRTC compilation.
//!
//! A program is one set of defines for the norm source (`kernels/gpu/rms_norm.h`, instantiated by
//! `kernels/cuda/rms_norm.cu`): dtype, weight, vector width and
//! threads per row (which also fixes the block size); its PTX holds the kernels of both norm ops. A
//! variant is one op's kernel in a program. Programs are compiled at first use and their modules
//! cached per device (so per compute capability too), shared by both ops.

use std::fmt;

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use ir_core::{Availability, DType, KernelError};
pub use kernel_support::NormOp;

use kernel_support::gpu_threads_per_row;
pub use kernel_support::largest_cached_row;

/// The CUDA portability header (`kernels/port.cuh`): what NVRTC spells differently from hipcc (the
/// f16 and bf16 conversions, f32 rounded to odd, the correctly rounded operations, the fp8
/// hardware, the dtypes a program instantiates) under the names the kernels CUDA and HIP share
/// (`kernels/gpu`) use, then the operations both dialects spell the same (`kernels/gpu/compute.h`).
/// Every kernel source is compiled after it.
pub const PORT: &str = concat!(include_str!("../kernels/port.cuh"), "\n", include_str!("../kernels/gpu/compute.h"));

/// The element layer of the kernels CUDA and HIP share (`kernels/gpu/elem.h`: `Elem<DT>`,
/// `RowChunk`), after the portability header: the prelude of the gated ops, the quantizations and
/// the rotary embedding.
pub const GPU_ELEMENT: &str = concat!(
    include_str!("../kernels/port.cuh"),
    "\n",
    include_str!("../kernels/gpu/compute.h"),
    "\n",
    include_str!("../kernels/gpu/elem.h")
);

/// The prelude the norms once had of their own; they are on the shared element layer now.
#[deprecated(note = "the norms share the element layer: use `GPU_ELEMENT`")]
pub const ELEMENT: &str = GPU_ELEMENT;

/// The norm kernels' source as NVRTC compiles it: the element layer CUDA and HIP share
/// ([`GPU_ELEMENT`]), the shared row kernel (`kernels/gpu/rms_norm.h`) and its CUDA
/// instantiation for one program's defines (`kernels/cuda/rms_norm.cu`).
pub const SOURCE: &str = concat!(
    include_str!("../kernels/port.cuh"),
    "\n",
    include_str!("../kernels/gpu/compute.h"),
    "\n",
    include_str!("../kernels/gpu/elem.h"),
    "\n",
    include_str!("../kernels/gpu/rms_norm.h"),
    "\n",
    include_str!("../kernels/rms_norm.cu")
);

/// Threads per row the kernels are compiled for.
pub const THREADS_PER_ROW: [u32; 6] = [8, 16, 32, 64, 128, 256];
/// Block sizes: 128 threads, 256 above H = 16384.
pub const BLOCK_SIZES: [u32; 2] = [128, 256];

/// The launch shape of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Threads cooperating on one row.
    pub threads_per_row: u32,
    /// Threads per block.
    pub block_size: u32,
    /// Rows one block handles.
    pub rows_per_block: u32,
    /// Blocks in the grid.
    pub grid: u32,
}

/// Threads per block: 128, or 256 above 128 threads per row.
pub(crate) fn block_size(threads_per_row: u32) -> u32 {
    if threads_per_row > 128 { 256 } else { 128 }
}

/// The geometry for `n_rows` rows of `hidden` elements; nothing but the grid depends on `n_rows`.
pub fn rms_norm_launch(n_rows: usize, hidden: usize) -> Result<Geometry, KernelError> {
    let threads_per_row = gpu_threads_per_row(hidden);
    let block_size = block_size(threads_per_row);
    let rows_per_block = block_size / threads_per_row;
    let grid = n_rows.div_ceil(rows_per_block as usize);
    let grid = u32::try_from(grid)
        .ok()
        .filter(|&g| g <= i32::MAX as u32)
        .ok_or_else(|| KernelError::GridLimit { what: "rows", count: n_rows })?;
    Ok(Geometry { threads_per_row, block_size, rows_per_block, grid })
}

/// One NVRTC program of the norm source: a set of defines (dtype, weight, vector width, threads per
/// row). Its PTX holds both norm kernels, `rms_norm_<dtype>` and `fused_add_rms_norm_<dtype>`, so
/// one compile serves both ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NormProgram {
    /// Element type (f32, f16, bf16 or f64).
    pub dtype: DType,
    /// The weight's dtype when a weight is applied (it may differ from `dtype`; one of the same).
    pub weight: Option<DType>,
    /// Whether 16-byte vector accesses are used (else scalar accesses, same bits).
    pub vectorized: bool,
    /// Threads cooperating on one row.
    pub threads_per_row: u32,
}

impl NormProgram {
    /// The block size this program is compiled for.
    pub fn block_size(&self) -> u32 {
        block_size(self.threads_per_row)
    }

    /// The kernel of `op` in this program.
    pub fn kernel(&self, op: NormOp) -> KernelVariant {
        KernelVariant { op, program: *self }
    }

    /// The 16-byte chunks of a row each thread keeps in registers between the two passes: enough
    /// for the whole row up to the largest hidden size of this program's threads-per-row bucket
    /// ([`largest_cached_row`]); the chunks of longer rows beyond these are read again. f64, a
    /// reference dtype, gets the f32 kernels' chunk count and so the same registers: half its row.
    pub fn cache_chunks(&self) -> u32 {
        kernel_support::norm_cache_chunks(self.dtype, self.threads_per_row)
    }

    /// Chunks the fused op keeps in registers (`norm_fused_cache_chunks` in `kernels/gpu/rms_norm.h`;
    /// [`kernel_support::norm_fused_cache_chunks`]).
    pub fn fused_cache_chunks(&self) -> u32 {
        kernel_support::norm_fused_cache_chunks(self.dtype, self.threads_per_row, self.vectorized)
    }

    /// The NVRTC `-D` options selecting this program.
    pub fn defines(&self) -> Result<Vec<String>, KernelError> {
        let chunk = 16 / self.dtype.size_in_bytes();
        Ok(vec![
            format!("-DCACHE_CHUNKS={}", self.cache_chunks()),
            dtype_define(self.dtype)?,
            format!("-DHAS_WEIGHT={}", u8::from(self.weight.is_some())),
            format!("-DWDTYPE={}", dtype_code(self.weight.unwrap_or(self.dtype))?),
            format!("-DVEC={}", if self.vectorized { chunk } else { 1 }),
            format!("-DTHREADS_PER_ROW={}", self.threads_per_row),
            format!("-DBLOCK_SIZE={}", self.block_size()),
        ])
    }
}

impl fmt::Display for NormProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rms_norm.cu[dtype={}, weight={}, vec={}, threads_per_row={}]",
            self.dtype,
            self.weight.map_or_else(|| "none".to_owned(), |w| w.to_string()),
            self.vectorized,
            self.threads_per_row
        )
    }
}

/// One launchable norm kernel: an op's kernel in one [`NormProgram`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelVariant {
    /// The kernel.
    pub op: NormOp,
    /// The program holding it (the same for both ops).
    pub program: NormProgram,
}

impl KernelVariant {
    /// The kernel's symbol: `<op>_<dtype>`.
    pub fn kernel_name(&self) -> String {
        let op = self.op.name();
        format!("{op}_{}", self.program.dtype)
    }
}

impl fmt::Display for KernelVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} in {}", self.kernel_name(), self.program)
    }
}

/// Every program the provider can launch a norm kernel from: without a weight and with one of each
/// dtype (a weight of another dtype than x at two row widths only: it differs from the same-dtype
/// form only in the weight step's loads and roundings). f64 rows launch with scalar accesses only
/// ([`vectorizes`]), and an f64 weight or f64 x with another weight at one row width.
pub fn all_programs() -> Vec<NormProgram> {
    const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];
    let mut programs = Vec::new();
    for dtype in DTYPES {
        for weight in std::iter::once(None).chain(DTYPES.map(Some)) {
            for vectorized in [false, true] {
                for threads_per_row in THREADS_PER_ROW {
                    let mixed = weight.is_some_and(|w| w != dtype);
                    let with_f64 = dtype == DType::F64 || weight == Some(DType::F64);
                    let widths: &[u32] = if with_f64 { &[32] } else { &[32, 256] };
                    if (mixed && !widths.contains(&threads_per_row)) || (vectorized && !vectorizes(dtype)) {
                        continue;
                    }
                    programs.push(NormProgram { dtype, weight, vectorized, threads_per_row });
                }
            }
        }
    }
    debug_assert!(BLOCK_SIZES.len() == 2);
    programs
}

pub use kernel_support::gpu::norm_vectorizes as vectorizes;

/// Whether NVRTC can be loaded (probing never panics).
pub fn nvrtc_availability() -> Availability {
    #[cfg(feature = "dynamic-loading")]
    // SAFETY: `is_culib_present` only tries to open the library by its candidate names.
    let present = std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false);
    #[cfg(not(feature = "dynamic-loading"))]
    let present = library_present(&["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so", "nvrtc64_120_0.dll"]);
    if present {
        return Availability::Available;
    }
    Availability::Unavailable("libnvrtc.so not found (install the CUDA toolkit or nvidia-cuda-nvrtc-cu12)".to_owned())
}

/// Whether one of `names` opens as a shared library (for when the engine's cudarc choice, not this
/// crate's, decides how cudarc reaches the library).
#[cfg(not(feature = "dynamic-loading"))]
pub(crate) fn library_present(names: &[&str]) -> bool {
    names.iter().any(|name| {
        // SAFETY: opening the CUDA driver or NVRTC runs their initializers, which have no
        // preconditions; the handle is closed again at once.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

/// Compiles one norm program to PTX for `arch` (`compute_80`, `compute_90`, …; `None` for NVRTC's default).
pub fn compile_ptx(program: &NormProgram, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    tracing::debug!(target: "kernels_cuda", %program, ?arch, "compiling with NVRTC");
    compile_program(&norm_program(program)?, arch)
}

/// One NVRTC program: its source (which starts with the portability header, [`PORT_HEADER`]),
/// the file name and the name errors give it, and its `-D` options. What NVRTC compiles and what
/// the emulated runtime (feature `emu`) builds for the CPU are the same programs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    /// The source, from the portability header on.
    pub source: String,
    /// The file name NVRTC is told (`quant.cu`).
    pub file: String,
    /// What a compile error names (a kernel or a program).
    pub name: String,
    /// The `-DNAME=VALUE` options.
    pub defines: Vec<String>,
}

/// The portability header every program starts with (`kernels/port.cuh`).
pub const PORT_HEADER: &str = include_str!("../kernels/port.cuh");

/// The norm source with a norm program's defines.
pub fn norm_program(program: &NormProgram) -> Result<Program, KernelError> {
    Ok(Program {
        source: SOURCE.to_owned(),
        file: "rms_norm.cu".to_owned(),
        name: program.to_string(),
        defines: program.defines()?,
    })
}

/// Compiles a program with NVRTC for `arch`.
pub fn compile_program(program: &Program, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile(&program.source, &program.file, program.name.clone(), program.defines.clone(), arch)
}

/// Compiles `source` with NVRTC; errors keep the kernel's name, the options and the log.
pub(crate) fn compile(
    source: &str,
    file_name: &str,
    kernel: String,
    defines: Vec<String>,
    arch: Option<&'static str>,
) -> Result<Ptx, KernelError> {
    if let Availability::Unavailable(reason) = nvrtc_availability() {
        return Err(KernelError::Driver { backend: "cuda", message: reason });
    }
    let options = CompileOptions { options: defines, arch, name: Some(file_name.to_owned()), ..Default::default() };
    let shown_options = options.options.clone();
    compile_ptx_with_opts(source, options).map_err(|error| match error {
        CompileError::CompileError { options, log, .. } => {
            KernelError::Compile { kernel, options, log: log.to_string_lossy().into_owned() }
        }
        other => KernelError::Compile { kernel, options: shown_options, log: format!("{other:?}") },
    })
}

/// The `-DDTYPE=` option of a dtype the kernels support.
pub(crate) fn dtype_define(dtype: DType) -> Result<String, KernelError> {
    Ok(format!("-DDTYPE={}", dtype_code(dtype)?))
}

/// The code the element prelude knows a dtype by (`DTYPE`, `WDTYPE`).
fn dtype_code(dtype: DType) -> Result<u8, KernelError> {
    kernel_support::compute_dtype_code(dtype, "cuda")
}

/// The NVRTC architecture for a compute capability.
pub fn arch_for(major: i32, minor: i32) -> Option<&'static str> {
    Some(match (major, minor) {
        (7, 0) => "compute_70",
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_programs_cover_every_dtype_weight_and_width() {
        let programs = all_programs();
        // dtypes x (no weight, or one of x's dtype) x vector paths x row widths, and the weights of
        // the two other dtypes at two row widths; f64 (scalar accesses only): no weight or an f64
        // one at every width, and at one width x f64 with each other weight and each other x with an
        // f64 weight (both vector paths). Each program holds both ops' kernels.
        let reduced = 3 * 2 * 2 * 6 + 3 * 2 * 2 * 2;
        assert_eq!(programs.len(), reduced + 2 * 6 + 3 + 3 * 2);
        let unique: std::collections::HashSet<_> = programs.iter().map(|p| p.defines().unwrap()).collect();
        assert_eq!(unique.len(), programs.len(), "no two programs compile the same defines");
        assert!(programs.iter().filter(|p| p.dtype == DType::F64).all(|p| !p.vectorized));
        assert!(programs.iter().any(|p| p.weight == Some(DType::F32) && p.dtype == DType::BF16));
        assert!(programs.iter().any(|p| p.weight == Some(DType::F64) && p.dtype == DType::BF16 && p.vectorized));
    }

    /// Every hidden size a program launches with, up to its bucket's largest (32768 for the last),
    /// fits in its threads' register cache; the bounded buckets' largest row launches with it.
    #[test]
    fn each_program_caches_every_row_of_its_bucket() {
        for program in all_programs() {
            let chunk = 16 / program.dtype.size_in_bytes() as u32;
            let cached = program.cache_chunks() * chunk * program.threads_per_row;
            let bucket = largest_cached_row(program.threads_per_row);
            // f64 keeps the f32 kernels' registers: half the row.
            let largest = if program.dtype == DType::F64 { bucket / 2 } else { bucket };
            assert!(cached >= largest, "{program}: {cached} elements cached, rows up to {largest}");
            assert!(
                cached < largest + chunk * program.threads_per_row,
                "{program}: one chunk a thread at most to spare"
            );
            if program.threads_per_row < 256 {
                let launched = rms_norm_launch(1, bucket as usize).unwrap().threads_per_row;
                assert_eq!(launched, program.threads_per_row, "H {bucket} launches with this program's width");
                let next = rms_norm_launch(1, bucket as usize + 1).unwrap().threads_per_row;
                assert!(next > program.threads_per_row, "H {} takes a wider bucket", bucket + 1);
            }
        }
    }

    #[test]
    fn geometry_depends_on_hidden_only() {
        let cases = [
            (8, 8, 128, 16),
            (64, 8, 128, 16),
            (65, 16, 128, 8),
            (1024, 32, 128, 4),
            (3072, 32, 128, 4),
            (4096, 64, 128, 2),
            (8192, 128, 128, 1),
            (16384, 128, 128, 1),
            (16385, 256, 256, 1),
        ];
        for (hidden, threads_per_row, block_size, rows_per_block) in cases {
            for n_rows in [1, 7, 2048, 262145] {
                let g = rms_norm_launch(n_rows, hidden).unwrap();
                assert_eq!(
                    (g.threads_per_row, g.block_size, g.rows_per_block),
                    (threads_per_row, block_size, rows_per_block),
                    "H {hidden}"
                );
                assert_eq!(g.grid as usize, n_rows.div_ceil(rows_per_block as usize));
            }
        }
        assert!(rms_norm_launch(1024, 1024).unwrap().rows_per_block > 1, "several rows per block when H <= 1024");
    }
}
