//! The pipeline: runs passes by name, verifies after each, times them, and optionally dumps
//! the IR after each pass into a folder with an `index.md`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use ir_graph::{Graph, VerifyError, verify};

use crate::{
    CloneReport, DceReport, FunctionalizeReport, FuseReport, LowerReport, NormQuantReport, PassContext, PassError, dce,
    eliminate_clones, functionalize, fuse_add_rms_norm, fuse_add_rms_norm_exact, fuse_norm_quant, lower,
};

/// A pass the pipeline can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PassName {
    /// `functionalize`.
    Functionalize,
    /// `dce`.
    Dce,
    /// `lower`.
    Lower,
    /// `eliminate-clones`.
    EliminateClones,
    /// `fuse-add-rms-norm`.
    FuseAddRmsNorm,
    /// `fuse-add-rms-norm-exact`: the f32 and f64 pairs only (the standard pipeline's form).
    FuseAddRmsNormExact,
    /// `fuse-norm-quant`.
    FuseNormQuant,
}

impl PassName {
    /// The name used on the command line and in dumps.
    pub fn as_str(self) -> &'static str {
        match self {
            PassName::Functionalize => "functionalize",
            PassName::Dce => "dce",
            PassName::Lower => "lower",
            PassName::EliminateClones => "eliminate-clones",
            PassName::FuseAddRmsNorm => "fuse-add-rms-norm",
            PassName::FuseAddRmsNormExact => "fuse-add-rms-norm-exact",
            PassName::FuseNormQuant => "fuse-norm-quant",
        }
    }
}

impl fmt::Display for PassName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PassName {
    type Err = PassError;

    fn from_str(s: &str) -> Result<PassName, PassError> {
        match s.trim() {
            "functionalize" => Ok(PassName::Functionalize),
            "dce" => Ok(PassName::Dce),
            "lower" => Ok(PassName::Lower),
            "eliminate-clones" => Ok(PassName::EliminateClones),
            "fuse-add-rms-norm" => Ok(PassName::FuseAddRmsNorm),
            "fuse-add-rms-norm-exact" => Ok(PassName::FuseAddRmsNormExact),
            "fuse-norm-quant" => Ok(PassName::FuseNormQuant),
            other => Err(PassError::UnknownPass { name: other.to_owned() }),
        }
    }
}

/// One pass's report.
#[derive(Clone, Debug, PartialEq)]
pub enum PassReport {
    /// From `functionalize`.
    Functionalize(FunctionalizeReport),
    /// From `dce`.
    Dce(DceReport),
    /// From `lower`.
    Lower(LowerReport),
    /// From `eliminate-clones`.
    EliminateClones(CloneReport),
    /// From `fuse-add-rms-norm`.
    FuseAddRmsNorm(FuseReport),
    /// From `fuse-norm-quant`.
    FuseNormQuant(NormQuantReport),
}

impl fmt::Display for PassReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PassReport::Functionalize(r) => r.fmt(f),
            PassReport::Dce(r) => r.fmt(f),
            PassReport::Lower(r) => r.fmt(f),
            PassReport::EliminateClones(r) => r.fmt(f),
            PassReport::FuseAddRmsNorm(r) => r.fmt(f),
            PassReport::FuseNormQuant(r) => r.fmt(f),
        }
    }
}

/// One pass as the pipeline ran it.
#[derive(Clone, Debug)]
pub struct PassRun {
    /// The pass.
    pub pass: PassName,
    /// Wall time, verification excluded.
    pub duration: Duration,
    /// The pass's report.
    pub report: PassReport,
    /// The graph text after the pass, when asked for.
    pub after: Option<String>,
}

/// What a pipeline run did.
#[derive(Clone, Debug, Default)]
pub struct PipelineReport {
    /// Each pass, in order.
    pub runs: Vec<PassRun>,
}

/// A pipeline failure: which pass, and why.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A pass returned an error (the graph is as before that pass).
    #[error("pass `{pass}` failed: {source}")]
    Pass {
        /// The pass.
        pass: PassName,
        /// Its error.
        source: PassError,
    },
    /// The graph does not verify after a pass (a bug in that pass), or before the first.
    #[error("the graph does not verify after `{pass}`")]
    Verify {
        /// The pass (`input` before any pass ran).
        pass: String,
        /// The diagnostics.
        source: Box<VerifyError>,
    },
    /// Writing the dump failed.
    #[error("writing {path}: {message}")]
    Dump {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        message: String,
    },
}

/// Whether the pipeline keeps the graph text after each pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Snapshots {
    /// Keep it (for `--print-after-all`).
    Keep,
    /// Do not print after each pass.
    Skip,
}

/// Passes in order.
///
/// ```
/// use ir_passes::{PassContext, Pipeline, Snapshots};
///
/// let registry = ir_core::Registry::with_builtin_ops();
/// let mut graph = ir_graph::parse(
///     "graph g(%x: f32[2,8]) {
///        %c = clone(%x) : f32[2,8]
///        %y = rms_norm(%c, none, 1e-6, none) : f32[2,8]
///        output(%y)
///      }",
/// )?;
/// let pipeline = Pipeline::from_names("lower,eliminate-clones,dce")?;
/// let report = pipeline.run(&mut graph, &PassContext::new(&registry), None, Snapshots::Skip)?;
/// assert_eq!(report.runs.len(), 3);
/// // The copy fed a functional op only: removed.
/// assert!(!graph.to_string().contains("clone("), "{graph}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// The passes.
    pub passes: Vec<PassName>,
}

impl Pipeline {
    /// The standard pipeline: functionalize → fuse-add-rms-norm-exact → fuse-norm-quant → dce → lower →
    /// eliminate-clones → dce. Its results are bit-identical to the input graph's with the same
    /// providers (the exact form of the add + norm fusion leaves 16-bit pairs unfused).
    pub fn standard() -> Pipeline {
        Pipeline {
            passes: vec![
                PassName::Functionalize,
                PassName::FuseAddRmsNormExact,
                PassName::FuseNormQuant,
                PassName::Dce,
                PassName::Lower,
                PassName::EliminateClones,
                PassName::Dce,
            ],
        }
    }

    /// A pipeline from a comma-separated list of pass names.
    pub fn from_names(list: &str) -> Result<Pipeline, PassError> {
        let passes = list.split(',').filter(|s| !s.trim().is_empty()).map(str::parse).collect::<Result<_, _>>()?;
        Ok(Pipeline { passes })
    }

    /// Runs the passes on `graph`, verifying before the first and after each; with `dump_dir`, writes
    /// `00-input.ir`, `01-<pass>.ir`, … (the failing state too) and `index.md`.
    pub fn run(
        &self,
        graph: &mut Graph,
        cx: &PassContext<'_>,
        dump_dir: Option<&Path>,
        snapshots: Snapshots,
    ) -> Result<PipelineReport, PipelineError> {
        let mut report = PipelineReport::default();
        let mut index = vec!["| # | pass | duration | report | file |".to_owned(), "|---|---|---|---|---|".to_owned()];
        if let Some(dir) = dump_dir {
            std::fs::create_dir_all(dir).map_err(|e| dump_error(dir, e))?;
            write_dump(dir, "00-input.ir", &graph.to_string())?;
            index.push("| 0 | input | | | 00-input.ir |".to_owned());
        }
        verify(graph, cx.registry)
            .map_err(|e| PipelineError::Verify { pass: "input".to_owned(), source: Box::new(e) })?;
        for (i, &pass) in self.passes.iter().enumerate() {
            let started = Instant::now();
            let result = match pass {
                PassName::Functionalize => functionalize(graph, cx).map(PassReport::Functionalize),
                PassName::Dce => dce(graph, cx).map(PassReport::Dce),
                PassName::Lower => lower(graph, cx).map(PassReport::Lower),
                PassName::EliminateClones => eliminate_clones(graph, cx).map(PassReport::EliminateClones),
                PassName::FuseAddRmsNorm => fuse_add_rms_norm(graph, cx).map(PassReport::FuseAddRmsNorm),
                PassName::FuseAddRmsNormExact => fuse_add_rms_norm_exact(graph, cx).map(PassReport::FuseAddRmsNorm),
                PassName::FuseNormQuant => fuse_norm_quant(graph, cx).map(PassReport::FuseNormQuant),
            };
            let duration = started.elapsed();
            let file = format!("{:02}-{pass}.ir", i + 1);
            let pass_report = match result {
                Ok(r) => r,
                Err(source) => {
                    if let Some(dir) = dump_dir {
                        write_dump(dir, &file, &graph.to_string())?;
                        index.push(format!("| {} | {pass} | {duration:?} | failed: {source} | {file} |", i + 1));
                        write_dump(dir, "index.md", &(index.join("\n") + "\n"))?;
                    }
                    return Err(PipelineError::Pass { pass, source });
                }
            };
            tracing::info!(target: "ir_passes::pipeline", %pass, ?duration, report = %pass_report, "pass done");
            if let Some(dir) = dump_dir {
                write_dump(dir, &file, &graph.to_string())?;
                index.push(format!("| {} | {pass} | {duration:?} | {pass_report} | {file} |", i + 1));
            }
            let verified = verify(graph, cx.registry);
            let after = (snapshots == Snapshots::Keep).then(|| graph.to_string());
            report.runs.push(PassRun { pass, duration, report: pass_report, after });
            if let Err(e) = verified {
                if let Some(dir) = dump_dir {
                    write_dump(dir, "index.md", &(index.join("\n") + "\n"))?;
                }
                return Err(PipelineError::Verify { pass: pass.to_string(), source: Box::new(e) });
            }
        }
        if let Some(dir) = dump_dir {
            write_dump(dir, "index.md", &(index.join("\n") + "\n"))?;
        }
        Ok(report)
    }
}

fn write_dump(dir: &Path, file: &str, text: &str) -> Result<(), PipelineError> {
    let path = dir.join(file);
    std::fs::write(&path, text).map_err(|e| dump_error(&path, e))
}

fn dump_error(path: &Path, error: std::io::Error) -> PipelineError {
    PipelineError::Dump { path: path.to_path_buf(), message: error.to_string() }
}
