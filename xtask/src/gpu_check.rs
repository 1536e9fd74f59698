//! `cargo xtask gpu-check [--dry-run]`: the first run on a machine with an NVIDIA GPU, as one
//! command. Each step runs with the device required (a test that would skip for want of it fails
//! instead) under a time limit, its output goes to `target/gpu-check/<step>.log`, and one report,
//! `target/gpu-check/report.md`, says what passed, how long each step took and the benchmark's
//! figures. `--dry-run` runs nothing: it prints the steps, their limits and what this machine lacks
//! for them.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::project_root;

/// One step of the check.
struct Step {
    /// A short name (also its log file's).
    name: &'static str,
    /// What it shows.
    what: &'static str,
    /// The cargo arguments.
    args: Vec<String>,
    /// Environment variables on top of the caller's.
    envs: Vec<(&'static str, String)>,
    /// The most it may take on one H200 (the steps add up to the 8-minute budget).
    limit: Duration,
}

/// The device requirements every step runs with: a missing driver, NVRTC or GPU fails the step.
const REQUIRE: &str = "cuda,nvrtc";

fn steps() -> Vec<Step> {
    let strings = |args: &[&str]| args.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>();
    let candle = project_root().join("examples").join("candle-cuda").join("Cargo.toml");
    let candle_target = project_root().join("target").join("candle-cuda");
    let candle_args = |verb: &str| {
        vec![
            verb.to_owned(),
            "--manifest-path".to_owned(),
            candle.display().to_string(),
            "--target-dir".to_owned(),
            candle_target.display().to_string(),
            "--release".to_owned(),
            "--locked".to_owned(),
        ]
    };
    let candle_env = || vec![("VLLM_IR_REQUIRE", REQUIRE.to_owned()), ("CUDARC_CUDA_VERSION", "12080".to_owned())];
    vec![
        Step {
            name: "build-tests",
            what: "the test and benchmark binaries, release (nothing runs)",
            args: strings(&[
                "test",
                "--package",
                "vllm-ir-tests",
                "--package",
                "vllm-ir-kernels-cuda",
                "--package",
                "vllm-ir-bench",
                "--release",
                "--no-run",
                "--locked",
            ]),
            envs: vec![],
            limit: Duration::from_secs(150),
        },
        Step {
            name: "build-candle",
            what: "the candle CUDA example (candle's kernels by nvcc), release",
            args: candle_args("build"),
            envs: candle_env(),
            limit: Duration::from_secs(120),
        },
        Step {
            name: "kernels",
            what: "the kernel harness (every op, dtype, layout and variant against native) with the cuda provider required",
            args: strings(&["test", "--package", "vllm-ir-tests", "--test", "kernels", "--release", "--locked"]),
            envs: vec![("VLLM_IR_REQUIRE", REQUIRE.to_owned())],
            limit: Duration::from_secs(80),
        },
        Step {
            name: "fp8-hardware",
            what: "the hardware fp8 conversion (sm_89 and later) against the software bits on every f32 pattern",
            args: strings(&[
                "test",
                "--package",
                "vllm-ir-kernels-cuda",
                "--test",
                "fp8_hardware",
                "--release",
                "--locked",
            ]),
            envs: vec![("VLLM_IR_REQUIRE", REQUIRE.to_owned())],
            limit: Duration::from_secs(20),
        },
        Step {
            name: "candle-cuda",
            what: "every op on candle CUDA tensors against candle CPU tensors, in place, no copy, no fallback",
            args: candle_args("run"),
            envs: candle_env(),
            limit: Duration::from_secs(30),
        },
        Step {
            name: "gpu-bench",
            what: "the kernel benchmark on the GPU providers (quick), its share of the device's peak bandwidth",
            args: strings(&["xtask", "gpu-bench", "--quick"]),
            envs: vec![],
            limit: Duration::from_secs(80),
        },
    ]
}

/// What this machine lacks for the check (empty when it has everything).
fn missing() -> Vec<String> {
    let mut missing = Vec::new();
    if !crate::tools::library_loadable("libcuda.so.1") && !crate::tools::library_loadable("libcuda.so") {
        missing.push("the NVIDIA driver's libcuda (no GPU driver on the loader path)".to_owned());
    }
    if !crate::tools::library_loadable("libnvrtc.so.12") {
        missing.push(
            "libnvrtc.so.12 (pip install nvidia-cuda-nvrtc-cu12 and put its lib directory on LD_LIBRARY_PATH)"
                .to_owned(),
        );
    }
    let nvcc = Command::new("nvcc").arg("--version").output().is_ok_and(|o| o.status.success());
    if !nvcc {
        missing.push("nvcc, for candle's CUDA build (`.ci/cuda-toolkit` installs it; put its bin on PATH)".to_owned());
    }
    missing
}

pub(crate) fn run(dry_run: bool) -> anyhow::Result<()> {
    let steps = steps();
    let budget: Duration = steps.iter().map(|s| s.limit).sum();
    let missing = missing();
    if dry_run {
        println!("gpu-check would run, in at most {} s in all (one H200):", budget.as_secs());
        for (i, step) in steps.iter().enumerate() {
            let envs: String = step.envs.iter().map(|(k, v)| format!("{k}={v} ")).collect();
            println!("{}. {} (at most {} s): {}", i + 1, step.name, step.limit.as_secs(), step.what);
            println!("   $ {envs}cargo {}", step.args.join(" "));
        }
        println!("and write {}", report_path().display());
        if missing.is_empty() {
            println!("this machine has what the steps need");
        } else {
            println!("this machine lacks:");
            for m in &missing {
                println!("- {m}");
            }
        }
        return Ok(());
    }
    if !missing.is_empty() {
        bail!("gpu-check needs a GPU machine; this one lacks: {} (`--dry-run` lists the steps)", missing.join("; "));
    }
    let dir = report_path().parent().map(Path::to_path_buf).unwrap_or_else(project_root);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut report = String::from("# GPU check\n\n| step | result | seconds | limit |\n|---|---|---|---|\n");
    let mut failed = Vec::new();
    let mut details = String::new();
    for step in &steps {
        let log = dir.join(format!("{}.log", step.name));
        println!("$ cargo {}  (at most {} s; log {})", step.args.join(" "), step.limit.as_secs(), log.display());
        let (outcome, seconds, output) = run_step(step, &log)?;
        println!("  {outcome} in {seconds:.0} s");
        report.push_str(&format!("| {} | {outcome} | {seconds:.0} | {} |\n", step.name, step.limit.as_secs()));
        if outcome != "passed" {
            failed.push(step.name);
        }
        let tail: Vec<&str> = output.lines().rev().take(40).collect();
        details.push_str(&format!("\n## {}\n\n{}\n\n```text\n", step.name, step.what));
        for line in tail.into_iter().rev() {
            details.push_str(line);
            details.push('\n');
        }
        details.push_str("```\n");
    }
    let bench = project_root().join("docs").join("benchmarks-gpu.md");
    if let Ok(figures) = std::fs::read_to_string(&bench) {
        details.push_str(&format!("\n## Benchmark figures ({})\n\n{figures}\n", bench.display()));
    }
    report.push_str(&details);
    std::fs::write(report_path(), &report).with_context(|| format!("writing {}", report_path().display()))?;
    println!("wrote {}", report_path().display());
    if !failed.is_empty() {
        bail!("gpu-check: {} failed (see the report)", failed.join(", "));
    }
    Ok(())
}

fn report_path() -> PathBuf {
    project_root().join("target").join("gpu-check").join("report.md")
}

/// Runs `step`, its output to `log`, killed at its limit: the outcome (`passed`, `failed`,
/// `skipped a device step`, `timed out`), the seconds it took and its output.
fn run_step(step: &Step, log: &Path) -> anyhow::Result<(&'static str, f64, String)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let start = Instant::now();
    let mut child = Command::new(&cargo)
        .args(&step.args)
        .envs(step.envs.iter().map(|(k, v)| (*k, v.as_str())))
        .current_dir(project_root())
        .stdout(file.try_clone()?)
        .stderr(file)
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("running `cargo {}`", step.args.join(" ")))?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() > step.limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let seconds = start.elapsed().as_secs_f64();
    let mut output = String::new();
    std::fs::File::open(log)?.read_to_string(&mut output)?;
    let outcome = match status {
        None => "timed out",
        Some(s) if !s.success() => "failed",
        // A device step that skipped (the example says so itself) did not check the device.
        Some(_) if output.lines().any(|l| l.starts_with("skipped:") && step.name == "candle-cuda") => {
            "skipped a device step"
        }
        Some(_) => "passed",
    };
    Ok((outcome, seconds, output))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steps_fit_eight_minutes_and_require_the_device() {
        let steps = steps();
        let budget: Duration = steps.iter().map(|s| s.limit).sum();
        assert!(budget <= Duration::from_secs(8 * 60), "{budget:?}");
        for name in ["kernels", "fp8-hardware", "candle-cuda"] {
            let step = steps.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no step {name}"));
            assert!(step.envs.iter().any(|(k, v)| *k == "VLLM_IR_REQUIRE" && v.contains("cuda")), "{name}");
        }
        // Every build precedes every run.
        let last_build = steps.iter().rposition(|s| s.name.starts_with("build")).unwrap();
        let first_run = steps.iter().position(|s| !s.name.starts_with("build")).unwrap();
        assert!(last_build < first_run);
    }
}
