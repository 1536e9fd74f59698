//! An engine built on candle hands its tensors to vllm-ir's kernels and takes the results back,
//! without copying on the CPU: a decoder step's residual add + RMSNorm, then the gated MLP
//! activation, on candle tensors.
//!
//! `cargo run -p vllm-ir --features candle --example candle`

#![allow(clippy::print_stdout)]

use candle_core::{DType, Device, Tensor as CandleTensor};
use vllm_ir::layers::{RmsNorm, SiluAndMul};
use vllm_ir::{EagerContext, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The engine's own tensors (weights loaded by candle, activations from its previous layer).
    let weight = CandleTensor::ones(4096, DType::BF16, &Device::Cpu)?;
    let hidden = CandleTensor::randn(0f32, 1.0, (16, 4096), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let gate_up = CandleTensor::randn(0f32, 1.0, (16, 2 * 4096), &Device::Cpu)?.to_dtype(DType::BF16)?;

    let registry = vllm_ir::registry()?;
    let ctx = EagerContext::new(&registry);
    let mut norm = RmsNorm::builder(4096).dtype(vllm_ir::DType::BF16).build()?;
    // SAFETY: nothing writes these candle tensors in place while the views live.
    let (w, x, h) = unsafe {
        (
            Tensor::from_candle_shared(&weight)?,
            Tensor::from_candle_shared(&hidden)?,
            Tensor::from_candle_shared(&gate_up)?,
        )
    };
    norm.load_weight(w)?;
    let normed: CandleTensor = norm.forward(&ctx, &x)?.into_candle()?;
    let activated: CandleTensor = SiluAndMul.forward(&ctx, &h)?.into_candle()?;

    // The same computation in candle, to check the exchange kept every value.
    let reference = candle_rms_norm(&hidden, &weight)?;
    let max_diff = (normed.to_dtype(DType::F32)? - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("rms_norm via {}: {:?}, max |diff| vs candle {max_diff}", provider(&registry), normed.dims());
    println!("silu_and_mul: {:?}", activated.dims());
    assert!(max_diff < 0.05, "the exchanged result differs from candle's by {max_diff}");
    assert_eq!(activated.dims(), [16, 4096]);
    Ok(())
}

fn candle_rms_norm(x: &CandleTensor, w: &CandleTensor) -> candle_core::Result<CandleTensor> {
    let x = x.to_dtype(DType::F32)?;
    let rms = (x.sqr()?.mean_keepdim(1)? + 1e-6)?.sqrt()?;
    x.broadcast_div(&rms)?.to_dtype(DType::BF16)?.broadcast_mul(w)?.to_dtype(DType::F32)
}

fn provider(registry: &vllm_ir::Registry) -> String {
    let record = registry.selection_record();
    let op = record.op("rms_norm");
    let used = |op: &vllm_ir::OpRecord| {
        op.providers.iter().filter(|p| p.selections > 0).map(|p| p.provider).collect::<Vec<_>>()
    };
    op.map(|op| used(op).join(",")).unwrap_or_default()
}
