//! What the tasks share: running cargo, the workspace root, and probing this machine for the
//! toolkits (hipcc and the HIP headers, a loadable library) and the HIP code-object cache.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::hipcc_cache;

/// Compiles the code objects a `rocm` build embeds into its build script's cache
/// (`crates/kernels-rocm/hipcc_cache.rs`, the same key), on a thread of its own.
pub(crate) fn prewarm_hip_cache() -> std::thread::JoinHandle<anyhow::Result<()>> {
    std::thread::spawn(|| {
        let start = std::time::Instant::now();
        let kernels = project_root().join("crates/kernels-rocm/kernels");
        let hipcc = env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
        let cache = hip_cache_dir();
        let work = env::temp_dir().join(format!("vllm-ir-hipcc-{}", std::process::id()));
        std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
        for arch in hipcc_cache::embed_archs() {
            let output = work.join(format!("kernels-{arch}.hsaco"));
            // A failure is the build script's to report (it skips a target hipcc rejects).
            let outcome = match hipcc_cache::embed(&hipcc, &kernels, &arch, &work, &output, &cache) {
                Ok(compiled) if compiled.cached => "already cached",
                Ok(_) => "compiled",
                Err(_) => "not compiled (the build script reports why)",
            };
            println!(
                "  ({:.0} s: hipcc code objects for {arch}, {outcome}, beside the lint)",
                start.elapsed().as_secs_f64()
            );
        }
        let _ = std::fs::remove_dir_all(&work);
        Ok(())
    })
}

/// The kernels-rocm build script's cache of code objects: `VLLM_IR_KERNEL_CACHE`, else
/// `kernel-cache` in the target directory.
pub(crate) fn hip_cache_dir() -> PathBuf {
    match env::var_os("VLLM_IR_KERNEL_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| project_root().join("target"), PathBuf::from)
            .join("kernel-cache"),
    }
}

pub(crate) fn hip_installed() -> bool {
    let hipcc = Command::new("hipcc").arg("--version").output().is_ok_and(|o| o.status.success());
    hipcc && Path::new("/usr/include/hip/hip_runtime_api.h").exists()
        || env::var("HIP_PATH").is_ok_and(|p| Path::new(&p).join("include/hip/hip_runtime_api.h").exists())
}

pub(crate) fn library_loadable(name: &str) -> bool {
    let ldconfig =
        Command::new("ldconfig").arg("-p").output().map(|o| String::from_utf8_lossy(&o.stdout).contains(name));
    let in_path = env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .any(|dir| !dir.is_empty() && Path::new(dir).join(name).exists());
    ldconfig.unwrap_or(false) || in_path
}

pub(crate) fn cargo(args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<()> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let shown_env: Vec<String> = envs.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    println!("$ {}cargo {}", shown_env.concat(), args.join(" "));
    let start = std::time::Instant::now();
    let status = Command::new(&cargo)
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(project_root())
        .status()
        .with_context(|| format!("running `cargo {}`", args.join(" ")))?;
    println!("  ({:.0} s: cargo {})", start.elapsed().as_secs_f64(), args.join(" "));
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

pub(crate) fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace root").to_path_buf()
}
