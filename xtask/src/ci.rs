//! `cargo xtask ci [--vendor cpu|cuda|rocm|xpu]`: every step this machine can run, two pairs of
//! them side by side, with the time each took; or one vendor's job of the CI matrix.

use std::env;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

use crate::Vendor;
use crate::tools::{cargo, hip_installed, library_loadable, prewarm_hip_cache, project_root};

/// `cargo xtask ci`: every step this machine can run.
pub(crate) fn run() -> anyhow::Result<()> {
    let mut steps = StepTimes::default();
    // The HIP code objects take one hipcc process minutes on one core; compiled into the build
    // script's cache beside the first cargo steps, the rocm builds and the hipcc sweep then find them.
    let hip = hip_installed().then(prewarm_hip_cache);
    steps.run("lint", || {
        crate::lint::lint_core()?;
        if let Some(hip) = hip {
            hip.join().map_err(|_| anyhow::anyhow!("the hipcc thread panicked"))??;
            crate::lint::lint_rocm()?;
        }
        Ok(())
    })?;
    steps.run("check-features", crate::features::run)?;
    steps.run("semver", crate::semver::run)?;
    // Two pairs of steps run side by side, each filling the cores the other leaves idle (the package
    // verification builds crate after crate, Miri's tests run on one core, a fuzz target runs on
    // one core); neither of a pair shares a target directory with the other.
    let candle = Background::spawn("candle-cuda", &["candle-cuda"])?;
    steps.run("package", crate::package::run)?;
    steps.run("candle-cuda", || candle.finish())?;
    steps.run("test", crate::test::run)?;
    steps.run("examples", crate::examples::run)?;
    // No GPU here: what the first GPU run would do, and what this machine lacks for it.
    steps.run("gpu-check --dry-run", || crate::gpu_check::run(true))?;
    let fuzz = Background::spawn("fuzz", &["fuzz", "--seconds", "20"])?;
    steps.run("miri", crate::miri::run)?;
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
pub(crate) fn vendor_job(vendor: Vendor) -> anyhow::Result<()> {
    match vendor {
        Vendor::Cpu => {
            println!(
                "cpu job: needs the Rust toolchain, a C++20 compiler (the emulated GPU's tests) and nightly with \
                 cargo-fuzz and the miri component for the fuzz and Miri steps"
            );
            crate::lint::lint_core()?;
            crate::features::check_features_core()?;
            crate::semver::run()?;
            crate::package::run()?;
            cargo(&["test", "--workspace", "--locked"], &[("VLLM_IR_REQUIRE", "cxx")])?;
            crate::examples::run()?;
            crate::fuzz::run(20)?;
            crate::miri::run()
        }
        Vendor::Cuda => {
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
            crate::candle_cuda::run()?;
            cargo(&["test", "--package", "vllm-ir-kernels-cuda", "--locked", "--", "--include-ignored"], &require)?;
            cargo(&["test", "--package", "vllm-ir-tests", "--test", "kernels", "--locked"], &require)
        }
        Vendor::Rocm => {
            println!("rocm job: install hipcc and the HIP runtime headers: apt-get install hipcc libamdhip64-dev");
            if !hip_installed() {
                bail!("the rocm job needs hipcc and libamdhip64-dev (see above)");
            }
            let require = [("VLLM_IR_REQUIRE", "hip")];
            crate::lint::lint_rocm()?;
            crate::features::check_features_rocm()?;
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
        Vendor::Xpu => {
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
    }
}
