//! `cargo xtask kernel-resources`: the GPU kernels' resource report, written to
//! `docs/kernel-resources.md` without a GPU. CUDA: every program NVRTC compiles, assembled by
//! `ptxas -v` for sm_80 and sm_90 (the `ptxas` test of `vllm-ir-kernels-cuda`, which also fails on any
//! spill or stack frame), with the occupancy each kernel reaches at 128- and 256-thread blocks.
//! ROCm: hipcc's resource remarks (`-Rpass-analysis=kernel-resource-usage`) for gfx90a.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{Context, bail};

use crate::{cargo, hipcc_cache, project_root};

/// One kernel as `ptxas -v` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CudaKernel {
    pub(crate) sm: String,
    pub(crate) program: String,
    pub(crate) kernel: String,
    pub(crate) registers: u32,
    pub(crate) shared_bytes: u32,
}

/// One kernel as hipcc's resource remarks report it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RocmKernel {
    pub(crate) kernel: String,
    pub(crate) vgprs: u32,
    pub(crate) sgprs: u32,
    pub(crate) scratch_bytes: u32,
    pub(crate) occupancy: u32,
    pub(crate) lds_bytes: u32,
}

/// Runs the sweeps and writes the report; with `render_only`, writes it from the last run's tables.
pub(crate) fn run(render_only: bool) -> anyhow::Result<()> {
    let dir = project_root().join("target/kernel-resources");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let table = dir.join("ptxas.tsv");
    let table_path = table.display().to_string();
    let loads_table = dir.join("sass-loads.tsv");
    let loads_path = loads_table.display().to_string();
    let isa_table = dir.join("isa-loads.tsv");
    let isa_path = isa_table.display().to_string();
    let generated_table = dir.join("generated-loads.tsv");
    let generated_path = generated_table.display().to_string();
    if !render_only {
        run_sweeps(&table_path, &loads_path, &isa_path, &generated_path)?;
    }
    let text = std::fs::read_to_string(&table).with_context(|| format!("reading {}", table.display()))?;
    let cuda = parse_ptxas_table(&text)?;
    let text = std::fs::read_to_string(&loads_table).with_context(|| format!("reading {}", loads_table.display()))?;
    let loads = parse_loads_table(&text)?;
    let rocm = parse_hipcc_remarks(&hipcc_report(&dir)?);
    if rocm.is_empty() {
        bail!("hipcc reported no kernel");
    }
    let text = std::fs::read_to_string(&isa_table).with_context(|| format!("reading {}", isa_table.display()))?;
    let isa_loads = parse_isa_loads(&text)?;
    let mut report = render(&cuda, &loads, &rocm);
    let text =
        std::fs::read_to_string(&generated_table).with_context(|| format!("reading {}", generated_table.display()))?;
    report.push_str(&render_generated_loads(&cuda, &loads, &text)?);
    report.push_str(&render_rocm_loads(&rocm, &isa_loads));
    let path = project_root().join("docs/kernel-resources.md");
    std::fs::write(&path, report).with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {} ({} CUDA kernels, {} ROCm kernels)", path.display(), cuda.len(), rocm.len());
    Ok(())
}

/// The `ptxas` and `hipcc` sweeps, writing their tables to the four paths.
fn run_sweeps(table_path: &str, loads_path: &str, isa_path: &str, generated_path: &str) -> anyhow::Result<()> {
    cargo(
        &[
            "test",
            "--locked",
            "--package",
            "vllm-ir-kernels-cuda",
            "--test",
            "ptxas",
            "--",
            "--ignored",
            "every_kernel",
        ],
        &[
            ("VLLM_IR_PTXAS_TABLE", table_path),
            ("VLLM_IR_SASS_LOADS_TABLE", loads_path),
            ("VLLM_IR_GENERATED_LOADS_TABLE", generated_path),
            ("VLLM_IR_REQUIRE", "nvrtc,ptxas,nvdisasm"),
        ],
    )?;
    cargo(
        &["test", "--locked", "--package", "vllm-ir-kernels-rocm", "--test", "hipcc", "--", "--ignored", "all_sources"],
        &[("VLLM_IR_ISA_LOADS_TABLE", isa_path), ("VLLM_IR_REQUIRE", "hip")],
    )
}

/// Reads the `ptxas` test's rows: architecture, program, kernel, registers, shared bytes.
pub(crate) fn parse_ptxas_table(text: &str) -> anyhow::Result<Vec<CudaKernel>> {
    text.lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [sm, program, kernel, registers, shared] = fields.as_slice() else {
                bail!("a ptxas table row has {} fields, not 5: {line:?}", fields.len());
            };
            Ok(CudaKernel {
                sm: (*sm).to_owned(),
                program: (*program).to_owned(),
                kernel: (*kernel).to_owned(),
                registers: registers.parse().with_context(|| format!("registers in {line:?}"))?,
                shared_bytes: shared.parse().with_context(|| format!("shared bytes in {line:?}"))?,
            })
        })
        .collect()
}

/// One vectorized norm kernel's loads in flight, as the `ptxas` test read them from its SASS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SassLoads {
    pub(crate) sm: String,
    pub(crate) program: String,
    pub(crate) kernel: String,
    pub(crate) threads_per_row: u32,
    /// The threads of the blocks it launches in.
    pub(crate) block: u32,
    /// The largest H launched with its threads per row (what its cache holds).
    pub(crate) up_to_hidden: u32,
    /// 16-byte loads a thread issues before it first reads one.
    pub(crate) loads: u32,
}

/// Reads the `ptxas` test's loads rows: architecture, program, kernel, threads per row, block size,
/// largest H, loads.
pub(crate) fn parse_loads_table(text: &str) -> anyhow::Result<Vec<SassLoads>> {
    text.lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [sm, program, kernel, threads_per_row, block, up_to_hidden, loads] = fields.as_slice() else {
                bail!("a loads table row has {} fields, not 7: {line:?}", fields.len());
            };
            let number = |field: &str, what: &str| -> anyhow::Result<u32> {
                field.parse().with_context(|| format!("{what} in {line:?}"))
            };
            Ok(SassLoads {
                sm: (*sm).to_owned(),
                program: (*program).to_owned(),
                kernel: (*kernel).to_owned(),
                threads_per_row: number(threads_per_row, "threads per row")?,
                block: number(block, "block size")?,
                up_to_hidden: number(up_to_hidden, "largest H")?,
                loads: number(loads, "loads")?,
            })
        })
        .collect()
}

/// H200: its SMs, its DRAM bandwidth (bytes/s), and the loaded DRAM latency Little's law assumes.
const H200_SMS: f64 = 132.0;
const H200_BANDWIDTH: f64 = 4.8e12;
const ASSUMED_LATENCY_S: f64 = 700e-9;

/// The model's ceiling, assumed (the first GPU run's `cargo xtask gpu-check` measures what it
/// stands for): the share of peak a streaming kernel with every load it needs in flight reaches,
/// 93% when it only reads, less by 10 points times the share of its traffic that is writes (the
/// bus turning around between reads and writes): 88% for a copy.
const H200_READ_EFFICIENCY: f64 = 0.93;
const H200_WRITE_COST: f64 = 0.10;

/// The rows (tokens) a prediction's tail wave is computed at: a prefill chunk.
pub(crate) const PREDICTED_ROWS: u64 = 4096;

/// The share of H200's peak bandwidth that `bytes_per_sm` in flight on every SM sustain, by
/// Little's law at [`ASSUMED_LATENCY_S`], uncapped: above 1, more bytes are in flight than the
/// peak needs.
pub(crate) fn littles_law_share(bytes_per_sm: f64) -> f64 {
    bytes_per_sm * H200_SMS / ASSUMED_LATENCY_S / H200_BANDWIDTH
}

/// The ceiling of a kernel whose DRAM traffic is `write_share` writes.
pub(crate) fn dram_efficiency(write_share: f64) -> f64 {
    H200_READ_EFFICIENCY - H200_WRITE_COST * write_share.clamp(0.0, 1.0)
}

/// A kernel's launch as the prediction sees it: its traffic, its blocks, and what one block does.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Launch {
    /// Bytes in flight on an SM (loads per thread × 16 B × resident threads).
    pub(crate) in_flight_per_sm: f64,
    /// The share of its DRAM traffic that is writes.
    pub(crate) write_share: f64,
    /// Blocks in the grid, and resident on an SM at once.
    pub(crate) blocks: u64,
    pub(crate) blocks_per_sm: u64,
    /// The DRAM bytes one block moves, and the barriers it waits at (its block reductions).
    pub(crate) bytes_per_block: f64,
    pub(crate) barriers_per_block: u32,
}

/// The share of the time an SM has a block with loads in flight: a block alternates between moving
/// its bytes (at the SM's share of the ceiling) and its barriers (nothing in flight), and with
/// several blocks resident the SM idles only while every one waits at a barrier.
pub(crate) fn busy_share(launch: &Launch) -> f64 {
    if launch.barriers_per_block == 0 {
        return 1.0;
    }
    let per_sm_bandwidth = H200_BANDWIDTH * dram_efficiency(launch.write_share) / H200_SMS;
    let moving = launch.bytes_per_block / per_sm_bandwidth;
    let waiting = f64::from(launch.barriers_per_block) * BARRIER_S;
    let idle = waiting / (moving + waiting);
    1.0 - idle.powi(i32::try_from(launch.blocks_per_sm.max(1)).unwrap_or(i32::MAX))
}

/// The predicted share of H200's peak a kernel achieves over its grid: every full wave of blocks
/// (`blocks_per_sm` on each SM) moves its bytes at Little's law on its bytes in flight, capped at
/// its traffic's ceiling times the share of the time its SM has loads in flight ([`busy_share`]);
/// the last, partial wave at the same law for the blocks left (fewer per SM, or fewer SMs busy).
pub(crate) fn predicted_achieved_share(launch: &Launch) -> f64 {
    let ceiling = dram_efficiency(launch.write_share) * busy_share(launch);
    let per_sm = launch.blocks_per_sm.max(1);
    let per_block = launch.in_flight_per_sm / per_sm as f64;
    // The share of peak while `resident` blocks are spread over `busy` SMs.
    let share = |resident: u64, busy: u64| {
        let per_busy_sm = resident as f64 / busy as f64;
        littles_law_share(per_block * per_busy_sm).min(ceiling) * busy as f64 / H200_SMS
    };
    let sms = H200_SMS as u64;
    let slots = per_sm * sms;
    let (full_waves, rest) = (launch.blocks / slots, launch.blocks % slots);
    // Time in units of one block's bytes at peak bandwidth.
    let mut time = full_waves as f64 * slots as f64 / share(slots, sms);
    if rest > 0 {
        time += rest as f64 / share(rest, rest.min(sms));
    }
    if time > 0.0 { launch.blocks as f64 / time } else { 0.0 }
}

/// The barriers a block of `kernel` waits at (`threads_per_row` threads a row, `block` threads),
/// from its structure in `kernels/gpu`: a block reduction (`block_reduce`) is log2(block) + 2
/// barriers; the norms' row sum past a warp is one, and the fused op waits once more before it
/// writes.
pub(crate) fn barriers_per_block(kernel: &str, block: u32, threads_per_row: u32) -> u32 {
    let reduction = block.max(2).ilog2() + 2;
    if kernel.starts_with("gelu_and_mul_sparse") || kernel.starts_with("norm_quant") {
        2 * reduction
    } else if kernel.starts_with("dynamic_per_token") {
        reduction
    } else if kernel.contains("rms_norm") {
        u32::from(threads_per_row > 32) + u32::from(kernel.starts_with("fused"))
    } else {
        0
    }
}

/// The DRAM bytes a block of `kernel` moves for `rows` rows of `width` elements: the norms read and
/// write x (the fused op the residual too), the gated ops read 2d and write d, the quantizations
/// read the row and write a byte per element.
pub(crate) fn bytes_per_block(kernel: &str, width: u32, rows: u32) -> f64 {
    let elements = f64::from(width) * f64::from(rows);
    let element = element_bytes(kernel);
    if kernel.contains("and_mul") {
        3.0 * elements * element
    } else if kernel.contains("quant") {
        elements * (element + 1.0)
    } else if kernel.starts_with("fused") {
        4.0 * elements * element
    } else {
        2.0 * elements * element
    }
}

/// The bytes of an element of a kernel's dtype, from its symbol (`silu_and_mul_bf16_vec`: 2).
fn element_bytes(kernel: &str) -> f64 {
    if kernel.contains("_f32") {
        4.0
    } else if kernel.contains("_f64") {
        8.0
    } else {
        2.0
    }
}

/// The share of a kernel's DRAM traffic that is writes: the norms write what they read (x, and the
/// fused op's residual); the gated ops read 2d and write d; a quantization writes one fp8 byte per
/// element read.
pub(crate) fn write_share(kernel: &str) -> f64 {
    if kernel.contains("and_mul") {
        1.0 / 3.0
    } else if kernel.contains("quant") {
        1.0 / (1.0 + element_bytes(kernel))
    } else {
        0.5
    }
}

/// The ceiling's statement, shared by the report's sections.
fn ceiling_statement() -> String {
    format!(
        "A prediction reads as achieved bandwidth, not as occupancy: Little's law (bytes in flight per SM × \
         {sms:.0} SMs / latency) gives the bandwidth the loads in flight could sustain, which is capped at the \
         model's ceiling, the share of peak a streaming kernel reaches at best ({read:.0}% when it only reads, less \
         {write:.0} points times the share of its traffic that is writes, assumed: a copy's {copy:.0}%). The grid \
         at {rows} rows runs in waves of the blocks resident at once, the last one partial: its blocks move their \
         bytes at the same law for their fewer bytes in flight (fewer blocks per SM, or fewer SMs busy). Barriers \
         are charged: a block waits at its barriers ({barrier:.0} ns each, assumed: a block reduction is \
         log2(block) + 2 of them) with nothing in flight, and its SM idles then unless another resident block is \
         moving bytes, so the ceiling is scaled by the share of the time some block on the SM is (each block \
         moving its bytes at the SM's share of the ceiling, then waiting). Not charged: L2 hits (a weight, or a \
         row read twice) and the launch.",
        sms = H200_SMS,
        read = H200_READ_EFFICIENCY * 100.0,
        write = H200_WRITE_COST * 100.0,
        copy = dram_efficiency(0.5) * 100.0,
        rows = PREDICTED_ROWS,
        barrier = BARRIER_S * 1e9,
    )
}

/// A program label's `key=value` (`dtype=bf16`).
fn label_field<'a>(program: &'a str, key: &str) -> Option<&'a str> {
    let at = program.find(&format!("{key}="))? + key.len() + 1;
    program[at..].split([',', ']']).next()
}

/// The loads-in-flight section: sm_90 vectorized norms with the weight in x's dtype.
fn render_loads(cuda: &[CudaKernel], loads: &[SassLoads]) -> String {
    let needed_kib = H200_BANDWIDTH * ASSUMED_LATENCY_S / H200_SMS / 1024.0;
    let mut out = format!(
        "\n## Loads in flight (CUDA norms, 16-byte path)\n\nRead from the SASS (`nvdisasm`) of every vectorized norm \
         kernel: the 16-byte loads a thread issues before the first instruction that reads one of them (the row \
         chunks it keeps in registers: x, and the residual for the fused op; the `ptxas` test fails when fewer are \
         in flight than it caches). Per sm_90 kernel with the weight in x's dtype, at the largest H of each \
         threads-per-row bucket: registers, resident threads per SM at the launch block (128 threads, 256 past 128 \
         threads per row), bytes in flight per thread and per SM, and the predicted share of H200 peak (4.8 TB/s, \
         132 SMs), with a loaded DRAM latency of {latency:.0} ns assumed (so {needed_kib:.1} KiB in flight per SM \
         reach the peak). {ceiling} A row shorter than its bucket's largest puts fewer chunks per thread in \
         flight: `fused_add_rms_norm` bf16 at H = 8192 (128 threads per row) issues 8 chunks of x and 8 of the \
         residual.\n\n| kernel | threads per row | up to H | registers | threads per SM | blocks per SM | \
         barriers per block | loads per thread | bytes in flight per SM | Little's law | predicted % of H200 peak \
         |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        latency = ASSUMED_LATENCY_S * 1e9,
        ceiling = ceiling_statement(),
    );
    let registers: BTreeMap<(&str, &str, &str), (u32, u32)> = cuda
        .iter()
        .map(|k| ((k.sm.as_str(), k.program.as_str(), k.kernel.as_str()), (k.registers, k.shared_bytes)))
        .collect();
    let mut rows: Vec<&SassLoads> = loads
        .iter()
        .filter(|l| {
            l.sm == "sm_90"
                && !is_chunk_kernel(l)
                && label_field(&l.program, "weight") == label_field(&l.program, "dtype")
        })
        .collect();
    rows.sort_by(|a, b| (a.kernel.as_str(), a.threads_per_row).cmp(&(b.kernel.as_str(), b.threads_per_row)));
    for row in rows {
        let Some(&(regs, shared)) = registers.get(&(row.sm.as_str(), row.program.as_str(), row.kernel.as_str())) else {
            continue;
        };
        let threads = (cuda_occupancy(&row.sm, regs, shared, row.block) * 64.0 * 32.0).round();
        let per_thread = f64::from(row.loads) * 16.0;
        let per_sm = per_thread * threads;
        let blocks_per_sm = threads as u64 / u64::from(row.block.max(1));
        let rows_per_block = (row.block / row.threads_per_row.max(1)).max(1);
        let launch = Launch {
            in_flight_per_sm: per_sm,
            write_share: write_share(&row.kernel),
            blocks: PREDICTED_ROWS.div_ceil(u64::from(rows_per_block)),
            blocks_per_sm,
            bytes_per_block: bytes_per_block(&row.kernel, row.up_to_hidden, rows_per_block),
            barriers_per_block: barriers_per_block(&row.kernel, row.block, row.threads_per_row),
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {regs} | {threads:.0} | {blocks_per_sm} | {} | {} | {:.0} KiB | {:.0}% | {:.0}% |",
            row.kernel,
            row.threads_per_row,
            row.up_to_hidden,
            launch.barriers_per_block,
            row.loads,
            per_sm / 1024.0,
            littles_law_share(per_sm) * 100.0,
            predicted_achieved_share(&launch) * 100.0
        );
    }
    out.push_str(&render_chunk_kernel_loads(&registers, loads));
    out.push_str(&render_decode(cuda));
    out
}

/// The decode latency model's constants, assumed: a kernel's launch and completion as the host's
/// stream sees them back to back (a CUDA graph cuts it), one unloaded DRAM round trip, and one
/// `__syncthreads` of a block of up to 256 threads with the shared-memory step of a block reduction
/// around it (about 60 cycles at 1.98 GHz).
const LAUNCH_S: f64 = 2.0e-6;
const DRAM_TRIP_S: f64 = 600e-9;
const BARRIER_S: f64 = 30e-9;

/// One kernel at the decode shape: one row of 4096 bf16 elements, alone on the GPU, so its time is
/// its launch, the memory round trips one after another (a load whose address or use waits for an
/// earlier one, and the last stores' completion) and its barriers, not bandwidth (8 KiB a row).
pub(crate) struct DecodeKernel {
    pub(crate) kernel: &'static str,
    /// What the row runs as: the block, the threads per row.
    pub(crate) shape: &'static str,
    pub(crate) trips: u32,
    pub(crate) barriers: u32,
    /// Where the round trips and barriers come from.
    pub(crate) why: &'static str,
}

/// The decode rows, from each kernel's structure (`kernels/gpu`): a block reduction of 256 threads
/// is 10 barriers (`block_reduce`: the write, 8 tree levels, the read).
pub(crate) const DECODE: [DecodeKernel; 7] = [
    DecodeKernel {
        kernel: "rms_norm_bf16",
        shape: "64 threads per row, 128-thread block",
        trips: 3,
        barriers: 1,
        why: "x; the weight, issued after the row sum; the stores. One barrier: the row sum past a warp",
    },
    DecodeKernel {
        kernel: "fused_add_rms_norm_bf16",
        shape: "64 threads per row, 128-thread block",
        trips: 3,
        barriers: 2,
        why: "x and the residual; the weight; the stores. The row sum's barrier, and the one before the first write",
    },
    DecodeKernel {
        kernel: "silu_and_mul_bf16_vec",
        shape: "256-thread block, d = 4096",
        trips: 2,
        barriers: 0,
        why: "the gate and up; the stores",
    },
    DecodeKernel {
        kernel: "gelu_and_mul_sparse_bf16_vec",
        shape: "256-thread block, d = 4096",
        trips: 2,
        barriers: 20,
        why: "the gate and up; the stores. Two block reductions (the gate's mean and std)",
    },
    DecodeKernel {
        kernel: "static_scaled_fp8_quant_bf16_vec",
        shape: "256-thread block",
        trips: 2,
        barriers: 0,
        why: "x and the scale; the stores",
    },
    DecodeKernel {
        kernel: "dynamic_per_token_scaled_fp8_quant_bf16_vec",
        shape: "256-thread block",
        trips: 2,
        barriers: 10,
        why: "x; the stores. One block reduction (the absmax)",
    },
    DecodeKernel {
        kernel: "norm_quant_bf16_vec",
        shape: "256-thread block (rms_norm + dynamic per-token quant)",
        trips: 3,
        barriers: 20,
        why: "x; the weight, at its use after the mean square; the stores. Two block reductions (the mean square, the absmax)",
    },
];

/// The predicted latency of a decode kernel, in seconds.
pub(crate) fn decode_latency(kernel: &DecodeKernel) -> f64 {
    LAUNCH_S + f64::from(kernel.trips) * DRAM_TRIP_S + f64::from(kernel.barriers) * BARRIER_S
}

/// The decode section: one row of 4096, a latency, not a share of peak.
fn render_decode(cuda: &[CudaKernel]) -> String {
    let mut out = format!(
        "\n## Decode (1 × 4096, bf16): predicted latency\n\nOne row is 8 KiB, which one SM's loads in flight move \
         within a round trip, so at the decode shape a kernel's time is its launch ({launch:.1} µs assumed, back to \
         back on a stream; a CUDA graph cuts it), its memory round trips one after another ({trip:.0} ns each, \
         unloaded DRAM, assumed: a load that waits for an earlier one, and the last stores' completion) and its \
         barriers ({barrier:.0} ns each, assumed), not a share of peak bandwidth. The round trips and barriers are \
         read from each kernel's source; the registers are sm_90's (the most over the kernel's variants).\n\n\
         | kernel | runs as | registers | round trips | barriers | predicted latency | where the time goes \
         |\n|---|---|---:|---:|---:|---:|---|\n",
        launch = LAUNCH_S * 1e6,
        trip = DRAM_TRIP_S * 1e9,
        barrier = BARRIER_S * 1e9,
    );
    for row in &DECODE {
        let registers = cuda
            .iter()
            .filter(|k| k.sm == "sm_90" && k.kernel == row.kernel)
            .map(|k| k.registers)
            .max()
            .map_or_else(|| "–".to_owned(), |r| r.to_string());
        let _ = writeln!(
            out,
            "| `{}` | {} | {registers} | {} | {} | {:.1} µs | {} |",
            row.kernel,
            row.shape,
            row.trips,
            row.barriers,
            decode_latency(row) * 1e6,
            row.why
        );
    }
    out
}

/// Whether a loads row is a 16-byte gated or quantization kernel's (the norms' kernels have no
/// `_vec` suffix).
fn is_chunk_kernel(row: &SassLoads) -> bool {
    row.kernel.ends_with("_vec")
}

/// The gated and quantization kernels' loads-in-flight rows: per sm_90 16-byte kernel and row
/// width, the block the host launches (`threads_per_row` in the row) and the loads a thread has in
/// flight at that width.
fn render_chunk_kernel_loads(registers: &BTreeMap<(&str, &str, &str), (u32, u32)>, loads: &[SassLoads]) -> String {
    let mut out = String::from(
        "\n## Loads in flight (CUDA gated activations and quantizations, 16-byte path)\n\nRead from the SASS of \
         every 16-byte gated and quantization kernel (`<kernel>_<dtype>_vec`); the `ptxas` test fails when fewer \
         loads than these are in flight before the first use of one. Gated: one block per row of a power of two of \
         threads, one step of two 16-byte chunks each (64 to 1024 threads: d = 8192 16-bit elements runs 512, so \
         two blocks share an SM and one's block reductions hide behind the other's loads); a step loads two chunks \
         of the gate and two of up (the first step before anything, the sparse op's statistics included, so a row \
         of up to two chunks per thread is read once). Quantizations: 256 threads per row; the static kernel loads two chunks per step, the dynamic \
         one keeps four chunks of x in registers, the norm + quantization four of x and four of the residual (a \
         row up to 8192 16-bit or 4096 f32 elements is read once). Per sm_90 kernel and row width: the block, \
         registers, resident threads per SM, 16-byte loads in flight per thread at that width, bytes in flight per \
         SM and the predicted share of H200 peak by the same model as above (one row per block).\n\n| kernel | row \
         width | block | registers | threads per SM | blocks per SM | barriers per block | loads per thread | bytes \
         in flight per SM | Little's law | predicted % of H200 peak |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\
         ---:|---:|\n",
    );
    let mut rows: Vec<&SassLoads> = loads.iter().filter(|l| l.sm == "sm_90" && is_chunk_kernel(l)).collect();
    rows.sort_by(|a, b| (a.kernel.as_str(), a.up_to_hidden).cmp(&(b.kernel.as_str(), b.up_to_hidden)));
    for row in rows {
        let Some(&(regs, shared)) = registers.get(&(row.sm.as_str(), row.program.as_str(), row.kernel.as_str())) else {
            continue;
        };
        let threads = (cuda_occupancy(&row.sm, regs, shared, row.block) * 64.0 * 32.0).round();
        let per_sm = f64::from(row.loads) * 16.0 * threads;
        let blocks_per_sm = threads as u64 / u64::from(row.block.max(1));
        let launch = Launch {
            in_flight_per_sm: per_sm,
            write_share: write_share(&row.kernel),
            blocks: PREDICTED_ROWS,
            blocks_per_sm,
            bytes_per_block: bytes_per_block(&row.kernel, row.up_to_hidden, 1),
            barriers_per_block: barriers_per_block(&row.kernel, row.block, row.block),
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {regs} | {threads:.0} | {blocks_per_sm} | {} | {} | {:.0} KiB | {:.0}% | {:.0}% |",
            row.kernel,
            row.up_to_hidden,
            row.block,
            launch.barriers_per_block,
            row.loads,
            per_sm / 1024.0,
            littles_law_share(per_sm) * 100.0,
            predicted_achieved_share(&launch) * 100.0
        );
    }
    out
}

/// One ROCm kernel's loads in flight, read from the gfx90a ISA by the `hipcc` test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IsaLoads {
    pub(crate) kernel: String,
    /// Threads per row (norms) or per block (gated, quantizations).
    pub(crate) threads: u32,
    /// The row width the count holds for.
    pub(crate) width: u32,
    /// 16-byte loads a thread issues before its first wait on vector memory.
    pub(crate) loads: u32,
}

/// Reads the `hipcc` test's rows: kernel, threads, width, loads.
pub(crate) fn parse_isa_loads(text: &str) -> anyhow::Result<Vec<IsaLoads>> {
    text.lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [kernel, threads, width, loads] = fields.as_slice() else {
                bail!("an ISA loads row has {} fields, not 4: {line:?}", fields.len());
            };
            let number = |field: &str, what: &str| -> anyhow::Result<u32> {
                field.parse().with_context(|| format!("{what} in {line:?}"))
            };
            Ok(IsaLoads {
                kernel: (*kernel).to_owned(),
                threads: number(threads, "threads")?,
                width: number(width, "width")?,
                loads: number(loads, "loads")?,
            })
        })
        .collect()
}

/// MI300X: its CUs, its HBM bandwidth (bytes/s), and the loaded memory latency Little's law
/// assumes for it.
const MI300X_CUS: f64 = 304.0;
const MI300X_BANDWIDTH: f64 = 5.3e12;
const MI300X_ASSUMED_LATENCY_S: f64 = 1e-6;

/// The share of MI300X's peak bandwidth that `bytes_per_cu` in flight on every CU sustain, by
/// Little's law at [`MI300X_ASSUMED_LATENCY_S`], capped at 1.
pub(crate) fn predicted_share_of_mi300x(bytes_per_cu: f64) -> f64 {
    (bytes_per_cu * MI300X_CUS / MI300X_ASSUMED_LATENCY_S / MI300X_BANDWIDTH).min(1.0)
}

/// The ROCm loads-in-flight section: every 16-byte kernel the `hipcc` test reads (norms with the
/// weight in x's dtype), with hipcc's occupancy, and the predicted share of MI300X's peak.
fn render_rocm_loads(rocm: &[RocmKernel], loads: &[IsaLoads]) -> String {
    let needed_kib = MI300X_BANDWIDTH * MI300X_ASSUMED_LATENCY_S / MI300X_CUS / 1024.0;
    let mut out = format!(
        "\n## Loads in flight (ROCm, 16-byte path)\n\nRead from the gfx90a ISA (`llvm-objdump`) of every 16-byte \
         norm (weight in x's dtype), gated and quantization kernel: the 16-byte loads a thread issues before its \
         first wait on vector memory (the `hipcc` test fails when fewer are in flight than the kernel caches or \
         loads per step), at the row width the count holds for (the norms: the largest H of the threads-per-row \
         bucket; gated: d = 16384 at 1024 threads; quantizations: H = 8192 for 16-bit, 4096 for f32). Waves per \
         SIMD are hipcc's occupancy; bytes in flight per CU = waves × 4 SIMDs × 64 lanes × loads × 16 B. The \
         predicted share of MI300X peak (5.3 TB/s, 304 CUs) is Little's law with a loaded memory latency of \
         {latency:.0} ns assumed (so {needed_kib:.1} KiB in flight per CU reach the peak), capped at 100%: it says \
         whether the loads in flight suffice, an upper bound, not the bandwidth achieved (no ceiling is assumed \
         for MI300X, whose achievable share nothing here has measured). The ISA \
         is gfx90a's (MI200), which the installed hipcc compiles; MI300X (gfx942) has the same CU and register \
         file, so the prediction carries over as an estimate.\n\n| kernel | threads | width | VGPRs | \
         waves/SIMD | loads per thread | bytes in flight per CU | predicted % of MI300X peak \
         |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
        latency = MI300X_ASSUMED_LATENCY_S * 1e9,
    );
    let remarks: BTreeMap<&str, &RocmKernel> = rocm.iter().map(|k| (k.kernel.as_str(), k)).collect();
    let mut rows: Vec<&IsaLoads> =
        loads.iter().filter(|l| !l.kernel.contains("rms_norm") || l.kernel.contains("_w1_")).collect();
    rows.sort_by(|a, b| a.kernel.cmp(&b.kernel));
    for row in rows {
        let Some(kernel) = remarks.get(row.kernel.as_str()) else { continue };
        let per_cu = f64::from(kernel.occupancy) * 4.0 * 64.0 * f64::from(row.loads) * 16.0;
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} | {} | {:.0} KiB | {:.0}% |",
            row.kernel,
            row.threads,
            row.width,
            kernel.vgprs,
            kernel.occupancy,
            row.loads,
            per_cu / 1024.0,
            predicted_share_of_mi300x(per_cu) * 100.0
        );
    }
    out
}

/// The share of an SM's 64 warp slots that `block`-thread blocks of a kernel fill on sm_80 and sm_90:
/// 65536 registers per SM allocated per warp in units of 256, at most 32 blocks and 64 warps per SM,
/// shared memory (164 KiB on sm_80, 228 KiB on sm_90) with 1 KiB reserved per block.
pub(crate) fn cuda_occupancy(sm: &str, registers: u32, shared_bytes: u32, block: u32) -> f64 {
    const REGISTERS_PER_SM: u32 = 65_536;
    const MAX_WARPS: u32 = 64;
    const MAX_BLOCKS: u32 = 32;
    let shared_per_sm: u32 = if sm == "sm_90" { 228 * 1024 } else { 164 * 1024 };
    let warps_per_block = block.div_ceil(32);
    let registers_per_warp = (registers.max(1) * 32).div_ceil(256) * 256;
    let by_registers = REGISTERS_PER_SM / (registers_per_warp * warps_per_block);
    let by_warps = MAX_WARPS / warps_per_block;
    let by_shared = shared_per_sm / (shared_bytes + 1024);
    let blocks = by_registers.min(by_warps).min(by_shared).min(MAX_BLOCKS);
    f64::from(blocks * warps_per_block) / f64::from(MAX_WARPS)
}

/// hipcc's remarks on every ROCm source compiled as one unit for gfx90a: the compile a `rocm` build
/// embeds, from the build script's cache when a build made it.
fn hipcc_report(dir: &std::path::Path) -> anyhow::Result<String> {
    let hipcc = std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
    let kernels = project_root().join("crates/kernels-rocm/kernels");
    match hipcc_cache::embed(&hipcc, &kernels, "gfx90a", dir, &dir.join("all.hsaco"), &crate::tools::hip_cache_dir()) {
        Ok(compiled) => Ok(compiled.report),
        Err(hipcc_cache::CompileFailure::Rejected(report)) => bail!("hipcc failed:\n{report}"),
        Err(hipcc_cache::CompileFailure::NotRunnable(error)) => {
            bail!("running `{hipcc}` (install Debian's hipcc, or set HIPCC): {error}")
        }
    }
}

/// Every kernel in hipcc's resource remarks (`Function Name: …` and the lines after it).
pub(crate) fn parse_hipcc_remarks(report: &str) -> Vec<RocmKernel> {
    let mut kernels: Vec<RocmKernel> = Vec::new();
    for line in report.lines() {
        let Some((_, remark)) = line.split_once("remark: ") else { continue };
        let remark = remark.split(" [-Rpass").next().unwrap_or_default().trim();
        let Some((key, value)) = remark.split_once(": ") else { continue };
        if key == "Function Name" {
            kernels.push(RocmKernel { kernel: value.to_owned(), ..RocmKernel::default() });
            continue;
        }
        let (Some(kernel), Ok(value)) = (kernels.last_mut(), value.parse::<u32>()) else { continue };
        match key {
            "VGPRs" => kernel.vgprs = value,
            "SGPRs" => kernel.sgprs = value,
            "ScratchSize [bytes/lane]" => kernel.scratch_bytes = value,
            "Occupancy [waves/SIMD]" => kernel.occupancy = value,
            "LDS Size [bytes/block]" => kernel.lds_bytes = value,
            _ => {}
        }
    }
    kernels
}

/// One kernel generated from a built-in row program, as the `ptxas` test describes its launch on
/// rows of [`GENERATED_WIDTH`] bf16 elements (an aligned call).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GeneratedLaunch {
    pub(crate) sm: String,
    /// `generated_<index>_<program>`.
    pub(crate) label: String,
    /// Global loads a thread issues before it first reads one, and of those the 16-byte ones.
    pub(crate) loads: u32,
    pub(crate) wide: u32,
    /// The 16-byte loads in flight at [`GENERATED_WIDTH`] (the SASS issues a bucket's longest row's).
    pub(crate) wide_at_width: u32,
    pub(crate) block: u32,
    pub(crate) threads_per_row: u32,
    /// DRAM bytes a row reads (its activations) and writes (its outputs).
    pub(crate) read_per_row: u32,
    pub(crate) written_per_row: u32,
    pub(crate) barriers: u32,
}

impl GeneratedLaunch {
    /// The program it was generated from.
    fn program(&self) -> &str {
        self.label.splitn(3, '_').nth(2).unwrap_or(&self.label)
    }
}

/// The row width the generated kernels are compiled and predicted at.
pub(crate) const GENERATED_WIDTH: u32 = 4096;

/// Reads the `ptxas` test's generated-kernel rows: architecture, label, loads, 16-byte loads,
/// 16-byte loads at the width, block, threads per row, bytes read and written per row, barriers.
pub(crate) fn parse_generated_table(text: &str) -> anyhow::Result<Vec<GeneratedLaunch>> {
    text.lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [sm, label, numbers @ ..] = fields.as_slice() else { bail!("an empty generated-kernel row") };
            let numbers: Vec<u32> = numbers
                .iter()
                .map(|field| field.parse().with_context(|| format!("{field:?} in {line:?}")))
                .collect::<anyhow::Result<_>>()?;
            let [loads, wide, wide_at_width, block, threads_per_row, read_per_row, written_per_row, barriers] =
                numbers.as_slice()
            else {
                bail!("a generated-kernel row has {} fields, not 10: {line:?}", fields.len());
            };
            Ok(GeneratedLaunch {
                sm: (*sm).to_owned(),
                label: (*label).to_owned(),
                loads: *loads,
                wide: *wide,
                wide_at_width: *wide_at_width,
                block: *block,
                threads_per_row: *threads_per_row,
                read_per_row: *read_per_row,
                written_per_row: *written_per_row,
                barriers: *barriers,
            })
        })
        .collect()
}

/// A kernel's launch at rows of [`GENERATED_WIDTH`], for the prediction: its resources, its row
/// geometry, its loads in flight per thread (16-byte ones and others, counted at 4 bytes), and the
/// traffic a row moves.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowLaunch {
    pub(crate) registers: u32,
    pub(crate) shared_bytes: u32,
    pub(crate) block: u32,
    pub(crate) threads_per_row: u32,
    pub(crate) wide_loads: u32,
    pub(crate) other_loads: u32,
    pub(crate) read_per_row: u32,
    pub(crate) written_per_row: u32,
    pub(crate) barriers: u32,
}

impl RowLaunch {
    /// Resident threads per SM on sm_90.
    fn threads_per_sm(&self) -> f64 {
        (cuda_occupancy("sm_90", self.registers, self.shared_bytes, self.block) * 64.0 * 32.0).round()
    }

    /// Bytes in flight per SM.
    fn in_flight_per_sm(&self) -> f64 {
        (f64::from(self.wide_loads) * 16.0 + f64::from(self.other_loads) * 4.0) * self.threads_per_sm()
    }

    /// The predicted share of H200's peak over [`PREDICTED_ROWS`] rows ([`predicted_achieved_share`]).
    fn predicted_share(&self) -> f64 {
        let rows_per_block = (self.block / self.threads_per_row.max(1)).max(1);
        let traffic = f64::from(self.read_per_row + self.written_per_row);
        let launch = Launch {
            in_flight_per_sm: self.in_flight_per_sm(),
            write_share: if traffic > 0.0 { f64::from(self.written_per_row) / traffic } else { 0.0 },
            blocks: PREDICTED_ROWS.div_ceil(u64::from(rows_per_block)),
            blocks_per_sm: self.threads_per_sm() as u64 / u64::from(self.block.max(1)),
            bytes_per_block: traffic * f64::from(rows_per_block),
            barriers_per_block: self.barriers,
        };
        predicted_achieved_share(&launch)
    }
}

/// The hand-written sm_90 kernel a generated one stands beside (bf16, rows of [`GENERATED_WIDTH`],
/// 16-byte path, the weight in x's dtype), launched as its host launches it there, with the traffic
/// of the generated kernel's program (the same op): its symbol and launch. None for a program no
/// hand-written kernel computes.
pub(crate) fn hand_written_beside(
    generated: &GeneratedLaunch,
    cuda: &[CudaKernel],
    loads: &[SassLoads],
) -> Option<(String, RowLaunch)> {
    let op = generated.program();
    let (kernel, row) = match op {
        "rms_norm" | "fused_add_rms_norm" => {
            let kernel = format!("{op}_bf16");
            let row = loads.iter().find(|l| {
                l.sm == "sm_90"
                    && l.kernel == kernel
                    && l.threads_per_row == generated.threads_per_row
                    && label_field(&l.program, "weight") == label_field(&l.program, "dtype")
            })?;
            (kernel, row)
        }
        _ => {
            let kernel = match op {
                "silu_and_mul" | "gelu_and_mul" | "gelu_and_mul_sparse" => format!("{op}_bf16_vec"),
                "static_scaled_fp8_quant" | "dynamic_per_token_scaled_fp8_quant" => format!("{op}_bf16_vec"),
                "rms_norm_static_fp8_quant"
                | "rms_norm_dynamic_per_token_quant"
                | "fused_add_rms_norm_static_fp8_quant"
                | "fused_add_rms_norm_dynamic_per_token_quant" => "norm_quant_bf16_vec".to_owned(),
                _ => return None,
            };
            let row =
                loads.iter().find(|l| l.sm == "sm_90" && l.kernel == kernel && l.up_to_hidden == GENERATED_WIDTH)?;
            (kernel, row)
        }
    };
    let resources = cuda.iter().find(|k| k.sm == row.sm && k.program == row.program && k.kernel == row.kernel)?;
    // A norm's row holds its bucket's longest row's chunks (x, and the residual for the fused op);
    // at the width each stream has the chunks the row has per thread.
    let wide_loads = if kernel.ends_with("_vec") {
        row.loads
    } else {
        let streams = if op.starts_with("fused") { 2 } else { 1 };
        let per_thread = (GENERATED_WIDTH / 8).div_ceil(row.threads_per_row.max(1));
        streams * (row.loads / streams).min(per_thread)
    };
    let launch = RowLaunch {
        registers: resources.registers,
        shared_bytes: resources.shared_bytes,
        block: row.block,
        threads_per_row: if kernel.ends_with("_vec") { row.block } else { row.threads_per_row },
        wide_loads,
        other_loads: 0,
        read_per_row: generated.read_per_row,
        written_per_row: generated.written_per_row,
        barriers: barriers_per_block(&kernel, row.block, row.threads_per_row),
    };
    Some((kernel, launch))
}

/// The kernels generated from the built-in row programs (the `ptxas` test's generated-kernel rows):
/// per sm_90 kernel in bf16 at rows of 4096, its registers, the loads a thread has in flight before
/// it first reads one, and the predicted share of H200's peak, beside the hand-written kernel of
/// the same op.
fn render_generated_loads(cuda: &[CudaKernel], loads: &[SassLoads], text: &str) -> anyhow::Result<String> {
    let mut out = format!(
        "\n## Loads in flight (CUDA kernels generated from row programs, bf16)\n\nRead from the SASS of the \
         kernel generated for every built-in row program (`ir_ops::row_program::builtin::all`, rows of \
         {GENERATED_WIDTH}): the global loads a thread issues before the first instruction that reads one, and how \
         many of them load 16 bytes, in the shape an aligned call launches (whole chunks). Every program but a \
         rotary one takes the hand-written norms' layout: at 4096 bf16 elements, 64 threads per row, each holding \
         up to 12 chunks of 16 bytes per activation stream in registers (the bucket's longest row, 6144 elements; \
         a gated program's gate and up, or a fused norm's x and residual, are two streams of 12 each), their loads \
         all issued before the first is used, as a hand-written norm's cached chunks are (the tables above: 12 for \
         `rms_norm` at 64 threads per row, 24 for `fused_add_rms_norm`). A rotary program walks its row by pairs \
         and loads one element per operand.\n\nThe prediction is the model above at rows of {GENERATED_WIDTH} \
         ({PREDICTED_ROWS} of them), where a thread holds 8 chunks of each stream: the loads in flight there (a \
         load of fewer than 16 bytes counted at 4), the blocks an SM holds by registers, the barriers a block waits \
         at (two per row reduction past a warp, log2(block) + 2 per block reduction of a walk, one after an \
         overflow rescue), and the DRAM bytes of the program's activations and outputs (weights in L2). The \
         hand-written kernel of the same op is predicted with the same traffic, at the block and loads its host \
         launches at that width.\n\n| kernel | registers | loads in flight | of 16 bytes | 16-byte loads at \
         {GENERATED_WIDTH} | threads per SM | barriers per block | predicted % of H200 peak | hand-written | its \
         registers | its 16-byte loads at {GENERATED_WIDTH} | its predicted % |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|\n"
    );
    for generated in parse_generated_table(text)? {
        let resources = cuda.iter().find(|k| k.sm == generated.sm && k.kernel == generated.label);
        let Some(resources) = resources else {
            bail!("no ptxas row for the generated kernel {}", generated.label);
        };
        let launch = RowLaunch {
            registers: resources.registers,
            shared_bytes: resources.shared_bytes,
            block: generated.block,
            threads_per_row: generated.threads_per_row,
            wide_loads: generated.wide_at_width,
            other_loads: generated.loads - generated.wide,
            read_per_row: generated.read_per_row,
            written_per_row: generated.written_per_row,
            barriers: generated.barriers,
        };
        let beside = match hand_written_beside(&generated, cuda, loads) {
            Some((kernel, hand)) => format!(
                "`{kernel}` | {} | {} | {:.0}%",
                hand.registers,
                hand.wide_loads,
                hand.predicted_share() * 100.0
            ),
            None => "— | | |".to_owned(),
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} | {:.0} | {} | {:.0}% | {beside} |",
            generated.label,
            resources.registers,
            generated.loads,
            generated.wide,
            generated.wide_at_width,
            launch.threads_per_sm(),
            generated.barriers,
            launch.predicted_share() * 100.0
        );
    }
    Ok(out)
}

/// A norm kernel's family (`rms_norm_bf16_w1_v8_t32` → `rms_norm_bf16`); other kernels are their own.
fn family(kernel: &str) -> &str {
    match kernel.find("_w") {
        Some(at) if kernel.contains("rms_norm") => &kernel[..at],
        _ => kernel,
    }
}

fn render(cuda: &[CudaKernel], loads: &[SassLoads], rocm: &[RocmKernel]) -> String {
    let mut out = String::from(
        "# GPU kernel resources\n\nGenerated by `cargo xtask kernel-resources` (no GPU needed). CI checks the same \
         compilations: no CUDA kernel spills or uses a stack frame (`tests/ptxas.rs`), no ROCm kernel uses scratch \
         memory (`tests/hipcc.rs`).\n\n## CUDA (NVRTC, then `ptxas -v`)\n\nPer architecture and kernel symbol, over \
         its compiled variants (dtype defines, weight, vector width, threads per row): registers per thread, the \
         most shared memory, and the occupancy (resident warps of the SM's 64) at 128- and 256-thread blocks for \
         the variant with the most registers.\n\n| arch | kernel | variants | registers | shared B | occupancy, 128 | \
         occupancy, 256 |\n|---|---|---:|---:|---:|---:|---:|\n",
    );
    let mut groups: BTreeMap<(&str, &str), Vec<&CudaKernel>> = BTreeMap::new();
    for k in cuda {
        groups.entry((k.sm.as_str(), k.kernel.as_str())).or_default().push(k);
    }
    for ((sm, kernel), list) in &groups {
        let low = list.iter().map(|k| k.registers).min().unwrap_or(0);
        let high = list.iter().map(|k| k.registers).max().unwrap_or(0);
        let shared = list.iter().map(|k| k.shared_bytes).max().unwrap_or(0);
        let registers = if low == high { low.to_string() } else { format!("{low}–{high}") };
        let at = |block| cuda_occupancy(sm, high, shared, block) * 100.0;
        let _ = writeln!(
            out,
            "| {sm} | `{kernel}` | {} | {registers} | {shared} | {:.0}% | {:.0}% |",
            list.len(),
            at(128),
            at(256)
        );
    }
    out.push_str(&render_loads(cuda, loads));
    out.push_str(
        "\n## ROCm (hipcc for gfx90a, resource remarks)\n\nPer kernel family (the norm variants grouped by op and \
         dtype): VGPRs and SGPRs per lane, scratch bytes per lane, LDS bytes per block, and the occupancy hipcc \
         reports (waves per SIMD, at most 8).\n\n| kernel | variants | VGPRs | SGPRs | scratch B | LDS B | waves/SIMD \
         |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut families: BTreeMap<&str, Vec<&RocmKernel>> = BTreeMap::new();
    for k in rocm {
        families.entry(family(&k.kernel)).or_default().push(k);
    }
    let range = |values: Vec<u32>| {
        let (low, high) = (values.iter().min().copied().unwrap_or(0), values.iter().max().copied().unwrap_or(0));
        if low == high { low.to_string() } else { format!("{low}–{high}") }
    };
    for (name, list) in &families {
        let _ = writeln!(
            out,
            "| `{name}` | {} | {} | {} | {} | {} | {} |",
            list.len(),
            range(list.iter().map(|k| k.vgprs).collect()),
            range(list.iter().map(|k| k.sgprs).collect()),
            list.iter().map(|k| k.scratch_bytes).max().unwrap_or(0),
            list.iter().map(|k| k.lds_bytes).max().unwrap_or(0),
            range(list.iter().map(|k| k.occupancy).collect()),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occupancy_follows_registers_warps_and_shared_memory() {
        // 32 registers: 2048 threads fit (64 warps), whatever the block.
        assert_eq!(cuda_occupancy("sm_80", 32, 0, 128), 1.0);
        assert_eq!(cuda_occupancy("sm_90", 32, 0, 256), 1.0);
        // 64 registers: 65536 / (64 * 32) = 32 warps = 50%.
        assert_eq!(cuda_occupancy("sm_80", 64, 0, 128), 0.5);
        // 40 registers are 1280 per warp (a whole number of 256-register units): 12 blocks of 4 warps.
        assert_eq!(cuda_occupancy("sm_80", 40, 0, 128), 48.0 / 64.0);
        // 42 registers round up to 1536 per warp: 10 blocks of 4 warps.
        assert_eq!(cuda_occupancy("sm_80", 42, 0, 128), 40.0 / 64.0);
        // 255 registers: 8 warps; a 256-thread block (8 warps) fits once.
        assert_eq!(cuda_occupancy("sm_80", 255, 0, 256), 8.0 / 64.0);
        // Shared memory: 48 KiB blocks, 1 KiB reserved each: 3 fit in 164 KiB, 4 in 228 KiB.
        assert_eq!(cuda_occupancy("sm_80", 32, 48 * 1024, 128), 12.0 / 64.0);
        assert_eq!(cuda_occupancy("sm_90", 32, 48 * 1024, 128), 16.0 / 64.0);
    }

    #[test]
    fn tables_and_remarks_are_read_back() {
        let rows =
            parse_ptxas_table("sm_80\trms_norm_bf16[...]\trms_norm_bf16\t40\t0\nsm_90\tq\tquant_f32\t30\t1024\n")
                .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[1],
            CudaKernel {
                sm: "sm_90".into(),
                program: "q".into(),
                kernel: "quant_f32".into(),
                registers: 30,
                shared_bytes: 1024
            }
        );
        assert!(parse_ptxas_table("sm_80\tonly\tthree\n").is_err());
        let remarks = "a.hip:1:1: remark: Function Name: rms_norm_bf16_w1_v8_t32 [-Rpass-analysis=kernel-resource-usage]\n\
            a.hip:1:1: remark:     SGPRs: 30 [-Rpass-analysis=kernel-resource-usage]\n\
            a.hip:1:1: remark:     VGPRs: 106 [-Rpass-analysis=kernel-resource-usage]\n\
            a.hip:1:1: remark:     ScratchSize [bytes/lane]: 0 [-Rpass-analysis=kernel-resource-usage]\n\
            a.hip:1:1: remark:     Occupancy [waves/SIMD]: 4 [-Rpass-analysis=kernel-resource-usage]\n\
            a.hip:1:1: remark:     LDS Size [bytes/block]: 16 [-Rpass-analysis=kernel-resource-usage]\n";
        let kernels = parse_hipcc_remarks(remarks);
        assert_eq!(
            kernels,
            [RocmKernel {
                kernel: "rms_norm_bf16_w1_v8_t32".into(),
                vgprs: 106,
                sgprs: 30,
                scratch_bytes: 0,
                occupancy: 4,
                lds_bytes: 16
            }]
        );
        assert_eq!(family("rms_norm_bf16_w1_v8_t32"), "rms_norm_bf16");
        assert_eq!(family("fused_add_rms_norm_f16_wf32_v1_t256"), "fused_add_rms_norm_f16");
        assert_eq!(family("silu_and_mul_bf16"), "silu_and_mul_bf16");
    }

    #[test]
    fn generated_kernels_are_predicted_beside_the_hand_written_kernel_of_their_op() {
        let text = "sm_90\tgenerated_00_rms_norm\t12\t12\t8\t128\t64\t8192\t8192\t2\n\
                    sm_90\tgenerated_31_rotary_neox\t1\t0\t0\t256\t256\t8192\t8192\t0\n";
        let generated = parse_generated_table(text).unwrap();
        assert_eq!(generated[0].program(), "rms_norm");
        assert_eq!((generated[0].wide_at_width, generated[0].block, generated[0].barriers), (8, 128, 2));
        assert!(parse_generated_table("sm_90\tgenerated_00_rms_norm\t12\t12\n").is_err());
        let program = "rms_norm.cu[dtype=bf16, weight=bf16, vec=true, threads_per_row=64]";
        let cuda = [
            CudaKernel {
                sm: "sm_90".into(),
                program: "generated_00_rms_norm".into(),
                kernel: "generated_00_rms_norm".into(),
                registers: 112,
                shared_bytes: 0,
            },
            CudaKernel {
                sm: "sm_90".into(),
                program: program.into(),
                kernel: "rms_norm_bf16".into(),
                registers: 113,
                shared_bytes: 0,
            },
        ];
        let loads = [SassLoads {
            sm: "sm_90".into(),
            program: program.into(),
            kernel: "rms_norm_bf16".into(),
            threads_per_row: 64,
            block: 128,
            up_to_hidden: 6144,
            loads: 12,
        }];
        // The hand-written norm at 4096: 8 of its 12 cached chunks are in the row; one barrier
        // (its row sum past a warp); the generated kernel's traffic.
        let (kernel, hand) = hand_written_beside(&generated[0], &cuda, &loads).unwrap();
        assert_eq!(kernel, "rms_norm_bf16");
        assert_eq!((hand.wide_loads, hand.barriers, hand.read_per_row, hand.registers), (8, 1, 8192, 113));
        // No hand-written rotary stands beside a generated one here.
        assert!(hand_written_beside(&generated[1], &cuda, &loads).is_none());
        // One more barrier per block, the rest alike: never a better prediction.
        let ours = RowLaunch { registers: 112, barriers: 2, ..hand };
        assert!(ours.predicted_share() <= hand.predicted_share());
        assert!(ours.predicted_share() > 0.5, "{}", ours.predicted_share());
        let section = render_generated_loads(&cuda, &loads, &text[..text.find('\n').unwrap() + 1]).unwrap();
        assert!(section.contains("| `generated_00_rms_norm` | 112 | 12 | 12 | 8 |"), "{section}");
        assert!(section.contains("`rms_norm_bf16` | 113 | 8 |"), "{section}");
        // A generated kernel the ptxas table lacks is an error, not a silent row.
        assert!(render_generated_loads(&cuda[1..], &loads, text).is_err());
    }

    #[test]
    fn rocm_loads_predict_a_share_of_mi300x_peak() {
        let loads =
            parse_isa_loads("silu_and_mul_bf16_vec\t1024\t16384\t4\nrms_norm_bf16_w0_v8_t32\t32\t3072\t12\n").unwrap();
        assert_eq!(
            loads[0],
            IsaLoads { kernel: "silu_and_mul_bf16_vec".into(), threads: 1024, width: 16384, loads: 4 }
        );
        assert!(parse_isa_loads("k\t1\t2\n").is_err());
        // 5.3 TB/s × 1 µs over 304 CUs is about 17 KiB per CU.
        assert!((predicted_share_of_mi300x(17_434.0) - 1.0).abs() < 1e-3);
        assert!((predicted_share_of_mi300x(4096.0) - 0.235).abs() < 1e-3);
        let rocm = [
            RocmKernel { kernel: "silu_and_mul_bf16_vec".into(), vgprs: 40, occupancy: 8, ..RocmKernel::default() },
            RocmKernel { kernel: "rms_norm_bf16_w0_v8_t32".into(), vgprs: 90, occupancy: 5, ..RocmKernel::default() },
        ];
        let section = render_rocm_loads(&rocm, &loads);
        assert!(section.contains("predicted % of MI300X peak"), "{section}");
        // 8 waves × 4 SIMDs × 64 lanes × 4 loads × 16 B = 128 KiB per CU; the norm without a
        // weight is not listed (only the weight in x's dtype).
        assert!(
            section.contains("| `silu_and_mul_bf16_vec` | 1024 | 16384 | 40 | 8 | 4 | 128 KiB | 100% |"),
            "{section}"
        );
        assert!(!section.contains("rms_norm_bf16_w0"), "{section}");
    }

    #[test]
    fn loads_in_flight_predict_a_share_of_peak() {
        let program = "rms_norm.cu[dtype=bf16, weight=bf16, vec=true, threads_per_row=128]";
        let loads =
            parse_loads_table(&format!("sm_90\t{program}\tfused_add_rms_norm_bf16\t128\t128\t16384\t32\n")).unwrap();
        assert_eq!((loads[0].block, loads[0].up_to_hidden, loads[0].loads), (128, 16384, 32));
        assert!(parse_loads_table("sm_90\tp\tk\t128\t32\n").is_err());
        assert_eq!((label_field(program, "dtype"), label_field(program, "weight")), (Some("bf16"), Some("bf16")));
        // Little's law: 4.8 TB/s × 700 ns over 132 SMs is about 24.9 KiB per SM.
        assert!((littles_law_share(25_454.0) - 1.0).abs() < 1e-3);
        assert!((littles_law_share(4096.0) - 0.161).abs() < 1e-3, "one load of 256 threads");
        assert!(littles_law_share(1e9) > 1.0);
        // The section names the column the report promises, and the kernel's row: 255 registers at
        // 128-thread blocks leave 256 threads, 32 loads of 16 bytes each: 128 KiB per SM.
        let cuda = [CudaKernel {
            sm: "sm_90".into(),
            program: program.into(),
            kernel: "fused_add_rms_norm_bf16".into(),
            registers: 255,
            shared_bytes: 32,
        }];
        let section = render_loads(&cuda, &loads);
        assert!(section.contains("predicted % of H200 peak"), "{section}");
        // 128 KiB per SM sustain 515% of peak by Little's law; the ceiling of a kernel writing half its
        // traffic is 88%; its two barriers cost nothing beside 128 KiB a block, and the last wave's
        // 136 blocks, about one per SM, still have 64 KiB each in flight.
        assert!(
            section.contains(
                "| `fused_add_rms_norm_bf16` | 128 | 16384 | 255 | 256 | 2 | 2 | 32 | 128 KiB | 515% | 88% |"
            ),
            "{section}"
        );
        // A gated row: 40 registers round up to 1280 per warp, so one 1024-thread block fits; two
        // loads of 16 bytes per thread are 32 KiB per SM. It stays out of the norms' table.
        let gated =
            parse_loads_table("sm_90\tsilu_and_mul_bf16\tsilu_and_mul_bf16_vec\t1024\t1024\t8192\t2\n").unwrap();
        let cuda = [CudaKernel {
            sm: "sm_90".into(),
            program: "silu_and_mul_bf16".into(),
            kernel: "silu_and_mul_bf16_vec".into(),
            registers: 40,
            shared_bytes: 0,
        }];
        let section = render_loads(&cuda, &gated);
        let (norms, gated) = section.split_once("gated activations and quantizations").unwrap();
        assert!(!norms.contains("silu_and_mul"), "{norms}");
        assert!(
            gated.contains("| `silu_and_mul_bf16_vec` | 8192 | 1024 | 40 | 1024 | 1 | 0 | 2 | 32 KiB | 129% | 87% |"),
            "{gated}"
        );
        // The decode section names a latency per kernel, with the registers of those in the table.
        let decode = render_decode(&cuda);
        assert!(
            decode.contains("| `silu_and_mul_bf16_vec` | 256-thread block, d = 4096 | 40 | 2 | 0 | 3.2 µs |"),
            "{decode}"
        );
        assert!(
            decode.contains("| `rms_norm_bf16` | 64 threads per row, 128-thread block | – | 3 | 1 | 3.8 µs |"),
            "{decode}"
        );
    }

    #[test]
    fn the_ceiling_the_tail_and_the_write_share_bound_a_prediction() {
        // Reads only: 93%; a copy: 88%; a gated op (a third writes) in between.
        assert!((dram_efficiency(0.0) - 0.93).abs() < 1e-12);
        assert!((dram_efficiency(0.5) - 0.88).abs() < 1e-12);
        assert!((write_share("silu_and_mul_bf16_vec") - 1.0 / 3.0).abs() < 1e-12);
        assert!((write_share("static_scaled_fp8_quant_f32_vec") - 0.2).abs() < 1e-12);
        assert!((write_share("fused_add_rms_norm_f16") - 0.5).abs() < 1e-12);
        // Little's law below the ceiling decides; above it, the ceiling does.
        let needed = H200_BANDWIDTH * ASSUMED_LATENCY_S / H200_SMS;
        let launch = |in_flight_per_sm| Launch {
            in_flight_per_sm,
            write_share: 0.5,
            blocks: 264,
            blocks_per_sm: 2,
            bytes_per_block: 65536.0,
            barriers_per_block: 0,
        };
        assert!((predicted_achieved_share(&launch(needed / 2.0)) - 0.5).abs() < 1e-9);
        assert!((predicted_achieved_share(&launch(needed * 4.0)) - 0.88).abs() < 1e-9);
        // Barriers: the sparse gated op at d = 8192 bf16 (48 KiB a row). One 1024-thread block per
        // SM waits at 24 barriers with nothing in flight: 59%. Two 512-thread blocks per SM (22
        // barriers each) hide most of them behind each other's loads: 81%.
        let (kernel, width) = ("gelu_and_mul_sparse_bf16_vec", 8192);
        assert_eq!(bytes_per_block(kernel, width, 1), 49152.0);
        let sparse = |block: u32, blocks_per_sm: u64, loads: f64| Launch {
            in_flight_per_sm: loads * 16.0 * 1024.0,
            write_share: write_share(kernel),
            blocks: PREDICTED_ROWS,
            blocks_per_sm,
            bytes_per_block: bytes_per_block(kernel, width, 1),
            barriers_per_block: barriers_per_block(kernel, block, block),
        };
        assert_eq!((barriers_per_block(kernel, 1024, 1024), barriers_per_block(kernel, 512, 512)), (24, 22));
        let before = predicted_achieved_share(&sparse(1024, 1, 2.0));
        let after = predicted_achieved_share(&sparse(512, 2, 4.0));
        assert!((before - 0.5884).abs() < 1e-3 && (after - 0.8135).abs() < 1e-3, "{before} {after}");
        // A lone block (a last wave of one) moves at its own Little's law on one SM of 132.
        let one = Launch { blocks: 1, ..sparse(512, 2, 4.0) };
        assert!(predicted_achieved_share(&one) < 1.0 / 132.0, "{}", predicted_achieved_share(&one));
        // The norms' row sum past a warp, and the fused op's barrier before its writes.
        assert_eq!(barriers_per_block("rms_norm_bf16", 128, 32), 0);
        assert_eq!(barriers_per_block("fused_add_rms_norm_bf16", 128, 64), 2);
        // Decode: the launch, the round trips, the barriers.
        let sparse = DECODE.iter().find(|k| k.kernel == "gelu_and_mul_sparse_bf16_vec").unwrap();
        assert!((decode_latency(sparse) - (2.0e-6 + 2.0 * 600e-9 + 20.0 * 30e-9)).abs() < 1e-12);
    }
}
