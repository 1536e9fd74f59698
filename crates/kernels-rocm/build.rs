//! With feature `rocm`, compiles every kernel source `kernels/*.hip` (the norms and each gated op)
//! as one translation unit with `hipcc --genco` for every target in `VLLM_IR_HIP_ARCHS` (default
//! `gfx90a`) and writes `code_objects.rs`, which embeds them. Targets
//! the installed hipcc rejects are reported and skipped. Without the feature, or without hipcc, or on
//! docs.rs, no code object is embedded.
//!
//! Code objects are cached by a hash of the sources, the target, the flags and hipcc's version (in
//! `VLLM_IR_KERNEL_CACHE`, else `kernel-cache` in the target directory; `hipcc_cache.rs`), so the
//! `check`, `clippy` and `test` builds of one checkout, which run this script each for its own
//! feature set, and `tests/hipcc.rs`, which reads the compile's resource remarks, compile the
//! kernels once.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;

mod hipcc_cache;

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    // The sources CUDA and HIP share, behind a link cargo's scan of `kernels` may not follow.
    println!("cargo::rerun-if-changed=kernels/gpu");
    println!("cargo::rerun-if-changed=hipcc_cache.rs");
    println!("cargo::rerun-if-env-changed=VLLM_IR_HIP_ARCHS");
    println!("cargo::rerun-if-env-changed=HIPCC");
    println!("cargo::rerun-if-env-changed=VLLM_IR_KERNEL_CACHE");
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut embedded = String::from(
        "/// Code objects built by hipcc: (target, bytes).\npub(crate) const CODE_OBJECTS: &[(&str, &[u8])] = &[\n",
    );
    let wanted = env::var("CARGO_FEATURE_ROCM").is_ok() && env::var("DOCS_RS").is_err();
    if wanted {
        let kernels =
            PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("kernels");
        let hipcc = env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
        let cache = cache_dir(&out_dir);
        for arch in hipcc_cache::embed_archs() {
            let output = out_dir.join(format!("kernels-{arch}.hsaco"));
            match hipcc_cache::embed(&hipcc, &kernels, &arch, &out_dir, &output, &cache) {
                Ok(_) => writeln!(embedded, "    ({arch:?}, include_bytes!({:?})),", output.display().to_string())
                    .expect("writing to a String"),
                Err(hipcc_cache::CompileFailure::Rejected(log)) => println!(
                    "cargo::warning=hipcc rejected target {arch}; skipped: {}",
                    log.lines().find(|l| l.contains("error")).unwrap_or("see hipcc")
                ),
                Err(hipcc_cache::CompileFailure::NotRunnable(error)) => {
                    println!("cargo::warning=hipcc not runnable ({error}); no code object embedded")
                }
            }
        }
    }
    embedded.push_str("];\n");
    fs::write(out_dir.join("code_objects.rs"), embedded).expect("writing code_objects.rs");
}

/// Where code objects are cached: `VLLM_IR_KERNEL_CACHE`, else `kernel-cache` in the target
/// directory (`OUT_DIR` is `<target>/<profile>/build/<package>/out`).
fn cache_dir(out_dir: &std::path::Path) -> PathBuf {
    match env::var_os("VLLM_IR_KERNEL_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => out_dir.ancestors().nth(4).unwrap_or(out_dir).join("kernel-cache"),
    }
}
