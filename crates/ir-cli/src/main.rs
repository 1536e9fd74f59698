//! `vllm-ir`: inspect providers and priorities (`info`), optimize (`opt`) and run (`run`) graph files,
//! and run a toy decoder (`demo`).
//!
//! Common flags: `--ir-op-priority` (same syntax as `VLLM_IR_PRIORITY`, which it replaces) and
//! `--platform` (`cuda`, `rocm`, `xpu`, `cpu`; default: detected). Logs go to stderr, filtered by
//! `RUST_LOG` (for example `RUST_LOG=ir_core::dispatch=debug`).

#![allow(clippy::print_stdout)]

/// `println!` that ends the process quietly when standard output is closed (`vllm-ir info | head`:
/// the reader has what it wanted), and with one line on any other write error.
macro_rules! outln {
    () => {
        $crate::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod compile;
mod demo;
mod info;
mod opt;
mod run;

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use ir_core::storage::DeviceAllocator;
use ir_core::{ConfigSources, PLATFORM_ENV, PRIORITY_ENV};
use ir_core::{Platform, PriorityConfig, Registry};

/// Inspect and run vllm-ir ops, providers and priorities.
#[derive(Parser, Debug)]
#[command(name = "vllm-ir", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the platform, every op with its providers and their availability, and the final priorities.
    Info(CommonArgs),
    /// Run a toy decoder (norms, fp8 quantization, rotary embedding, SiluAndMul) eagerly and compiled; require bit-identical results.
    Demo(demo::DemoArgs),
    /// Parse, verify and optimize a graph file; print the result.
    Opt(opt::OptArgs),
    /// Interpret a graph file before and after the passes and compare the outputs.
    Run(run::RunArgs),
}

/// Flags every subcommand takes.
#[derive(Args, Debug, Clone)]
struct CommonArgs {
    /// Provider priorities, e.g. `rms_norm=cpu,native;fused_add_rms_norm=native` (replaces VLLM_IR_PRIORITY).
    #[arg(long = "ir-op-priority", value_name = "SPEC")]
    ir_op_priority: Option<String>,
    /// Platform whose defaults to use: cuda, rocm, xpu or cpu (default: detected; replaces VLLM_IR_PLATFORM).
    #[arg(long, value_name = "PLATFORM")]
    platform: Option<String>,
}

impl CommonArgs {
    fn config(&self) -> anyhow::Result<PriorityConfig> {
        let sources = ConfigSources {
            env_priority: std::env::var(PRIORITY_ENV).ok(),
            env_platform: std::env::var(PLATFORM_ENV).ok(),
            cli_priority: self.ir_op_priority.clone(),
            cli_platform: self.platform.clone(),
        };
        PriorityConfig::from_sources(&sources).context("reading the priority configuration")
    }
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Info(args) => info::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Opt(args) => opt::run(args),
        Command::Run(args) => run::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            match error.chain().find_map(|cause| cause.downcast_ref::<compile::LocatedError>()) {
                // `FILE:LINE:COL: error: MESSAGE`, as compilers print it.
                Some(located) => eprintln!("{located}"),
                None => eprintln!("error: {}", one_line(&error)),
            }
            ExitCode::FAILURE
        }
    }
}

/// Writes to standard output; a closed pipe ends the process with success, any other error with one
/// line and failure (never a panic).
fn write_stdout(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(error) = std::io::stdout().lock().write_fmt(text) {
        exit_on_stdout_error(&error);
    }
}

/// Ends the process after a failed write to standard output: quietly when the reader closed the pipe.
fn exit_on_stdout_error(error: &std::io::Error) -> ! {
    if error.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: writing standard output: {error}");
    std::process::exit(1);
}

/// The error and its causes on one line; verifier errors give their diagnostics, not the graph.
fn one_line(error: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in error.chain() {
        let verify = cause
            .downcast_ref::<ir_graph::VerifyError>()
            .or_else(|| cause.downcast_ref::<Box<ir_graph::VerifyError>>().map(|boxed| &**boxed));
        if let Some(verify) = verify {
            parts.push(verify.summary());
            break;
        }
        let text = cause.to_string();
        // thiserror messages often include their source; do not repeat it.
        if parts.last().is_some_and(|previous| previous.contains(text.lines().next().unwrap_or_default())) {
            continue;
        }
        parts.push(text.lines().next().unwrap_or_default().to_owned());
    }
    parts.join(": ")
}

/// The allocator of the platform's device, where a run on `platform` keeps its tensors; `None` for
/// the CPU. A platform whose device this build or machine lacks is an error naming why.
fn device_allocator(platform: Platform) -> anyhow::Result<Option<Arc<dyn DeviceAllocator>>> {
    let unavailable = |reason: String| anyhow::anyhow!("platform {platform}: no device to run on: {reason}");
    match platform {
        Platform::Cpu => Ok(None),
        #[cfg(feature = "cuda")]
        Platform::Cuda => match kernels_cuda::allocator(0) {
            Ok(allocator) => Ok(Some(Arc::new(allocator))),
            Err(reason) => Err(unavailable(reason)),
        },
        #[cfg(feature = "xpu")]
        Platform::Xpu => match kernels_xpu::allocator() {
            Ok(allocator) => Ok(Some(Arc::new(allocator))),
            Err(reason) => Err(unavailable(reason)),
        },
        Platform::Rocm => kernels_rocm::allocator().map(|a| Some(Arc::from(a))).map_err(unavailable),
        #[allow(unreachable_patterns)]
        other => Err(unavailable(format!("this build has no `{}` provider", other.provider()))),
    }
}

/// A registry with the built-in ops and every provider this build includes, frozen: the commands
/// install priorities on it and never register anything later.
fn build_registry() -> anyhow::Result<Registry> {
    ir_core::strict_from_env()?;
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("a fresh registry has no cpu provider yet");
    #[cfg(feature = "cuda")]
    kernels_cuda::register(&registry).expect("a fresh registry has no cuda provider yet");
    #[cfg(feature = "xpu")]
    kernels_xpu::register(&registry).expect("a fresh registry has no xpu provider yet");
    kernels_rocm::register(&registry).expect("a fresh registry has no rocm provider yet");
    registry.freeze();
    Ok(registry)
}
