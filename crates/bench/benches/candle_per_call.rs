//! `candle per call`: one token's op call through `candle_ops` on candle tensors, beside the cpu
//! kernel called directly on this project's tensors and candle-nn's equivalent, at every hidden
//! size from 256 to 8192, f32 and bf16 (feature `candle`). The report's targets: `candle_ops` no
//! slower than candle-nn, and no slower than 1.2× the direct kernel plus 100 ns.

use criterion::{Criterion, criterion_group, criterion_main};
use ir_core::{DType, Platform, PriorityConfig, Registry, Tensor, TensorMeta, UniqueTensor};
use ir_ops::Rounding;
use ir_ops::candle_ops;

/// The hidden sizes measured.
const HIDDEN: [usize; 6] = [256, 512, 1024, 2048, 4096, 8192];

fn registry() -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("the cpu priorities");
    registry.freeze();
    registry
}

fn unique(tensor: Tensor) -> UniqueTensor {
    UniqueTensor::new(tensor).unwrap_or_else(|_| panic!("a fresh tensor is uniquely owned"))
}

fn candle_per_call(c: &mut Criterion) {
    let registry = registry();
    let to_candle = |t: &Tensor| t.deep_clone().expect("copied").into_candle().expect("candle");
    for dtype in [DType::F32, DType::BF16] {
        for hidden in HIDDEN {
            let x = Tensor::randn(&TensorMeta::compact(dtype, &[1, hidden]), 1).expect("x");
            let w = Tensor::randn(&TensorMeta::compact(dtype, &[hidden]), 2).expect("w");
            let gate_up = Tensor::randn(&TensorMeta::compact(dtype, &[1, 2 * hidden]), 3).expect("gate_up");
            let (cx, cw, cg) = (to_candle(&x), to_candle(&w), to_candle(&gate_up));
            let residual = cx.copy().expect("residual");
            let mut group = c.benchmark_group(format!("candle_per_call/{dtype}/1x{hidden}"));

            group.bench_function("rms_norm/candle_ops", |b| {
                b.iter(|| candle_ops::rms_norm(&registry, &cx, Some(&cw), 1e-6).expect("ran"))
            });
            group.bench_function("rms_norm/direct", |b| {
                b.iter(|| kernels_cpu::rms_norm_cpu(&x, Some(&w), 1e-6, None).expect("ran"))
            });
            group.bench_function("rms_norm/candle-nn", |b| {
                b.iter(|| candle_nn::ops::rms_norm(&cx, &cw, 1e-6).expect("ran"))
            });

            group.bench_function("fused_add_rms_norm/candle_ops", |b| {
                b.iter(|| {
                    candle_ops::fused_add_rms_norm(&registry, &cx, &residual, Some(&cw), 1e-6, Rounding::Exact)
                        .expect("ran")
                })
            });
            let mut state = Some((x.deep_clone().expect("x"), x.deep_clone().expect("r")));
            group.bench_function("fused_add_rms_norm/direct", |b| {
                b.iter(|| {
                    let (x, r) = state.take().expect("held");
                    let (x, r) = kernels_cpu::fused_add_rms_norm_cpu(
                        unique(x),
                        unique(r),
                        Some(&w),
                        1e-6,
                        None,
                        Rounding::Exact,
                    )
                    .expect("ran");
                    state = Some((x, r));
                })
            });
            group.bench_function("fused_add_rms_norm/candle-nn", |b| {
                b.iter(|| {
                    let sum = (&cx + &residual).expect("added");
                    candle_nn::ops::rms_norm(&sum, &cw, 1e-6).expect("ran")
                })
            });

            group.bench_function("silu_and_mul/candle_ops", |b| {
                b.iter(|| candle_ops::silu_and_mul(&registry, &cg).expect("ran"))
            });
            group.bench_function("silu_and_mul/direct", |b| {
                b.iter(|| kernels_cpu::gated::run(&gate_up, kernels_cpu::gated::Silu).expect("ran"))
            });
            group.bench_function("silu_and_mul/candle-nn", |b| {
                b.iter(|| {
                    let (gate, up) =
                        (cg.narrow(1, 0, hidden).expect("gate"), cg.narrow(1, hidden, hidden).expect("up"));
                    (candle_nn::ops::silu(&gate).expect("silu") * up).expect("ran")
                })
            });
            group.finish();
        }
    }
}

criterion_group! { name = benches; config = Criterion::default().sample_size(30); targets = candle_per_call }
criterion_main!(benches);
