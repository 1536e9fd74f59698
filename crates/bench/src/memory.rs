//! The memory study: the demo's decoder traced, interpreted without passes and after the standard
//! pipeline, with the interpreter's statistics. Deterministic, so it is computed, not timed.

use ir_core::DType;
use ir_core::Registry;
use ir_core::bit_eq;
use ir_graph::{InterpOptions, InterpStats, interpret};
use ir_passes::{PassContext, Pipeline, Snapshots};
use serde::Serialize;

use crate::BenchError;
use crate::decoder::Decoder;

/// The layer counts of the study.
pub const LAYERS: [usize; 3] = [1, 8, 32];
/// The activation shape of the study (a decode batch of the demo's size).
pub const SHAPE: (usize, usize) = (64, 4096);

/// The statistics of one run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RunStats {
    /// Bytes of storages the run created.
    pub bytes_allocated: u64,
    /// Peak bytes referenced by live values.
    pub peak_live_bytes: u64,
    /// `clone` / `contiguous` nodes run.
    pub clones_executed: usize,
    /// Copies the call path made to protect values still read.
    pub defensive_copies: usize,
}

impl RunStats {
    fn from_stats(stats: &InterpStats) -> RunStats {
        RunStats {
            bytes_allocated: stats.bytes_allocated,
            peak_live_bytes: stats.peak_live_bytes,
            clones_executed: stats.clones_executed,
            defensive_copies: stats.defensive_copies,
        }
    }

    /// Every copy the run made.
    pub fn copies(&self) -> usize {
        self.clones_executed + self.defensive_copies
    }
}

/// One decoder size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryRow {
    /// Fused layers (L).
    pub layers: usize,
    /// The functional trace (every fused norm a functional call) interpreted without passes: an
    /// in-place provider copies x and the residual of each fused norm.
    pub uncompiled: RunStats,
    /// The donating trace (`maybe_inplace`) interpreted without passes: the interpreter proves
    /// nothing, so it copies each activation that is still readable (the non-donated graph input).
    pub uncompiled_donating: RunStats,
    /// The donating trace after the standard pipeline.
    pub compiled: RunStats,
    /// What the compiled run must allocate: the first `rms_norm`'s output and the L `scale`s.
    pub compiled_floor_bytes: u64,
    /// Bytes the pipeline saves.
    pub saved_bytes: u64,
    /// Whether the three runs returned bit-identical outputs.
    pub bit_identical: bool,
}

/// The whole study.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryStudy {
    /// Rows (T).
    pub tokens: usize,
    /// Hidden size (H).
    pub hidden: usize,
    /// The activations' dtype.
    pub dtype: String,
    /// T·H·s.
    pub activation_bytes: u64,
    /// The provider the fused norms ran.
    pub fused_provider: String,
    /// One row per L.
    pub rows: Vec<MemoryRow>,
}

/// Runs the study on `registry` (its installed priorities choose the providers).
pub fn study(registry: &Registry, layers: &[usize], tokens: usize, hidden: usize) -> Result<MemoryStudy, BenchError> {
    let dtype = DType::BF16;
    let mut rows = Vec::new();
    let mut fused_provider = String::new();
    for &l in layers {
        let decoder = Decoder::new(l, tokens, hidden, dtype)?;
        let functional = decoder.trace(registry, false)?;
        let traced = decoder.trace(registry, true)?;
        let inputs = decoder.graph_inputs(&traced, 42)?;

        let uncompiled = interpret(&functional.graph, registry, clone_inputs(&inputs)?, InterpOptions::checked())?;
        let donating = interpret(&traced.graph, registry, clone_inputs(&inputs)?, InterpOptions::checked())?;
        let mut graph = traced.graph.clone();
        Pipeline::standard().run(&mut graph, &PassContext::new(registry), None, Snapshots::Skip)?;
        let compiled = interpret(&graph, registry, inputs, InterpOptions::checked())?;

        if let Some((_, _, provider)) = compiled.stats.providers.iter().find(|(_, op, _)| op == "fused_add_rms_norm") {
            fused_provider = (*provider).to_owned();
        }
        let uncompiled_stats = RunStats::from_stats(&uncompiled.stats);
        let compiled_stats = RunStats::from_stats(&compiled.stats);
        let same = |a: &[ir_core::Tensor], b: &[ir_core::Tensor]| a.iter().zip(b).all(|(a, b)| bit_eq(a, b));
        let bit_identical = same(&uncompiled.outputs, &compiled.outputs) && same(&donating.outputs, &compiled.outputs);
        rows.push(MemoryRow {
            layers: l,
            saved_bytes: uncompiled_stats.bytes_allocated.saturating_sub(compiled_stats.bytes_allocated),
            compiled_floor_bytes: (1 + l as u64) * decoder.activation_bytes(),
            uncompiled: uncompiled_stats,
            uncompiled_donating: RunStats::from_stats(&donating.stats),
            compiled: compiled_stats,
            bit_identical,
        });
    }
    Ok(MemoryStudy {
        tokens,
        hidden,
        dtype: dtype.to_string(),
        activation_bytes: (tokens * hidden * dtype.size_in_bytes()) as u64,
        fused_provider,
        rows,
    })
}

fn clone_inputs(inputs: &[(String, ir_core::Tensor)]) -> Result<Vec<(String, ir_core::Tensor)>, BenchError> {
    inputs.iter().map(|(name, t)| Ok((name.clone(), t.deep_clone()?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compiled_decoder_allocates_only_the_norm_and_scale_outputs() {
        let registry = ir_ops::registry();
        kernels_cpu::register(&registry).unwrap();
        ir_core::PriorityConfig::platform_default(ir_core::Platform::Cpu).apply(&registry).unwrap();
        let study = study(&registry, &[1, 4], 4, 64).unwrap();
        assert_eq!(study.fused_provider, "cpu");
        assert_eq!(study.activation_bytes, 4 * 64 * 2);
        for row in &study.rows {
            assert!(row.bit_identical, "L={}", row.layers);
            assert_eq!(row.compiled.copies(), 0, "L={}", row.layers);
            assert_eq!(row.compiled.bytes_allocated, row.compiled_floor_bytes, "L={}", row.layers);
            let copies = 2 * row.layers as u64 * study.activation_bytes;
            assert_eq!(row.uncompiled.bytes_allocated, row.compiled_floor_bytes + copies, "L={}", row.layers);
            assert_eq!(row.uncompiled.copies(), 2 * row.layers, "L={}", row.layers);
            assert_eq!(row.saved_bytes, copies);
        }
    }
}
