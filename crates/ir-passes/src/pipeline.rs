//! The pipeline: runs passes by name, verifies after each, times them, and optionally dumps
//! the IR after each pass into a folder with an `index.md`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use ir_graph::{Graph, VerifyError, verify};

use crate::{
    CloneReport, DceReport, FunctionalizeReport, FusionReport, LowerReport, PassContext, PassError, dce,
    eliminate_clones, functionalize, fuse_add_rms_norm, fuse_add_rms_norm_exact, fuse_norm_quant, fuse_row_programs,
    fuse_row_programs_exact, lower,
};

/// A pass the pipeline can run (a later release may add passes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
    /// `fuse-row-programs`.
    FuseRowPrograms,
    /// `fuse-row-programs-exact`: the chains whose results keep their bits (the standard
    /// pipeline's form).
    FuseRowProgramsExact,
}

/// One pass of the table: its name, what it does, and how the pipeline runs it.
#[derive(Clone, Copy)]
pub struct PassDef {
    /// The pass.
    pub pass: PassName,
    /// The name used on the command line, in `--passes`, in dumps and in reports.
    pub name: &'static str,
    /// One line on what it does.
    pub summary: &'static str,
    run: fn(&mut Graph, &PassContext<'_>) -> Result<PassReport, PassError>,
}

impl fmt::Debug for PassDef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PassDef").field("name", &self.name).finish()
    }
}

/// Every pass the pipeline can run: the one place a pass is named (parsing `--passes`, the
/// unknown-pass error, dump file names and running all read it).
pub const PASSES: [PassDef; 9] = [
    PassDef {
        pass: PassName::Functionalize,
        name: "functionalize",
        summary: "maybe_inplace calls become functional ones where the donated values are dead",
        run: |graph, cx| functionalize(graph, cx).map(PassReport::Functionalize),
    },
    PassDef {
        pass: PassName::Dce,
        name: "dce",
        summary: "removes nodes whose results nothing reads and that write nothing",
        run: |graph, cx| dce(graph, cx).map(PassReport::Dce),
    },
    PassDef {
        pass: PassName::Lower,
        name: "lower",
        summary: "each op call becomes its chosen provider, with a copy before each in-place kernel's activations",
        run: |graph, cx| lower(graph, cx).map(PassReport::Lower),
    },
    PassDef {
        pass: PassName::EliminateClones,
        name: "eliminate-clones",
        summary: "removes the copies nothing needs",
        run: |graph, cx| eliminate_clones(graph, cx).map(PassReport::EliminateClones),
    },
    PassDef {
        pass: PassName::FuseAddRmsNorm,
        name: "fuse-add-rms-norm",
        summary: "an add feeding rms_norm becomes fused_add_rms_norm",
        run: |graph, cx| fuse_add_rms_norm(graph, cx).map(PassReport::Fusion),
    },
    PassDef {
        pass: PassName::FuseAddRmsNormExact,
        name: "fuse-add-rms-norm-exact",
        summary: "fuse-add-rms-norm where results keep their bits (f32 and f64, the same provider)",
        run: |graph, cx| fuse_add_rms_norm_exact(graph, cx).map(PassReport::Fusion),
    },
    PassDef {
        pass: PassName::FuseNormQuant,
        name: "fuse-norm-quant",
        summary: "a norm feeding an fp8 quantization becomes the fused norm + quantization op",
        run: |graph, cx| fuse_norm_quant(graph, cx).map(PassReport::Fusion),
    },
    PassDef {
        pass: PassName::FuseRowPrograms,
        name: "fuse-row-programs",
        summary: "chains one generated row-program op computes (add + layer_norm, Gemma's sandwich norms, silu_and_mul + per-token fp8 quantization) become that op",
        run: |graph, cx| fuse_row_programs(graph, cx).map(PassReport::Fusion),
    },
    PassDef {
        pass: PassName::FuseRowProgramsExact,
        name: "fuse-row-programs-exact",
        summary: "fuse-row-programs where results keep their bits (the chain's provider, 16-bit sums rounded)",
        run: |graph, cx| fuse_row_programs_exact(graph, cx).map(PassReport::Fusion),
    },
];

/// The names of every pass, comma-separated (for errors and help).
pub fn known_passes() -> String {
    PASSES.iter().map(|def| def.name).collect::<Vec<_>>().join(", ")
}

impl PassName {
    /// The pass's entry in [`PASSES`].
    pub fn def(self) -> &'static PassDef {
        // The table lists the variants in declaration order (checked by a test).
        &PASSES[self as usize]
    }

    /// The name used on the command line and in dumps.
    pub fn as_str(self) -> &'static str {
        self.def().name
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
        let name = s.trim();
        PASSES
            .iter()
            .find(|def| def.name == name)
            .map(|def| def.pass)
            .ok_or_else(|| PassError::UnknownPass { name: name.to_owned() })
    }
}

/// One pass's report.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum PassReport {
    /// From `functionalize`.
    Functionalize(FunctionalizeReport),
    /// From `dce`.
    Dce(DceReport),
    /// From `lower`.
    Lower(LowerReport),
    /// From `eliminate-clones`.
    EliminateClones(CloneReport),
    /// From a fusion pass (`fuse-add-rms-norm`, `fuse-add-rms-norm-exact`, `fuse-norm-quant`,
    /// `fuse-row-programs`, `fuse-row-programs-exact`).
    Fusion(FusionReport),
}

impl fmt::Display for PassReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PassReport::Functionalize(r) => r.fmt(f),
            PassReport::Dce(r) => r.fmt(f),
            PassReport::Lower(r) => r.fmt(f),
            PassReport::EliminateClones(r) => r.fmt(f),
            PassReport::Fusion(r) => r.fmt(f),
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
#[non_exhaustive]
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
/// let registry = ir_ops::registry();
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
    /// The standard pipeline: functionalize → fuse-add-rms-norm-exact → fuse-row-programs-exact →
    /// fuse-norm-quant → dce → lower → eliminate-clones → dce. Its results are bit-identical to the
    /// input graph's with the same providers (the exact forms of the fusions fuse only what keeps
    /// its bits).
    pub fn standard() -> Pipeline {
        Pipeline {
            passes: vec![
                PassName::Functionalize,
                PassName::FuseAddRmsNormExact,
                PassName::FuseRowProgramsExact,
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
            let result = (pass.def().run)(graph, cx);
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

impl fmt::Display for Pipeline {
    /// The pass names, comma-separated (what [`Pipeline::from_names`] reads back).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pass) in self.passes.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(pass.as_str())?;
        }
        Ok(())
    }
}

fn write_dump(dir: &Path, file: &str, text: &str) -> Result<(), PipelineError> {
    let path = dir.join(file);
    std::fs::write(&path, text).map_err(|e| dump_error(&path, e))
}

fn dump_error(path: &Path, error: std::io::Error) -> PipelineError {
    PipelineError::Dump { path: path.to_path_buf(), message: error.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pass_has_one_entry_whose_name_parses_back() {
        let all = [
            PassName::Functionalize,
            PassName::Dce,
            PassName::Lower,
            PassName::EliminateClones,
            PassName::FuseAddRmsNorm,
            PassName::FuseAddRmsNormExact,
            PassName::FuseNormQuant,
            PassName::FuseRowPrograms,
            PassName::FuseRowProgramsExact,
        ];
        assert_eq!(all.len(), PASSES.len());
        for (index, def) in PASSES.iter().enumerate() {
            assert_eq!(def.pass as usize, index, "{} is out of declaration order", def.name);
        }
        for pass in all {
            assert_eq!(PASSES.iter().filter(|def| def.pass == pass).count(), 1, "{pass:?}");
            assert_eq!(pass.def().pass, pass);
            assert_eq!(pass.as_str().parse::<PassName>().unwrap(), pass);
        }
        let standard = Pipeline::standard();
        assert_eq!(Pipeline::from_names(&standard.to_string()).unwrap(), standard);
        let error = "fuse-everything".parse::<PassName>().unwrap_err().to_string();
        assert!(error.contains("fuse-everything") && error.contains(&known_passes()), "{error}");
    }
}
