//! With feature `rocm`, compiles every kernel source `kernels/*.hip` (the norms and each gated op)
//! as one translation unit with `hipcc --genco` for every target in `VLLM_IR_HIP_ARCHS` (default
//! `gfx90a`) and writes `code_objects.rs`, which embeds them. Targets
//! the installed hipcc rejects are reported and skipped. Without the feature, or without hipcc, or on
//! docs.rs, no code object is embedded.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=VLLM_IR_HIP_ARCHS");
    println!("cargo::rerun-if-env-changed=HIPCC");
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
        for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let output = out_dir.join(format!("kernels-{arch}.hsaco"));
            let result = Command::new(&hipcc)
                .args(["--genco", &format!("--offload-arch={arch}"), "-O3", "-o"])
                .arg(&output)
                .arg(&unit)
                .output();
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
