//! Exchanging tensors with candle and DLPack: which conversions share memory, which copy, and
//! that memory lent read-only is never written.

mod common;

use candle_core as candle;
use ir_core::half::bf16;
use ir_core::interop::InteropError;
use ir_core::storage::Storage;
use ir_core::{DType, Tensor, TensorError};
use ir_ops::fused_add_rms_norm;
use ir_ops::rms_norm::rms_norm;

/// The address of a candle CPU tensor's first element.
fn candle_first_element(tensor: &candle::Tensor) -> usize {
    let (storage, layout) = tensor.storage_and_layout();
    let candle::Storage::Cpu(cpu) = &*storage else { panic!("not a CPU tensor") };
    let base = match cpu {
        candle::CpuStorage::F32(v) => v.as_ptr() as usize,
        candle::CpuStorage::BF16(v) => v.as_ptr() as usize,
        other => panic!("unexpected storage {other:?}"),
    };
    base + layout.start_offset() * tensor.dtype().size_in_bytes()
}

fn first_element(tensor: &Tensor) -> usize {
    tensor.cpu_buffer().unwrap().as_ptr() as usize + tensor.offset() * tensor.dtype().size_in_bytes()
}

#[test]
fn candle_tensors_are_viewed_without_a_copy_and_never_written() {
    let data: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let c = candle::Tensor::from_vec(data, (3, 4), &candle::Device::Cpu).unwrap();
    // A strided candle view (transposed, then narrowed) keeps its strides and offset.
    let view = c.t().unwrap().narrow(0, 1, 2).unwrap();
    // SAFETY: nothing writes `c` in place in this test.
    let t = unsafe { Tensor::from_candle_shared(&view) }.unwrap();
    assert_eq!(first_element(&t), candle_first_element(&view));
    assert_eq!(t.shape(), [2, 3]);
    assert_eq!(t.to_vec::<f32>().unwrap(), view.to_vec2::<f32>().unwrap().concat());
    assert!(!t.is_uniquely_owned(), "memory lent by candle is read-only");
    // An in-place kernel given it as a donated activation gets a copy; candle's memory keeps its
    // values, while the writable residual is written in place.
    let registry = ir_ops::registry();
    common::register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let before = c.to_vec2::<f32>().unwrap();
    let residual = Tensor::ones(DType::F32, &[2, 3]).unwrap();
    let residual_address = first_element(&residual);
    let (normed, residual) =
        fused_add_rms_norm::maybe_inplace(&registry, t.clone(), residual, None, 1e-6, None, ir_ops::Rounding::Exact)
            .unwrap();
    assert_ne!(first_element(&normed), first_element(&t));
    assert_eq!(first_element(&residual), residual_address);
    assert_eq!(c.to_vec2::<f32>().unwrap(), before);
    let record = registry.selection_record();
    let record = record.op("fused_add_rms_norm").unwrap();
    assert_eq!((record.inplace_writes, record.defensive_copies), (1, 1));
    // copy_ into it is refused by name.
    let mut target = t.clone();
    let error = target.copy_from(&normed).unwrap_err();
    assert!(matches!(error, TensorError::ReadOnlyStorage { .. }), "{error}");
    // The safe conversion copies.
    let copied = Tensor::from_candle(&view).unwrap();
    assert_ne!(first_element(&copied), candle_first_element(&view));
    assert_eq!(copied.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    assert!(copied.is_uniquely_owned());
}

#[test]
fn kernel_outputs_move_into_candle_without_a_copy() {
    let registry = ir_ops::registry();
    let x = Tensor::from_vec(&[2, 4], (0..8).map(|i| bf16::from_f32(i as f32 - 3.0)).collect()).unwrap();
    let w = Tensor::ones(DType::BF16, &[4]).unwrap();
    let out = rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap();
    let expected = out.to_vec::<bf16>().unwrap();
    let address = first_element(&out);
    let c = out.into_candle().unwrap();
    // Up to 8 KiB, the elements move to the front of their vector (candle then wraps the vector as
    // it is): the same allocation, at most one 64-byte alignment step earlier.
    let moved_by = address - candle_first_element(&c);
    assert!(moved_by < 64, "the output's vector moved into candle (moved by {moved_by} bytes)");
    assert_eq!(c.dims(), [2, 4]);
    assert_eq!(c.flatten_all().unwrap().to_vec1::<bf16>().unwrap(), expected);
    // A larger output stays where it is, a view of its vector.
    let x = Tensor::ones(DType::F32, &[4, 1024]).unwrap();
    let out = rms_norm(&registry, &x, None, 1e-6, None).unwrap();
    let (address, expected) = (first_element(&out), out.to_vec::<f32>().unwrap());
    let c = out.into_candle().unwrap();
    assert_eq!(candle_first_element(&c), address, "a 16 KiB output is not moved");
    assert_eq!(c.dims(), [4, 1024]);
    assert!(c.flatten_all().unwrap().to_vec1::<f32>().unwrap() == expected, "the same values");
    // A compact view at an offset moves too; a shared or strided one is copied.
    let x = Tensor::from_vec(&[3, 2], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let row = x.slice(0, 1, 3).unwrap();
    let shared = row.clone().into_candle().unwrap();
    assert_ne!(candle_first_element(&shared), first_element(&row), "x still holds the storage");
    drop(x);
    let address = first_element(&row);
    let moved = row.into_candle().unwrap();
    assert!(address - candle_first_element(&moved) < 64 + 2 * 4, "the same vector, its elements moved to the front");
    assert_eq!(moved.to_vec2::<f32>().unwrap(), [[3.0, 4.0], [5.0, 6.0]]);
    let t = Tensor::from_vec(&[2, 2], vec![1.0f32, 2.0, 3.0, 4.0]).unwrap().transpose(0, 1).unwrap();
    assert_eq!(t.into_candle().unwrap().to_vec2::<f32>().unwrap(), [[1.0, 3.0], [2.0, 4.0]]);
}

#[test]
fn candle_dtypes_without_a_counterpart_are_errors_naming_them() {
    let c = candle::Tensor::new(&[1u32, 2], &candle::Device::Cpu).unwrap();
    // SAFETY: nothing writes `c`.
    let error = unsafe { Tensor::from_candle_shared(&c) }.unwrap_err();
    assert!(matches!(error, InteropError::UnsupportedDType { .. }));
    assert!(error.to_string().contains("U32"), "{error}");
}

#[test]
fn eight_bit_tensors_cross_to_candle_and_dlpack_with_their_bits() {
    let values = [0.0, -1.5, 448.0, 1e6, -0.001953125, f64::NAN];
    let t = Tensor::from_f64(DType::F8E4M3FN, &[2, 3], &values).unwrap();
    let bits: Vec<u8> = t.cpu_buffer().unwrap().bytes().to_vec();
    assert_eq!(bits, [0x00, 0xbc, 0x7e, 0x7e, 0x81, 0x7f], "saturating, nearest-even codes");
    let c = t.clone().into_candle().unwrap();
    assert_eq!(c.dtype(), candle::DType::F8E4M3);
    // SAFETY: nothing writes `c`.
    let back = unsafe { Tensor::from_candle_shared(&c) }.unwrap();
    assert_eq!((back.dtype(), back.cpu_buffer().unwrap().bytes()), (DType::F8E4M3FN, &bits[..]));
    for dtype in [DType::F8E5M2, DType::I8] {
        let t = Tensor::from_f64(dtype, &[3], &[1.0, -2.0, 3.0]).unwrap();
        let error = t.clone().into_candle().unwrap_err();
        assert!(error.to_string().contains(dtype.name()), "{error}");
        // SAFETY: the DLPack tensor came from `to_dlpack`; nothing else touches it.
        let back = unsafe { Tensor::from_dlpack(t.to_dlpack().unwrap()) }.unwrap();
        assert_eq!(back.dtype(), dtype);
        assert_eq!(back.to_f64_vec().unwrap(), [1.0, -2.0, 3.0]);
    }
}

#[test]
fn i64_positions_cross_to_candle_and_dlpack() {
    let positions = Tensor::from_vec(&[4], vec![0i64, 7, 4095, 1 << 40]).unwrap();
    let c = positions.clone().into_candle().unwrap();
    assert_eq!(c.to_vec1::<i64>().unwrap(), [0, 7, 4095, 1 << 40]);
    // SAFETY: nothing writes `c`.
    let back = unsafe { Tensor::from_candle_shared(&c) }.unwrap();
    assert_eq!((back.dtype(), back.to_f64_vec().unwrap()), (DType::I64, vec![0.0, 7.0, 4095.0, (1u64 << 40) as f64]));
    // SAFETY: the DLPack tensor came from `to_dlpack`; nothing else touches it.
    let again = unsafe { Tensor::from_dlpack(positions.clone().to_dlpack().unwrap()) }.unwrap();
    assert!(ir_core::bit_eq(&again, &positions));
}

#[test]
fn dlpack_round_trips_share_memory_and_respect_read_only() {
    let t = Tensor::from_vec(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let address = first_element(&t);
    // The only handle: exported writable, imported writable, the same memory.
    let exported = t.to_dlpack().unwrap();
    assert!(exported.flags().is_empty());
    // SAFETY: the DLPack tensor came from `to_dlpack`; nothing else touches it.
    let mut back = unsafe { Tensor::from_dlpack(exported) }.unwrap();
    assert_eq!(first_element(&back), address);
    assert!(back.is_uniquely_owned());
    back.copy_from(&Tensor::zeros(DType::F32, &[2, 3]).unwrap()).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), [0.0; 6]);
    // A view of a shared storage: read-only, strides and offset kept.
    let base = Tensor::from_vec(&[3, 2], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let view = base.slice(0, 1, 3).unwrap().transpose(0, 1).unwrap();
    let exported = view.clone().to_dlpack().unwrap();
    assert!(exported.flags().contains(dlpark::DlpackFlags::READ_ONLY));
    // SAFETY: as above.
    let back = unsafe { Tensor::from_dlpack(exported) }.unwrap();
    assert_eq!(first_element(&back), first_element(&view));
    assert_eq!(back.to_vec::<f32>().unwrap(), [3.0, 5.0, 4.0, 6.0]);
    assert!(!back.is_uniquely_owned(), "read-only DLPack memory is never written");
    assert!(matches!(back.storage(), Storage::Cpu(_)));
}

#[test]
fn candle_tensors_reach_dlpack_consumers_and_back() {
    // candle -> ours (shared) -> DLPack -> ours: one allocation throughout.
    let c = candle::Tensor::from_vec(vec![bf16::ONE; 8], (2, 4), &candle::Device::Cpu).unwrap();
    // SAFETY: nothing writes `c` in place.
    let t = unsafe { Tensor::from_candle_shared(&c) }.unwrap();
    let exported = t.to_dlpack().unwrap();
    assert!(exported.flags().contains(dlpark::DlpackFlags::READ_ONLY), "candle's memory stays read-only");
    // SAFETY: the DLPack tensor came from `to_dlpack`.
    let back = unsafe { Tensor::from_dlpack(exported) }.unwrap();
    assert_eq!(first_element(&back), candle_first_element(&c));
    assert_eq!(back.to_vec::<bf16>().unwrap(), vec![bf16::ONE; 8]);
}
