//! What `rounding = "dtype"` costs against `"exact"` on the cpu provider, on the shape the parity
//! setting is used at (a bf16 prefill of 512 tokens): `rotary_embedding` on q and k (32 and 8 heads
//! of 128), in place, beside a copy of the same bytes. The target: `dtype` within 1.2 times
//! `exact`.

use criterion::{Criterion, criterion_group, criterion_main};
use ir_core::op::StrEnum;
use ir_core::{DType, Platform, PriorityConfig, Tensor, TensorMeta};
use ir_ops::Rounding;

fn rounding(c: &mut Criterion) {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("the cpu priorities");
    let (tokens, heads, kv_heads, head_size) = (512usize, 32usize, 8usize, 128usize);
    for dtype in [DType::BF16, DType::F32] {
        let cache = ir_ops::rotary_embedding::cos_sin_cache(dtype, 4096, head_size, 10000.0).expect("cache");
        let positions: Vec<i64> = (0..tokens as i64).map(|t| (t * 7) % 4096).collect();
        let positions = Tensor::from_vec(&[tokens], positions).expect("positions");
        let q = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, heads * head_size]), 1).expect("q");
        let k = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, kv_heads * head_size]), 2).expect("k");
        let mut group = c.benchmark_group(format!("rounding/rotary_embedding/{dtype}/{tokens}x{}", heads * head_size));
        for rounding in [Rounding::Exact, Rounding::Dtype] {
            let mut qk = Some((q.deep_clone().expect("q"), k.deep_clone().expect("k")));
            group.bench_function(rounding.as_str(), |b| {
                b.iter(|| {
                    let (q, k) = qk.take().expect("held");
                    let rotate = ir_ops::rotary_embedding::maybe_inplace;
                    let (q, k) =
                        rotate(&registry, &positions, q, Some(k), &cache, 128, 128, true, rounding).expect("ran");
                    qk = Some((q, k.expect("a key")));
                })
            });
        }
        group.bench_function("copy", |b| b.iter(|| (q.deep_clone().expect("q"), k.deep_clone().expect("k"))));
        group.finish();
    }
}

criterion_group!(benches, rounding);
criterion_main!(benches);
