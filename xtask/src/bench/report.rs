//! `docs/benchmarks.md`: the machine, the targets with their status, then one table per group.

use super::{BenchOptions, Machine, Results, peak_for};

const PROVIDER_COLUMNS: [&str; 8] = ["copy", "native", "cpu", "unfused", "candle", "xpu", "cuda", "rocm"];

/// The norm + quantization ops, whose `unfused` baseline is the cpu norm then the cpu quantization.
const FUSED_QUANT_OPS: [&str; 4] = [
    "rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_quant",
    "fused_add_rms_norm_static_fp8_quant",
    "fused_add_rms_norm_dynamic_per_token_quant",
];

/// A target's verdict.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Status {
    Met,
    Missed,
    NotMeasured(String),
}

impl Status {
    fn from_bool(met: bool) -> Status {
        if met { Status::Met } else { Status::Missed }
    }

    fn text(&self) -> String {
        match self {
            Status::Met => "**met**".to_owned(),
            Status::Missed => "**missed**".to_owned(),
            Status::NotMeasured(why) => format!("not measured ({why})"),
        }
    }
}

/// One row of the targets table.
pub(crate) struct Target {
    pub(crate) name: String,
    pub(crate) measured: String,
    pub(crate) status: Status,
}

impl Target {
    fn not_measured(name: &str, why: &str) -> Target {
        Target { name: name.to_owned(), measured: "—".to_owned(), status: Status::NotMeasured(why.to_owned()) }
    }
}

fn fmt_gbps(v: Option<f64>) -> String {
    v.map_or_else(|| "—".to_owned(), |v| format!("{v:.1}"))
}

fn fmt_ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "—".to_owned(),
    }
}

fn fmt_time(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

fn fmt_bytes(b: u64) -> String {
    format!("{b} ({:.2} MiB)", b as f64 / (1 << 20) as f64)
}

fn gbps(results: &Results, group: &str, provider: &str) -> Option<f64> {
    results.get(group, provider).and_then(|m| m.gb_per_s())
}

/// The targets of the performance issue, each with what this run measured.
pub(crate) fn targets(results: &Results) -> Vec<Target> {
    let mut targets = Vec::new();
    let prefill = ["4096x4096", "2048x8192"];
    let mut copy_ratios = Vec::new();
    let mut candle_ratios = Vec::new();
    for op in ["rms_norm", "fused_add_rms_norm"] {
        for dtype in ["f32", "bf16"] {
            for shape in prefill {
                let group = format!("kernels/{op}/{dtype}/{shape}");
                let cpu = gbps(results, &group, "cpu");
                if let (Some(cpu), Some(copy)) = (cpu, gbps(results, &group, "copy")) {
                    copy_ratios.push((format!("{op} {dtype} {shape}"), cpu / copy));
                }
                if let (Some(cpu), Some(candle)) = (cpu, gbps(results, &group, "candle")) {
                    candle_ratios.push((format!("{op} {dtype} {shape}"), cpu / candle));
                }
            }
        }
    }
    targets.push(ratio_target(
        "`cpu` at prefill shapes, f32 and bf16: ≥ 85% of the same-run copy bandwidth",
        &copy_ratios,
        0.85,
        true,
        "no prefill results",
    ));
    targets.push(every_op_share(
        results,
        "every op's `cpu` at prefill shapes (4096×4096, 2048×8192), f32 and bf16: ≥ 85% of the same-run copy",
        &prefill,
        0.85,
    ));
    targets.push(every_op_share(
        results,
        "every op's `cpu` at decode shapes (1×4096, 16×4096, 64×8192, 256×4096), f32 and bf16: ≥ 50% of the same-run copy",
        &["1x4096", "16x4096", "64x8192", "256x4096"],
        0.50,
    ));
    targets.push(ratio_target(
        "`cpu` at prefill shapes, f32 and bf16: ≥ 5× candle-nn on the same data",
        &candle_ratios,
        5.0,
        false,
        "built without `candle`",
    ));

    let mut native_ratios = Vec::new();
    for op in ["rms_norm", "fused_add_rms_norm"] {
        for dtype in ["f32", "bf16"] {
            let group = format!("kernels/{op}/{dtype}/1x4096");
            if let (Some(cpu), Some(native)) = (gbps(results, &group, "cpu"), gbps(results, &group, "native")) {
                native_ratios.push((format!("{op} {dtype}"), cpu / native));
            }
        }
    }
    targets.push(ratio_target(
        "`cpu` on one row of 4096: ≥ 3× native",
        &native_ratios,
        3.0,
        false,
        "no decode results",
    ));

    let mut overheads = Vec::new();
    for op in ["rms_norm", "fused_add_rms_norm_maybe_inplace"] {
        let group = format!("dispatch/{op}/1x4096");
        if let (Some(direct), Some(registry)) = (results.get(&group, "direct"), results.get(&group, "registry")) {
            overheads.push((op.to_owned(), registry.median_ns - direct.median_ns));
        }
    }
    // The overheads alone (providers that do no work: the functional call and `maybe_inplace` with
    // an in-place provider) decide; the pairs with the cpu kernel are shown beside them, where the
    // kernel's run-to-run variation is larger than the overhead.
    let alone: Vec<(&str, f64)> = OVERHEAD_GROUPS
        .iter()
        .filter_map(|&(call, group)| match (results.get(group, "direct"), results.get(group, "registry")) {
            (Some(direct), Some(registry)) => Some((call, registry.median_ns - direct.median_ns)),
            _ => None,
        })
        .collect();
    let name = "decode 1×4096: registry dispatch ≤ 100 ns over the direct kernel call";
    let with_kernel = overheads.iter().map(|(op, ns)| format!("{op} with the cpu kernel: {ns:+.0} ns"));
    targets.push(match (alone.as_slice(), overheads.as_slice()) {
        ([], []) => Target::not_measured(name, "no dispatch results"),
        (alone @ [_, ..], _) => Target {
            name: name.to_owned(),
            measured: alone
                .iter()
                .map(|(call, ns)| format!("{call}, no-op kernel: {ns:+.0} ns"))
                .chain(with_kernel)
                .collect::<Vec<_>>()
                .join("; "),
            status: Status::from_bool(alone.iter().all(|(_, ns)| *ns <= 100.0)),
        },
        ([], list) => Target {
            name: name.to_owned(),
            measured: with_kernel.collect::<Vec<_>>().join("; "),
            status: Status::from_bool(list.iter().all(|(_, ns)| *ns <= 100.0)),
        },
    });

    targets.push(match per_node_near(results, 100_000) {
        Some(ns) => Target {
            name: "passes: ≤ 1 µs per node at 100k nodes".to_owned(),
            measured: format!("{:.2} µs per node", ns / 1e3),
            status: Status::from_bool(ns <= 1000.0),
        },
        None => Target::not_measured("passes: ≤ 1 µs per node at 100k nodes", "no pass results"),
    });
    let linear = "passes: 1M nodes ≤ 11× the 100k time (linear)";
    targets.push(match (find_pass(results, 100_000), find_pass(results, 1_000_000)) {
        (Some(small), Some(large)) => {
            let ratio = large.median_ns / small.median_ns;
            let nodes = large.per_iteration.unwrap_or(0) as f64 / small.per_iteration.unwrap_or(1) as f64;
            Target {
                name: linear.to_owned(),
                measured: format!("{ratio:.1}× the time for {nodes:.1}× the nodes"),
                status: Status::from_bool(ratio <= 11.0),
            }
        }
        _ => Target::not_measured(linear, "no pass results"),
    });
    let resident = "passes: ≤ 600 B of peak resident memory per node at 1M (`vllm-ir opt` on the generated decoder, minus the smallest graph)";
    targets.push(
        match results
            .rss
            .as_ref()
            .and_then(|study| study.runs.iter().find(|r| r.nodes >= 1_000_000).map(|r| (study, r)))
        {
            Some((study, run)) => {
                let per_node = study.bytes_per_node(run);
                Target {
                    name: resident.to_owned(),
                    measured: format!(
                        "{per_node:.0} B per node ({} nodes: {:.0} MiB peak, {:.0} MiB for the smallest graph)",
                        run.nodes,
                        run.peak_bytes as f64 / MIB,
                        study.baseline.peak_bytes as f64 / MIB
                    ),
                    status: Status::from_bool(per_node <= 600.0),
                }
            }
            None => Target::not_measured(resident, "no resident-memory results"),
        },
    );

    targets.push(match &results.memory {
        Some(memory) => {
            let met = memory.rows.iter().all(|r| {
                r.compiled.bytes_allocated == r.compiled_floor_bytes && r.compiled.copies() == 0 && r.bit_identical
            });
            let measured = memory
                .rows
                .iter()
                .map(|r| {
                    format!(
                        "L={}: {} vs {} B, {} vs {} copies",
                        r.layers,
                        r.compiled.bytes_allocated,
                        r.uncompiled.bytes_allocated,
                        r.compiled.copies(),
                        r.uncompiled.copies()
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            Target {
                name: "memory: compiled fused norms allocate nothing (only the first norm and the scales)".to_owned(),
                measured,
                status: Status::from_bool(met),
            }
        }
        None => Target::not_measured("memory: compiled fused norms allocate nothing", "no memory results"),
    });

    let round_trips = "GPU: 0 host round trips in the demo (`vllm-ir demo --platform <p>`: toy decoder, eager and compiled, tensors on the device)";
    let ran: Vec<_> = results.device_demo.iter().filter(|d| d.round_trips.is_some()).collect();
    targets.push(if ran.is_empty() {
        let why =
            results.device_demo.iter().map(|d| format!("{}: {}", d.platform, d.note)).collect::<Vec<_>>().join("; ");
        Target::not_measured(round_trips, if why.is_empty() { "no device demo results" } else { &why })
    } else {
        let measured = results
            .device_demo
            .iter()
            .map(|d| match d.round_trips {
                Some(n) => format!("{}: {n} ({})", d.platform, d.note),
                None => format!("{}: not run ({})", d.platform, d.note),
            })
            .collect::<Vec<_>>()
            .join("; ");
        Target {
            name: round_trips.to_owned(),
            measured,
            status: Status::from_bool(ran.iter().all(|d| d.round_trips == Some(0))),
        }
    });

    let cuda_device =
        results.providers.iter().find(|p| p.provider == "cuda" && p.available).and_then(|p| p.device.clone());
    let h200 = "H200: `cuda` fused op at 16384×8192 bf16 ≥ 85% of 4.8 TB/s".to_owned();
    targets.push(candle_per_call_target(results));
    targets.push(match (cuda_device, gbps(results, "kernels/fused_add_rms_norm/bf16/16384x8192", "cuda")) {
        (Some(device), Some(gb)) if device.contains("H200") => Target {
            name: h200,
            measured: format!("{gb:.0} GB/s = {:.1}% of 4800", gb / 48.0),
            status: Status::from_bool(gb >= 0.85 * 4800.0),
        },
        (Some(device), _) => Target::not_measured(&h200, &format!("the CUDA device is {device}")),
        (None, _) => Target::not_measured(&h200, "no CUDA device in this run; see `cargo xtask gpu-bench`"),
    });
    targets
}

/// Bytes in a MiB.
const MIB: f64 = 1024.0 * 1024.0;

fn find_pass(results: &Results, nodes_at_least: u64) -> Option<&super::Measurement> {
    results
        .measurements
        .iter()
        .filter(|((g, _), m)| g == "passes/pipeline" && m.per_iteration.is_some_and(|n| n >= nodes_at_least))
        .map(|(_, m)| m)
        .min_by_key(|m| m.per_iteration)
}

fn per_node_near(results: &Results, nodes: u64) -> Option<f64> {
    find_pass(results, nodes).and_then(|m| m.per_iteration.map(|n| m.median_ns / n as f64))
}

/// The `cpu` provider's share of the same-run copy over every op's kernel cases at `shapes` in f32
/// and bf16: how many cases meet `threshold`, and each case below it, worst first.
fn every_op_share(results: &Results, name: &str, shapes: &[&str], threshold: f64) -> Target {
    let mut shares = Vec::new();
    for group in results.groups("kernels/") {
        let parts: Vec<&str> = group.split('/').collect();
        let [_, op, dtype, shape] = parts.as_slice() else { continue };
        if !matches!(*dtype, "f32" | "bf16") || !shapes.contains(shape) {
            continue;
        }
        if let (Some(cpu), Some(copy)) = (gbps(results, &group, "cpu"), gbps(results, &group, "copy")) {
            shares.push((format!("{op} {dtype} {shape}"), cpu / copy));
        }
    }
    if shares.is_empty() {
        return Target::not_measured(name, "no such cases in this run");
    }
    let met = shares.iter().filter(|(_, share)| *share >= threshold).count();
    let mut below: Vec<&(String, f64)> = shares.iter().filter(|(_, share)| *share < threshold).collect();
    below.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut measured = format!("{met} of {} cases", shares.len());
    if !below.is_empty() {
        let list: Vec<String> = below.iter().map(|(what, share)| format!("{what} {:.0}%", share * 100.0)).collect();
        measured.push_str(&format!("; below: {}", list.join(", ")));
    }
    Target { name: name.to_owned(), measured, status: Status::from_bool(below.is_empty()) }
}

fn ratio_target(name: &str, ratios: &[(String, f64)], threshold: f64, percent: bool, missing: &str) -> Target {
    if ratios.is_empty() {
        return Target::not_measured(name, missing);
    }
    let measured = ratios
        .iter()
        .map(|(what, r)| if percent { format!("{what}: {:.0}%", r * 100.0) } else { format!("{what}: {r:.1}×") })
        .collect::<Vec<_>>()
        .join("; ");
    Target { name: name.to_owned(), measured, status: Status::from_bool(ratios.iter().all(|(_, r)| *r >= threshold)) }
}

/// The whole report.
pub(crate) fn write(
    results: &Results,
    machine: &Machine,
    options: BenchOptions,
    sweep_plots: &[(String, String)],
) -> anyhow::Result<String> {
    let mut out = String::new();
    let command = format!(
        "cargo xtask bench{}{}",
        if options.quick { " --quick" } else { "" },
        if options.candle { "" } else { " --no-candle" }
    );
    out.push_str("# Benchmarks\n\n");
    out.push_str(&format!(
        "Generated by `{command}` on {}, commit {}{}. Regenerate with the same command; the quick run \
         is a subset (decode 1×4096 and prefill 4096×4096, f32 and bf16) taking a few minutes on 2 cores.\n\n",
        machine.date,
        machine.commit,
        if options.report_only { "; this page was rewritten from that run's results by `--report-only`" } else { "" }
    ));
    out.push_str(&machine_section(machine));
    out.push_str(
        "Every figure is a criterion median. The kernel group runs every op the registry defines on every \
         provider registered for it, from the op's own input generator. Kernel throughput is the bytes a \
         call must move (every tensor argument read once, every output written once: `rms_norm` \
         2·T·H·s + H·s_w and fused 4·T·H·s + H·s_w; a gated activation on [T, 2H] 3·T·H·s) divided by the \
         median time, in GB/s (10⁹ B/s); the copy baseline copies the op's activation buffers with the same \
         thread split, in the same run, so ratios hold on any machine. Each provider is checked against \
         native once through the registry before timing, then called directly; functional \
         implementations allocate their outputs inside the timed region (as every caller of them does; the \
         run keeps freed host memory in the process, as an engine's caching allocator does, so a call pays \
         the zeroing of its output but not fresh page faults), in-place ones get their inputs restored \
         (untimed) before each call. A provider whose predicate \
         rejects a case shows `rejected`.\n\n",
    );

    out.push_str("## Targets\n\n| target | measured | status |\n|---|---|---|\n");
    let targets = targets(results);
    for t in &targets {
        out.push_str(&format!("| {} | {} | {} |\n", t.name, t.measured, t.status.text()));
    }
    out.push('\n');
    if targets.iter().any(|t| matches!(t.status, Status::Missed)) {
        out.push_str(
            "What limits each missed figure, with the profiles that show it, is in [What limits the \
             figures](benchmarking.md#what-limits-the-figures).\n\n",
        );
    }

    out.push_str(&provider_summary(results));
    out.push_str(&kernel_tables(results, "kernels/", "## Kernels\n\n"));
    let mut sweep_header = String::from(
        "## Bandwidth vs hidden size\n\nbf16, T·H = 16M elements per activation (32 MB, like 4096×4096), so every \
         shape streams from memory. One plot per op: each provider's bandwidth as a share of the same-run \
         copy of the same bytes (the black line at 100%), every measured hidden size on the axis.\n\n",
    );
    for (op, file) in sweep_plots {
        sweep_header.push_str(&format!("![{op}: share of the copy vs hidden size](benchmarks/{file})\n\n"));
    }
    out.push_str(&kernel_tables(results, "sweep/", &sweep_header));
    out.push_str(&fusion_table(results));
    out.push_str(&dispatch_table(results));
    out.push_str(&model_table(results));
    out.push_str(&decode_table(results));
    out.push_str(&candle_per_call_table(results));
    out.push_str(&copies_table(results));
    out.push_str(&passes_table(results));
    out.push_str(&memory_table(results));
    out.push_str(&providers_section(results));
    let gpu_report = crate::project_root().join("docs/benchmarks-gpu.md");
    out.push_str(if gpu_report.exists() {
        "## GPU\n\nGPU figures come from `cargo xtask gpu-bench` on a machine with a CUDA (or ROCm, OpenCL GPU) \
         device: see [benchmarks-gpu.md](benchmarks-gpu.md), with their date.\n"
    } else {
        "## GPU\n\nNo GPU figures are recorded yet. `cargo xtask gpu-bench` on a machine with a CUDA (or ROCm, \
         OpenCL GPU) device measures the kernel group there and writes `docs/benchmarks-gpu.md` with the date.\n"
    });
    Ok(out)
}

/// The Llama example's model with our ops and with candle-nn's.
fn model_table(results: &Results) -> String {
    let mut out = String::from(
        "## Model\n\nThe Llama example's model (`crates/vllm-ir/examples/llama`) on a random checkpoint: candle's \
         matmuls, attention and KV cache, with this project's norms, rotary and gated activation on candle tensors \
         (`candle_ops`, in place where they write) or candle-nn's, interleaved in one run; and the same model \
         traced and compiled, candle's matmuls and attention as engine ops in the graph (`compiled`, run by the \
         interpreter; the activations crossing into and out of candle are copied). Share: of the forward time with \
         our ops, the time inside their calls. Copies: defensive copies of our ops, then the copies the compiled \
         graphs ran.\n\n| model | dtype | layers × hidden | prefill (tokens) | prefill ours | prefill candle-nn | \
         prefill compiled | decode ours | decode candle-nn | decode compiled | share in our ops | copies | native \
         fallbacks |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for row in &results.model {
        out.push_str(&format!(
            "| {} | {} | {} × {} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.2} ms/token | {:.2} ms/token | {:.2} \
             ms/token | {:.1}% | {} / {} | {} |\n",
            row.variant,
            row.dtype,
            row.layers,
            row.hidden,
            row.prefill_tokens,
            row.prefill_ms[0],
            row.prefill_ms[1],
            row.prefill_ms[2],
            row.decode_ms[0],
            row.decode_ms[1],
            row.decode_ms[2],
            100.0 * row.ours_share,
            row.copies,
            row.compiled_copies,
            row.native_fallbacks
        ));
    }
    if results.model.is_empty() {
        out.push_str("| (not measured) | | | | | | | | | | | | |\n");
    }
    out.push('\n');
    out
}

/// One decode token's whole op calls: ours through the registry on our tensors and on candle
/// tensors (`candle_ops`), and candle-nn's equivalents, in one run.
fn decode_table(results: &Results) -> String {
    let mut out = String::from(
        "## Decode: one token's op calls

Whole calls as an engine makes them at one token (dispatch, views and \
         output allocation included): `ours` through the registry on this project's tensors, `candle_ops` on \
         candle tensors (in place where the op writes), and candle-nn's equivalent (`ops::rms_norm`, an add then \
         `rms_norm`, `silu` times up, `rotary_emb::rope` on q and k), in the same run. Rotary: heads of 128, a \
         quarter as many kv heads.\n\n| dtype | shape | op | ours | candle_ops | candle-nn | candle-nn / candle_ops |\n\
         |---|---|---|---:|---:|---:|---:|\n",
    );
    let mut rows = 0;
    for group in results.groups("decode/") {
        let parts: Vec<&str> = group.split('/').collect();
        let [_, dtype, shape] = parts.as_slice() else { continue };
        for op in ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"] {
            let time = |who: &str| results.get(&group, &format!("{op}/{who}")).map(|m| m.median_ns);
            let Some(ours) = time("ours") else { continue };
            let cell = |t: Option<f64>| t.map_or("—".to_owned(), fmt_time);
            let ratio = match (time("candle_ops"), time("candle-nn")) {
                (Some(a), Some(b)) => format!("{:.1}×", b / a),
                _ => "—".to_owned(),
            };
            out.push_str(&format!(
                "| {dtype} | {shape} | {op} | {} | {} | {} | {ratio} |\n",
                fmt_time(ours),
                cell(time("candle_ops")),
                cell(time("candle-nn"))
            ));
            rows += 1;
        }
    }
    if rows == 0 {
        out.push_str("| (not measured) | | | | | | |\n");
    }
    out.push('\n');
    out
}

/// The ops `candle per call` measures.
const PER_CALL_OPS: [&str; 3] = ["rms_norm", "fused_add_rms_norm", "silu_and_mul"];

/// One `candle per call` measurement: `candle_ops`, the direct kernel and candle-nn, in ns.
struct PerCall {
    dtype: String,
    shape: String,
    op: &'static str,
    ours: f64,
    direct: Option<f64>,
    candle_nn: Option<f64>,
}

impl PerCall {
    /// No slower than candle-nn.
    fn beats_candle_nn(&self) -> bool {
        self.candle_nn.is_none_or(|nn| self.ours <= nn)
    }

    /// No slower than 1.2× the direct kernel + 100 ns.
    fn near_direct(&self) -> bool {
        self.direct.is_none_or(|d| self.ours <= 1.2 * d + 100.0)
    }

    /// The cost target: both of the above.
    fn met(&self) -> bool {
        self.beats_candle_nn() && self.near_direct()
    }

    /// The hidden size of the `1xH` shape, for ordering rows.
    fn hidden(&self) -> usize {
        self.shape.rsplit('x').next().and_then(|h| h.parse().ok()).unwrap_or(usize::MAX)
    }
}

fn per_call(results: &Results) -> Vec<PerCall> {
    let mut rows = Vec::new();
    for group in results.groups("candle_per_call/") {
        let parts: Vec<&str> = group.split('/').collect();
        let [_, dtype, shape] = parts.as_slice() else { continue };
        for op in PER_CALL_OPS {
            let time = |who: &str| results.get(&group, &format!("{op}/{who}")).map(|m| m.median_ns);
            let Some(ours) = time("candle_ops") else { continue };
            rows.push(PerCall {
                dtype: (*dtype).to_owned(),
                shape: (*shape).to_owned(),
                op,
                ours,
                direct: time("direct"),
                candle_nn: time("candle-nn"),
            });
        }
    }
    // f32 first, then by hidden size, then in the ops' order.
    let dtype_rank = |dtype: &str| if dtype == "f32" { 0 } else { 1 };
    let op_rank = |op: &str| PER_CALL_OPS.iter().position(|o| *o == op).unwrap_or(usize::MAX);
    rows.sort_by_key(|row| (dtype_rank(&row.dtype), row.dtype.clone(), row.hidden(), op_rank(row.op)));
    rows
}

/// `candle per call`: `candle_ops` at one token beside the direct kernel and candle-nn.
fn candle_per_call_table(results: &Results) -> String {
    let mut out = String::from(
        "## Candle per call

One token's call through `candle_ops` on candle tensors (locks, views, dispatch and output \
         included), the cpu kernel called directly on this project's tensors, and candle-nn's equivalent, in the \
         same run, at every hidden size from 256 to 8192 (`benches/candle_per_call.rs`). Target: `candle_ops` \
         ≤ candle-nn and ≤ 1.2× direct + 100 ns; the last columns say which part holds, and `over direct` is \
         the call's cost above the kernel's.\n\n| dtype | shape | op | candle_ops | direct | candle-nn | over \
         direct | ≤ candle-nn | ≤ 1.2× direct + 100 ns |\n|---|---|---|---:|---:|---:|---:|---|---|\n",
    );
    let rows = per_call(results);
    for row in &rows {
        let cell = |t: Option<f64>| t.map_or("—".to_owned(), fmt_time);
        let yes = |held: bool| if held { "yes" } else { "no" };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            row.dtype,
            row.shape,
            row.op,
            fmt_time(row.ours),
            cell(row.direct),
            cell(row.candle_nn),
            cell(row.direct.map(|d| row.ours - d)),
            yes(row.beats_candle_nn()),
            yes(row.near_direct())
        ));
    }
    if rows.is_empty() {
        out.push_str("| (not measured: needs `cargo xtask bench` with candle) | | | | | | | | |\n");
    }
    out.push('\n');
    out
}

/// The `candle per call` target over every measured row.
fn candle_per_call_target(results: &Results) -> Target {
    let name =
        "`candle_ops` at one token, hidden 256–8192, f32 and bf16: ≤ candle-nn and ≤ 1.2× the direct kernel + 100 ns";
    let rows = per_call(results);
    if rows.is_empty() {
        return Target::not_measured(name, "built without `candle`");
    }
    let missed: Vec<String> =
        rows.iter().filter(|row| !row.met()).map(|row| format!("{} {} {}", row.op, row.dtype, row.shape)).collect();
    let measured = if missed.is_empty() {
        format!("all {} calls", rows.len())
    } else {
        format!("{} of {} calls; missed: {}", rows.len() - missed.len(), rows.len(), missed.join(", "))
    };
    Target { name: name.to_owned(), measured, status: Status::from_bool(missed.is_empty()) }
}

/// Copies of column slices of a qkv buffer against compact copies of the same bytes.
fn copies_table(results: &Results) -> String {
    let mut out = String::from(
        "## Strided copies\n\nA compact copy (`contiguous()`) of a column slice of a `qkv` buffer (rows of W \
         elements, `stride` apart) against a compact copy of the same bytes, in the same run; target: at least 80% \
         of the compact copy's bandwidth.\n\n| dtype | shape | slice of | compact | slice | share |\n\
         |---|---|---|---:|---:|---:|\n",
    );
    let mut rows = 0;
    for group in results.groups("copy/") {
        let parts: Vec<&str> = group.split('/').collect();
        let [_, dtype, shape] = parts.as_slice() else { continue };
        let Some(compact) = results.get(&group, "compact") else { continue };
        let slices = results.measurements.iter().filter(|((g, f), _)| *g == group && f.starts_with("column-slice-of-"));
        for ((_, function), slice) in slices {
            let stride = function.trim_start_matches("column-slice-of-");
            out.push_str(&format!(
                "| {dtype} | {shape} | {stride} | {} | {} | {:.0}% |\n",
                fmt_time(compact.median_ns),
                fmt_time(slice.median_ns),
                100.0 * compact.median_ns / slice.median_ns
            ));
            rows += 1;
        }
    }
    if rows == 0 {
        out.push_str("| (not measured) | | | | | |\n");
    }
    out.push_str(
        "\nRotary embedding in place on candle tensors (`candle_ops`, the `cpu` provider) on q and k as column \
         slices of one `qkv` buffer (v after them) against the same call on compact q and k; target: the slices \
         within 1.3× of compact.\n\n| dtype | tokens × q + k | compact | qkv slices | slices / compact |\n\
         |---|---|---:|---:|---:|\n",
    );
    let mut rotary_rows = 0;
    for group in results.groups("rotary/") {
        let parts: Vec<&str> = group.split('/').collect();
        let [_, dtype, shape] = parts.as_slice() else { continue };
        let (Some(compact), Some(slices)) = (results.get(&group, "compact"), results.get(&group, "qkv-slices")) else {
            continue;
        };
        out.push_str(&format!(
            "| {dtype} | {shape} | {} | {} | {:.2}× |\n",
            fmt_time(compact.median_ns),
            fmt_time(slices.median_ns),
            slices.median_ns / compact.median_ns
        ));
        rotary_rows += 1;
    }
    if rotary_rows == 0 {
        out.push_str("| (not measured) | | | | |\n");
    }
    out.push('\n');
    out
}

/// The norm + quantization ops against their unfused pair on the cpu provider: time, and the bytes
/// each moves (the pair also writes the normalized tensor and reads it back: 2·T·H·s more).
fn fusion_table(results: &Results) -> String {
    let mut out = String::from(
        "## Fusion: norm + fp8 quantization\n\nEach fused op's `cpu` kernel against the `unfused` pair (the cpu \
         norm kernel writing its output, then the cpu quantization kernel reading it back) on the same inputs, \
         both checked against native before timing. Bytes: what each must move at least; the pair also writes \
         and reads the normalized tensor.\n\n| op | dtype | shape | fused | unfused | fused speed-up | bytes fused | \
         bytes unfused |\n|---|---|---|---:|---:|---:|---:|---:|\n",
    );
    let mut rows = 0;
    let mut groups = results.groups("kernels/");
    groups.sort_unstable();
    for group in &groups {
        let parts: Vec<&str> = group.split('/').collect();
        let [_, op, dtype, shape] = parts.as_slice() else { continue };
        if !FUSED_QUANT_OPS.contains(op) {
            continue;
        }
        let (Some(fused), Some(unfused)) = (results.get(group, "cpu"), results.get(group, "unfused")) else { continue };
        let size: u64 = match *dtype {
            "f32" => 4,
            _ => 2,
        };
        let elements: u64 = shape.split('x').filter_map(|d| d.parse::<u64>().ok()).product();
        let bytes = fused.per_iteration.unwrap_or(0);
        out.push_str(&format!(
            "| {op} | {dtype} | {shape} | {} | {} | {:.2}× | {} | {} |\n",
            fmt_time(fused.median_ns),
            fmt_time(unfused.median_ns),
            unfused.median_ns / fused.median_ns,
            fmt_bytes(bytes),
            fmt_bytes(bytes + 2 * elements * size),
        ));
        rows += 1;
    }
    if rows == 0 {
        out.push_str("| (no run measured both) | | | | | | | |\n");
    }
    out.push('\n');
    out
}

fn machine_section(machine: &Machine) -> String {
    let mut out = String::from("## Machine\n\n");
    out.push_str(&format!("- CPU: {} ({} threads available)\n", machine.cpu, machine.cores));
    out.push_str(&format!("- Memory: {}\n- OS: {}\n- Compiler: {}\n", machine.memory, machine.os, machine.rustc));
    if machine.devices.is_empty() {
        out.push_str("- Devices: none beyond the CPU\n");
    }
    for device in &machine.devices {
        out.push_str(&format!("- Device {device}\n"));
    }
    out.push('\n');
    out
}

fn kernel_tables(results: &Results, prefix: &str, heading: &str) -> String {
    let groups = results.groups(prefix);
    if groups.is_empty() {
        return String::new();
    }
    let mut out = heading.to_owned();
    let present: Vec<&str> =
        PROVIDER_COLUMNS.iter().copied().filter(|p| groups.iter().any(|g| results.get(g, p).is_some())).collect();
    let mut header = "| op | dtype | shape |".to_owned();
    let mut rule = "|---|---|---|".to_owned();
    for p in &present {
        header.push_str(&format!(" {p} GB/s |"));
        rule.push_str("---:|");
    }
    for extra in ["cpu time", "cpu / copy", "cpu / native", "cpu / candle"] {
        header.push_str(&format!(" {extra} |"));
        rule.push_str("---:|");
    }
    out.push_str(&format!("{header}\n{rule}\n"));
    let mut sorted = groups;
    sorted.sort_by_key(|g| {
        let parts: Vec<&str> = g.split('/').collect();
        let dims: Vec<usize> =
            parts.get(3).map(|s| s.split('x').filter_map(|d| d.parse().ok()).collect()).unwrap_or_default();
        (
            parts.get(1).map(|s| s.to_string()),
            parts.get(2).map(|s| s.to_string()),
            dims.iter().product::<usize>(),
            dims.get(1).copied(),
        )
    });
    for group in sorted {
        let parts: Vec<&str> = group.split('/').collect();
        let [_, op, dtype, shape] = parts.as_slice() else { continue };
        let mut row = format!("| {op} | {dtype} | {shape} |");
        for p in &present {
            let cell = match (gbps(results, &group, p), *p) {
                (Some(gb), "cuda" | "rocm" | "xpu") => {
                    let device = results.providers.iter().find(|s| s.provider == *p).and_then(|s| s.device.clone());
                    match device.as_deref().and_then(peak_for) {
                        Some((_, peak)) => format!("{gb:.1} ({:.0}% of peak)", 100.0 * gb / peak),
                        None => format!("{gb:.1}"),
                    }
                }
                (None, _) if rejected(results, &group, p) => "rejected".to_owned(),
                (gb, _) => fmt_gbps(gb),
            };
            row.push_str(&format!(" {cell} |"));
        }
        let cpu = gbps(results, &group, "cpu");
        let cpu_time = results.get(&group, "cpu").map_or_else(|| "—".to_owned(), |m| fmt_time(m.median_ns));
        row.push_str(&format!(
            " {cpu_time} | {} | {} | {} |",
            fmt_ratio(cpu, gbps(results, &group, "copy")),
            fmt_ratio(cpu, gbps(results, &group, "native")),
            fmt_ratio(cpu, gbps(results, &group, "candle"))
        ));
        out.push_str(&row);
        out.push('\n');
    }
    out.push('\n');
    out
}

/// Whether `provider`'s predicate rejected the case of `group` in this run.
fn rejected(results: &Results, group: &str, provider: &str) -> bool {
    results.providers.iter().any(|s| s.provider == provider && s.rejected.iter().any(|(g, _)| g == group))
}

/// A share as a percentage: whole percents, one decimal below 10%.
fn fmt_percent(share: f64) -> String {
    let percent = 100.0 * share;
    if percent < 10.0 { format!("{percent:.1}%") } else { format!("{percent:.0}%") }
}

/// A ratio with the case it was measured on.
type Labelled = (String, f64);

/// Geometric mean, best and worst of positive ratios, with the labels of the best and worst.
fn spread(ratios: &[Labelled]) -> Option<(f64, Labelled, Labelled)> {
    let valid: Vec<&(String, f64)> = ratios.iter().filter(|(_, r)| *r > 0.0 && r.is_finite()).collect();
    if valid.is_empty() {
        return None;
    }
    let geomean = (valid.iter().map(|(_, r)| r.ln()).sum::<f64>() / valid.len() as f64).exp();
    let best = valid.iter().max_by(|a, b| a.1.total_cmp(&b.1)).expect("non-empty");
    let worst = valid.iter().min_by(|a, b| a.1.total_cmp(&b.1)).expect("non-empty");
    Some((geomean, (*best).clone(), (*worst).clone()))
}

/// Per provider over every `kernels/` case it ran: its bandwidth as a share of the same-run copy and
/// its speedup over native (geometric mean, best, worst), then the share of copy per op.
fn provider_summary(results: &Results) -> String {
    let groups = results.groups("kernels/");
    if groups.is_empty() {
        return String::new();
    }
    let case_of = |group: &str| group.trim_start_matches("kernels/").replace('/', " ");
    let ratios = |provider: &str, baseline: &str, filter: &dyn Fn(&str) -> bool| -> Vec<(String, f64)> {
        groups
            .iter()
            .filter(|g| filter(g))
            .filter_map(|g| Some((case_of(g), gbps(results, g, provider)? / gbps(results, g, baseline)?)))
            .collect()
    };
    let mut out = String::from(
        "## Providers at a glance\n\nOver every kernel case each provider ran: bandwidth as a share of the \
         same-run copy of the op's activation bytes, and speedup over native (native's time ÷ the \
         provider's; native runs at decode shapes only in quick runs). Geometric mean, best and worst case.\n\n\
         | provider | % of copy: geomean | best | worst | × native: geomean | best | worst |\n\
         |---|---:|---|---|---:|---|---|\n",
    );
    let fmt_case = |(case, r): &(String, f64), percent: bool| {
        if percent { format!("{} ({case})", fmt_percent(*r)) } else { format!("{r:.1}× ({case})") }
    };
    for provider in PROVIDER_COLUMNS.iter().filter(|p| !matches!(**p, "copy")) {
        let all = |_: &str| true;
        let copy = spread(&ratios(provider, "copy", &all));
        let native = if *provider == "native" { None } else { spread(&ratios(provider, "native", &all)) };
        if copy.is_none() && native.is_none() {
            continue;
        }
        let cells = |s: Option<(f64, Labelled, Labelled)>, percent: bool| match s {
            Some((g, best, worst)) => format!(
                "{} | {} | {}",
                if percent { fmt_percent(g) } else { format!("{g:.1}×") },
                fmt_case(&best, percent),
                fmt_case(&worst, percent)
            ),
            None => "— | — | —".to_owned(),
        };
        out.push_str(&format!("| {provider} | {} | {} |\n", cells(copy, true), cells(native, false)));
    }
    let mut ops: Vec<String> = groups.iter().filter_map(|g| g.split('/').nth(1).map(str::to_owned)).collect();
    ops.dedup();
    out.push_str("\nShare of copy per op (geometric mean over the op's cases):\n\n| provider |");
    for op in &ops {
        out.push_str(&format!(" {op} |"));
    }
    out.push_str(&format!("\n|---|{}\n", "---:|".repeat(ops.len())));
    for provider in PROVIDER_COLUMNS.iter().filter(|p| !matches!(**p, "copy")) {
        let cells: Vec<String> = ops
            .iter()
            .map(|op| {
                let prefix = format!("kernels/{op}/");
                let of_op = |g: &str| g.starts_with(&prefix);
                spread(&ratios(provider, "copy", &of_op)).map_or_else(|| "—".to_owned(), |(g, _, _)| fmt_percent(g))
            })
            .collect();
        if cells.iter().all(|c| c == "—") {
            continue;
        }
        out.push_str(&format!("| {provider} | {} |\n", cells.join(" | ")));
    }
    out.push('\n');
    out
}

/// The dispatch benchmark's groups for the overhead alone (a provider whose kernel does no work), by
/// the call they time.
const OVERHEAD_GROUPS: [(&str, &str); 2] = [
    ("rms_norm", "dispatch/overhead/rms_norm/1x4096"),
    ("fused_add_rms_norm_maybe_inplace", "dispatch/overhead/fused_add_rms_norm_maybe_inplace/1x4096"),
];

fn dispatch_table(results: &Results) -> String {
    let groups = results.groups("dispatch/");
    if groups.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "## Eager dispatch overhead\n\nThe typed entry point through the registry against calling the selected \
         kernel directly, bf16, with the CPU platform's two-entry list `[cpu, native]`. A call whose argument \
         metadata this thread saw before takes the provider and output metadata from its selection cache (one atomic \
         load of the generation that any change a selection could see advances, and the key comparison; no snapshot \
         load, predicate or meta function); the functional calls run a typed implementation on the caller's \
         borrowed arguments, and `maybe_inplace` an in-place one on the donated tensors, their outputs \
         checked where they are; the steady-state path allocates nothing beyond the kernel's own output \
         (counted by `tests/dispatch_alloc.rs`). What remains is the key comparison, the selection and \
         in-place counts, the output contract check and, for `maybe_inplace`, the donated tensors' \
         uniqueness checks. Both sides of each pair allocate the kernel's output.\n\n\
         | call | shape | direct | registry | overhead |\n|---|---|---:|---:|---:|\n",
    );
    for (call, group) in OVERHEAD_GROUPS {
        if let (Some(direct), Some(registry)) = (results.get(group, "direct"), results.get(group, "registry")) {
            out.push_str(&format!(
                "| `{call}`, no-op kernel (the overhead alone) | 1x4096 | {} | {} | {:+.0} ns |\n",
                fmt_time(direct.median_ns),
                fmt_time(registry.median_ns),
                registry.median_ns - direct.median_ns
            ));
        }
    }
    for group in &groups {
        let parts: Vec<&str> = group.split('/').collect();
        if let [_, call, shape] = parts.as_slice()
            && let (Some(direct), Some(registry)) = (results.get(group, "direct"), results.get(group, "registry"))
        {
            out.push_str(&format!(
                "| `{call}` | {shape} | {} | {} | {:+.0} ns |\n",
                fmt_time(direct.median_ns),
                fmt_time(registry.median_ns),
                registry.median_ns - direct.median_ns
            ));
        }
    }
    if let Some(select) = results.get("dispatch/select", "rms_norm") {
        out.push_str(&format!(
            "\nSelection alone (`Registry::select`: bind, meta function, predicates, on metadata): {}.\n",
            fmt_time(select.median_ns)
        ));
    }
    out.push('\n');
    out
}

fn passes_table(results: &Results) -> String {
    let Some(rows) = growth_rows(results, "passes/pipeline") else { return String::new() };
    let mut out = String::from(
        "## Passes\n\nThe standard pipeline (functionalize, fuse-add-rms-norm-exact, fuse-row-programs-exact, fuse-norm-quant, dce, lower, eliminate-clones, dce) with the graph \
         verified before the first pass and after each, on traced decoder graphs (a first `rms_norm`, then \
         layers of `scale` and a donating fused norm, each with its weight input). The graph is cloned \
         outside the timed region.\n\n",
    );
    out.push_str(&rows);
    if !results.passes.is_empty() {
        let names: Vec<String> = results.passes[0].passes.iter().map(|(n, _)| n.clone()).collect();
        out.push_str("\nOne run's time per pass (verification excluded), in ns per node:\n\n| nodes |");
        for n in &names {
            out.push_str(&format!(" {n} |"));
        }
        out.push_str("\n|---:|");
        out.push_str(&"---:|".repeat(names.len()));
        out.push('\n');
        for b in &results.passes {
            out.push_str(&format!("| {} |", b.nodes));
            for (_, seconds) in &b.passes {
                out.push_str(&format!(" {:.0} |", seconds * 1e9 / b.nodes.max(1) as f64));
            }
            out.push('\n');
        }
    }
    out.push_str("\n![pass time per node vs graph size](benchmarks/pass-time.svg)\n\n");
    out.push_str(&resident_table(results));
    if let Some(rows) = growth_rows(results, "passes/interpret") {
        out.push_str(
            "## Interpreter\n\nThe same decoder graphs, uncompiled, run by the interpreter with its safety checks \
             (each fused norm a `maybe_inplace` call through dispatch, in place); inputs are made outside the \
             timed region. The run must grow linearly with the graph.\n\n",
        );
        out.push_str(&rows);
        out.push('\n');
    }
    out.push_str(&toy_decoder(results));
    out
}

/// `vllm-ir opt`'s peak resident memory per graph size.
fn resident_table(results: &Results) -> String {
    let Some(study) = &results.rss else { return String::new() };
    let mut out = String::from(
        "### Resident memory of the compiler

`vllm-ir opt` on the same generated decoder, written as IR text (parse, verify, \
         the standard pipeline verified after every pass, the result written to a file), one process per \
         graph; peak RSS from the kernel's accounting of the finished process. *per node* is the peak above \
         the smallest graph's (the first norm only: the binary, its providers and their threads) divided by \
         the nodes.\n\n| nodes | input text | peak RSS | above the smallest graph | per node | time |\n|---:|---:|---:|---:|---:|---:|\n",
    );
    for run in std::iter::once(&study.baseline).chain(&study.runs) {
        let above = run.peak_bytes.saturating_sub(study.baseline.peak_bytes);
        let per_node = if std::ptr::eq(run, &study.baseline) {
            "—".to_owned()
        } else {
            format!("{:.0} B", study.bytes_per_node(run))
        };
        out.push_str(&format!(
            "| {} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {per_node} | {:.2} s |\n",
            run.nodes,
            run.text_bytes as f64 / MIB,
            run.peak_bytes as f64 / MIB,
            above as f64 / MIB,
            run.seconds
        ));
    }
    out.push('\n');
    out
}

/// The toy decoder's section: each form's median (eager functional, eager donating, compiled and
/// interpreted, and compiling).
fn toy_decoder(results: &Results) -> String {
    let rows: Vec<(&str, &str, f64)> = results
        .measurements
        .iter()
        .filter_map(|((group, function), m)| {
            group.strip_prefix("decoder/toy/").map(|shape| (shape, function.as_str(), m.median_ns))
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "## Toy decoder

`layers::toy::ToyDecoder` (the demo's model): per layer a fused add + norm with fp8 \
         quantization, rotary embedding of q and k (slices of one qkv buffer), a second norm + quantization and \
         `SiluAndMul`; the GEMMs and the attention are copy stand-ins, so the times are the non-GEMM work plus \
         those copies. bf16 on the cpu providers, shape T×H×layers; every form gives the same bits (checked before \
         timing). *compiled* is the donating trace after the standard pipeline, run by the interpreter with its \
         safety checks; *compile* is the standard pipeline itself.\n\n| shape | form | median |\n|---|---|---:|\n",
    );
    for (shape, function, median) in rows {
        out.push_str(&format!("| {shape} | {function} | {} |\n", fmt_time(median)));
    }
    out.push('\n');
    out
}

/// A table of a group measured at growing graph sizes: median, time per node, and growth.
fn growth_rows(results: &Results, group: &str) -> Option<String> {
    let mut rows: Vec<&super::Measurement> =
        results.measurements.iter().filter(|((g, _), _)| g == group).map(|(_, m)| m).collect();
    if rows.is_empty() {
        return None;
    }
    rows.sort_by_key(|m| m.per_iteration);
    let mut out = String::from(
        "| nodes | median | per node | time × vs previous | nodes × vs previous |\n|---:|---:|---:|---:|---:|\n",
    );
    let mut previous: Option<&super::Measurement> = None;
    for m in &rows {
        let nodes = m.per_iteration.unwrap_or(0);
        let growth = previous.map_or_else(
            || ("—".to_owned(), "—".to_owned()),
            |p| {
                (
                    format!("{:.1}×", m.median_ns / p.median_ns),
                    format!("{:.1}×", nodes as f64 / p.per_iteration.unwrap_or(1) as f64),
                )
            },
        );
        out.push_str(&format!(
            "| {nodes} | {} | {:.2} µs | {} | {} |\n",
            fmt_time(m.median_ns),
            m.median_ns / nodes.max(1) as f64 / 1e3,
            growth.0,
            growth.1
        ));
        previous = Some(m);
    }
    Some(out)
}

fn memory_table(results: &Results) -> String {
    let Some(memory) = &results.memory else { return String::new() };
    let mut out = format!(
        "## Memory\n\nThe norm decoder of the passes benchmark (`vllm_ir_bench::decoder`: a first `rms_norm`, then L layers of `scale` and fused add + norm), \
         {}×{} {} activations ({} B each), fused norms on `{}`, from the interpreter's statistics. \
         *Functional* is the trace with functional fused norms, interpreted as traced (an in-place provider \
         copies x and the residual of each); *maybe_inplace* is the donating trace interpreted without \
         passes (nothing proves the graph input dead, so the residual is copied once); *compiled* is the \
         donating trace after the standard pipeline. The floor is what the compiled run must allocate: the \
         first norm's output and the L scales.\n\n\
         | L | functional: allocated | copies | maybe_inplace: allocated | copies | compiled: allocated | copies | floor | saved vs functional | peak live (functional → compiled) | outputs equal |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|\n",
        memory.tokens, memory.hidden, memory.dtype, memory.activation_bytes, memory.fused_provider
    );
    for r in &memory.rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} → {} | {} |\n",
            r.layers,
            fmt_bytes(r.uncompiled.bytes_allocated),
            r.uncompiled.copies(),
            fmt_bytes(r.uncompiled_donating.bytes_allocated),
            r.uncompiled_donating.copies(),
            fmt_bytes(r.compiled.bytes_allocated),
            r.compiled.copies(),
            fmt_bytes(r.compiled_floor_bytes),
            fmt_bytes(r.saved_bytes),
            fmt_bytes(r.uncompiled.peak_live_bytes),
            fmt_bytes(r.compiled.peak_live_bytes),
            if r.bit_identical { "bit-identical" } else { "**differ**" }
        ));
    }
    out.push('\n');
    out
}

fn providers_section(results: &Results) -> String {
    if results.providers.is_empty() {
        return String::new();
    }
    let mut out = String::from("## Providers in this run\n\n");
    for p in &results.providers {
        let line = match (p.available, &p.reason) {
            (true, _) => format!(
                "- `{}`: measured{}",
                p.provider,
                p.device.as_ref().map(|d| format!(" on {d}")).unwrap_or_default()
            ),
            (false, Some(reason)) => format!("- `{}`: skipped: {reason}", p.provider),
            (false, None) => format!("- `{}`: skipped", p.provider),
        };
        out.push_str(&line);
        out.push('\n');
        for failure in &p.failures {
            out.push_str(&format!("  - **failed**: {failure}\n"));
        }
    }
    out.push('\n');
    out
}

/// The GPU report of `cargo xtask gpu-bench`: % of the device's nominal peak per case.
pub(crate) fn gpu(results: &Results, machine: &Machine) -> anyhow::Result<String> {
    let mut out = format!(
        "# GPU benchmarks\n\nGenerated by `cargo xtask gpu-bench` on {}, commit {}.\n\n",
        machine.date, machine.commit
    );
    out.push_str(&machine_section(machine));
    out.push_str("GB/s = bytes a call must move / median time; the fused op runs in place on the same buffers call after call; timing ends with a synchronizing download. Decode shapes are launch-bound (≤ 8 µs per call without graph capture).\n\n");
    out.push_str(
        "| provider | op | dtype | shape | median | GB/s | % of nominal peak |\n|---|---|---|---|---:|---:|---:|\n",
    );
    let mut any = false;
    for ((group, provider), m) in &results.measurements {
        let parts: Vec<&str> = group.split('/').collect();
        let [kind, op, dtype, shape] = parts.as_slice() else { continue };
        if *kind != "kernels" || !matches!(provider.as_str(), "cuda" | "rocm" | "xpu") {
            continue;
        }
        any = true;
        let device = results.providers.iter().find(|s| &s.provider == provider).and_then(|s| s.device.clone());
        let gb = m.gb_per_s().unwrap_or(0.0);
        let peak = device.as_deref().and_then(peak_for).map_or_else(
            || "unknown peak".to_owned(),
            |(name, peak)| format!("{:.1}% of {name} {peak:.0} GB/s", 100.0 * gb / peak),
        );
        out.push_str(&format!(
            "| {provider} | {op} | {dtype} | {shape} | {} | {gb:.1} | {peak} |\n",
            fmt_time(m.median_ns)
        ));
    }
    if !any {
        out.push_str("\nNo GPU provider could run on this machine:\n\n");
        out.push_str(&providers_section(results));
    }
    for t in targets(results).into_iter().filter(|t| t.name.starts_with("H200")) {
        out.push_str(&format!("\n{}: {} ({})\n", t.name, t.measured, t.status.text()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::{Measurement, ProviderStatus};
    use super::*;

    fn measure(results: &mut Results, group: &str, provider: &str, gbps: f64) {
        let m = Measurement {
            group: group.to_owned(),
            function: provider.to_owned(),
            median_ns: 1000.0,
            per_iteration: Some((gbps * 1000.0) as u64),
        };
        results.measurements.insert((group.to_owned(), provider.to_owned()), m);
    }

    /// A timing of `function` in `group`.
    fn timed(results: &mut Results, group: &str, function: &str, ns: f64) {
        let m =
            Measurement { group: group.to_owned(), function: function.to_owned(), median_ns: ns, per_iteration: None };
        results.measurements.insert((group.to_owned(), function.to_owned()), m);
    }

    #[test]
    fn every_no_op_overhead_decides_the_dispatch_target() {
        let dispatch = |results: &Results| {
            targets(results).into_iter().find(|t| t.name.starts_with("decode 1×4096: registry dispatch")).unwrap()
        };
        let mut results = Results::default();
        timed(&mut results, OVERHEAD_GROUPS[0].1, "direct", 20.0);
        timed(&mut results, OVERHEAD_GROUPS[0].1, "registry", 100.0);
        assert!(matches!(dispatch(&results).status, Status::Met), "one call, within 100 ns");
        timed(&mut results, OVERHEAD_GROUPS[1].1, "direct", 40.0);
        timed(&mut results, OVERHEAD_GROUPS[1].1, "registry", 250.0);
        let target = dispatch(&results);
        assert!(matches!(target.status, Status::Missed), "the maybe_inplace call is 210 ns over");
        assert!(
            target.measured.contains("fused_add_rms_norm_maybe_inplace, no-op kernel: +210 ns"),
            "{}",
            target.measured
        );
    }

    #[test]
    fn candle_per_call_rows_meet_the_target_only_under_both_bounds() {
        let target = |results: &Results| {
            targets(results).into_iter().find(|t| t.name.starts_with("`candle_ops` at one token")).unwrap()
        };
        let mut results = Results::default();
        assert!(matches!(target(&results).status, Status::NotMeasured(_)));
        assert!(candle_per_call_table(&results).contains("not measured"));
        let group = "candle_per_call/f32/1x256";
        timed(&mut results, group, "rms_norm/candle_ops", 600.0);
        timed(&mut results, group, "rms_norm/direct", 420.0);
        timed(&mut results, group, "rms_norm/candle-nn", 700.0);
        assert!(matches!(target(&results).status, Status::Met), "600 ≤ 700 and ≤ 1.2 × 420 + 100");
        timed(&mut results, group, "silu_and_mul/candle_ops", 900.0);
        timed(&mut results, group, "silu_and_mul/direct", 500.0);
        timed(&mut results, group, "silu_and_mul/candle-nn", 1000.0);
        let missed = target(&results);
        assert!(matches!(missed.status, Status::Missed), "900 > 1.2 × 500 + 100");
        assert!(missed.measured.contains("missed: silu_and_mul f32 1x256"), "{}", missed.measured);
        let table = candle_per_call_table(&results);
        assert!(
            table.contains("| f32 | 1x256 | rms_norm | 600 ns | 420 ns | 700 ns | 180 ns | yes | yes |"),
            "{table}"
        );
        assert!(table.contains("| silu_and_mul | 900 ns | 500 ns | 1.00 µs | 400 ns | yes | no |"), "{table}");
        // Rows are ordered by hidden size as a number, not as text.
        timed(&mut results, "candle_per_call/f32/1x1024", "rms_norm/candle_ops", 2000.0);
        let table = candle_per_call_table(&results);
        assert!(table.find("| 1x256 |").unwrap() < table.find("| 1x1024 |").unwrap(), "{table}");
    }

    #[test]
    fn the_summary_gives_geomean_best_and_worst_and_rejected_cells_show() {
        let mut results = Results::default();
        for (group, copy, cpu, native) in [
            ("kernels/silu_and_mul/bf16/1x4096", 10.0, 5.0, 1.0),
            ("kernels/silu_and_mul/bf16/4096x4096", 10.0, 8.0, 2.0),
        ] {
            measure(&mut results, group, "copy", copy);
            measure(&mut results, group, "cpu", cpu);
            measure(&mut results, group, "native", native);
        }
        results.providers.push(ProviderStatus {
            provider: "xpu".to_owned(),
            available: true,
            device: None,
            reason: None,
            failures: Vec::new(),
            rejected: vec![("kernels/silu_and_mul/bf16/1x4096".to_owned(), "dtype".to_owned())],
        });
        measure(&mut results, "kernels/silu_and_mul/bf16/4096x4096", "xpu", 4.0);
        let (geomean, best, worst) = spread(&[("a".to_owned(), 0.5), ("b".to_owned(), 0.8)]).unwrap();
        assert!((geomean - 0.4f64.sqrt()).abs() < 1e-12);
        assert_eq!((best.0.as_str(), worst.0.as_str()), ("b", "a"));
        let summary = provider_summary(&results);
        assert!(
            summary
                .contains("| cpu | 63% | 80% (silu_and_mul bf16 4096x4096) | 50% (silu_and_mul bf16 1x4096) | 4.5× |"),
            "{summary}"
        );
        assert!(summary.contains("| cpu | 63% |\n"), "per-op share\n{summary}");
        let table = kernel_tables(&results, "kernels/", "");
        assert!(table.contains("| silu_and_mul | bf16 | 1x4096 | 10.0 | 1.0 | 5.0 | rejected |"), "{table}");
    }
}
