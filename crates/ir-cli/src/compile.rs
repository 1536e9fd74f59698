//! Shared by `opt` and `run`: reading a graph file and running a pass pipeline on it.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use ir_core::Registry;
use ir_graph::{Graph, parse};
use ir_passes::{CloneElimination, PassContext, Pipeline, PipelineReport, Snapshots};

/// Pass selection flags.
#[derive(Args, Debug, Clone)]
pub(crate) struct PassArgs {
    /// Comma-separated passes (functionalize, dce, lower, eliminate-clones); default: the standard pipeline.
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

pub(crate) fn read_graph(path: &Path) -> anyhow::Result<Graph> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    match parse(&text) {
        Ok(graph) => Ok(graph),
        Err(e) => bail!("{}:{e}", path.display()),
    }
}

pub(crate) fn compile(
    graph: &mut Graph,
    registry: &Registry,
    passes: &PassArgs,
    dump_dir: Option<&PathBuf>,
    snapshots: Snapshots,
) -> anyhow::Result<PipelineReport> {
    let pipeline = passes.pipeline()?;
    let report = pipeline.run(graph, &passes.context(registry), dump_dir.map(PathBuf::as_path), snapshots)?;
    Ok(report)
}
