//! `add` and `mul` of xpu tensors compute on the device (the `add`/`mul` kernel), giving the host's
//! bits, and never through the host: every dtype on a device with f64 arithmetic (PoCL has it), all
//! but f64 and i64 on one without. Its own test binary: the counters are process-wide.

use ir_core::DType;

#[test]
fn add_and_mul_compute_on_the_device() {
    let device = match kernels_xpu::device() {
        Ok(device) => device,
        Err(reason) => return ir_core::testing::skip("xpu", &reason),
    };
    let allocator = kernels_xpu::allocator().expect("an available device has an allocator");
    let dtypes: Vec<DType> = if device.has_fp64() {
        DType::ALL.to_vec()
    } else {
        eprintln!(
            "skipped: add and mul of f64 and i64: the OpenCL device has no cl_khr_fp64 (they go through the host)"
        );
        DType::ALL.into_iter().filter(|d| !matches!(d, DType::F64 | DType::I64)).collect()
    };
    let (launches, round_trips) = (device.device_copies(), ir_core::storage::host_round_trips());
    let operations = kernel_support::testing::check_device_binaries_of(&allocator, &dtypes);
    // Three pairs of operands, add and mul, per dtype.
    assert_eq!(operations, 6 * dtypes.len() as u64);
    assert_eq!(device.device_copies() - launches, operations, "one kernel each");
    assert_eq!(ir_core::storage::host_round_trips(), round_trips, "no host round trip");
}
