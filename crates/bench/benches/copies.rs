//! Copies of strided views against a compact copy of the same bytes: the column slices of one
//! `qkv` buffer (rows of `width` elements `stride` apart) that rotary and attention take, copied
//! compact (what a defensive copy or `contiguous()` does), beside a compact tensor's copy.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ir_core::{DType, Tensor, TensorMeta};

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

criterion_group! { name = benches; config = Criterion::default().sample_size(30); targets = copies }
criterion_main!(benches);
