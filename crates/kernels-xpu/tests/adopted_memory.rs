//! Kernels on an engine's own OpenCL memory (runs where an OpenCL device is, PoCL included with
//! `VLLM_IR_XPU_ALLOW_CPU=1`; says `skipped: …` elsewhere).

use std::ptr;

use ir_core::{Availability, DType, Tensor, allclose, bit_eq};
use ir_ops::rms_norm;
use kernels_xpu::XpuBuffer;
use opencl3::memory::{Buffer, CL_MEM_READ_WRITE, ClMem};
use opencl3::types::CL_BLOCKING;

fn host(rows: usize, hidden: usize, seed: u64) -> Tensor {
    let values: Vec<f64> =
        (0..rows * hidden).map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f64) / 250.0 - 2.0).collect();
    Tensor::from_f64(DType::F32, &[rows, hidden], &values).unwrap()
}

/// Whether an OpenCL device runs here; says `skipped: <what>: <reason>` otherwise.
fn xpu_runs(what: &str) -> bool {
    let Availability::Unavailable(reason) = kernels_xpu::availability() else { return true };
    ir_core::testing::skip("xpu", &format!("{what}: {reason}"));
    false
}

/// An engine's buffer in the kernels' context, filled with `t`'s bytes.
fn engine_buffer(t: &Tensor) -> Buffer<u8> {
    let device = kernels_xpu::device().unwrap();
    let bytes = t.cpu_buffer().unwrap().bytes().to_vec();
    // SAFETY: no host pointer; OpenCL allocates the memory.
    let mut buffer =
        unsafe { Buffer::<u8>::create(device.context(), CL_MEM_READ_WRITE, bytes.len(), ptr::null_mut()) }.unwrap();
    // SAFETY: a blocking write of the buffer's size from a live slice.
    unsafe { device.queue().enqueue_write_buffer(&mut buffer, CL_BLOCKING, 0, &bytes, &[]) }.unwrap();
    buffer
}

#[test]
fn kernels_run_on_adopted_opencl_memory() {
    if !xpu_runs("adopted OpenCL memory") {
        return;
    }
    let registry = ir_ops::registry();
    kernels_xpu::register(&registry).unwrap();
    let _guard = registry.override_priority("rms_norm", &["xpu"]).unwrap();
    let x = host(4, 256, 1);
    let engine = engine_buffer(&x);
    // SAFETY: `engine` is a live buffer of this context; only the tensor below uses it meanwhile.
    let adopted = unsafe { XpuBuffer::from_cl_mem(engine.get(), x.cpu_buffer().unwrap().len_bytes()) }.unwrap();
    assert_eq!(adopted.cl_mem(), engine.get(), "the same memory object, no copy");
    let dx = adopted.into_tensor(DType::F32, x.layout().clone()).unwrap();
    assert!(bit_eq(&dx.to_cpu().unwrap(), &x));
    let out = rms_norm::rms_norm(&registry, &dx, None, 1e-6, None).unwrap();
    let record = registry.selection_record();
    let record = record.op("rms_norm").unwrap();
    assert!(record.providers.iter().any(|p| p.provider == "xpu" && p.selections == 1), "{record:?}");
    allclose(&out.to_cpu().unwrap(), &rms_norm::native(&x, None, 1e-6, None).unwrap(), 1e-5, 1e-5).unwrap();
    // Dropping the tensor releases only its own reference: the engine's buffer still reads.
    drop(dx);
    let mut back = vec![0u8; 16];
    // SAFETY: a blocking read of 16 bytes of a live buffer into a live slice.
    unsafe { kernels_xpu::device().unwrap().queue().enqueue_read_buffer(&engine, CL_BLOCKING, 0, &mut back, &[]) }
        .unwrap();
    assert_eq!(back, x.cpu_buffer().unwrap().bytes()[..16]);
}

#[test]
fn memory_too_small_or_from_another_context_is_refused() {
    if !xpu_runs("adopted OpenCL memory") {
        return;
    }
    let x = host(2, 8, 2);
    let engine = engine_buffer(&x);
    // SAFETY: a live buffer; the call refuses it before adopting.
    let error = unsafe { XpuBuffer::from_cl_mem(engine.get(), 1 << 20) }.unwrap_err();
    assert!(error.to_string().contains("fewer than the 1048576"), "{error}");
    let device = kernels_xpu::device().unwrap();
    let other =
        opencl3::context::Context::from_device(&opencl3::device::Device::new(device.context().devices()[0])).unwrap();
    // SAFETY: no host pointer.
    let foreign = unsafe { Buffer::<u8>::create(&other, CL_MEM_READ_WRITE, 64, ptr::null_mut()) }.unwrap();
    // SAFETY: a live buffer; the call refuses it before adopting.
    let error = unsafe { XpuBuffer::from_cl_mem(foreign.get(), 64) }.unwrap_err();
    assert!(error.to_string().contains("another OpenCL context"), "{error}");
}

#[test]
fn an_execution_context_carries_the_engines_queue() {
    if !xpu_runs("engine queue") {
        return;
    }
    let registry = ir_ops::registry();
    kernels_xpu::register(&registry).unwrap();
    let _norm = registry.override_priority("rms_norm", &["xpu"]).unwrap();
    let _fused = registry.override_priority("fused_add_rms_norm", &["xpu"]).unwrap();
    let _silu = registry.override_priority("silu_and_mul", &["xpu"]).unwrap();
    let device = kernels_xpu::device().unwrap();
    #[allow(deprecated)]
    let engine_queue =
        std::sync::Arc::new(opencl3::command_queue::CommandQueue::create_default(device.context(), 0).unwrap());
    let allocator = kernels_xpu::allocator().unwrap();
    let (x, residual) = (host(4, 256, 3), host(4, 256, 4));
    let (dx, dresidual) = (x.to_device(&allocator).unwrap(), residual.to_device(&allocator).unwrap());
    let ctx = ir_core::EagerContext::new(&registry).with_stream(std::sync::Arc::clone(&engine_queue));
    let queue_of = |t: &Tensor| {
        let ir_core::storage::Storage::Device(buffer) = t.storage() else { panic!("a device tensor") };
        buffer.as_any().downcast_ref::<XpuBuffer>().unwrap().queue()
    };
    // A functional call: the output belongs to the engine's queue; the input moved there too.
    let out = ir_ops::rms_norm::call(&ctx, &dx, None, 1e-6, None).unwrap();
    assert!(std::sync::Arc::ptr_eq(&queue_of(&out), &engine_queue));
    assert!(std::sync::Arc::ptr_eq(&queue_of(&dx), &engine_queue));
    allclose(&out.to_cpu().unwrap(), &rms_norm::native(&x, None, 1e-6, None).unwrap(), 1e-5, 1e-5).unwrap();
    // In place on the engine's queue, then a call without a queue reads the results in order.
    let (normed, summed) =
        ir_ops::fused_add_rms_norm::call_maybe_inplace(&ctx, dx, dresidual, None, 1e-6, None, ir_ops::Rounding::Exact)
            .unwrap();
    let (want_normed, want_summed) = ir_ops::fused_add_rms_norm::fused_add_rms_norm(
        &registry,
        &x,
        &residual,
        None,
        1e-6,
        None,
        ir_ops::Rounding::Exact,
    )
    .unwrap();
    let gated = ir_ops::silu_and_mul::silu_and_mul(&registry, &normed).unwrap();
    let want_gated = ir_ops::silu_and_mul::native(&want_normed).unwrap();
    allclose(&summed.to_cpu().unwrap(), &want_summed, 1e-6, 1e-6).unwrap();
    allclose(&gated.to_cpu().unwrap(), &want_gated, 1e-4, 1e-4).unwrap();
    // A queue of another context is refused by name.
    let other =
        opencl3::context::Context::from_device(&opencl3::device::Device::new(device.context().devices()[0])).unwrap();
    #[allow(deprecated)]
    let foreign = std::sync::Arc::new(opencl3::command_queue::CommandQueue::create_default(&other, 0).unwrap());
    let wrong = ir_core::EagerContext::new(&registry).with_stream(foreign);
    let x2 = host(2, 64, 5).to_device(&allocator).unwrap();
    let error = ir_ops::rms_norm::call(&wrong, &x2, None, 1e-6, None).unwrap_err();
    assert!(error.to_string().contains("another OpenCL context"), "{error}");
}
