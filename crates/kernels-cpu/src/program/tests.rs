//! The executor against the cpu provider's hand-written kernels (the same bits where the program
//! fixes the order: every norm and quantization) and the reference interpreter (within the op's
//! tolerance where the cpu computes a wide step in f32: the gated activations).

use ir_core::op::OpDef;
use ir_core::testing::InputRng;
use ir_core::{DType, Tensor, UniqueTensor};
use ir_ops::Rounding;
use ir_ops::gelu_and_mul::Approximate;
use ir_ops::row_program::{BinaryOp, OutDType, Precision, ReduceOp, RowArg, RowProgram, builtin};

use super::run_row_program;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn unique(t: &Tensor) -> UniqueTensor {
    UniqueTensor::new(t.deep_clone().unwrap()).unwrap_or_else(|_| panic!("a fresh copy is uniquely owned"))
}

fn assert_bits(ours: &Tensor, theirs: &Tensor, what: &str) {
    assert_eq!((ours.dtype(), ours.shape()), (theirs.dtype(), theirs.shape()), "{what}");
    let (a, b) = (ours.to_f64_vec().unwrap(), theirs.to_f64_vec().unwrap());
    for (index, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{what}: element {index}: {x} != {y}");
    }
}

/// `[rows, width]` of N(0, scale) with a zero row, a NaN, an infinity and (f32) a row whose f32 sum
/// of squares overflows; with `strided`, a column slice of a wider buffer.
fn activation(rng: &mut InputRng, dtype: DType, rows: usize, width: usize, scale: f64, strided: bool) -> Tensor {
    let wide = if strided { width + 5 } else { width };
    let mut values = rng.normal(dtype, &[rows, wide], 0.0, scale).unwrap().to_f64_vec().unwrap();
    values[..wide].iter_mut().for_each(|v| *v = 0.0);
    values[wide + 2] = f64::NAN;
    values[2 * wide + 3] = f64::INFINITY;
    if dtype == DType::F32 {
        values[3 * wide..4 * wide].iter_mut().for_each(|v| *v = 1e19);
    }
    let t = Tensor::from_f64(dtype, &[rows, wide], &values).unwrap();
    if strided { t.narrow(1, 2, width).unwrap() } else { t }
}

#[test]
fn norm_programs_give_the_cpu_norms_bits() {
    let mut rng = InputRng::new(3);
    for dtype in DTYPES {
        // Rows of 97 values (a partial chunk: whole 32-element groups and a tail), and 300 rows of
        // 2100 (two whole chunks and a partial one), split across tasks.
        for (rows, width) in [(6, 97), (300, 2100)] {
            let x = activation(&mut rng, dtype, rows, width, 1.0, rows < 100);
            let r = activation(&mut rng, dtype, rows, width, 1.0, false);
            let w = rng.normal(dtype, &[width], 1.0, 0.1).unwrap();
            let what = format!("{dtype} {rows}x{width}");
            let theirs = [crate::rms_norm_cpu(&x, Some(&w), 1e-6, None).unwrap()];
            let ours = run_row_program(
                &builtin::rms_norm(true, false),
                &[RowArg::Tensor(&x), RowArg::Tensor(&w), RowArg::Scalar(1e-6)],
            )
            .unwrap();
            assert_bits(&ours[0], &theirs[0], &format!("rms_norm {what}"));
            let ours =
                run_row_program(&builtin::rms_norm(false, false), &[RowArg::Tensor(&x), RowArg::Scalar(1e-6)]).unwrap();
            let theirs = [crate::rms_norm_cpu(&x, None, 1e-6, None).unwrap()];
            assert_bits(&ours[0], &theirs[0], &format!("rms_norm without weight {what}"));
            for rounding in [Rounding::Exact, Rounding::Dtype] {
                let (out, residual) =
                    crate::fused_add_rms_norm_cpu(unique(&x), unique(&r), Some(&w), 1e-6, None, rounding).unwrap();
                let theirs = [out, residual];
                let program = builtin::fused_add_rms_norm(true, false, rounding);
                let ours = run_row_program(
                    &program,
                    &[RowArg::Tensor(&x), RowArg::Tensor(&r), RowArg::Tensor(&w), RowArg::Scalar(1e-6)],
                )
                .unwrap();
                assert_bits(&ours[0], &theirs[0], &format!("fused_add_rms_norm {rounding:?} {what}: out"));
                assert_bits(&ours[1], &theirs[1], &format!("fused_add_rms_norm {rounding:?} {what}: residual"));
            }
        }
    }
}

#[test]
fn quantization_programs_give_the_reference_bits() {
    // No sum and only f32 arithmetic: the executor's order is the reference's.
    let mut rng = InputRng::new(5);
    for dtype in DTYPES {
        let x = activation(&mut rng, dtype, 7, 150, 100.0, true);
        let scale = Tensor::from_f64(DType::F32, &[1], &[0.37]).unwrap();
        let bound = Tensor::from_f64(DType::F32, &[1], &[50.0]).unwrap();
        for out_dtype in [DType::F8E4M3FN, DType::F8E5M2] {
            for rounding in [Rounding::Exact, Rounding::Dtype] {
                let program = builtin::static_scaled_fp8_quant(out_dtype, rounding).unwrap();
                let args = [RowArg::Tensor(&x), RowArg::Tensor(&scale)];
                assert_bits(&run_row_program(&program, &args).unwrap()[0], &program.run(&args).unwrap()[0], "static");
            }
            for ub in [None, Some(&bound)] {
                let program = builtin::dynamic_per_token_scaled_fp8_quant(out_dtype, ub.is_some()).unwrap();
                let mut args = vec![RowArg::Tensor(&x)];
                args.extend(ub.map(RowArg::Tensor));
                let (ours, reference) = (run_row_program(&program, &args).unwrap(), program.run(&args).unwrap());
                assert_bits(&ours[0], &reference[0], &format!("dynamic {dtype} {out_dtype} {ub:?}: q"));
                assert_bits(&ours[1], &reference[1], &format!("dynamic {dtype} {out_dtype} {ub:?}: scales"));
            }
        }
    }
}

#[test]
fn norm_quantization_programs_give_the_cpu_kernels_bits() {
    let mut rng = InputRng::new(9);
    for dtype in DTYPES {
        let x = activation(&mut rng, dtype, 6, 160, 1.0, false);
        let r = activation(&mut rng, dtype, 6, 160, 1.0, true);
        let w = rng.normal(dtype, &[160], 1.0, 0.1).unwrap();
        let scale = Tensor::from_f64(DType::F32, &[1], &[0.01]).unwrap();
        for rounding in [Rounding::Exact, Rounding::Dtype] {
            let what = format!("{dtype} {rounding:?}");
            let fp8 = DType::F8E4M3FN;
            let theirs =
                [crate::quant::rms_norm_static_fp8_quant_cpu(&x, Some(&w), 1e-6, &scale, fp8, rounding).unwrap()];
            let program = builtin::norm_static_fp8_quant(false, true, DType::F8E4M3FN, rounding).unwrap();
            let ours = run_row_program(
                &program,
                &[RowArg::Tensor(&x), RowArg::Tensor(&w), RowArg::Scalar(1e-6), RowArg::Tensor(&scale)],
            )
            .unwrap();
            assert_bits(&ours[0], &theirs[0], &format!("rms_norm_static {what}"));

            let (residual, q, scales) = crate::quant::fused_add_rms_norm_dynamic_per_token_quant_cpu(
                &x,
                unique(&r),
                Some(&w),
                1e-6,
                None,
                fp8,
                rounding,
            )
            .unwrap();
            let theirs = [residual, q, scales];
            let program = builtin::norm_dynamic_per_token_quant(true, true, false, DType::F8E4M3FN, rounding).unwrap();
            let ours = run_row_program(
                &program,
                &[RowArg::Tensor(&x), RowArg::Tensor(&r), RowArg::Tensor(&w), RowArg::Scalar(1e-6)],
            )
            .unwrap();
            for (index, name) in ["residual", "q", "scales"].into_iter().enumerate() {
                assert_bits(&ours[index], &theirs[index], &format!("fused_add_dynamic {what}: {name}"));
            }
        }
    }
}

#[test]
fn gated_programs_are_within_the_ops_tolerance_of_the_reference() {
    let mut rng = InputRng::new(15);
    for dtype in DTYPES {
        let x = rng.normal(dtype, &[5, 2 * 200], 0.0, 2.0).unwrap();
        let cases: Vec<(&'static OpDef, RowProgram, Vec<RowArg<'_>>)> = vec![
            (&ir_ops::silu_and_mul::SILU_AND_MUL, builtin::silu_and_mul(), vec![RowArg::Tensor(&x)]),
            (&ir_ops::gelu_and_mul::GELU_AND_MUL, builtin::gelu_and_mul(Approximate::None), vec![RowArg::Tensor(&x)]),
            (&ir_ops::gelu_and_mul::GELU_AND_MUL, builtin::gelu_and_mul(Approximate::Tanh), vec![RowArg::Tensor(&x)]),
            (
                &ir_ops::gelu_and_mul_sparse::GELU_AND_MUL_SPARSE,
                builtin::gelu_and_mul_sparse(Approximate::Tanh),
                vec![RowArg::Tensor(&x), RowArg::Scalar(0.5)],
            ),
        ];
        for (op, program, args) in cases {
            let tolerance = ir_core::op::tolerance(op, dtype).unwrap();
            let (ours, reference) = (run_row_program(&program, &args).unwrap(), program.run(&args).unwrap());
            ir_core::allclose(&ours[0], &reference[0], tolerance.atol, tolerance.rtol)
                .unwrap_or_else(|error| panic!("{} {dtype}: {error}", program.name()));
        }
    }
}

#[test]
fn reductions_over_a_counted_prefix_and_row_outputs_follow_the_reference() {
    // rms_norm over the first V columns: the sums in the cpu's order, so within f32 rounding.
    let mut rng = InputRng::new(21);
    let x = rng.normal(DType::F32, &[4, 300], 0.0, 1.0).unwrap();
    let program = builtin::rms_norm(false, true);
    for variance in [1.0, 31.0, 32.0, 33.0, 129.0, 300.0] {
        let args = [RowArg::Tensor(&x), RowArg::Scalar(1e-6), RowArg::Scalar(variance)];
        ir_core::allclose(&run_row_program(&program, &args).unwrap()[0], &program.run(&args).unwrap()[0], 1e-6, 1e-5)
            .unwrap_or_else(|error| panic!("variance {variance}: {error}"));
    }
    let error = run_row_program(&program, &[RowArg::Tensor(&x), RowArg::Scalar(1e-6), RowArg::Scalar(301.0)])
        .unwrap_err()
        .to_string();
    assert!(error.contains("reduction count 301 is not an integer in 1..=300"), "{error}");
}

#[test]
fn a_program_whose_reduction_needs_a_later_count_runs_in_order() {
    // The count itself comes from a reduction: the second sum waits for it (three passes).
    let mut b = RowProgram::builder("counted");
    let x = b.activation("x", 1);
    let v = b.load(x, 0);
    let max = b.reduce(ReduceOp::MaxAbs, v, None, Precision::Wide);
    let sum = b.reduce(ReduceOp::Sum, v, Some(max), Precision::Wide);
    let y = b.binary(BinaryOp::Sub, v, sum, Precision::Compute);
    b.store("y", y, OutDType::Like(x), None);
    b.store("sum", sum, OutDType::Fixed(DType::F32), None);
    let program = b.build().unwrap();
    let x = Tensor::from_f64(DType::F32, &[2, 4], &[1.0, 2.0, 3.0, 0.5, 4.0, 1.0, 1.0, 1.0]).unwrap();
    let ours = run_row_program(&program, &[RowArg::Tensor(&x)]).unwrap();
    assert_eq!(ours[1].to_f64_vec().unwrap(), [6.0, 7.0]);
    assert_eq!(ours[0].to_f64_vec().unwrap(), [-5.0, -4.0, -3.0, -5.5, -3.0, -6.0, -6.0, -6.0]);
}

#[test]
fn what_the_cpu_cannot_run_is_refused_with_the_reason() {
    let x = Tensor::zeros(DType::F64, &[2, 8]).unwrap();
    let error = run_row_program(&builtin::silu_and_mul(), &[RowArg::Tensor(&x)]).unwrap_err().to_string();
    assert!(error.contains("reference interpreter"), "{error}");
    let x = Tensor::zeros(DType::F32, &[2, 7]).unwrap();
    let error = run_row_program(&builtin::silu_and_mul(), &[RowArg::Tensor(&x)]).unwrap_err().to_string();
    assert!(error.contains("argument `x`: last dimension 7 is not 2 blocks"), "{error}");
}

#[test]
fn empty_rows_and_zero_rows_give_empty_outputs() {
    let program = builtin::dynamic_per_token_scaled_fp8_quant(DType::F8E4M3FN, false).unwrap();
    let x = Tensor::zeros(DType::F32, &[0, 16]).unwrap();
    let out = run_row_program(&program, &[RowArg::Tensor(&x)]).unwrap();
    assert_eq!((out[0].shape(), out[1].shape()), (&[0, 16][..], &[0, 1][..]));
    let x = Tensor::zeros(DType::F32, &[3, 0]).unwrap();
    let (ours, reference) =
        (run_row_program(&program, &[RowArg::Tensor(&x)]).unwrap(), program.run(&[RowArg::Tensor(&x)]).unwrap());
    assert_eq!(ours[1].to_f64_vec().unwrap(), reference[1].to_f64_vec().unwrap(), "the scales of empty rows");
    assert_eq!(ours[0].shape(), [3, 0]);
}

#[test]
fn exact_elementwise_steps_give_the_reference_bits() {
    // Compute and dtype roundings of +, ×, ÷, √, |x|, −x, relu, min and max (signed zeros
    // included: −0 below +0): one f32 operation each, the reference's bits.
    use ir_ops::row_program::UnaryOp;
    let mut b = RowProgram::builder("exact");
    let xi = b.activation("x", 2);
    let si = b.scalar("s");
    let (g, u) = (b.load(xi, 0), b.load(xi, 1));
    let s = b.param(si, Precision::Compute);
    let t = b.binary(BinaryOp::Mul, g, s, Precision::Like(xi));
    let t = b.binary(BinaryOp::Add, t, u, Precision::Compute);
    let t = b.binary(BinaryOp::Div, t, s, Precision::Like(xi));
    let a = b.unary(UnaryOp::Abs, t, Precision::Compute);
    let r = b.unary(UnaryOp::Sqrt, a, Precision::Like(xi));
    let m = b.binary(BinaryOp::Max, r, g, Precision::Compute);
    let n = b.unary(UnaryOp::Neg, m, Precision::Compute);
    let y = b.unary(UnaryOp::Relu, n, Precision::Compute);
    let z = b.binary(BinaryOp::Min, y, u, Precision::Like(xi));
    b.store("t", t, OutDType::Fixed(DType::F32), None);
    b.store("z", z, OutDType::Like(xi), None);
    let program = b.build().unwrap();
    let mut rng = InputRng::new(33);
    for dtype in DTYPES {
        let x = activation(&mut rng, dtype, 5, 2 * 150, 3.0, false);
        let args = [RowArg::Tensor(&x), RowArg::Scalar(0.3)];
        let (ours, reference) = (run_row_program(&program, &args).unwrap(), program.run(&args).unwrap());
        for (index, (a, b)) in ours.iter().zip(&reference).enumerate() {
            assert_bits(a, b, &format!("{dtype} output {index}"));
        }
    }
}

#[test]
fn layer_norm_runs_its_program_on_the_cpu_provider() {
    // The op's native is its program on the reference interpreter; the cpu provider runs the same
    // program here: within the op's tolerance, and chosen on the cpu platform.
    use ir_core::op::ArgMeta;
    use ir_core::{Platform, PriorityConfig};
    let registry = ir_ops::registry();
    crate::register(&registry).unwrap();
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).unwrap();
    let mut rng = InputRng::new(41);
    for dtype in DTYPES {
        let x = activation(&mut rng, dtype, 6, 200, 2.0, true);
        let w = rng.normal(dtype, &[200], 1.0, 0.1).unwrap();
        let b = rng.normal(dtype, &[200], 0.0, 0.1).unwrap();
        let metas =
            [ArgMeta::Tensor(x.meta()), ArgMeta::Tensor(w.meta()), ArgMeta::Tensor(b.meta()), ArgMeta::F64(1e-5)];
        assert_eq!(registry.select("layer_norm", &metas).unwrap().provider, crate::PROVIDER, "{dtype}");
        // Every layout the op accepts: a column slice, and a transposed view (its last dimension
        // strided), whose output is compact as the op declares.
        let transposed = rng.normal(dtype, &[200, 6], 0.5, 1.0).unwrap().transpose(0, 1).unwrap();
        for x in [&x, &transposed] {
            for (weight, bias) in [(Some(&w), Some(&b)), (None, None), (Some(&w), None)] {
                let ours = ir_ops::layer_norm::layer_norm(&registry, x, weight, bias, 1e-5).unwrap();
                let native = ir_ops::layer_norm::native(x, weight, bias, 1e-5).unwrap();
                assert_eq!(ours.meta(), native.meta(), "{dtype}: the declared metadata");
                let tolerance = ir_core::op::tolerance(&ir_ops::layer_norm::LAYER_NORM, dtype).unwrap();
                ir_core::allclose(&ours, &native, tolerance.atol, tolerance.rtol).unwrap_or_else(|error| {
                    panic!("{dtype} {:?} weight {} bias {}: {error}", x.strides(), weight.is_some(), bias.is_some())
                });
            }
        }
    }
}

#[test]
fn a_fused_gated_quantization_computes_its_activation_once_with_the_unfused_bits() {
    // The activation (an exp) is kept by the absmax pass and read back by the codes pass; the
    // loads and the activation are not computed again there. A norm keeps nothing: its loads are
    // cheaper to repeat than to keep.
    for approximate in [None, Some(Approximate::Tanh)] {
        let fused = match approximate {
            None => builtin::silu_and_mul_dynamic_fp8_quant(DType::F8E4M3FN, true).unwrap(),
            Some(_) => {
                let mut b = RowProgram::builder("gelu_tanh_quant");
                let x = b.activation("x", 2);
                let g = b.load(x, 0);
                let t = b.unary(ir_ops::row_program::UnaryOp::Tanh, g, Precision::Compute);
                let gated = b.binary(BinaryOp::Mul, t, g, Precision::Like(x));
                let m = b.reduce(ReduceOp::MaxAbs, gated, None, Precision::Compute);
                let q = b.binary(BinaryOp::Div, gated, m, Precision::Compute);
                b.store("q", q, OutDType::Like(x), None);
                b.build().unwrap()
            }
        };
        let reuse = super::Reuse::plan(&fused, &fused.schedule());
        assert_eq!(reuse.slots, 1, "{}: one kept row", fused.name());
        let last = reuse.actions.last().unwrap();
        assert_eq!(last.iter().filter(|(_, recall)| *recall).count(), 1, "{}: {reuse:?}", fused.name());
        let steps = fused.steps();
        for &(index, recall) in last {
            if !recall {
                assert!(
                    !matches!(
                        steps[index].op,
                        ir_ops::row_program::Op::Load { .. } | ir_ops::row_program::Op::Unary(..)
                    ),
                    "{}: the codes pass computes %{index} again: {reuse:?}",
                    fused.name()
                );
            }
        }
    }
    let norm = builtin::rms_norm(true, false);
    assert_eq!(super::Reuse::plan(&norm, &norm.schedule()).slots, 0);

    let mut rng = InputRng::new(77);
    let bound = Tensor::from_f64(DType::F32, &[1], &[3.0]).unwrap();
    let fused = builtin::silu_and_mul_dynamic_fp8_quant(DType::F8E4M3FN, true).unwrap();
    let silu = builtin::silu_and_mul();
    let quant = builtin::dynamic_per_token_scaled_fp8_quant(DType::F8E4M3FN, true).unwrap();
    for dtype in DTYPES {
        // 3 chunks and a tail per row, and a column slice.
        let x = activation(&mut rng, dtype, 5, 2 * 700, 3.0, true);
        let ours = run_row_program(&fused, &[RowArg::Tensor(&x), RowArg::Tensor(&bound)]).unwrap();
        let gated = run_row_program(&silu, &[RowArg::Tensor(&x)]).unwrap().pop().unwrap();
        let pair = run_row_program(&quant, &[RowArg::Tensor(&gated), RowArg::Tensor(&bound)]).unwrap();
        for (index, (a, b)) in ours.iter().zip(&pair).enumerate() {
            assert_bits(a, b, &format!("{dtype} output {index}"));
        }
    }
}

/// A uniquely owned copy of `t` with `t`'s layout (a column slice stays a slice of a wider buffer).
fn unique_same_layout(t: &Tensor) -> UniqueTensor {
    UniqueTensor::new(t.deep_clone_same_layout().unwrap()).unwrap_or_else(|_| panic!("a fresh copy is uniquely owned"))
}

/// Every program that writes in place, run in place on donated activations (column slices of wider
/// buffers, and rows split across tasks): the values written are the functional run's, bit for
/// bit, and the storage outside the views is untouched.
#[test]
fn in_place_runs_write_the_functional_runs_bits_into_the_donated_rows() {
    use super::run_row_program_in_place;
    use ir_ops::row_program::InPlaceArg;
    use kernel_support::testing::{SampleArg, row_program_sample};
    let mut rng = InputRng::new(43);
    let programs: Vec<RowProgram> = builtin::all().into_iter().filter(RowProgram::is_inplace).collect();
    assert!(programs.len() >= 8, "the fused-add norms, their quantizations, add + layer_norm, sandwich");
    for program in &programs {
        for dtype in DTYPES {
            for (rows, width, strided) in [(6, 97, true), (300, 2100, false)] {
                let what = format!("{} {dtype} {rows}x{width}", program.name());
                let mut samples = row_program_sample(program, dtype, rows, width);
                // Activations with the awkward rows (a NaN, an infinity, an f32 sum that overflows).
                for (sample, input) in samples.iter_mut().zip(program.inputs()) {
                    if matches!(input.kind, ir_ops::row_program::InputKind::Activation { .. }) {
                        *sample = SampleArg::Tensor(activation(&mut rng, dtype, rows, width, 1.0, strided));
                    }
                }
                let row_args: Vec<RowArg<'_>> = samples
                    .iter()
                    .map(|s| match s {
                        SampleArg::Tensor(t) => RowArg::Tensor(t),
                        SampleArg::Scalar(v) => RowArg::Scalar(*v),
                    })
                    .collect();
                let functional = run_row_program(program, &row_args).unwrap();
                let mut donated: Vec<(usize, UniqueTensor, Vec<u8>)> = program
                    .outputs()
                    .iter()
                    .filter_map(|o| o.in_place_of)
                    .map(|input| {
                        let SampleArg::Tensor(t) = &samples[input] else { unreachable!("activations are tensors") };
                        let unique = unique_same_layout(t);
                        let before = unique.tensor().cpu_buffer().unwrap().bytes().to_vec();
                        (input, unique, before)
                    })
                    .collect();
                let fresh = {
                    let mut owned: Vec<Option<&mut UniqueTensor>> = (0..row_args.len()).map(|_| None).collect();
                    for (input, unique, _) in donated.iter_mut() {
                        owned[*input] = Some(unique);
                    }
                    let mut args: Vec<InPlaceArg<'_>> = row_args
                        .iter()
                        .zip(owned)
                        .map(|(arg, owned)| match owned {
                            Some(unique) => InPlaceArg::Donated(unique),
                            None => InPlaceArg::Read(*arg),
                        })
                        .collect();
                    run_row_program_in_place(program, &mut args).unwrap_or_else(|e| panic!("{what}: {e}"))
                };
                for (index, (output, fresh)) in program.outputs().iter().zip(&fresh).enumerate() {
                    let what = format!("{what}: output `{}`", output.name);
                    match (output.in_place_of, fresh) {
                        (Some(input), None) => {
                            let (_, unique, before) = donated.iter().find(|d| d.0 == input).unwrap();
                            let written = unique.tensor();
                            assert_bits(written, &functional[index], &what);
                            // Outside the view (the other columns of the wider buffer): untouched.
                            let size = dtype.size_in_bytes();
                            let mut inside = vec![false; before.len() / size];
                            for element in written.layout().storage_indices() {
                                inside[element] = true;
                            }
                            let after = written.cpu_buffer().unwrap().bytes();
                            for (element, inside) in inside.iter().enumerate() {
                                let bytes = element * size..(element + 1) * size;
                                assert!(*inside || after[bytes.clone()] == before[bytes], "{what}: element {element}");
                            }
                        }
                        (None, Some(tensor)) => assert_bits(tensor, &functional[index], &what),
                        other => panic!("{what}: in place of {:?}, fresh {}", other.0, other.1.is_some()),
                    }
                }
            }
        }
    }
}

#[test]
fn what_cannot_run_in_place_is_refused_with_the_reason() {
    use super::run_row_program_in_place;
    use ir_ops::row_program::InPlaceArg;
    let x = Tensor::from_f64(DType::F32, &[2, 4], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).unwrap();
    // A donated argument the program writes nothing into.
    let mut donated = unique(&x);
    let mut args = [InPlaceArg::Donated(&mut donated), InPlaceArg::Read(RowArg::Scalar(1e-6))];
    let error = run_row_program_in_place(&builtin::rms_norm(false, false), &mut args).unwrap_err().to_string();
    assert!(error.contains("`x` is donated but no output is written in place of it"), "{error}");
    // A program whose last pass finishes a sum (a row output): a row would be run again after its
    // writes when its sum overflows.
    let mut b = RowProgram::builder("doubled_with_total");
    let input = b.activation("x", 1);
    let v = b.load(input, 0);
    let two = b.constant(2.0);
    let doubled = b.binary(BinaryOp::Mul, v, two, Precision::Compute);
    let total = b.reduce(ReduceOp::Sum, v, None, Precision::Wide);
    b.store("x_out", doubled, OutDType::Like(input), Some(input));
    b.store("total", total, OutDType::Fixed(DType::F32), None);
    let program = b.build().unwrap();
    let mut donated = unique(&x);
    let error = run_row_program_in_place(&program, &mut [InPlaceArg::Donated(&mut donated)]).unwrap_err().to_string();
    assert!(error.contains("cannot run in place") && error.contains("finishes a sum"), "{error}");
    assert_eq!(donated.tensor().to_f64_vec().unwrap(), x.to_f64_vec().unwrap(), "nothing written");
    // The functional run of the same program is fine.
    let out = run_row_program(&program, &[RowArg::Tensor(&x)]).unwrap();
    assert_eq!(out[1].to_f64_vec().unwrap(), [10.0, 26.0]);
}

/// The cpu provider's `silu_and_mul` then `dynamic_per_token_scaled_fp8_quant` (its hand-written
/// kernels), its `silu_and_mul_dynamic_fp8_quant` (the two rows composed) and the op's program on
/// the interpreter give the same codes and scales, bit for bit: all compute silu as
/// `g / (1 + exp(-g))` in f32 with the same vectorized `exp`, round the gated value to x's dtype,
/// and take the same per-row absmax. The
/// exact form of `fuse-row-programs` fuses the pair on the cpu on this ground; this test is its
/// guard (every dtype, widths with and without full vectors and chunks, both fp8 formats, with and
/// without a bound, rows of zeros, NaN, infinity and values beyond the fp8 range).
#[test]
fn the_cpu_silu_and_quantization_pair_gives_its_fused_ops_bits() {
    use ir_core::EagerContext;
    use ir_ops::{dynamic_per_token_scaled_fp8_quant, silu_and_mul, silu_and_mul_dynamic_fp8_quant};

    let registry = ir_ops::registry();
    crate::register(&registry).unwrap();
    let ops = ["silu_and_mul", "dynamic_per_token_scaled_fp8_quant", "silu_and_mul_dynamic_fp8_quant"];
    let _guards: Vec<_> =
        ops.iter().map(|op| registry.override_priority(op, &[crate::PROVIDER, "native"]).unwrap()).collect();
    let ctx = EagerContext::new(&registry);
    let mut rng = InputRng::new(91);
    let bound = Tensor::from_f64(DType::F32, &[1], &[0.5]).unwrap();
    for dtype in DTYPES {
        for width in [1, 7, 32, 33, 100, 1000, 4099] {
            for scale in [0.01, 1.0, 30.0, 3000.0] {
                let x = activation(&mut rng, dtype, 5, 2 * width, scale, width % 2 == 1);
                for out_dtype in [DType::F8E4M3FN, DType::F8E5M2] {
                    for ub in [None, Some(&bound)] {
                        let what = format!("{dtype} width {width} scale {scale} {out_dtype} bound {}", ub.is_some());
                        let before = registry.selection_record();
                        let gated = silu_and_mul::call(&ctx, &x).unwrap();
                        let pair = dynamic_per_token_scaled_fp8_quant::call(&ctx, &gated, ub, out_dtype).unwrap();
                        let fused = silu_and_mul_dynamic_fp8_quant::call(&ctx, &x, ub, out_dtype).unwrap();
                        let step = registry.selection_record().since(&before);
                        for op in ops {
                            assert_eq!(step.selections(op, crate::PROVIDER), 1, "{what}: {op} on the cpu");
                        }
                        assert_bits(&fused.0, &pair.0, &format!("{what}: codes"));
                        assert_bits(&fused.1, &pair.1, &format!("{what}: scales"));
                        // The program on the interpreter (what other layouts run): the same bits.
                        let program = silu_and_mul_dynamic_fp8_quant::program(out_dtype, ub.is_some()).unwrap();
                        let args = silu_and_mul_dynamic_fp8_quant::program_args(&x, ub);
                        let interpreted = run_row_program(program, &args).unwrap();
                        assert_bits(&interpreted[0], &pair.0, &format!("{what}: the program's codes"));
                        assert_bits(&interpreted[1], &pair.1, &format!("{what}: the program's scales"));
                    }
                }
            }
        }
    }
}

/// The cpu `fused_sandwich_rms_norm` (the norm rows composed) gives its program's bits and the cpu
/// pair's (`rms_norm`, then `fused_add_rms_norm` of its output): every dtype, both roundings, each
/// weight present or absent, Gemma's f32 weights on 16-bit rows, strided rows, rows split across
/// threads, and the awkward rows (a NaN, an infinity, an f32 sum of squares that overflows).
#[test]
fn the_composed_sandwich_kernel_gives_the_program_and_the_pairs_bits() {
    let mut rng = InputRng::new(59);
    for dtype in DTYPES {
        for (rows, width, strided) in [(5, 97, true), (300, 2100, false)] {
            let x = activation(&mut rng, dtype, rows, width, 4.0, strided);
            let r = activation(&mut rng, dtype, rows, width, 1.0, !strided);
            for weight_dtype in [dtype, DType::F32] {
                let post = rng.normal(weight_dtype, &[width], 1.0, 0.1).unwrap();
                let pre = rng.normal(weight_dtype, &[width], 1.0, 0.1).unwrap();
                for rounding in [Rounding::Exact, Rounding::Dtype] {
                    for (p, q) in [(Some(&post), Some(&pre)), (None, Some(&pre)), (Some(&post), None)] {
                        let what = format!(
                            "{dtype} {rows}x{width} weights {weight_dtype} {rounding:?} post {} pre {}",
                            p.is_some(),
                            q.is_some()
                        );
                        let (out, sum) =
                            crate::fused_sandwich_rms_norm_cpu(unique(&x), unique(&r), p, q, 1e-6, rounding).unwrap();
                        let program = ir_ops::fused_sandwich_rms_norm::program(p.is_some(), q.is_some(), rounding);
                        let mut args = vec![RowArg::Tensor(&x), RowArg::Tensor(&r)];
                        args.extend(p.map(RowArg::Tensor));
                        args.extend(q.map(RowArg::Tensor));
                        args.push(RowArg::Scalar(1e-6));
                        let expected = run_row_program(program, &args).unwrap();
                        assert_bits(&out, &expected[0], &format!("{what}: out against the program"));
                        assert_bits(&sum, &expected[1], &format!("{what}: residual against the program"));
                        let h = crate::rms_norm_cpu(&x, p, 1e-6, None).unwrap();
                        let (pair_out, pair_sum) =
                            crate::fused_add_rms_norm_cpu(unique(&h), unique(&r), q, 1e-6, None, rounding).unwrap();
                        assert_bits(&out, &pair_out, &format!("{what}: out against the pair"));
                        assert_bits(&sum, &pair_sum, &format!("{what}: residual against the pair"));
                    }
                }
            }
        }
    }
}

/// Rotations on the cpu: the reference's bits (a rotation is exact per element), in both styles
/// and roundings, rows of one chunk and rows wider than a chunk (the row runs as one), split across
/// tasks; Qwen3's head norm + rotation gives the cpu `rms_norm`'s bits rotated; a position outside
/// the cache is refused naming it.
#[test]
fn rotations_give_the_reference_bits_and_the_head_norm_the_cpu_norms() {
    let mut rng = InputRng::new(47);
    for dtype in DTYPES {
        for (tokens, heads, width, rotated) in [(4, 3, 96, 64), (5, 2, 128, 128), (70, 8, 2100, 2048)] {
            let positions: Vec<i64> = (0..tokens as i64).map(|t| (t * 5 + 2) % 9).collect();
            let positions = Tensor::from_slice(&[tokens], &positions).unwrap();
            let x = activation(&mut rng, dtype, tokens * heads, width, 1.0, false);
            let x = x.reshape(&[tokens, heads, width]).unwrap();
            let cache = rng.normal(dtype, &[9, rotated], 0.0, 1.0).unwrap();
            let w = rng.normal(dtype, &[width], 1.0, 0.1).unwrap();
            for (neox, rounding) in [(true, Rounding::Exact), (false, Rounding::Dtype), (true, Rounding::Dtype)] {
                let what = format!("{dtype} {tokens}x{heads}x{width}/{rotated} neox {neox} {rounding:?}");
                let program = builtin::rotary(neox, rounding);
                let args = [RowArg::Tensor(&positions), RowArg::Tensor(&x), RowArg::Tensor(&cache)];
                let reference = program.run(&args).unwrap();
                assert_bits(&run_row_program(&program, &args).unwrap()[0], &reference[0], &format!("rotary {what}"));

                let normed = crate::rms_norm_cpu(&x, Some(&w), 1e-6, None).unwrap();
                let normed_args = [RowArg::Tensor(&positions), RowArg::Tensor(&normed), RowArg::Tensor(&cache)];
                let theirs = program.run(&normed_args).unwrap();
                let program = builtin::rms_norm_rotary(neox, rounding);
                let args = [
                    RowArg::Tensor(&positions),
                    RowArg::Tensor(&x),
                    RowArg::Tensor(&w),
                    RowArg::Tensor(&cache),
                    RowArg::Scalar(1e-6),
                ];
                assert_bits(
                    &run_row_program(&program, &args).unwrap()[0],
                    &theirs[0],
                    &format!("norm + rotary {what}"),
                );
            }
        }
    }
    let x = Tensor::zeros(DType::F32, &[2, 2, 8]).unwrap();
    let cache = Tensor::zeros(DType::F32, &[3, 8]).unwrap();
    let positions = Tensor::from_slice::<i64>(&[2], &[0, 3]).unwrap();
    let args = [RowArg::Tensor(&positions), RowArg::Tensor(&x), RowArg::Tensor(&cache)];
    let error = run_row_program(&builtin::rotary(true, Rounding::Exact), &args).unwrap_err().to_string();
    assert!(error.contains("position 3 of row group 1 is outside the cos/sin cache `cos_sin_cache` (0..3)"), "{error}");
}
