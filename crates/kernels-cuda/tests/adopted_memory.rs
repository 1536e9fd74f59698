//! Kernels on an engine's own device memory and stream (runs where a CUDA device is; says
//! `skipped: …` elsewhere).

use std::sync::Arc;

use ir_core::storage::Storage;
use ir_core::{Availability, DType, Registry, Tensor, bit_eq};
use ir_ops::{fused_add_rms_norm, rms_norm};
use kernels_cuda::CudaBuffer;

/// An engine's registry: only `cuda` (then native) for both norms.
fn registry() -> Option<Registry> {
    if let Availability::Unavailable(reason) = kernels_cuda::availability() {
        ir_core::testing::skip("cuda", &format!("adopted cuda memory: {reason}"));
        return None;
    }
    let registry = ir_ops::registry();
    kernels_cuda::register(&registry).unwrap();
    Some(registry)
}

fn host(rows: usize, hidden: usize, seed: u64) -> Tensor {
    let values: Vec<f64> =
        (0..rows * hidden).map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f64) / 250.0 - 2.0).collect();
    Tensor::from_f64(DType::BF16, &[rows, hidden], &values).unwrap()
}

#[test]
fn kernels_run_on_adopted_slices_and_launch_on_their_stream() {
    let Some(registry) = registry() else { return };
    let _guard = registry.override_priority("rms_norm", &["cuda"]).unwrap();
    let _fused = registry.override_priority("fused_add_rms_norm", &["cuda"]).unwrap();
    let device = &kernels_cuda::devices().unwrap()[0];
    // The engine's own stream, and memory it allocated there through cudarc.
    let engine_stream: Arc<cudarc::driver::CudaStream> = device.context().new_stream().unwrap();
    let adopt = |t: &Tensor| -> Tensor {
        let bytes = t.cpu_buffer().unwrap().bytes().to_vec();
        let slice = engine_stream.clone_htod(&bytes).unwrap();
        CudaBuffer::from_cuda_slice(slice).unwrap().into_tensor(t.dtype(), t.layout().clone()).unwrap()
    };
    let (x, residual, weight) = (host(64, 4096, 1), host(64, 4096, 2), host(1, 4096, 3).reshape(&[4096]).unwrap());
    let (dx, dresidual, dweight) = (adopt(&x), adopt(&residual), adopt(&weight));

    let expected = rms_norm::rms_norm(&registry, &x, Some(&weight), 1e-6, None).unwrap();
    let out = rms_norm::rms_norm(&registry, &dx, Some(&dweight), 1e-6, None).unwrap();
    let Storage::Device(buffer) = out.storage() else { panic!("a device output") };
    let buffer = buffer.as_any().downcast_ref::<CudaBuffer>().unwrap();
    assert!(Arc::ptr_eq(buffer.stream(), &engine_stream), "the output lives on the engine's stream");
    ir_core::allclose(&out.to_cpu().unwrap(), &expected, 0.05, 0.02).unwrap();

    // In place, on adopted memory: the engine's buffers are written.
    let (want_out, want_residual) = fused_add_rms_norm::fused_add_rms_norm(
        &registry,
        &dx.to_cpu().unwrap(),
        &dresidual.to_cpu().unwrap(),
        Some(&weight),
        1e-6,
        None,
        ir_ops::Rounding::Exact,
    )
    .unwrap();
    let (out, residual_out) = fused_add_rms_norm::maybe_inplace(
        &registry,
        dx,
        dresidual,
        Some(&dweight),
        1e-6,
        None,
        ir_ops::Rounding::Exact,
    )
    .unwrap();
    let record = registry.selection_record();
    assert_eq!(record.op("fused_add_rms_norm").unwrap().inplace_writes, 2);
    assert!(bit_eq(&residual_out.to_cpu().unwrap(), &want_residual));
    ir_core::allclose(&out.to_cpu().unwrap(), &want_out, 0.05, 0.02).unwrap();
}

#[test]
fn raw_device_pointers_are_adopted_with_their_owner() {
    let Some(registry) = registry() else { return };
    let device = &kernels_cuda::devices().unwrap()[0];
    let engine_stream = device.context().new_stream().unwrap();
    let x = host(8, 256, 4);
    let bytes = x.cpu_buffer().unwrap().bytes().to_vec();
    let slice = engine_stream.clone_htod(&bytes).unwrap();
    let ptr = {
        use cudarc::driver::DevicePtr;
        let (ptr, _sync) = slice.device_ptr(&engine_stream);
        ptr
    };
    // SAFETY: `slice` owns the allocation and is the owner, dropped with the buffer; the engine
    // uses it only through this tensor, on `engine_stream`.
    let buffer = unsafe { CudaBuffer::from_raw_parts(ptr, bytes.len(), Arc::clone(&engine_stream), slice) }.unwrap();
    let dx = buffer.into_tensor(DType::BF16, x.layout().clone()).unwrap();
    assert!(bit_eq(&dx.to_cpu().unwrap(), &x), "the adopted memory reads back");
    let _guard = registry.override_priority("rms_norm", &["cuda"]).unwrap();
    let out = rms_norm::rms_norm(&registry, &dx, None, 1e-6, None).unwrap();
    let expected = rms_norm::native(&x, None, 1e-6, None).unwrap();
    ir_core::allclose(&out.to_cpu().unwrap(), &expected, 0.05, 0.02).unwrap();
}

#[test]
fn an_execution_context_carries_the_engines_stream() {
    let Some(registry) = registry() else { return };
    let _guard = registry.override_priority("rms_norm", &["cuda"]).unwrap();
    let device = &kernels_cuda::devices().unwrap()[0];
    let engine_stream = device.context().new_stream().unwrap();
    let allocator = kernels_cuda::allocator(0).unwrap();
    let x = host(16, 1024, 5);
    // Memory allocated by this crate (on its own stream); the call's context names another.
    let dx = x.to_device(&allocator).unwrap();
    let ctx = ir_core::EagerContext::new(&registry).with_stream(Arc::clone(&engine_stream));
    let out = ir_ops::rms_norm::call(&ctx, &dx, None, 1e-6, None).unwrap();
    let Storage::Device(buffer) = out.storage() else { panic!("a device output") };
    let buffer = buffer.as_any().downcast_ref::<CudaBuffer>().unwrap();
    assert!(Arc::ptr_eq(buffer.stream(), &engine_stream), "launched and allocated on the context's stream");
    let expected = rms_norm::native(&x, None, 1e-6, None).unwrap();
    ir_core::allclose(&out.to_cpu().unwrap(), &expected, 0.05, 0.02).unwrap();
    // Without the stream, the memory's own stream.
    let out = rms_norm::rms_norm(&registry, &dx, None, 1e-6, None).unwrap();
    let Storage::Device(buffer) = out.storage() else { panic!("a device output") };
    let buffer = buffer.as_any().downcast_ref::<CudaBuffer>().unwrap();
    assert!(Arc::ptr_eq(buffer.stream(), device.stream()));
}
