//! Row programs compiled by hipcc at run time: the HIP source `kernel_support::program::gpu_source`
//! generates from a program, after this backend's portability header (`port.hip.h`) and the shared
//! headers, compiled to a code object for the device's target (`hipcc --genco`), the same source
//! the emulated HIP runs. The code object is kept on disk
//! ([`DiskCache::from_env`]: `VLLM_IR_KERNEL_CACHE`, else `~/.cache/vllm-ir/kernels`), keyed by the
//! whole source, the target, the flags and hipcc's version.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use ir_core::KernelError;
use ir_ops::row_program::{Binding, RowProgram};
use kernel_support::program::{DiskCache, ROW_PROGRAM_HEADERS, RowShape, Signature, gpu_source};

/// `port.hip.h` without its last include (the shared operations, which the generated program's
/// headers hold).
const PORT: &str = include_str!("../kernels/port.hip.h");

/// The flags every generated program is compiled with, after `--offload-arch=<target>`.
pub const FLAGS: [&str; 3] = ["--genco", "-O3", "-xhip"];

/// The HIP source of `program` for a call bound as `binding` (kernel
/// [`ROW_PROGRAM_KERNEL`](kernel_support::program::ROW_PROGRAM_KERNEL)), whole: it includes
/// nothing but `hip/hip_runtime.h`.
pub fn hip_source(program: &RowProgram, binding: &Binding, shape: RowShape) -> Result<String, KernelError> {
    let generated = gpu_source(program, binding, shape)?;
    let port = PORT.replace("#include \"gpu/compute.h\"", "");
    Ok(format!("{port}\n{ROW_PROGRAM_HEADERS}{generated}"))
}

/// Where a generated code object came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeObjectOrigin {
    /// Compiled by hipcc now (and stored in the cache, where there is one).
    Compiled,
    /// Read from the on-disk cache.
    Cached,
}

/// The compiler: `HIPCC`, else `hipcc`.
pub fn hipcc() -> String {
    std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned())
}

/// Compiles `program` for a call bound as `binding` to a code object for `target` (`gfx90a`, …)
/// with [`hipcc`], through `cache`. An error names the program, the command and hipcc's log; a
/// cache that cannot be written is logged and costs nothing but the next compile.
pub fn compile_code_object(
    program: &RowProgram,
    binding: &Binding,
    shape: RowShape,
    target: &str,
    cache: Option<&DiskCache>,
) -> Result<(Vec<u8>, CodeObjectOrigin), KernelError> {
    let source = hip_source(program, binding, shape)?;
    let hipcc = hipcc();
    let kernel = format!("row program `{}` ({})", program.name(), Signature::of(binding, shape));
    let mut options: Vec<String> = vec![format!("--offload-arch={target}")];
    options.extend(FLAGS.iter().map(|f| (*f).to_owned()));
    let driver = |message: String| KernelError::Driver { backend: "rocm", message };
    let version = Command::new(&hipcc)
        .arg("--version")
        .output()
        .map_err(|error| driver(format!("`{hipcc}` does not run ({error}): install hipcc or set HIPCC")))?;
    let key = format!("hipcc {}\noptions {options:?}\n{source}", String::from_utf8_lossy(&version.stdout));
    if let Some(cache) = cache
        && let Some(object) = cache.get(&key)
    {
        tracing::debug!(target: "kernels_rocm", program = program.name(), dir = %cache.dir().display(), "code object from the disk cache");
        return Ok((object, CodeObjectOrigin::Cached));
    }
    let start = Instant::now();
    let dir = scratch_dir().map_err(|error| driver(format!("a directory for hipcc's files: {error}")))?;
    let (input, output) = (dir.join("row_program.hip"), dir.join("row_program.hsaco"));
    let compiled = (|| {
        std::fs::write(&input, &source).map_err(|error| driver(format!("writing {}: {error}", input.display())))?;
        let run = Command::new(&hipcc)
            .args(&options)
            .arg("-o")
            .arg(&output)
            .arg(&input)
            .output()
            .map_err(|error| driver(format!("`{hipcc}` does not run ({error}): install hipcc or set HIPCC")))?;
        if !run.status.success() {
            return Err(KernelError::Compile {
                kernel: kernel.clone(),
                options: std::iter::once(hipcc.clone()).chain(options.iter().cloned()).collect(),
                log: String::from_utf8_lossy(&run.stderr).into_owned(),
            });
        }
        std::fs::read(&output).map_err(|error| driver(format!("hipcc wrote no code object: {error}")))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    let object = compiled?;
    tracing::info!(
        target: "kernels_rocm",
        program = program.name(),
        signature = %Signature::of(binding, shape),
        target,
        elapsed_ms = start.elapsed().as_secs_f64() * 1e3,
        "generated kernel compiled with hipcc"
    );
    if let Some(cache) = cache
        && let Err(error) = cache.put(&key, &object)
    {
        tracing::warn!(target: "kernels_rocm", dir = %cache.dir().display(), %error, "code object not stored in the disk cache");
    }
    Ok((object, CodeObjectOrigin::Compiled))
}

/// A fresh directory of this process for one compile.
fn scratch_dir() -> std::io::Result<PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "vllm-ir-hipcc-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
