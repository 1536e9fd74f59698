//! `add` and `mul` of xpu tensors compute on the device (the `add`/`mul` kernel), giving the host's
//! bits, and never through the host. Its own test binary: the counters are process-wide.

#[test]
fn add_and_mul_compute_on_the_device() {
    let device = match kernels_xpu::device() {
        Ok(device) => device,
        Err(reason) => return ir_core::testing::skip("xpu", &reason),
    };
    let allocator = kernels_xpu::allocator().expect("an available device has an allocator");
    let (launches, round_trips) = (device.device_copies(), ir_core::storage::host_round_trips());
    let operations = ir_core::testing::check_device_binaries(&allocator);
    assert_eq!(operations, 18);
    assert_eq!(device.device_copies() - launches, operations, "one kernel each");
    assert_eq!(ir_core::storage::host_round_trips(), round_trips, "no host round trip");
}
