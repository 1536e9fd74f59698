//! hipcc compiles, cached by a hash of everything their output depends on: every file under
//! `kernels/` (sources and headers, the shared `kernels/gpu` ones included, by path and content),
//! the names of the sources compiled as one unit, the flags, hipcc's path and its version. The build
//! script (which embeds the code objects) and `tests/hipcc.rs` (which reads the same compile's
//! resource report) share it, so the `check`, `clippy` and `test` builds of one checkout and its
//! compile checks run hipcc once per unit.
//!
//! The cache holds `<key>.hsaco` (the code object) and `<key>.report` (what hipcc wrote on stderr:
//! the resource remarks when the flags ask for them). Entries are written through a temporary name,
//! so a concurrent build never reads half a file; a cache that cannot be written only costs the next
//! build a compile.

// The build script and the test each use part of this module.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One hipcc compile: the sources compiled as one translation unit (each `#include`d, in order),
/// with `flags`, into `output`.
pub(crate) struct Compile<'a> {
    /// The compiler (`hipcc`, or `HIPCC`).
    pub(crate) hipcc: &'a str,
    /// The flags besides `-o` and the input (`--genco`, the target, the optimization level, remarks).
    pub(crate) flags: &'a [String],
    /// The `kernels/` directory: every file under it is part of the key.
    pub(crate) kernels: &'a Path,
    /// The sources, compiled as one unit.
    pub(crate) sources: &'a [PathBuf],
    /// A directory for the unit's source file.
    pub(crate) work_dir: &'a Path,
    /// Where the code object goes.
    pub(crate) output: &'a Path,
    /// The cache directory.
    pub(crate) cache: &'a Path,
}

/// What a compile left: hipcc's report (stderr) and whether it came from the cache.
pub(crate) struct Compiled {
    /// hipcc's stderr: warnings, and the resource remarks when the flags ask for them.
    pub(crate) report: String,
    /// Whether the code object and report were the cache's.
    pub(crate) cached: bool,
}

/// Why a compile produced no code object.
pub(crate) enum CompileFailure {
    /// hipcc could not be started.
    NotRunnable(std::io::Error),
    /// hipcc ran and failed (or wrote no code object); its stderr.
    Rejected(String),
}

impl Compile<'_> {
    /// Copies the cached code object to `output`, or compiles it and stores it.
    pub(crate) fn run(&self) -> Result<Compiled, CompileFailure> {
        let version = Command::new(self.hipcc).arg("--version").output().map(|o| o.stdout).unwrap_or_default();
        let key = self.cache.join(format!("{:016x}", self.key(&version)));
        let (cached_object, cached_report) = (key.with_extension("hsaco"), key.with_extension("report"));
        if let Ok(report) = fs::read_to_string(&cached_report)
            && fs::copy(&cached_object, self.output).is_ok()
        {
            return Ok(Compiled { report, cached: true });
        }
        let stem = self.output.file_stem().and_then(|s| s.to_str()).unwrap_or("unit");
        let unit = self.work_dir.join(format!("{stem}.hip"));
        let includes: String =
            self.sources.iter().map(|path| format!("#include {:?}\n", path.display().to_string())).collect();
        fs::write(&unit, includes).map_err(CompileFailure::NotRunnable)?;
        let done = Command::new(self.hipcc)
            .args(self.flags)
            .arg("-o")
            .arg(self.output)
            .arg(&unit)
            .output()
            .map_err(CompileFailure::NotRunnable)?;
        let report = String::from_utf8_lossy(&done.stderr).into_owned();
        if !done.status.success() || !self.output.is_file() {
            return Err(CompileFailure::Rejected(report));
        }
        store(self.output, &cached_object);
        store_bytes(report.as_bytes(), &cached_report);
        Ok(Compiled { report, cached: false })
    }

    fn key(&self, version: &[u8]) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut files = Vec::new();
        files_under(self.kernels, &mut files);
        files.sort();
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        for file in &files {
            file.strip_prefix(self.kernels).unwrap_or(file).hash(&mut hasher);
            fs::read(file).unwrap_or_default().hash(&mut hasher);
        }
        let names: Vec<_> = self.sources.iter().map(|s| s.file_name()).collect();
        (names, self.flags, self.hipcc, version).hash(&mut hasher);
        hasher.finish()
    }
}

/// Every file under `dir`, through its subdirectories (`gpu/`, the sources CUDA and HIP share, is a
/// link to a directory: followed).
fn files_under(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for path in entries.filter_map(|entry| entry.ok().map(|e| e.path())) {
        if path.is_dir() {
            files_under(&path, files);
        } else {
            files.push(path);
        }
    }
}

/// Copies a fresh file into the cache through a temporary name.
fn store(file: &Path, cached: &Path) {
    if let Ok(bytes) = fs::read(file) {
        store_bytes(&bytes, cached);
    }
}

fn store_bytes(bytes: &[u8], cached: &Path) {
    let Some(dir) = cached.parent() else { return };
    let temporary = cached.with_extension(format!("tmp{}", std::process::id()));
    if fs::create_dir_all(dir).is_ok() && fs::write(&temporary, bytes).is_ok() {
        let _ = fs::rename(&temporary, cached);
    }
}

/// Every `kernels/*.hip` source, sorted: the unit the build script embeds.
pub(crate) fn all_sources(kernels: &Path) -> Vec<PathBuf> {
    let mut sources: Vec<PathBuf> = fs::read_dir(kernels)
        .map(|entries| entries.filter_map(|entry| entry.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    sources.retain(|path| path.extension().is_some_and(|e| e == "hip"));
    sources.sort();
    sources
}

/// The targets a `rocm` build embeds code objects for: `VLLM_IR_HIP_ARCHS` (comma-separated),
/// else `gfx90a`.
pub(crate) fn embed_archs() -> Vec<String> {
    let archs = std::env::var("VLLM_IR_HIP_ARCHS").unwrap_or_else(|_| "gfx90a".to_owned());
    archs.split(',').map(str::trim).filter(|a| !a.is_empty()).map(str::to_owned).collect()
}

/// The compile a `rocm` build embeds for `arch` (every source of `kernels` as one unit, with
/// [`embed_flags`]), from the cache when it holds it.
pub(crate) fn embed(
    hipcc: &str,
    kernels: &Path,
    arch: &str,
    work_dir: &Path,
    output: &Path,
    cache: &Path,
) -> Result<Compiled, CompileFailure> {
    let (sources, flags) = (all_sources(kernels), embed_flags(arch));
    Compile { hipcc, flags: &flags, kernels, sources: &sources, work_dir, output, cache }.run()
}

/// The flags of the build script's compile for `arch`; with the resource remarks, so the compile
/// checks read the report of the very compile the crate embeds.
pub(crate) fn embed_flags(arch: &str) -> Vec<String> {
    vec![
        "--genco".to_owned(),
        format!("--offload-arch={arch}"),
        "-O3".to_owned(),
        "-Rpass-analysis=kernel-resource-usage".to_owned(),
    ]
}
