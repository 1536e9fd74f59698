//! `clone` and `contiguous` of rocm tensors copy on the device, bit for bit in every dtype and
//! layout (a rank past the kernel's in pieces), and `copy_` between dtypes and `scale` convert
//! there with the host's bits (needs feature `rocm` and an AMD GPU; `hipcc.rs` checks the kernels
//! compile without one).

#[test]
fn clone_and_contiguous_copy_on_the_device_bit_for_bit() {
    match kernels_rocm::allocator() {
        Ok(allocator) => assert_eq!(kernel_support::testing::check_device_copies(allocator.as_ref()), 128),
        Err(reason) => ir_core::testing::skip("rocm", &format!("rocm device: {reason}")),
    }
}

#[test]
fn copies_between_dtypes_and_scales_convert_on_the_device() {
    match kernels_rocm::allocator() {
        Ok(allocator) => {
            let conversions = kernel_support::testing::check_device_conversions(allocator.as_ref());
            assert!(conversions > 100, "{conversions} conversions checked");
        }
        Err(reason) => ir_core::testing::skip("rocm", &format!("rocm device: {reason}")),
    }
}

#[test]
fn add_and_mul_compute_on_the_device() {
    match kernels_rocm::allocator() {
        Ok(allocator) => assert_eq!(kernel_support::testing::check_device_binaries(allocator.as_ref()), 48),
        Err(reason) => ir_core::testing::skip("rocm", &format!("rocm device: {reason}")),
    }
}
