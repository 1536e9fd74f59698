//! Every CUDA kernel of this crate (both norm kernels of every norm program, the other op families in every dtype, the
//! strided copy and conversion) compiles to PTX with NVRTC for sm_80 and sm_90 and assembles
//! to SASS with `ptxas` with no register spill and no stack frame (local memory), and the resource report (registers per
//! thread, shared memory) of each is printed. No GPU needed: NVRTC makes the PTX and `ptxas` (the
//! `nvidia-cuda-nvcc-cu12` wheel ships it) assembles it; `PTXAS` names the binary, else `ptxas` on
//! `PATH`. Without it the test says so (`VLLM_IR_REQUIRE=ptxas` makes that a failure).
//!
//! The machine code of every vectorized norm kernel is read back with `nvdisasm` (the
//! `nvidia-cuda-nvdisasm` wheel; `NVDISASM` names the binary): a thread issues the 16-byte loads of
//! all the row chunks it keeps in registers (x, and the residual for the fused op) before the first
//! instruction that reads one of them, so its row costs one memory round trip. Without `nvdisasm`
//! the test says so (`VLLM_IR_REQUIRE=nvdisasm` makes that a failure). The sweep
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
    // The kernels generated from every built-in row program, in bf16 (rows of 4096).
    for (index, program) in ir_ops::row_program::builtin::all().into_iter().enumerate() {
        jobs.push(Box::new(move || {
            // The shape of an aligned call: whole chunks, 16-byte accesses.
            let binding = generated_binding(&program);
            let shape = kernel_support::program::RowShape::for_call(&program, &binding, true);
            let ptx = kernels_cuda::program::compile_ptx(&program, &binding, shape, Some(arch))
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", program.name()));
            (generated_label(index, &program), ptx.to_src())
        }));
    }
    jobs.push(Box::new(move || {
        let copy = kernels_cuda::copy::compile_ptx(Some(arch)).unwrap_or_else(|e| panic!("{e}"));
        for size in kernels_cuda::copy::ELEMENT_SIZES {
            let entry = format!(".entry strided_copy_{size}(");
            assert!(copy.to_src().contains(&entry), "the strided copy PTX lacks `{entry}`");
        }
        // The wide copy moves each 16-byte unit with one vector load and one vector store.
        let text = copy.to_src();
        let wide = text.split(".entry strided_copy_16(").nth(1).and_then(|rest| rest.split(".entry").next());
        let wide = wide.expect("the wide copy's PTX");
        let (loads, stores) = (wide.matches("ld.global.nc.v4.u32").count(), wide.matches("st.global.v4.u32").count());
        assert_eq!((loads, stores), (1, 1), "strided_copy_16 for {arch}: 16-byte loads and stores");
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

/// The label of built-in row program `index`'s generated kernel (`generated_<index>_<name>`), the
/// kernel's name in the resource table (every generated kernel's symbol is `row_program`).
fn generated_label(index: usize, program: &ir_ops::row_program::RowProgram) -> String {
    format!("generated_{index:02}_{}", program.name())
}

/// A bf16 call of `program` on rows of 4096 (f32 scalar tensors, i64 positions).
fn generated_binding(program: &ir_ops::row_program::RowProgram) -> ir_ops::row_program::Binding {
    use ir_ops::row_program::InputKind;
    let dtypes = program
        .inputs()
        .iter()
        .map(|input| match input.kind {
            InputKind::Scalar => None,
            InputKind::ScalarTensor => Some(DType::F32),
            InputKind::Positions => Some(DType::I64),
            _ => Some(DType::BF16),
        })
        .collect();
    ir_ops::row_program::Binding {
        width: 4096,
        rows: 1,
        rows_shape: vec![1],
        compute: DType::F32,
        dtypes,
        in_place: false,
    }
}

/// The cubin `assemble` writes for a program.
fn cubin_path(dir: &std::path::Path, label: &str, sm: &str) -> std::path::PathBuf {
    dir.join(format!("{}-{sm}.cubin", label.replace(|c: char| !c.is_ascii_alphanumeric(), "_")))
}

/// Assembles `ptx` for `sm` with `-v` into its cubin ([`cubin_path`]) and returns the report (ptxas
/// writes it on stderr).
fn assemble(ptxas: &str, dir: &std::path::Path, label: &str, sm: &str, ptx: &str) -> String {
    let file = dir.join(format!("{}-{sm}.ptx", label.replace(|c: char| !c.is_ascii_alphanumeric(), "_")));
    std::fs::write(&file, ptx).unwrap();
    let out = Command::new(ptxas)
        .args([&format!("-arch={sm}"), "-v", "-o"])
        .arg(cubin_path(dir, label, sm))
        .arg(&file)
        .output()
        .expect("ptxas runs");
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ptxas failed on {label} for {sm}:\n{report}");
    report
}

/// The nvdisasm binary, or why there is none.
fn nvdisasm() -> Result<String, String> {
    let binary = std::env::var("NVDISASM").unwrap_or_else(|_| "nvdisasm".to_owned());
    match Command::new(&binary).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(binary),
        _ => Err(format!(
            "`{binary}` not found (pip install nvidia-cuda-nvdisasm and put its bin on PATH, or set NVDISASM)"
        )),
    }
}

/// The SASS of every function in a cubin, by function name: one instruction per line, without
/// addresses and encodings.
fn disassemble(nvdisasm: &str, cubin: &std::path::Path) -> std::collections::BTreeMap<String, Vec<String>> {
    let out = Command::new(nvdisasm).arg("-c").arg(cubin).output().expect("nvdisasm runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "nvdisasm failed on {}: {}", cubin.display(), String::from_utf8_lossy(&out.stderr));
    sass_functions(&text)
}

/// Splits nvdisasm's listing into functions (`.text.<name>:` sections) of instructions.
fn sass_functions(listing: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut functions = std::collections::BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in listing.lines() {
        let trimmed = line.trim();
        if let Some(name) = trimmed.strip_prefix(".text.").and_then(|rest| rest.strip_suffix(':')) {
            if let Some((name, code)) = current.take() {
                functions.insert(name, code);
            }
            current = Some((name.to_owned(), Vec::new()));
            continue;
        }
        let Some((_, code)) = current.as_mut() else { continue };
        // `/*0150*/  @P0 LDG.E.128 <register>, desc[UR6][<register pair>] ;`
        let Some(rest) = trimmed.strip_prefix("/*").and_then(|r| r.split_once("*/")).map(|(_, r)| r.trim()) else {
            continue;
        };
        let instruction = rest.split(';').next().unwrap_or_default().trim();
        if !instruction.is_empty() {
            code.push(instruction.to_owned());
        }
    }
    if let Some((name, code)) = current {
        functions.insert(name, code);
    }
    functions
}

/// The registers an operand names: `R` and a number one, with `.64` two (a pair); `RZ` none.
fn operand_registers(operand: &str) -> Vec<u32> {
    let mut registers = Vec::new();
    let bytes = operand.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if bytes[i] == b'R' && starts_word {
            let digits = bytes[i + 1..].iter().take_while(|b| b.is_ascii_digit()).count();
            if digits > 0 {
                let number: u32 = operand[i + 1..i + 1 + digits].parse().expect("digits");
                let pair = operand[i + 1 + digits..].starts_with(".64");
                registers.push(number);
                if pair {
                    registers.push(number + 1);
                }
                i += 1 + digits;
                continue;
            }
        }
        i += 1;
    }
    registers
}

/// The opcode (with its modifiers) and the operands of an instruction, without its predicate.
fn opcode_and_operands(instruction: &str) -> (&str, Vec<&str>) {
    let instruction = match instruction.strip_prefix('@') {
        Some(rest) => rest.split_once(' ').map_or("", |(_, rest)| rest.trim_start()),
        None => instruction,
    };
    let (opcode, operands) = instruction.split_once(' ').unwrap_or((instruction, ""));
    (opcode, operands.split(',').map(str::trim).filter(|o| !o.is_empty()).collect())
}

/// How a thread's first pass issues its global loads: how many it issues before the first
/// instruction that reads a register one of them wrote (the loads in flight before the first wait),
/// and whether a shuffle (the row reduction, the end of the first pass) comes after them.
#[derive(Debug, PartialEq, Eq)]
struct FirstPass {
    /// Global loads issued before the first use of a loaded register.
    loads_before_first_use: usize,
    /// Of those, the 16-byte ones.
    wide_loads: usize,
    /// The first instruction that uses a loaded register, if any does before the reduction.
    first_use: Option<String>,
}

/// Reads the first pass of a kernel's SASS: the instructions before its first shuffle.
fn first_pass(code: &[String]) -> FirstPass {
    let mut pending: Vec<u32> = Vec::new();
    let (mut loads, mut wide) = (0, 0);
    for instruction in code {
        let (opcode, operands) = opcode_and_operands(instruction);
        if opcode.starts_with("SHFL") || opcode.starts_with("BAR") {
            break;
        }
        // The first operand is written, except by a store (its address and data are both read).
        let sources = if opcode.starts_with("ST") { &operands[..] } else { &operands[operands.len().min(1)..] };
        if sources.iter().flat_map(|o| operand_registers(o)).any(|r| pending.contains(&r)) {
            let first_use = Some(instruction.clone());
            return FirstPass { loads_before_first_use: loads, wide_loads: wide, first_use };
        }
        if opcode.starts_with("LDG") {
            let width = if opcode.contains(".128") {
                4
            } else if opcode.contains(".64") {
                2
            } else {
                1
            };
            if let Some(&first) = operand_registers(operands.first().copied().unwrap_or_default()).first() {
                pending.extend(first..first + width);
            }
            loads += 1;
            wide += usize::from(width == 4);
        } else if let Some(destination) = operands.first() {
            // A register written by anything else no longer holds a load's value.
            for r in operand_registers(destination) {
                pending.retain(|&p| p != r);
            }
        }
    }
    FirstPass { loads_before_first_use: loads, wide_loads: wide, first_use: None }
}

/// The weight loads of a norm's second pass (after its last shuffle or barrier, the end of the row
/// reduction): how many global loads it issues before its first global store.
fn second_pass_loads_before_first_store(code: &[String]) -> usize {
    let start = code
        .iter()
        .rposition(|i| {
            let opcode = opcode_and_operands(i).0;
            opcode.starts_with("SHFL") || opcode.starts_with("BAR")
        })
        .map_or(0, |at| at + 1);
    code[start..]
        .iter()
        .map(|i| opcode_and_operands(i).0)
        .take_while(|opcode| !opcode.starts_with("STG"))
        .filter(|opcode| opcode.starts_with("LDG"))
        .count()
}

/// The weight loads the norms' second pass issues before its first store (`NORM_WEIGHT_AHEAD` in
/// `kernels/gpu/rms_norm.h`), at most.
const WEIGHT_AHEAD: u32 = 8;

#[test]
fn the_second_pass_reader_counts_the_loads_before_the_first_store() {
    // Registers written `%n`, spelled as SASS spells them by the replacement (the repository's
    // citation lint reads an `R` and a number as a requirement citation).
    let code: Vec<String> = [
        "LDG.E.128 %4, [%2.64]",
        "SHFL.BFLY PT, %9, %8, 0x1, 0x1f",
        "LDG.E.128 %12, [%10.64]",
        "LDG.E.128 %16, [%10.64+0x200]",
        "FMUL %4, %4, %9",
        "STG.E.128 [%20.64], %4",
        "LDG.E.128 %24, [%10.64+0x400]",
    ]
    .map(|i| i.replace('%', "R"))
    .to_vec();
    assert_eq!(second_pass_loads_before_first_store(&code), 2);
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
fn the_first_pass_reader_counts_loads_before_their_first_use() {
    // Registers are written `%n` here and spelled as SASS spells them by `sass` (the repository's
    // citation lint reads an `R` and a number as a requirement citation).
    let sass = |text: &str| text.replace('%', "R");
    let listing = sass(
        "\t.text.k:\n\
        /*0000*/                   MOV %1, c[0x0][0x28] ;\n\
        /*0010*/                   LDG.E.128 %4, desc[UR4][%2.64] ;\n\
        /*0020*/               @P0 LDG.E.128 %8, desc[UR4][%2.64+0x200] ;\n\
        /*0030*/                   IADD3 %2, %2, 0x10, RZ ;\n\
        /*0040*/                   LDG.E.64 %12, desc[UR4][%2.64] ;\n\
        /*0050*/                   PRMT %16, %4, 0x7632, %16 ;\n\
        /*0060*/                   LDG.E %20, desc[UR4][%2.64+0x8] ;\n\
        /*0070*/                   SHFL.BFLY PT, %3, %2, 0x1, 0x1f ;\n\
        .text.other:\n\
        /*0000*/                   LDG.E.128 %4, desc[UR4][%2.64] ;\n\
        /*0010*/                   MOV %5, RZ ;\n\
        /*0020*/                   IMAD %6, %5, %5, RZ ;\n\
        /*0030*/                   SHFL.BFLY PT, %6, %4, 0x1, 0x1f ;\n",
    );
    let functions = sass_functions(&listing);
    assert_eq!(functions.len(), 2);
    assert_eq!(functions["k"][1], sass("LDG.E.128 %4, desc[UR4][%2.64]"));
    let pass = first_pass(&functions["k"]);
    assert_eq!((pass.loads_before_first_use, pass.wide_loads), (3, 2), "{pass:?}");
    assert_eq!(pass.first_use, Some(sass("PRMT %16, %4, 0x7632, %16")));
    // The load's second register overwritten before it is read is no use of the load; the shuffle
    // reads the first (the end of the pass).
    assert_eq!(
        first_pass(&functions["other"]),
        FirstPass { loads_before_first_use: 1, wide_loads: 1, first_use: None }
    );
    assert_eq!(operand_registers(&sass("desc[UR4][%2.64+0x10]")), [2, 3]);
    assert_eq!(operand_registers(&sass("-%14.H0_H0")), [14]);
    assert!(operand_registers("RZ").is_empty() && operand_registers("UR4").is_empty());
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
            for mut k in kernels {
                let clean = k.stack_bytes == 0 && k.spill_store_bytes == 0 && k.spill_load_bytes == 0;
                assert!(clean, "{label} for {sm}: {k:?} uses local memory or spills:\n{report}");
                if label.starts_with("generated_") {
                    k.kernel = label.clone();
                }
                table.push((sm, label.clone(), k));
            }
        }
    }
    let _ = writeln!(std::io::stderr(), "ptxas: assembled them in {:.0?}", start.elapsed());
    check_loads_in_flight(&dir);
    check_gated_loads_in_flight(&dir);
    check_fp8_conversions(&dir);
    check_quant_loads_in_flight(&dir);
    report_generated_loads(&dir);
    let _ = std::fs::remove_dir_all(&dir);
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

/// Every vectorized norm program's kernels, for both architectures: a thread issues the 16-byte
/// loads of every chunk it caches before it reads one (x: `cache_chunks`; the fused op x and the
/// residual, `fused_cache_chunks` of each). Prints the loads in flight per thread of each.
fn check_loads_in_flight(dir: &std::path::Path) {
    let nvdisasm = match nvdisasm() {
        Ok(binary) => binary,
        Err(reason) => {
            ir_core::testing::skip("nvdisasm", &format!("{reason}: the loads in flight were not read from the SASS"));
            return;
        }
    };
    let start = std::time::Instant::now();
    let jobs: Vec<(&str, kernels_cuda::NormProgram)> = ARCHS
        .iter()
        .flat_map(|&(_, sm)| all_programs().into_iter().filter(|p| p.vectorized).map(move |p| (sm, p)))
        .collect();
    // Each program's kernels: (the printed row, the table row), disassembled on every core.
    let check = |sm: &str, program: &kernels_cuda::NormProgram| -> Vec<(String, String)> {
        let label = program.to_string();
        let functions = disassemble(&nvdisasm, &cubin_path(dir, &label, sm));
        let mut found = Vec::new();
        for (op, cached) in
            [(NormOp::RmsNorm, program.cache_chunks()), (NormOp::FusedAddRmsNorm, 2 * program.fused_cache_chunks())]
        {
            let kernel = program.kernel(op).kernel_name();
            let code = functions.get(&kernel).unwrap_or_else(|| panic!("{label} for {sm}: no SASS for {kernel}"));
            let pass = first_pass(code);
            let loads = code.iter().filter(|i| opcode_and_operands(i).0.starts_with("LDG.E.128")).count();
            assert!(
                pass.loads_before_first_use >= cached as usize,
                "{label} for {sm}: {kernel} issues {} loads before it first reads one ({:?}); it caches {cached} \
                 chunks, whose loads must all be in flight first",
                pass.loads_before_first_use,
                pass.first_use
            );
            // The second pass: the weight loads of a group of cached chunks before its first store.
            let cached_chunks = match op {
                NormOp::RmsNorm => program.cache_chunks(),
                NormOp::FusedAddRmsNorm => program.fused_cache_chunks(),
            };
            let weight_loads = second_pass_loads_before_first_store(code);
            if program.weight.is_some() {
                let wanted = cached_chunks.min(WEIGHT_AHEAD) as usize;
                assert!(
                    weight_loads >= wanted,
                    "{label} for {sm}: {kernel}'s second pass issues {weight_loads} loads before its first store; \
                     the weight loads of its first {wanted} cached chunks must be in flight first"
                );
            }
            found.push((
                format!(
                    "  {sm} {kernel} ({label}): {} loads in flight before the first use, {cached} cached chunks, {loads} 16-byte loads in all, {weight_loads} weight loads before the first store",
                    pass.loads_before_first_use
                ),
                format!(
                    "{sm}\t{label}\t{kernel}\t{}\t{}\t{}\t{}\n",
                    program.threads_per_row,
                    program.block_size(),
                    kernels_cuda::largest_cached_row(program.threads_per_row),
                    pass.loads_before_first_use
                ),
            ));
        }
        found
    };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let found: Vec<(String, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .chunks(jobs.len().div_ceil(threads).max(1))
            .map(|chunk| {
                let check = &check;
                scope.spawn(move || chunk.iter().flat_map(|(sm, program)| check(sm, program)).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a disassembling thread")).collect()
    });
    let (rows, table): (Vec<String>, String) = found.into_iter().unzip();
    // `cargo xtask kernel-resources` asks for every row (architecture, program, kernel, threads per
    // row, block size, the largest H of the bucket, 16-byte loads in flight per thread) to predict
    // each kernel's share of peak bandwidth.
    if let Ok(path) = std::env::var(LOADS_ENV) {
        std::fs::write(&path, &table).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "nvdisasm: read {} vectorized norm kernels in {:.0?}; loads in flight per thread:",
        rows.len(),
        start.elapsed()
    );
    for row in rows {
        let _ = writeln!(err, "{row}");
    }
}

/// Every 16-byte gated kernel, for both architectures: a thread issues the loads of its first
/// `GATED_UNROLL` chunks of the gate and of up (4 loads) before it reads one, the sparse op's
/// statistics (which reduce over the block first) included.
fn check_gated_loads_in_flight(dir: &std::path::Path) {
    let Ok(nvdisasm) = nvdisasm() else { return };
    const GATED_UNROLL: usize = kernel_support::GATED_STEP_CHUNKS;
    const GATED_TABLE_WIDTHS: [usize; 4] = [2048, 4096, 8192, 14336];
    let (mut rows, mut table) = (Vec::new(), String::new());
    for (_, sm) in ARCHS {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for op in kernels_cuda::gated::GATED_OPS {
                let label = op.kernel_name(dtype);
                let functions = disassemble(&nvdisasm, &cubin_path(dir, &label, sm));
                let kernel = format!("{label}_vec");
                let code = functions.get(&kernel).unwrap_or_else(|| panic!("{label} for {sm}: no SASS for {kernel}"));
                // The first step's gate and up are loaded before anything, the sparse op's
                // statistics (which reduce over the block) included.
                let wanted = 2 * GATED_UNROLL;
                let pass = first_pass(code);
                assert!(
                    pass.loads_before_first_use >= wanted,
                    "{sm} {kernel} issues {} loads before it first reads one ({:?}); a step loads {wanted} chunks, \
                     whose loads must all be in flight first",
                    pass.loads_before_first_use,
                    pass.first_use
                );
                let stores = code.iter().filter(|i| opcode_and_operands(i).0.starts_with("STG.E.128")).count();
                assert!(stores > 0, "{sm} {kernel} has no 16-byte store");
                rows.push(format!(
                    "  {sm} {kernel}: {} loads in flight before the first use",
                    pass.loads_before_first_use
                ));
                // At a few widths: the block the host launches and the loads a thread has in flight
                // there (a row of fewer chunks than two per thread fills one slot).
                for d in GATED_TABLE_WIDTHS {
                    let block = kernel_support::gated_block(d, dtype) as usize;
                    let chunks = d.div_ceil(kernel_support::gpu_chunk(dtype)).div_ceil(block).min(GATED_UNROLL);
                    let loads = (2 * chunks).min(pass.loads_before_first_use);
                    table.push_str(&format!("{sm}\t{label}\t{kernel}\t{block}\t{block}\t{d}\t{loads}\n"));
                }
            }
        }
    }
    report_chunk_loads("gated", &rows, &table);
}

/// Every 16-byte quantization kernel, for both architectures: a thread issues the 16-byte loads of
/// the chunks it starts with before it reads one: `QUANT_UNROLL` (2) chunks of x per step for the
/// static kernel, the `QUANT_CACHE` (4) it keeps for the dynamic one, and those of x and the
/// residual (8) for the norm + quantization. Appends rows at a few hidden sizes to the loads table.
fn check_quant_loads_in_flight(dir: &std::path::Path) {
    let Ok(nvdisasm) = nvdisasm() else { return };
    const QUANT_BLOCK: usize = 256;
    const HIDDEN: [usize; 3] = [4096, 8192, 16384];
    let kernels =
        [("static_scaled_fp8_quant", 2, 1), ("dynamic_per_token_scaled_fp8_quant", 4, 1), ("norm_quant", 4, 2)];
    let (mut rows, mut table) = (Vec::new(), String::new());
    for (_, sm) in ARCHS {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let label = format!("quant_{dtype}");
            let functions = disassemble(&nvdisasm, &cubin_path(dir, &label, sm));
            for (name, chunks, rows_read) in kernels {
                let kernel = format!("{name}_{dtype}_vec");
                let code = functions.get(&kernel).unwrap_or_else(|| panic!("{label} for {sm}: no SASS for {kernel}"));
                let pass = first_pass(code);
                let wanted = chunks * rows_read;
                assert!(
                    pass.wide_loads >= wanted,
                    "{sm} {kernel} issues {} 16-byte loads before it first reads one ({:?}); it starts with {wanted} \
                     chunks, whose loads must all be in flight first",
                    pass.wide_loads,
                    pass.first_use
                );
                rows.push(format!("  {sm} {kernel}: {} 16-byte loads in flight before the first use", pass.wide_loads));
                for hidden in HIDDEN {
                    let per_thread = hidden.div_ceil(kernel_support::gpu_chunk(dtype)).div_ceil(QUANT_BLOCK);
                    let loads = (per_thread.min(chunks) * rows_read).min(pass.wide_loads);
                    table.push_str(&format!(
                        "{sm}\t{label}\t{kernel}\t{QUANT_BLOCK}\t{QUANT_BLOCK}\t{hidden}\t{loads}\n"
                    ));
                }
            }
        }
    }
    report_chunk_loads("quantization", &rows, &table);
}

/// The kernels generated from the built-in row programs, on sm_90: the global loads a thread issues
/// before it first reads one, and how many load 16 bytes (what `cargo xtask kernel-resources` puts
/// beside the hand-written kernels'; printed, and written to `VLLM_IR_GENERATED_LOADS_TABLE` as
/// rows of [`GeneratedLaunch::row`]). A generated kernel loads one element per operand per
/// column and uses it at once, so this is what its columns have in flight.
fn report_generated_loads(dir: &std::path::Path) {
    let Ok(nvdisasm) = nvdisasm() else { return };
    let (mut rows, mut table) = (Vec::new(), String::new());
    for (index, program) in ir_ops::row_program::builtin::all().iter().enumerate() {
        let label = generated_label(index, program);
        let functions = disassemble(&nvdisasm, &cubin_path(dir, &label, "sm_90"));
        let code = functions
            .get(kernel_support::program::ROW_PROGRAM_KERNEL)
            .unwrap_or_else(|| panic!("{label}: no SASS for the generated kernel"));
        let pass = first_pass(code);
        assert!(pass.loads_before_first_use >= 1, "{label}: no load before the first use: {pass:?}");
        rows.push(format!(
            "  sm_90 {label}: {} loads in flight before the first use ({} of 16 bytes)",
            pass.loads_before_first_use, pass.wide_loads
        ));
        let launch = GeneratedLaunch::of(program, &pass);
        table.push_str(&format!("sm_90\t{label}\t{}\n", launch.row()));
    }
    if let Ok(path) = std::env::var(GENERATED_LOADS_ENV) {
        std::fs::write(&path, table).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "nvdisasm: read {} generated kernels; loads in flight per thread:", rows.len());
    for row in rows {
        let _ = writeln!(err, "{row}");
    }
}

/// What the resource report's prediction needs of a generated kernel's launch on rows of 4096 bf16
/// elements ([`generated_binding`], an aligned call): its loads in flight, its block and row
/// geometry, the DRAM bytes a row moves, and the barriers a block waits at.
struct GeneratedLaunch {
    /// Global loads before the first use, and of those the 16-byte ones (the SASS's count).
    loads: usize,
    wide: usize,
    /// The 16-byte loads in flight at rows of 4096: each activation stream a thread caches holds
    /// `cached_chunks` chunks in the SASS, of which the row has `chunks_per_thread`.
    wide_at_width: usize,
    block: u32,
    threads_per_row: u32,
    /// DRAM bytes a row reads (its activations; weights and caches stay in L2) and writes.
    read_per_row: usize,
    written_per_row: usize,
    /// Barriers a block waits at: two per row reduction past a warp (`rp_row_reduce`), log2(block)
    /// + 2 per block reduction of a walk, and those the kernel's own source has.
    barriers: usize,
}

impl GeneratedLaunch {
    fn of(program: &ir_ops::row_program::RowProgram, pass: &FirstPass) -> GeneratedLaunch {
        use ir_ops::row_program::{Extent, Op};
        use kernel_support::program::RowShape;
        let binding = generated_binding(program);
        let shape = RowShape::for_call(program, &binding, true);
        let source = kernel_support::program::gpu_source(program, &binding, shape).unwrap();
        let kernel = source.split("extern \"C\"").nth(1).expect("the kernel's entry point");
        let block = shape.block();
        let (threads_per_row, wide_at_width) = match shape {
            RowShape::Chunks { threads_per_row, .. } => {
                let cached = kernel_support::program::cached_chunks(program, &binding, threads_per_row) as usize;
                let chunk = kernel_support::program::chunk_elements(program, &binding);
                let per_thread = binding.width.div_ceil(chunk).div_ceil(threads_per_row as usize);
                (threads_per_row, pass.wide_loads * cached.min(per_thread) / cached.max(1))
            }
            RowShape::Walk => (block, pass.wide_loads),
        };
        let row_reduce = if threads_per_row > 32 { 2 } else { 0 };
        let block_reduce = block.ilog2() as usize + 2;
        let barriers = kernel.matches("rp_row_reduce<").count() * row_reduce
            + (kernel.matches("block_sum<").count() + kernel.matches("block_max<").count()) * block_reduce
            + kernel.matches("__syncthreads();").count();
        let bytes = |dtype: DType| binding.width * dtype.size_in_bytes();
        let mut streams = Vec::new();
        for step in program.steps() {
            if let Op::Load { input, block } = step.op
                && !streams.contains(&(input, block))
            {
                streams.push((input, block));
            }
        }
        let read_per_row = streams.iter().map(|&(input, _)| bytes(binding.dtypes[input].unwrap())).sum();
        let written_per_row = program
            .outputs()
            .iter()
            .map(|output| match program.steps()[output.value.0 as usize].extent {
                Extent::Element => bytes(binding.output_dtype(output.dtype)),
                Extent::Row => binding.output_dtype(output.dtype).size_in_bytes(),
            })
            .sum();
        GeneratedLaunch {
            loads: pass.loads_before_first_use,
            wide: pass.wide_loads,
            wide_at_width,
            block,
            threads_per_row,
            read_per_row,
            written_per_row,
            barriers,
        }
    }

    /// The table's fields after the architecture and label: loads, 16-byte loads, 16-byte loads at
    /// the width, block, threads per row, bytes read and written per row, barriers per block.
    fn row(&self) -> String {
        let fields = [
            self.loads,
            self.wide,
            self.wide_at_width,
            self.block as usize,
            self.threads_per_row as usize,
            self.read_per_row,
            self.written_per_row,
            self.barriers,
        ];
        fields.map(|field| field.to_string()).join("\t")
    }
}

/// Where to write the generated kernels' loads table (tab-separated), when set.
const GENERATED_LOADS_ENV: &str = "VLLM_IR_GENERATED_LOADS_TABLE";

/// Appends a family's loads-table rows to the norms' (`cargo xtask kernel-resources`; the block
/// stands in the threads-per-row column, the row width in the largest-H one) and prints its
/// per-kernel lines.
fn report_chunk_loads(family: &str, rows: &[String], table: &str) {
    if let Ok(path) = std::env::var(LOADS_ENV) {
        let mut file = std::fs::OpenOptions::new().append(true).create(true).open(&path).unwrap();
        file.write_all(table.as_bytes()).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "nvdisasm: read {} 16-byte {family} kernels; loads in flight per thread:", rows.len());
    for row in rows {
        let _ = writeln!(err, "{row}");
    }
}

/// The quantization programs (every input dtype) and the strided conversions convert to fp8 with the
/// hardware's `F2FP.SATFINITE` on sm_90 (both formats), and in software on sm_80, which has none.
fn check_fp8_conversions(dir: &std::path::Path) {
    let Ok(nvdisasm) = nvdisasm() else { return };
    let labels = DTYPES.iter().map(|dtype| format!("quant_{dtype}")).chain(["strided_convert".to_owned()]);
    for label in labels {
        for (_, sm) in ARCHS {
            let functions = disassemble(&nvdisasm, &cubin_path(dir, &label, sm));
            let code: Vec<&String> = functions.values().flatten().collect();
            for format in ["E4M3", "E5M2"] {
                let converts = code.iter().any(|i| i.contains(&format!("F2FP.SATFINITE.{format}.F32")));
                assert_eq!(converts, sm == "sm_90", "{label} for {sm}: the hardware {format} conversion");
            }
        }
    }
    let _ = writeln!(std::io::stderr(), "nvdisasm: the fp8 conversions are the hardware's on sm_90, software on sm_80");
}

/// Where to write the loads-in-flight table (tab-separated), when set.
const LOADS_ENV: &str = "VLLM_IR_SASS_LOADS_TABLE";

/// Where to write the resource table (tab-separated), when set.
const TABLE_ENV: &str = "VLLM_IR_PTXAS_TABLE";
