//! Every kernel variant compiles to PTX with NVRTC for sm_80 and sm_90 (R91); no GPU needed.

use kernels_cuda::{all_variants, compile_ptx, nvrtc_availability};

#[test]
fn every_variant_compiles_to_ptx() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    let variants = all_variants();
    // ops x dtypes x (no weight, or one of x's dtype) x vector paths x row widths, and the weights
    // of the two other dtypes at two row widths; f64 (scalar accesses only): no weight or an f64
    // one at every width, and at one width x f64 with each other weight and each other x with an
    // f64 weight (both vector paths).
    let reduced = 2 * 3 * 2 * 2 * 6 + 2 * 3 * 2 * 2 * 2;
    assert_eq!(variants.len(), reduced + 2 * 2 * 6 + 2 * 3 + 2 * 3 * 2);
    assert!(variants.iter().filter(|v| v.dtype == ir_core::DType::F64).all(|v| !v.vectorized));
    assert!(variants.iter().any(|v| v.weight == Some(ir_core::DType::F32) && v.dtype == ir_core::DType::BF16));
    let jobs: Vec<_> =
        ["compute_80", "compute_90"].iter().flat_map(|arch| variants.iter().map(move |v| (*arch, *v))).collect();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|scope| {
        for chunk in jobs.chunks(jobs.len().div_ceil(threads)) {
            scope.spawn(move || {
                for (arch, variant) in chunk {
                    let ptx = compile_ptx(variant, Some(arch)).unwrap_or_else(|e| panic!("{variant} for {arch}: {e}"));
                    let text = ptx.to_src();
                    let entry = format!(".entry {}(", variant.kernel_name());
                    assert!(text.contains(&entry), "{variant}: PTX lacks `{entry}`");
                    let target = format!(".target sm_{}", &arch["compute_".len()..]);
                    assert!(text.contains(&target), "{variant}: PTX lacks `{target}`");
                }
            });
        }
    });
}

#[test]
fn compile_errors_keep_the_log() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    let mut variant = all_variants()[0];
    variant.threads_per_row = 8;
    // Compile a broken source through the same error path by asking for an unknown architecture.
    let err = compile_ptx(&variant, Some("compute_1")).unwrap_err();
    let ir_core::KernelError::Compile { kernel, options, log } = &err else {
        panic!("expected a compile error, got {err}")
    };
    assert!(kernel.starts_with("rms_norm_f32"), "{kernel}");
    assert!(options.iter().any(|o| o.contains("compute_1")), "{options:?}");
    assert!(!log.is_empty() || err.to_string().contains("compute_1"), "{err}");
}

#[test]
fn the_provider_reports_why_it_is_unavailable() {
    let registry = ir_core::Registry::with_builtin_ops();
    kernels_cuda::register(&registry).unwrap();
    let cuda = registry.providers("rms_norm").into_iter().find(|p| p.name == "cuda").unwrap();
    match cuda.availability {
        ir_core::Availability::Available => assert!(kernels_cuda::devices().is_ok()),
        ir_core::Availability::Unavailable(reason) => {
            assert!(!reason.is_empty());
            assert!(kernels_cuda::devices().is_err() || reason.contains("nvrtc"), "{reason}");
        }
    }
    assert!(kernels_cuda::register(&registry).is_err(), "registering twice is a duplicate-provider error");
}

#[test]
fn every_gated_op_compiles_to_ptx_for_every_dtype() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    let registry = ir_core::Registry::with_builtin_ops();
    kernels_cuda::register(&registry).unwrap();
    for op in kernels_cuda::gated::GATED_OPS {
        assert!(registry.providers(op.def.name).iter().any(|p| p.name == "cuda"), "{} is registered", op.def.name);
        for arch in ["compute_80", "compute_90"] {
            for dtype in [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16] {
                let ptx = kernels_cuda::gated::compile_ptx(op, dtype, Some(arch))
                    .unwrap_or_else(|e| panic!("{} {dtype} {arch}: {e}", op.def.name));
                let entry = format!(".entry {}(", op.kernel_name(dtype));
                assert!(ptx.to_src().contains(&entry), "{} {dtype}: PTX lacks `{entry}`", op.def.name);
            }
        }
    }
}

#[test]
fn the_quantization_kernels_compile_to_ptx_for_every_dtype() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    let registry = ir_core::Registry::with_builtin_ops();
    kernels_cuda::register(&registry).unwrap();
    for op in kernels_cuda::quant::QUANT_OPS {
        assert!(registry.providers(op).iter().any(|p| p.name == "cuda"), "{op} is registered");
    }
    for arch in ["compute_80", "compute_90"] {
        for dtype in [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16] {
            let ptx = kernels_cuda::quant::compile_ptx(dtype, Some(arch))
                .unwrap_or_else(|e| panic!("quant {dtype} {arch}: {e}"))
                .to_src();
            for kernel in kernels_cuda::quant::KERNELS {
                let entry = format!(".entry {kernel}_{dtype}(");
                assert!(ptx.contains(&entry), "quant {dtype} {arch}: PTX lacks `{entry}`");
            }
            assert!(!ptx.contains(".local"), "quant {dtype} {arch}: no local memory");
        }
    }
}

#[test]
fn the_rotary_kernel_compiles_to_ptx_without_fused_multiply_adds() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    let registry = ir_core::Registry::with_builtin_ops();
    kernels_cuda::register(&registry).unwrap();
    assert!(registry.providers("rotary_embedding").iter().any(|p| p.name == "cuda"), "rotary_embedding is registered");
    assert_eq!(registry.is_inplace("rotary_embedding", "cuda"), Some(true), "it rotates in place");
    for arch in ["compute_80", "compute_90"] {
        for dtype in [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16] {
            let ptx = kernels_cuda::rotary::compile_ptx(dtype, Some(arch))
                .unwrap_or_else(|e| panic!("rotary {dtype} {arch}: {e}"))
                .to_src();
            let entry = format!(".entry {}_{dtype}(", kernels_cuda::rotary::KERNEL);
            assert!(ptx.contains(&entry), "rotary {dtype} {arch}: PTX lacks `{entry}`");
            assert!(!ptx.contains(".local"), "rotary {dtype} {arch}: no local memory");
            // The reference rounds each product: a contracted fma would round once.
            assert!(!ptx.contains("fma.rn.f32"), "rotary {dtype} {arch}: no fused multiply-add");
            assert!(ptx.contains("mul.rn.f32"), "rotary {dtype} {arch}: products rounded on their own");
        }
    }
}
