//! vllm-ir's ops on candle CUDA tensors: each op through `candle_ops` on candle's `CudaStorage`
//! and stream, checked against the same call on candle CPU tensors (the `native` provider), and
//! the selection record checked: the `cuda` provider chosen, in-place ops written in place, no
//! defensive copy, no native fallback. Exits non-zero on any difference; says `skipped` and why
//! when the machine has no usable CUDA device.

#![allow(clippy::print_stdout)]

use std::error::Error;

use candle_core::{DType, Device, Tensor};
use ir_core::Registry;
use ir_ops::Rounding;
use ir_ops::candle_ops;
use ir_ops::gelu_and_mul::Approximate;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn main() -> Result<()> {
    if let ir_core::Availability::Unavailable(reason) = kernels_cuda::availability() {
        println!("skipped: no usable CUDA device ({reason})");
        return Ok(());
    }
    let gpu = Device::new_cuda(0)?;
    // On the GPU: the `cuda` provider only (a fallback to `native` would be counted and refused).
    let cuda = ir_ops::registry();
    kernels_cuda::register(&cuda)?;
    // Every built-in op, each of which `check` calls.
    let ops = cuda.ops();
    for op in &ops {
        cuda.set_default(op, &["cuda"])?;
    }
    // On the CPU: the reference semantics.
    let reference = ir_ops::registry();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let before = cuda.selection_record();
        check(&cuda, &reference, &gpu, dtype)?;
        let step = cuda.selection_record().since(&before);
        print!("{dtype:?}:\n{step}");
        if step.defensive_copies() != 0 || step.native_fallbacks() != 0 {
            return Err(format!(
                "{dtype:?}: {} copies, {} fallbacks",
                step.defensive_copies(),
                step.native_fallbacks()
            )
            .into());
        }
        for op in &ops {
            if step.selections(op, "cuda") == 0 {
                return Err(format!("{dtype:?}: `{op}` never ran on the cuda provider").into());
            }
        }
    }
    println!("every op on candle CUDA tensors matches the CPU reference");
    Ok(())
}

/// The largest difference between a GPU result and the CPU reference, in f32.
fn max_diff(gpu: &Tensor, cpu: &Tensor) -> Result<f32> {
    let gpu = gpu.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    Ok((gpu - cpu.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn expect_close(what: &str, dtype: DType, gpu: &Tensor, cpu: &Tensor) -> Result<()> {
    let tolerance = match dtype {
        DType::F32 => 1e-4,
        _ => 0.05,
    };
    let diff = max_diff(gpu, cpu)?;
    if diff.is_nan() || diff > tolerance {
        return Err(format!("{what} ({dtype:?}): max |gpu - cpu| = {diff} > {tolerance}").into());
    }
    Ok(())
}

/// Per-token scales: within 1% of the reference's largest.
fn expect_scales(what: &str, gpu: &Tensor, cpu: &Tensor) -> Result<()> {
    let diff = max_diff(gpu, cpu)?;
    let largest = cpu.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    if diff.is_nan() || diff > 0.01 * largest {
        return Err(format!("{what}: max |gpu - cpu| = {diff}, largest scale {largest}").into());
    }
    Ok(())
}

/// fp8 codes may differ by one step where the GPU rounds a value on a tie: compared as values.
fn expect_codes(what: &str, gpu: &Tensor, cpu: &Tensor) -> Result<()> {
    let diff = max_diff(gpu, cpu)?;
    let bound = cpu.to_dtype(DType::F32)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? / 8.0;
    if diff.is_nan() || diff > bound.max(1e-3) {
        return Err(format!("{what}: max |gpu - cpu| code value = {diff}").into());
    }
    Ok(())
}

fn check(cuda: &Registry, reference: &Registry, gpu: &Device, dtype: DType) -> Result<()> {
    let cpu = Device::Cpu;
    let (tokens, hidden, heads, kv_heads, head_size) = (8, 1024, 8, 2, 128);
    let random =
        |shape: (usize, usize)| -> Result<Tensor> { Ok(Tensor::randn(0f32, 1.0, shape, &cpu)?.to_dtype(dtype)?) };
    let on_gpu = |t: &Tensor| t.to_device(gpu);
    let weight = (Tensor::randn(0f32, 0.1, hidden, &cpu)? + 1.0)?.to_dtype(dtype)?;
    let e4m3 = ir_core::DType::F8E4M3FN;

    // rms_norm, the gated activations: fresh outputs.
    let x = random((tokens, hidden))?;
    let (gx, gw) = (on_gpu(&x)?, on_gpu(&weight)?);
    let out = candle_ops::rms_norm(cuda, &gx, Some(&gw), 1e-6)?;
    expect_close("rms_norm", dtype, &out, &candle_ops::rms_norm(reference, &x, Some(&weight), 1e-6)?)?;
    let gate_up = random((tokens, 2 * hidden))?;
    let out = candle_ops::silu_and_mul(cuda, &on_gpu(&gate_up)?)?;
    expect_close("silu_and_mul", dtype, &out, &candle_ops::silu_and_mul(reference, &gate_up)?)?;
    let out = candle_ops::gelu_and_mul(cuda, &on_gpu(&gate_up)?, Approximate::Tanh)?;
    expect_close("gelu_and_mul", dtype, &out, &candle_ops::gelu_and_mul(reference, &gate_up, Approximate::Tanh)?)?;

    // fused_add_rms_norm: both activations written in place on the GPU.
    let residual = random((tokens, hidden))?;
    let (gx, gr) = (on_gpu(&x)?, on_gpu(&residual)?);
    let (cx, cr) = (x.copy()?, residual.copy()?);
    candle_ops::fused_add_rms_norm(cuda, &gx, &gr, Some(&gw), 1e-6, Rounding::Exact)?;
    candle_ops::fused_add_rms_norm(reference, &cx, &cr, Some(&weight), 1e-6, Rounding::Exact)?;
    expect_close("fused_add_rms_norm out", dtype, &gx, &cx)?;
    expect_close("fused_add_rms_norm residual", dtype, &gr, &cr)?;

    // rotary on q and k as column slices of one qkv buffer, in place; u32 positions.
    let qkv = random((tokens, (heads + 2 * kv_heads) * head_size))?;
    let gqkv = on_gpu(&qkv)?;
    let cqkv = qkv.copy()?;
    let positions = Tensor::arange(0u32, tokens as u32, &cpu)?;
    let cache = ir_ops::rotary_embedding::cos_sin_cache(ir_core::DType::F32, 64, head_size, 10000.0)?
        .into_candle()?
        .to_dtype(dtype)?;
    let slices = |t: &Tensor| -> Result<(Tensor, Tensor)> {
        Ok((t.narrow(1, 0, heads * head_size)?, t.narrow(1, heads * head_size, kv_heads * head_size)?))
    };
    let ((gq, gk), (cq, ck)) = (slices(&gqkv)?, slices(&cqkv)?);
    let (gpos, gcache) = (on_gpu(&positions)?, on_gpu(&cache)?);
    candle_ops::rotary_embedding(cuda, &gpos, &gq, Some(&gk), &gcache, head_size, head_size, true, Rounding::Exact)?;
    candle_ops::rotary_embedding(
        reference,
        &positions,
        &cq,
        Some(&ck),
        &cache,
        head_size,
        head_size,
        true,
        Rounding::Exact,
    )?;
    expect_close("rotary_embedding", dtype, &gqkv, &cqkv)?;

    // The quantizations (fp8 e4m3 codes; per-token scales in f32), the static and fused ones with
    // vLLM's rounding points (`Rounding::Dtype`).
    let parity = Rounding::Dtype;
    let scale = Tensor::new(&[0.05f32], &cpu)?;
    let gscale = on_gpu(&scale)?;
    let codes = candle_ops::static_scaled_fp8_quant(cuda, &on_gpu(&x)?, &gscale, e4m3, parity)?;
    expect_codes(
        "static_scaled_fp8_quant",
        &codes,
        &candle_ops::static_scaled_fp8_quant(reference, &x, &scale, e4m3, parity)?,
    )?;
    let (codes, scales) = candle_ops::dynamic_per_token_scaled_fp8_quant(cuda, &on_gpu(&x)?, None, e4m3)?;
    let (rcodes, rscales) = candle_ops::dynamic_per_token_scaled_fp8_quant(reference, &x, None, e4m3)?;
    expect_codes("dynamic_per_token_scaled_fp8_quant", &codes, &rcodes)?;
    expect_scales("dynamic_per_token_scaled_fp8_quant scales", &scales, &rscales)?;
    let codes = candle_ops::rms_norm_static_fp8_quant(cuda, &on_gpu(&x)?, Some(&gw), 1e-6, &gscale, e4m3, parity)?;
    let rcodes = candle_ops::rms_norm_static_fp8_quant(reference, &x, Some(&weight), 1e-6, &scale, e4m3, parity)?;
    expect_codes("rms_norm_static_fp8_quant", &codes, &rcodes)?;
    let (codes, scales) =
        candle_ops::rms_norm_dynamic_per_token_quant(cuda, &on_gpu(&x)?, Some(&gw), 1e-6, None, e4m3, parity)?;
    let (rcodes, rscales) =
        candle_ops::rms_norm_dynamic_per_token_quant(reference, &x, Some(&weight), 1e-6, None, e4m3, parity)?;
    expect_codes("rms_norm_dynamic_per_token_quant", &codes, &rcodes)?;
    expect_scales("rms_norm_dynamic_per_token_quant scales", &scales, &rscales)?;

    // The fused add + norm + quantizations: the residual in place, the codes fresh.
    let (gx, gr, cr) = (on_gpu(&x)?, on_gpu(&residual)?, residual.copy()?);
    let codes =
        candle_ops::fused_add_rms_norm_static_fp8_quant(cuda, &gx, &gr, Some(&gw), 1e-6, &gscale, e4m3, parity)?;
    let rcodes =
        candle_ops::fused_add_rms_norm_static_fp8_quant(reference, &x, &cr, Some(&weight), 1e-6, &scale, e4m3, parity)?;
    expect_codes("fused_add_rms_norm_static_fp8_quant", &codes, &rcodes)?;
    expect_close("fused_add_rms_norm_static_fp8_quant residual", dtype, &gr, &cr)?;
    let (gr, cr) = (on_gpu(&residual)?, residual.copy()?);
    let (codes, scales) =
        candle_ops::fused_add_rms_norm_dynamic_per_token_quant(cuda, &gx, &gr, Some(&gw), 1e-6, None, e4m3, parity)?;
    let (rcodes, rscales) = candle_ops::fused_add_rms_norm_dynamic_per_token_quant(
        reference,
        &x,
        &cr,
        Some(&weight),
        1e-6,
        None,
        e4m3,
        parity,
    )?;
    expect_codes("fused_add_rms_norm_dynamic_per_token_quant", &codes, &rcodes)?;
    expect_scales("fused_add_rms_norm_dynamic_per_token_quant scales", &scales, &rscales)?;
    expect_close("fused_add_rms_norm_dynamic_per_token_quant residual", dtype, &gr, &cr)?;
    Ok(())
}
