//! `vllm-ir demo`: a toy decoder run with donated activations and functionally, then traced and
//! compiled. Each layer: `RmsNorm` with residual, its output quantized to fp8 (the input of an fp8
//! GEMM: the norm and the quantization fuse when compiled), rotary embedding of q and k, views of one
//! qkv buffer, then a second norm + quantization and a `SiluAndMul` MLP. The GEMMs and the attention
//! are stand-ins made of copies (dequantization into a fresh buffer, `cat` of column slices), so
//! every run is bit-identical to every other.
//!
//! The model's parameters and the activations live on the platform's device (host memory for
//! `cpu`), and each run says how many times it moved device tensors through host memory
//! ([`host_round_trips`]): 0 when every step runs on the device.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ir_core::builtin::Builtin;
use ir_core::op::InputSpec;
use ir_core::storage::{DeviceAllocator, cpu_bytes_allocated, host_round_trips};
use ir_core::{DType, EagerContext, Registry, SelectionRecord, Tensor, bit_eq};
use ir_graph::{InterpOptions, Interpretation, Tracer, interpret};
use ir_passes::{PassContext, PassReport, Pipeline, Snapshots};
use layers::toy::{ToyDecoder, ToyDecoderConfig};

use crate::{CommonArgs, build_registry, device_allocator};

/// Options of `vllm-ir demo`.
#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Number of decoder layers (each: fused add + norm and fp8 quantization, rotary embedding of q
    /// and k, fused add + norm and fp8 quantization, `SiluAndMul`; the GEMMs and the attention are
    /// stand-ins made of copies).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Number of tokens (rows).
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Hidden size (a multiple of 8: it is split into query, key and value heads).
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// Seed of the random inputs and weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print each compiled graph (after the standard pipeline) in the text format.
    #[arg(long)]
    print_ir: bool,
    /// Refuse host round trips: a step that would move device tensors through host memory fails,
    /// naming the op, instead of running slowly.
    #[arg(long)]
    no_host_round_trips: bool,
}

struct RunReport {
    outputs: (Tensor, Tensor),
    elapsed: Duration,
    bytes_allocated: u64,
    host_round_trips: u64,
    record: SelectionRecord,
}

/// Where the demo's tensors live: the platform's device, or host memory.
struct Placement {
    allocator: Option<std::sync::Arc<dyn DeviceAllocator>>,
}

impl Placement {
    /// `t` on the device (a fresh upload), or `t` itself on the host.
    fn place(&self, t: Tensor) -> anyhow::Result<Tensor> {
        match &self.allocator {
            Some(allocator) => Ok(t.to_device(allocator.as_ref())?),
            None => Ok(t),
        }
    }

    fn device(&self) -> ir_core::Device {
        self.allocator.as_ref().map_or(ir_core::Device::Cpu, |a| a.device())
    }
}

pub(crate) fn run(args: &DemoArgs) -> anyhow::Result<()> {
    if args.layers == 0 || args.tokens == 0 || args.hidden == 0 {
        bail!("--layers, --tokens and --hidden must be at least 1");
    }
    ir_core::storage::refuse_host_round_trips(args.no_host_round_trips);
    let registry = build_registry()?;
    let config = args.common.config()?;
    let resolved = config.apply(&registry).context("applying priorities")?;
    let placement = Placement { allocator: device_allocator(resolved.platform)? };
    let mut model = build_model(args)?;
    if let Some(allocator) = &placement.allocator {
        model.to_device(allocator.as_ref()).context("moving the model's parameters to the device")?;
    }
    outln!(
        "demo: {} decoder layers, {} tokens x hidden {} ({} query and {} key/value heads of {}), bf16, platform {}, tensors on {}",
        args.layers,
        args.tokens,
        args.hidden,
        model.heads().q_heads,
        model.heads().kv_heads,
        model.heads().head_size,
        resolved.platform,
        placement.device()
    );
    for (op, priority) in &resolved.ops {
        outln!("  priority {op}: [{}]", priority.resolved.join(", "));
    }

    let donated = run_once(&registry, &model, args, &placement, true)?;
    let functional = run_once(&registry, &model, args, &placement, false)?;
    report("maybe_inplace (donated activations)", &donated);
    report("functional", &functional);

    let identical =
        bit_eq(&donated.outputs.0, &functional.outputs.0) && bit_eq(&donated.outputs.1, &functional.outputs.1);
    let checksum: f64 = donated.outputs.0.to_f64_vec()?.iter().sum();
    outln!("output checksum: {checksum:.6}");
    if !identical {
        bail!("the donated and functional runs differ; they must be bit-identical");
    }
    outln!("eager bit-identical: yes");

    let compiled = compiled_runs(&registry, &model, args, &placement)?;
    let compiled_identical = compiled.iter().all(|(run, _)| {
        bit_eq(&run.outputs[0], &functional.outputs.0) && bit_eq(&run.outputs[1], &functional.outputs.1)
    });
    if !compiled_identical {
        bail!("the compiled runs differ from the eager run; they must be bit-identical");
    }
    let (donating, functional_graph) = (&compiled[0].0.stats, &compiled[1].0.stats);
    outln!(
        "compiled vs functional graph: {:.2} MiB vs {:.2} MiB allocated, peak live {:.2} MiB vs {:.2} MiB",
        donating.bytes_allocated as f64 / (1 << 20) as f64,
        functional_graph.bytes_allocated as f64 / (1 << 20) as f64,
        donating.peak_live_bytes as f64 / (1 << 20) as f64,
        functional_graph.peak_live_bytes as f64 / (1 << 20) as f64
    );
    outln!("compiled bit-identical to eager: yes");
    outln!("bit-identical: yes");
    let round_trips = [&donated, &functional].iter().map(|r| r.host_round_trips).sum::<u64>()
        + compiled.iter().map(|(_, trips)| trips).sum::<u64>();
    outln!("host round trips: {round_trips}");
    Ok(())
}

/// Traces the model (donating, and functional for comparison), compiles both with the standard
/// pipeline and interprets them; each run with its host round trips.
fn compiled_runs(
    registry: &Registry,
    model: &ToyDecoder,
    args: &DemoArgs,
    placement: &Placement,
) -> anyhow::Result<Vec<(Interpretation, u64)>> {
    let device = placement.device();
    let meta = ir_core::TensorMeta { device, ..ir_core::TensorMeta::compact(DType::BF16, &[args.tokens, args.hidden]) };
    let mut runs = Vec::new();
    for (label, donate) in [("compiled, maybe_inplace", true), ("compiled, functional", false)] {
        let tracer = Tracer::new(registry, "decoder");
        let x = tracer.input("x", meta.clone());
        let residual = tracer.input("residual", meta.clone());
        let positions = tracer.input(
            "positions",
            ir_core::TensorMeta { device, ..ir_core::TensorMeta::compact(DType::I64, &[args.tokens]) },
        );
        let (out, new_residual) = model.forward(&tracer, (x, residual), &positions, donate)?;
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
        let (x, residual, positions) = activations(args, placement)?;
        let mut inputs =
            vec![("x".to_owned(), x), ("residual".to_owned(), residual), ("positions".to_owned(), positions)];
        inputs.extend(traced.parameters.iter().map(|(name, t)| (name.clone(), t.clone())));
        let (trips_before, start) = (host_round_trips(), Instant::now());
        let run = interpret(&graph, registry, inputs, InterpOptions::checked())
            .context("interpreting the compiled decoder")?;
        let elapsed = start.elapsed();
        let round_trips = host_round_trips() - trips_before;
        outln!("{label}:");
        for pass in &report.runs {
            match &pass.report {
                PassReport::Functionalize(f) => outln!("  {f}"),
                PassReport::Fusion(f) => outln!("  {f}"),
                PassReport::Lower(l) => outln!("  {l}"),
                _ => {}
            }
        }
        outln!(
            "  copies: {lowered_clones} inserted by lowering, {} left after clone elimination",
            count_copies(&graph)
        );
        let stats = &run.stats;
        outln!(
            "  bytes allocated {} ({:.2} MiB), peak live {:.2} MiB, clones executed {}, defensive copies {}",
            stats.bytes_allocated,
            stats.bytes_allocated as f64 / (1 << 20) as f64,
            stats.peak_live_bytes as f64 / (1 << 20) as f64,
            stats.clones_executed,
            stats.defensive_copies
        );
        outln!("  host round trips: {round_trips}");
        outln!("  time: {:.3} ms", elapsed.as_secs_f64() * 1e3);
        if args.print_ir {
            outln!("{graph}");
        }
        runs.push((run, round_trips));
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

fn build_model(args: &DemoArgs) -> anyhow::Result<ToyDecoder> {
    let config = ToyDecoderConfig {
        layers: args.layers,
        hidden: args.hidden,
        max_position: args.tokens.max(4096),
        dtype: DType::BF16,
        seed: args.seed,
    };
    ToyDecoder::new(config).map_err(|e| anyhow::anyhow!("--hidden {}: {e}", args.hidden))
}

/// Fresh, uniquely owned activations (x, residual) and the token positions `0..T`, placed.
fn activations(args: &DemoArgs, placement: &Placement) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    let spec = InputSpec {
        num_tokens: args.tokens,
        hidden_size: args.hidden,
        dtype: DType::BF16,
        epsilon: 1e-6,
        seed: args.seed,
    };
    let inputs = (ir_ops::fused_add_rms_norm::FUSED_ADD_RMS_NORM.generate_inputs)(&spec)?;
    let x = inputs[0].as_tensor().expect("generated x").deep_clone()?;
    let residual = inputs[1].as_tensor().expect("generated residual").deep_clone()?;
    let positions = Tensor::from_vec(&[args.tokens], (0..args.tokens as i64).collect())?;
    Ok((placement.place(x)?, placement.place(residual)?, placement.place(positions)?))
}

/// One eager forward pass.
fn run_once(
    registry: &Registry,
    model: &ToyDecoder,
    args: &DemoArgs,
    placement: &Placement,
    donate: bool,
) -> anyhow::Result<RunReport> {
    let ctx = EagerContext::new(registry);
    let (x, residual, positions) = activations(args, placement)?;
    registry.reset_selection_record();
    let (bytes_before, trips_before) = (cpu_bytes_allocated(), host_round_trips());
    let start = Instant::now();
    let outputs = model.forward(&ctx, (x, residual), &positions, donate)?;
    Ok(RunReport {
        outputs,
        elapsed: start.elapsed(),
        bytes_allocated: cpu_bytes_allocated() - bytes_before,
        host_round_trips: host_round_trips() - trips_before,
        record: registry.selection_record(),
    })
}

fn report(label: &str, run: &RunReport) {
    outln!("{label}:");
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
        outln!(
            "  {}: {}; activations written in place {}, copied {}",
            op.op,
            chosen.join(", "),
            op.inplace_writes,
            op.defensive_copies
        );
    }
    outln!("  bytes allocated: {} ({:.2} MiB)", run.bytes_allocated, run.bytes_allocated as f64 / (1 << 20) as f64);
    outln!("  host round trips: {}", run.host_round_trips);
    outln!("  time: {:.3} ms", run.elapsed.as_secs_f64() * 1e3);
}
