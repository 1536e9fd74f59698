//! Every CUDA kernel of this crate (both norm kernels of every norm program, the other op families in every dtype, the
//! strided copy and conversion) compiles to PTX with NVRTC for sm_80 and sm_90 and assembles
//! to SASS with `ptxas` with no register spill and no stack frame (local memory), and the resource report (registers per
//! thread, shared memory) of each is printed. No GPU needed: NVRTC makes the PTX and `ptxas` (the
//! `nvidia-cuda-nvcc-cu12` wheel ships it) assembles it; `PTXAS` names the binary, else `ptxas` on
//! `PATH`. Without it the test says so (`VLLM_IR_REQUIRE=ptxas` makes that a failure). The sweep
//! takes minutes, so `cargo test` lists it as ignored and `cargo xtask ci` runs it (`cargo test
//! --test ptxas -- --ignored`).

use std::io::Write as _;
use std::process::Command;

use ir_core::DType;
use kernels_cuda::{NormOp, all_programs, compile_ptx, nvrtc_availability};

const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];
const ARCHS: [(&str, &str); 2] = [("compute_80", "sm_80"), ("compute_90", "sm_90")];

/// One kernel's resources, from `ptxas -v`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Resources {
    kernel: String,
    registers: u32,
    shared_bytes: u32,
    stack_bytes: u32,
    spill_store_bytes: u32,
    spill_load_bytes: u32,
}

/// The number before `unit` in `line` (`"12 bytes spill stores"`, `"Used 32 registers"`).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty())?.parse().ok()
}

/// Every entry function's resources in a `ptxas -v` report.
fn parse_report(report: &str) -> Vec<Resources> {
    let mut kernels: Vec<Resources> = Vec::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            kernels.push(Resources { kernel: name.to_owned(), ..Resources::default() });
            continue;
        }
        let Some(current) = kernels.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            current.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(u32::MAX);
            current.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(u32::MAX);
            current.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(u32::MAX);
        } else if line.contains("Used ") && line.contains(" registers") {
            current.registers = number_before(line, " registers").unwrap_or(u32::MAX);
            current.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    kernels
}

/// The ptxas binary, or why there is none.
fn ptxas() -> Result<String, String> {
    let binary = std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".to_owned());
    match Command::new(&binary).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(binary),
        _ => Err(format!(
            "`{binary}` not found (pip install nvidia-cuda-nvcc-cu12 and put its bin on PATH, or set PTXAS)"
        )),
    }
}

/// One program to compile: its label and how to make its PTX.
type Job = Box<dyn Fn() -> (String, String) + Send + Sync>;

/// Every program this crate compiles, for one architecture: (label, PTX), compiled on every core
/// (NVRTC compiles independent programs concurrently).
fn programs(arch: &'static str) -> Vec<(String, String)> {
    let mut jobs: Vec<Job> = Vec::new();
    for program in all_programs() {
        jobs.push(Box::new(move || {
            let ptx = compile_ptx(&program, Some(arch)).unwrap_or_else(|e| panic!("{program} for {arch}: {e}"));
            let text = ptx.to_src();
            for op in [NormOp::RmsNorm, NormOp::FusedAddRmsNorm] {
                let entry = format!(".entry {}(", program.kernel(op).kernel_name());
                assert!(text.contains(&entry), "{program}: PTX lacks `{entry}`");
            }
            let target = format!(".target sm_{}", &arch["compute_".len()..]);
            assert!(text.contains(&target), "{program}: PTX lacks `{target}`");
            (format!("{program}"), text)
        }))
    }
    for dtype in DTYPES {
        for op in kernels_cuda::gated::GATED_OPS {
            jobs.push(Box::new(move || {
                let ptx = kernels_cuda::gated::compile_ptx(op, dtype, Some(arch)).unwrap_or_else(|e| panic!("{e}"));
                (op.kernel_name(dtype), ptx.to_src())
            }));
        }
        jobs.push(Box::new(move || {
            let quant = kernels_cuda::quant::compile_ptx(dtype, Some(arch)).unwrap_or_else(|e| panic!("{e}"));
            (format!("quant_{dtype}"), quant.to_src())
        }));
        jobs.push(Box::new(move || {
            let rotary = kernels_cuda::rotary::compile_ptx(dtype, Some(arch)).unwrap_or_else(|e| panic!("{e}"));
            (format!("rotary_{dtype}"), rotary.to_src())
        }));
    }
    jobs.push(Box::new(move || {
        let copy = kernels_cuda::copy::compile_ptx(Some(arch)).unwrap_or_else(|e| panic!("{e}"));
        for size in kernels_cuda::copy::ELEMENT_SIZES {
            let entry = format!(".entry strided_copy_{size}(");
            assert!(copy.to_src().contains(&entry), "the strided copy PTX lacks `{entry}`");
        }
        ("strided_copy".to_owned(), copy.to_src())
    }));
    jobs.push(Box::new(move || {
        let convert = kernels_cuda::copy::compile_convert_ptx(Some(arch)).unwrap_or_else(|e| panic!("{e}"));
        let names = kernels_cuda::copy::CONVERT_KERNELS.iter().map(|k| k.2);
        for name in names.chain(kernels_cuda::copy::BINARY_KERNELS.iter().map(|k| k.2)) {
            let entry = format!(".entry {name}(");
            assert!(convert.to_src().contains(&entry), "the strided conversion PTX lacks `{entry}`");
        }
        ("strided_convert".to_owned(), convert.to_src())
    }));
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    // Every `threads`-th job to each thread, so the slow norm variants spread evenly.
    let mut compiled: Vec<(usize, (String, String))> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|first| {
                let jobs = &jobs;
                scope.spawn(move || (first..jobs.len()).step_by(threads).map(|i| (i, jobs[i]())).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a compiling thread")).collect()
    });
    compiled.sort_by_key(|(i, _)| *i);
    compiled.into_iter().map(|(_, program)| program).collect()
}

/// Assembles `ptx` for `sm` with `-v` and returns the report (ptxas writes it on stderr).
fn assemble(ptxas: &str, dir: &std::path::Path, label: &str, sm: &str, ptx: &str) -> String {
    let file = dir.join(format!("{}-{sm}.ptx", label.replace(|c: char| !c.is_ascii_alphanumeric(), "_")));
    std::fs::write(&file, ptx).unwrap();
    let out = Command::new(ptxas)
        .args([&format!("-arch={sm}"), "-v", "-o", "/dev/null"])
        .arg(&file)
        .output()
        .expect("ptxas runs");
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ptxas failed on {label} for {sm}:\n{report}");
    report
}

#[test]
fn the_report_parser_reads_registers_spills_and_shared_memory() {
    let report = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'rms_norm_bf16' for 'sm_80'\n\
        ptxas info    : Function properties for rms_norm_bf16\n    \
        8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
        ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem, 400 bytes cmem[0]\n\
        ptxas info    : Compiling entry function 'other' for 'sm_80'\n\
        ptxas info    : Function properties for other\n    \
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
        ptxas info    : Used 18 registers, 380 bytes cmem[0]\n";
    let parsed = parse_report(report);
    assert_eq!(
        parsed,
        [
            Resources {
                kernel: "rms_norm_bf16".into(),
                registers: 40,
                shared_bytes: 128,
                stack_bytes: 8,
                spill_store_bytes: 4,
                spill_load_bytes: 12
            },
            Resources { kernel: "other".into(), registers: 18, ..Resources::default() },
        ]
    );
}

#[test]
#[ignore = "GPU compile sweep (about 4 minutes on 2 cores), run by `cargo xtask ci` and `cargo xtask kernels`"]
fn every_kernel_compiles_and_assembles_without_spills_or_local_memory() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    // Every program compiles with NVRTC for both architectures, ptxas or not.
    let start = std::time::Instant::now();
    let compiled = ARCHS.map(|(arch, sm)| (sm, programs(arch)));
    let programs_per_arch = compiled[0].1.len();
    // On stderr itself, which libtest does not capture (`eprintln!` it does).
    let _ = writeln!(
        std::io::stderr(),
        "ptxas: NVRTC compiled {programs_per_arch} programs per architecture in {:.0?}",
        start.elapsed()
    );
    let start = std::time::Instant::now();
    let ptxas = match ptxas() {
        Ok(binary) => binary,
        Err(reason) => {
            ir_core::testing::skip("ptxas", &format!("{reason}: the PTX was compiled, not assembled"));
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("kernels-cuda-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut table = Vec::new();
    for (sm, programs) in compiled {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let reports: Vec<(String, String)> = std::thread::scope(|scope| {
            let handles: Vec<_> = programs
                .chunks(programs.len().div_ceil(threads))
                .map(|chunk| {
                    let (ptxas, dir) = (&ptxas, &dir);
                    scope.spawn(move || {
                        chunk
                            .iter()
                            .map(|(label, ptx)| (label.clone(), assemble(ptxas, dir, label, sm, ptx)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().flat_map(|h| h.join().expect("an assembling thread")).collect()
        });
        for (label, report) in reports {
            let kernels = parse_report(&report);
            assert!(!kernels.is_empty(), "{label} for {sm}: no entry function in the report:\n{report}");
            for k in kernels {
                let clean = k.stack_bytes == 0 && k.spill_store_bytes == 0 && k.spill_load_bytes == 0;
                assert!(clean, "{label} for {sm}: {k:?} uses local memory or spills:\n{report}");
                table.push((sm, label.clone(), k));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = writeln!(std::io::stderr(), "ptxas: assembled them in {:.0?}", start.elapsed());
    // The resource table, on stderr (which libtest does not capture): per architecture and kernel
    // symbol, the registers per thread over its variants and the most shared memory.
    let mut summary: std::collections::BTreeMap<(&str, &str), (u32, u32, u32, usize)> = Default::default();
    for (sm, _, k) in &table {
        let entry = summary.entry((sm, k.kernel.as_str())).or_insert((u32::MAX, 0, 0, 0));
        *entry = (entry.0.min(k.registers), entry.1.max(k.registers), entry.2.max(k.shared_bytes), entry.3 + 1);
    }
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "ptxas: {} kernels, no spills, no stack frame; registers per thread (min-max over variants), shared memory:",
        table.len()
    );
    for ((sm, kernel), (low, high, shared, variants)) in &summary {
        let _ = writeln!(err, "  {sm} {kernel}: {low}-{high} registers over {variants} variant(s), {shared} B smem");
    }
    let most = table.iter().map(|(_, _, k)| k.registers).max().unwrap_or(0);
    assert!(most <= 255, "a kernel asks for {most} registers");
    // `cargo xtask kernel-resources` asks for every row (architecture, program, kernel, registers,
    // shared bytes) as tab-separated lines, to compute occupancies for docs/kernel-resources.md.
    if let Ok(path) = std::env::var(TABLE_ENV) {
        let rows: String = table
            .iter()
            .map(|(sm, label, k)| format!("{sm}\t{label}\t{}\t{}\t{}\n", k.kernel, k.registers, k.shared_bytes))
            .collect();
        std::fs::write(&path, rows).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
}

/// Where to write the resource table (tab-separated), when set.
const TABLE_ENV: &str = "VLLM_IR_PTXAS_TABLE";
