//! `cargo xtask fuzz [--seconds N]`: the cargo-fuzz targets, side by side, on nightly.

use std::env;
use std::process::Command;

use anyhow::{Context, bail};

use crate::tools::project_root;

/// Fuzz targets under `fuzz/`.
const FUZZ_TARGETS: [&str; 2] = ["parse", "pipeline"];

/// Runs each fuzz target for `seconds` (`--seconds N`, default 60) with cargo-fuzz on the nightly toolchain;
/// prints `skipped: <reason>` when either is missing. New corpus entries go to a temporary folder,
/// the committed seeds in `fuzz/corpus/<target>` are only read.
pub(crate) fn run(seconds: u64) -> anyhow::Result<()> {
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
