//! The generated CUDA/HIP source of the built-in programs, run on the emulated GPU against the
//! reference interpreter (within each op's tolerance: the kernel sums per thread and by a tree, and
//! computes wide steps in f32).

use ir_core::op::OpDef;
use ir_core::{DType, Tensor};
use ir_ops::Rounding;
use ir_ops::row_program::{BinaryOp, InputKind, OutDType, Precision, ReduceOp, RowArg, RowProgram, builtin};

use super::{gpu_source, run_emulated};
use crate::emu::Dialect;
use crate::emu::tests::compiler_at_hand;

/// `[rows, width]` in `dtype` scaled by `scale`, with a zero row and a NaN in the second; a column
/// slice of a wider buffer when `strided`.
fn activation(dtype: DType, rows: usize, width: usize, scale: f64, seed: u64, strided: bool) -> Tensor {
    let wide = if strided { width + 3 } else { width };
    // A deterministic spread of values in (-2, 2) times `scale`.
    let mut values: Vec<f64> =
        (0..rows * wide).map(|i| ((i as f64 * 0.618_034 + seed as f64) * 12.9898).sin() * 2.0 * scale).collect();
    values[..wide].iter_mut().for_each(|v| *v = 0.0);
    if rows > 1 {
        values[wide + 1] = f64::NAN;
    }
    let t = Tensor::from_f64(dtype, &[rows, wide], &values).unwrap();
    if strided { t.narrow(1, 1, width).unwrap() } else { t }
}

/// The op whose tolerance a program's outputs are held to: its own, `layer_norm`'s (defined apart
/// from the built-ins), or the quantization's for the fused gated quantization.
fn op(name: &str) -> &'static OpDef {
    match name {
        "layer_norm" => &ir_ops::layer_norm::LAYER_NORM,
        "silu_and_mul_dynamic_fp8_quant" => {
            &ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT
        }
        _ => ir_ops::BUILTIN_OPS.iter().copied().find(|def| def.name == name).expect("a built-in op"),
    }
}

/// Runs `program` on the emulated GPU and compares every output with the interpreter's.
fn check(program: &RowProgram, args: &[RowArg<'_>], dialect: Dialect, dtype: DType) {
    let ours = run_emulated(program, args, dialect).unwrap_or_else(|e| panic!("{} {dtype}: {e}", program.name()));
    let reference = program.run(args).unwrap();
    let tolerance = ir_core::op::tolerance(op(program.name()), dtype).unwrap();
    for (index, (a, b)) in ours.iter().zip(&reference).enumerate() {
        // An fp8 code may land one step away where the f32 norm before it differs in its last bit.
        let (atol, rtol) =
            if a.dtype().fp8_max().is_some() { (tolerance.atol, 0.13) } else { (tolerance.atol, tolerance.rtol) };
        ir_core::allclose(a, b, atol, rtol)
            .unwrap_or_else(|error| panic!("{} {dtype} {dialect:?} output {index}: {error}", program.name()));
    }
}

/// An argument of a sample call: a tensor or a scalar.
enum Sample {
    Tensor(Tensor),
    Scalar(f64),
}

impl Sample {
    fn arg(&self) -> RowArg<'_> {
        match self {
            Sample::Tensor(t) => RowArg::Tensor(t),
            Sample::Scalar(v) => RowArg::Scalar(*v),
        }
    }
}

/// A call of any built-in program on `rows` rows of `width` in `dtype`: activations (the first a
/// column slice), a weight of 1.25, an epsilon of 1e-6, a variance size of half the row, a std
/// multiplier of 1, a scale of 0.01 and a bound of 2.
fn sample(program: &RowProgram, dtype: DType, rows: usize, width: usize) -> Vec<Sample> {
    program
        .inputs()
        .iter()
        .enumerate()
        .map(|(index, input)| match (&input.kind, input.name.as_str()) {
            (InputKind::Activation { blocks }, _) => {
                Sample::Tensor(activation(dtype, rows, blocks * width, 2.0, index as u64, index == 0))
            }
            (InputKind::Weight, _) => Sample::Tensor(Tensor::from_f64(dtype, &[width], &vec![1.25; width]).unwrap()),
            (InputKind::ScalarTensor, "scale_ub") => {
                Sample::Tensor(Tensor::from_f64(DType::F32, &[1], &[2.0]).unwrap())
            }
            (InputKind::ScalarTensor, _) => Sample::Tensor(Tensor::from_f64(DType::F32, &[1], &[0.01]).unwrap()),
            (InputKind::Scalar, "epsilon") => Sample::Scalar(1e-6),
            (InputKind::Scalar, "variance_size") => Sample::Scalar((width / 2) as f64),
            (InputKind::Scalar, "std_multiplier") => Sample::Scalar(1.0),
            (InputKind::Scalar, other) => panic!("no sample for scalar `{other}`"),
        })
        .collect()
}

#[test]
fn every_built_in_program_runs_as_generated_gpu_source() {
    if !compiler_at_hand() {
        return;
    }
    // Every program in bf16 as NVRTC gets it; in f32 and f16 as hipcc does.
    for (dtype, dialect) in [(DType::BF16, Dialect::Cuda), (DType::F32, Dialect::Hip), (DType::F16, Dialect::Hip)] {
        for program in builtin::all() {
            let samples = sample(&program, dtype, 5, 300);
            let args: Vec<RowArg<'_>> = samples.iter().map(Sample::arg).collect();
            check(&program, &args, dialect, dtype);
        }
    }
}

#[test]
fn the_generated_source_fuses_each_pass_into_one_loop() {
    let program = builtin::norm_dynamic_per_token_quant(true, true, false, DType::F8E4M3FN, Rounding::Exact).unwrap();
    let x = Tensor::zeros(DType::BF16, &[2, 64]).unwrap();
    let w = Tensor::zeros(DType::BF16, &[64]).unwrap();
    let binding =
        program.bind(&[RowArg::Tensor(&x), RowArg::Tensor(&x), RowArg::Tensor(&w), RowArg::Scalar(1e-6)]).unwrap();
    let source = gpu_source(&program, &binding).unwrap();
    // Three passes (the sum of squares, the absmax, the codes), each one loop over the row.
    assert_eq!(source.matches("for (int j = threadIdx.x; j < width;").count(), 3, "{source}");
    assert_eq!(source.matches("block_sum<").count() + source.matches("block_max<").count(), 2, "{source}");
    assert!(source.contains("fp8_e4m3("), "{source}");
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
    let error = gpu_source(&program, &binding).unwrap_err().to_string();
    assert!(error.contains("a step rounds to f8e4m3fn, which only a store may"), "{error}");

    let mut b = RowProgram::builder("counted");
    let xi = b.activation("x", 1);
    let v = b.load(xi, 0);
    let m = b.reduce(ReduceOp::MaxAbs, v, None, Precision::Wide);
    let s = b.reduce(ReduceOp::Sum, v, Some(m), Precision::Wide);
    let y = b.binary(BinaryOp::Mul, v, s, Precision::Compute);
    b.store("y", y, OutDType::Like(xi), None);
    let program = b.build().unwrap();
    let error = gpu_source(&program, &binding).unwrap_err().to_string();
    assert!(error.contains("%2 is counted by %1, not a scalar parameter"), "{error}");

    if compiler_at_hand() {
        let program = builtin::rms_norm(false, true);
        let args = [RowArg::Tensor(&x), RowArg::Scalar(1e-6), RowArg::Scalar(9.0)];
        let error = run_emulated(&program, &args, Dialect::Cuda).unwrap_err().to_string();
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
            let ours = run_emulated(&program, &args, dialect).unwrap();
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
