//! vllm-ir's `cuda` provider registered in a program whose cudarc is configured like candle's.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let registry = ir_core::Registry::with_builtin_ops();
    kernels_cuda::register(&registry)?;
    // The engine's own cudarc handles and this crate's share one cudarc build.
    let engine_stream: Option<std::sync::Arc<cudarc::driver::CudaStream>> = None;
    let names = registry.providers("rms_norm").into_iter().map(|p| p.name).collect::<Vec<_>>();
    println!("rms_norm providers: {names:?}; engine stream given: {}", engine_stream.is_some());
    Ok(())
}
