//! Shared by `opt` and `run`: reading a graph file and running a pass pipeline on it.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use ir_core::Registry;
use ir_graph::{Graph, parse};
use ir_passes::{CloneElimination, PassContext, Pipeline, PipelineError, PipelineReport, Snapshots};

/// Pass selection flags.
#[derive(Args, Debug, Clone)]
pub(crate) struct PassArgs {
    /// Comma-separated pass names (`vllm-ir info` lists them; an unknown name is an error naming the
    /// known ones); default: the standard pipeline.
    #[arg(long, value_name = "LIST")]
    pub(crate) passes: Option<String>,
    /// Clone elimination variant.
    #[arg(long, value_enum, default_value_t = Variant::AliasAware)]
    pub(crate) clone_elimination: Variant,
}

/// `--clone-elimination`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum Variant {
    /// Storage-root aware (sound; the default).
    AliasAware,
    /// vLLM's rules (ignores aliasing through views).
    Unsafe,
}

impl PassArgs {
    pub(crate) fn pipeline(&self) -> anyhow::Result<Pipeline> {
        match &self.passes {
            None => Ok(Pipeline::standard()),
            Some(list) => Pipeline::from_names(list).context("reading --passes"),
        }
    }

    pub(crate) fn context<'r>(&self, registry: &'r Registry) -> PassContext<'r> {
        let variant = match self.clone_elimination {
            Variant::AliasAware => CloneElimination::AliasAware,
            Variant::Unsafe => CloneElimination::Unsafe,
        };
        PassContext::new(registry).with_clone_elimination(variant)
    }
}

/// An error at a position of an input file, printed compiler-style: `FILE:LINE:COL: error: MESSAGE`.
#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}:{column}: error: {message}")]
pub(crate) struct LocatedError {
    pub(crate) file: String,
    pub(crate) line: u32,
    pub(crate) column: u32,
    pub(crate) message: String,
}

/// How a graph file is named in messages: its path, or `<stdin>` for `-`.
pub(crate) fn display_name(path: &Path) -> String {
    if path == Path::new("-") { "<stdin>".to_owned() } else { path.display().to_string() }
}

/// Reads and parses a graph file; `-` reads standard input.
pub(crate) fn read_graph(path: &Path) -> anyhow::Result<Graph> {
    let text = if path == Path::new("-") {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).context("reading standard input")?;
        text
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
    };
    parse(&text).map_err(|e| {
        let message = format!("expected {}, found {}", e.expected, e.found);
        anyhow::Error::new(LocatedError { file: display_name(path), line: e.line, column: e.column, message })
    })
}

/// Runs the pipeline; when the input graph does not verify, the error is located at the first
/// diagnostic that has a position (the others follow on the same line).
pub(crate) fn compile(
    graph: &mut Graph,
    registry: &Registry,
    passes: &PassArgs,
    dump_dir: Option<&PathBuf>,
    snapshots: Snapshots,
    file: &Path,
) -> anyhow::Result<PipelineReport> {
    let pipeline = passes.pipeline()?;
    match pipeline.run(graph, &passes.context(registry), dump_dir.map(PathBuf::as_path), snapshots) {
        Ok(report) => Ok(report),
        Err(PipelineError::Verify { pass, source }) if pass == "input" => {
            let located = source.diagnostics.iter().position(|d| d.location.is_some());
            let Some(first) = located else {
                bail!("{}: the graph does not verify: {}", display_name(file), source.summary())
            };
            let diagnostic = &source.diagnostics[first];
            let (line, column) = diagnostic.location.expect("found with a location");
            let mut message = diagnostic.problem.to_string();
            if !diagnostic.statement.is_empty() {
                message.push_str(&format!(" (in `{}`)", diagnostic.statement));
            }
            for (i, other) in source.diagnostics.iter().enumerate() {
                if i != first {
                    message.push_str(&format!("; {other}"));
                }
            }
            Err(anyhow::Error::new(LocatedError { file: display_name(file), line, column, message }))
        }
        Err(e) => Err(e).with_context(|| format!("optimizing {}", display_name(file))),
    }
}
