//! `clone` and `contiguous` of xpu tensors copy on the device (the strided copy kernel), bit for
//! bit in every dtype and layout, at any rank.

use ir_core::{DType, Tensor, bit_eq};

/// The xpu device and its allocator, or `None` after saying why there is none.
fn xpu() -> Option<(&'static kernels_xpu::XpuDevice, kernels_xpu::XpuAllocator)> {
    match kernels_xpu::device() {
        Ok(device) => Some((device, kernels_xpu::allocator().expect("an available device has an allocator"))),
        Err(reason) => {
            ir_core::testing::skip("xpu", &reason);
            None
        }
    }
}

/// A compact host tensor whose elements differ from their neighbours (quarter steps, signed, so
/// every dtype, 8-bit ones included, holds them apart).
fn distinct(dtype: DType, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n).map(|i| ((i * 37) % 29) as f64 / 4.0 - 3.5).collect();
    Tensor::from_f64(dtype, shape, &values).unwrap()
}

#[test]
fn clone_and_contiguous_copy_on_the_device_bit_for_bit() {
    let Some((device, allocator)) = xpu() else { return };
    let before = device.device_copies();
    let copies = kernel_support::testing::check_device_copies(&allocator);
    // Every dtype, eight views each (one of rank 10, two of whole 16-byte rows), clone and
    // contiguous: all on the device.
    assert_eq!(copies, 2 * 8 * ir_core::DType::ALL.len() as u64);
    // (At least: the counter is the process's, and the other test copies too; no copy went through
    // the host on this thread, which `check_device_copies` checks.)
    assert!(device.device_copies() - before >= copies);
}

#[test]
fn a_rank_past_the_kernel_copies_on_the_device_in_pieces() {
    let Some((device, allocator)) = xpu() else { return };
    // Twelve dimensions, every other one transposed with its neighbour: nothing merges, so the
    // outer four dimensions make 3·2·2·2 launches of eight dimensions.
    let rank = kernels_xpu::COPY_MAX_RANK + 4;
    let mut shape = vec![2; rank];
    shape[0] = 3;
    let host = distinct(DType::BF16, &shape);
    let view = (0..rank).step_by(2).try_fold(host.clone(), |t, k| t.transpose(k, k + 1)).unwrap();
    let on_device = host.to_device(&allocator).unwrap().as_strided(view.layout().clone()).unwrap();
    let (before, trips) = (device.device_copies(), ir_core::storage::host_round_trips_on_this_thread());
    let copy = on_device.contiguous().unwrap();
    assert!(device.device_copies() > before, "a copy on the device");
    assert_eq!(ir_core::storage::host_round_trips_on_this_thread(), trips, "no copy through the host");
    assert!(bit_eq(&copy.to_cpu().unwrap(), &view));
}
