//! The ops on candle tensors: the cpu kernels write candle's own memory in place (0 defensive
//! copies, 0 native fallbacks in the selection record), the results are those of the same ops on
//! this crate's tensors, a query and a key that are column slices of one qkv storage are rotated in
//! place, and a functional provider's result is copied into candle's memory.

use candle_core::{DType as CDType, Device, IndexOp, Tensor as CTensor};
use ir_core::{DType, Platform, PriorityConfig, Registry, Tensor, allclose, bit_eq};
use ir_ops::candle_ops;
use ir_ops::gelu_and_mul::Approximate;

fn cpu_registry() -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).unwrap();
    registry
}

/// A copy of a candle tensor as this crate's tensor.
fn ours(t: &CTensor) -> Tensor {
    Tensor::from_candle(t).unwrap()
}

fn randn(shape: (usize, usize), dtype: CDType, seed: u64) -> CTensor {
    let device = Device::Cpu;
    // candle's randn has no seed: values from a fixed formula instead.
    let n = shape.0 * shape.1;
    let values: Vec<f32> =
        (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 2001) as f32 / 500.0) - 2.0).collect();
    CTensor::from_vec(values, shape, &device).unwrap().to_dtype(dtype).unwrap()
}

#[test]
fn fused_add_rms_norm_writes_candle_memory_in_place() {
    let registry = cpu_registry();
    for dtype in [CDType::F32, CDType::BF16] {
        let x = randn((6, 256), dtype, 1);
        let residual = randn((6, 256), dtype, 2);
        let weight = randn((1, 256), dtype, 3).reshape(256).unwrap();
        let (x_before, r_before, w) = (ours(&x), ours(&residual), ours(&weight));
        let clone = x.clone();
        let before = registry.selection_record();
        candle_ops::fused_add_rms_norm(&registry, &x, &residual, Some(&weight), 1e-6, ir_ops::Rounding::Exact).unwrap();
        let step = registry.selection_record().since(&before);
        let (expected_out, expected_res) = ir_ops::fused_add_rms_norm::fused_add_rms_norm(
            &registry,
            &x_before,
            &r_before,
            Some(&w),
            1e-6,
            None,
            ir_ops::Rounding::Exact,
        )
        .unwrap();
        assert!(bit_eq(&ours(&x), &expected_out), "{dtype:?}: x holds the norm");
        assert!(bit_eq(&ours(&residual), &expected_res), "{dtype:?}: residual holds the sum");
        assert!(bit_eq(&ours(&clone), &expected_out), "clones share candle's storage, as candle's in-place ops");
        let op = step.op("fused_add_rms_norm").unwrap();
        assert_eq!(
            (op.inplace_writes, op.defensive_copies, op.native_fallbacks),
            (2, 0, 0),
            "{dtype:?}: x and residual"
        );
        assert_eq!(step.selections("fused_add_rms_norm", "cpu"), 1);
    }
}

#[test]
fn rotary_rotates_column_slices_of_one_qkv_storage_in_place() {
    let registry = cpu_registry();
    let (tokens, heads, kv_heads, head_size) = (5, 4, 2, 32);
    let (q_width, kv_width) = (heads * head_size, kv_heads * head_size);
    for dtype in [CDType::F32, CDType::BF16] {
        let qkv = randn((tokens, q_width + 2 * kv_width), dtype, 4);
        let q = qkv.narrow(1, 0, q_width).unwrap();
        let k = qkv.narrow(1, q_width, kv_width).unwrap();
        let v_before = ours(&qkv.narrow(1, q_width + kv_width, kv_width).unwrap());
        let cache = ir_ops::rotary_embedding::cos_sin_cache(ours(&q).dtype(), 64, head_size, 10000.0).unwrap();
        let cache = cache.into_candle().unwrap();
        let positions_u32 = CTensor::new(&[0u32, 3, 7, 63, 1], &Device::Cpu).unwrap();
        let positions = Tensor::from_vec(&[tokens], vec![0i64, 3, 7, 63, 1]).unwrap();
        let (q_before, k_before, c) = (ours(&q), ours(&k), ours(&cache));
        let before = registry.selection_record();
        candle_ops::rotary_embedding(
            &registry,
            &positions_u32,
            &q,
            Some(&k),
            &cache,
            head_size,
            head_size,
            true,
            ir_ops::Rounding::Exact,
        )
        .unwrap();
        let step = registry.selection_record().since(&before);
        let (eq, ek) = ir_ops::rotary_embedding::rotary_embedding(
            &registry,
            &positions,
            &q_before,
            Some(&k_before),
            &c,
            head_size as i64,
            head_size as i64,
            true,
            ir_ops::Rounding::Exact,
        )
        .unwrap();
        assert!(bit_eq(&ours(&q), &eq), "{dtype:?}: query rotated in qkv");
        assert!(bit_eq(&ours(&k), &ek.unwrap()), "{dtype:?}: key rotated in qkv");
        assert!(bit_eq(&ours(&qkv.narrow(1, q_width + kv_width, kv_width).unwrap()), &v_before), "v untouched");
        let op = step.op("rotary_embedding").unwrap();
        assert_eq!((op.defensive_copies, op.native_fallbacks), (0, 0), "{dtype:?}");
        assert_eq!((op.inplace_writes, step.selections("rotary_embedding", "cpu")), (2, 2), "{dtype:?}");
        assert_eq!(ours(&qkv.i((.., ..q_width)).unwrap()).shape(), [tokens, q_width]);
    }
}

#[test]
fn functional_ops_match_the_same_ops_on_our_tensors() {
    let registry = cpu_registry();
    let x = randn((4, 128), CDType::BF16, 5);
    let w = randn((1, 128), CDType::BF16, 6).reshape(128).unwrap();
    let gate_up = randn((4, 256), CDType::BF16, 7);
    let (xo, wo, go) = (ours(&x), ours(&w), ours(&gate_up));
    let y = candle_ops::rms_norm(&registry, &x, Some(&w), 1e-6).unwrap();
    assert!(bit_eq(&ours(&y), &ir_ops::rms_norm::rms_norm(&registry, &xo, Some(&wo), 1e-6, None).unwrap()));
    let s = candle_ops::silu_and_mul(&registry, &gate_up).unwrap();
    assert!(bit_eq(&ours(&s), &ir_ops::silu_and_mul::silu_and_mul(&registry, &go).unwrap()));
    let g = candle_ops::gelu_and_mul(&registry, &gate_up, Approximate::Tanh).unwrap();
    let expected = ir_ops::gelu_and_mul::gelu_and_mul(&registry, &go, Approximate::Tanh).unwrap();
    assert!(bit_eq(&ours(&g), &expected));
    let (q, scales) = candle_ops::dynamic_per_token_scaled_fp8_quant(&registry, &x, None, DType::F8E4M3FN).unwrap();
    let (eq, es) = ir_ops::dynamic_per_token_scaled_fp8_quant::dynamic_per_token_scaled_fp8_quant(
        &registry,
        &xo,
        None,
        DType::F8E4M3FN,
    )
    .unwrap();
    assert!(bit_eq(&ours(&q), &eq) && bit_eq(&ours(&scales), &es), "dynamic fp8");
    assert_eq!(q.dtype(), CDType::F8E4M3);
    let scale = CTensor::new(&[0.05f32], &Device::Cpu).unwrap();
    let exact = ir_ops::Rounding::Exact;
    // The static and fused forms run with vLLM's rounding points (a static scale's reciprocal, the
    // rounded sum): the parameter reaches the kernel.
    let parity = ir_ops::Rounding::Dtype;
    let (q, _) =
        candle_ops::rms_norm_dynamic_per_token_quant(&registry, &x, Some(&w), 1e-6, None, DType::F8E4M3FN, exact)
            .unwrap();
    let (eq, _) = ir_ops::rms_norm_dynamic_per_token_quant::rms_norm_dynamic_per_token_quant(
        &registry,
        &xo,
        Some(&wo),
        1e-6,
        None,
        DType::F8E4M3FN,
        exact,
    )
    .unwrap();
    assert!(bit_eq(&ours(&q), &eq), "norm + dynamic fp8");
    let q =
        candle_ops::rms_norm_static_fp8_quant(&registry, &x, Some(&w), 1e-6, &scale, DType::F8E4M3FN, parity).unwrap();
    let eq = ir_ops::rms_norm_static_fp8_quant::rms_norm_static_fp8_quant(
        &registry,
        &xo,
        Some(&wo),
        1e-6,
        &ours(&scale),
        DType::F8E4M3FN,
        parity,
    )
    .unwrap();
    assert!(bit_eq(&ours(&q), &eq), "norm + static fp8");
    for rounding in [exact, parity] {
        let q = candle_ops::static_scaled_fp8_quant(&registry, &x, &scale, DType::F8E4M3FN, rounding).unwrap();
        let static_quant = ir_ops::static_scaled_fp8_quant::static_scaled_fp8_quant;
        let eq = static_quant(&registry, &xo, &ours(&scale), DType::F8E4M3FN, rounding).unwrap();
        assert!(bit_eq(&ours(&q), &eq), "static fp8, {rounding:?}");
    }
    // The residual of the fused norm + quantization is written in place.
    let residual = randn((4, 128), CDType::BF16, 8);
    let r_before = ours(&residual);
    let q = candle_ops::fused_add_rms_norm_static_fp8_quant(
        &registry,
        &x,
        &residual,
        Some(&w),
        1e-6,
        &scale,
        DType::F8E4M3FN,
        parity,
    )
    .unwrap();
    let (er, eq) = ir_ops::fused_add_rms_norm_static_fp8_quant::fused_add_rms_norm_static_fp8_quant(
        &registry,
        &xo,
        &r_before,
        Some(&wo),
        1e-6,
        &ours(&scale),
        DType::F8E4M3FN,
        parity,
    )
    .unwrap();
    assert!(bit_eq(&ours(&q), &eq) && bit_eq(&ours(&residual), &er), "fused norm + static fp8");
    // And of the per-token form, on a residual that is a column slice of a wider buffer.
    let wide = randn((4, 3 * 128), CDType::BF16, 12);
    let residual = wide.narrow(1, 128, 128).unwrap();
    let untouched = |t: &CTensor| ours(&t.narrow(1, 0, 128).unwrap());
    let (r_before, rest_before) = (ours(&residual), untouched(&wide));
    let ub = CTensor::new(&[2.5f32], &Device::Cpu).unwrap();
    let (q, scales) = candle_ops::fused_add_rms_norm_dynamic_per_token_quant(
        &registry,
        &x,
        &residual,
        Some(&w),
        1e-6,
        Some(&ub),
        DType::F8E4M3FN,
        parity,
    )
    .unwrap();
    // Before the reference call below, whose functional form copies the residual.
    let op = registry.selection_record().op("fused_add_rms_norm_dynamic_per_token_quant").unwrap().clone();
    assert_eq!((op.inplace_writes, op.defensive_copies), (1, 0), "written in place, nothing copied");
    let (er, eq, es) = ir_ops::fused_add_rms_norm_dynamic_per_token_quant::fused_add_rms_norm_dynamic_per_token_quant(
        &registry,
        &xo,
        &r_before,
        Some(&wo),
        1e-6,
        Some(&ours(&ub)),
        DType::F8E4M3FN,
        parity,
    )
    .unwrap();
    assert_eq!(scales.dims(), [4, 1]);
    assert!(bit_eq(&ours(&q), &eq) && bit_eq(&ours(&scales), &es), "fused norm + per-token fp8");
    assert!(bit_eq(&ours(&residual), &er), "the residual slice holds the sum");
    assert!(bit_eq(&untouched(&wide), &rest_before), "the rest of the buffer is untouched");
    assert_eq!(registry.selection_record().native_fallbacks(), 0);
}

#[test]
fn functional_providers_and_shared_storages_land_in_candle_memory() {
    // Only native: the in-place call runs functionally and its results are copied into place.
    let native_only = ir_ops::registry();
    let x = randn((3, 64), CDType::F32, 9);
    let residual = randn((3, 64), CDType::F32, 10);
    let (xo, ro) = (ours(&x), ours(&residual));
    candle_ops::fused_add_rms_norm(&native_only, &x, &residual, None, 1e-6, ir_ops::Rounding::Exact).unwrap();
    let (eo, er) = ir_ops::fused_add_rms_norm::native(&xo, &ro, None, 1e-6, None, ir_ops::Rounding::Exact).unwrap();
    assert!(bit_eq(&ours(&x), &eo) && bit_eq(&ours(&residual), &er), "native's results landed");
    let op = native_only.selection_record().op("fused_add_rms_norm").unwrap().clone();
    assert_eq!((op.defensive_copies, op.native_fallbacks), (2, 0), "both results copied into place, counted");

    // x, the residual and the weight as slices of one storage: computed functionally, written back.
    let registry = cpu_registry();
    let buffer = randn((3, 3 * 64), CDType::F32, 11);
    let (x, residual) = (buffer.narrow(1, 0, 64).unwrap(), buffer.narrow(1, 64, 64).unwrap());
    let weight = buffer.i((0, 128..192)).unwrap();
    let (xo, ro, wo) = (ours(&x), ours(&residual), ours(&weight));
    let before = registry.selection_record();
    candle_ops::fused_add_rms_norm(&registry, &x, &residual, Some(&weight), 1e-6, ir_ops::Rounding::Exact).unwrap();
    let step = registry.selection_record().since(&before);
    let (eo, er) = ir_ops::fused_add_rms_norm::fused_add_rms_norm(
        &registry,
        &xo,
        &ro,
        Some(&wo),
        1e-6,
        None,
        ir_ops::Rounding::Exact,
    )
    .unwrap();
    allclose(&ours(&x), &eo, 1e-6, 1e-6).unwrap();
    assert!(bit_eq(&ours(&residual), &er), "the sum landed");
    // The weight copied apart (1), the functional call's copies of the activations for the in-place
    // kernel (2), both results copied into place (2): every copy counted.
    assert_eq!(step.op("fused_add_rms_norm").unwrap().defensive_copies, 5);
}

#[test]
fn bad_calls_are_errors_that_candle_code_propagates() {
    let registry = cpu_registry();
    let x = randn((2, 64), CDType::F32, 12);
    let w = randn((1, 32), CDType::F32, 13).reshape(32).unwrap();
    let err = candle_ops::rms_norm(&registry, &x, Some(&w), 1e-6).unwrap_err();
    assert!(matches!(err, candle_ops::CandleOpError::Call(_)), "{err}");
    assert!(err.to_string().contains("weight"), "{err}");
    let u8s = CTensor::new(&[1u8, 2, 3, 4], &Device::Cpu).unwrap().reshape((2, 2)).unwrap();
    let err = candle_ops::silu_and_mul(&registry, &u8s).unwrap_err();
    assert!(err.to_string().contains("U8"), "{err}");
    // In a function returning candle's result, `?` converts.
    fn in_candle_code(registry: &Registry, x: &CTensor, w: &CTensor) -> candle_core::Result<CTensor> {
        Ok(candle_ops::rms_norm(registry, x, Some(w), 1e-6)?)
    }
    assert!(in_candle_code(&registry, &x, &w).is_err());
    let residual = randn((2, 32), CDType::F32, 14);
    let before = ours(&residual);
    let err =
        candle_ops::fused_add_rms_norm(&registry, &x, &residual, None, 1e-6, ir_ops::Rounding::Exact).unwrap_err();
    assert!(err.to_string().contains("x_residual"), "{err}");
    assert!(bit_eq(&ours(&residual), &before), "unchanged after a refused call");
}

/// A provider that keeps a tensor over candle memory past the call would leave a view of memory
/// candle writes or frees: the process aborts with a message naming the op (run in a child).
#[test]
fn a_provider_keeping_candle_memory_aborts_the_process() {
    if std::env::var_os("VLLM_IR_TEST_KEEPER_CHILD").is_some() {
        use std::sync::Mutex;
        static KEPT: Mutex<Vec<Tensor>> = Mutex::new(Vec::new());
        let registry = ir_ops::registry();
        let keeper = ir_core::ImplSpec::new("keeper");
        ir_ops::silu_and_mul::register(&registry, keeper, |x| {
            KEPT.lock().unwrap().push(x.clone());
            ir_ops::silu_and_mul::native(x)
        })
        .unwrap();
        let _guard = registry.override_priority("silu_and_mul", &["keeper"]).unwrap();
        let _ = candle_ops::silu_and_mul(&registry, &randn((2, 8), CDType::F32, 15));
        unreachable!("the call aborts");
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_provider_keeping_candle_memory_aborts_the_process", "--nocapture"])
        .env("VLLM_IR_TEST_KEEPER_CHILD", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the child must not survive");
    assert!(stderr.contains("a provider of `silu_and_mul` kept a tensor over candle memory"), "{stderr}");
    assert!(!stderr.contains("the call aborts"), "aborted inside the call: {stderr}");
}

/// The rounding a caller asks for reaches the kernels: `Rounding::Dtype` on bf16 candle tensors
/// gives the bits of the same op on this crate's tensors (the norm of the rounded sum, rounded
/// rotary products), in place, and differs from the default on some elements.
#[test]
fn dtype_rounding_reaches_the_candle_ops() {
    use ir_ops::Rounding;
    let registry = cpu_registry();
    let (x, residual) = (randn((4, 128), CDType::BF16, 21), randn((4, 128), CDType::BF16, 22));
    let weight = randn((1, 128), CDType::BF16, 23).reshape(128).unwrap();
    let (xo, ro, wo) = (ours(&x), ours(&residual), ours(&weight));
    candle_ops::fused_add_rms_norm(&registry, &x, &residual, Some(&weight), 1e-6, Rounding::Dtype).unwrap();
    let fused = |rounding| {
        ir_ops::fused_add_rms_norm::fused_add_rms_norm(&registry, &xo, &ro, Some(&wo), 1e-6, None, rounding).unwrap()
    };
    let ((parity, sum), (exact, _)) = (fused(Rounding::Dtype), fused(Rounding::Exact));
    assert!(bit_eq(&ours(&x), &parity) && bit_eq(&ours(&residual), &sum), "the fused norm");
    assert!(!bit_eq(&parity, &exact), "the roundings differ on bf16");

    let q = randn((4, 128), CDType::BF16, 24);
    let cache = ir_ops::rotary_embedding::cos_sin_cache(DType::BF16, 16, 64, 10000.0).unwrap();
    let cache_candle = cache.clone().into_candle().unwrap();
    let positions = CTensor::new(&[1i64, 5, 9, 15], &Device::Cpu).unwrap();
    let q_before = ours(&q);
    candle_ops::rotary_embedding(&registry, &positions, &q, None, &cache_candle, 64, 64, true, Rounding::Dtype)
        .unwrap();
    let p = ours(&positions);
    let rotate = |rounding| {
        let call = ir_ops::rotary_embedding::rotary_embedding;
        call(&registry, &p, &q_before, None, &cache, 64, 64, true, rounding).unwrap().0
    };
    assert!(bit_eq(&ours(&q), &rotate(Rounding::Dtype)), "rotary");
    assert!(!bit_eq(&rotate(Rounding::Dtype), &rotate(Rounding::Exact)), "the roundings differ on bf16");
    assert_eq!(registry.selection_record().native_fallbacks(), 0);
}

/// A key that shares any element with the query (the query itself, a clone, an identical view, a
/// view overlapping whole heads or half a head) is refused before anything is written: rotating it
/// would rotate the shared elements twice.
#[test]
fn rotary_refuses_a_key_that_overlaps_the_query() {
    let registry = cpu_registry();
    let (tokens, head_size) = (5, 32);
    let q_width = 4 * head_size;
    let qkv = randn((tokens, q_width + 2 * head_size), CDType::F32, 31);
    let q = qkv.narrow(1, 0, q_width).unwrap();
    let cache = ir_ops::rotary_embedding::cos_sin_cache(DType::F32, 16, head_size, 10000.0).unwrap();
    let cache = cache.into_candle().unwrap();
    let positions = CTensor::new(&[1i64, 2, 3, 4, 5], &Device::Cpu).unwrap();
    let before = ours(&qkv);
    let keys = [
        ("the query", q.clone()),
        ("an identical view", qkv.narrow(1, 0, q_width).unwrap()),
        ("whole heads", qkv.narrow(1, q_width - head_size, 2 * head_size).unwrap()),
        ("half a head", qkv.narrow(1, q_width - head_size / 2, head_size).unwrap()),
    ];
    for (case, key) in keys {
        let err = rotate_with_key(&registry, &positions, &q, &key, &cache, head_size).unwrap_err();
        assert!(matches!(err, candle_ops::CandleOpError::Overlap { .. }), "{case}: {err}");
        assert!(err.to_string().contains("`query` and `key`"), "{case}: {err}");
        assert!(bit_eq(&ours(&qkv), &before), "{case}: nothing written");
    }
}

/// NeoX rotary of whole heads of `q` and `key` on candle tensors.
fn rotate_with_key(
    registry: &Registry,
    positions: &CTensor,
    q: &CTensor,
    key: &CTensor,
    cache: &CTensor,
    head_size: usize,
) -> Result<(), candle_ops::CandleOpError> {
    let rounding = ir_ops::Rounding::Exact;
    candle_ops::rotary_embedding(registry, positions, q, Some(key), cache, head_size, head_size, true, rounding)
}

/// A key the op refuses (a width `head_size` does not divide, another dtype) is refused before the
/// query is rotated.
#[test]
fn rotary_checks_the_key_before_rotating_the_query() {
    let registry = cpu_registry();
    let head_size = 32;
    let q = randn((3, 2 * head_size), CDType::F32, 32);
    let cache = ir_ops::rotary_embedding::cos_sin_cache(DType::F32, 8, head_size, 10000.0).unwrap();
    let cache = cache.into_candle().unwrap();
    let positions = CTensor::new(&[0u32, 1, 7], &Device::Cpu).unwrap();
    let q_before = ours(&q);
    let keys = [
        ("a width head_size does not divide", randn((3, head_size + 8), CDType::F32, 33)),
        ("another dtype", randn((3, head_size), CDType::BF16, 34)),
        ("other leading dimensions", randn((2, head_size), CDType::F32, 35)),
    ];
    for (case, key) in keys {
        let err = rotate_with_key(&registry, &positions, &q, &key, &cache, head_size).unwrap_err();
        assert!(err.to_string().contains("key") || err.to_string().contains("head_size"), "{case}: {err}");
        assert!(bit_eq(&ours(&q), &q_before), "{case}: the query is unchanged");
    }
    // A query and a key in one storage take two dispatches, the query's first: the key is still
    // checked before anything is written.
    let qkv = randn((3, 2 * head_size + head_size + 8), CDType::F32, 44);
    let (q, key) = (qkv.narrow(1, 0, 2 * head_size).unwrap(), qkv.narrow(1, 2 * head_size, head_size + 8).unwrap());
    let before = ours(&qkv);
    let err = rotate_with_key(&registry, &positions, &q, &key, &cache, head_size).unwrap_err();
    assert!(err.to_string().contains("head_size"), "{err}");
    assert!(bit_eq(&ours(&qkv), &before), "one storage: nothing written");
}

/// A written tensor made by `broadcast_as` (one memory row seen as many) is refused, nothing
/// written: every row would write the same memory, the last one winning.
#[test]
fn in_place_writes_through_broadcast_views_are_refused() {
    use candle_ops::CandleOpError;
    let registry = cpu_registry();
    let row = randn((1, 64), CDType::F32, 36);
    let broadcast = row.broadcast_as((4, 64)).unwrap();
    let other = randn((4, 64), CDType::F32, 37);
    let row_before = ours(&row);
    let refused = |result: Result<(), CandleOpError>, param: &str| {
        let err = result.unwrap_err();
        match &err {
            CandleOpError::OverlappingWrite { param: named, .. } => assert_eq!(*named, param, "{err}"),
            other => panic!("expected a refused broadcast write of `{param}`: {other}"),
        }
        assert!(err.to_string().contains("one address"), "{err}");
        assert!(bit_eq(&ours(&row), &row_before), "{param}: nothing written");
    };
    let rounding = ir_ops::Rounding::Exact;
    refused(candle_ops::fused_add_rms_norm(&registry, &other, &broadcast, None, 1e-6, rounding), "x_residual");
    refused(candle_ops::fused_add_rms_norm(&registry, &broadcast, &other, None, 1e-6, rounding), "x");
    let cache = ir_ops::rotary_embedding::cos_sin_cache(DType::F32, 8, 64, 10000.0).unwrap().into_candle().unwrap();
    let positions = CTensor::new(&[0i64, 1, 2, 3], &Device::Cpu).unwrap();
    let rotary = candle_ops::rotary_embedding(&registry, &positions, &broadcast, None, &cache, 64, 64, true, rounding);
    refused(rotary, "query");
    let fused_quant = candle_ops::fused_add_rms_norm_dynamic_per_token_quant(
        &registry,
        &other,
        &broadcast,
        None,
        1e-6,
        None,
        DType::F8E4M3FN,
        rounding,
    );
    refused(fused_quant.map(|_| ()), "x_residual");
}

/// Two threads calling ops on the same two tensors in different roles (one writes `b` and `a`,
/// the other reads `a` then `b`; rotary with the query and the cache swapped) finish: every call
/// takes its locks in one global order.
#[test]
fn calls_with_swapped_roles_do_not_deadlock() {
    use std::sync::mpsc;
    use std::time::Duration;
    const CALLS: usize = 4000;
    let registry = std::sync::Arc::new(cpu_registry());
    let a = randn((1, 64), CDType::F32, 38);
    let b = randn((1, 64), CDType::F32, 39);
    let b_row = b.reshape(64).unwrap();
    let (done, finished) = mpsc::channel();
    let spawn = |work: Box<dyn Fn() + Send>| {
        let done = done.clone();
        std::thread::spawn(move || {
            work();
            done.send(()).unwrap();
        })
    };
    let norms = {
        let (registry, a, b) = (registry.clone(), a.clone(), b.clone());
        Box::new(move || {
            for _ in 0..CALLS {
                candle_ops::fused_add_rms_norm(&registry, &a, &b, None, 1e-6, ir_ops::Rounding::Exact).unwrap();
            }
        })
    };
    let reads = {
        let (registry, a, b_row) = (registry.clone(), a.clone(), b_row.clone());
        Box::new(move || {
            for _ in 0..CALLS {
                candle_ops::rms_norm(&registry, &a, Some(&b_row), 1e-6).unwrap();
            }
        })
    };
    let rotary = |query: CTensor, cache: CTensor| {
        let registry = registry.clone();
        Box::new(move || {
            let positions = CTensor::new(&[0i64, 1, 2, 3], &Device::Cpu).unwrap();
            for _ in 0..CALLS {
                let rounding = ir_ops::Rounding::Exact;
                candle_ops::rotary_embedding(&registry, &positions, &query, None, &cache, 8, 8, true, rounding)
                    .unwrap();
            }
        })
    };
    let (p, c) = (randn((4, 8), CDType::F32, 40), randn((4, 8), CDType::F32, 41));
    let threads = [spawn(norms), spawn(reads), spawn(rotary(p.clone(), c.clone())), spawn(rotary(c, p))];
    for _ in &threads {
        finished
            .recv_timeout(Duration::from_secs(60))
            .expect("two calls on the same tensors in different roles deadlocked");
    }
    for thread in threads {
        thread.join().unwrap();
    }
}

/// `gelu_and_mul_sparse` runs on candle tensors too, with the bits of the same op on this crate's
/// tensors.
#[test]
fn gelu_and_mul_sparse_runs_on_candle_tensors() {
    let registry = cpu_registry();
    let x = randn((3, 128), CDType::BF16, 42);
    let out = candle_ops::gelu_and_mul_sparse(&registry, &x, 1.6448536, Approximate::Tanh).unwrap();
    let expected =
        ir_ops::gelu_and_mul_sparse::gelu_and_mul_sparse(&registry, &ours(&x), 1.6448536, Approximate::Tanh).unwrap();
    assert!(bit_eq(&ours(&out), &expected));
    assert_eq!(out.dims(), [3, 64]);
}

/// Written tensors that interleave in one storage without sharing an element (x in the even
/// columns of a buffer, the residual in the odd ones) are a valid call: computed, not refused.
#[test]
fn interleaved_written_tensors_that_share_no_element_are_computed() {
    let registry = cpu_registry();
    let buffer = randn((4, 2 * 64), CDType::F32, 43).reshape((4, 64, 2)).unwrap();
    let x = buffer.narrow(2, 0, 1).unwrap().squeeze(2).unwrap();
    let residual = buffer.narrow(2, 1, 1).unwrap().squeeze(2).unwrap();
    assert_eq!((x.stride(), residual.stride()), (&[128, 2][..], &[128, 2][..]));
    let (xo, ro) = (ours(&x), ours(&residual));
    candle_ops::fused_add_rms_norm(&registry, &x, &residual, None, 1e-6, ir_ops::Rounding::Exact).unwrap();
    let (eo, er) = ir_ops::fused_add_rms_norm::native(&xo, &ro, None, 1e-6, None, ir_ops::Rounding::Exact).unwrap();
    assert!(bit_eq(&ours(&x), &eo) && bit_eq(&ours(&residual), &er));
}

/// Every op the registry defines runs on candle tensors through the binding read from its
/// definition (`candle_ops::call`), with no per-op code: on the op's own generated inputs, the
/// written activations hold native's first outputs and the returned tensors its other outputs,
/// within the op's tolerance, for the cpu provider and for native alone; an op defined by an
/// engine (here a copy of `rms_norm`'s definition under another name) is callable the same way.
#[test]
fn every_registry_op_runs_on_candle_tensors_through_its_declaration() {
    use candle_ops::Candle;
    use ir_core::OpCaller;
    use ir_core::op::{Arg, InputSpec, Overload};
    static ENGINE_NORM: std::sync::LazyLock<ir_core::op::OpDef> =
        std::sync::LazyLock::new(|| ir_core::op::OpDef { name: "engine_norm", ..ir_ops::rms_norm::RMS_NORM });
    let engine_norm: &'static ir_core::op::OpDef = &ENGINE_NORM;
    let native_only = ir_ops::registry();
    native_only.define_op(engine_norm).unwrap();
    let cpu = cpu_registry();
    cpu.define_op(engine_norm).unwrap();
    for (label, registry) in [("cpu", &cpu), ("native", &native_only)] {
        let ops = registry.ops();
        assert!(ops.len() >= 13, "the built-in ops and the engine's: {ops:?}");
        for name in ops {
            let def = registry.op_def(name).unwrap();
            for dtype in [DType::F32, DType::BF16] {
                let spec = InputSpec { num_tokens: 3, hidden_size: 128, dtype, epsilon: 1e-6, seed: 7 };
                let values = (def.generate_inputs)(&spec).unwrap();
                let expected = (def.native)(&values).unwrap().into_vec();
                let candle: Vec<Arg<CTensor>> =
                    values.iter().map(|v| v.clone().map_tensor(|t| t.to_candle().unwrap())).collect();
                let args: Vec<candle_ops::CandleArg<'_>> = candle.iter().map(Arg::borrowed).collect();
                // The path of the generated functional calls (`op::call(&Candle(..), ..)`): every
                // output fresh, no input written.
                let inputs: Vec<Tensor> = candle.iter().filter_map(Arg::as_tensor).map(ours).collect();
                let functional = Candle(registry)
                    .call_op(def, Overload::Default, candle.iter().cloned().collect())
                    .unwrap_or_else(|e| panic!("{label} {name} {dtype}: functional: {e}"));
                assert_eq!(functional.len(), expected.len(), "{label} {name} {dtype}: functional outputs");
                for (i, (g, e)) in functional.iter().zip(&expected).enumerate() {
                    let tolerance = ir_core::op::tolerance(def, e.dtype()).unwrap();
                    allclose(&ours(g), e, tolerance.atol, tolerance.rtol)
                        .unwrap_or_else(|err| panic!("{label} {name} {dtype}: functional output {i}: {err}"));
                }
                let after: Vec<Tensor> = candle.iter().filter_map(Arg::as_tensor).map(ours).collect();
                assert!(inputs.iter().zip(&after).all(|(a, b)| bit_eq(a, b)), "{label} {name} {dtype}: read only");
                // Index tensors (positions) in candle's usual u32 give the i64 call's outputs.
                let is_i64 = |t: &CTensor| t.dtype() == CDType::I64;
                if candle.iter().filter_map(Arg::as_tensor).any(is_i64) {
                    let as_u32: Vec<Arg<CTensor>> = candle
                        .iter()
                        .map(|arg| match arg.as_tensor() {
                            Some(t) if is_i64(t) => Arg::Tensor(t.to_dtype(CDType::U32).unwrap()),
                            _ => arg.clone(),
                        })
                        .collect();
                    let from_u32 = Candle(registry)
                        .call_op(def, Overload::Default, as_u32.into_iter().collect())
                        .unwrap_or_else(|e| panic!("{label} {name} {dtype}: u32 indices: {e}"));
                    for (i, (a, b)) in from_u32.iter().zip(&functional).enumerate() {
                        assert!(bit_eq(&ours(a), &ours(b)), "{label} {name} {dtype}: output {i} from u32 indices");
                    }
                }
                let before = registry.selection_record();
                let fresh =
                    candle_ops::call(registry, def, &args).unwrap_or_else(|e| panic!("{label} {name} {dtype}: {e}"));
                let written: Vec<&CTensor> = if def.allow_inplace {
                    let activations = def.activation_indices().unwrap();
                    activations.iter().filter_map(|&i| args[i].as_tensor().copied()).collect()
                } else {
                    Vec::new()
                };
                let got: Vec<Tensor> = written.into_iter().map(ours).chain(fresh.iter().map(ours)).collect();
                assert_eq!(got.len(), expected.len(), "{label} {name} {dtype}: outputs");
                for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                    let tolerance = ir_core::op::tolerance(def, e.dtype()).unwrap();
                    allclose(g, e, tolerance.atol, tolerance.rtol)
                        .unwrap_or_else(|err| panic!("{label} {name} {dtype}: output {i}: {err}"));
                }
                let step = registry.selection_record().since(&before);
                let record = step.op(name).unwrap_or_else(|| panic!("{label} {name}: recorded"));
                if label == "cpu" && name != "engine_norm" {
                    // The cpu kernels take every op here, in place where the op writes.
                    assert_eq!((record.defensive_copies, record.native_fallbacks), (0, 0), "{label} {name} {dtype}");
                }
            }
        }
        assert!(registry.ops().contains(&"engine_norm"));
    }
    // Bad calls are errors, and write nothing: a residual of another shape, too many arguments, an
    // argument of the wrong kind.
    let x = randn((4, 64), CDType::F32, 40);
    let x_before = ours(&x);
    let fused = &ir_ops::fused_add_rms_norm::FUSED_ADD_RMS_NORM;
    let short = randn((4, 32), CDType::F32, 41);
    let bad_shape = candle_ops::call(&cpu, fused, &[Arg::Tensor(&x), Arg::Tensor(&short), Arg::None, Arg::F64(1e-6)]);
    assert!(bad_shape.unwrap_err().to_string().contains("shape"));
    let too_many =
        [Arg::Tensor(&x), Arg::Tensor(&x), Arg::None, Arg::F64(1e-6), Arg::None, Arg::Str("exact"), Arg::None];
    assert!(candle_ops::call(&cpu, fused, &too_many).unwrap_err().to_string().contains("takes 6 arguments"));
    let wrong_kind = candle_ops::call(&cpu, fused, &[Arg::Tensor(&x), Arg::F64(1.0), Arg::None, Arg::F64(1e-6)]);
    assert!(wrong_kind.unwrap_err().to_string().contains("x_residual"));
    let no_tensor = candle_ops::call(&cpu, fused, &[]).unwrap_err().to_string();
    assert!(no_tensor.contains("no candle tensor argument"), "{no_tensor}");
    assert!(bit_eq(&ours(&x), &x_before), "nothing written");
}

#[test]
fn layer_norm_from_its_row_program_matches_candle_nn() {
    // An op whose only implementations are its row program (native on the reference interpreter,
    // cpu on the block-vectorized one), called on candle tensors through its declaration, beside
    // candle-nn's layer norm.
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).unwrap();
    let ops = candle_ops::Candle(&registry);
    for (dtype, tolerance) in [(CDType::F32, 1e-5), (CDType::BF16, 2e-2)] {
        let x = randn((7, 384), dtype, 21).affine(1.0, 0.5).unwrap();
        let w = randn((1, 384), dtype, 22).squeeze(0).unwrap().affine(0.1, 1.0).unwrap();
        let b = randn((1, 384), dtype, 23).squeeze(0).unwrap().affine(0.1, 0.0).unwrap();
        let ours = ir_ops::layer_norm::call(&ops, &x, Some(&w), Some(&b), 1e-5).unwrap();
        let theirs = candle_nn::ops::layer_norm(&x, &w, &b, 1e-5).unwrap();
        let (ours, theirs) = (ours.to_dtype(CDType::F64).unwrap(), theirs.to_dtype(CDType::F64).unwrap());
        let (a, e) = (
            ours.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            theirs.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        );
        for (index, (a, e)) in a.iter().zip(&e).enumerate() {
            assert!((a - e).abs() <= tolerance * (1.0 + e.abs()), "{dtype:?} element {index}: {a} vs candle-nn's {e}");
        }
    }
    let record = registry.selection_record();
    let op = record.ops.iter().find(|op| op.op == "layer_norm").expect("layer_norm is recorded");
    assert!(op.providers.iter().any(|p| p.provider == "cpu" && p.selections == 2), "{op:?}");
    assert_eq!(op.native_fallbacks, 0, "{op:?}");
}

/// Close to `expected` elementwise (relative to its magnitude), naming the element.
fn assert_near(ours: &CTensor, expected: &CTensor, tolerance: f64, what: &str) {
    let values = |t: &CTensor| t.to_dtype(CDType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    for (index, (a, e)) in values(ours).iter().zip(&values(expected)).enumerate() {
        assert!((a - e).abs() <= tolerance * (1.0 + e.abs()), "{what}: element {index}: {a} vs candle-nn's {e}");
    }
}

#[test]
fn the_fused_add_and_sandwich_norms_match_candle_nn_chains() {
    // Two model patterns with no kernel written (add + LayerNorm; Gemma 2/3's norm, add, norm),
    // called on candle tensors through their declarations, beside the same chains of candle-nn
    // ops an unfused engine runs.
    use ir_ops::Rounding;
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).unwrap();
    let ops = candle_ops::Candle(&registry);
    for (dtype, tolerance) in [(CDType::F32, 1e-5), (CDType::BF16, 2e-2)] {
        let x = randn((5, 256), dtype, 31).affine(3.0, 0.5).unwrap();
        let r = randn((5, 256), dtype, 32);
        let w = randn((1, 256), dtype, 33).squeeze(0).unwrap().affine(0.1, 1.0).unwrap();
        let b = randn((1, 256), dtype, 34).squeeze(0).unwrap().affine(0.1, 0.0).unwrap();
        let v = randn((1, 256), dtype, 35).squeeze(0).unwrap().affine(0.1, 1.0).unwrap();
        let sum = (&x + &r).unwrap();

        let (out, residual) =
            ir_ops::fused_add_layer_norm::call(&ops, &x, &r, Some(&w), Some(&b), 1e-5, Rounding::Dtype).unwrap();
        // The residual is candle's own sum, bit for bit (both round the f32 sum to the dtype).
        assert_near(&residual, &sum, 0.0, &format!("{dtype:?} add + layer_norm: residual"));
        let expected = candle_nn::ops::layer_norm(&sum, &w, &b, 1e-5).unwrap();
        assert_near(&out, &expected, tolerance, &format!("{dtype:?} add + layer_norm: out"));

        let (out, residual) =
            ir_ops::fused_sandwich_rms_norm::call(&ops, &x, &r, Some(&w), Some(&v), 1e-6, Rounding::Dtype).unwrap();
        let h = candle_nn::ops::rms_norm(&x, &w, 1e-6).unwrap();
        let stream = (&h + &r).unwrap();
        assert_near(&residual, &stream, tolerance, &format!("{dtype:?} sandwich: residual"));
        let expected = candle_nn::ops::rms_norm(&stream, &v, 1e-6).unwrap();
        assert_near(&out, &expected, tolerance, &format!("{dtype:?} sandwich: out"));
    }
    let record = registry.selection_record();
    for name in ["fused_add_layer_norm", "fused_sandwich_rms_norm"] {
        let op = record.ops.iter().find(|op| op.op == name).expect("recorded");
        assert!(op.providers.iter().any(|p| p.provider == "cpu" && p.selections == 2), "{op:?}");
        assert_eq!(op.native_fallbacks, 0, "{op:?}");
    }
}
