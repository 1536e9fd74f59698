//! `cargo xtask examples`: the `vllm-ir` crate's examples, run as the workspace's test build made them.

use std::env;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

use crate::tools::project_root;

/// The engine-facing examples run as written (each asserts what it shows). `cargo test --workspace`
/// builds every example with the workspace's features, so they run as that build made them: a
/// `cargo run` of one package would compile the crates again with its own feature set.
pub(crate) fn run() -> anyhow::Result<()> {
    let built = built_examples()?;
    let run = |name: &str, args: &[&str]| -> anyhow::Result<()> {
        let binary = built.get(name).with_context(|| {
            format!(
                "`cargo test --workspace` built no example `{name}` (built: {:?})",
                built.keys().collect::<Vec<_>>()
            )
        })?;
        println!("$ {} {}", binary.display(), args.join(" "));
        let start = std::time::Instant::now();
        let status = Command::new(binary)
            .args(args)
            .current_dir(project_root())
            .status()
            .with_context(|| format!("running example `{name}`"))?;
        println!("  ({:.0} s: example {name})", start.elapsed().as_secs_f64());
        if !status.success() {
            bail!("example `{name}` failed ({status})");
        }
        Ok(())
    };
    run("engine", &[])?;
    run("custom_kernel", &[])?;
    // The ops on candle tensors (the feature pulls candle-core in), and the Llama-architecture model
    // on them beside candle-nn's ops: a tiny random model of each variant, which fails on a
    // defensive copy or a native fallback, or when its compiled graph (candle's matmuls and
    // attention as engine ops) does not give the eager run's logits bit for bit.
    run("candle", &[])?;
    for variant in ["llama", "gemma"] {
        run("llama", &["--variant", variant, "--dtype", "bf16", "--iters", "1"])?;
    }
    Ok(())
}

/// The example binaries of the README's test build, by name: what `cargo test --workspace --no-run`
/// reports (building whatever is not built yet).
fn built_examples() -> anyhow::Result<std::collections::BTreeMap<String, PathBuf>> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let args = ["test", "--workspace", "--locked", "--no-run", "--message-format=json-render-diagnostics"];
    println!("$ cargo {}", args.join(" "));
    let output = Command::new(&cargo)
        .args(args)
        .current_dir(project_root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running `cargo test --no-run`")?;
    if !output.status.success() {
        bail!("`cargo {}` failed ({})", args.join(" "), output.status);
    }
    let mut built = std::collections::BTreeMap::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let is_example = message["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "example"));
        if let (true, Some(executable)) = (is_example, message["executable"].as_str()) {
            let name = message["target"]["name"].as_str().unwrap_or_default().to_owned();
            built.insert(name, PathBuf::from(executable));
        }
    }
    Ok(built)
}
