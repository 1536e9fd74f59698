//! `copy_` between dtypes and `scale` of xpu tensors convert on the device (the strided conversion
//! kernel), giving the host's bits, and never through the host: every pair of dtypes on a device
//! with f64 arithmetic (PoCL has it), the pairs without f64 or i64 on one without.

use ir_core::DType;

/// The dtypes the device converts between on the device, after saying which it leaves to the host.
fn dtypes(device: &kernels_xpu::XpuDevice) -> Vec<DType> {
    if device.has_fp64() {
        return DType::ALL.to_vec();
    }
    eprintln!(
        "skipped: conversions from f64 or i64 and into f64: the OpenCL device has no cl_khr_fp64 (they go through the host)"
    );
    DType::ALL.into_iter().filter(|d| !matches!(d, DType::F64 | DType::I64)).collect()
}

#[test]
fn copies_between_dtypes_and_scales_convert_on_the_device() {
    let device = match kernels_xpu::device() {
        Ok(device) => device,
        Err(reason) => return ir_core::testing::skip("xpu", &reason),
    };
    let allocator = kernels_xpu::allocator().expect("an available device has an allocator");
    let (copies, round_trips) = (device.device_copies(), ir_core::storage::host_round_trips());
    let conversions = kernel_support::testing::check_device_conversions_of(&allocator, &dtypes(device));
    assert!(conversions > 100, "{conversions} conversions checked");
    // The transposed views the checker makes of its results are not copies; each conversion is one
    // kernel, and none went through the host.
    assert_eq!(device.device_copies() - copies, conversions);
    assert_eq!(ir_core::storage::host_round_trips(), round_trips, "no host round trip");
}
