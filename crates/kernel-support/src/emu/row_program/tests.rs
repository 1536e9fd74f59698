//! The generated CUDA/HIP source of the built-in programs, run on the emulated GPU against the
//! reference interpreter (within each op's tolerance: the kernel sums per thread and by a tree, and
//! computes wide steps in f32).

use ir_core::{DType, Tensor};
use ir_ops::row_program::{BinaryOp, OutDType, Precision, ReduceOp, RowArg, RowProgram, builtin};

use super::run_row_program as run_emulated;
use crate::emu::Dialect;
use crate::emu::tests::compiler_at_hand;
use crate::program::{RowShape, gpu_source};
use crate::testing::{SampleArg, check_row_program_outputs, row_program_activation as activation, row_program_sample};

/// Runs `program` on the emulated GPU and compares every output with the interpreter's.
fn check(program: &RowProgram, args: &[RowArg<'_>], dialect: Dialect, dtype: DType) {
    let reference = program.run(args).unwrap();
    for scalar in [false, true] {
        let ours = run_emulated(program, args, dialect, scalar)
            .unwrap_or_else(|e| panic!("{} {dtype} (scalar {scalar}): {e}", program.name()));
        check_row_program_outputs(program, dtype, &ours, &reference, &format!("{dialect:?} (scalar {scalar})"));
    }
}

#[test]
fn every_built_in_program_runs_as_generated_gpu_source() {
    if !compiler_at_hand() {
        return;
    }
    // Every program in bf16 as NVRTC gets it; in f32 and f16 as hipcc does; rows of 300, which
    // split into no whole chunks, and of 512 in bf16 and f32, which do (16-byte accesses where
    // the buffers are aligned, as the launch records show).
    for (dtype, dialect) in [(DType::BF16, Dialect::Cuda), (DType::F32, Dialect::Hip), (DType::F16, Dialect::Hip)] {
        for width in [300, 512] {
            if width == 512 && dtype == DType::F16 {
                continue;
            }
            for program in builtin::all() {
                let mut samples = row_program_sample(&program, dtype, 5, width);
                if width == 512 {
                    // Compact rows (the sample's first activation is padded).
                    for sample in &mut samples {
                        if let SampleArg::Tensor(tensor) = sample {
                            *tensor = tensor.contiguous().unwrap();
                        }
                    }
                }
                let args: Vec<RowArg<'_>> = samples.iter().map(SampleArg::arg).collect();
                crate::emu::take_launches();
                check(&program, &args, dialect, dtype);
                let launches = crate::emu::take_launches();
                let whole = launches.iter().filter(|l| l.defines.contains("RP_VEC=1")).count();
                let rotary = program.rotary_cache().is_some();
                // The 16-byte kernel then the scalar one, or two walks for a rotary program.
                let expected = if width == 512 && !rotary { 1 } else { 0 };
                assert_eq!(whole, expected, "{} {dtype} width {width}: {launches:?}", program.name());
            }
        }
    }
}

#[test]
fn what_the_generator_cannot_express_is_refused_with_the_reason() {
    let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
    let mut b = RowProgram::builder("fp8_step");
    let xi = b.activation("x", 1);
    let v = b.load(xi, 0);
    let q = b.round(v, Precision::Dtype(DType::F8E4M3FN));
    b.store("q", q, OutDType::Like(xi), None);
    let program = b.build().unwrap();
    let binding = program.bind(&[RowArg::Tensor(&x)]).unwrap();
    let error = gpu_source(&program, &binding, RowShape::for_call(&program, &binding, false)).unwrap_err().to_string();
    assert!(error.contains("a step rounds to f8e4m3fn, which only a store may"), "{error}");

    let mut b = RowProgram::builder("counted");
    let xi = b.activation("x", 1);
    let v = b.load(xi, 0);
    let m = b.reduce(ReduceOp::MaxAbs, v, None, Precision::Wide);
    let s = b.reduce(ReduceOp::Sum, v, Some(m), Precision::Wide);
    let y = b.binary(BinaryOp::Mul, v, s, Precision::Compute);
    b.store("y", y, OutDType::Like(xi), None);
    let program = b.build().unwrap();
    let error = gpu_source(&program, &binding, RowShape::for_call(&program, &binding, false)).unwrap_err().to_string();
    assert!(error.contains("%2 is counted by %1, not a scalar parameter"), "{error}");

    if compiler_at_hand() {
        let program = builtin::rms_norm(false, true);
        let args = [RowArg::Tensor(&x), RowArg::Scalar(1e-6), RowArg::Scalar(9.0)];
        let error = run_emulated(&program, &args, Dialect::Cuda, false).unwrap_err().to_string();
        assert!(error.contains("reduction count 9 is not an integer in 1..=8"), "{error}");
    }
}

#[test]
fn exact_steps_give_the_reference_bits() {
    // Without a reduction or a wide step, every value is one correctly rounded operation in the
    // compute type, rounded where the program says: the reference's bits, rounding points included.
    if !compiler_at_hand() {
        return;
    }
    let mut b = RowProgram::builder("exact");
    let xi = b.activation("x", 2);
    let wi = b.weight("w");
    let si = b.scalar("s");
    let (g, u, w) = (b.load(xi, 0), b.load(xi, 1), b.load_weight(wi));
    let s = b.param(si, Precision::Compute);
    let t = b.binary(BinaryOp::Mul, g, s, Precision::Like(xi));
    let t = b.binary(BinaryOp::Add, t, u, Precision::Compute);
    let t = b.binary(BinaryOp::Div, t, w, Precision::Like(wi));
    let a = b.unary(ir_ops::row_program::UnaryOp::Abs, t, Precision::Compute);
    let r = b.unary(ir_ops::row_program::UnaryOp::Sqrt, a, Precision::Like(xi));
    let m = b.binary(BinaryOp::Max, r, g, Precision::Compute);
    let n = b.unary(ir_ops::row_program::UnaryOp::Neg, m, Precision::Compute);
    let y = b.unary(ir_ops::row_program::UnaryOp::Relu, n, Precision::Compute);
    let z = b.binary(BinaryOp::Min, y, u, Precision::Like(xi));
    b.store("y", t, OutDType::Fixed(DType::F32), None);
    b.store("z", z, OutDType::Like(xi), None);
    let program = b.build().unwrap();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let x = activation(dtype, 4, 2 * 70, 3.0, 7, false);
        let w: Vec<f64> = (0..70).map(|i| 0.5 + (i as f64 * 0.37).sin().abs()).collect();
        let w = Tensor::from_f64(dtype, &[70], &w).unwrap();
        let args = [RowArg::Tensor(&x), RowArg::Tensor(&w), RowArg::Scalar(0.3)];
        for dialect in [Dialect::Cuda, Dialect::Hip] {
            let ours = run_emulated(&program, &args, dialect, false).unwrap();
            let reference = program.run(&args).unwrap();
            for (output, (a, b)) in ours.iter().zip(&reference).enumerate() {
                let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
                for (index, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                        "{dtype} {dialect:?} output {output} element {index}: {x} != {y}"
                    );
                }
            }
        }
    }
}

/// Equal bits element by element (any NaN equals any NaN).
fn assert_bits(ours: &Tensor, reference: &Tensor, what: &str) {
    let (a, b) = (ours.to_f64_vec().unwrap(), reference.to_f64_vec().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    for (index, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{what}: element {index}: {x} != {y}");
    }
}

#[test]
fn rotations_give_the_reference_bits_and_leave_rows_at_unknown_positions_unrotated() {
    // A rotation is exact per element (no reduction): the generated pair walk gives the reference's
    // bits, in both styles, both roundings, a partial and a full rotated width, with infinities and
    // NaNs in the rotated and the passed-through columns.
    if !compiler_at_hand() {
        return;
    }
    let (tokens, heads) = (3, 4);
    let positions = Tensor::from_slice::<i64>(&[tokens], &[2, 0, 5]).unwrap();
    for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64] {
        for (width, rotated) in [(64, 64), (70, 32), (6, 2)] {
            let x = activation(dtype, tokens * heads, width, 3.0, 5, false);
            let mut values = x.to_f64_vec().unwrap();
            values[width + 3] = f64::INFINITY;
            values[2 * width + width - 1] = f64::NEG_INFINITY;
            let x = Tensor::from_f64(dtype, &[tokens, heads, width], &values).unwrap();
            let cache: Vec<f64> = (0..6 * rotated).map(|i| (i as f64 * 0.71).sin()).collect();
            let cache = Tensor::from_f64(dtype, &[6, rotated], &cache).unwrap();
            for (neox, rounding) in [(true, ir_ops::Rounding::Exact), (false, ir_ops::Rounding::Dtype)] {
                let program = builtin::rotary(neox, rounding);
                let args = [RowArg::Tensor(&positions), RowArg::Tensor(&x), RowArg::Tensor(&cache)];
                let reference = program.run(&args).unwrap();
                for dialect in [Dialect::Cuda, Dialect::Hip] {
                    let ours = run_emulated(&program, &args, dialect, false).unwrap();
                    let what = format!("{} {dtype} {width}/{rotated} {dialect:?}", program.name());
                    assert_bits(&ours[0], &reference[0], &what);
                }
            }
            // A position past the cache: the kernel cannot report it, so its token's rows stay as
            // they are (the reference and the cpu refuse the call).
            let outside = Tensor::from_slice::<i64>(&[tokens], &[2, 6, -1]).unwrap();
            let program = builtin::rotary(true, ir_ops::Rounding::Exact);
            let args = [RowArg::Tensor(&outside), RowArg::Tensor(&x), RowArg::Tensor(&cache)];
            assert!(program.run(&args).unwrap_err().to_string().contains("position 6 of row group 1 is outside"));
            let ours = run_emulated(&program, &args, Dialect::Cuda, false).unwrap();
            let rows = |t: &Tensor, first: usize| t.narrow(0, first, 2).unwrap().contiguous().unwrap();
            assert_bits(&rows(&ours[0], 1), &rows(&x, 1), &format!("{dtype} {width}: unknown positions"));
            let inside = [RowArg::Tensor(&positions), RowArg::Tensor(&x), RowArg::Tensor(&cache)];
            let rotated_rows = program.run(&inside).unwrap();
            assert_bits(
                &rows(&ours[0], 0).narrow(0, 0, 1).unwrap(),
                &rows(&rotated_rows[0], 0).narrow(0, 0, 1).unwrap(),
                &format!("{dtype} {width}: the known position"),
            );
        }
    }
}
