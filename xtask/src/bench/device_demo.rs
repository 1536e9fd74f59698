//! Host round trips of the demo on a device: `vllm-ir demo --platform <p>` (the toy decoder, eager
//! and compiled, with its parameters and activations on the platform's device) for each GPU
//! platform, reading the run's total from its last `host round trips: N` line. The xpu platform
//! may use a CPU OpenCL device (PoCL) here: the count is a property of the code paths, not of the
//! device's speed. A platform without a device is recorded with the CLI's reason.

use std::path::Path;
use std::process::Command;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::project_root;

/// The demo's shape: small, so that an emulated device runs it in seconds.
const DEMO_ARGS: [&str; 6] = ["--layers", "2", "--tokens", "16", "--hidden", "512"];

/// One platform's demo run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub(crate) struct DeviceDemo {
    /// `cuda`, `rocm` or `xpu`.
    pub(crate) platform: String,
    /// The run's host round trips, when it ran.
    pub(crate) round_trips: Option<u64>,
    /// Where the tensors lived (the demo's `tensors on` field), or why it did not run.
    pub(crate) note: String,
}

/// Runs the demo on every GPU platform (the CLI built in release by the resident-memory study) and
/// writes `device-demo.json` into `out`.
pub(crate) fn measure(out: &Path) -> anyhow::Result<Vec<DeviceDemo>> {
    let cli = project_root().join("target/release/vllm-ir");
    let mut runs = Vec::new();
    for platform in ["cuda", "rocm", "xpu"] {
        let output = Command::new(&cli)
            .args(["demo", "--platform", platform])
            .args(DEMO_ARGS)
            .env("VLLM_IR_XPU_ALLOW_CPU", "1")
            .output()
            .with_context(|| format!("running {}", cli.display()))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let run = parse(platform, output.status.success(), &stdout, &stderr);
        println!("vllm-ir demo --platform {platform}: {:?} host round trips ({})", run.round_trips, run.note);
        runs.push(run);
    }
    let path = out.join("device-demo.json");
    std::fs::write(&path, serde_json::to_string_pretty(&runs)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(runs)
}

/// The record of one demo run from its exit and output.
fn parse(platform: &str, success: bool, stdout: &str, stderr: &str) -> DeviceDemo {
    let round_trips = stdout
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix("host round trips: "))
        .and_then(|n| n.trim().parse().ok());
    let note = if success {
        let device = stdout.lines().find_map(|line| line.split_once("tensors on ").map(|(_, d)| d.trim().to_owned()));
        format!("tensors on {}", device.unwrap_or_else(|| "an unnamed device".to_owned()))
    } else {
        stderr.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("the demo failed").trim().to_owned()
    };
    DeviceDemo { platform: platform.to_owned(), round_trips: if success { round_trips } else { None }, note }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_gives_its_total_and_a_failure_its_reason() {
        let stdout = "demo: 2 decoder layers, bf16, platform xpu, tensors on xpu:0\n  host round trips: 1\nhost round trips: 3\n";
        let run = parse("xpu", true, stdout, "");
        assert_eq!(run.round_trips, Some(3));
        assert_eq!(run.note, "tensors on xpu:0");
        let failed = parse("cuda", false, "", "error: platform cuda: no device to run on: libcuda.so not found\n");
        assert_eq!(failed.round_trips, None);
        assert!(failed.note.contains("libcuda.so not found"), "{}", failed.note);
    }
}
