//! The compiler's resident memory: `vllm-ir opt` (parse, verify, the standard pipeline with
//! verification after every pass, print) on generated decoder graphs, peak RSS read from the
//! kernel's accounting of the finished child (`wait4`), minus the same for the smallest graph.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::{cargo, project_root};

/// Graph sizes measured besides the baseline (nodes asked for; the generator rounds up to a layer).
const SIZES: [usize; 2] = [100_000, 1_000_000];

/// One `vllm-ir opt` run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub(crate) struct RssRun {
    /// Nodes of the input graph.
    pub(crate) nodes: usize,
    /// Bytes of the input text.
    pub(crate) text_bytes: u64,
    /// Peak resident set of the process, in bytes.
    pub(crate) peak_bytes: u64,
    /// Wall time of the run, in seconds.
    pub(crate) seconds: f64,
}

/// The baseline (smallest graph) and the measured sizes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub(crate) struct RssStudy {
    pub(crate) baseline: RssRun,
    pub(crate) runs: Vec<RssRun>,
}

impl RssStudy {
    /// Peak bytes per node above the baseline, for a run.
    pub(crate) fn bytes_per_node(&self, run: &RssRun) -> f64 {
        run.peak_bytes.saturating_sub(self.baseline.peak_bytes) as f64 / run.nodes.max(1) as f64
    }
}

/// Builds the CLI and the generator, runs the study and writes `rss.json` into `out`.
pub(crate) fn measure(out: &Path) -> anyhow::Result<RssStudy> {
    cargo(&["build", "--release", "--locked", "--package", "vllm-ir-cli", "--bin", "vllm-ir"], &[])?;
    cargo(&["build", "--release", "--locked", "--package", "vllm-ir-bench", "--example", "decoder_ir"], &[])?;
    let release = project_root().join("target/release");
    let (cli, generator) = (release.join("vllm-ir"), release.join("examples/decoder_ir"));
    let dir = out.join("rss");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let run = |nodes: usize| -> anyhow::Result<RssRun> {
        let (graph, nodes) = generate(&generator, &dir, nodes)?;
        let run = opt(&cli, &graph, nodes)?;
        println!("vllm-ir opt: {} nodes, peak RSS {} KiB, {:.2} s", run.nodes, run.peak_bytes / 1024, run.seconds);
        // The texts are large (75 MB at 1M nodes): nothing reads them again.
        std::fs::remove_file(&graph).with_context(|| format!("removing {}", graph.display()))?;
        let _ = std::fs::remove_file(graph.with_extension("opt.ir"));
        Ok(run)
    };
    let baseline = run(0)?;
    let runs = SIZES.iter().map(|&nodes| run(nodes)).collect::<anyhow::Result<Vec<_>>>()?;
    let study = RssStudy { baseline, runs };
    let path = out.join("rss.json");
    std::fs::write(&path, serde_json::to_string_pretty(&study)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(study)
}

/// Writes the generated graph of (at least) `nodes` nodes; returns its path and node count.
fn generate(generator: &Path, dir: &Path, nodes: usize) -> anyhow::Result<(PathBuf, usize)> {
    let path = dir.join(format!("decoder-{nodes}.ir"));
    let file = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let output = Command::new(generator)
        .arg(nodes.to_string())
        .stdout(file)
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {}", generator.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!("{} {nodes} failed ({}): {stderr}", generator.display(), output.status);
    }
    let count = stderr
        .lines()
        .find_map(|line| line.strip_prefix("nodes ").and_then(|n| n.trim().parse().ok()))
        .with_context(|| format!("the generator did not say its node count: {stderr}"))?;
    Ok((path, count))
}

/// Runs `vllm-ir opt` on `graph` (the result written beside it) and reads its peak RSS.
fn opt(cli: &Path, graph: &Path, nodes: usize) -> anyhow::Result<RssRun> {
    let text_bytes = std::fs::metadata(graph).with_context(|| format!("reading {}", graph.display()))?.len();
    let started = Instant::now();
    let child = Command::new(cli)
        .arg("opt")
        .arg(graph)
        .arg("-o")
        .arg(graph.with_extension("opt.ir"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("running {}", cli.display()))?;
    let (status, peak_bytes) = wait_with_peak_rss(child)?;
    let seconds = started.elapsed().as_secs_f64();
    if status != 0 {
        bail!("`vllm-ir opt {}` failed (wait status {status})", graph.display());
    }
    Ok(RssRun { nodes, text_bytes, peak_bytes, seconds })
}

/// Waits for `child` (reaping it, as `Child::wait` would) and returns its wait status and peak
/// resident set in bytes.
fn wait_with_peak_rss(child: Child) -> anyhow::Result<(i32, u64)> {
    let pid = libc::pid_t::try_from(child.id()).context("a process id that fits pid_t")?;
    let mut status: libc::c_int = 0;
    // SAFETY: `rusage` is plain data, so all-zero bytes are a valid value of it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own child, not yet waited for; both pointers are valid for writes.
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if waited != pid {
        bail!("waiting for process {pid}: {}", std::io::Error::last_os_error());
    }
    // Linux reports `ru_maxrss` in KiB.
    let peak = u64::try_from(usage.ru_maxrss).context("a non-negative peak RSS")? * 1024;
    Ok((status, peak))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_childs_exit_status_and_peak_rss_are_read() {
        let child = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        let (status, peak) = wait_with_peak_rss(child).unwrap();
        assert_ne!(status, 0, "a failing child is seen as failing");
        assert!(peak > 0, "a running process has resident pages");
        let child = Command::new("sh").args(["-c", "exit 0"]).spawn().unwrap();
        assert_eq!(wait_with_peak_rss(child).unwrap().0, 0);
    }

    #[test]
    fn bytes_per_node_are_measured_above_the_baseline() {
        let run = |nodes, peak_bytes| RssRun { nodes, text_bytes: 0, peak_bytes, seconds: 0.0 };
        let study = RssStudy { baseline: run(3, 70 << 20), runs: vec![run(1_000_000, (70 << 20) + 550_000_000)] };
        assert_eq!(study.bytes_per_node(&study.runs[0]), 550.0);
        // A run below the baseline (noise) reads as zero, not as a wrapped huge number.
        assert_eq!(study.bytes_per_node(&run(10, 1)), 0.0);
    }
}
