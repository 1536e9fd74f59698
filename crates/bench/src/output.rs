//! Where the benchmarks write what criterion does not record (provider availability, the memory
//! study): JSON files in one folder that `cargo xtask bench` reads back.

use std::path::PathBuf;

use serde::Serialize;

use crate::BenchError;

/// Environment variable naming the results folder (`cargo xtask bench` sets it).
pub const OUT_DIR_ENV: &str = "VLLM_IR_BENCH_OUT";

/// The results folder: `$VLLM_IR_BENCH_OUT`, else `target/vllm-ir-bench` under the workspace.
pub fn out_dir() -> PathBuf {
    match std::env::var_os(OUT_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/vllm-ir-bench"),
    }
}

/// Writes `value` as pretty JSON to `<out_dir>/<file>`.
pub fn write_json(file: &str, value: &impl Serialize) -> Result<PathBuf, BenchError> {
    let dir = out_dir();
    let path = dir.join(file);
    let io = |message: String| BenchError::Io { path: path.display().to_string(), message };
    std::fs::create_dir_all(&dir).map_err(|e| io(e.to_string()))?;
    let text = serde_json::to_string_pretty(value).map_err(|e| io(e.to_string()))?;
    std::fs::write(&path, text + "\n").map_err(|e| io(e.to_string()))?;
    Ok(path)
}

/// Whether the quick subset was asked for (`VLLM_IR_BENCH_QUICK=1`, set by `cargo xtask bench --quick`).
pub fn quick() -> bool {
    std::env::var("VLLM_IR_BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// Criterion's options that take a value (so the value is not mistaken for the filter).
const VALUE_OPTIONS: &[&str] = &[
    "--save-baseline",
    "-s",
    "--baseline",
    "-b",
    "--baseline-lenient",
    "--load-baseline",
    "--sample-size",
    "--warm-up-time",
    "--measurement-time",
    "--nresamples",
    "--noise-threshold",
    "--confidence-level",
    "--significance-level",
    "--profile-time",
    "--plotting-backend",
    "--output-format",
    "--color",
    "-c",
    "--format",
];

/// The benchmark filter criterion was given (`cargo bench -- <filter>`), as the regular expression
/// criterion matches benchmark ids with; `None` runs everything. Benchmarks use it to skip the setup
/// of cases nothing will time.
pub fn filter(args: impl IntoIterator<Item = String>) -> Option<regex::Regex> {
    let mut args = args.into_iter().skip(1);
    while let Some(arg) = args.next() {
        if VALUE_OPTIONS.contains(&arg.as_str()) {
            args.next();
        } else if !arg.starts_with('-') {
            return regex::Regex::new(&arg).ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        std::iter::once("bench").chain(list.iter().copied()).map(str::to_owned).collect()
    }

    #[test]
    fn the_filter_is_the_first_positional_argument() {
        assert!(filter(args(&["--bench"])).is_none());
        let f = filter(args(&["--bench", "--save-baseline", "main", "kernels/silu"])).unwrap();
        assert!(f.is_match("kernels/silu_and_mul/bf16/1x4096/cpu"));
        assert!(!f.is_match("kernels/rms_norm/bf16/1x4096/cpu"));
        assert_eq!(filter(args(&["--bench", "-s", "x"])).map(|r| r.to_string()), None);
    }
}
