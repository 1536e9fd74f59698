//! `vllm-ir demo`: a toy decoder of `RmsNorm` layers whose normalized outputs are quantized to fp8
//! (the input of an fp8 GEMM), run with donated activations and functionally, then traced and
//! compiled (where the norm and its quantization fuse).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ir_core::op::InputSpec;
use ir_core::op::rms_norm::RMS_NORM;
use ir_core::storage::cpu_bytes_allocated;
use ir_core::{Builtin, BuiltinArg, DType, EagerContext, ExecutionContext, Registry, SelectionRecord, Tensor, bit_eq};
use ir_graph::{InterpOptions, Interpretation, Tracer, interpret};
use ir_passes::{PassContext, PassReport, Pipeline, Snapshots};
use layers::{QuantFp8, QuantScale, RmsNorm};

use crate::{CommonArgs, build_registry};

/// Options of `vllm-ir demo`.
#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Number of decoder steps (each: fused add + norm, fp8 quantization of its output, then a
    /// stand-in for the fp8 GEMM: dequantization and a scale).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Number of tokens (rows).
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// Seed of the random inputs and weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

struct Model {
    norms: Vec<RmsNorm>,
    /// The fp8 quantization of each layer's normalized output (a static, calibrated scale).
    quants: Vec<QuantFp8>,
    final_norm: RmsNorm,
}

/// The static scale of the layers' fp8 quantization: normalized values up to 4 in magnitude fit.
const QUANT_SCALE: f64 = 4.0 / 448.0;

struct RunReport {
    outputs: (Tensor, Tensor),
    elapsed: Duration,
    bytes_allocated: u64,
    record: SelectionRecord,
}

pub(crate) fn run(args: &DemoArgs) -> anyhow::Result<()> {
    if args.layers == 0 || args.tokens == 0 || args.hidden == 0 {
        bail!("--layers, --tokens and --hidden must be at least 1");
    }
    let registry = build_registry();
    let config = args.common.config()?;
    let resolved = config.apply(&registry).context("applying priorities")?;
    let model = build_model(args)?;
    println!(
        "demo: {} decoder steps, {} tokens x hidden {}, bf16, platform {}",
        args.layers, args.tokens, args.hidden, resolved.platform
    );
    for (op, priority) in &resolved.ops {
        println!("  priority {op}: [{}]", priority.resolved.join(", "));
    }

    let donated = run_once(&registry, &model, args, true)?;
    let functional = run_once(&registry, &model, args, false)?;
    report("maybe_inplace (donated activations)", &donated);
    report("functional", &functional);

    let identical =
        bit_eq(&donated.outputs.0, &functional.outputs.0) && bit_eq(&donated.outputs.1, &functional.outputs.1);
    let checksum: f64 = donated.outputs.0.to_f64_vec()?.iter().sum();
    println!("output checksum: {checksum:.6}");
    if !identical {
        bail!("the donated and functional runs differ; they must be bit-identical");
    }
    println!("eager bit-identical: yes");

    let compiled = compiled_runs(&registry, &model, args)?;
    let compiled_identical = compiled
        .iter()
        .all(|run| bit_eq(&run.outputs[0], &functional.outputs.0) && bit_eq(&run.outputs[1], &functional.outputs.1));
    if !compiled_identical {
        bail!("the compiled runs differ from the eager run; they must be bit-identical");
    }
    let (donating, functional_graph) = (&compiled[0].stats, &compiled[1].stats);
    println!(
        "compiled vs functional graph: {:.2} MiB vs {:.2} MiB allocated, peak live {:.2} MiB vs {:.2} MiB",
        donating.bytes_allocated as f64 / (1 << 20) as f64,
        functional_graph.bytes_allocated as f64 / (1 << 20) as f64,
        donating.peak_live_bytes as f64 / (1 << 20) as f64,
        functional_graph.peak_live_bytes as f64 / (1 << 20) as f64
    );
    println!("compiled bit-identical to eager: yes");
    println!("bit-identical: yes");
    Ok(())
}

/// Traces the model (donating, and functional for comparison), compiles both with the standard
/// pipeline and interprets them.
fn compiled_runs(registry: &Registry, model: &Model, args: &DemoArgs) -> anyhow::Result<Vec<Interpretation>> {
    let meta = ir_core::TensorMeta::compact(DType::BF16, &[args.tokens, args.hidden]);
    let mut runs = Vec::new();
    for (label, donate) in [("compiled, maybe_inplace", true), ("compiled, functional", false)] {
        let tracer = Tracer::new(registry, "decoder");
        let x = tracer.input("x", meta.clone());
        let residual = tracer.input("residual", meta.clone());
        let (out, new_residual) = decoder(&tracer, model, x, residual, donate)?;
        let traced = tracer.finish(&[out, new_residual]);
        let mut graph = traced.graph;
        let report = Pipeline::standard()
            .run(&mut graph, &PassContext::new(registry), None, Snapshots::Skip)
            .context("compiling the traced decoder")?;
        let lowered_clones = report
            .runs
            .iter()
            .find_map(|r| match &r.report {
                PassReport::Lower(l) => Some(l.clones_inserted),
                _ => None,
            })
            .unwrap_or(0);
        let (x, residual) = activations(args)?;
        let mut inputs = vec![("x".to_owned(), x), ("residual".to_owned(), residual)];
        inputs.extend(traced.parameters.iter().map(|(name, t)| (name.clone(), t.clone())));
        let start = Instant::now();
        let run = interpret(&graph, registry, inputs, InterpOptions::checked())
            .context("interpreting the compiled decoder")?;
        let elapsed = start.elapsed();
        println!("{label}:");
        for pass in &report.runs {
            match &pass.report {
                PassReport::Functionalize(f) => println!("  {f}"),
                PassReport::FuseNormQuant(f) => println!("  {f}"),
                PassReport::Lower(l) => println!("  {l}"),
                _ => {}
            }
        }
        println!(
            "  copies: {lowered_clones} inserted by lowering, {} left after clone elimination",
            count_copies(&graph)
        );
        let stats = &run.stats;
        println!(
            "  bytes allocated {} ({:.2} MiB), peak live {:.2} MiB, clones executed {}, defensive copies {}",
            stats.bytes_allocated,
            stats.bytes_allocated as f64 / (1 << 20) as f64,
            stats.peak_live_bytes as f64 / (1 << 20) as f64,
            stats.clones_executed,
            stats.defensive_copies
        );
        println!("  time: {:.3} ms", elapsed.as_secs_f64() * 1e3);
        runs.push(run);
    }
    Ok(runs)
}

/// The `clone`s in `graph`: what lowering inserts in front of in-place kernels (the model's own
/// `contiguous` buffers are not counted).
fn count_copies(graph: &ir_graph::Graph) -> usize {
    graph
        .order()
        .iter()
        .filter(|&&n| matches!(graph.node(n).kind, ir_graph::NodeKind::Builtin { op: Builtin::Clone, .. }))
        .count()
}

fn build_model(args: &DemoArgs) -> anyhow::Result<Model> {
    let weight = |seed: u64| -> anyhow::Result<Tensor> {
        let spec = InputSpec { num_tokens: 1, hidden_size: args.hidden, dtype: DType::BF16, epsilon: 1e-6, seed };
        let inputs = (RMS_NORM.generate_inputs)(&spec)?;
        Ok(inputs[1].as_tensor().expect("rms_norm's generator returns a weight").clone())
    };
    let mut norms = Vec::new();
    let mut quants = Vec::new();
    for layer in 0..args.layers {
        let mut norm = RmsNorm::builder(args.hidden).name(format!("layers.{layer}.norm.weight")).build()?;
        norm.load_weight(weight(args.seed + 1000 + layer as u64)?)?;
        norms.push(norm);
        let scale = QuantScale::Static(Tensor::from_f64(DType::F32, &[1], &[QUANT_SCALE])?);
        quants.push(QuantFp8::new(format!("layers.{layer}.input_scale"), scale, DType::F8E4M3FN)?);
    }
    let mut final_norm = RmsNorm::builder(args.hidden).name("final_norm.weight").build()?;
    final_norm.load_weight(weight(args.seed + 999)?)?;
    Ok(Model { norms, quants, final_norm })
}

/// The model's forward pass, written once for every execution context (eager or traced); `donate`
/// chooses `maybe_inplace` over the functional call for the fused norms.
fn decoder<C: ExecutionContext>(
    ctx: &C,
    model: &Model,
    mut x: C::Tensor,
    mut residual: C::Tensor,
    donate: bool,
) -> anyhow::Result<(C::Tensor, C::Tensor)> {
    for (norm, quant) in model.norms.iter().zip(&model.quants) {
        let (normed, new_residual) = if donate {
            norm.forward_residual(ctx, x, residual)?
        } else {
            norm.forward_residual_functional(ctx, &x, &residual)?
        };
        // The fp8 GEMM's input: the normalized output's only reader, so the compiled graph fuses the
        // norm and the quantization into one kernel.
        let (q, _) = quant.forward(ctx, &normed)?;
        // A cheap stand-in for the GEMM: dequantize into a fresh bf16 buffer, then scale.
        let buffer = ctx.contiguous(&new_residual)?;
        let dequantized = ctx.builtin(Builtin::Copy, vec![BuiltinArg::Value(buffer), BuiltinArg::Value(q)])?;
        x = ctx.scale(&dequantized, 0.5 * QUANT_SCALE)?;
        residual = new_residual;
    }
    let outputs = if donate {
        model.final_norm.forward_residual(ctx, x, residual)?
    } else {
        model.final_norm.forward_residual_functional(ctx, &x, &residual)?
    };
    Ok(outputs)
}

/// Fresh, uniquely owned activations (x, residual).
fn activations(args: &DemoArgs) -> anyhow::Result<(Tensor, Tensor)> {
    let spec = InputSpec {
        num_tokens: args.tokens,
        hidden_size: args.hidden,
        dtype: DType::BF16,
        epsilon: 1e-6,
        seed: args.seed,
    };
    let inputs = (ir_core::op::fused_add_rms_norm::FUSED_ADD_RMS_NORM.generate_inputs)(&spec)?;
    let x = inputs[0].as_tensor().expect("generated x").deep_clone()?;
    let residual = inputs[1].as_tensor().expect("generated residual").deep_clone()?;
    Ok((x, residual))
}

/// One eager forward pass.
fn run_once(registry: &Registry, model: &Model, args: &DemoArgs, donate: bool) -> anyhow::Result<RunReport> {
    let ctx = EagerContext::new(registry);
    let (x, residual) = activations(args)?;
    registry.reset_selection_record();
    let bytes_before = cpu_bytes_allocated();
    let start = Instant::now();
    let outputs = decoder(&ctx, model, x, residual, donate)?;
    Ok(RunReport {
        outputs,
        elapsed: start.elapsed(),
        bytes_allocated: cpu_bytes_allocated() - bytes_before,
        record: registry.selection_record(),
    })
}

fn report(label: &str, run: &RunReport) {
    println!("{label}:");
    for op in &run.record.ops {
        let chosen: Vec<String> = op
            .providers
            .iter()
            .filter(|p| p.selections > 0)
            .map(|p| format!("{}x{}", p.provider, p.selections))
            .collect();
        if chosen.is_empty() {
            continue;
        }
        println!(
            "  {}: {}; activations written in place {}, copied {}",
            op.op,
            chosen.join(", "),
            op.inplace_writes,
            op.defensive_copies
        );
    }
    println!("  bytes allocated: {} ({:.2} MiB)", run.bytes_allocated, run.bytes_allocated as f64 / (1 << 20) as f64);
    println!("  time: {:.3} ms", run.elapsed.as_secs_f64() * 1e3);
}
