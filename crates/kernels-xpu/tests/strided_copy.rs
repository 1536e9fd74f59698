//! `clone` and `contiguous` of xpu tensors copy on the device (the strided copy kernel), bit for
//! bit in every dtype and layout, and through the host only past the kernel's rank.

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
    ir_core::testing::check_device_copies(&allocator);
    // Every dtype, five views each, clone and contiguous: all on the device.
    assert_eq!(device.device_copies(), before + 2 * 5 * ir_core::DType::ALL.len() as u64);
}

#[test]
fn a_rank_past_the_kernel_copies_through_the_host() {
    let Some((device, allocator)) = xpu() else { return };
    let rank = kernels_xpu::COPY_MAX_RANK + 1;
    let mut shape = vec![1; rank];
    shape[0] = 3;
    shape[rank - 1] = 2;
    let host = distinct(DType::F32, &shape);
    let view = host.transpose(0, rank - 1).unwrap();
    let on_device = host.to_device(&allocator).unwrap().as_strided(view.layout().clone()).unwrap();
    let before = device.device_copies();
    let copy = on_device.contiguous().unwrap();
    assert_eq!(device.device_copies(), before, "no device-side copy past the kernel's rank");
    assert!(bit_eq(&copy.to_cpu().unwrap(), &view));
}
