//! `clone` and `contiguous` of cuda tensors copy on the device, bit for bit in every dtype and
//! layout (needs a CUDA device; the kernels' compilation is checked without one by `ptxas.rs`).

#[test]
fn clone_and_contiguous_copy_on_the_device_bit_for_bit() {
    if let ir_core::Availability::Unavailable(reason) = kernels_cuda::availability() {
        ir_core::testing::skip("cuda", &format!("cuda kernels: {reason}"));
        return;
    }
    ir_core::testing::check_device_copies(&kernels_cuda::allocator(0).unwrap());
}
