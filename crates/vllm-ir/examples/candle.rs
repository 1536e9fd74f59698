//! An engine built on candle runs vllm-ir's ops on its own tensors, in place where the op writes
//! its activations: a decoder step's residual add + RMSNorm, rotary on q and k as column slices of
//! one qkv buffer, then the gated MLP activation. Prints what dispatch chose, the copies and the
//! native fallbacks (0 and 0 on the cpu platform).
//!
//! `cargo run -p vllm-ir --features candle --example candle`

#![allow(clippy::print_stdout)]

use candle_core::{DType, Device, Tensor};
use vllm_ir::interop::candle_ops;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tokens, hidden, heads, kv_heads, head_size) = (16, 4096, 32, 8, 128);
    let device = Device::Cpu;
    // The engine's own tensors (weights loaded by candle, activations from its previous layer).
    let weight = Tensor::ones(hidden, DType::BF16, &device)?;
    let x = Tensor::randn(0f32, 1.0, (tokens, hidden), &device)?.to_dtype(DType::BF16)?;
    let residual = Tensor::randn(0f32, 1.0, (tokens, hidden), &device)?.to_dtype(DType::BF16)?;
    let qkv_width = (heads + 2 * kv_heads) * head_size;
    let qkv = Tensor::randn(0f32, 1.0, (tokens, qkv_width), &device)?.to_dtype(DType::BF16)?;
    let gate_up = Tensor::randn(0f32, 1.0, (tokens, 2 * hidden), &device)?.to_dtype(DType::BF16)?;
    let positions = Tensor::arange(0u32, tokens as u32, &device)?;
    let cache = vllm_ir::op::rotary_embedding::cos_sin_cache(vllm_ir::DType::BF16, 4096, head_size, 10000.0)?;
    let cache = cache.into_candle()?;

    let registry = vllm_ir::registry()?;
    let sum = (&x.to_dtype(DType::F32)? + &residual.to_dtype(DType::F32)?)?;
    let before = registry.selection_record();
    candle_ops::fused_add_rms_norm(&registry, &x, &residual, Some(&weight), 1e-6, vllm_ir::op::Rounding::Exact)?;
    let (q, k) = (qkv.narrow(1, 0, heads * head_size)?, qkv.narrow(1, heads * head_size, kv_heads * head_size)?);
    candle_ops::rotary_embedding(
        &registry,
        &positions,
        &q,
        Some(&k),
        &cache,
        head_size,
        head_size,
        true,
        vllm_ir::op::Rounding::Exact,
    )?;
    let activated = candle_ops::silu_and_mul(&registry, &gate_up)?;
    let step = registry.selection_record().since(&before);

    print!("{step}");
    // The same norm in candle, to check the in-place result (x now holds the norm of x + residual).
    let reference = candle_rms_norm(&sum, &weight)?;
    let max_diff = (x.to_dtype(DType::F32)? - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("fused_add_rms_norm: max |diff| vs candle {max_diff}; silu_and_mul: {:?}", activated.dims());
    assert!(max_diff < 0.05, "the in-place result differs from candle's by {max_diff}");
    assert_eq!(activated.dims(), [tokens, hidden]);
    assert_eq!((step.defensive_copies(), step.native_fallbacks()), (0, 0), "no copy and no fallback on the cpu");
    Ok(())
}

fn candle_rms_norm(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let rms = (x.sqr()?.mean_keepdim(1)? + 1e-6)?.sqrt()?;
    x.broadcast_div(&rms)?.to_dtype(DType::BF16)?.broadcast_mul(w)?.to_dtype(DType::F32)
}
