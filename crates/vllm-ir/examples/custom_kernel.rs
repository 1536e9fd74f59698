//! An engine's own kernel, registered with state (a call counter and a scale it captured) and put
//! first in the priority list, in front of the platform's `cpu` provider, which it falls back to for
//! what its `supports` predicate rejects.
//!
//! `cargo run -p vllm-ir --example custom_kernel`

// An example reports on standard output.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use vllm_ir::op::silu_and_mul::{self, SiluAndMulArgs};
use vllm_ir::{DType, ImplSpec, KernelError, Support, Tensor, half::bf16};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The registry is frozen once built: the engine's provider is registered on the builder.
    let builder = vllm_ir::RegistryBuilder::new()?;

    // The engine's kernel: f32 only (its predicate says so), counting its calls.
    let calls = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&calls);
    let spec = ImplSpec::new("engine").with_supports(|args| match SiluAndMulArgs::from_meta(args) {
        Some(view) if view.x.dtype == DType::F32 => Support::Yes,
        _ => Support::No("the engine kernel handles f32 only".into()),
    });
    silu_and_mul::register(builder.registry(), spec, move |x| -> Result<Tensor, KernelError> {
        counter.fetch_add(1, Ordering::Relaxed);
        silu_and_mul::native(x) // an engine would launch its own kernel here
    })?;
    let registry = builder.build()?;
    // Your entries first, the platform's after: `[engine, cpu, native]`.
    let _guard = registry.override_priority("silu_and_mul", &["engine"])?;
    println!("silu_and_mul priority: {:?}", registry.installed_priority("silu_and_mul").unwrap_or_default());

    let x32 = Tensor::from_vec(&[2, 8], (0..16).map(|i| i as f32 / 4.0 - 2.0).collect())?;
    let x16 = Tensor::from_vec(&[2, 8], (0..16).map(|i| bf16::from_f32(i as f32 / 4.0 - 2.0)).collect())?;
    let a = silu_and_mul::silu_and_mul(&registry, &x32)?;
    let b = silu_and_mul::silu_and_mul(&registry, &x16)?;
    assert_eq!(calls.load(Ordering::Relaxed), 1, "f32 went to the engine kernel");
    assert_eq!((a.dtype(), b.dtype()), (DType::F32, DType::BF16));

    let record = registry.selection_record();
    let op = record.op("silu_and_mul").expect("the op is recorded");
    for provider in &op.providers {
        println!(
            "  {}: {} call(s){}",
            provider.provider,
            provider.selections,
            provider.last_rejection.as_ref().map(|r| format!(", last rejection: {r}")).unwrap_or_default()
        );
    }
    assert_eq!(record.selections("silu_and_mul", "cpu"), 1, "bf16 fell back to cpu");
    Ok(())
}
