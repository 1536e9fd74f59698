//! `vllm-ir opt FILE`: parse, verify, run passes, print the result. Conventions of `mlir-opt`: `-`
//! reads standard input, `-o FILE` writes the result there, standard output holds exactly the
//! final graph (it parses back; or its DOT with `--dot`) and everything else (pass reports,
//! `--print-after-all` dumps, timings) goes to standard error.

use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use ir_graph::Graph;
use ir_passes::Snapshots;

use crate::compile::{PassArgs, compile, read_graph};
use crate::{CommonArgs, build_registry};

/// Options of `vllm-ir opt`.
#[derive(Args, Debug)]
pub(crate) struct OptArgs {
    /// The graph file (text format); `-` reads standard input.
    file: PathBuf,
    /// Write the result to this file instead of standard output.
    #[arg(short = 'o', value_name = "FILE")]
    output: Option<PathBuf>,
    #[command(flatten)]
    passes: PassArgs,
    #[command(flatten)]
    common: CommonArgs,
    /// Print the graph before the first pass and after every pass to standard error (each after a
    /// `// after <pass>` line); standard output still gets only the result.
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
    let registry = build_registry()?;
    args.common.config()?.apply(&registry).context("applying priorities")?;
    let mut graph = read_graph(&args.file)?;
    let snapshots = if args.print_after_all { Snapshots::Keep } else { Snapshots::Skip };
    if args.print_after_all {
        eprint!("// input\n{graph}");
    }
    let report = compile(&mut graph, &registry, &args.passes, args.dump_dir.as_ref(), snapshots, &args.file)?;
    for run in &report.runs {
        if args.timing {
            eprintln!("{}: {} ({:.3} ms)", run.pass, run.report, run.duration.as_secs_f64() * 1e3);
        } else {
            eprintln!("{}: {}", run.pass, run.report);
        }
        if let Some(after) = &run.after {
            eprint!("// after {}\n{after}", run.pass);
        }
    }
    // The graph text is streamed to its destination, not built in memory first: for a large graph it
    // is as big as the input file.
    match &args.output {
        Some(path) => {
            let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
            write_result(&graph, args.dot, BufWriter::new(file)).with_context(|| format!("writing {}", path.display()))
        }
        None => {
            if let Err(error) = write_result(&graph, args.dot, BufWriter::new(std::io::stdout().lock())) {
                crate::exit_on_stdout_error(&error);
            }
            Ok(())
        }
    }
}

/// Writes the graph (its text, or its DOT) and flushes.
fn write_result(graph: &Graph, dot: bool, mut out: impl Write) -> std::io::Result<()> {
    if dot {
        out.write_all(graph.to_dot().as_bytes())?;
    } else {
        write!(out, "{graph}")?;
    }
    out.flush()
}
