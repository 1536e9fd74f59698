//! Dispatch allocates nothing on the steady-state path: a typed call through the registry makes
//! exactly the heap allocations the selected kernel makes when called directly (none for an in-place
//! kernel), counted by a global allocator. The first call with new argument metadata fills the
//! installed list's selection cache and may allocate; every later call with the same metadata may not.
//! A call through `candle_ops` adds only its views, their lease and candle's tensor of the output.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ir_core::{DType, Platform, PriorityConfig, Registry, Tensor, TensorMeta, UniqueTensor};
use ir_ops::fused_add_rms_norm;
use ir_ops::rms_norm::rms_norm;
use ir_ops::silu_and_mul::silu_and_mul;

/// Counts the allocations of the current thread (other test threads do not disturb the count).
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every method forwards to the system allocator; the counter is a const-initialized
// thread-local `Cell`, which does not allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations `f` makes on this thread.
fn allocations<R>(f: impl FnOnce() -> R) -> (u64, R) {
    let before = ALLOCATIONS.with(Cell::get);
    let result = f();
    (ALLOCATIONS.with(Cell::get) - before, result)
}

fn registry() -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).unwrap();
    registry
}

#[test]
fn in_place_calls_allocate_nothing_after_the_first() {
    let registry = registry();
    for (dtype, tokens, hidden) in [(DType::BF16, 1, 4096), (DType::F32, 16, 4096), (DType::F16, 3, 100)] {
        let meta = TensorMeta::compact(dtype, &[tokens, hidden]);
        let (mut x, mut r) = (Tensor::randn(&meta, 1).unwrap(), Tensor::randn(&meta, 2).unwrap());
        let w = Tensor::randn(&TensorMeta::compact(dtype, &[hidden]), 3).unwrap();
        // The first call selects (predicates, meta function) and remembers the selection.
        (x, r) =
            fused_add_rms_norm::maybe_inplace(&registry, x, r, Some(&w), 1e-6, None, ir_ops::Rounding::Exact).unwrap();
        let storages = (x.storage_id(), r.storage_id());
        for step in 0..10 {
            let (count, outputs) = allocations(|| {
                fused_add_rms_norm::maybe_inplace(&registry, x, r, Some(&w), 1e-6, None, ir_ops::Rounding::Exact)
                    .unwrap()
            });
            (x, r) = outputs;
            assert_eq!(count, 0, "{dtype} {tokens}x{hidden}, call {step}: the donated call allocated {count} times");
            assert_eq!((x.storage_id(), r.storage_id()), storages, "written in place");
        }
        // The kernel alone allocates nothing either: the rows use stack buffers.
        let (count, _) = allocations(|| {
            kernels_cpu::fused_add_rms_norm_cpu(
                UniqueTensor::new(x).unwrap(),
                UniqueTensor::new(r).unwrap(),
                Some(&w),
                1e-6,
                None,
                ir_ops::Rounding::Exact,
            )
            .unwrap()
        });
        assert_eq!(count, 0, "{dtype}: the direct in-place kernel allocated {count} times");
    }
    let record = registry.selection_record();
    assert_eq!(record.selections("fused_add_rms_norm", "cpu"), 33, "every call selected the cpu kernel");
}

#[test]
fn functional_calls_allocate_only_what_the_kernel_allocates() {
    let registry = registry();
    for (dtype, tokens, hidden) in [(DType::BF16, 1, 4096), (DType::F32, 64, 512)] {
        let x = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, hidden]), 4).unwrap();
        let w = Tensor::randn(&TensorMeta::compact(dtype, &[hidden]), 5).unwrap();
        let first = rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap();
        let (cold, expected) = allocations(|| kernels_cpu::rms_norm_cpu(&x, Some(&w), 1e-6, None).unwrap());
        assert!(ir_core::bit_eq(&first, &expected), "the registry ran the cpu kernel");
        // Freed outputs go back to this thread's buffer cache, and the next call of the size takes one.
        drop((first, expected));
        let (direct, _) = allocations(|| kernels_cpu::rms_norm_cpu(&x, Some(&w), 1e-6, None).unwrap());
        assert!(direct > 0, "the functional kernel allocates its output's handle");
        assert!(direct < cold, "a repeated call reuses a freed buffer: {direct} allocations, {cold} the first time");
        for step in 0..10 {
            let (count, _) = allocations(|| rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap());
            assert_eq!(
                count, direct,
                "{dtype} rms_norm call {step}: {count} allocations, the kernel alone makes {direct}"
            );
        }

        let gate = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, 2 * hidden]), 6).unwrap();
        silu_and_mul(&registry, &gate).unwrap();
        let (direct, _) = allocations(|| kernels_cpu::gated::run(&gate, kernels_cpu::gated::Silu).unwrap());
        for step in 0..10 {
            let (count, _) = allocations(|| silu_and_mul(&registry, &gate).unwrap());
            assert_eq!(
                count, direct,
                "{dtype} silu_and_mul call {step}: {count} allocations, the kernel alone makes {direct}"
            );
        }
    }
}

#[test]
fn new_argument_metadata_is_selected_again_and_a_priority_change_is_seen() {
    let registry = registry();
    let x = Tensor::randn(&TensorMeta::compact(DType::F32, &[2, 64]), 7).unwrap();
    let w = Tensor::randn(&TensorMeta::compact(DType::F32, &[64]), 8).unwrap();
    let cpu = rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap();
    // Other metadata (a variance over part of the row): selected afresh, the cpu predicate rejects
    // it and native runs, although a selection for the whole row is cached.
    rms_norm(&registry, &x, Some(&w), 1e-6, Some(32)).unwrap();
    let record = registry.selection_record();
    assert_eq!(record.selections("rms_norm", "cpu"), 1);
    assert_eq!(record.selections("rms_norm", "native"), 1);
    // A priority change publishes a new list with an empty cache: the next call obeys it.
    let guard = registry.override_priority("rms_norm", &["native"]).unwrap();
    let native = rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap();
    assert_eq!(registry.selection_record().selections("rms_norm", "native"), 2);
    ir_core::allclose(&native, &cpu, 1e-5, 1e-5).unwrap();
    drop(guard);
    rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap();
    assert_eq!(registry.selection_record().selections("rms_norm", "cpu"), 2, "the guard's drop is seen too");
}

#[test]
fn changes_in_another_registry_leave_the_selection_remembered() {
    let registry = registry();
    let meta = TensorMeta::compact(DType::F32, &[2, 256]);
    let (mut x, mut r) = (Tensor::randn(&meta, 9).unwrap(), Tensor::randn(&meta, 10).unwrap());
    let w = Tensor::randn(&TensorMeta::compact(DType::F32, &[256]), 11).unwrap();
    (x, r) = fused_add_rms_norm::maybe_inplace(&registry, x, r, Some(&w), 1e-6, None, ir_ops::Rounding::Exact).unwrap();
    for step in 0..5 {
        // Another registry (another engine, another test thread) defines ops and installs lists.
        let other = self::registry();
        let guard = other.override_priority("fused_add_rms_norm", &["native"]).unwrap();
        let (count, outputs) = allocations(|| {
            fused_add_rms_norm::maybe_inplace(&registry, x, r, Some(&w), 1e-6, None, ir_ops::Rounding::Exact).unwrap()
        });
        (x, r) = outputs;
        assert_eq!(count, 0, "call {step} after another registry changed: {count} allocations");
        drop((guard, other));
    }
    assert_eq!(registry.selection_record().selections("fused_add_rms_norm", "cpu"), 6);
}

#[test]
fn a_priority_change_is_selected_again_and_then_remembered() {
    let registry = registry();
    let meta = TensorMeta::compact(DType::F32, &[2, 256]);
    let (mut x, mut r) = (Tensor::randn(&meta, 12).unwrap(), Tensor::randn(&meta, 13).unwrap());
    let w = Tensor::randn(&TensorMeta::compact(DType::F32, &[256]), 14).unwrap();
    for step in 0..40 {
        // Each change publishes a new installed list: the first call after it selects again.
        let guard = registry.override_priority("fused_add_rms_norm", &["cpu", "native"]).unwrap();
        (x, r) =
            fused_add_rms_norm::maybe_inplace(&registry, x, r, Some(&w), 1e-6, None, ir_ops::Rounding::Exact).unwrap();
        drop(guard);
        (x, r) =
            fused_add_rms_norm::maybe_inplace(&registry, x, r, Some(&w), 1e-6, None, ir_ops::Rounding::Exact).unwrap();
        // The re-selection took the stale entry's slot and allocation: later calls are hits.
        let (count, outputs) = allocations(|| {
            fused_add_rms_norm::maybe_inplace(&registry, x, r, Some(&w), 1e-6, None, ir_ops::Rounding::Exact).unwrap()
        });
        (x, r) = outputs;
        assert_eq!(count, 0, "step {step}: {count} allocations on a remembered call");
    }
    assert_eq!(registry.selection_record().selections("fused_add_rms_norm", "cpu"), 120);
}

#[test]
fn a_candle_call_allocates_only_its_output_views_and_lease() {
    let registry = registry();
    let device = candle_core::Device::Cpu;
    for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
        let x = candle_core::Tensor::ones((1, 256), dtype, &device).unwrap();
        let w = candle_core::Tensor::ones(256, dtype, &device).unwrap();
        // The first call selects and remembers the selection.
        ir_ops::candle_ops::rms_norm(&registry, &x, Some(&w), 1e-6).unwrap();
        let ours = Tensor::from_candle(&x).unwrap().deep_clone().unwrap();
        let weight = Tensor::from_candle(&w).unwrap().deep_clone().unwrap();
        let (kernel, out) = allocations(|| kernels_cpu::rms_norm_cpu(&ours, Some(&weight), 1e-6, None).unwrap());
        let (wrap, _) = allocations(|| out.into_candle().unwrap());
        for step in 0..5 {
            let (count, _) = allocations(|| ir_ops::candle_ops::rms_norm(&registry, &x, Some(&w), 1e-6).unwrap());
            // The kernel's output and candle's tensor of it, one tensor per view (two), the views'
            // lease (one) and the output's vector, which leaves the pool for candle (up to two);
            // the selection, the locks and the checks allocate nothing.
            assert!(
                count <= kernel + wrap + 5,
                "{dtype:?} call {step}: {count} allocations; kernel {kernel}, candle's tensor {wrap}"
            );
        }
    }
}
