//! `copy_` between dtypes and `scale` of xpu tensors convert on the device (the strided conversion
//! kernel), giving the host's bits, and never through the host.

#[test]
fn copies_between_dtypes_and_scales_convert_on_the_device() {
    let device = match kernels_xpu::device() {
        Ok(device) => device,
        Err(reason) => return ir_core::testing::skip("xpu", &reason),
    };
    let allocator = kernels_xpu::allocator().expect("an available device has an allocator");
    let (copies, round_trips) = (device.device_copies(), ir_core::storage::host_round_trips());
    let conversions = ir_core::testing::check_device_conversions(&allocator);
    assert!(conversions > 100, "{conversions} conversions checked");
    // The transposed views the checker makes of its results are not copies; each conversion is one
    // kernel, and none went through the host.
    assert_eq!(device.device_copies() - copies, conversions);
    assert_eq!(ir_core::storage::host_round_trips(), round_trips, "no host round trip");
}
