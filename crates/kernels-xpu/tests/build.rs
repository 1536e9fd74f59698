//! Every OpenCL kernel variant builds on the selected device (PoCL in CI).

#[test]
fn every_variant_builds() {
    let device = match kernels_xpu::device() {
        Ok(device) => device,
        Err(reason) => {
            ir_core::testing::skip("xpu", &reason);
            return;
        }
    };
    let subgroups = kernels_xpu::use_subgroups(device.extensions(), device.max_sub_group_size(), 128, false);
    let dtypes = kernels_xpu::kernel_dtypes();
    let mut variants = kernels_xpu::all_variants(false, dtypes);
    if subgroups {
        variants.extend(kernels_xpu::all_variants(true, dtypes));
    }
    let f64_variants = variants.iter().filter(|v| v.dtype == ir_core::DType::F64).count();
    assert_eq!(f64_variants > 0, device.has_fp64(), "f64 variants exactly where the device computes in f64");
    for variant in variants {
        device.kernel(&variant).unwrap_or_else(|e| panic!("{variant} on {}: {e}", device.name()));
    }
}

#[test]
fn the_provider_reports_availability() {
    let registry = ir_ops::registry();
    kernels_xpu::register(&registry).unwrap();
    let xpu = registry.providers("fused_add_rms_norm").into_iter().find(|p| p.name == "xpu").unwrap();
    assert!(xpu.inplace);
    match (xpu.availability, kernels_xpu::device()) {
        (ir_core::Availability::Available, Ok(device)) => {
            let detected = ir_core::Platform::detect(&registry);
            let expected = if kernels_xpu::is_gpu() { ir_core::Platform::Xpu } else { ir_core::Platform::Cpu };
            assert_eq!(detected, expected, "device {}", device.name());
        }
        (ir_core::Availability::Unavailable(reason), Err(device_reason)) => assert_eq!(reason, device_reason),
        (availability, device) => panic!("availability {availability:?} disagrees with {device:?}"),
    }
}

#[test]
fn every_gated_op_builds_for_every_dtype() {
    let device = match kernels_xpu::device() {
        Ok(device) => device,
        Err(reason) => {
            ir_core::testing::skip("xpu", &reason);
            return;
        }
    };
    for op in kernels_xpu::gated::GATED_OPS {
        let dtypes = [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16, ir_core::DType::F64];
        for dtype in dtypes.into_iter().filter(|&d| kernels_xpu::kernel_dtypes().contains(d)) {
            device
                .gated_kernel(op, dtype)
                .unwrap_or_else(|e| panic!("{} {dtype} on {}: {e}", op.def.name, device.name()));
        }
    }
}
