//! The emulated GPU: the CUDA/HIP kernel source executed on the CPU (feature `emu`, for tests).
//!
//! A program is the kernel source a backend gives its compiler (NVRTC, hipcc), with the CPU
//! portability header (`kernels/cpu/port.h`) in place of the backend's and the fiber runtime
//! (`kernels/cpu/runtime.h`) before it, compiled by the C++ compiler the `cc` crate finds at build
//! time (`CXX` overrides it) into a shared library and loaded. A launch runs the grid's blocks on a
//! pool of OS threads, each block's threads as cooperative fibers that switch at `__syncthreads` and
//! at the warp shuffles; a barrier or a shuffle some threads never reach is an error naming the
//! block and the lanes ([`EmuError::Launch`]), not a hang. Every argument is checked against the
//! kernel's prototype (kind, and a buffer's element size) before the first thread runs.
//!
//! Compiled programs are kept in a directory (`VLLM_IR_EMU_CACHE`, else `vllm-ir-emu` in the
//! temporary directory), named by a hash of the compiler, its flags and the source, so a test run
//! compiles each program once.
//!
//! What it needs: a C++20 compiler with `_Float16` (g++ 12 or clang 15 and later) and glibc's
//! `ucontext`, on x86-64 (fibers switched by a few instructions of assembly) or another Linux
//! target (switched by `swapcontext`). Miri cannot run it (foreign code).

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock, mpsc};

/// The fiber runtime compiled into every emulated program.
pub const RUNTIME: &str = include_str!("../kernels/cpu/runtime.h");
/// The CPU portability header: the CUDA/HIP names the shared kernel source uses.
pub const PORT: &str = include_str!("../kernels/cpu/port.h");

/// The C++ compiler the build found (`cc` crate), empty when it found none.
const BUILD_CXX: &str = env!("VLLM_IR_EMU_CXX");

/// The flags every program is compiled with: contraction off, so each `c_*` operation rounds once;
/// hidden visibility, so no symbol of one program binds to another's (a `__shared__` array is a
/// static local of an inline function, which would otherwise be one process-wide unique symbol:
/// the first program loaded would lend its size to every later program's); the alignment check,
/// whose handler the runtime defines (a misaligned access fails the launch, as it faults on a GPU;
/// no sanitizer runtime is linked).
const FLAGS: [&str; 9] = [
    "-std=c++20",
    "-O1",
    "-fPIC",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fvisibility=hidden",
    "-fsanitize=alignment",
    "-w",
    "-xc++",
];

/// The flags a program's object is linked with into a shared library (without the sanitizer
/// flag, so no sanitizer runtime is linked: the runtime defines the one handler the check calls).
const LINK_FLAGS: [&str; 2] = ["-shared", "-fPIC"];

/// What went wrong in the emulator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmuError {
    /// No C++ compiler: none found at build time and `CXX` unset.
    #[error("the emulated GPU needs a C++20 compiler: none was found when this crate was built and CXX is unset")]
    NoCompiler,
    /// The compiler failed on a program.
    #[error("the C++ compiler `{compiler}` rejected the emulated program {program}:\n{stderr}")]
    Compile {
        /// The compiler run.
        compiler: String,
        /// Where the program's source was written.
        program: PathBuf,
        /// What it said.
        stderr: String,
    },
    /// Reading or writing the program cache, or running the compiler, failed.
    #[error("emulated program cache {path}: {source}")]
    Io {
        /// The file or command.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The compiled library did not load.
    #[error("cannot load the emulated program {path}: {source}")]
    Load {
        /// The library.
        path: PathBuf,
        /// The loader's error.
        source: libloading::Error,
    },
    /// The program holds no kernel of that name.
    #[error("the emulated program has no kernel `{kernel}` (it has: {available})")]
    NoKernel {
        /// The name asked for.
        kernel: String,
        /// The kernels it has.
        available: String,
    },
    /// The launch's arguments do not fit the kernel's prototype.
    #[error("kernel `{kernel}`: {message}")]
    Arguments {
        /// The kernel.
        kernel: String,
        /// What does not fit.
        message: String,
    },
    /// The kernel failed while running (a barrier or a shuffle not every thread reached).
    #[error("kernel `{kernel}`: {message}")]
    Launch {
        /// The kernel.
        kernel: String,
        /// What happened, and where.
        message: String,
    },
}

/// Which compiler's view of the source a program is built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// As NVRTC gets it: one block per row (`GPU_ROWS` an `if`), one dtype per program.
    Cuda,
    /// As hipcc gets it: grid-stride rows, every dtype in one program (`VLLM_IR_EMU_HIP`).
    Hip,
}

/// A kernel argument as the runtime reads it (`EmuArg` in `kernels/cpu/runtime.h`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmuArg {
    kind: c_int,
    element_size: c_int,
    payload: [u64; 8],
}

impl EmuArg {
    fn scalar(kind: c_int, bits: u64) -> Self {
        let mut payload = [0; 8];
        payload[0] = bits;
        EmuArg { kind, element_size: 0, payload }
    }

    /// A buffer from `address` on, of `element_size`-byte elements.
    pub fn buffer(address: *const u8, element_size: usize) -> Self {
        let mut arg = Self::scalar(1, address as usize as u64);
        arg.element_size = c_int::try_from(element_size).unwrap_or(c_int::MAX);
        arg
    }

    /// A null buffer (a parameter the kernel is told never to touch).
    pub fn null() -> Self {
        Self::scalar(1, 0)
    }

    /// `int`.
    pub fn i32(v: i32) -> Self {
        Self::scalar(2, u64::from(v as u32))
    }

    /// `long long`.
    pub fn i64(v: i64) -> Self {
        Self::scalar(3, v as u64)
    }

    /// `float`.
    pub fn f32(v: f32) -> Self {
        Self::scalar(4, u64::from(v.to_bits()))
    }

    /// `double`.
    pub fn f64(v: f64) -> Self {
        Self::scalar(5, v.to_bits())
    }

    /// Eight `long long`s by value (`Dims8`).
    pub fn i64x8(v: [i64; 8]) -> Self {
        EmuArg { kind: 6, element_size: 0, payload: v.map(|x| x as u64) }
    }
}

/// A launch's shape: `blocks` blocks of `threads` threads, in warps of `warp` lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmuGrid {
    /// Blocks in the grid (`gridDim.x`).
    pub blocks: u32,
    /// Threads per block (`blockDim.x`).
    pub threads: u32,
    /// Lanes per warp: 32 (CUDA, HIP wave32) or 64 (HIP wave64).
    pub warp: u32,
}

type CheckFn = unsafe extern "C" fn(*const EmuArg, c_int, *mut c_char, usize) -> c_int;
type CallFn = unsafe extern "C" fn(*const EmuArg);
type RunFn = unsafe extern "C" fn(
    CallFn,
    *const EmuArg,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> c_int;

/// One kernel a thread launched ([`take_launches`]): shared names, so recording one costs no copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmuLaunch {
    /// The kernel.
    pub kernel: Arc<str>,
    /// Its program's defines (`NAME=VALUE`, space-separated; empty for a program without).
    pub defines: Arc<str>,
}

thread_local! {
    /// The kernels this thread launched since it last took them.
    static LAUNCHES: std::cell::RefCell<Vec<EmuLaunch>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The kernels the calling thread launched (found in a program, whatever came of the launch) since
/// it last called this, oldest first: what a test asks to learn which variant the host code chose.
pub fn take_launches() -> Vec<EmuLaunch> {
    LAUNCHES.take()
}

/// The file every launch of the process is appended to when `VLLM_IR_EMU_LAUNCH_LOG` names one
/// (a line `kernel<TAB>defines` each), so a run of the kernel harness can be counted per kernel
/// family and program afterwards; `None` when unset or not writable (said once).
fn launch_log() -> Option<&'static Mutex<std::fs::File>> {
    static LOG: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let path = std::env::var_os("VLLM_IR_EMU_LAUNCH_LOG")?;
        match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
            Ok(file) => Some(Mutex::new(file)),
            Err(error) => {
                tracing::warn!(path = %Path::new(&path).display(), %error, "VLLM_IR_EMU_LAUNCH_LOG not writable");
                None
            }
        }
    })
    .as_ref()
}

/// A compiled, loaded program and its kernels.
pub struct EmuProgram {
    kernels: HashMap<Arc<str>, (CheckFn, CallFn)>,
    run: RunFn,
    path: PathBuf,
    /// The defines it was built with (`NAME=VALUE`, space-separated).
    defines: Arc<str>,
    // Keeps the code the function pointers point into loaded.
    _library: libloading::Library,
}

impl std::fmt::Debug for EmuProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&str> = self.kernels.keys().map(|k| &**k).collect();
        names.sort();
        f.debug_struct("EmuProgram").field("path", &self.path).field("kernels", &names).finish()
    }
}

/// The C++ compiler: `CXX` at run time, else the one the build found.
fn compiler() -> Result<String, EmuError> {
    match std::env::var("CXX") {
        Ok(cxx) if !cxx.trim().is_empty() => Ok(cxx),
        _ if !BUILD_CXX.is_empty() => Ok(BUILD_CXX.to_owned()),
        _ => Err(EmuError::NoCompiler),
    }
}

/// Whether a C++ compiler is at hand (what the tests that run the emulator ask first): asked of
/// each compiler once per process.
pub fn available() -> Result<(), EmuError> {
    /// Why a compiler could not be run, as its error's kind and message (`None`: it ran).
    type Failure = Option<(std::io::ErrorKind, String)>;
    static ASKED: OnceLock<Mutex<HashMap<String, Failure>>> = OnceLock::new();
    let cxx = compiler()?;
    let mut asked = ASKED.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let failure = asked
        .entry(cxx.clone())
        .or_insert_with(|| Command::new(&cxx).arg("--version").output().err().map(|e| (e.kind(), e.to_string())));
    match failure {
        None => Ok(()),
        Some((kind, message)) => {
            Err(EmuError::Io { path: cxx.into(), source: std::io::Error::new(*kind, message.clone()) })
        }
    }
}

/// [`available`] as a provider's availability: what an emulated provider's probe answers.
pub fn availability() -> ir_core::Availability {
    match available() {
        Ok(()) => ir_core::Availability::Available,
        Err(e) => ir_core::Availability::Unavailable(e.to_string()),
    }
}

/// Whether the compiler's alignment check covers a 16-byte chunk loaded as a whole (GCC's does;
/// Clang 15's instruments scalar accesses only, so a misaligned chunk load reaches the CPU, which
/// faults on it and ends the process).
pub fn checks_chunk_alignment() -> bool {
    let Ok(cxx) = compiler() else { return false };
    Command::new(&cxx).arg("--version").output().is_ok_and(|o| {
        let version = String::from_utf8_lossy(&o.stdout);
        o.status.success() && !version.contains("clang")
    })
}

fn cache_dir() -> PathBuf {
    std::env::var_os("VLLM_IR_EMU_CACHE").map_or_else(|| std::env::temp_dir().join("vllm-ir-emu"), PathBuf::from)
}

/// FNV-1a, 64 bits: a stable name for a program's cache entry.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &byte in *part {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        hash ^= 0xff;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The `extern "C"` kernels of preprocessed source: each `extern "C" void <name>(`.
fn kernel_names(preprocessed: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = preprocessed;
    while let Some(at) = rest.find("extern \"C\"") {
        rest = &rest[at + "extern \"C\"".len()..];
        let after = rest.trim_start();
        let Some(after) = after.strip_prefix("void") else { continue };
        let after = after.trim_start();
        let name: String = after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        // `emu_*` are the runtime's, `__*` reserved names (the alignment check's handler).
        let runtime = name.starts_with("emu_") || name.starts_with("__");
        if !name.is_empty() && !runtime && after[name.len()..].trim_start().starts_with('(') {
            names.push(name);
        }
    }
    names.sort();
    names.dedup();
    names
}

/// Extra compiler flags (`VLLM_IR_EMU_CXXFLAGS`, split at whitespace): `-fsanitize=address` with
/// the sanitizer's runtime preloaded finds a kernel's out-of-bounds access, `-O0 -g` lets a
/// debugger step through one.
fn extra_flags() -> Vec<String> {
    std::env::var("VLLM_IR_EMU_CXXFLAGS").unwrap_or_default().split_whitespace().map(str::to_owned).collect()
}

fn run_compiler(cxx: &str, flags: &[&str], args: &[&str], program: &Path) -> Result<Vec<u8>, EmuError> {
    let output = Command::new(cxx)
        .args(flags)
        .args(extra_flags())
        .args(args)
        .output()
        .map_err(|source| EmuError::Io { path: PathBuf::from(cxx), source })?;
    if !output.status.success() {
        return Err(EmuError::Compile {
            compiler: cxx.to_owned(),
            program: program.to_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    Ok(output.stdout)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EmuError + '_ {
    move |source| EmuError::Io { path: path.to_owned(), source }
}

impl EmuProgram {
    /// Builds (or takes from the cache) and loads the program `source` as `dialect`'s compiler gets
    /// it, after `#define NAME VALUE` for each of `defines`. `source` is the kernel source after the
    /// backend's portability header (which the CPU one replaces). Programs are shared: building the
    /// same one twice in a process loads it once.
    pub fn build(dialect: Dialect, defines: &[(&str, String)], source: &str) -> Result<Arc<EmuProgram>, EmuError> {
        static LOADED: OnceLock<Mutex<HashMap<u64, Arc<EmuProgram>>>> = OnceLock::new();
        let cxx = compiler()?;
        let mut text = String::new();
        for (name, value) in defines {
            let _ = writeln!(text, "#define {name} {value}");
        }
        if dialect == Dialect::Hip {
            text.push_str("#define VLLM_IR_EMU_HIP 1\n");
        }
        text.push_str(RUNTIME);
        text.push('\n');
        text.push_str(PORT);
        text.push('\n');
        text.push_str(source);
        text.push('\n');
        let flags = format!("{} {} {}", FLAGS.join(" "), LINK_FLAGS.join(" "), extra_flags().join(" "));
        let hash = fnv1a(&[cxx.as_bytes(), flags.as_bytes(), text.as_bytes()]);
        let loaded = LOADED.get_or_init(Default::default);
        // Held while building, so two threads never build one program at once.
        let mut loaded = loaded.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(program) = loaded.get(&hash) {
            return Ok(program.clone());
        }
        let dir = cache_dir();
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let library = dir.join(format!("{hash:016x}.so"));
        let names_path = dir.join(format!("{hash:016x}.kernels"));
        // Another process may build the same program: one builds it while the others wait.
        let lock_path = dir.join(format!("{hash:016x}.lock"));
        let lock = std::fs::File::create(&lock_path).map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        if !library.exists() || !names_path.exists() {
            let unique = format!("{hash:016x}.{}", std::process::id());
            // Kept: the library's debug information and a sanitizer's reports point into it.
            let source_path = dir.join(format!("{hash:016x}.cpp"));
            std::fs::write(&source_path, &text).map_err(io(&source_path))?;
            let source_arg = source_path.to_string_lossy().into_owned();
            let preprocessed = run_compiler(&cxx, &FLAGS, &["-E", "-P", &source_arg], &source_path)?;
            let names = kernel_names(&String::from_utf8_lossy(&preprocessed));
            for name in &names {
                let _ = writeln!(text, "EMU_KERNEL({name})");
            }
            std::fs::write(&source_path, &text).map_err(io(&source_path))?;
            let object = dir.join(format!("{unique}.o"));
            let object_arg = object.to_string_lossy().into_owned();
            run_compiler(&cxx, &FLAGS, &["-c", "-o", &object_arg, &source_arg], &source_path)?;
            let scratch = dir.join(format!("{unique}.so"));
            let scratch_arg = scratch.to_string_lossy().into_owned();
            let linked = run_compiler(&cxx, &LINK_FLAGS, &["-o", &scratch_arg, &object_arg], &source_path);
            let _ = std::fs::remove_file(&object);
            linked?;
            let scratch_names = dir.join(format!("{unique}.kernels"));
            std::fs::write(&scratch_names, names.join("\n")).map_err(io(&scratch_names))?;
            // Renamed into place, so a run that skips the lock never loads half a file.
            std::fs::rename(&scratch, &library).map_err(io(&library))?;
            std::fs::rename(&scratch_names, &names_path).map_err(io(&names_path))?;
        }
        let names = std::fs::read_to_string(&names_path).map_err(io(&names_path))?;
        let mut program = Self::load(&library, names.lines().filter(|l| !l.is_empty()))?;
        program.defines =
            defines.iter().map(|(name, value)| format!("{name}={value}")).collect::<Vec<_>>().join(" ").into();
        let program = Arc::new(program);
        tracing::debug!(path = %library.display(), kernels = program.kernels.len(), "emulated program loaded");
        loaded.insert(hash, program.clone());
        Ok(program)
    }

    fn load<'a>(path: &Path, names: impl Iterator<Item = &'a str>) -> Result<EmuProgram, EmuError> {
        let load = |source| EmuError::Load { path: path.to_owned(), source };
        // SAFETY: the library is a program this module compiled; loading it runs no initializer
        // but the C++ runtime's static ones.
        let library = unsafe { libloading::Library::new(path) }.map_err(load)?;
        // SAFETY: every symbol is looked up with the signature `runtime.h` gives it.
        let run = *unsafe { library.get::<RunFn>(b"emu_run\0") }.map_err(load)?;
        let mut kernels = HashMap::new();
        for name in names {
            let check = CString::new(format!("emu_check_{name}")).unwrap_or_default();
            let call = CString::new(format!("emu_call_{name}")).unwrap_or_default();
            // SAFETY: as above (`EMU_KERNEL` in `runtime.h`).
            let check = *unsafe { library.get::<CheckFn>(check.as_bytes_with_nul()) }.map_err(load)?;
            // SAFETY: as above.
            let call = *unsafe { library.get::<CallFn>(call.as_bytes_with_nul()) }.map_err(load)?;
            kernels.insert(Arc::from(name), (check, call));
        }
        Ok(EmuProgram { kernels, run, path: path.to_owned(), defines: Arc::from(""), _library: library })
    }

    /// The program's kernels, sorted.
    pub fn kernels(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.kernels.keys().map(|k| &**k).collect();
        names.sort_unstable();
        names
    }

    /// Runs `kernel` on `grid` with `args`, the blocks spread over the machine's cores.
    ///
    /// # Safety
    ///
    /// Every buffer argument must be valid for every access the kernel makes through it with these
    /// arguments, and no memory it writes may be read or written by anything else while it runs
    /// (as for a GPU launch).
    pub unsafe fn launch(&self, kernel: &str, grid: EmuGrid, args: &[EmuArg]) -> Result<(), EmuError> {
        let (name, &(check, call)) = self
            .kernels
            .get_key_value(kernel)
            .ok_or_else(|| EmuError::NoKernel { kernel: kernel.to_owned(), available: self.kernels().join(", ") })?;
        LAUNCHES.with_borrow_mut(|log| {
            log.push(EmuLaunch { kernel: Arc::clone(name), defines: Arc::clone(&self.defines) });
        });
        if let Some(file) = launch_log() {
            let mut file = file.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            // A lost line loses a count, not a result.
            let _ = std::io::Write::write_all(&mut *file, format!("{name}\t{}\n", self.defines).as_bytes());
        }
        let n_args = c_int::try_from(args.len()).unwrap_or(c_int::MAX);
        let mut message = [0 as c_char; 512];
        // SAFETY: `check` reads `args.len()` arguments and writes at most `message.len()` bytes.
        if unsafe { check(args.as_ptr(), n_args, message.as_mut_ptr(), message.len()) } != 0 {
            return Err(EmuError::Arguments { kernel: kernel.to_owned(), message: text_of(&message) });
        }
        if grid.blocks == 0 {
            return Ok(());
        }
        let pool = pool();
        if pool.is_empty() {
            let message = "the emulated GPU could not start a worker thread".to_owned();
            return Err(EmuError::Launch { kernel: kernel.to_owned(), message });
        }
        let workers = pool.len().min(grid.blocks as usize);
        let per = grid.blocks.div_ceil(workers as u32);
        let run = self.run;
        let (done, results) = mpsc::channel::<Option<String>>();
        let mut failures = Vec::new();
        for (w, worker) in pool.iter().take(workers).enumerate() {
            let first = w as u32 * per;
            let end = (first + per).min(grid.blocks);
            // The address crosses to the worker as an integer: the arguments outlive the job, as
            // this call returns only once every job it sent has dropped its sender.
            let args_at = args.as_ptr() as usize;
            let done = done.clone();
            let job: Job = Box::new(move || {
                let mut message = [0 as c_char; 512];
                let mut state = WORKER_STATE.get();
                // SAFETY: the caller's contract covers the kernel's accesses; `emu_run` writes at
                // most `message.len()` bytes of message, and `state` is this worker's (null, or
                // what an earlier `emu_run` on this thread allocated).
                let rc = unsafe {
                    run(
                        call,
                        args_at as *const EmuArg,
                        grid.blocks,
                        first,
                        end,
                        grid.threads,
                        grid.warp,
                        &mut state,
                        message.as_mut_ptr(),
                        message.len(),
                    )
                };
                WORKER_STATE.set(state);
                let _ = done.send((rc != 0).then(|| text_of(&message)));
            });
            if worker.send(job).is_err() {
                failures.push(format!("emulator worker {w} is gone"));
            }
        }
        drop(done);
        // Every result, or the channel's end once every job is dropped (a job that panicked
        // included): no job runs past this loop.
        while let Ok(result) = results.recv() {
            failures.extend(result);
        }
        match failures.into_iter().next() {
            Some(message) => Err(EmuError::Launch { kernel: kernel.to_owned(), message }),
            None => Ok(()),
        }
    }
}

thread_local! {
    /// A pool worker's state in the runtime (`EmuWorker` in `runtime.h`: its fibers' stacks and
    /// thread records), shared by every program the worker runs; allocated by the first launch on
    /// the worker and kept while it lives (as long as the process).
    static WORKER_STATE: std::cell::Cell<*mut c_void> = const { std::cell::Cell::new(std::ptr::null_mut()) };
}

/// A range of one launch's blocks, run by a worker of the pool.
type Job = Box<dyn FnOnce() + Send>;

/// The workers that run blocks: one per core, started at the first launch and kept, so each keeps
/// its fibers' stacks and thread records ([`WORKER_STATE`]) from launch to launch and from program
/// to program, instead of mapping them again on a fresh thread. A core the pool could not start a worker for
/// goes unused.
fn pool() -> &'static [mpsc::Sender<Job>] {
    static POOL: OnceLock<Vec<mpsc::Sender<Job>>> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers: Vec<mpsc::Sender<Job>> = (0..cores)
            .filter_map(|i| {
                let (sender, jobs) = mpsc::channel::<Job>();
                let spawned = std::thread::Builder::new().name(format!("emu-gpu-{i}")).spawn(move || {
                    for job in jobs {
                        job();
                    }
                });
                spawned.ok().map(|_| sender)
            })
            .collect();
        if workers.is_empty() {
            tracing::warn!("the emulated GPU could not start a worker thread");
        }
        workers
    })
}

fn text_of(message: &[c_char]) -> String {
    let bytes: Vec<u8> = message.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

mod buffer;
mod memory;
mod row_program;
pub use buffer::{EmuAllocator, EmuBuffer, EmuDevice};
pub use memory::{ALIGN, EmuMemory, launch};
pub use row_program::run_row_program;

#[cfg(test)]
pub(crate) mod tests;
