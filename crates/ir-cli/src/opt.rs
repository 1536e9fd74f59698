//! `vllm-ir opt FILE`: parse, verify, run passes, print the result.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use ir_passes::Snapshots;

use crate::compile::{PassArgs, compile, read_graph};
use crate::{CommonArgs, build_registry};

/// Options of `vllm-ir opt`.
#[derive(Args, Debug)]
pub(crate) struct OptArgs {
    /// The graph file (text format).
    file: PathBuf,
    #[command(flatten)]
    passes: PassArgs,
    #[command(flatten)]
    common: CommonArgs,
    /// Print the graph after every pass (to stdout, each after a `// after <pass>` line).
    #[arg(long)]
    print_after_all: bool,
    /// Write `00-input.ir`, `01-<pass>.ir`, … and `index.md` into this folder.
    #[arg(long, value_name = "DIR")]
    dump_dir: Option<PathBuf>,
    /// Print each pass's duration on stderr.
    #[arg(long)]
    timing: bool,
    /// Print the result as Graphviz DOT instead of IR text.
    #[arg(long)]
    dot: bool,
}

pub(crate) fn run(args: &OptArgs) -> anyhow::Result<()> {
    let registry = build_registry();
    args.common.config()?.apply(&registry).context("applying priorities")?;
    let mut graph = read_graph(&args.file)?;
    let snapshots = if args.print_after_all { Snapshots::Keep } else { Snapshots::Skip };
    if args.print_after_all {
        print!("// input\n{graph}");
    }
    let report = compile(&mut graph, &registry, &args.passes, args.dump_dir.as_ref(), snapshots)
        .with_context(|| format!("optimizing {}", args.file.display()))?;
    for run in &report.runs {
        if args.timing {
            eprintln!("{}: {} ({:.3} ms)", run.pass, run.report, run.duration.as_secs_f64() * 1e3);
        } else {
            eprintln!("{}: {}", run.pass, run.report);
        }
        if let Some(after) = &run.after {
            print!("// after {}\n{after}", run.pass);
        }
    }
    if args.print_after_all {
        return Ok(());
    }
    if args.dot {
        print!("{}", graph.to_dot());
    } else {
        print!("{graph}");
    }
    Ok(())
}
