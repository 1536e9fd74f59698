//! One decode token's op calls (1 × 4096 and 1 × 8192, f32 and bf16), whole calls as an engine
//! makes them: this project's ops through the registry on its own tensors and on candle tensors
//! (`candle_ops`), beside candle-nn's equivalents in the same run (feature `candle`; without it,
//! only ours).

use criterion::{Criterion, criterion_group, criterion_main};
use ir_core::{DType, Platform, PriorityConfig, Registry, Tensor, TensorMeta};
use ir_ops::Rounding;

fn registry() -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("the cpu priorities");
    registry
}

fn decode_ops(c: &mut Criterion) {
    let registry = registry();
    for dtype in [DType::F32, DType::BF16] {
        for hidden in [4096usize, 8192] {
            let x = Tensor::randn(&TensorMeta::compact(dtype, &[1, hidden]), 1).expect("x");
            let w = Tensor::randn(&TensorMeta::compact(dtype, &[hidden]), 2).expect("w");
            let gate_up = Tensor::randn(&TensorMeta::compact(dtype, &[1, 2 * hidden]), 3).expect("gate_up");
            let mut group = c.benchmark_group(format!("decode/{dtype}/1x{hidden}"));
            group.bench_function("rms_norm/ours", |b| {
                b.iter(|| ir_ops::rms_norm::rms_norm(&registry, &x, Some(&w), 1e-6, None).expect("ran"))
            });
            group.bench_function("silu_and_mul/ours", |b| {
                b.iter(|| ir_ops::silu_and_mul::silu_and_mul(&registry, &gate_up).expect("ran"))
            });
            let mut state = Some((x.deep_clone().expect("x"), x.deep_clone().expect("r")));
            group.bench_function("fused_add_rms_norm/ours", |b| {
                b.iter(|| {
                    let (x, r) = state.take().expect("held");
                    state = Some(
                        ir_ops::fused_add_rms_norm::maybe_inplace(
                            &registry,
                            x,
                            r,
                            Some(&w),
                            1e-6,
                            None,
                            Rounding::Exact,
                        )
                        .expect("ran"),
                    );
                })
            });
            // Rotary at the hidden size's head layout (heads of 128, a quarter as many kv heads).
            let (heads, head_size) = (hidden / 128, 128);
            let cache = ir_ops::rotary_embedding::cos_sin_cache(dtype, 4096, head_size, 10000.0).expect("cache");
            let positions = Tensor::from_vec(&[1], vec![1234i64]).expect("positions");
            let q = Tensor::randn(&TensorMeta::compact(dtype, &[1, hidden]), 4).expect("q");
            let k = Tensor::randn(&TensorMeta::compact(dtype, &[1, hidden / 4]), 5).expect("k");
            let mut qk = Some((q.deep_clone().expect("q"), k.deep_clone().expect("k")));
            group.bench_function("rotary_embedding/ours", |b| {
                b.iter(|| {
                    let (q, k) = qk.take().expect("held");
                    let (q, k) = ir_ops::rotary_embedding::maybe_inplace(
                        &registry,
                        &positions,
                        q,
                        Some(k),
                        &cache,
                        head_size as i64,
                        head_size as i64,
                        true,
                        Rounding::Exact,
                    )
                    .expect("ran");
                    qk = Some((q, k.expect("a key")));
                })
            });
            #[cfg(feature = "candle")]
            candle_side(&mut group, &registry, &x, &w, &gate_up);
            #[cfg(feature = "candle")]
            candle_rotary(&mut group, &registry, (&q, &k, &cache), heads, head_size);
            let _ = heads;
            group.finish();
        }
    }
}

#[cfg(feature = "candle")]
fn candle_side(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    registry: &Registry,
    x: &Tensor,
    w: &Tensor,
    gate_up: &Tensor,
) {
    use ir_ops::candle_ops;
    let to_candle = |t: &Tensor| t.deep_clone().expect("copied").into_candle().expect("candle");
    let (cx, cw, cg) = (to_candle(x), to_candle(w), to_candle(gate_up));
    let residual = cx.copy().expect("residual");
    let d = gate_up.shape()[1] / 2;
    group.bench_function("rms_norm/candle_ops", |b| {
        b.iter(|| candle_ops::rms_norm(registry, &cx, Some(&cw), 1e-6).expect("ran"))
    });
    group.bench_function("rms_norm/candle-nn", |b| b.iter(|| candle_nn::ops::rms_norm(&cx, &cw, 1e-6).expect("ran")));
    group.bench_function("fused_add_rms_norm/candle_ops", |b| {
        b.iter(|| {
            candle_ops::fused_add_rms_norm(registry, &cx, &residual, Some(&cw), 1e-6, Rounding::Exact).expect("ran")
        })
    });
    group.bench_function("fused_add_rms_norm/candle-nn", |b| {
        b.iter(|| {
            let sum = (&cx + &residual).expect("added");
            candle_nn::ops::rms_norm(&sum, &cw, 1e-6).expect("ran")
        })
    });
    group.bench_function("silu_and_mul/candle_ops", |b| {
        b.iter(|| candle_ops::silu_and_mul(registry, &cg).expect("ran"))
    });
    group.bench_function("silu_and_mul/candle-nn", |b| {
        b.iter(|| {
            let (gate, up) = (cg.narrow(1, 0, d).expect("gate"), cg.narrow(1, d, d).expect("up"));
            (candle_nn::ops::silu(&gate).expect("silu") * up).expect("ran")
        })
    });
}

#[cfg(feature = "candle")]
fn candle_rotary(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    registry: &Registry,
    (q, k, cache): (&Tensor, &Tensor, &Tensor),
    heads: usize,
    head_size: usize,
) {
    use ir_ops::candle_ops;
    let to_candle = |t: &Tensor| t.deep_clone().expect("copied").into_candle().expect("candle");
    let (cq, ck, cc) = (to_candle(q), to_candle(k), to_candle(cache));
    let positions = candle_core::Tensor::new(&[1234u32], &candle_core::Device::Cpu).expect("positions");
    group.bench_function("rotary_embedding/candle_ops", |b| {
        b.iter(|| {
            candle_ops::rotary_embedding(
                registry,
                &positions,
                &cq,
                Some(&ck),
                &cc,
                head_size,
                head_size,
                true,
                Rounding::Exact,
            )
            .expect("ran")
        })
    });
    let half = head_size / 2;
    let (cos, sin) = (
        cc.narrow(0, 1234, 1).and_then(|c| c.narrow(1, 0, half)).expect("cos"),
        cc.narrow(0, 1234, 1).and_then(|c| c.narrow(1, half, half)).and_then(|s| s.contiguous()).expect("sin"),
    );
    let cos = cos.contiguous().expect("cos");
    let (q4, k4) =
        (cq.reshape((1, heads, 1, head_size)).expect("q"), ck.reshape((1, heads / 4, 1, head_size)).expect("k"));
    group.bench_function("rotary_embedding/candle-nn", |b| {
        b.iter(|| {
            (
                candle_nn::rotary_emb::rope(&q4, &cos, &sin).expect("q"),
                candle_nn::rotary_emb::rope(&k4, &cos, &sin).expect("k"),
            )
        })
    });
}

criterion_group! { name = benches; config = Criterion::default().sample_size(50); targets = decode_ops }
criterion_main!(benches);
