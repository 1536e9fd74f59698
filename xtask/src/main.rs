//! `cargo xtask`: the project's automation, in Rust (matklad's xtask pattern).
//!
//! Subcommands: `ci` (everything below this machine can run), `lint` (fmt check, clippy with warnings
//! denied), `test` (the workspace tests), `check-features` (each feature of the spec's R3 table
//! compiles on its own), `build --platform cpu|cuda|rocm|xpu` (the CLI with that platform's features).

#![allow(clippy::print_stdout)]

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

const USAGE: &str = "usage: cargo xtask <ci | lint | test | check-features | build --platform cpu|cuda|rocm|xpu>";

fn main() {
    if let Err(error) = run(env::args().skip(1).collect()) {
        eprintln!("xtask: {error:#}");
        std::process::exit(1);
    }
}

fn run(args: Vec<String>) -> anyhow::Result<()> {
    let Some(command) = args.first() else { bail!("{USAGE}") };
    match command.as_str() {
        "ci" => ci(),
        "lint" => lint(),
        "test" => test(),
        "check-features" => check_features(),
        "build" => build(&args[1..]),
        other => bail!("unknown subcommand `{other}`\n{USAGE}"),
    }
}

fn ci() -> anyhow::Result<()> {
    lint()?;
    check_features()?;
    test()?;
    println!("xtask ci: all steps passed");
    Ok(())
}

fn lint() -> anyhow::Result<()> {
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"])
}

/// The README's test command.
fn test() -> anyhow::Result<()> {
    cargo(&["test", "--workspace", "--locked"])
}

fn check_features() -> anyhow::Result<()> {
    cargo(&["check", "--package", "ir-cli", "--no-default-features", "--locked"])?;
    cargo(&["check", "--workspace", "--all-features", "--locked"])
}

fn build(args: &[String]) -> anyhow::Result<()> {
    let platform = match args {
        [flag, platform] if flag == "--platform" => platform.as_str(),
        [flag] if flag.starts_with("--platform=") => &flag["--platform=".len()..],
        _ => bail!("usage: cargo xtask build --platform cpu|cuda|rocm|xpu"),
    };
    match platform {
        "cpu" => cargo(&["build", "--release", "--package", "ir-cli", "--no-default-features", "--locked"]),
        "cuda" | "rocm" | "xpu" => bail!(
            "platform `{platform}`: this build has no {platform} kernel crate yet; `cargo xtask build --platform cpu` \
             builds the CPU platform"
        ),
        other => bail!("unknown platform `{other}` (expected cpu, cuda, rocm or xpu)"),
    }
}

fn cargo(args: &[&str]) -> anyhow::Result<()> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    println!("$ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .current_dir(project_root())
        .status()
        .with_context(|| format!("running `cargo {}`", args.join(" ")))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace root").to_path_buf()
}

#[cfg(test)]
mod tidy;
