//! Every HIP kernel variant compiles with hipcc for gfx90a; no GPU needed. The two sweeps take
//! minutes, so `cargo test` lists them as ignored and `cargo xtask ci` runs them (`cargo test --test
//! hipcc -- --ignored`). Compiles go through the build script's cache (`hipcc_cache.rs`): the unit
//! of every source is the very compile a `rocm` build of this checkout embeds, so after one the
//! sweep reads its report instead of compiling again.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../hipcc_cache.rs"]
mod hipcc_cache;

/// The kernel sources.
fn kernels() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// The build script's cache: `VLLM_IR_KERNEL_CACHE`, else `kernel-cache` in the target directory.
fn cache_dir() -> PathBuf {
    match std::env::var_os("VLLM_IR_KERNEL_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_TARGET_TMPDIR")).parent().expect("the target directory").join("kernel-cache"),
    }
}

/// Compiles `sources` as one unit with `flags` into `dir` (or takes the cached compile) and returns
/// the code object's bytes and hipcc's report.
fn compile(hipcc: &str, dir: &Path, name: &str, sources: &[PathBuf], flags: &[String]) -> (Vec<u8>, String) {
    let output = dir.join(format!("{name}.hsaco"));
    let compile = hipcc_cache::Compile {
        hipcc,
        flags,
        kernels: &kernels(),
        sources,
        work_dir: dir,
        output: &output,
        cache: &cache_dir(),
    };
    let compiled = match compile.run() {
        Ok(compiled) => compiled,
        Err(hipcc_cache::CompileFailure::Rejected(log)) => panic!("hipcc failed on {name}:\n{log}"),
        Err(hipcc_cache::CompileFailure::NotRunnable(error)) => panic!("hipcc does not run: {error}"),
    };
    if compiled.cached {
        // On stderr itself, which libtest does not capture.
        let _ = writeln!(std::io::stderr(), "hipcc: {name}: the cached compile of these sources and flags");
    }
    (std::fs::read(&output).expect("hipcc wrote the code object"), compiled.report)
}

/// The element dtypes every kernel family is compiled for.
const DTYPES: [ir_core::DType; 4] =
    [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16, ir_core::DType::F64];

/// Every gated op's source compiles on its own (`build.rs` compiles them all as one unit, which
/// [`all_sources_compile_as_one_unit_and_no_kernel_uses_scratch`] checks with every norm variant)
/// and defines its kernel for every dtype.
#[test]
#[ignore = "GPU compile sweep (about a minute on 2 cores), run by `cargo xtask ci` and `cargo xtask kernels`"]
fn every_gated_source_compiles_on_its_own() {
    let hipcc = std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
    let probe = Command::new(&hipcc).arg("--version").output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        ir_core::testing::skip("hip", &format!("`{hipcc}` not found (install Debian's hipcc)"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("kernels-rocm-hipcc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gated: Vec<_> = kernels_rocm::gated::GATED_OPS.to_vec();
    std::thread::scope(|scope| {
        for op in &gated {
            let (hipcc, dir) = (&hipcc, &dir);
            scope.spawn(move || {
                let source = kernels().join(format!("{}.hip", op.def.name));
                let flags = ["--genco", "--offload-arch=gfx90a", "-O3"].map(str::to_owned);
                let (object, _) = compile(hipcc, dir, op.def.name, &[source], &flags);
                let text = String::from_utf8_lossy(&object);
                for dtype in DTYPES {
                    let symbol = op.kernel_name(dtype);
                    assert!(text.contains(&symbol), "the code object of {} lacks `{symbol}`", op.def.name);
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every kernel source together, as `build.rs` compiles them (one translation unit, so a name
/// defined twice fails here and not only as a build-script warning), defining every norm variant,
/// and no kernel (norms,
/// quantizations, rotary, copies) uses scratch memory (hipcc's resource report for each kernel).
#[test]
#[ignore = "GPU compile sweep (about a minute on 2 cores), run by `cargo xtask ci` and `cargo xtask kernels`"]
fn all_sources_compile_as_one_unit_and_no_kernel_uses_scratch() {
    let hipcc = std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
    if !Command::new(&hipcc).arg("--version").output().is_ok_and(|o| o.status.success()) {
        ir_core::testing::skip("hip", &format!("`{hipcc}` not found (install Debian's hipcc)"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("kernels-rocm-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sources = hipcc_cache::all_sources(&kernels());
    let (object, report) = compile(&hipcc, &dir, "all_kernels", &sources, &hipcc_cache::embed_flags("gfx90a"));
    let text = String::from_utf8_lossy(&object).into_owned();
    for variant in kernels_rocm::all_variants() {
        assert!(text.contains(&variant.symbol()), "the code object lacks `{}`", variant.symbol());
    }
    let mixed = kernel_support::NORM_QUANT_MIXED_KERNELS.map(|(_, kernel)| kernel);
    for kernel in kernels_rocm::quant::KERNELS.into_iter().chain(mixed) {
        for dtype in DTYPES {
            assert!(text.contains(&format!("{kernel}_{dtype}")), "the code object lacks `{kernel}_{dtype}`");
        }
        for dtype in &DTYPES[..3] {
            assert!(text.contains(&format!("{kernel}_{dtype}_vec")), "the code object lacks `{kernel}_{dtype}_vec`");
        }
    }
    // Each report line names the source line of the kernel it describes.
    let quant_scratch: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("ScratchSize") && (l.contains("/quant.h:") || l.contains("/norm_quant.h:")))
        .collect();
    // Every quantization kernel (those for a weight of another dtype included) in every dtype, and
    // its 16-byte form in all but f64.
    assert_eq!(
        quant_scratch.len(),
        (2 * DTYPES.len() - 1) * (kernels_rocm::quant::KERNELS.len() + mixed.len()),
        "one report per kernel:\n{report}"
    );
    assert!(quant_scratch.iter().all(|l| l.contains("ScratchSize [bytes/lane]: 0")), "{quant_scratch:#?}");
    // The norm kernels keep their cached chunks in registers (constant indices): no scratch in any
    // variant (a runtime index into the cache puts it in scratch: 144 or 272 bytes per lane).
    let norm_scratch: Vec<&str> =
        report.lines().filter(|l| l.contains("ScratchSize") && l.contains("/rms_norm.hip:")).collect();
    assert_eq!(norm_scratch.len(), kernels_rocm::all_variants().len(), "one report per norm kernel:\n{report}");
    assert!(norm_scratch.iter().all(|l| l.contains("ScratchSize [bytes/lane]: 0")), "{norm_scratch:#?}");
    let rotary_scratch: Vec<&str> =
        report.lines().filter(|l| l.contains("ScratchSize") && l.contains("/rotary.h:")).collect();
    assert_eq!(rotary_scratch.len(), DTYPES.len(), "one report per rotary kernel:\n{report}");
    assert!(rotary_scratch.iter().all(|l| l.contains("ScratchSize [bytes/lane]: 0")), "{rotary_scratch:#?}");
    for dtype in DTYPES {
        let symbol = format!("{}_{dtype}", kernels_rocm::rotary::KERNEL);
        assert!(text.contains(&symbol), "the code object lacks `{symbol}`");
    }
    // The strided copy (`clone`/`contiguous` on the device): one kernel per element size and the
    // wide copy of 16-byte units, the
    // strided conversion (`copy_` between dtypes, `scale`): one per pair of dtypes, and `add`/`mul`:
    // one per dtype; no scratch.
    let copy_scratch: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("ScratchSize") && (l.contains("/strided_copy.h:") || l.contains("/strided_convert.h:")))
        .collect();
    let expected = 5 + kernels_rocm::CONVERT_KERNELS.len() + kernels_rocm::BINARY_KERNELS.len();
    assert_eq!(copy_scratch.len(), expected, "one report per strided copy and conversion kernel:\n{report}");
    assert!(copy_scratch.iter().all(|l| l.contains("ScratchSize [bytes/lane]: 0")), "{copy_scratch:#?}");
    for size in [1, 2, 4, 8, 16] {
        assert!(text.contains(&format!("strided_copy_{size}")), "the code object lacks `strided_copy_{size}`");
    }
    let names =
        kernels_rocm::CONVERT_KERNELS.iter().map(|k| k.2).chain(kernels_rocm::BINARY_KERNELS.iter().map(|k| k.2));
    for name in names {
        assert!(text.contains(name), "the code object lacks `{name}`");
    }
    check_loads_in_flight(&dir, &object);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The llvm-objdump that disassembles gfx90a (`LLVM_OBJDUMP`, else the first of the usual names
/// whose targets include amdgcn; hipcc's LLVM installs one), or why there is none.
fn llvm_objdump() -> Result<String, String> {
    let names = std::env::var("LLVM_OBJDUMP").map(|name| vec![name]).unwrap_or_else(|_| {
        ["llvm-objdump", "llvm-objdump-15", "llvm-objdump-16", "llvm-objdump-17"].map(String::from).to_vec()
    });
    names
        .into_iter()
        .find(|name| {
            Command::new(name)
                .arg("--version")
                .output()
                .is_ok_and(|out| out.status.success() && String::from_utf8_lossy(&out.stdout).contains("amdgcn"))
        })
        .ok_or_else(|| "no llvm-objdump with the amdgcn target (install hipcc's LLVM, or set LLVM_OBJDUMP)".to_owned())
}

/// The code object for `target` (a triple ending, `gfx90a`) inside a clang offload bundle: the
/// magic `__CLANG_OFFLOAD_BUNDLE__`, the number of entries, then per entry its offset and size in
/// the file and its target triple (little-endian 64-bit numbers).
fn unbundle<'a>(bundle: &'a [u8], target: &str) -> Option<&'a [u8]> {
    const MAGIC: &[u8] = b"__CLANG_OFFLOAD_BUNDLE__";
    let number = |at: usize| -> Option<usize> {
        let bytes: [u8; 8] = bundle.get(at..at + 8)?.try_into().ok()?;
        usize::try_from(u64::from_le_bytes(bytes)).ok()
    };
    if !bundle.starts_with(MAGIC) {
        return None;
    }
    let mut at = MAGIC.len() + 8;
    for _ in 0..number(MAGIC.len())? {
        let (offset, size, length) = (number(at)?, number(at + 8)?, number(at + 16)?);
        let triple = bundle.get(at + 24..at + 24 + length)?;
        at += 24 + length;
        if triple.ends_with(target.as_bytes()) {
            return bundle.get(offset..offset.checked_add(size)?);
        }
    }
    None
}

/// How many 16-byte global loads a function's ISA issues before its first wait on vector memory
/// (an `s_waitcnt vmcnt(n)` with more than n vector memory operations outstanding; one with no
/// more outstanding waits for nothing): the loads a thread has in flight before it first waits.
/// The instructions are walked in the order they run when every lane is active and no early exit
/// is taken: an unconditional `s_branch` is followed (the compiler places a loop's body before its
/// header), a conditional branch falls through.
fn loads_before_first_wait(isa: &[&str]) -> usize {
    // Each line's address is in llvm-objdump's comment (`// 0000000138E8: BF820038`), a branch's
    // target after it as an offset from the function's start (`<name+0x1cc>`).
    let address = |line: &str| {
        let (_, comment) = line.split_once("//")?;
        u64::from_str_radix(comment.trim().split(':').next()?, 16).ok()
    };
    let start = isa.iter().find_map(|line| address(line));
    let target = |line: &str| {
        let offset = line.rsplit_once("+0x")?.1.strip_suffix('>')?;
        Some(start? + u64::from_str_radix(offset, 16).ok()?)
    };
    // The `n` of an `s_waitcnt` that waits on vector memory.
    let vmcnt = |instruction: &str| {
        let (_, rest) = instruction.strip_prefix("s_waitcnt")?.split_once("vmcnt(")?;
        rest.split(')').next()?.parse::<usize>().ok()
    };
    let (mut at, mut loads, mut outstanding) = (0, 0, 0);
    // A path longer than the function twice over is in a loop without loads or waits.
    for _ in 0..2 * isa.len() {
        let Some(line) = isa.get(at) else { break };
        let instruction = line.trim();
        if vmcnt(instruction).is_some_and(|n| outstanding > n) || instruction.starts_with("s_endpgm") {
            break;
        }
        if ["global_", "buffer_", "flat_"].iter().any(|p| instruction.starts_with(p)) {
            outstanding += 1;
        }
        if instruction.starts_with("global_load_dwordx4") {
            loads += 1;
        }
        at = match (instruction.starts_with("s_branch "), target(instruction)) {
            (true, Some(to)) => match isa.iter().position(|l| address(l) == Some(to)) {
                Some(position) => position,
                None => break,
            },
            _ => at + 1,
        };
    }
    loads
}

/// The 16-byte global loads a norm's second pass issues before its first 16-byte global store, in
/// listing order: the pass starts after the row reduction's last cross-lane step (a barrier or a
/// lane permute). The weight loads of a group of cached chunks must all come before its stores.
fn second_pass_loads_before_first_store(isa: &[&str]) -> usize {
    let reduction = |i: &str| i.starts_with("s_barrier") || i.starts_with("ds_bpermute") || i.starts_with("ds_swizzle");
    let start = isa.iter().rposition(|l| reduction(l.trim())).map_or(0, |at| at + 1);
    isa[start..]
        .iter()
        .map(|l| l.trim())
        .take_while(|i| !i.starts_with("global_store"))
        .filter(|i| i.starts_with("global_load_dwordx4"))
        .count()
}

/// The weight loads the norms' second pass issues before its first store (`NORM_WEIGHT_AHEAD` in
/// `kernels/gpu/rms_norm.h`), at most.
const WEIGHT_AHEAD: usize = 8;

#[test]
fn the_second_pass_reader_counts_the_loads_before_the_first_store() {
    let isa = [
        "global_load_dwordx4 v[4:7], v[2:3], off",
        "ds_bpermute_b32 v9, v8, v10",
        "global_load_dwordx4 v[12:15], v[10:11], off",
        "global_load_dwordx4 v[16:19], v[10:11], off offset:512",
        "v_mul_f32_e32 v4, v4, v9",
        "global_store_dwordx4 v[20:21], v[4:7], off",
        "global_load_dwordx4 v[24:27], v[10:11], off offset:1024",
    ];
    assert_eq!(second_pass_loads_before_first_store(&isa), 2);
}

/// The instructions of every function in llvm-objdump's listing (`<name>:` starts one, a blank
/// line ends it).
fn isa_functions(listing: &str) -> std::collections::HashMap<&str, Vec<&str>> {
    let mut functions = std::collections::HashMap::new();
    let mut current: Option<(&str, Vec<&str>)> = None;
    for line in listing.lines() {
        if let Some(name) = line.split_once(" <").and_then(|(_, rest)| rest.strip_suffix(">:")) {
            if let Some((name, code)) = current.take() {
                functions.insert(name, code);
            }
            current = Some((name, Vec::new()));
        } else if line.trim().is_empty() {
            if let Some((name, code)) = current.take() {
                functions.insert(name, code);
            }
        } else if let Some((_, code)) = current.as_mut() {
            code.push(line);
        }
    }
    if let Some((name, code)) = current {
        functions.insert(name, code);
    }
    functions
}

/// The 16-byte loads a norm variant caches (`kernels/gpu/rms_norm.h` follows kernel-support's rules): x's
/// chunks, and for the fused op x's and the residual's.
fn cached_loads(variant: &kernels_rocm::KernelVariant) -> usize {
    let (dtype, threads) = (variant.dtype, variant.threads_per_row);
    let loads = match variant.op {
        kernels_rocm::NormOp::RmsNorm => kernel_support::norm_cache_chunks(dtype, threads),
        kernels_rocm::NormOp::FusedAddRmsNorm => {
            2 * kernel_support::norm_fused_cache_chunks(dtype, threads, variant.vectorized)
        }
    };
    loads as usize
}

/// Every vectorized norm kernel issues the 16-byte loads of all the chunks it caches (x, and the
/// residual for the fused op) before its first wait on vector memory, read from the gfx90a ISA of
/// the code object the crate embeds.
fn check_loads_in_flight(dir: &Path, object: &[u8]) {
    let objdump = match llvm_objdump() {
        Ok(binary) => binary,
        Err(reason) => {
            ir_core::testing::skip("hip", &format!("{reason}: the loads in flight were not read from the ISA"));
            return;
        }
    };
    let elf = unbundle(object, "gfx90a").expect("the code object bundles a gfx90a object");
    let path = dir.join("all_kernels-gfx90a.elf");
    std::fs::write(&path, elf).unwrap();
    let out = Command::new(&objdump).args(["-d", "--mcpu=gfx90a"]).arg(&path).output().expect("llvm-objdump runs");
    assert!(out.status.success(), "llvm-objdump failed: {}", String::from_utf8_lossy(&out.stderr));
    let listing = String::from_utf8_lossy(&out.stdout);
    let functions = isa_functions(&listing);
    let (mut checked, mut weight_checked) = (0, 0);
    // `cargo xtask kernel-resources` asks for every checked kernel's loads in flight per thread
    // (symbol, threads per row or block, the row width the count holds for, loads) to predict its
    // share of MI300X's bandwidth.
    let mut table = String::new();
    for variant in kernels_rocm::all_variants().into_iter().filter(|v| v.vectorized) {
        let symbol = variant.symbol();
        let isa = functions.get(symbol.as_str()).unwrap_or_else(|| panic!("no ISA for {symbol}"));
        let (loads, cached) = (loads_before_first_wait(isa), cached_loads(&variant));
        assert!(
            loads >= cached,
            "{symbol} issues {loads} 16-byte loads before its first wait on vector memory; it caches {cached} chunks, \
             whose loads must all be in flight first"
        );
        // The second pass: a weight of x's dtype is loaded 16 bytes at a time, a group of cached
        // chunks' weight before the group's first store.
        let weight_loads = second_pass_loads_before_first_store(isa);
        if variant.weight == Some(variant.dtype) {
            let cached_chunks = match variant.op {
                kernels_rocm::NormOp::RmsNorm => cached,
                kernels_rocm::NormOp::FusedAddRmsNorm => cached / 2,
            };
            let wanted = cached_chunks.min(WEIGHT_AHEAD);
            assert!(
                weight_loads >= wanted,
                "{symbol}'s second pass issues {weight_loads} 16-byte loads before its first store; the weight loads \
                 of its first {wanted} cached chunks must be in flight first"
            );
            weight_checked += 1;
        }
        checked += 1;
        let up_to = kernel_support::largest_cached_row(variant.threads_per_row);
        table.push_str(&format!("{symbol}\t{}\t{up_to}\t{loads}\n", variant.threads_per_row));
    }
    let _ = writeln!(
        std::io::stderr(),
        "hipcc: every one of {checked} vectorized norm kernels has all its cached chunks' loads in flight before its first wait, \
         and each of the {weight_checked} with a weight of x's dtype its weight loads (a group of up to {WEIGHT_AHEAD}) before its first store"
    );
    // The 16-byte gated kernels: the first step's loads of GATED_UNROLL chunks, of the gate and of
    // up (4), issued before anything, the sparse op's statistics included.
    const GATED_UNROLL: usize = kernel_support::GATED_STEP_CHUNKS;
    let mut gated = Vec::new();
    for op in kernels_rocm::gated::GATED_OPS {
        for dtype in [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16] {
            let symbol = format!("{}_vec", op.kernel_name(dtype));
            let isa = functions.get(symbol.as_str()).unwrap_or_else(|| panic!("no ISA for {symbol}"));
            let wanted = 2 * GATED_UNROLL;
            let loads = loads_before_first_wait(isa);
            assert!(
                loads >= wanted,
                "{symbol} issues {loads} 16-byte loads before its first wait on vector memory; a step loads {wanted} \
                 chunks, whose loads must all be in flight first"
            );
            assert!(
                isa.iter().any(|line| line.trim().starts_with("global_store_dwordx4")),
                "{symbol}: no 16-byte store"
            );
            gated.push(format!("{symbol}: {loads}"));
            // The loads of a full step: two chunks per thread at the largest block, d = 16384.
            table.push_str(&format!("{symbol}\t{}\t16384\t{loads}\n", kernel_support::GATED_MAX_BLOCK));
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "hipcc: 16-byte gated kernels, loads in flight before the first wait: {}",
        gated.join(", ")
    );
    // The 16-byte quantizations: the static kernel's step of QUANT_UNROLL (2) chunks, the dynamic
    // kernel's QUANT_CACHE (4) cached chunks, and the norm + quantization's of x and the residual (8).
    let mut quant = Vec::new();
    for (kernel, wanted) in
        [("static_scaled_fp8_quant", 2), ("dynamic_per_token_scaled_fp8_quant", 4), ("norm_quant", 8)]
    {
        for dtype in [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16] {
            let symbol = format!("{kernel}_{dtype}_vec");
            let isa = functions.get(symbol.as_str()).unwrap_or_else(|| panic!("no ISA for {symbol}"));
            let loads = loads_before_first_wait(isa);
            assert!(
                loads >= wanted,
                "{symbol} issues {loads} 16-byte loads before its first wait on vector memory; it starts with \
                 {wanted} chunks, whose loads must all be in flight first"
            );
            quant.push(format!("{symbol}: {loads}"));
            // All the cached chunks: 4 per thread of 256 at H = 8192 (16-bit) or 4096 (f32).
            let up_to = 256 * 4 * kernel_support::gpu_chunk(dtype);
            table.push_str(&format!("{symbol}\t256\t{up_to}\t{loads}\n"));
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "hipcc: 16-byte quantization kernels, loads in flight before the first wait: {}",
        quant.join(", ")
    );
    // The wide strided copy moves each 16-byte unit with one 16-byte load and one 16-byte store.
    let wide = functions.get("strided_copy_16").expect("no ISA for strided_copy_16");
    for instruction in ["global_load_dwordx4", "global_store_dwordx4"] {
        assert!(wide.iter().any(|line| line.trim().starts_with(instruction)), "strided_copy_16: no {instruction}");
    }
    if let Ok(path) = std::env::var("VLLM_IR_ISA_LOADS_TABLE") {
        std::fs::write(&path, &table).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
}

#[test]
fn the_isa_readers_find_functions_loads_and_bundled_objects() {
    let listing = "\nall.elf:\tfile format elf64-amdgpu\n\n0000000000001000 <k>:\n\
        \ts_load_dwordx2 s[0:1], s[4:5], 0x0\n\
        \tglobal_load_dwordx4 v[2:5], v[2:3], off\n\
        \tglobal_load_dwordx4 v[6:9], v[2:3], off offset:16\n\
        \ts_waitcnt lgkmcnt(0)\n\
        \tglobal_load_dwordx4 v[10:13], v[2:3], off offset:32\n\
        \ts_waitcnt vmcnt(2)\n\
        \tglobal_load_dwordx4 v[14:17], v[2:3], off offset:48\n\n\
        0000000000002000 <other>:\n\ts_endpgm\n";
    let functions = isa_functions(listing);
    assert_eq!(functions.len(), 2);
    assert_eq!(loads_before_first_wait(&functions["k"]), 3, "a wait on scalar memory does not count");
    assert_eq!(loads_before_first_wait(&functions["other"]), 0);
    // A wait with no more vector memory operations outstanding than it allows waits for nothing.
    let idle = "0000000000004000 <idle>:\n\ts_waitcnt vmcnt(0)\n\tglobal_load_dwordx4 v[2:5], v[2:3], off\n\
        \tglobal_load_dword v6, v[2:3], off\n\ts_waitcnt vmcnt(2)\n\
        \tglobal_load_dwordx4 v[8:11], v[2:3], off\n\ts_waitcnt vmcnt(1)\n";
    assert_eq!(loads_before_first_wait(&isa_functions(idle)["idle"]), 2);
    // A loop whose body the compiler placed before its header: the branch into the header is
    // followed, the conditional skip falls through, and the jump back to the body reaches the wait.
    let rotated = "0000000000003000 <loop>:\n\
        \ts_branch 3                  // 000000003000: BF820003 <loop+0x10>\n\
        \ts_waitcnt vmcnt(0)          // 000000003004: BF8C0F70\n\
        \tv_add_f32_e32 v1, v1, v2    // 000000003008: 02020501\n\
        \ts_endpgm                    // 00000000300C: BF810000\n\
        \tglobal_load_dwordx4 v[2:5], v[2:3], off // 000000003010: DC5C8000 027F0002\n\
        \ts_cbranch_execz 65533       // 000000003018: BF88FFFD <loop+0x8>\n\
        \tglobal_load_dwordx4 v[6:9], v[2:3], off // 00000000301C: DC5C8000 067F0002\n\
        \ts_branch 65529              // 000000003024: BF82FFF9 <loop+0x4>\n";
    let functions = isa_functions(rotated);
    assert_eq!(loads_before_first_wait(&functions["loop"]), 2);
    // A bundle of a host entry and a gfx90a entry.
    let mut bundle = b"__CLANG_OFFLOAD_BUNDLE__".to_vec();
    let entries: [(&[u8], &[u8]); 2] =
        [(b"host-x86_64-unknown-linux", b""), (b"hipv4-amdgcn-amd-amdhsa--gfx90a", b"ELF")];
    bundle.extend(2u64.to_le_bytes());
    let header: usize = bundle.len() + entries.iter().map(|(t, _)| 24 + t.len()).sum::<usize>();
    let mut offset = header;
    for (triple, body) in entries {
        bundle.extend((offset as u64).to_le_bytes());
        bundle.extend((body.len() as u64).to_le_bytes());
        bundle.extend((triple.len() as u64).to_le_bytes());
        bundle.extend(triple);
        offset += body.len();
    }
    bundle.extend(b"ELF");
    assert_eq!(unbundle(&bundle, "gfx90a"), Some(&b"ELF"[..]));
    assert_eq!(unbundle(&bundle, "gfx942"), None);
    assert_eq!(unbundle(b"not a bundle", "gfx90a"), None);
}

/// The rotary kernel rounds each product on its own, as the reference does: its gfx90a ISA has no
/// f32 or f64 fused multiply-add (hipcc contracts `x * c - y * s` into one unless told not to).
#[test]
fn the_rotary_kernel_has_no_fused_multiply_add() {
    let hipcc = std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
    if !Command::new(&hipcc).arg("--version").output().is_ok_and(|o| o.status.success()) {
        ir_core::testing::skip("hip", &format!("`{hipcc}` not found (install Debian's hipcc)"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("kernels-rocm-rotary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels").join("rotary.hip");
    let output = dir.join("rotary.s");
    let done = Command::new(&hipcc)
        .args(["--offload-arch=gfx90a", "-O3", "--cuda-device-only", "-S", "-o"])
        .arg(&output)
        .arg(&source)
        .current_dir(&dir)
        .output()
        .expect("hipcc runs");
    assert!(done.status.success(), "hipcc failed on rotary.hip:\n{}", String::from_utf8_lossy(&done.stderr));
    let isa = std::fs::read_to_string(&output).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(isa.contains("v_mul_f32") && isa.contains("v_mul_f64"), "the products are in the ISA");
    let fused: Vec<&str> = isa
        .lines()
        .map(str::trim)
        .filter(|l| {
            ["v_fma_f32", "v_fmac_f32", "v_mad_f32", "v_mac_f32", "v_fma_mix", "v_mad_mix", "v_fma_f64"]
                .iter()
                .any(|i| l.starts_with(i))
        })
        .collect();
    assert!(fused.is_empty(), "fused multiply-adds in the rotary kernel: {fused:#?}");
}

#[test]
fn without_the_feature_or_a_device_the_provider_says_why() {
    let registry = ir_ops::registry();
    kernels_rocm::register(&registry).unwrap();
    let rocm = registry.providers("rms_norm").into_iter().find(|p| p.name == "rocm").unwrap();
    if let ir_core::Availability::Unavailable(reason) = rocm.availability {
        assert!(!reason.is_empty());
        if !cfg!(feature = "rocm") {
            assert_eq!(reason, "built without feature `rocm`");
        }
    }
}

/// A row program's generated HIP source compiles with hipcc at run time for gfx90a (what the
/// `rocm` provider does at a generated kernel's first use), into a code object holding the kernel;
/// the second compile reads the on-disk cache.
#[test]
fn a_generated_kernel_compiles_with_hipcc_and_is_cached() {
    let hipcc = kernels_rocm::program::hipcc();
    let probe = Command::new(&hipcc).arg("--version").output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        ir_core::testing::skip("hip", &format!("`{hipcc}` not found (install Debian's hipcc)"));
        return;
    }
    use ir_core::DType;
    use kernels_rocm::program::{CodeObjectOrigin, compile_code_object};
    let dir = std::env::temp_dir().join(format!("kernels-rocm-generated-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = kernel_support::program::DiskCache::new(&dir);
    let program = ir_ops::layer_norm::program(true, true);
    let binding = ir_ops::row_program::Binding {
        width: 4096,
        rows: 1,
        rows_shape: vec![1],
        compute: DType::F32,
        dtypes: vec![Some(DType::BF16), Some(DType::BF16), Some(DType::BF16), None],
        in_place: false,
    };
    let shape = kernel_support::program::RowShape::for_call(program, &binding, true);
    let (object, origin) = compile_code_object(program, &binding, shape, "gfx90a", Some(&cache))
        .unwrap_or_else(|error| panic!("hipcc rejected the generated layer_norm: {error}"));
    assert_eq!(origin, CodeObjectOrigin::Compiled);
    assert!(
        object.windows(kernel_support::program::ROW_PROGRAM_KERNEL.len()).any(|w| w == b"row_program"),
        "the code object holds the kernel"
    );
    let (again, origin) = compile_code_object(program, &binding, shape, "gfx90a", Some(&cache)).unwrap();
    assert_eq!(origin, CodeObjectOrigin::Cached);
    assert_eq!(again, object);
    let _ = std::fs::remove_dir_all(&dir);
}
