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
