//! `cargo xtask`: the project's automation, in Rust (the xtask pattern): one module per task,
//! arguments declared with clap (`cargo xtask --help`, `cargo xtask <task> --help`).
//!
//! The tasks: `ci` (everything this machine can run, or one vendor's job of the CI matrix), `lint`,
//! `test` (the README's test command, then the GPU compile sweeps), `examples`, `check-features`,
//! `kernels`, `package`, `candle-cuda`, `fuzz`, `miri`, `bless`, `build --platform`, `bench`,
//! `gpu-bench`, `gpu-check` and `kernel-resources`; each module's documentation says what its task
//! does. Shared helpers (running cargo, probing toolkits) are in `tools`.

#![allow(clippy::print_stdout)]

use clap::{Args, Parser, Subcommand, ValueEnum};

/// The project's automation.
#[derive(Parser, Debug)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand, Debug)]
enum Task {
    /// Everything this machine can run (as `.ci/run` does), or one vendor's job of the CI matrix
    /// (its toolchain required); ends with the time each step took.
    Ci {
        /// Run one vendor's job only.
        #[arg(long, value_enum)]
        vendor: Option<Vendor>,
    },
    /// Formatting check, clippy and rustdoc with warnings denied.
    Lint,
    /// The workspace tests (the README's test command), then the GPU compile sweeps it lists as ignored.
    Test,
    /// The `vllm-ir` crate's examples, as the test build made them.
    Examples,
    /// Each platform's features compile on their own (the CLI with none, `cuda`, `xpu`, `rocm`; the bench with `candle`).
    CheckFeatures,
    /// Every CUDA variant through NVRTC, every HIP variant through hipcc, the OpenCL kernels on the OpenCL device.
    Kernels,
    /// Each published crate ships its licenses and kernel sources; `cargo publish --dry-run` of the workspace.
    Package,
    /// The ops on candle CUDA tensors, linted beside candle's own CUDA build (needs nvcc).
    CandleCuda,
    /// The cargo-fuzz targets (parser; parse, verify, pipeline) on nightly.
    Fuzz {
        /// How long each target runs.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
    },
    /// The tests of the code that holds `unsafe`, under Miri on nightly.
    Miri,
    /// Rewrites the expectations of the golden IR tests (`IR_BLESS=1`) and shows the diff.
    Bless,
    /// Every published crate's public API against the last release `CHANGELOG.md` records: a
    /// breaking change needs a breaking version bump.
    Semver,
    /// The CLI in release with one platform's features, saying what the machine lacks.
    Build {
        /// The platform whose features to build with.
        #[arg(long, value_enum)]
        platform: Platform,
    },
    /// The criterion benchmarks of `vllm-ir-bench`, then `docs/benchmarks.md` and its plots.
    Bench(BenchArgs),
    /// The kernel benchmark on the GPU providers only, written to `docs/benchmarks-gpu.md`.
    GpuBench {
        /// Fewer cases and samples.
        #[arg(long)]
        quick: bool,
    },
    /// The first run on an NVIDIA GPU as one command, with one report (`target/gpu-check/report.md`).
    GpuCheck {
        /// Print the steps and what this machine lacks for them; run nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Registers, shared memory, occupancy and loads in flight of every CUDA and ROCm kernel,
    /// written to `docs/kernel-resources.md`; no GPU.
    KernelResources {
        /// Write the report from the last run's tables (`target/kernel-resources`).
        #[arg(long)]
        render_only: bool,
    },
}

/// A vendor's job of the CI matrix.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vendor {
    /// Lint, features, every test with no backend required, the examples, fuzzing, Miri.
    Cpu,
    /// NVRTC compiles every kernel, the cuda feature builds, the device tests where a GPU is.
    Cuda,
    /// hipcc, feature `rocm` linted and built.
    Rocm,
    /// The OpenCL kernels run.
    Xpu,
}

/// A platform `cargo xtask build` builds the CLI for.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Platform {
    /// No GPU feature.
    Cpu,
    /// Feature `cuda`.
    Cuda,
    /// Feature `rocm`.
    Rocm,
    /// Feature `xpu`.
    Xpu,
}

/// `cargo xtask bench`'s flags.
#[derive(Args, Debug)]
struct BenchArgs {
    /// Fewer cases and samples.
    #[arg(long)]
    quick: bool,
    /// Leave out the candle baseline.
    #[arg(long)]
    no_candle: bool,
    /// Rewrite the report and plots from the last run's results without running anything.
    #[arg(long)]
    report_only: bool,
}

fn main() {
    let cli = Cli::parse();
    if let Err(error) = run(cli.task) {
        eprintln!("xtask: {error:#}");
        std::process::exit(1);
    }
}

fn run(task: Task) -> anyhow::Result<()> {
    match task {
        Task::Ci { vendor: None } => ci::run(),
        Task::Ci { vendor: Some(vendor) } => ci::vendor_job(vendor),
        Task::Lint => lint::run(),
        Task::Test => test::run(),
        Task::Examples => examples::run(),
        Task::CheckFeatures => features::run(),
        Task::Kernels => kernels::run(),
        Task::Package => package::run(),
        Task::CandleCuda => candle_cuda::run(),
        Task::Fuzz { seconds } => fuzz::run(seconds),
        Task::Miri => miri::run(),
        Task::Bless => bless::run(),
        Task::Semver => semver::run(),
        Task::Build { platform } => release::run(platform),
        Task::Bench(args) => bench::bench(bench::BenchOptions {
            quick: args.quick,
            candle: !args.no_candle,
            report_only: args.report_only,
        }),
        Task::GpuBench { quick } => bench::gpu_bench(quick),
        Task::GpuCheck { dry_run } => gpu_check::run(dry_run),
        Task::KernelResources { render_only } => resources::run(render_only),
    }
}

pub(crate) use tools::{cargo, project_root};

mod bench;
mod bless;
mod candle_cuda;
mod ci;
#[cfg(test)]
mod docs;
mod examples;
mod features;
mod fuzz;
mod gpu_check;
#[path = "../../crates/kernels-rocm/hipcc_cache.rs"]
mod hipcc_cache;
mod kernels;
mod lint;
mod miri;
#[cfg(test)]
mod modules;
mod package;
#[cfg(test)]
mod paths;
mod release;
mod resources;
mod semver;
mod test;
#[cfg(test)]
mod tidy;
mod tools;

#[cfg(test)]
mod cli_tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_arguments_are_well_formed_and_parse() {
        Cli::command().debug_assert();
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied()));
        assert!(matches!(parse(&["ci"]).unwrap().task, Task::Ci { vendor: None }));
        assert!(matches!(parse(&["ci", "--vendor", "rocm"]).unwrap().task, Task::Ci { vendor: Some(Vendor::Rocm) }));
        assert!(matches!(parse(&["ci", "--vendor=xpu"]).unwrap().task, Task::Ci { vendor: Some(Vendor::Xpu) }));
        assert!(matches!(parse(&["fuzz"]).unwrap().task, Task::Fuzz { seconds: 60 }));
        assert!(matches!(parse(&["fuzz", "--seconds", "20"]).unwrap().task, Task::Fuzz { seconds: 20 }));
        assert!(matches!(
            parse(&["build", "--platform", "cuda"]).unwrap().task,
            Task::Build { platform: Platform::Cuda }
        ));
        assert!(matches!(
            parse(&["bench", "--quick", "--no-candle"]).unwrap().task,
            Task::Bench(BenchArgs { quick: true, no_candle: true, report_only: false })
        ));
        assert!(matches!(
            parse(&["kernel-resources", "--render-only"]).unwrap().task,
            Task::KernelResources { render_only: true }
        ));
        for bad in
            [&["ci", "--vendor", "tpu"][..], &["build"], &["fuzz", "--seconds", "x"], &["nope"], &["lint", "--x"]]
        {
            assert!(parse(bad).is_err(), "{bad:?} is refused");
        }
    }
}
