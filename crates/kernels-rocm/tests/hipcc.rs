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
    for kernel in kernels_rocm::quant::KERNELS {
        for dtype in DTYPES {
            assert!(text.contains(&format!("{kernel}_{dtype}")), "the code object lacks `{kernel}_{dtype}`");
        }
    }
    // Each report line names the source line of the kernel it describes.
    let quant_scratch: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("ScratchSize") && (l.contains("/quant.hip:") || l.contains("/norm_quant.hip:")))
        .collect();
    assert_eq!(
        quant_scratch.len(),
        DTYPES.len() * kernels_rocm::quant::KERNELS.len(),
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
        report.lines().filter(|l| l.contains("ScratchSize") && l.contains("/rotary.hip:")).collect();
    assert_eq!(rotary_scratch.len(), DTYPES.len(), "one report per rotary kernel:\n{report}");
    assert!(rotary_scratch.iter().all(|l| l.contains("ScratchSize [bytes/lane]: 0")), "{rotary_scratch:#?}");
    for dtype in DTYPES {
        let symbol = format!("{}_{dtype}", kernels_rocm::rotary::KERNEL);
        assert!(text.contains(&symbol), "the code object lacks `{symbol}`");
    }
    // The strided copy (`clone`/`contiguous` on the device): one kernel per element size, the
    // strided conversion (`copy_` between dtypes, `scale`): one per pair of dtypes, and `add`/`mul`:
    // one per dtype; no scratch.
    let copy_scratch: Vec<&str> =
        report.lines().filter(|l| l.contains("ScratchSize") && l.contains("/strided_copy.hip:")).collect();
    let expected = 4 + kernels_rocm::CONVERT_KERNELS.len() + kernels_rocm::BINARY_KERNELS.len();
    assert_eq!(copy_scratch.len(), expected, "one report per strided copy and conversion kernel:\n{report}");
    assert!(copy_scratch.iter().all(|l| l.contains("ScratchSize [bytes/lane]: 0")), "{copy_scratch:#?}");
    for size in [1, 2, 4, 8] {
        assert!(text.contains(&format!("strided_copy_{size}")), "the code object lacks `strided_copy_{size}`");
    }
    let names =
        kernels_rocm::CONVERT_KERNELS.iter().map(|k| k.2).chain(kernels_rocm::BINARY_KERNELS.iter().map(|k| k.2));
    for name in names {
        assert!(text.contains(name), "the code object lacks `{name}`");
    }
    let _ = std::fs::remove_dir_all(&dir);
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
