//! NVRTC: errors keep the compiler's log, the provider says why it is unavailable, and the gated,
//! quantization and rotary kernels compile to PTX for sm_80 and sm_90 for every dtype with the
//! properties their numerics need; no GPU needed. Every norm program is compiled (and assembled) by
//! `tests/ptxas.rs`, which compiles all of this crate's programs once.

use kernels_cuda::{all_programs, compile_ptx, nvrtc_availability};

/// The element dtypes every kernel family is compiled for.
const DTYPES: [ir_core::DType; 4] =
    [ir_core::DType::F32, ir_core::DType::F16, ir_core::DType::BF16, ir_core::DType::F64];

#[test]
fn compile_errors_keep_the_log() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    let mut program = all_programs()[0];
    program.threads_per_row = 8;
    // Compile a broken source through the same error path by asking for an unknown architecture.
    let err = compile_ptx(&program, Some("compute_1")).unwrap_err();
    let ir_core::KernelError::Compile { kernel, options, log } = &err else {
        panic!("expected a compile error, got {err}")
    };
    assert!(kernel.starts_with("rms_norm.cu[dtype=f32"), "{kernel}");
    assert!(options.iter().any(|o| o.contains("compute_1")), "{options:?}");
    assert!(!log.is_empty() || err.to_string().contains("compute_1"), "{err}");
}

#[test]
fn the_provider_reports_why_it_is_unavailable() {
    let registry = ir_ops::registry();
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
    let registry = ir_ops::registry();
    kernels_cuda::register(&registry).unwrap();
    for op in kernels_cuda::gated::GATED_OPS {
        assert!(registry.providers(op.def.name).iter().any(|p| p.name == "cuda"), "{} is registered", op.def.name);
        for arch in ["compute_80", "compute_90"] {
            for dtype in DTYPES {
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
    let registry = ir_ops::registry();
    kernels_cuda::register(&registry).unwrap();
    for op in kernels_cuda::quant::QUANT_OPS {
        assert!(registry.providers(op).iter().any(|p| p.name == "cuda"), "{op} is registered");
    }
    for arch in ["compute_80", "compute_90"] {
        for dtype in DTYPES {
            let ptx = kernels_cuda::quant::compile_ptx(dtype, Some(arch))
                .unwrap_or_else(|e| panic!("quant {dtype} {arch}: {e}"))
                .to_src();
            let mixed = kernel_support::NORM_QUANT_MIXED_KERNELS.map(|(_, kernel)| kernel);
            for kernel in kernels_cuda::quant::KERNELS.into_iter().chain(mixed) {
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
    let registry = ir_ops::registry();
    kernels_cuda::register(&registry).unwrap();
    assert!(registry.providers("rotary_embedding").iter().any(|p| p.name == "cuda"), "rotary_embedding is registered");
    assert_eq!(registry.is_inplace("rotary_embedding", "cuda"), Some(true), "it rotates in place");
    for arch in ["compute_80", "compute_90"] {
        for dtype in DTYPES {
            let ptx = kernels_cuda::rotary::compile_ptx(dtype, Some(arch))
                .unwrap_or_else(|e| panic!("rotary {dtype} {arch}: {e}"))
                .to_src();
            let entry = format!(".entry {}_{dtype}(", kernels_cuda::rotary::KERNEL);
            assert!(ptx.contains(&entry), "rotary {dtype} {arch}: PTX lacks `{entry}`");
            assert!(!ptx.contains(".local"), "rotary {dtype} {arch}: no local memory");
            // The reference rounds each product: a contracted fma would round once.
            let c = if dtype == ir_core::DType::F64 { "f64" } else { "f32" };
            assert!(!ptx.contains(&format!("fma.rn.{c}")), "rotary {dtype} {arch}: no fused multiply-add");
            assert!(ptx.contains(&format!("mul.rn.{c}")), "rotary {dtype} {arch}: products rounded on their own");
        }
    }
}

#[test]
fn every_built_in_row_program_compiles_to_ptx() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    use ir_ops::row_program::{Binding, InputKind, builtin};
    // Every program in bf16 for sm_90; f32 and f16 for sm_80.
    for (dtype, arch) in
        [(ir_core::DType::BF16, "compute_90"), (ir_core::DType::F32, "compute_80"), (ir_core::DType::F16, "compute_80")]
    {
        for program in builtin::all() {
            let dtypes = program
                .inputs()
                .iter()
                .map(|input| match input.kind {
                    InputKind::Scalar => None,
                    InputKind::ScalarTensor => Some(ir_core::DType::F32),
                    InputKind::Positions => Some(ir_core::DType::I64),
                    _ => Some(dtype),
                })
                .collect();
            let binding = Binding {
                width: 4096,
                rows: 1,
                rows_shape: vec![1],
                compute: ir_core::DType::F32,
                dtypes,
                in_place: false,
            };
            // Both shapes: whole aligned chunks and element by element.
            for aligned in [true, false] {
                let shape = kernel_support::program::RowShape::for_call(&program, &binding, aligned);
                let ptx = kernels_cuda::program::compile_ptx(&program, &binding, shape, Some(arch))
                    .unwrap_or_else(|e| panic!("{} {dtype} {arch} {shape}: {e}", program.name()));
                assert!(
                    ptx.to_src().contains(".entry row_program("),
                    "{} {dtype}: PTX lacks the kernel",
                    program.name()
                );
            }
        }
    }
}

/// A generated kernel's PTX is kept on disk: the second compile of a program reads it back (the
/// same PTX), another signature compiles anew, and a cache that cannot be written costs only the
/// compile.
#[test]
fn generated_kernels_are_cached_on_disk() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    use ir_core::DType;
    use ir_ops::row_program::Binding;
    use kernel_support::program::DiskCache;
    use kernels_cuda::program::{PtxOrigin, compile_ptx_cached};
    let dir = std::env::temp_dir().join(format!("kernels-cuda-ptx-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = DiskCache::new(&dir);
    let program = ir_ops::layer_norm::program(true, false);
    let binding = |dtype| Binding {
        width: 1024,
        rows: 1,
        rows_shape: vec![1],
        compute: DType::F32,
        dtypes: vec![Some(dtype), Some(dtype), None],
        in_place: false,
    };
    let arch = Some("compute_90");
    let shape = kernel_support::program::RowShape::Chunks { threads_per_row: 32, vectorized: true };
    let (first, origin) = compile_ptx_cached(program, &binding(DType::BF16), shape, arch, Some(&cache)).unwrap();
    assert_eq!(origin, PtxOrigin::Compiled);
    let (again, origin) = compile_ptx_cached(program, &binding(DType::BF16), shape, arch, Some(&cache)).unwrap();
    assert_eq!(origin, PtxOrigin::Cached, "the second compile reads the cache");
    assert_eq!(again.to_src(), first.to_src());
    let (_, origin) = compile_ptx_cached(program, &binding(DType::F16), shape, arch, Some(&cache)).unwrap();
    assert_eq!(origin, PtxOrigin::Compiled, "another signature is another kernel");
    let (_, origin) =
        compile_ptx_cached(program, &binding(DType::BF16), shape, Some("compute_80"), Some(&cache)).unwrap();
    assert_eq!(origin, PtxOrigin::Compiled, "another architecture is another kernel");
    // A file where the directory should be: nothing is stored, the compile still succeeds.
    let blocked = dir.join("blocked");
    std::fs::write(&blocked, b"not a directory").unwrap();
    let unwritable = DiskCache::new(blocked.join("kernels"));
    for _ in 0..2 {
        let (ptx, origin) = compile_ptx_cached(program, &binding(DType::BF16), shape, arch, Some(&unwritable)).unwrap();
        assert_eq!(origin, PtxOrigin::Compiled);
        assert_eq!(ptx.to_src(), first.to_src());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The first fused multiply-add of `ptx` that adds something to its product: `fma(x, y, +0)` is
/// `x · y` rounded once (NVRTC writes a sum's first term so), any other rounds a product and a sum
/// once where the source rounds them apart.
fn contracted(ptx: &str) -> Option<&str> {
    ptx.lines().map(str::trim).find(|line| {
        line.starts_with("fma.rn.")
            && !line
                .trim_end_matches(';')
                .rsplit(',')
                .next()
                .is_some_and(|addend| matches!(addend.trim(), "0f00000000" | "0d0000000000000000"))
    })
}

/// The norms' sums of squares and their weight steps round each product on its own on a GPU as on
/// the emulated one (compiled with contraction off): no fused multiply-add that adds to its
/// product in the hand-written norm programs (f32 and bf16, at 64 threads per row) nor in the
/// kernels generated from the norm programs, so a generated kernel that
/// owns and reduces a row's chunks as the hand-written norms do gives their bits on the device
/// too, not only on the emulator.
#[test]
fn the_norms_compile_without_fused_multiply_adds() {
    if let ir_core::Availability::Unavailable(reason) = nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    use ir_core::DType;
    let arch = Some("compute_90");
    for program in all_programs() {
        let wide_weight = program.weight.is_some_and(|w| w != program.dtype);
        if !matches!(program.dtype, DType::F32 | DType::BF16) || program.threads_per_row != 64 || wide_weight {
            continue;
        }
        let ptx = compile_ptx(&program, arch).unwrap_or_else(|e| panic!("{program:?}: {e}")).to_src();
        assert_eq!(contracted(&ptx), None, "{program:?}: a fused multiply-add");
    }
    use ir_ops::row_program::{Binding, builtin};
    for program in
        [builtin::rms_norm(true, false), builtin::fused_sandwich_rms_norm(true, true, ir_ops::Rounding::Exact)]
    {
        let dtypes = program.inputs().iter().map(|input| input.kind.is_tensor().then_some(DType::BF16)).collect();
        let binding =
            Binding { width: 4096, rows: 1, rows_shape: vec![1], compute: DType::F32, dtypes, in_place: false };
        for aligned in [true, false] {
            let shape = kernel_support::program::RowShape::for_call(&program, &binding, aligned);
            let ptx = kernels_cuda::program::compile_ptx(&program, &binding, shape, arch).unwrap().to_src();
            assert_eq!(contracted(&ptx), None, "{} {shape}: a fused multiply-add", program.name());
        }
    }
}
