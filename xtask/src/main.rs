//! `cargo xtask`: the project's automation, in Rust (matklad's xtask pattern).
//!
//! Subcommands:
//! - `ci [--vendor cpu|cuda|rocm|xpu]`: everything below that this machine can run, or one vendor's job of
//!   the CI matrix (its toolchain required); it ends with the time each step took;
//! - `lint`: fmt check, clippy and rustdoc with warnings denied;
//! - `test`: the workspace tests (the README's test command), then the GPU compile sweeps it lists
//!   as ignored;
//! - `examples`: the `vllm-ir` crate's examples, as the test build made them;
//! - `check-features`: each platform's features compile on their own (the CLI with none, `cuda`, `xpu`, `rocm`; the bench with `candle`);
//! - `ci` also checks that each kernel crate's package ships its kernel source;
//! - `kernels`: every CUDA variant compiled by NVRTC, every HIP variant by hipcc, the OpenCL
//!   kernels built and run on the OpenCL device (PoCL in CI);
//! - `fuzz [--seconds N]`: runs the cargo-fuzz targets (parser; parse → verify → pipeline) on nightly;
//! - `miri`: the tests of the code that holds `unsafe` (storage, tensors, interop, the registry's
//!   per-thread state, the cpu rows) under Miri, on nightly;
//! - `bless`: rewrites the expectations of the golden IR tests (`IR_BLESS=1`) and shows the diff;
//! - `build --platform cpu|cuda|rocm|xpu`: the CLI with that platform's features, saying what the
//!   machine lacks;
//! - `bench [--quick] [--no-candle]`: the criterion benchmarks of `vllm-ir-bench` (candle comparison
//!   on unless `--no-candle`), then `docs/benchmarks.md` and its plots;
//! - `gpu-bench [--quick]`: the kernel benchmark on the GPU providers only, printed and written to
//!   `docs/benchmarks-gpu.md` with % of the device's nominal peak bandwidth;
//! - `gpu-check [--dry-run]`: the first run on a GPU machine, as one command (at most 8 minutes on
//!   one H200): the kernel harness and the hardware-fp8 test with the device required, the candle
//!   CUDA example, the GPU benchmark; one report, `target/gpu-check/report.md`. `--dry-run` says
//!   what it would run and what the machine lacks;
//! - `kernel-resources`: registers, shared memory and occupancy of every CUDA kernel (NVRTC +
//!   `ptxas`) and every ROCm kernel (hipcc's remarks), written to `docs/kernel-resources.md`; no GPU.
//!   `--render-only` writes the report from the last run's tables (`target/kernel-resources`).

#![allow(clippy::print_stdout)]

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

const USAGE: &str = "usage: cargo xtask <ci [--vendor cpu|cuda|rocm|xpu] | lint | test | examples | check-features | kernels | package | \
                     candle-cuda | fuzz [--seconds N] | miri | bless | build --platform cpu|cuda|rocm|xpu | bench [--quick] [--no-candle] | \
                     gpu-bench [--quick] | gpu-check [--dry-run] | kernel-resources [--render-only]>";

fn main() {
    if let Err(error) = run(env::args().skip(1).collect()) {
        eprintln!("xtask: {error:#}");
        std::process::exit(1);
    }
}

fn run(args: Vec<String>) -> anyhow::Result<()> {
    let Some(command) = args.first() else { bail!("{USAGE}") };
    match command.as_str() {
        "ci" => match &args[1..] {
            [] => ci(),
            [flag, vendor] if flag == "--vendor" => vendor_job(vendor),
            [flag] if flag.starts_with("--vendor=") => vendor_job(&flag["--vendor=".len()..]),
            _ => bail!("usage: cargo xtask ci [--vendor cpu|cuda|rocm|xpu]"),
        },
        "lint" => lint(),
        "test" => test(),
        "examples" => examples(),
        "check-features" => check_features(),
        "kernels" => kernels(),
        "bless" => bless(),
        "fuzz" => fuzz(&args[1..]),
        "miri" => miri(),
        "package" => package_lists(),
        "candle-cuda" => candle_cuda(),
        "build" => build(&args[1..]),
        "bench" => bench::bench(bench::BenchOptions::parse(&args[1..])?),
        "gpu-bench" => bench::gpu_bench(&args[1..]),
        "kernel-resources" => resources::run(args[1..].iter().any(|a| a == "--render-only")),
        "gpu-check" => gpu_check::run(&args[1..]),
        other => bail!("unknown subcommand `{other}`\n{USAGE}"),
    }
}

fn ci() -> anyhow::Result<()> {
    let mut steps = StepTimes::default();
    // The HIP code objects take one hipcc process minutes on one core; compiled into the build
    // script's cache beside the first cargo steps, the rocm builds and the hipcc sweep then find them.
    let hip = hip_installed().then(prewarm_hip_cache);
    steps.run("lint", || {
        lint_core()?;
        if let Some(hip) = hip {
            hip.join().map_err(|_| anyhow::anyhow!("the hipcc thread panicked"))??;
            lint_rocm()?;
        }
        Ok(())
    })?;
    steps.run("check-features", check_features)?;
    // Two pairs of steps run side by side, each filling the cores the other leaves idle (the package
    // verification builds crate after crate, Miri's tests run on one core, a fuzz target runs on
    // one core); neither of a pair shares a target directory with the other.
    let candle = Background::spawn("candle-cuda", &["candle-cuda"])?;
    steps.run("package", package_lists)?;
    steps.run("candle-cuda", || candle.finish())?;
    steps.run("test", test)?;
    steps.run("examples", examples)?;
    // No GPU here: what the first GPU run would do, and what this machine lacks for it.
    steps.run("gpu-check --dry-run", || gpu_check::run(&["--dry-run".to_owned()]))?;
    let fuzz = Background::spawn("fuzz", &["fuzz", "--seconds", "20"])?;
    steps.run("miri", miri)?;
    steps.run("fuzz", || fuzz.finish())?;
    println!("xtask ci: all steps passed");
    steps.print();
    Ok(())
}

/// A step of `cargo xtask ci` run as its own `cargo xtask` process beside the steps that follow,
/// its output in `target/xtask-<step>.log`, printed when it is waited for.
struct Background {
    step: &'static str,
    log: PathBuf,
    /// Taken by [`Background::finish`]; a step never waited for (an earlier one failed) is killed.
    child: Option<std::process::Child>,
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Background {
    fn spawn(step: &'static str, args: &[&str]) -> anyhow::Result<Self> {
        let dir = project_root().join("target");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = dir.join(format!("xtask-{step}.log"));
        let file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let xtask = env::current_exe().context("finding the xtask binary")?;
        println!("$ cargo xtask {} (beside the next steps; output: {})", args.join(" "), log.display());
        let child = Command::new(xtask)
            .args(args)
            .current_dir(project_root())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting `cargo xtask {}`", args.join(" ")))?;
        Ok(Background { step, log, child: Some(child) })
    }

    /// Waits for the step, prints its output and fails when it failed.
    fn finish(mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else { bail!("step `{}` was already waited for", self.step) };
        let status = child.wait().with_context(|| format!("waiting for {}", self.step))?;
        println!("--- output of `{}`, run beside the steps above ({status}):", self.step);
        print!("{}", std::fs::read_to_string(&self.log).unwrap_or_default());
        println!("--- end of `{}`", self.step);
        if !status.success() {
            bail!("step `{}` failed ({status})", self.step);
        }
        Ok(())
    }
}

/// How long each step of `cargo xtask ci` took, printed at the end so a slow step shows.
#[derive(Default)]
struct StepTimes(Vec<(&'static str, std::time::Duration)>);

impl StepTimes {
    fn run(&mut self, step: &'static str, f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
        let start = std::time::Instant::now();
        let result = f();
        self.0.push((step, start.elapsed()));
        if result.is_err() {
            self.print();
        }
        result
    }

    fn print(&self) {
        let total: std::time::Duration = self.0.iter().map(|(_, d)| *d).sum();
        println!(
            "xtask ci: step times (total {:.0} s; candle-cuda and fuzz run beside package and miri: their time is \
             what was left to wait for)",
            total.as_secs_f64()
        );
        for (step, duration) in &self.0 {
            println!("  {step:<16} {:>6.0} s", duration.as_secs_f64());
        }
    }
}

/// One GPU vendor's CI job (or the CPU's), as the matrix in `.github/workflows/ci.yml` runs them:
/// the toolchain it needs is printed first and required (a missing one fails the job); `cargo xtask
/// ci` without `--vendor` runs everything this machine has, as `.ci/run` does.
fn vendor_job(vendor: &str) -> anyhow::Result<()> {
    match vendor {
        "cpu" => {
            println!(
                "cpu job: needs the Rust toolchain, a C++20 compiler (the emulated GPU's tests) and nightly with \
                 cargo-fuzz and the miri component for the fuzz and Miri steps"
            );
            lint_core()?;
            check_features_core()?;
            package_lists()?;
            cargo(&["test", "--workspace", "--locked"], &[("VLLM_IR_REQUIRE", "cxx")])?;
            examples()?;
            fuzz(&["--seconds".to_owned(), "20".to_owned()])?;
            miri()
        }
        "cuda" => {
            println!(
                "cuda job: install NVRTC and the CUDA headers: pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 \
                 nvidia-cuda-nvcc-cu12, put the nvrtc wheel's lib directory on LD_LIBRARY_PATH and the nvcc wheel's bin (ptxas) on PATH, and \
                 nvcc for candle's CUDA build (.ci/cuda-toolkit installs it and prints its root: set VLLM_IR_CUDA_TOOLKIT to it); on a GPU runner \
                 the driver's libcuda runs the device tests too"
            );
            if !library_loadable("libnvrtc.so.12") {
                bail!("the cuda job needs libnvrtc.so.12 on the loader path (see above)");
            }
            let require = [("VLLM_IR_REQUIRE", "nvrtc,ptxas")];
            cargo(
                &["check", "--package", "vllm-ir-cli", "--no-default-features", "--features", "cuda", "--locked"],
                &[],
            )?;
            cargo(&["check", "--package", "vllm-ir", "--features", "cuda", "--all-targets", "--locked"], &[])?;
            candle_cuda()?;
            cargo(&["test", "--package", "vllm-ir-kernels-cuda", "--locked", "--", "--include-ignored"], &require)?;
            cargo(&["test", "--package", "vllm-ir-tests", "--test", "kernels", "--locked"], &require)
        }
        "rocm" => {
            println!("rocm job: install hipcc and the HIP runtime headers: apt-get install hipcc libamdhip64-dev");
            if !hip_installed() {
                bail!("the rocm job needs hipcc and libamdhip64-dev (see above)");
            }
            let require = [("VLLM_IR_REQUIRE", "hip")];
            lint_rocm()?;
            check_features_rocm()?;
            cargo(
                &[
                    "test",
                    "--package",
                    "vllm-ir-kernels-rocm",
                    "--features",
                    "rocm",
                    "--locked",
                    "--",
                    "--include-ignored",
                ],
                &require,
            )?;
            cargo(&["test", "--package", "vllm-ir-tests", "--test", "kernels", "--locked"], &require)
        }
        "xpu" => {
            println!(
                "xpu job: install an OpenCL ICD loader and a device: apt-get install ocl-icd-libopencl1 \
                 pocl-opencl-icd (CPU OpenCL, with VLLM_IR_XPU_ALLOW_CPU=1) or an Intel GPU driver"
            );
            if !library_loadable("libOpenCL.so.1") {
                bail!("the xpu job needs libOpenCL.so.1 (see above)");
            }
            let require = [("VLLM_IR_REQUIRE", "xpu"), ("VLLM_IR_XPU_ALLOW_CPU", "1")];
            cargo(
                &["check", "--package", "vllm-ir-cli", "--no-default-features", "--features", "xpu", "--locked"],
                &[],
            )?;
            cargo(&["test", "--package", "vllm-ir-kernels-xpu", "--locked"], &require)?;
            cargo(&["test", "--package", "vllm-ir-tests", "--test", "kernels", "--locked"], &require)
        }
        other => bail!("unknown vendor `{other}` (cpu, cuda, rocm, xpu)"),
    }
}

/// The engine-facing examples run as written (each asserts what it shows). `cargo test --workspace`
/// builds every example with the workspace's features, so they run as that build made them: a
/// `cargo run` of one package would compile the crates again with its own feature set.
fn examples() -> anyhow::Result<()> {
    let built = built_examples()?;
    let run = |name: &str, args: &[&str]| -> anyhow::Result<()> {
        let binary = built.get(name).with_context(|| {
            format!(
                "`cargo test --workspace` built no example `{name}` (built: {:?})",
                built.keys().collect::<Vec<_>>()
            )
        })?;
        println!("$ {} {}", binary.display(), args.join(" "));
        let start = std::time::Instant::now();
        let status = Command::new(binary)
            .args(args)
            .current_dir(project_root())
            .status()
            .with_context(|| format!("running example `{name}`"))?;
        println!("  ({:.0} s: example {name})", start.elapsed().as_secs_f64());
        if !status.success() {
            bail!("example `{name}` failed ({status})");
        }
        Ok(())
    };
    run("engine", &[])?;
    run("custom_kernel", &[])?;
    // The ops on candle tensors (the feature pulls candle-core in), and the Llama-architecture model
    // on them beside candle-nn's ops: a tiny random model of each variant, which fails on a
    // defensive copy or a native fallback, or when its compiled graph (candle's matmuls and
    // attention as engine ops) does not give the eager run's logits bit for bit.
    run("candle", &[])?;
    for variant in ["llama", "gemma"] {
        run("llama", &["--variant", variant, "--dtype", "bf16", "--iters", "1"])?;
    }
    Ok(())
}

/// The example binaries of the README's test build, by name: what `cargo test --workspace --no-run`
/// reports (building whatever is not built yet).
fn built_examples() -> anyhow::Result<std::collections::BTreeMap<String, PathBuf>> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let args = ["test", "--workspace", "--locked", "--no-run", "--message-format=json-render-diagnostics"];
    println!("$ cargo {}", args.join(" "));
    let output = Command::new(&cargo)
        .args(args)
        .current_dir(project_root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running `cargo test --no-run`")?;
    if !output.status.success() {
        bail!("`cargo {}` failed ({})", args.join(" "), output.status);
    }
    let mut built = std::collections::BTreeMap::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let is_example = message["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "example"));
        if let (true, Some(executable)) = (is_example, message["executable"].as_str()) {
            let name = message["target"]["name"].as_str().unwrap_or_default().to_owned();
            built.insert(name, PathBuf::from(executable));
        }
    }
    Ok(built)
}

/// Compiles the code objects a `rocm` build embeds into its build script's cache
/// (`crates/kernels-rocm/hipcc_cache.rs`, the same key), on a thread of its own.
fn prewarm_hip_cache() -> std::thread::JoinHandle<anyhow::Result<()>> {
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
fn hip_cache_dir() -> PathBuf {
    match env::var_os("VLLM_IR_KERNEL_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| project_root().join("target"), PathBuf::from)
            .join("kernel-cache"),
    }
}

fn lint() -> anyhow::Result<()> {
    lint_core()?;
    if hip_installed() {
        lint_rocm()?;
    }
    Ok(())
}

fn lint_core() -> anyhow::Result<()> {
    cargo(&["fmt", "--all", "--", "--check"], &[])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"], &[])?;
    // The published crates' documentation builds without a warning (broken or private links).
    cargo(
        &["doc", "--workspace", "--no-deps", "--exclude", "vllm-ir-bench", "--locked"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )
}

fn lint_rocm() -> anyhow::Result<()> {
    let args = [
        "clippy",
        "--package",
        "vllm-ir-kernels-rocm",
        "--all-targets",
        "--features",
        "rocm",
        "--locked",
        "--",
        "-D",
        "warnings",
    ];
    cargo(&args, &[])
}

/// The README's test command (`cargo test --workspace`), then the GPU compile sweeps it leaves out
/// (ignored tests: every CUDA kernel through NVRTC and ptxas, every HIP source through hipcc), in the
/// same build.
fn test() -> anyhow::Result<()> {
    cargo(&["test", "--workspace", "--locked"], &[])?;
    // Over the workspace's build (not one package's own feature set), so nothing is compiled again.
    cargo(&["test", "--workspace", "--locked", "--test", "ptxas", "--test", "hipcc", "--", "--ignored"], &[])
}

fn check_features() -> anyhow::Result<()> {
    check_features_core()?;
    if hip_installed() {
        check_features_rocm()?;
    } else {
        println!("skipped: feature `rocm` (needs hipcc and libamdhip64-dev: apt-get install hipcc libamdhip64-dev)");
    }
    Ok(())
}

fn check_features_core() -> anyhow::Result<()> {
    // What an engine links: the core and the cpu kernels without the `testing` feature (no
    // random-number crates); the generators then report the missing feature.
    cargo(
        &[
            "check",
            "--package",
            "vllm-ir-core",
            "--package",
            "vllm-ir-ops",
            "--package",
            "vllm-ir-kernel-support",
            "--package",
            "vllm-ir-kernels-cpu",
            "--package",
            "vllm-ir-layers",
            "--lib",
            "--locked",
        ],
        &[],
    )?;
    cargo(&["check", "--package", "vllm-ir-cli", "--no-default-features", "--locked"], &[])?;
    cargo(&["check", "--package", "vllm-ir-cli", "--no-default-features", "--features", "cuda", "--locked"], &[])?;
    cargo(&["check", "--package", "vllm-ir-cli", "--no-default-features", "--features", "xpu", "--locked"], &[])?;
    // The benchmarks' candle baseline is compiled only by `cargo xtask bench`: check it here, so a
    // change elsewhere (a new dtype) cannot break it unseen.
    cargo(&["check", "--package", "vllm-ir-bench", "--features", "candle", "--all-targets", "--locked"], &[])
}

fn check_features_rocm() -> anyhow::Result<()> {
    cargo(&["check", "--package", "vllm-ir-cli", "--no-default-features", "--features", "rocm", "--locked"], &[])?;
    // Every feature but the bench crate's `candle` (compiled only by `cargo xtask bench`) and
    // kernels-cuda's cudarc choices, which exclude each other (its dependents build its defaults).
    cargo(
        &[
            "check",
            "--workspace",
            "--all-features",
            "--exclude",
            "vllm-ir-bench",
            "--exclude",
            "vllm-ir-kernels-cuda",
            "--locked",
        ],
        &[],
    )?;
    cargo(&["check", "--package", "vllm-ir-bench", "--features", "rocm", "--all-targets", "--locked"], &[])
}

/// Each published crate ships the license texts, and each kernel crate its kernel sources (reached
/// through symlinks), so every crate can be published on its own; then `cargo publish --workspace
/// --dry-run` packages and builds them all as crates.io would.
fn package_lists() -> anyhow::Result<()> {
    let licenses = ["LICENSE-APACHE", "LICENSE-MIT"];
    let crates: [(&str, &[&str]); 12] = [
        ("vllm-ir-core", &[]),
        ("vllm-ir-ops", &[]),
        ("vllm-ir-kernel-support", &["kernels/cpu/runtime.h", "kernels/cpu/port.h"]),
        ("vllm-ir-graph", &[]),
        ("vllm-ir-passes", &[]),
        ("vllm-ir-kernels-cpu", &[]),
        ("vllm-ir-kernels-cuda", &["kernels/rms_norm.cu", "kernels/port.cuh", "kernels/gpu/rms_norm.h"]),
        ("vllm-ir-kernels-rocm", &["kernels/rms_norm.hip", "kernels/port.hip.h", "kernels/gpu/rms_norm.h"]),
        ("vllm-ir-kernels-xpu", &["kernels/rms_norm.cl", "kernels/gated.cl"]),
        ("vllm-ir-layers", &[]),
        ("vllm-ir-cli", &[]),
        ("vllm-ir", &[]),
    ];
    for (krate, sources) in crates {
        let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        println!("$ cargo package --list --allow-dirty --package {krate}");
        let output = Command::new(&cargo)
            .args(["package", "--list", "--allow-dirty", "--package", krate])
            .current_dir(project_root())
            .output()
            .with_context(|| format!("listing the package of {krate}"))?;
        let listing = String::from_utf8_lossy(&output.stdout);
        for file in licenses.iter().chain(sources.iter()) {
            if !output.status.success() || !listing.lines().any(|line| line == *file) {
                bail!(
                    "`cargo package --list` of {krate} does not ship {file}:\n{listing}{}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
    }
    let target_dir = forget_packaged_workspace_crates()?;
    let target_dir = target_dir.to_string_lossy();
    cargo(&["publish", "--workspace", "--dry-run", "--allow-dirty", "--locked", "--target-dir", &target_dir], &[])
}

/// Removes what an earlier `cargo publish --dry-run` left behind, and returns the target directory
/// the dry run builds in. Cargo treats registry crates as immutable: it unpacks the packaged crates
/// of its local registry under `$CARGO_HOME/registry/src/-<hash>/` once per name and version, and
/// reuses their builds by version. So a later dry run of changed sources would verify the dependents
/// against the first run's copies (and fail, or pass wrongly). Only this workspace's `vllm-ir*`
/// unpacked crates go, and the dry run builds in its own target directory whose `vllm-ir*`
/// fingerprints go (third-party builds stay cached).
fn forget_packaged_workspace_crates() -> anyhow::Result<PathBuf> {
    let target_dir = project_root().join("target").join("publish-dry-run");
    let fingerprints = target_dir.join("debug").join(".fingerprint");
    remove_entries_starting_with(&fingerprints, "vllm-ir")?;
    let cargo_home = match env::var_os("CARGO_HOME") {
        Some(home) => PathBuf::from(home),
        None => match env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".cargo"),
            None => return Ok(target_dir),
        },
    };
    let Ok(registries) = std::fs::read_dir(cargo_home.join("registry").join("src")) else { return Ok(target_dir) };
    for registry in registries.flatten() {
        // Local registries have no host name: their folder is `-<hash>`.
        if registry.file_name().to_string_lossy().starts_with('-') {
            remove_entries_starting_with(&registry.path(), "vllm-ir")?;
        }
    }
    Ok(target_dir)
}

/// Removes the entries of `dir` (if it exists) whose names start with `prefix`.
fn remove_entries_starting_with(dir: &Path, prefix: &str) -> anyhow::Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            let path = entry.path();
            let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// Clippy (`-D warnings`, every target) of `examples/candle-cuda`, a crate outside the workspace
/// that runs the ops on candle CUDA tensors: candle-core with its `cuda` feature (candle's kernels
/// compiled by nvcc, cudarc configured by candle) beside the `cuda` provider built with its `candle`
/// feature, so the bridge is checked against candle's real `CudaStorage`. Needs nvcc (CUDA 12 or
/// 13): the toolkit root in `VLLM_IR_CUDA_TOOLKIT` (`.ci/run` installs NVIDIA's CUDA 13.0 wheels and
/// sets it) or nvcc on PATH; without it prints `skipped: <reason>`, or fails when
/// `VLLM_IR_REQUIRE` lists `nvcc`. cudarc's `cuda-version-from-build-system` reads
/// `CUDARC_CUDA_VERSION`, set to 12.8, the API this crate's default binds.
fn candle_cuda() -> anyhow::Result<()> {
    // The toolkit named by VLLM_IR_CUDA_TOOLKIT (what `.ci/cuda-toolkit` prints) goes on PATH for
    // this build alone: hipcc turns to the NVIDIA platform when it finds nvcc on PATH.
    let toolkit = env::var("VLLM_IR_CUDA_TOOLKIT").ok().filter(|root| !root.is_empty());
    let path = match &toolkit {
        Some(root) => format!("{root}/bin:{}", env::var("PATH").unwrap_or_default()),
        None => env::var("PATH").unwrap_or_default(),
    };
    let nvcc = Command::new("nvcc").arg("--version").env("PATH", &path).output().is_ok_and(|o| o.status.success());
    if !nvcc {
        let reason = "candle's CUDA build needs nvcc: set VLLM_IR_CUDA_TOOLKIT to the root `.ci/cuda-toolkit` prints \
                      (it installs CUDA 13.0's nvcc from NVIDIA's pip wheels), or put nvcc on PATH";
        let required = env::var("VLLM_IR_REQUIRE").unwrap_or_default();
        if required.split(',').any(|b| b.trim() == "nvcc") {
            bail!("`nvcc` is required (VLLM_IR_REQUIRE={required}): {reason}");
        }
        println!("skipped: ops on candle CUDA tensors: {reason}");
        return Ok(());
    }
    let root = project_root();
    let manifest = root.join("examples").join("candle-cuda").join("Cargo.toml");
    let target = root.join("target").join("candle-cuda");
    let (manifest, target) = (manifest.to_string_lossy(), target.to_string_lossy());
    // candle's build asks nvidia-smi for the compute capability unless told; 8.0 when nothing says.
    let compute_cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".to_owned());
    let mut envs = vec![("CUDARC_CUDA_VERSION", "12080"), ("CUDA_COMPUTE_CAP", compute_cap.as_str())];
    if let Some(root) = &toolkit {
        envs.extend([("PATH", path.as_str()), ("CUDA_ROOT", root.as_str())]);
    }
    cargo(
        &[
            "clippy",
            "--manifest-path",
            &manifest,
            "--target-dir",
            &target,
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ],
        &envs,
    )
}

/// Fuzz targets under `fuzz/`.
const FUZZ_TARGETS: [&str; 2] = ["parse", "pipeline"];

/// Runs each fuzz target for `--seconds N` (default 60) with cargo-fuzz on the nightly toolchain;
/// prints `skipped: <reason>` when either is missing. New corpus entries go to a temporary folder,
/// the committed seeds in `fuzz/corpus/<target>` are only read.
fn fuzz(args: &[String]) -> anyhow::Result<()> {
    let seconds: u64 = match args {
        [] => 60,
        [flag, n] if flag == "--seconds" => n.parse().with_context(|| format!("--seconds {n}"))?,
        _ => bail!("usage: cargo xtask fuzz [--seconds N]"),
    };
    let works = |args: &[&str]| Command::new("rustup").args(args).output().is_ok_and(|o| o.status.success());
    if !works(&["run", "nightly", "cargo", "--version"]) {
        println!("skipped: fuzzing needs a nightly toolchain (rustup toolchain install nightly)");
        return Ok(());
    }
    if !works(&["run", "nightly", "cargo", "fuzz", "--version"]) {
        println!("skipped: cargo-fuzz is not installed (cargo +nightly install cargo-fuzz)");
        return Ok(());
    }
    // One build of every target, then the targets side by side (each libFuzzer process runs on one
    // core); each one's output goes to a log under `fuzz/`, whose tail is printed.
    let cargo_fuzz = |args: &[&str]| {
        let mut command = Command::new("rustup");
        command.args(["run", "nightly", "cargo", "fuzz"]).args(args).current_dir(project_root());
        command
    };
    println!("$ cargo +nightly fuzz build");
    let status = cargo_fuzz(&["build"]).status().context("running cargo fuzz build")?;
    if !status.success() {
        bail!("`cargo fuzz build` failed ({status})");
    }
    let runs: Vec<_> = FUZZ_TARGETS
        .iter()
        .map(|target| {
            let scratch = env::temp_dir().join(format!("vllm-ir-fuzz-{target}-{}", std::process::id()));
            std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
            let seeds = project_root().join("fuzz/corpus").join(target);
            let log = project_root().join("fuzz").join(format!("{target}.log"));
            let file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
            println!("$ cargo +nightly fuzz run {target} -- -max_total_time={seconds} (output: {})", log.display());
            let child = cargo_fuzz(&["run", target])
                .arg(&scratch)
                .arg(&seeds)
                .args(["--", &format!("-max_total_time={seconds}"), "-max_len=4096"])
                .stdout(file.try_clone()?)
                .stderr(file)
                .spawn()
                .context("running cargo fuzz")?;
            Ok((*target, scratch, log, child))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut failed = Vec::new();
    for (target, scratch, log, mut child) in runs {
        let status = child.wait().context("waiting for cargo fuzz")?;
        let _ = std::fs::remove_dir_all(&scratch);
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let shown = if status.success() { 3 } else { 60 };
        println!("fuzz target `{target}` ({status}), the end of {}:", log.display());
        for line in &lines[lines.len().saturating_sub(shown)..] {
            println!("  {line}");
        }
        if !status.success() {
            failed.push(target);
        }
    }
    if !failed.is_empty() {
        bail!("fuzz targets {failed:?} failed; the crashing inputs are under fuzz/artifacts/<target>");
    }
    Ok(())
}

/// The tests that reach the workspace's `unsafe` code, run under Miri (nightly with the `miri`
/// component); prints `skipped: <reason>` when either is missing. What runs and what does not:
/// - `ir-core`: the storage (host buffers, the pool, external memory), tensors over them, the candle
///   and DLPack conversions, and the registry (its per-thread selection cache, a selection that outlives
///   its thread's dispatch state); left out, two tests Miri cannot run as written: one asks for 2^60
///   bytes (Miri aborts where the allocator returns an error) and one fills a 1 MiB pool buffer
///   three times (minutes under Miri; the pool's code is the small buffers' code);
/// - `ir-ops`: the ops on candle tensors (views of candle's storage under its locks);
/// - `kernels-cpu`: the rows' raw-pointer slices (in place and into another row), the element
///   conversions and the gated activations' scratch; its AVX-512 code cannot run under Miri (no
///   AVX-512), and its tests say `skipped:` there;
/// - the GPU crates hold `unsafe` only around driver calls (FFI), which Miri cannot run.
///
/// `-Zmiri-deterministic-floats` turns off Miri's deliberate imprecision in transcendental
/// functions, which the exact-value tests would read as failures; isolation is off for the test
/// harness's file and environment reads.
fn miri() -> anyhow::Result<()> {
    let works = |args: &[&str]| Command::new("rustup").args(args).output().is_ok_and(|o| o.status.success());
    if !works(&["run", "nightly", "cargo", "miri", "--version"]) {
        println!(
            "skipped: Miri needs the nightly toolchain with its `miri` component (rustup component add --toolchain nightly miri rust-src)"
        );
        return Ok(());
    }
    // One invocation, so the dependencies (and `ir-core` with the features the crates need) are
    // compiled once; the filters pick the tests of the four crates' libraries (`ir-ops` holds the
    // candle custom ops, `kernel-support` the GPU family host code, run over a recording runtime) and of the two `ir-core` test files (their names carry `candle`, `dlpack`
    // or `thread_local`).
    let args = [
        "--package",
        "vllm-ir-core",
        "--package",
        "vllm-ir-ops",
        "--package",
        "vllm-ir-kernels-cpu",
        "--package",
        "vllm-ir-kernel-support",
        "--features",
        "vllm-ir-core/dlpack,vllm-ir-core/candle,vllm-ir-core/testing,vllm-ir-ops/candle",
        "--lib",
        "--test",
        "interop",
        "--test",
        "thread_exit",
        "--",
        "storage::",
        "tensor::",
        "interop::",
        "registry::",
        "candle",
        "dlpack",
        "thread_local",
        "rows::",
        "element::",
        "gated::",
        "gpu::",
        "tests::rms_norm_into",
        "--skip",
        "sizes_never_wrap_and_allocations_never_abort",
        "--skip",
        "a_freed_large_buffer_is_reused",
    ];
    let shown = args.join(" ");
    println!("$ MIRIFLAGS=\"{MIRIFLAGS}\" cargo +nightly miri test --locked {shown}");
    let status = Command::new("rustup")
        .args(["run", "nightly", "cargo", "miri", "test", "--locked"])
        .args(args)
        .env("MIRIFLAGS", MIRIFLAGS)
        .current_dir(project_root())
        .status()
        .context("running cargo miri")?;
    if !status.success() {
        bail!("`cargo +nightly miri test {shown}` failed ({status})");
    }
    Ok(())
}

/// Miri's flags for [`miri`].
const MIRIFLAGS: &str = "-Zmiri-disable-isolation -Zmiri-deterministic-floats";

/// Reruns the golden IR tests with `IR_BLESS=1`, then shows what changed.
fn bless() -> anyhow::Result<()> {
    cargo(&["test", "--package", "vllm-ir-tests", "--test", "ir_golden", "--locked"], &[("IR_BLESS", "1")])?;
    let status = Command::new("git")
        .args(["diff", "--stat", "--", "tests/ir"])
        .current_dir(project_root())
        .status()
        .context("running git diff")?;
    if !status.success() {
        bail!("git diff failed ({status})");
    }
    Ok(())
}

/// The kernel tests of every backend this machine has, each required to run (a missing toolkit
/// there is a failure); backends the machine lacks are skipped with the reason and what to install.
fn kernels() -> anyhow::Result<()> {
    if library_loadable("libnvrtc.so.12") {
        cargo(
            &[
                "test",
                "--package",
                "vllm-ir-kernels-cuda",
                "--test",
                "nvrtc",
                "--test",
                "ptxas",
                "--locked",
                "--",
                "--include-ignored",
            ],
            &[("VLLM_IR_REQUIRE", "nvrtc")],
        )?;
    } else {
        println!(
            "skipped: cuda kernels: libnvrtc.so.12 is not on the loader path (pip install nvidia-cuda-nvrtc-cu12 \
             nvidia-cuda-runtime-cu12 and add the wheel's lib directory to LD_LIBRARY_PATH)"
        );
    }
    if hip_installed() {
        cargo(
            &["test", "--package", "vllm-ir-kernels-rocm", "--test", "hipcc", "--locked", "--", "--include-ignored"],
            &[("VLLM_IR_REQUIRE", "hip")],
        )?;
    } else {
        println!("skipped: rocm kernels: hipcc or the HIP headers are missing (apt-get install hipcc libamdhip64-dev)");
    }
    let opencl: &[(&str, &str)] = if library_loadable("libOpenCL.so.1") {
        &[("VLLM_IR_REQUIRE", "xpu"), ("VLLM_IR_XPU_ALLOW_CPU", "1")]
    } else {
        println!("skipped: xpu kernels: no OpenCL ICD loader (apt-get install ocl-icd-libopencl1 pocl-opencl-icd)");
        &[]
    };
    if !opencl.is_empty() {
        cargo(&["test", "--package", "vllm-ir-kernels-xpu", "--locked"], opencl)?;
    }
    // The harness runs every provider available here (cpu always).
    cargo(&["test", "--package", "vllm-ir-tests", "--test", "kernels", "--locked"], opencl)
}

fn build(args: &[String]) -> anyhow::Result<()> {
    let platform = match args {
        [flag, platform] if flag == "--platform" => platform.as_str(),
        [flag] if flag.starts_with("--platform=") => &flag["--platform=".len()..],
        _ => bail!("usage: cargo xtask build --platform cpu|cuda|rocm|xpu"),
    };
    let features = match platform {
        "cpu" => None,
        "cuda" => {
            println!(
                "cuda: kernels are compiled by NVRTC at first use (cudarc loads libcuda and libnvrtc at run time)"
            );
            if !library_loadable("libcuda.so.1") {
                println!(
                    "note: libcuda.so.1 is not on this machine; the binary builds but `cuda` will report itself unavailable"
                );
            }
            if !library_loadable("libnvrtc.so.12") {
                println!(
                    "note: libnvrtc.so.12 is not on the loader path (pip install nvidia-cuda-nvrtc-cu12 and add its lib dir to LD_LIBRARY_PATH)"
                );
            }
            Some("cuda")
        }
        "xpu" => {
            if !library_loadable("libOpenCL.so.1") {
                println!(
                    "note: libOpenCL.so.1 (the OpenCL ICD loader) is missing; `xpu` will report itself unavailable"
                );
            }
            Some("xpu")
        }
        "rocm" => {
            if !hip_installed() {
                bail!(
                    "platform rocm needs hipcc and libamdhip64-dev (apt-get install hipcc libamdhip64-dev); kernels are compiled ahead of time for VLLM_IR_HIP_ARCHS (default gfx90a)"
                );
            }
            Some("rocm")
        }
        other => bail!("unknown platform `{other}` (expected cpu, cuda, rocm or xpu)"),
    };
    let mut args = vec!["build", "--release", "--package", "vllm-ir-cli", "--no-default-features", "--locked"];
    if let Some(feature) = features {
        args.extend(["--features", feature]);
    }
    cargo(&args, &[])
}

fn hip_installed() -> bool {
    let hipcc = Command::new("hipcc").arg("--version").output().is_ok_and(|o| o.status.success());
    hipcc && Path::new("/usr/include/hip/hip_runtime_api.h").exists()
        || env::var("HIP_PATH").is_ok_and(|p| Path::new(&p).join("include/hip/hip_runtime_api.h").exists())
}

fn library_loadable(name: &str) -> bool {
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

mod bench;
#[cfg(test)]
mod docs;
mod gpu_check;
#[path = "../../crates/kernels-rocm/hipcc_cache.rs"]
mod hipcc_cache;
#[cfg(test)]
mod modules;
mod resources;
#[cfg(test)]
mod tidy;
