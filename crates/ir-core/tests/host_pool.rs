//! The host buffer pool's bound (one test: the pool is process-wide).

use ir_core::DType;
use ir_core::storage::{
    CpuBuffer, HOST_POOL_DEFAULT_BYTES, HOST_POOL_MIN_BYTES, host_pool_bytes, host_pool_capacity,
    set_host_pool_capacity,
};

#[test]
fn the_bound_frees_what_it_no_longer_allows_and_zero_turns_the_pool_off() {
    assert_eq!(host_pool_capacity(), HOST_POOL_DEFAULT_BYTES);
    let bytes = HOST_POOL_MIN_BYTES;
    // Three buffers freed: the pool keeps them (well under the default bound).
    let buffers: Vec<CpuBuffer> = (0..3).map(|_| CpuBuffer::for_overwrite(DType::F32, bytes).unwrap()).collect();
    drop(buffers);
    assert_eq!(host_pool_bytes(), 3 * bytes);
    // A lower bound frees the excess at once.
    set_host_pool_capacity(bytes);
    assert_eq!(host_pool_bytes(), bytes);
    // Reuse still works within it.
    let again = CpuBuffer::for_overwrite(DType::F32, bytes).unwrap();
    assert_eq!(host_pool_bytes(), 0, "taken from the pool");
    drop(again);
    assert_eq!(host_pool_bytes(), bytes);
    // Zero: nothing is kept, and large buffers are plain vectors again.
    set_host_pool_capacity(0);
    assert_eq!(host_pool_bytes(), 0);
    let plain = CpuBuffer::for_overwrite(DType::F32, bytes).unwrap();
    assert!(plain.owner().is::<Vec<f32>>());
    drop(plain);
    assert_eq!(host_pool_bytes(), 0);
}
