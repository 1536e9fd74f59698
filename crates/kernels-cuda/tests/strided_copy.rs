//! `clone` and `contiguous` of cuda tensors copy on the device, bit for bit in every dtype and
//! layout (a rank past the kernel's in pieces), and `copy_` between dtypes and `scale` convert
//! there with the host's bits (needs a CUDA device; the kernels' compilation is checked without one
//! by `ptxas.rs`).

#[test]
fn clone_and_contiguous_copy_on_the_device_bit_for_bit() {
    if let ir_core::Availability::Unavailable(reason) = kernels_cuda::availability() {
        ir_core::testing::skip("cuda", &format!("cuda kernels: {reason}"));
        return;
    }
    assert_eq!(kernel_support::testing::check_device_copies(&kernels_cuda::allocator(0).unwrap()), 128);
}

#[test]
fn copies_between_dtypes_and_scales_convert_on_the_device() {
    if let ir_core::Availability::Unavailable(reason) = kernels_cuda::availability() {
        ir_core::testing::skip("cuda", &format!("cuda kernels: {reason}"));
        return;
    }
    let conversions = kernel_support::testing::check_device_conversions(&kernels_cuda::allocator(0).unwrap());
    assert!(conversions > 100, "{conversions} conversions checked");
}

#[test]
fn add_and_mul_compute_on_the_device() {
    if let ir_core::Availability::Unavailable(reason) = kernels_cuda::availability() {
        ir_core::testing::skip("cuda", &format!("cuda kernels: {reason}"));
        return;
    }
    assert_eq!(kernel_support::testing::check_device_binaries(&kernels_cuda::allocator(0).unwrap()), 48);
}
