//! `cargo xtask test`: the README's test command, then the GPU compile sweeps it lists as ignored.

use crate::tools::cargo;

/// The README's test command (`cargo test --workspace`), then the GPU compile sweeps it leaves out
/// (ignored tests: every CUDA kernel through NVRTC and ptxas, every HIP source through hipcc), in the
/// same build.
pub(crate) fn run() -> anyhow::Result<()> {
    cargo(&["test", "--workspace", "--locked"], &[])?;
    // Over the workspace's build (not one package's own feature set), so nothing is compiled again.
    cargo(&["test", "--workspace", "--locked", "--test", "ptxas", "--test", "hipcc", "--", "--ignored"], &[])
}
