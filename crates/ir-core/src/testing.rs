//! Helpers for tests of this and other crates.

use std::io::Write;

/// Says that a test cannot run here and why, on stderr (which libtest does not capture), unless the
/// backend is listed in `VLLM_IR_REQUIRE` (comma list of `xpu`, `nvrtc`, `hip`), in which case the
/// skip is a failure.
///
/// Returns normally so the caller can `return` right after it.
pub fn skip(backend: &str, reason: &str) {
    let required = std::env::var("VLLM_IR_REQUIRE").unwrap_or_default();
    let is_required = required.split(',').map(str::trim).any(|b| b == backend);
    assert!(!is_required, "`{backend}` is required (VLLM_IR_REQUIRE={required}) but unavailable: {reason}");
    let _ = writeln!(std::io::stderr(), "skipped: {reason}");
}
