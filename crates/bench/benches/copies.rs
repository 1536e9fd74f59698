//! Copies of strided views against a compact copy of the same bytes: the column slices of one
//! `qkv` buffer (rows of `width` elements `stride` apart) that rotary and attention take, copied
//! compact (what a defensive copy or `contiguous()` does), beside a compact tensor's copy; and
//! rotary embedding in place on candle tensors (`candle_ops`) on the q and k column slices of one
//! `qkv` buffer, beside the same call on compact q and k.

use candle_core::{DType as CandleDType, Device, Tensor as CandleTensor};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ir_core::{DType, Tensor, TensorMeta};
use ir_ops::Rounding;
use ir_ops::candle_ops;

fn copies(c: &mut Criterion) {
    for dtype in [DType::F32, DType::BF16] {
        for (tokens, width, stride) in [(512, 256, 768), (512, 4096, 12288), (1, 4096, 12288)] {
            let qkv = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, stride]), 1).expect("a qkv buffer");
            let slice = qkv.narrow(1, width, width).expect("the k slice");
            let compact = slice.contiguous().expect("a compact copy");
            let bytes = (tokens * width * dtype.size_in_bytes()) as u64;
            let mut group = c.benchmark_group(format!("copy/{dtype}/{tokens}x{width}"));
            group.throughput(Throughput::Bytes(bytes));
            group.bench_function("compact", |b| b.iter(|| compact.contiguous().expect("copied")));
            group.bench_function(format!("column-slice-of-{stride}"), |b| {
                b.iter(|| slice.contiguous().expect("copied"))
            });
            group.finish();
        }
    }
}

/// Rotary on q and k (a Llama-like 32 query and 8 key heads of 128, 512 tokens) as column slices of
/// one `qkv` buffer (with v after them) against compact q and k, in place through `candle_ops`.
fn rotary_on_slices(c: &mut Criterion) {
    let registry = vllm_ir::registry().expect("the registry");
    let (tokens, heads, kv_heads, head_size) = (512usize, 32usize, 8usize, 128usize);
    let (q_width, k_width) = (heads * head_size, kv_heads * head_size);
    let device = Device::Cpu;
    let positions = CandleTensor::arange(0u32, tokens as u32, &device).expect("positions");
    for dtype in [CandleDType::F32, CandleDType::BF16] {
        let cache = ir_ops::rotary_embedding::cos_sin_cache(DType::F32, 4096, head_size, 10000.0)
            .expect("the cache")
            .into_candle()
            .expect("the cache on candle")
            .to_dtype(dtype)
            .expect("the cache in the dtype");
        let qkv = CandleTensor::randn(0f32, 1.0, (tokens, q_width + 2 * k_width), &device)
            .and_then(|t| t.to_dtype(dtype))
            .expect("a qkv buffer");
        let (q_slice, k_slice) = (qkv.narrow(1, 0, q_width).expect("q"), qkv.narrow(1, q_width, k_width).expect("k"));
        let (q, k) = (q_slice.copy().expect("compact q"), k_slice.copy().expect("compact k"));
        let mut group = c.benchmark_group(format!("rotary/{dtype:?}/{tokens}x{q_width}+{k_width}").to_lowercase());
        let mut rotate = |name: &str, q: &CandleTensor, k: &CandleTensor| {
            group.bench_function(name, |b| {
                b.iter(|| {
                    // Rotating the same rows again keeps them bounded: a rotation preserves norms.
                    candle_ops::rotary_embedding(
                        &registry,
                        &positions,
                        q,
                        Some(k),
                        &cache,
                        head_size,
                        head_size,
                        true,
                        Rounding::Exact,
                    )
                    .expect("rotated")
                })
            });
        };
        rotate("compact", &q, &k);
        rotate("qkv-slices", &q_slice, &k_slice);
        group.finish();
    }
    let record = registry.selection_record();
    let rotary = record.op("rotary_embedding").expect("rotary ran");
    assert_eq!(rotary.defensive_copies, 0, "the slices were rotated where they are");
}

criterion_group! { name = benches; config = Criterion::default().sample_size(30); targets = copies, rotary_on_slices }
criterion_main!(benches);
