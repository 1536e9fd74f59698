//! Every HIP kernel variant compiles with hipcc for gfx90a (R93); no GPU needed.

use std::process::Command;

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
    let output = dir.join("rms_norm-gfx90a.hsaco");
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/rms_norm.hip");
    let done = Command::new(&hipcc)
        .args(["--genco", "--offload-arch=gfx90a", "-O3", "-o"])
        .arg(&output)
        .arg(source)
        .output()
        .expect("hipcc runs");
    assert!(done.status.success(), "hipcc failed:\n{}", String::from_utf8_lossy(&done.stderr));
    let object = std::fs::read(&output).expect("hipcc wrote the code object");
    let text = String::from_utf8_lossy(&object);
    for variant in kernels_rocm::all_variants() {
        assert!(text.contains(&variant.symbol()), "the code object lacks `{}`", variant.symbol());
    }
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
