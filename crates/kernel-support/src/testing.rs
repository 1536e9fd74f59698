//! Checks the device crates' tests share: a device's strided copies, conversions and binary
//! operations, bit for bit against the host.

/// Checks a device's `clone` and `contiguous` (its `DeviceBuffer::copy_strided`) bit for bit in every
/// dtype, on views that are transposed, sliced (an offset), both, of rank 3, of rank 10 with no two
/// dimensions mergeable (past the kernels' [`COPY_MAX_RANK`](crate::COPY_MAX_RANK), so a device
/// cuts it into pieces), and two whose rows are whole 16-byte units at 16-byte offsets (the wide
/// copy, [`CopyDims::widened`](crate::CopyDims::widened)), against the same views on the host; panics naming the dtype
/// and layout that differ, or saying that a copy went through the host. Returns the number of copies
/// made (clone and contiguous of each view). For the kernel crates' tests.
pub fn check_device_copies(allocator: &dyn ir_core::storage::DeviceAllocator) -> u64 {
    use ir_core::storage::host_round_trips_on_this_thread;
    use ir_core::{DType, Tensor, bit_eq};
    let mut copies = 0;
    for dtype in DType::ALL {
        // Quarter steps, signed: every dtype, 8-bit ones included, holds neighbours apart.
        let distinct = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            let values: Vec<f64> = (0..n).map(|i| ((i * 37) % 29) as f64 / 4.0 - 3.5).collect();
            Tensor::from_f64(dtype, shape, &values).expect("a small tensor")
        };
        let host = distinct(&[7, 12]);
        // Rows of 16 elements (16 to 128 bytes) from column 16 of 32: a copy of whole 16-byte units,
        // which a device with the wide copy moves 16 bytes a thread.
        let wide = distinct(&[6, 32]);
        // Ten dimensions, the first and last of extent 3 and 2 swapped and the middle ones of
        // extent 2 reversed pairwise: no neighbours step as one.
        let deep = distinct(&[3, 2, 2, 2, 2, 2, 2, 2, 2, 2]);
        let deep_view =
            (1..5).try_fold(deep.transpose(0, 9).expect("rank 10"), |t, k| t.transpose(k, 9 - k)).expect("rank 10");
        let views = [
            (&host, host.clone()),
            (&host, host.transpose(0, 1).expect("rank 2")),
            (&host, host.slice(1, 2, 9).expect("in range")),
            (&host, host.slice(0, 1, 6).and_then(|t| t.transpose(0, 1)).expect("in range")),
            (&host, host.reshape(&[2, 3, 14]).and_then(|t| t.transpose(0, 2)).expect("84 elements")),
            (&deep, deep_view),
            (&wide, wide.slice(1, 16, 32).expect("in range")),
            (
                &wide,
                wide.reshape(&[3, 2, 32])
                    .and_then(|t| t.slice(2, 16, 32))
                    .and_then(|t| t.transpose(0, 1))
                    .expect("192 elements"),
            ),
        ];
        for (base, view) in views {
            let label = format!("{dtype} {}", view.layout());
            let on_device = base
                .to_device(allocator)
                .and_then(|t| t.as_strided(view.layout().clone()))
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            let trips = host_round_trips_on_this_thread();
            let contiguous = on_device.contiguous().unwrap_or_else(|e| panic!("{label}: {e}"));
            let cloned = on_device.deep_clone().unwrap_or_else(|e| panic!("{label}: {e}"));
            assert_eq!(host_round_trips_on_this_thread(), trips, "{label}: copied through the host");
            assert!(contiguous.layout().is_compact_at_zero(), "{label}: contiguous is compact");
            assert!(bit_eq(&contiguous.to_cpu().expect("download"), &view), "{label}: contiguous");
            assert!(bit_eq(&cloned.to_cpu().expect("download"), &view), "{label}: clone");
            copies += 2;
        }
    }
    copies
}

/// Panics naming `label` and the first element where `got` differs from `expected` (bit for bit,
/// any NaN equal to any NaN).
fn assert_same(got: &ir_core::Tensor, expected: &ir_core::Tensor, label: &str) {
    let (x, y) = (got.to_f64_vec().expect("download"), expected.to_f64_vec().expect("download"));
    assert_eq!(x.len(), y.len(), "{label}: lengths");
    let differs = x.iter().zip(&y).position(|(p, q)| p.to_bits() != q.to_bits() && !(p.is_nan() && q.is_nan()));
    if let Some(i) = differs {
        panic!("{label}: differs from the host's at element {i}: {:e} against {:e}", x[i], y[i]);
    }
}

/// Checks a device's `copy_` between dtypes and `scale` (its `DeviceBuffer::convert_strided`) against
/// the host's, bit for bit (NaN as NaN): every pair of dtypes, from a compact and a transposed
/// source into a compact and a transposed destination, on values from 2^-30 to 2^20 (subnormal,
/// overflowing and tie cases for the narrow dtypes), infinities, NaN, values past i64's range, f64
/// values that a rounding through nearest-even f32 would round twice, every code of the 8-bit
/// dtypes, i64 values past f64's precision, and `scale` of each dtype by inexact factors. Panics
/// naming the case that differs, or saying that a conversion went through the host (a backend
/// with f64 arithmetic converts every pair on the device). Returns the number of conversions made.
/// For the kernel crates' tests.
pub fn check_device_conversions(allocator: &dyn ir_core::storage::DeviceAllocator) -> u64 {
    check_device_conversions_of(allocator, &ir_core::DType::ALL)
}

/// [`check_device_conversions`] of the pairs within `dtypes` only (a device without f64 arithmetic
/// checks the others).
pub fn check_device_conversions_of(
    allocator: &dyn ir_core::storage::DeviceAllocator,
    dtypes: &[ir_core::DType],
) -> u64 {
    use ir_core::storage::host_round_trips_on_this_thread;
    use ir_core::{DType, F8E4M3, F8E5M2, Tensor};
    // Signed quarter steps times powers of two from 2^-30 to 2^20, values halfway between two bf16
    // (and f16) neighbours, then twelve specials.
    let specials = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        1e19,
        -1e19,
        // Exact in f64 and i64, not in f32.
        2f64.powi(60) + 256.0,
        // A bf16 tie broken by a bit f32 cannot hold: nearest-even f32 would round twice.
        1.0 + 2f64.powi(-8) + 2f64.powi(-30),
        -(1.0 + 2f64.powi(-11) + 2f64.powi(-40)),
        1e-300,
        300.0,
        -129.5,
        2.5,
    ];
    let values: Vec<f64> = (0..84i32)
        .map(|i| {
            let base = f64::from((i * 37) % 29) / 4.0 - 3.5;
            let scaled = base * 2f64.powi((i % 11) * 5 - 30);
            if i % 7 == 3 { 1.0 + 2f64.powi(-8) + 2f64.powi(-9) * f64::from(i % 2) } else { scaled }
        })
        .chain(specials)
        .collect();
    let mut conversions = 0;
    for &src_dtype in dtypes {
        let mut sources = vec![Tensor::from_f64(src_dtype, &[8, 12], &values).expect("a small tensor")];
        let every_code = |t: Result<Tensor, ir_core::TensorError>| t.expect("every code");
        match src_dtype {
            DType::F8E4M3FN => {
                sources.push(every_code(Tensor::from_vec(&[16, 16], (0..=255u8).map(F8E4M3::from_bits).collect())))
            }
            DType::F8E5M2 => {
                sources.push(every_code(Tensor::from_vec(&[16, 16], (0..=255u8).map(F8E5M2::from_bits).collect())))
            }
            DType::I8 => sources.push(every_code(Tensor::from_vec(&[16, 16], (-128..=127i8).collect()))),
            DType::I64 => {
                let edges = [i64::MAX, i64::MIN, (1 << 53) + 1, -(1 << 53) - 1, (1 << 62) + 1, (1 << 62) - 1, 0, -1];
                sources.push(every_code(Tensor::from_vec(&[2, 4], edges.to_vec())));
            }
            _ => {}
        }
        for host in sources {
            let on_device = host.to_device(allocator).expect("upload");
            for transposed_src in [false, true] {
                let (src_host, src_device) = if transposed_src {
                    (host.transpose(0, 1).expect("rank 2"), on_device.transpose(0, 1).expect("rank 2"))
                } else {
                    (host.clone(), on_device.clone())
                };
                for &dst_dtype in dtypes {
                    for transposed_dst in [false, true] {
                        let label = format!(
                            "copy_ {src_dtype} {} -> {dst_dtype}{}",
                            src_host.layout(),
                            if transposed_dst { " (transposed destination)" } else { "" }
                        );
                        let shape = src_host.shape();
                        let fresh = |shape: &[usize]| Tensor::zeros(dst_dtype, shape).expect("zeros");
                        let (mut expected, dst) = if transposed_dst {
                            let swapped = [shape[1], shape[0]];
                            let host_dst = fresh(&swapped).transpose(0, 1).expect("rank 2");
                            let device_dst =
                                fresh(&swapped).to_device(allocator).and_then(|t| t.transpose(0, 1)).expect("upload");
                            (host_dst, device_dst)
                        } else {
                            (fresh(shape), fresh(shape).to_device(allocator).expect("upload"))
                        };
                        let mut dst = dst;
                        expected.copy_from(&src_host).unwrap_or_else(|e| panic!("{label}: {e}"));
                        let trips = host_round_trips_on_this_thread();
                        dst.copy_from(&src_device).unwrap_or_else(|e| panic!("{label}: {e}"));
                        assert_eq!(host_round_trips_on_this_thread(), trips, "{label}: converted on the host");
                        conversions += 1;
                        assert_same(&dst, &expected, &label);
                    }
                }
                for factor in [0.1, -3.0, 1e-3] {
                    let label = format!("scale {src_dtype} {} by {factor}", src_host.layout());
                    let expected = src_host.scale(factor).unwrap_or_else(|e| panic!("{label}: {e}"));
                    let trips = host_round_trips_on_this_thread();
                    let got = src_device.scale(factor).unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert_eq!(host_round_trips_on_this_thread(), trips, "{label}: scaled on the host");
                    conversions += 1;
                    assert!(got.layout().is_compact_at_zero(), "{label}: compact result");
                    assert_same(&got, &expected, &label);
                }
            }
        }
    }
    conversions
}

/// Checks a device's `add` and `mul` (its `DeviceBuffer::binary_strided`) against the host's, bit
/// for bit (NaN as NaN): every dtype, compact and transposed operands, and operands of rank 10 (one
/// with its dimensions reversed: past the kernels' rank, so a device cuts it into pieces), on
/// values whose sums and products round (ties, overflow, subnormal results, NaN, i64 saturation).
/// Panics naming the case that differs or went through the host; returns the number of operations
/// made. For the kernel crates' tests.
pub fn check_device_binaries(allocator: &dyn ir_core::storage::DeviceAllocator) -> u64 {
    check_device_binaries_of(allocator, &ir_core::DType::ALL)
}

/// [`check_device_binaries`] of the dtypes in `dtypes` only (a device without f64 arithmetic checks
/// the others).
pub fn check_device_binaries_of(allocator: &dyn ir_core::storage::DeviceAllocator, dtypes: &[ir_core::DType]) -> u64 {
    use ir_core::Tensor;
    let a_values: Vec<f64> = (0..84i32)
        .map(|i| match i % 9 {
            0 => f64::NAN,
            1 => 6.0e4,
            2 => 1.0 + 2f64.powi(-8),
            3 => 2f64.powi(-20),
            4 if i % 2 == 0 => 3e18,
            _ => f64::from((i * 37) % 29) / 4.0 - 3.5,
        })
        .collect();
    let b_values: Vec<f64> = (0..84i32)
        .map(|i| match i % 7 {
            1 => 6.0e4,
            2 => 2f64.powi(-9),
            3 => -2f64.powi(-21),
            _ => f64::from((i * 11) % 17) / 8.0 - 1.0,
        })
        .collect();
    let mut operations = 0;
    for &dtype in dtypes {
        let a = Tensor::from_f64(dtype, &[7, 12], &a_values).expect("a small tensor");
        let b = Tensor::from_f64(dtype, &[12, 7], &b_values).expect("a small tensor");
        let (a_device, b_device) = (a.to_device(allocator).expect("upload"), b.to_device(allocator).expect("upload"));
        // Rank 10: a with its dimensions reversed, b compact in that shape.
        let deep = |values: &[f64], shape: &[usize]| {
            let n: usize = shape.iter().product();
            let cycled: Vec<f64> = values.iter().copied().cycle().take(n).collect();
            Tensor::from_f64(dtype, shape, &cycled).expect("a small tensor")
        };
        let a_deep = deep(&a_values, &[3, 2, 2, 2, 2, 2, 2, 2, 2, 2]);
        let b_deep = deep(&b_values, &[2, 2, 2, 2, 2, 2, 2, 2, 2, 3]);
        let reversed = |t: &Tensor| (0..5).try_fold(t.clone(), |t, k| t.transpose(k, 9 - k)).expect("rank 10");
        let a_deep_device = a_deep.to_device(allocator).expect("upload");
        let b_deep_device = b_deep.to_device(allocator).expect("upload");
        // a compact with b transposed, both transposed, and the rank-10 pair.
        let pairs = [
            (reversed(&a_deep), b_deep, reversed(&a_deep_device), b_deep_device),
            (
                a.clone(),
                b.transpose(0, 1).expect("rank 2"),
                a_device.clone(),
                b_device.transpose(0, 1).expect("rank 2"),
            ),
            (
                a.transpose(0, 1).expect("rank 2"),
                b.clone(),
                a_device.transpose(0, 1).expect("rank 2"),
                b_device.clone(),
            ),
        ];
        let trips = ir_core::storage::host_round_trips_on_this_thread();
        for (x, y, x_device, y_device) in pairs {
            for (name, host, device) in
                [("add", x.add(&y), x_device.add(&y_device)), ("mul", x.mul(&y), x_device.mul(&y_device))]
            {
                let label = format!("{name} {dtype} {} {}", x.layout(), y.layout());
                let (host, device) = (host.expect("host"), device.unwrap_or_else(|e| panic!("{label}: {e}")));
                operations += 1;
                assert!(!device.device().is_cpu(), "{label}: the result stays on the device");
                assert!(device.layout().shape() == host.layout().shape(), "{label}: shape");
                assert!(device.layout().is_compact_at_zero(), "{label}: compact result");
                assert_same(&device, &host, &label);
            }
        }
        let through_host = ir_core::storage::host_round_trips_on_this_thread() - trips;
        assert_eq!(through_host, 0, "{dtype}: add or mul went through the host");
    }
    operations
}

/// `[rows, width]` in `dtype`: values in (-2, 2) times `scale`, the first row zero and a NaN in
/// the second; a column slice of a wider buffer when `strided`. The activations of
/// [`row_program_sample`].
pub fn row_program_activation(
    dtype: ir_core::DType,
    rows: usize,
    width: usize,
    scale: f64,
    seed: u64,
    strided: bool,
) -> ir_core::Tensor {
    let wide = if strided { width + 3 } else { width };
    let mut values: Vec<f64> =
        (0..rows * wide).map(|i| ((i as f64 * 0.618_034 + seed as f64) * 12.9898).sin() * 2.0 * scale).collect();
    values[..wide].iter_mut().for_each(|v| *v = 0.0);
    if rows > 1 {
        values[wide + 1] = f64::NAN;
    }
    let t = ir_core::Tensor::from_f64(dtype, &[rows, wide], &values).expect("a small tensor");
    if strided { t.narrow(1, 1, width).expect("inside the row") } else { t }
}

/// An argument of a sample call of a row program: a tensor or a scalar.
#[derive(Debug)]
pub enum SampleArg {
    /// A tensor argument.
    Tensor(ir_core::Tensor),
    /// A scalar argument.
    Scalar(f64),
}

impl SampleArg {
    /// As a program argument.
    pub fn arg(&self) -> ir_ops::row_program::RowArg<'_> {
        match self {
            SampleArg::Tensor(t) => ir_ops::row_program::RowArg::Tensor(t),
            SampleArg::Scalar(v) => ir_ops::row_program::RowArg::Scalar(*v),
        }
    }
}

/// A call of any built-in program (`ir_ops::row_program::builtin::all`) on `rows` rows of `width`
/// in `dtype`, on the host: activations (the first a column slice, [`row_program_activation`] of
/// scale 2), a weight of 1.25, an epsilon of 1e-6, a variance size of half the row, a std
/// multiplier of 1, a scale of 0.01, a bound of 2, one position per row (cycling through 7, the
/// last one 7 rows apart), and a cos/sin cache of 7 positions rotating half the row (an even width
/// of at least 2: all of it below 4).
pub fn row_program_sample(
    program: &ir_ops::row_program::RowProgram,
    dtype: ir_core::DType,
    rows: usize,
    width: usize,
) -> Vec<SampleArg> {
    use ir_core::{DType, Tensor};
    use ir_ops::row_program::InputKind;
    program
        .inputs()
        .iter()
        .enumerate()
        .map(|(index, input)| match (&input.kind, input.name.as_str()) {
            (InputKind::Activation { blocks }, _) => {
                SampleArg::Tensor(row_program_activation(dtype, rows, blocks * width, 2.0, index as u64, index == 0))
            }
            (InputKind::Weight, _) => {
                SampleArg::Tensor(Tensor::from_f64(dtype, &[width], &vec![1.25; width]).expect("a weight"))
            }
            (InputKind::ScalarTensor, "scale_ub") => {
                SampleArg::Tensor(Tensor::from_f64(DType::F32, &[1], &[2.0]).expect("a bound"))
            }
            (InputKind::ScalarTensor, _) => {
                SampleArg::Tensor(Tensor::from_f64(DType::F32, &[1], &[0.01]).expect("a scale"))
            }
            (InputKind::Positions, _) => {
                let positions: Vec<i64> = (0..rows as i64).map(|row| (row * 3 + 1) % 7).collect();
                SampleArg::Tensor(Tensor::from_slice(&[rows], &positions).expect("positions"))
            }
            (InputKind::CosSinCache { .. }, _) => {
                let rotated = if width < 4 { width & !1 } else { (width / 2) & !1 }.max(2);
                let values: Vec<f64> = (0..7 * rotated).map(|i| (i as f64 * 0.37).cos()).collect();
                SampleArg::Tensor(Tensor::from_f64(dtype, &[7, rotated], &values).expect("a cos/sin cache"))
            }
            (InputKind::Scalar, "epsilon") => SampleArg::Scalar(1e-6),
            (InputKind::Scalar, "variance_size") => SampleArg::Scalar((width / 2) as f64),
            (InputKind::Scalar, "std_multiplier") => SampleArg::Scalar(1.0),
            (InputKind::Scalar, other) => panic!("no sample for scalar `{other}`"),
        })
        .collect()
}

/// The op whose tolerance a built-in program's outputs are held to: its own, or the
/// quantization's for the fused gated quantization.
pub fn row_program_op(name: &str) -> &'static ir_core::op::OpDef {
    match name {
        "layer_norm" => &ir_ops::layer_norm::LAYER_NORM,
        "rotary_neox" | "rotary_gptj" => &ir_ops::rotary_embedding::ROTARY_EMBEDDING,
        // The rotation is exact; the norm before it sums in another order.
        "rms_norm_rotary_neox" | "rms_norm_rotary_gptj" => &ir_ops::rms_norm::RMS_NORM,
        "silu_and_mul_dynamic_fp8_quant" => {
            &ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT
        }
        _ => ir_ops::BUILTIN_OPS.iter().copied().find(|def| def.name == name).expect("a built-in op"),
    }
}

/// Checks a generated kernel's outputs (`ours`, host or device tensors) against the reference
/// interpreter's within the program's op's tolerance (an fp8 code may land one step away, where
/// the f32 value before it differs in its last bit); panics naming the program, dtype, `what` (the
/// backend) and the output.
pub fn check_row_program_outputs(
    program: &ir_ops::row_program::RowProgram,
    dtype: ir_core::DType,
    ours: &[ir_core::Tensor],
    reference: &[ir_core::Tensor],
    what: &str,
) {
    assert_eq!(ours.len(), reference.len(), "{} {dtype} {what}: the outputs", program.name());
    let tolerance = ir_core::op::tolerance(row_program_op(program.name()), dtype).expect("a tolerance");
    for (index, (a, b)) in ours.iter().zip(reference).enumerate() {
        let rtol = if a.dtype().fp8_max().is_some() { 0.13 } else { tolerance.rtol };
        let a = a.to_cpu().expect("an output downloads");
        ir_core::allclose(&a, b, tolerance.atol, rtol)
            .unwrap_or_else(|error| panic!("{} {dtype} {what} output {index}: {error}", program.name()));
    }
}
