//! Row programs on the cpu: the block-vectorized interpreter (`kernels_cpu::program`) running a
//! built-in op's program beside the hand-written cpu kernel of the op, at decode (1 × 4096) and
//! prefill (512 × 4096), f32 and bf16. Both return fresh outputs. And three fused patterns, each
//! beside its unfused chain: `silu_and_mul_dynamic_fp8_quant` (as one program and as the cpu
//! provider's composed rows, beside two programs and the two hand-written kernels), and, in place
//! on donated activations (copied outside the timing), `fused_sandwich_rms_norm` (one program, and
//! the cpu provider's composed norm rows, beside the hand-written `rms_norm` then
//! `fused_add_rms_norm`) and `fused_add_layer_norm` (one program beside an in-place add program
//! then the `layer_norm` program), and Qwen3's `fused_qk_norm_rope` in place on the q and k slices
//! of a qkv buffer (the cpu provider's composed rows) beside the hand-written `rms_norm` of the
//! heads then rotary.

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use ir_core::{DType, Tensor, TensorMeta, UniqueTensor};
use ir_ops::Rounding;
use ir_ops::row_program::{BinaryOp, InPlaceArg, OutDType, Precision, RowArg, RowProgram, builtin};
use kernels_cpu::program::{run_row_program, run_row_program_in_place};

/// A uniquely owned copy of `t`, to donate.
fn donate(t: &Tensor) -> UniqueTensor {
    UniqueTensor::new(t.deep_clone().expect("a copy")).unwrap_or_else(|_| panic!("a fresh copy is uniquely owned"))
}

/// `residual ← x + residual` in place, in f32 rounded to x's dtype: the add of an unfused engine.
fn add_in_place() -> RowProgram {
    let mut b = RowProgram::builder("add");
    let x = b.activation("x", 1);
    let r = b.activation("residual", 1);
    let (a, c) = (b.load(x, 0), b.load(r, 0));
    let sum = b.binary(BinaryOp::Add, a, c, Precision::Compute);
    let sum = b.round(sum, Precision::Like(x));
    b.store("residual_out", sum, OutDType::Like(r), Some(r));
    b.build().expect("well formed")
}

/// Runs the fused-add program `program` in place on fresh donated copies of `x` and `r` (made
/// outside the timing), with `vectors` and epsilon.
fn bench_in_place(b: &mut criterion::Bencher<'_>, program: &RowProgram, x: &Tensor, r: &Tensor, vectors: &[&Tensor]) {
    b.iter_batched(
        || (donate(x), donate(r)),
        |(mut x, mut r)| {
            let mut args = vec![InPlaceArg::Donated(&mut x), InPlaceArg::Donated(&mut r)];
            args.extend(vectors.iter().map(|v| InPlaceArg::Read(RowArg::Tensor(v))));
            args.push(InPlaceArg::Read(RowArg::Scalar(1e-6)));
            run_row_program_in_place(program, &mut args).expect("ran");
            (x, r)
        },
        BatchSize::LargeInput,
    )
}

fn row_programs(c: &mut Criterion) {
    let hidden = 4096;
    for dtype in [DType::F32, DType::BF16] {
        for tokens in [1usize, 512] {
            let x = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, hidden]), 1).expect("x");
            let w = Tensor::randn(&TensorMeta::compact(dtype, &[hidden]), 2).expect("w");
            let gate_up = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, 2 * hidden]), 3).expect("gate_up");
            let mut group = c.benchmark_group(format!("row_programs/{dtype}/{tokens}x{hidden}"));
            let norm = builtin::rms_norm(true, false);
            group.bench_function("rms_norm/program", |b| {
                let args = [RowArg::Tensor(&x), RowArg::Tensor(&w), RowArg::Scalar(1e-6)];
                b.iter(|| run_row_program(&norm, &args).expect("ran"))
            });
            group.bench_function("rms_norm/hand-written", |b| {
                b.iter(|| kernels_cpu::rms_norm_cpu(&x, Some(&w), 1e-6, None).expect("ran"))
            });
            let silu = builtin::silu_and_mul();
            group.bench_function("silu_and_mul/program", |b| {
                let args = [RowArg::Tensor(&gate_up)];
                b.iter(|| run_row_program(&silu, &args).expect("ran"))
            });
            group.bench_function("silu_and_mul/hand-written", |b| {
                b.iter(|| kernels_cpu::gated::run(&gate_up, kernels_cpu::gated::Silu).expect("ran"))
            });
            let quant = builtin::dynamic_per_token_scaled_fp8_quant(DType::F8E4M3FN, false).expect("fp8");
            group.bench_function("dynamic_per_token_scaled_fp8_quant/program", |b| {
                let args = [RowArg::Tensor(&x)];
                b.iter(|| run_row_program(&quant, &args).expect("ran"))
            });
            group.bench_function("dynamic_per_token_scaled_fp8_quant/hand-written", |b| {
                b.iter(|| {
                    kernels_cpu::quant::dynamic_per_token_scaled_fp8_quant_cpu(&x, None, DType::F8E4M3FN).expect("ran")
                })
            });
            // A fused pattern: silu_and_mul then the per-token quantization of its output, as one
            // program (the gated values never stored) beside the unfused pair, as programs and as
            // the hand-written kernels.
            let fused = builtin::silu_and_mul_dynamic_fp8_quant(DType::F8E4M3FN, false).expect("fp8");
            group.bench_function("silu_and_mul_dynamic_fp8_quant/fused-program", |b| {
                let args = [RowArg::Tensor(&gate_up)];
                b.iter(|| run_row_program(&fused, &args).expect("ran"))
            });
            group.bench_function("silu_and_mul_dynamic_fp8_quant/unfused-programs", |b| {
                b.iter(|| {
                    let gated = run_row_program(&silu, &[RowArg::Tensor(&gate_up)]).expect("ran");
                    run_row_program(&quant, &[RowArg::Tensor(&gated[0])]).expect("ran")
                })
            });
            group.bench_function("silu_and_mul_dynamic_fp8_quant/fused-cpu-rows", |b| {
                b.iter(|| {
                    kernels_cpu::quant::silu_and_mul_dynamic_fp8_quant_cpu(&gate_up, None, DType::F8E4M3FN)
                        .expect("ran")
                })
            });
            group.bench_function("silu_and_mul_dynamic_fp8_quant/unfused-hand-written", |b| {
                b.iter(|| {
                    let gated = kernels_cpu::gated::run(&gate_up, kernels_cpu::gated::Silu).expect("ran");
                    kernels_cpu::quant::dynamic_per_token_scaled_fp8_quant_cpu(&gated, None, DType::F8E4M3FN)
                        .expect("ran")
                })
            });
            // Gemma 2/3's sandwich: norm of the block's output, residual add, norm of the sum.
            let r = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, hidden]), 4).expect("residual");
            let v = Tensor::randn(&TensorMeta::compact(dtype, &[hidden]), 5).expect("v");
            let sandwich = builtin::fused_sandwich_rms_norm(true, true, Rounding::Dtype);
            group.bench_function("fused_sandwich_rms_norm/fused-program", |b| {
                bench_in_place(b, &sandwich, &x, &r, &[&w, &v])
            });
            group.bench_function("fused_sandwich_rms_norm/fused-cpu-rows", |b| {
                b.iter_batched(
                    || (donate(&x), donate(&r)),
                    |(x, r)| {
                        kernels_cpu::fused_sandwich_rms_norm_cpu(x, r, Some(&w), Some(&v), 1e-6, Rounding::Dtype)
                            .expect("ran")
                    },
                    BatchSize::LargeInput,
                )
            });
            group.bench_function("fused_sandwich_rms_norm/unfused-hand-written", |b| {
                b.iter_batched(
                    || donate(&r),
                    |r| {
                        let h = kernels_cpu::rms_norm_cpu(&x, Some(&w), 1e-6, None).expect("ran");
                        let h = UniqueTensor::new(h).unwrap_or_else(|_| panic!("fresh"));
                        kernels_cpu::fused_add_rms_norm_cpu(h, r, Some(&v), 1e-6, None, Rounding::Dtype).expect("ran")
                    },
                    BatchSize::LargeInput,
                )
            });
            // add + LayerNorm.
            let add_ln = builtin::fused_add_layer_norm(true, true, Rounding::Dtype);
            let layer_norm = builtin::layer_norm(true, true);
            group.bench_function("fused_add_layer_norm/fused-program", |b| {
                bench_in_place(b, &add_ln, &x, &r, &[&w, &v])
            });
            let add = add_in_place();
            group.bench_function("fused_add_layer_norm/unfused-programs", |b| {
                b.iter_batched(
                    || donate(&r),
                    |mut r| {
                        let mut args = [InPlaceArg::Read(RowArg::Tensor(&x)), InPlaceArg::Donated(&mut r)];
                        run_row_program_in_place(&add, &mut args).expect("ran");
                        let args =
                            [RowArg::Tensor(r.tensor()), RowArg::Tensor(&w), RowArg::Tensor(&v), RowArg::Scalar(1e-6)];
                        (run_row_program(&layer_norm, &args).expect("ran"), r)
                    },
                    BatchSize::LargeInput,
                )
            });
            qk_norm_rope(&mut group, dtype, tokens);
            group.finish();
        }
    }
}

/// Qwen3-8B's attention input (32 query heads, 8 key heads of 128, a `[T, 6144]` qkv buffer):
/// `fused_qk_norm_rope` in place on the q and k column slices of qkv (the cpu provider's composed
/// rows, and the program in place on compact q and k), beside the unfused chain the engine runs:
/// the cpu `rms_norm` of each slice's heads (fresh results), then the cpu rotary in place on them.
fn qk_norm_rope(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    dtype: DType,
    tokens: usize,
) {
    use ir_ops::rotary_embedding::cos_sin_cache;
    let (heads, kv_heads, head_size) = (32usize, 8usize, 128usize);
    let width = (heads + 2 * kv_heads) * head_size;
    let qkv = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, width]), 6).expect("qkv");
    let q_weight = Tensor::randn(&TensorMeta::compact(dtype, &[head_size]), 7).expect("q_weight");
    let k_weight = Tensor::randn(&TensorMeta::compact(dtype, &[head_size]), 8).expect("k_weight");
    let cache = cos_sin_cache(dtype, 4096, head_size, 1e6).expect("cache");
    let positions: Vec<i64> = (0..tokens as i64).map(|t| (t * 7 + 3) % 4096).collect();
    let positions = Tensor::from_slice(&[tokens], &positions).expect("positions");
    let slice = |t: &Tensor, first: usize, count: usize| {
        t.narrow(1, first * head_size, count * head_size).expect("a slice of qkv")
    };
    // A donated copy of qkv's q and k slices (each the only view of its copy's storage).
    let donated_slices = || {
        let unique = |first, count| {
            let view = slice(&qkv.deep_clone().expect("a copy"), first, count);
            UniqueTensor::new(view).unwrap_or_else(|_| panic!("the only view"))
        };
        (unique(0, heads), unique(heads, kv_heads))
    };
    group.bench_function("fused_qk_norm_rope/fused-cpu-rows", |b| {
        b.iter_batched(
            donated_slices,
            |(q, k)| {
                let (q_weight, k_weight, neox) = (&q_weight, Some(&k_weight), true);
                let size = head_size as i64;
                kernels_cpu::rotary::fused_qk_norm_rope_cpu(
                    &positions,
                    q,
                    Some(k),
                    q_weight,
                    k_weight,
                    &cache,
                    1e-6,
                    size,
                    size,
                    neox,
                    Rounding::Exact,
                )
                .expect("ran")
            },
            BatchSize::LargeInput,
        )
    });
    let program = ir_ops::fused_qk_norm_rope::program(true, Rounding::Exact);
    let q_compact = slice(&qkv, 0, heads).contiguous().expect("q");
    group.bench_function("fused_qk_norm_rope/fused-program-query", |b| {
        b.iter_batched(
            || donate(&q_compact.reshape(&[tokens, heads, head_size]).expect("heads")),
            |mut q| {
                let mut args = [
                    InPlaceArg::Read(RowArg::Tensor(&positions)),
                    InPlaceArg::Donated(&mut q),
                    InPlaceArg::Read(RowArg::Tensor(&q_weight)),
                    InPlaceArg::Read(RowArg::Tensor(&cache)),
                    InPlaceArg::Read(RowArg::Scalar(1e-6)),
                ];
                run_row_program_in_place(program, &mut args).expect("ran");
                q
            },
            BatchSize::LargeInput,
        )
    });
    group.bench_function("fused_qk_norm_rope/unfused-hand-written", |b| {
        b.iter(|| {
            let norm = |first, count, weight: &Tensor| {
                let heads_view = slice(&qkv, first, count).reshape(&[tokens, count, head_size]).expect("heads");
                let rows = {
                    let normed = kernels_cpu::rms_norm_cpu(&heads_view, Some(weight), 1e-6, None).expect("ran");
                    normed.reshape(&[tokens, count * head_size]).expect("rows")
                };
                UniqueTensor::new(rows).unwrap_or_else(|_| panic!("fresh"))
            };
            let (q, k) = (norm(0, heads, &q_weight), norm(heads, kv_heads, &k_weight));
            let size = head_size as i64;
            let launch =
                kernel_support::RotaryLaunch::of(&positions, q.tensor(), Some(k.tensor()), &cache, size, size, true)
                    .expect("launch");
            let call = kernel_support::RotaryCall {
                positions: &positions,
                query: q,
                key: Some(k),
                cos_sin_cache: &cache,
                launch,
                round_products: false,
            };
            kernels_cpu::rotary::rotary_embedding_cpu(call).expect("ran")
        })
    });
}

criterion_group! { name = benches; config = Criterion::default().sample_size(20); targets = row_programs }
criterion_main!(benches);
