//! `cargo xtask bench [--quick]` and `cargo xtask gpu-bench`: run the criterion benchmarks of
//! `vllm-ir-bench`, read back their medians (criterion's `estimates.json`) and the JSON the
//! benchmarks write themselves, and write `docs/benchmarks.md` with plots beside it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use serde::Deserialize;
use serde_json::Value;

use crate::{cargo, project_root};

/// What `bench` was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BenchOptions {
    pub(crate) quick: bool,
    pub(crate) candle: bool,
    /// Rewrite the report and plots from the last run's results without running anything.
    pub(crate) report_only: bool,
}

fn results_dir() -> PathBuf {
    project_root().join("target/vllm-ir-bench")
}

/// Runs every benchmark group and writes `docs/benchmarks.md` and the plots.
pub(crate) fn bench(options: BenchOptions) -> anyhow::Result<()> {
    let out = results_dir();
    if options.report_only {
        if !out.join("criterion").exists() {
            bail!("no results in {} to report on: run `cargo xtask bench` first", out.display());
        }
    } else {
        let run_env = RunEnv::fresh(&out, options.quick)?;
        let envs = run_env.vars();
        let mut args = vec!["bench", "--package", "vllm-ir-bench", "--locked"];
        if options.candle {
            args.extend(["--features", "candle"]);
        }
        let candle_only: &[&str] = if options.candle { &["candle_per_call"] } else { &[] };
        let benches =
            ["memory", "dispatch", "passes", "decoder", "copies", "decode_ops", "rounding", "model", "kernels"];
        for bench in benches.iter().chain(candle_only) {
            let mut run = args.clone();
            run.extend(["--bench", *bench]);
            cargo(&run, &envs)?;
        }
        rss::measure(&out)?;
        device_demo::measure(&out)?;
    }
    let results = Results::load(&out)?;
    let docs = project_root().join("docs");
    let plots = docs.join("benchmarks");
    std::fs::create_dir_all(&plots)?;
    // Plots of earlier runs (other families, the former single plot) are replaced, not kept.
    for entry in std::fs::read_dir(&plots)? {
        let path = entry?.path();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("kernel-bandwidth")) {
            std::fs::remove_file(&path)?;
        }
    }
    let sweeps = plot::kernel_sweeps(&results, &plots)?;
    plot::passes(&results, &plots.join("pass-time.svg"))?;
    let mut machine = Machine::describe(&results)?;
    // The date, commit and kind (quick or full) of the run measured: written by a run, read back
    // by `--report-only`, so the page names the run its figures come from.
    let stamp = out.join("run-stamp.txt");
    let mut options = options;
    if options.report_only {
        let text = std::fs::read_to_string(&stamp).with_context(|| format!("reading {}", stamp.display()))?;
        let mut lines = text.lines();
        let (Some(date), Some(commit)) = (lines.next(), lines.next()) else {
            bail!("{} holds the date, the commit and the kind of run", stamp.display());
        };
        (machine.date, machine.commit) = (date.to_owned(), commit.to_owned());
        match lines.next() {
            Some("quick") => options.quick = true,
            Some("full") => options.quick = false,
            _ => {}
        }
    } else {
        let kind = if options.quick { "quick" } else { "full" };
        std::fs::write(&stamp, format!("{}\n{}\n{kind}\n", machine.date, machine.commit))?;
    }
    let report = report::write(&results, &machine, options, &sweeps)?;
    let path = docs.join("benchmarks.md");
    std::fs::write(&path, report).with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {} and the plots in docs/benchmarks/", path.display());
    Ok(())
}

/// Runs the kernel group on the GPU providers only and writes `docs/benchmarks-gpu.md`.
pub(crate) fn gpu_bench(quick: bool) -> anyhow::Result<()> {
    let out = results_dir().join("gpu");
    let run_env = RunEnv::fresh(&out, quick)?;
    let mut envs = run_env.vars();
    envs.push(("VLLM_IR_BENCH_PROVIDERS", "cuda,rocm,xpu"));
    cargo(&["bench", "--package", "vllm-ir-bench", "--locked", "--bench", "kernels"], &envs)?;
    let results = Results::load(&out)?;
    let machine = Machine::describe(&results)?;
    let text = report::gpu(&results, &machine)?;
    println!("{text}");
    let path = project_root().join("docs/benchmarks-gpu.md");
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// glibc settings that keep freed host memory in the process between calls (see [`RunEnv::vars`]).
pub(crate) const HOST_ALLOCATOR_ENV: [(&str, &str); 2] =
    [("MALLOC_MMAP_THRESHOLD_", "4294967296"), ("MALLOC_TRIM_THRESHOLD_", "17179869184")];

/// The environment of one benchmark run: an emptied results folder, criterion's files inside it.
struct RunEnv {
    out: String,
    criterion_home: String,
    quick: bool,
}

impl RunEnv {
    fn fresh(out: &Path, quick: bool) -> anyhow::Result<RunEnv> {
        if out.exists() {
            std::fs::remove_dir_all(out).with_context(|| format!("clearing {}", out.display()))?;
        }
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        let criterion_home = out.join("criterion").display().to_string();
        Ok(RunEnv { out: out.display().to_string(), criterion_home, quick })
    }

    fn vars(&self) -> Vec<(&str, &str)> {
        let mut vars = vec![("VLLM_IR_BENCH_OUT", self.out.as_str()), ("CRITERION_HOME", self.criterion_home.as_str())];
        // Functional kernels allocate their outputs inside the timed region. glibc returns large
        // blocks to the system on free and maps fresh pages on the next call, so without this every
        // call of a prefill-sized op would pay a page fault per 4 KiB; keeping freed memory in the
        // process is what an engine's caching allocator does. The zeroing of a reused block stays
        // part of the measured call.
        vars.extend(HOST_ALLOCATOR_ENV);
        if self.quick {
            vars.push(("VLLM_IR_BENCH_QUICK", "1"));
        }
        vars
    }
}

/// One criterion benchmark's median.
#[derive(Debug, Clone)]
pub(crate) struct Measurement {
    pub(crate) group: String,
    pub(crate) function: String,
    pub(crate) median_ns: f64,
    /// Bytes (or elements) per iteration, as the benchmark declared.
    pub(crate) per_iteration: Option<u64>,
}

impl Measurement {
    /// GB/s (10⁹ bytes per second) from the declared bytes.
    pub(crate) fn gb_per_s(&self) -> Option<f64> {
        self.per_iteration.map(|bytes| bytes as f64 / self.median_ns)
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct ProviderStatus {
    pub(crate) provider: String,
    pub(crate) available: bool,
    pub(crate) device: Option<String>,
    pub(crate) reason: Option<String>,
    pub(crate) failures: Vec<String>,
    /// (criterion group, reason) of the cases the provider's predicate rejects.
    #[serde(default)]
    pub(crate) rejected: Vec<(String, String)>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct PassBreakdown {
    pub(crate) nodes: usize,
    pub(crate) passes: Vec<(String, f64)>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct RunStats {
    pub(crate) bytes_allocated: u64,
    pub(crate) peak_live_bytes: u64,
    pub(crate) clones_executed: usize,
    pub(crate) defensive_copies: usize,
}

impl RunStats {
    pub(crate) fn copies(&self) -> usize {
        self.clones_executed + self.defensive_copies
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct MemoryRow {
    pub(crate) layers: usize,
    pub(crate) uncompiled: RunStats,
    pub(crate) uncompiled_donating: RunStats,
    pub(crate) compiled: RunStats,
    pub(crate) compiled_floor_bytes: u64,
    pub(crate) saved_bytes: u64,
    pub(crate) bit_identical: bool,
}

/// One row of the model study (`model.json`): ours, candle-nn's, then the compiled graph's, per
/// figure.
#[derive(Debug, Deserialize)]
pub(crate) struct ModelRow {
    pub(crate) variant: String,
    pub(crate) dtype: String,
    pub(crate) layers: usize,
    pub(crate) hidden: usize,
    pub(crate) prefill_tokens: usize,
    pub(crate) prefill_ms: [f64; 3],
    pub(crate) decode_ms: [f64; 3],
    pub(crate) ours_share: f64,
    pub(crate) copies: u64,
    pub(crate) native_fallbacks: u64,
    pub(crate) compiled_copies: usize,
}

#[derive(Debug, Deserialize)]
pub(crate) struct MemoryStudy {
    pub(crate) tokens: usize,
    pub(crate) hidden: usize,
    pub(crate) dtype: String,
    pub(crate) activation_bytes: u64,
    pub(crate) fused_provider: String,
    pub(crate) rows: Vec<MemoryRow>,
}

/// Everything one run produced.
#[derive(Debug, Default)]
pub(crate) struct Results {
    /// By (group, function).
    pub(crate) measurements: BTreeMap<(String, String), Measurement>,
    pub(crate) providers: Vec<ProviderStatus>,
    pub(crate) passes: Vec<PassBreakdown>,
    pub(crate) memory: Option<MemoryStudy>,
    /// `vllm-ir opt`'s peak resident memory on generated graphs.
    pub(crate) rss: Option<rss::RssStudy>,
    /// The demo's host round trips on each GPU platform.
    pub(crate) device_demo: Vec<device_demo::DeviceDemo>,
    /// The Llama example's model with ours and candle-nn's ops.
    pub(crate) model: Vec<ModelRow>,
}

impl Results {
    fn load(dir: &Path) -> anyhow::Result<Results> {
        let mut results = Results::default();
        let mut files = Vec::new();
        collect_benchmark_files(&dir.join("criterion"), &mut files)?;
        for file in files {
            let m = read_measurement(&file).with_context(|| format!("reading {}", file.display()))?;
            results.measurements.insert((m.group.clone(), m.function.clone()), m);
        }
        if results.measurements.is_empty() {
            bail!("no criterion results under {}", dir.join("criterion").display());
        }
        let read_json = |name: &str| -> anyhow::Result<Option<String>> {
            let path = dir.join(name);
            if !path.exists() {
                return Ok(None);
            }
            Ok(Some(std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?))
        };
        if let Some(text) = read_json("providers.json")? {
            results.providers = serde_json::from_str(&text).context("parsing providers.json")?;
        }
        if let Some(text) = read_json("passes.json")? {
            results.passes = serde_json::from_str(&text).context("parsing passes.json")?;
        }
        if let Some(text) = read_json("memory.json")? {
            results.memory = Some(serde_json::from_str(&text).context("parsing memory.json")?);
        }
        if let Some(text) = read_json("rss.json")? {
            results.rss = Some(serde_json::from_str(&text).context("parsing rss.json")?);
        }
        if let Some(text) = read_json("model.json")? {
            results.model = serde_json::from_str(&text).context("parsing model.json")?;
        }
        if let Some(text) = read_json("device-demo.json")? {
            results.device_demo = serde_json::from_str(&text).context("parsing device-demo.json")?;
        }
        Ok(results)
    }

    pub(crate) fn get(&self, group: &str, function: &str) -> Option<&Measurement> {
        self.measurements.get(&(group.to_owned(), function.to_owned()))
    }

    /// Groups starting with `prefix`, in order, with their functions.
    pub(crate) fn groups(&self, prefix: &str) -> Vec<String> {
        let mut groups: Vec<String> =
            self.measurements.keys().filter(|(g, _)| g.starts_with(prefix)).map(|(g, _)| g.clone()).collect();
        groups.dedup();
        groups
    }
}

fn collect_benchmark_files(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "new") && path.join("benchmark.json").exists() {
                out.push(path);
            } else {
                collect_benchmark_files(&path, out)?;
            }
        }
    }
    Ok(())
}

/// Reads `benchmark.json` (ids, throughput) and `estimates.json` (the median) of one benchmark.
fn read_measurement(new_dir: &Path) -> anyhow::Result<Measurement> {
    let benchmark: Value = serde_json::from_str(&std::fs::read_to_string(new_dir.join("benchmark.json"))?)?;
    let estimates: Value = serde_json::from_str(&std::fs::read_to_string(new_dir.join("estimates.json"))?)?;
    let group = benchmark["group_id"].as_str().context("benchmark.json has no group_id")?.to_owned();
    let function = match (benchmark["function_id"].as_str(), benchmark["value_str"].as_str()) {
        (Some(f), Some(v)) => format!("{f}/{v}"),
        (Some(f), None) => f.to_owned(),
        (None, Some(v)) => v.to_owned(),
        (None, None) => String::new(),
    };
    let median_ns = estimates["median"]["point_estimate"].as_f64().context("estimates.json has no median")?;
    let per_iteration = benchmark["throughput"].as_object().and_then(|t| t.values().next()).and_then(Value::as_u64);
    Ok(Measurement { group, function, median_ns, per_iteration })
}

/// The machine the run measured.
pub(crate) struct Machine {
    pub(crate) cpu: String,
    pub(crate) cores: usize,
    pub(crate) memory: String,
    pub(crate) os: String,
    pub(crate) rustc: String,
    pub(crate) commit: String,
    pub(crate) date: String,
    pub(crate) devices: Vec<String>,
}

impl Machine {
    fn describe(results: &Results) -> anyhow::Result<Machine> {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name").map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned()))
            .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse::<f64>().ok())
            .map_or_else(|| "unknown".to_owned(), |kb| format!("{:.1} GiB", kb / (1 << 20) as f64));
        let os = std::fs::read_to_string("/etc/os-release")
            .ok()
            .and_then(|t| {
                t.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_owned()))
            })
            .unwrap_or_else(|| std::env::consts::OS.to_owned());
        let rustc = command_output("rustc", &["--version"]).unwrap_or_else(|| "unknown".to_owned());
        let mut commit =
            command_output("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
        // Changes under docs/ (this report itself, after a first run) do not change what was measured.
        let status = command_output("git", &["status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"]);
        if status.is_some_and(|s| !s.is_empty()) {
            commit.push_str(" (with uncommitted changes)");
        }
        let date = command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_else(|| "unknown".to_owned());
        let devices = results
            .providers
            .iter()
            .filter(|p| p.available)
            .filter_map(|p| p.device.as_ref().map(|d| format!("`{}`: {d}", p.provider)))
            .collect();
        Ok(Machine { cpu, cores, memory, os, rustc, commit, date, devices })
    }
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let output = Command::new(program).args(args).current_dir(project_root()).output().ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Nominal peak bandwidths, by a substring of the device name, in GB/s.
pub(crate) const PEAKS: [(&str, f64); 6] =
    [("H200", 4800.0), ("H100", 3350.0), ("A100", 2039.0), ("B200", 8000.0), ("MI300X", 5300.0), ("Max 1550", 3276.8)];

/// The nominal peak of a described device, if known.
pub(crate) fn peak_for(device: &str) -> Option<(&'static str, f64)> {
    PEAKS.iter().find(|(name, _)| device.contains(name)).copied()
}

mod device_demo;
mod plot;
mod report;
mod rss;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn criterion_files_are_read_back() {
        let dir = std::env::temp_dir().join(format!("xtask-bench-test-{}", std::process::id()));
        let new = dir.join("criterion/kernels_rms_norm/cpu/new");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::write(
            new.join("benchmark.json"),
            r#"{"group_id":"kernels/rms_norm/f32/1x4096","function_id":"cpu","value_str":null,"throughput":{"Bytes":32784},"full_id":"x","directory_name":"x","title":"x"}"#,
        )
        .unwrap();
        std::fs::write(
            new.join("estimates.json"),
            r#"{"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":990.0,"upper_bound":1010.0},"point_estimate":1000.0,"standard_error":1.0}}"#,
        )
        .unwrap();
        let results = Results::load(&dir).unwrap();
        let m = results.get("kernels/rms_norm/f32/1x4096", "cpu").unwrap();
        assert_eq!(m.median_ns, 1000.0);
        assert!((m.gb_per_s().unwrap() - 32.784).abs() < 1e-9);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(Results::load(&dir).unwrap_err().to_string().starts_with("no criterion results"));
    }

    #[test]
    fn peaks_follow_the_spec() {
        assert_eq!(peak_for("NVIDIA H200 (cuda:0, sm_90)"), Some(("H200", 4800.0)));
        assert_eq!(peak_for("some laptop GPU"), None);
    }
}
