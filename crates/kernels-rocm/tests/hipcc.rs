//! Every HIP kernel variant compiles with hipcc for gfx90a (R93); no GPU needed.

use std::process::Command;

/// Compiles one kernel source to a gfx90a code object and returns its bytes.
fn compile(hipcc: &str, dir: &std::path::Path, file: &str) -> Vec<u8> {
    let output = dir.join(format!("{file}.hsaco"));
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels").join(file);
    let done = Command::new(hipcc)
        .args(["--genco", "--offload-arch=gfx90a", "-O3", "-o"])
        .arg(&output)
        .arg(&source)
        .output()
        .expect("hipcc runs");
    assert!(done.status.success(), "hipcc failed on {file}:\n{}", String::from_utf8_lossy(&done.stderr));
    std::fs::read(&output).expect("hipcc wrote the code object")
}

#[test]
fn hipcc_compiles_every_variant() {
    let hipcc = std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
    let probe = Command::new(&hipcc).arg("--version").output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        ir_core::testing::skip("hip", &format!("`{hipcc}` not found (install Debian's hipcc)"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("kernels-rocm-hipcc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let norms = compile(&hipcc, &dir, "rms_norm.hip");
    let text = String::from_utf8_lossy(&norms);
    for variant in kernels_rocm::all_variants() {
        assert!(text.contains(&variant.symbol()), "the code object lacks `{}`", variant.symbol());
    }
    // Every gated op's source compiles on its own (build.rs compiles them all as one unit) and
    // defines its kernel for every dtype.
    let gated: Vec<_> = kernels_rocm::gated::GATED_OPS.to_vec();
    std::thread::scope(|scope| {
        for op in &gated {
            let (hipcc, dir) = (&hipcc, &dir);
            scope.spawn(move || {
                let object = compile(hipcc, dir, &format!("{}.hip", op.def.name));
                let text = String::from_utf8_lossy(&object);
                for dtype in [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16] {
                    let symbol = op.kernel_name(dtype);
                    assert!(text.contains(&symbol), "the code object of {} lacks `{symbol}`", op.def.name);
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// The quantization kernels compile for every dtype and use no scratch memory (hipcc's resource
/// report for each kernel).
#[test]
fn the_quantization_kernels_compile_without_scratch() {
    let hipcc = std::env::var("HIPCC").unwrap_or_else(|_| "hipcc".to_owned());
    if !Command::new(&hipcc).arg("--version").output().is_ok_and(|o| o.status.success()) {
        ir_core::testing::skip("hip", &format!("`{hipcc}` not found (install Debian's hipcc)"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("kernels-rocm-quant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let output = dir.join("quant.hsaco");
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels").join("quant.hip");
    let done = Command::new(&hipcc)
        .args(["--genco", "--offload-arch=gfx90a", "-O3", "-Rpass-analysis=kernel-resource-usage", "-o"])
        .arg(&output)
        .arg(&source)
        .output()
        .expect("hipcc runs");
    let report = String::from_utf8_lossy(&done.stderr).into_owned();
    assert!(done.status.success(), "hipcc failed on quant.hip:\n{report}");
    let text = String::from_utf8_lossy(&std::fs::read(&output).unwrap()).into_owned();
    for op in kernels_rocm::quant::QUANT_OPS {
        for dtype in [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16] {
            assert!(text.contains(&format!("{op}_{dtype}")), "the code object lacks `{op}_{dtype}`");
        }
    }
    let scratch: Vec<&str> = report.lines().filter(|l| l.contains("ScratchSize")).collect();
    assert_eq!(scratch.len(), 6, "one resource report per kernel:\n{report}");
    assert!(scratch.iter().all(|l| l.contains("ScratchSize [bytes/lane]: 0")), "{scratch:#?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_the_feature_or_a_device_the_provider_says_why() {
    let registry = ir_core::Registry::with_builtin_ops();
    kernels_rocm::register(&registry).unwrap();
    let rocm = registry.providers("rms_norm").into_iter().find(|p| p.name == "rocm").unwrap();
    if let ir_core::Availability::Unavailable(reason) = rocm.availability {
        assert!(!reason.is_empty());
        if !cfg!(feature = "rocm") {
            assert_eq!(reason, "built without feature `rocm`");
        }
    }
}
