//! With feature `rocm`, compiles every kernel source `kernels/*.hip` (the norms and each gated op)
//! as one translation unit with `hipcc --genco` for every target in `VLLM_IR_HIP_ARCHS` (default
//! `gfx90a`) and writes `code_objects.rs`, which embeds them. Targets
//! the installed hipcc rejects are reported and skipped. Without the feature, or without hipcc, or on
//! docs.rs, no code object is embedded.
//!
//! Code objects are cached by a hash of the sources, the target, the flags and hipcc's version (in
//! `VLLM_IR_KERNEL_CACHE`, else `kernel-cache` in the target directory), so the `check`, `clippy`
//! and `test` builds of one checkout, which run this script each for its own feature set, compile
//! the kernels once.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=VLLM_IR_HIP_ARCHS");
    println!("cargo::rerun-if-env-changed=HIPCC");
    println!("cargo::rerun-if-env-changed=VLLM_IR_KERNEL_CACHE");
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut embedded = String::from(
        "/// Code objects built by hipcc: (target, bytes).\npub(crate) const CODE_OBJECTS: &[(&str, &[u8])] = &[\n",
    );
    let wanted = env::var("CARGO_FEATURE_ROCM").is_ok() && env::var("DOCS_RS").is_err();
    if wanted {
        let unit = out_dir.join("all_kernels.hip");
        fs::write(&unit, translation_unit()).expect("writing all_kernels.hip");
        let hipcc = env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
        let archs = env::var("VLLM_IR_HIP_ARCHS").unwrap_or_else(|_| "gfx90a".to_owned());
        let version = Command::new(&hipcc).arg("--version").output().map(|o| o.stdout).unwrap_or_default();
        for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let output = out_dir.join(format!("kernels-{arch}.hsaco"));
            let flags = ["--genco".to_owned(), format!("--offload-arch={arch}"), "-O3".to_owned()];
            let cached = cache_dir(&out_dir).join(format!("{:016x}.hsaco", cache_key(&flags, &hipcc, &version)));
            if fs::copy(&cached, &output).is_ok() {
                writeln!(embedded, "    ({arch:?}, include_bytes!({:?})),", output.display().to_string())
                    .expect("writing to a String");
                continue;
            }
            let result = Command::new(&hipcc).args(&flags).arg("-o").arg(&output).arg(&unit).output();
            if result.as_ref().is_ok_and(|done| done.status.success() && output.is_file()) {
                store(&output, &cached);
            }
            match result {
                Ok(done) if done.status.success() && output.is_file() => {
                    writeln!(embedded, "    ({arch:?}, include_bytes!({:?})),", output.display().to_string())
                        .expect("writing to a String");
                }
                Ok(done) => println!(
                    "cargo::warning=hipcc rejected target {arch}; skipped: {}",
                    String::from_utf8_lossy(&done.stderr).lines().find(|l| l.contains("error")).unwrap_or("see hipcc")
                ),
                Err(error) => println!("cargo::warning=hipcc not runnable ({error}); no code object embedded"),
            }
        }
    }
    embedded.push_str("];\n");
    fs::write(out_dir.join("code_objects.rs"), embedded).expect("writing code_objects.rs");
}

/// One translation unit including every `kernels/*.hip` source (sorted): each defines `extern "C"`
/// kernels with distinct names, so one code object holds them all.
fn translation_unit() -> String {
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("kernels");
    let mut sources: Vec<PathBuf> = fs::read_dir(&dir)
        .expect("the kernels directory exists")
        .map(|entry| entry.expect("a readable directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "hip"))
        .collect();
    sources.sort();
    sources.iter().map(|path| format!("#include {:?}\n", path.display().to_string())).collect()
}

/// Where code objects are cached: `VLLM_IR_KERNEL_CACHE`, else `kernel-cache` in the target
/// directory (`OUT_DIR` is `<target>/<profile>/build/<package>/out`).
fn cache_dir(out_dir: &std::path::Path) -> PathBuf {
    match env::var_os("VLLM_IR_KERNEL_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => out_dir.ancestors().nth(4).unwrap_or(out_dir).join("kernel-cache"),
    }
}

/// A hash of everything a code object depends on: every file of `kernels/` (sources and headers,
/// by name), the flags, the compiler's path and its version.
fn cache_key(flags: &[String], hipcc: &str, version: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("kernels");
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .expect("the kernels directory exists")
        .map(|entry| entry.expect("a readable directory entry").path())
        .collect();
    files.sort();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for file in &files {
        file.file_name().hash(&mut hasher);
        fs::read(file).unwrap_or_default().hash(&mut hasher);
    }
    (flags, hipcc, version).hash(&mut hasher);
    hasher.finish()
}

/// Stores a fresh code object in the cache (through a temporary name, so a concurrent build never
/// reads half a file); a cache that cannot be written only costs the next build a compile.
fn store(output: &std::path::Path, cached: &std::path::Path) {
    let Some(dir) = cached.parent() else { return };
    let temporary = cached.with_extension(format!("tmp{}", std::process::id()));
    if fs::create_dir_all(dir).is_ok() && fs::copy(output, &temporary).is_ok() {
        let _ = fs::rename(&temporary, cached);
    }
}
