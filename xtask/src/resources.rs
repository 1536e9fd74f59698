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

pub(crate) fn run() -> anyhow::Result<()> {
    let dir = project_root().join("target/kernel-resources");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let table = dir.join("ptxas.tsv");
    let table_path = table.display().to_string();
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
        &[("VLLM_IR_PTXAS_TABLE", table_path.as_str()), ("VLLM_IR_REQUIRE", "nvrtc,ptxas")],
    )?;
    let text = std::fs::read_to_string(&table).with_context(|| format!("reading {}", table.display()))?;
    let cuda = parse_ptxas_table(&text)?;
    let rocm = parse_hipcc_remarks(&hipcc_report(&dir)?);
    if rocm.is_empty() {
        bail!("hipcc reported no kernel");
    }
    let report = render(&cuda, &rocm);
    let path = project_root().join("docs/kernel-resources.md");
    std::fs::write(&path, report).with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {} ({} CUDA kernels, {} ROCm kernels)", path.display(), cuda.len(), rocm.len());
    Ok(())
}

/// Reads the `ptxas` test's rows: architecture, program, kernel, registers, shared bytes.
pub(crate) fn parse_ptxas_table(text: &str) -> anyhow::Result<Vec<CudaKernel>> {
    text.lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [sm, _program, kernel, registers, shared] = fields.as_slice() else {
                bail!("a ptxas table row has {} fields, not 5: {line:?}", fields.len());
            };
            Ok(CudaKernel {
                sm: (*sm).to_owned(),
                kernel: (*kernel).to_owned(),
                registers: registers.parse().with_context(|| format!("registers in {line:?}"))?,
                shared_bytes: shared.parse().with_context(|| format!("shared bytes in {line:?}"))?,
            })
        })
        .collect()
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
    match hipcc_cache::embed(&hipcc, &kernels, "gfx90a", dir, &dir.join("all.hsaco"), &crate::hip_cache_dir()) {
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

/// A norm kernel's family (`rms_norm_bf16_w1_v8_t32` → `rms_norm_bf16`); other kernels are their own.
fn family(kernel: &str) -> &str {
    match kernel.find("_w") {
        Some(at) if kernel.contains("rms_norm") => &kernel[..at],
        _ => kernel,
    }
}

fn render(cuda: &[CudaKernel], rocm: &[RocmKernel]) -> String {
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
            CudaKernel { sm: "sm_90".into(), kernel: "quant_f32".into(), registers: 30, shared_bytes: 1024 }
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
}
