//! `vllm-ir run FILE`: interpret a graph before and after the passes and compare.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use ir_core::{DType, Tensor, allclose, bit_eq};
use ir_graph::{Graph, InterpOptions, Interpretation, interpret};
use ir_passes::Snapshots;
use safetensors::{Dtype, SafeTensors};

use crate::compile::{PassArgs, compile, read_graph};
use crate::{CommonArgs, build_registry};

/// Options of `vllm-ir run`.
#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// The graph file (text format); `-` reads standard input.
    file: PathBuf,
    #[command(flatten)]
    passes: PassArgs,
    #[command(flatten)]
    common: CommonArgs,
    /// Seed of the N(0, 1) inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Read the graph's inputs by name from this safetensors file instead.
    #[arg(long, value_name = "FILE")]
    inputs: Option<PathBuf>,
    /// Write the outputs (`out0`, `out1`, …) of the optimized run to this safetensors file.
    #[arg(long, value_name = "FILE")]
    save_outputs: Option<PathBuf>,
}

pub(crate) fn run(args: &RunArgs) -> anyhow::Result<()> {
    let registry = build_registry()?;
    args.common.config()?.apply(&registry).context("applying priorities")?;
    let original = read_graph(&args.file)?;
    let mut optimized = original.clone();
    let report = compile(&mut optimized, &registry, &args.passes, None, Snapshots::Skip, &args.file)?;
    for run in &report.runs {
        eprintln!("{}: {}", run.pass, run.report);
    }
    let file_inputs = match &args.inputs {
        Some(path) => Some(std::fs::read(path).with_context(|| format!("reading {}", path.display()))?),
        None => None,
    };
    let inputs = |graph: &Graph| -> anyhow::Result<Vec<(String, Tensor)>> {
        match &file_inputs {
            Some(bytes) => inputs_from_safetensors(graph, bytes, args.inputs.as_deref().unwrap_or(Path::new(""))),
            None => random_inputs(graph, args.seed),
        }
    };
    let before = interpret(&original, &registry, inputs(&original)?, InterpOptions::checked())
        .context("running the input graph")?;
    let after = interpret(&optimized, &registry, inputs(&optimized)?, InterpOptions::checked())
        .context("running the optimized graph")?;
    report_run("before passes", &before);
    report_run("after passes", &after);
    if let Some(path) = &args.save_outputs {
        save_outputs(path, &after.outputs)?;
        outln!("outputs saved to {}", path.display());
    }
    compare(&before, &after)
}

fn report_run(label: &str, run: &Interpretation) {
    outln!("{label}:");
    for (i, out) in run.outputs.iter().enumerate() {
        let values = out.to_f64_vec().unwrap_or_default();
        let checksum: f64 = values.iter().sum();
        let mean_abs = values.iter().map(|v| v.abs()).sum::<f64>() / values.len().max(1) as f64;
        outln!("  out{i}: {} checksum {checksum:.6} mean|x| {mean_abs:.6}", out.meta());
    }
    let selections: Vec<String> = run.stats.providers.iter().map(|(_, op, p)| format!("{op}={p}")).collect();
    outln!("  providers: [{}]", selections.join(", "));
    let stats = &run.stats;
    outln!(
        "  bytes allocated {}, peak live bytes {}, clones executed {}, defensive copies {}",
        stats.bytes_allocated,
        stats.peak_live_bytes,
        stats.clones_executed,
        stats.defensive_copies
    );
}

fn compare(before: &Interpretation, after: &Interpretation) -> anyhow::Result<()> {
    let identical = before.outputs.len() == after.outputs.len()
        && before.outputs.iter().zip(&after.outputs).all(|(a, b)| bit_eq(a, b));
    if identical {
        outln!("outputs bit-identical: yes");
        return Ok(());
    }
    outln!("outputs bit-identical: no");
    for (i, (a, b)) in before.outputs.iter().zip(&after.outputs).enumerate() {
        let tolerance = ir_core::op::global_tolerance(a.dtype());
        if let Err(e) = allclose(b, a, tolerance.atol, tolerance.rtol) {
            bail!("out{i} differs beyond the {} tolerance: {e}", a.dtype());
        }
    }
    outln!("outputs within tolerance: yes");
    Ok(())
}

fn random_inputs(graph: &Graph, seed: u64) -> anyhow::Result<Vec<(String, Tensor)>> {
    graph
        .inputs()
        .into_iter()
        .enumerate()
        .map(|(i, (_, value, name, _))| {
            let tensor = Tensor::randn(graph.meta(value), seed.wrapping_mul(1000).wrapping_add(i as u64))?;
            Ok((name.to_owned(), tensor))
        })
        .collect()
}

fn inputs_from_safetensors(graph: &Graph, bytes: &[u8], path: &Path) -> anyhow::Result<Vec<(String, Tensor)>> {
    let file = SafeTensors::deserialize(bytes).with_context(|| format!("reading {} as safetensors", path.display()))?;
    graph
        .inputs()
        .into_iter()
        .map(|(_, value, name, _)| {
            let meta = graph.meta(value);
            let view = file.tensor(name).with_context(|| format!("{} has no tensor `{name}`", path.display()))?;
            let Some(dtype) = dtype_from_safetensors(view.dtype()) else {
                bail!(
                    "tensor `{name}` has dtype {:?}; expected one of F32, F16, BF16, F64, F8_E4M3, F8_E5M2, I8, I64",
                    view.dtype()
                );
            };
            if dtype != meta.dtype || view.shape() != meta.shape() {
                bail!("tensor `{name}` is {dtype}{:?} but the graph declares {meta}", view.shape());
            }
            let compact = tensor_from_bytes(dtype, view.shape(), view.data())?;
            let mut placed = Tensor::randn(meta, 0)?;
            placed.copy_from(&compact)?;
            Ok((name.to_owned(), placed))
        })
        .collect()
}

/// The dtype of a safetensors dtype, if this crate has it. safetensors' `F8_E4M3` is the OCP `E4M3FN`
/// format (the one PyTorch writes for `float8_e4m3fn`).
fn dtype_from_safetensors(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::F8_E4M3 => DType::F8E4M3FN,
        Dtype::F8_E5M2 => DType::F8E5M2,
        Dtype::I8 => DType::I8,
        Dtype::I64 => DType::I64,
        _ => return None,
    })
}

fn dtype_to_safetensors(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F64 => Dtype::F64,
        DType::F8E4M3FN => Dtype::F8_E4M3,
        DType::F8E5M2 => Dtype::F8_E5M2,
        DType::I8 => Dtype::I8,
        DType::I64 => Dtype::I64,
    }
}

/// A compact tensor holding these little-endian bytes as they are (NaN payloads included).
fn tensor_from_bytes(dtype: DType, shape: &[usize], data: &[u8]) -> anyhow::Result<Tensor> {
    let mut tensor = Tensor::zeros(dtype, shape)?;
    let buffer = tensor.cpu_buffer_mut()?.context("a fresh host tensor")?.bytes_mut();
    if data.len() != buffer.len() {
        bail!("{} bytes do not hold {} elements of {dtype}", data.len(), tensor.numel());
    }
    buffer.copy_from_slice(data);
    Ok(tensor)
}

fn save_outputs(path: &Path, outputs: &[Tensor]) -> anyhow::Result<()> {
    let mut buffers: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (i, out) in outputs.iter().enumerate() {
        let compact = out.to_cpu()?.contiguous()?;
        let bytes = compact.cpu_buffer().context("a host copy")?.bytes().to_vec();
        let dtype = dtype_to_safetensors(out.dtype());
        buffers.push((format!("out{i}"), dtype, out.shape().to_vec(), bytes));
    }
    let views: HashMap<String, safetensors::tensor::TensorView<'_>> = buffers
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            Ok((name.clone(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)?))
        })
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    let serialized = safetensors::serialize(views, None)?;
    std::fs::write(path, serialized).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
