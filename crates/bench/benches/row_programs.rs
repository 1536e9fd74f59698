//! Row programs on the cpu: the block-vectorized interpreter (`kernels_cpu::program`) running a
//! built-in op's program beside the hand-written cpu kernel of the op, at decode (1 × 4096) and
//! prefill (512 × 4096), f32 and bf16. Both return fresh outputs. And one fused pattern,
//! `silu_and_mul_dynamic_fp8_quant`, as one program beside the unfused pair (two programs, and the
//! two hand-written kernels).

use criterion::{Criterion, criterion_group, criterion_main};
use ir_core::{DType, Tensor, TensorMeta};
use ir_ops::row_program::{RowArg, builtin};

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
                b.iter(|| kernels_cpu::program::run_row_program(&norm, &args).expect("ran"))
            });
            group.bench_function("rms_norm/hand-written", |b| {
                b.iter(|| kernels_cpu::rms_norm_cpu(&x, Some(&w), 1e-6, None).expect("ran"))
            });
            let silu = builtin::silu_and_mul();
            group.bench_function("silu_and_mul/program", |b| {
                let args = [RowArg::Tensor(&gate_up)];
                b.iter(|| kernels_cpu::program::run_row_program(&silu, &args).expect("ran"))
            });
            group.bench_function("silu_and_mul/hand-written", |b| {
                b.iter(|| kernels_cpu::gated::run(&gate_up, kernels_cpu::gated::Silu).expect("ran"))
            });
            let quant = builtin::dynamic_per_token_scaled_fp8_quant(DType::F8E4M3FN, false).expect("fp8");
            group.bench_function("dynamic_per_token_scaled_fp8_quant/program", |b| {
                let args = [RowArg::Tensor(&x)];
                b.iter(|| kernels_cpu::program::run_row_program(&quant, &args).expect("ran"))
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
                b.iter(|| kernels_cpu::program::run_row_program(&fused, &args).expect("ran"))
            });
            group.bench_function("silu_and_mul_dynamic_fp8_quant/unfused-programs", |b| {
                b.iter(|| {
                    let gated = kernels_cpu::program::run_row_program(&silu, &[RowArg::Tensor(&gate_up)]).expect("ran");
                    kernels_cpu::program::run_row_program(&quant, &[RowArg::Tensor(&gated[0])]).expect("ran")
                })
            });
            group.bench_function("silu_and_mul_dynamic_fp8_quant/unfused-hand-written", |b| {
                b.iter(|| {
                    let gated = kernels_cpu::gated::run(&gate_up, kernels_cpu::gated::Silu).expect("ran");
                    kernels_cpu::quant::dynamic_per_token_scaled_fp8_quant_cpu(&gated, None, DType::F8E4M3FN)
                        .expect("ran")
                })
            });
            group.finish();
        }
    }
}

criterion_group! { name = benches; config = Criterion::default().sample_size(20); targets = row_programs }
criterion_main!(benches);
