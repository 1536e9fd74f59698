//! Unit tests of the crate root's pieces: geometry, predicates, copy pieces, kernel arguments.

use super::*;
use ir_core::op::ArgMeta;
use ir_core::{DType, DeviceKind, KernelError, Support, Tensor, TensorMeta, UniqueTensor};
use ir_core::{Device, Layout};

#[test]
fn gated_blocks_are_a_step_per_thread_in_powers_of_two() {
    // 16-byte chunks: 8 bf16, 4 f32, 2 f64.
    assert_eq!([DType::BF16, DType::F16, DType::F32, DType::F64].map(gpu_chunk), [8, 8, 4, 2]);
    // At least a wavefront, even for one chunk.
    assert_eq!(gated_block(1, DType::BF16), 64);
    assert_eq!(gated_block(1024, DType::BF16), 64);
    assert_eq!(gated_block(1040, DType::BF16), 128);
    assert_eq!(gated_block(4096, DType::BF16), 256);
    assert_eq!(gated_block(8192, DType::BF16), 512);
    assert_eq!(gated_block(4096, DType::F32), 512);
    assert_eq!(gated_block(14336, DType::BF16), 1024);
    assert_eq!(gated_block(16384, DType::BF16), 1024);
    assert_eq!(gated_block(usize::MAX, DType::BF16), 1024);
    assert_eq!(gated_block(4096, DType::F64), 1024);
    for d in 1..5000 {
        for dtype in [DType::BF16, DType::F32, DType::F64] {
            let block = gated_block(d, dtype);
            assert!(block.is_power_of_two() && (64..=GATED_MAX_BLOCK).contains(&block), "{d} {dtype}");
            // One step per thread whenever the largest block allows it.
            let chunks = d.div_ceil(gpu_chunk(dtype));
            if chunks <= GATED_STEP_CHUNKS * GATED_MAX_BLOCK as usize {
                assert!(chunks <= GATED_STEP_CHUNKS * block as usize, "{d} {dtype}: {block}");
                assert!(block == 64 || chunks > GATED_STEP_CHUNKS * block as usize / 2, "{d} {dtype}: {block}");
            }
        }
    }
}

fn meta(dtype: DType, shape: &[usize], strides: &[usize], offset: usize) -> TensorMeta {
    TensorMeta { dtype, device: Device::Cpu, layout: Layout::new(shape, strides, offset).unwrap() }
}

fn rms(x: &TensorMeta, w: Option<&TensorMeta>, variance: Option<i64>) -> Support {
    let w = w.map_or(ArgMeta::None, ArgMeta::Tensor);
    let v = variance.map_or(ArgMeta::None, ArgMeta::I64);
    rms_norm_support(&[ArgMeta::Tensor(x), w, ArgMeta::F64(1e-6), v], DeviceKind::Cpu)
}

#[test]
fn dtype_codes_match_the_kernel_preludes() {
    let codes: Vec<u8> = [DType::F32, DType::F16, DType::BF16, DType::F64].map(element_code).to_vec();
    assert_eq!(codes, [0, 1, 2, 6]);
    assert_eq!(compute_dtype_code(DType::BF16, "cuda").unwrap(), 2);
    let error = compute_dtype_code(DType::F8E4M3FN, "xpu").unwrap_err();
    assert!(matches!(error, KernelError::UnsupportedDType { backend: "xpu", dtype: DType::F8E4M3FN }));
    assert_eq!(element_code(DType::I64), 7);
}

#[test]
fn row_parameters_give_back_their_rows() {
    for m in [meta(DType::BF16, &[4, 8], &[8, 1], 0), meta(DType::F32, &[3, 2, 8], &[32, 16, 1], 5)] {
        let rows = Rows::for_kernel(&m).unwrap();
        assert_eq!(rows.kernel_args().unwrap().rows().unwrap(), rows, "{m}");
    }
    let negative = RowArgs { n_rows: 2, hidden: 8, row_stride: -8, offset: 0 };
    let err = negative.rows().unwrap_err();
    assert_eq!(err, KernelError::OutOfRange { what: "row stride", value: -8, min: 0, max: i64::MAX });
    assert!(err.to_string().contains("row stride -8 is outside 0..="), "{err}");
}

#[test]
fn integers_past_a_kernel_parameter_and_native_only_parameters_are_typed_errors() {
    let err = kernel_int::<i32>(1 << 31, "hidden size").unwrap_err();
    let expected =
        KernelError::OutOfRange { what: "hidden size", value: 1 << 31, min: i32::MIN.into(), max: i32::MAX.into() };
    assert_eq!(err, expected);
    assert_eq!(kernel_int::<i32>(7, "hidden size"), Ok(7));
    // A block-stride loop's index must not pass i32::MAX on its last step.
    let most = i32::MAX as usize - 256;
    assert_eq!(stepped_extent(most, "output width", 256), Ok(i32::MAX - 256));
    let err = stepped_extent(most + 1, "output width", 256).unwrap_err();
    assert_eq!(err, KernelError::OutOfRange { what: "output width", value: most as i64 + 1, min: 0, max: most as i64 });
    assert!(stepped_extent(1 << 31, "hidden size", 128).is_err());
    let err = norm_variance(Some(9), 8).unwrap_err();
    assert_eq!(err, KernelError::OutOfRange { what: "variance_size", value: 9, min: 1, max: 8 });
    assert_eq!(norm_variance(Some(8), 8), Ok(8));
    assert_eq!(reject_variance_size(Some(4)), Err(KernelError::NativeOnly { param: "variance_size" }));
}

/// The norm + quantization predicates take the element dtypes (the common case: a weight of
/// x's dtype) or a provider's norm capabilities (a weight of another dtype too).
#[test]
fn norm_quant_predicates_take_dtypes_or_capabilities() {
    let x = meta(DType::BF16, &[4, 8], &[8, 1], 0);
    let w32 = meta(DType::F32, &[8], &[1], 0);
    let scale = meta(DType::F32, &[1], &[1], 0);
    let args = [
        ArgMeta::Tensor(&x),
        ArgMeta::Tensor(&w32),
        ArgMeta::F64(1e-6),
        ArgMeta::Tensor(&scale),
        ArgMeta::DType(DType::F8E4M3FN),
        ArgMeta::Str("exact"),
    ];
    let Support::No(reason) = rms_norm_static_fp8_quant_support_with(&args, DeviceKind::Cpu, KernelDTypes::Reduced)
    else {
        panic!("a weight of another dtype needs the capability")
    };
    assert_eq!(reason, "weight dtype f32 differs from x dtype bf16");
    let mixed = NormCapabilities { mixed_weight_dtype: true, ..NormCapabilities::DEFAULT };
    assert_eq!(rms_norm_static_fp8_quant_support_with(&args, DeviceKind::Cpu, mixed), Support::Yes);

    // The fused-add form's `dtype` rounding of a bf16 sum needs its capability.
    let w = meta(DType::BF16, &[8], &[1], 0);
    let fused = |rounding: &'static str| {
        [
            ArgMeta::Tensor(&x),
            ArgMeta::Tensor(&x),
            ArgMeta::Tensor(&w),
            ArgMeta::F64(1e-6),
            ArgMeta::Tensor(&scale),
            ArgMeta::DType(DType::F8E4M3FN),
            ArgMeta::Str(rounding),
        ]
    };
    let plain = NormCapabilities::DEFAULT;
    let rounding = NormCapabilities { dtype_rounding: true, ..NormCapabilities::DEFAULT };
    let support = fused_add_rms_norm_static_fp8_quant_support_with;
    assert_eq!(support(&fused("exact"), DeviceKind::Cpu, plain), Support::Yes);
    let Support::No(reason) = support(&fused("dtype"), DeviceKind::Cpu, plain) else {
        panic!("`dtype` rounding of a bf16 sum needs the capability")
    };
    assert!(reason.contains("rounding \"dtype\""), "{reason}");
    assert_eq!(support(&fused("dtype"), DeviceKind::Cpu, rounding), Support::Yes);
}

#[test]
fn rules() {
    let x = meta(DType::BF16, &[4, 8], &[8, 1], 0);
    let w = meta(DType::BF16, &[8], &[1], 0);
    assert_eq!(rms(&x, Some(&w), None), Support::Yes);
    assert_eq!(rms(&x, None, None), Support::Yes);
    let Support::No(reason) = rms(&x, Some(&w), Some(4)) else { panic!() };
    assert!(reason.contains("variance_size"), "{reason}");
    let Support::No(reason) = rms(&x, Some(&meta(DType::F32, &[8], &[1], 0)), None) else { panic!() };
    assert_eq!(reason, "weight dtype f32 differs from x dtype bf16");
    let f64_x = meta(DType::F64, &[4, 8], &[8, 1], 0);
    assert!(matches!(rms(&f64_x, None, None), Support::No(_)));
    let padded = meta(DType::BF16, &[4, 8], &[11, 1], 1);
    assert_eq!(rms(&padded, None, None), Support::Yes);
    let transposed = meta(DType::BF16, &[8, 4], &[1, 8], 0);
    assert!(matches!(rms(&transposed, None, None), Support::No(_)));
    let heads = meta(DType::BF16, &[4, 2, 64], &[128, 64, 1], 0);
    assert_eq!(rms(&heads, None, None), Support::Yes);
    let strided_weight = meta(DType::BF16, &[8], &[2], 0);
    assert!(matches!(rms(&x, Some(&strided_weight), None), Support::No(_)));
    let mut on_gpu = x.clone();
    on_gpu.device = Device::Cuda(0);
    let Support::No(reason) = rms(&on_gpu, None, None) else { panic!() };
    assert_eq!(reason, "x is on cuda:0, this provider runs on cpu");
}

#[test]
fn f64_is_taken_only_by_kernels_that_compute_in_it() {
    let f64_x = meta(DType::F64, &[4, 8], &[8, 1], 0);
    let f64_w = meta(DType::F64, &[8], &[1], 0);
    let bf16_x = meta(DType::BF16, &[4, 8], &[8, 1], 0);
    let bf16_w = meta(DType::BF16, &[8], &[1], 0);
    let norm = |x: &TensorMeta, w: &TensorMeta, dtypes| {
        let capabilities = NormCapabilities { dtypes, ..NormCapabilities::ALL };
        let args = [ArgMeta::Tensor(x), ArgMeta::Tensor(w), ArgMeta::F64(1e-6), ArgMeta::None];
        rms_norm_support_with(&args, DeviceKind::Cpu, capabilities)
    };
    for (x, w) in [(&f64_x, &f64_w), (&f64_x, &bf16_w), (&bf16_x, &f64_w)] {
        assert_eq!(norm(x, w, KernelDTypes::WithF64), Support::Yes, "x {} w {}", x.dtype, w.dtype);
        let Support::No(reason) = norm(x, w, KernelDTypes::Reduced) else { panic!("f64 refused") };
        assert!(reason.ends_with("dtype f64 is not one of f32, f16, bf16"), "{reason}");
    }
    let gated = |dtypes| gated_support_with(&[ArgMeta::Tensor(&f64_x)], DeviceKind::Cpu, dtypes);
    let quant = |dtypes| quant_support_with(&[ArgMeta::Tensor(&f64_x)], DeviceKind::Cpu, dtypes);
    assert_eq!((gated(KernelDTypes::WithF64), quant(KernelDTypes::WithF64)), (Support::Yes, Support::Yes));
    assert!(matches!(gated(KernelDTypes::Reduced), Support::No(_)));
    assert!(matches!(quant(KernelDTypes::Reduced), Support::No(_)));
    assert!(matches!(gated_support(&[ArgMeta::Tensor(&f64_x)], DeviceKind::Cpu), Support::No(_)), "the default");
    assert_eq!(KernelDTypes::with_f64_if(true), KernelDTypes::WithF64);
    assert!(!KernelDTypes::default().contains(DType::F64) && !KernelDTypes::WithF64.contains(DType::I64));
}

#[test]
fn gpu_geometry_thresholds() {
    let cases = [
        (8, 8),
        (64, 8),
        (65, 16),
        (128, 16),
        (129, 32),
        (3072, 32),
        (3073, 64),
        (6144, 64),
        (6145, 128),
        (16384, 128),
        (16385, 256),
    ];
    for (hidden, threads) in cases {
        assert_eq!(gpu_threads_per_row(hidden), threads, "H {hidden}");
    }
}

#[test]
fn rows() {
    let rows = Rows::of(&meta(DType::F32, &[2, 3, 8], &[48, 16, 1], 5)).unwrap();
    assert_eq!(rows, Rows { n_rows: 6, hidden: 8, row_stride: 16, offset: 5 });
    assert_eq!(rows.span(), 5 * 16 + 8);
    let single = Rows::of(&meta(DType::F32, &[8], &[1], 0)).unwrap();
    assert_eq!((single.n_rows, single.row_stride), (1, 8));
    let empty = Rows::of(&meta(DType::F32, &[0, 8], &[8, 1], 0)).unwrap();
    assert_eq!(empty.span(), 0);
}

#[test]
fn answers_do_not_depend_on_the_number_of_tokens() {
    for hidden in [1, 8, 769, 4096] {
        for (row_stride, offset) in [(hidden, 0), (hidden + 3, 1), (2 * hidden, 0)] {
            let answers: Vec<bool> = [1usize, 7, 2048, 65536]
                .iter()
                .flat_map(|&t| {
                    [
                        meta(DType::F16, &[t, hidden], &[row_stride, 1], offset),
                        meta(DType::F16, &[2, t, hidden], &[t * row_stride, row_stride, 1], offset),
                    ]
                })
                .map(|x| rms(&x, None, None) == Support::Yes)
                .collect();
            assert!(answers.iter().all(|&a| a == answers[0]), "H {hidden}, stride {row_stride}: {answers:?}");
        }
    }
}

#[test]
fn a_host_tensor_is_not_a_device_buffer_and_the_error_names_the_parameter() {
    let t = Tensor::zeros(DType::F32, &[2, 4]).unwrap();
    let err = device_buffer::<u8>(&t, "x", "CUDA").unwrap_err();
    assert_eq!(err.to_string(), KernelError::WrongMemory { param: "x".to_owned(), memory: "CUDA" }.to_string());
    let mut unique = UniqueTensor::new(t).unwrap();
    assert!(
        device_buffer_mut::<u8>(&mut unique, "x_residual", "xpu")
            .unwrap_err()
            .to_string()
            .contains("`x_residual` is not in xpu memory")
    );
}

/// Every (source, destination) storage index pair the pieces walk, in launch order: each
/// piece's elements in row-major order of its padded dimensions.
fn walked(pieces: &[CopyDims]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for piece in pieces {
        for i in 0..piece.n {
            let (mut rest, mut s, mut d) = (i, piece.src_offset, piece.dst_offset);
            for k in (0..COPY_MAX_RANK).rev() {
                s += (rest % piece.shape[k]) * piece.src_strides[k];
                d += (rest % piece.shape[k]) * piece.dst_strides[k];
                rest /= piece.shape[k];
            }
            out.push((s as usize, d as usize));
        }
    }
    out
}

/// What a copy between the two layouts moves, element by element.
fn expected(src: &Layout, dst: &Layout) -> Vec<(usize, usize)> {
    src.storage_indices().zip(dst.storage_indices()).collect()
}

#[test]
fn copy_pieces_merge_what_both_layouts_step_through_as_one() {
    // Compact into compact at any rank: one piece of one dimension.
    let shape = [2, 1, 3, 2, 2, 1, 2, 2, 3, 2, 2];
    let compact = Layout::compact(&shape);
    let pieces = CopyDims::pieces(&meta(DType::F32, &shape, compact.strides(), 0), &compact).unwrap();
    assert_eq!(pieces.len(), 1);
    assert_eq!((pieces[0].rank, pieces[0].n, pieces[0].shape[0], pieces[0].src_strides[0]), (1, 1152, 1152, 1));
    // A row slice of a [4, 6] matrix into compact rows: two dimensions stay.
    let rows = meta(DType::F32, &[4, 3], &[6, 1], 2);
    let pieces = CopyDims::pieces(&rows, &Layout::compact(&[4, 3])).unwrap();
    assert_eq!((pieces.len(), pieces[0].rank), (1, 2));
    assert_eq!(walked(&pieces), expected(&rows.layout, &Layout::compact(&[4, 3])));
    // No elements, no launch.
    assert!(CopyDims::pieces(&meta(DType::F32, &[3, 0], &[1, 1], 0), &Layout::compact(&[3, 0])).unwrap().is_empty());
    // Different shapes are refused.
    let err = CopyDims::pieces(&rows, &Layout::compact(&[3, 4])).unwrap_err();
    assert!(matches!(&err, KernelError::OperandMismatch(m) if m.operand == "destination"), "{err}");
}

#[test]
fn a_copy_past_the_kernels_rank_is_cut_into_pieces_over_its_outer_dimensions() {
    // Ten dimensions of extent 2, the source's strides reversed (a full transpose): nothing
    // merges, so the outer two dimensions make four pieces of eight dimensions.
    let shape = [2; 10];
    let compact = Layout::compact(&shape);
    let reversed: Vec<usize> = (0..10).map(|i| 1 << i).collect();
    let src = meta(DType::BF16, &shape, &reversed, 3);
    let dst = Layout::new(&shape, compact.strides(), 5).unwrap();
    let pieces = CopyDims::pieces(&src, &dst).unwrap();
    assert_eq!(pieces.len(), 4);
    assert!(pieces.iter().all(|p| p.rank == 8 && p.n == 256));
    assert_eq!(pieces.iter().map(|p| p.first).collect::<Vec<_>>(), [0, 256, 512, 768]);
    assert_eq!(walked(&pieces), expected(&src.layout, &dst));
}

proptest::proptest! {
    /// For any shape up to twelve dimensions, any order of the source's and the destination's
    /// dimensions in memory, padding and offsets: the pieces walk exactly the copy's pairs, in
    /// row-major order, each within the kernel's rank, with `first` counting the elements before.
    #[test]
    fn copy_pieces_walk_every_element_pair_in_order(
        extents in proptest::collection::vec(1usize..4, 1..12),
        src_order in proptest::prelude::any::<u64>(),
        dst_order in proptest::prelude::any::<u64>(),
        pad in 0usize..2,
        offsets in (0usize..7, 0usize..7),
    ) {
        let strided = |order: u64, offset: usize| {
            // The dimensions laid out in memory in a permutation drawn from `order`, the
            // innermost one padded by `pad`.
            let rank = extents.len();
            let mut dims: Vec<usize> = (0..rank).collect();
            let mut bits = order;
            for i in (1..rank).rev() {
                dims.swap(i, (bits % (i as u64 + 1)) as usize);
                bits /= i as u64 + 1;
            }
            let mut strides = vec![0; rank];
            let mut step = 1;
            for &d in dims.iter().rev() {
                strides[d] = step;
                step *= extents[d] + pad;
            }
            Layout::new(&extents, &strides, offset).unwrap()
        };
        let src = strided(src_order, offsets.0);
        let dst = strided(dst_order, offsets.1);
        let pieces = CopyDims::pieces(&meta(DType::F16, &extents, src.strides(), src.offset()), &dst).unwrap();
        proptest::prop_assert!(pieces.iter().all(|p| (1..=COPY_MAX_RANK as i32).contains(&p.rank)));
        let mut first = 0;
        for p in &pieces {
            proptest::prop_assert_eq!(p.first, first);
            proptest::prop_assert!(p.shape[p.rank as usize..].iter().all(|&e| e == 1));
            first += p.n;
        }
        proptest::prop_assert_eq!(walked(&pieces), expected(&src, &dst));
    }
}
