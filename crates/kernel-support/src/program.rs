//! Row programs as CUDA/HIP source: one kernel generated from a program ([`ir_ops::row_program`])
//! for a call's dtypes, compiled after the shared headers (`kernels/gpu/compute.h`, `elem.h`,
//! `fp8.h`) and a backend's portability header, like the hand-written kernels.
//!
//! The kernel computes one row per block (`GPU_ROWS`: a block per row on CUDA, a grid-stride loop
//! on HIP), [`ROW_BLOCK`] threads each, in the passes of [`RowProgram::schedule`]. In each pass a
//! thread walks its columns (`j = threadIdx.x, j + ROW_BLOCK, ...`) and computes, per column, every
//! element step the pass needs into registers, one fused loop: a value goes from its load to its
//! store or reduction without touching memory. A reduction keeps a partial per thread, in its
//! columns' order (a sum in `double`, so a mean far from zero keeps its bits), and the block
//! combines them by `block_reduce`'s fixed tree (`elem.h`), so the bits do not depend on
//! scheduling. Row values are `double`, rounded as the program says (the
//! reference's row arithmetic); element values are the compute type (`float`, `double` for f64
//! activations), each operation one correctly rounded `c_*` call of the portability header, so a
//! `compute` step is the reference's and a `wide` element step is computed in the compute type
//! (within the op's tolerance). Outputs are fresh and compact.
//!
//! Not generated (an error names it): a step that rounds to an fp8 dtype (fp8 is a store's dtype),
//! a constant that is not finite, a reduction counted by anything but a scalar parameter.

use std::fmt::Write as _;

use ir_core::DType;
use ir_ops::row_program::{
    BinaryOp, Binding, Extent, InputKind, Op, Precision, ReduceOp, RowProgram, UnaryOp, ValueId,
};

/// Threads per block of a generated kernel (a power of two: `block_reduce`'s tree).
pub const ROW_BLOCK: u32 = 256;

/// The headers a generated kernel is compiled after, in order (after the backend's portability
/// header).
pub const ROW_PROGRAM_HEADERS: &str = concat!(
    include_str!("../kernels/gpu/compute.h"),
    "\n",
    include_str!("../kernels/gpu/elem.h"),
    "\n",
    include_str!("../kernels/gpu/fp8.h"),
    "\n",
);

/// The name of a generated kernel.
pub const ROW_PROGRAM_KERNEL: &str = "row_program";

/// What every generated kernel uses beyond the shared headers: erfc in the compute type, and IEEE
/// 754-2019 `minimumNumber`/`maximumNumber` (`-0` below `+0`, a NaN operand gives the other), the
/// rule of [`BinaryOp::Min`] and [`BinaryOp::Max`].
const PRELUDE: &str = r#"__device__ __forceinline__ float rp_erfc(float a) { return erfcf(a); }
__device__ __forceinline__ double rp_erfc(double a) { return erfc(a); }
template <typename C>
__device__ __forceinline__ C rp_min(C a, C b) { return (a < b || (a == b && signbit(a)) || b != b) ? a : b; }
template <typename C>
__device__ __forceinline__ C rp_max(C a, C b) { return (a > b || (a == b && signbit(b)) || b != b) ? a : b; }
"#;

/// Why a program has no GPU source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    /// The program.
    pub program: String,
    /// What is not generated.
    pub reason: String,
}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "row program `{}` has no GPU source: {}", self.program, self.reason)
    }
}

impl std::error::Error for Unsupported {}

/// `elem.h`'s element type code of `dtype` (`Elem<code>`), if it has one.
fn elem_code(dtype: DType) -> Option<u32> {
    match dtype {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        DType::F64 => Some(6),
        _ => None,
    }
}

/// A generated kernel's parameters, in order: `long long n_rows, int width`, then per input an
/// activation's `(const T* in, long long offset, long long row_stride)`, a weight's or a scalar
/// tensor's `(const T* in, long long offset)`, a scalar's `double`; then per output its `T* out`
/// (`unsigned char*` for fp8), compact.
///
/// Returns the source (the generated part only: compile it after [`ROW_PROGRAM_HEADERS`]).
pub fn gpu_source(program: &RowProgram, binding: &Binding) -> Result<String, Unsupported> {
    let unsupported = |reason: String| Unsupported { program: program.name().to_owned(), reason };
    let c = match binding.compute {
        DType::F64 => "double",
        _ => "float",
    };
    let code = |dtype: DType| elem_code(dtype).ok_or_else(|| unsupported(format!("no element type for {dtype}")));
    let input_code = |input: usize| code(binding.dtypes[input].unwrap_or(binding.compute));
    let steps = program.steps();
    // The rounding of a value of C type `ty` to `precision`.
    let round = |expr: String, precision: Precision, row: bool| -> Result<String, Unsupported> {
        Ok(match precision {
            Precision::Wide => expr,
            Precision::Compute if row && c == "float" => format!("(double)(float)({expr})"),
            Precision::Compute => expr,
            Precision::Like(input) => format!("round_elem<{}>({expr})", input_code(input)?),
            Precision::Dtype(dtype) if dtype.fp8_max().is_some() => {
                return Err(unsupported(format!("a step rounds to {dtype}, which only a store may")));
            }
            Precision::Dtype(dtype) => format!("round_elem<{}>({expr})", code(dtype)?),
        })
    };
    let value = |v: ValueId, element: bool| match (steps[v.0 as usize].extent, element) {
        (Extent::Element, _) => format!("e{}", v.0),
        (Extent::Row, true) => format!("(({c})r{})", v.0),
        (Extent::Row, false) => format!("r{}", v.0),
    };
    let unary = |op: UnaryOp, a: String, ty: &str| match op {
        UnaryOp::Neg => format!("(-({a}))"),
        UnaryOp::Abs => format!("c_fabs({a})"),
        UnaryOp::Exp => format!("c_exp({a})"),
        UnaryOp::Tanh => format!("c_tanh({a})"),
        UnaryOp::Erf => format!("c_erf({a})"),
        UnaryOp::Erfc => format!("rp_erfc({a})"),
        UnaryOp::Sigmoid => format!("c_div(({ty})1, c_add(({ty})1, c_exp(-({a}))))"),
        UnaryOp::Sqrt => format!("c_sqrt({a})"),
        UnaryOp::Recip => format!("c_div(({ty})1, {a})"),
        UnaryOp::Relu => format!("(({a}) < ({ty})0 ? ({ty})0 : ({a}))"),
        UnaryOp::Round => a,
    };
    let binary = |op: BinaryOp, a: String, b: String| match op {
        BinaryOp::Add => format!("c_add({a}, {b})"),
        BinaryOp::Sub => format!("c_sub({a}, {b})"),
        BinaryOp::Mul => format!("c_mul({a}, {b})"),
        BinaryOp::Div => format!("c_div({a}, {b})"),
        BinaryOp::Min => format!("rp_min({a}, {b})"),
        BinaryOp::Max => format!("rp_max({a}, {b})"),
    };

    let mut src = String::new();
    let _ = writeln!(src, "// Generated from row program `{}` ({:016x}).", program.name(), program.fingerprint());
    src.push_str(PRELUDE);
    // The prototype.
    let mut params = vec!["long long n_rows".to_owned(), "int width".to_owned()];
    for (index, input) in program.inputs().iter().enumerate() {
        match input.kind {
            InputKind::Scalar => params.push(format!("double s{index}")),
            InputKind::Activation { .. } => {
                let t = input_code(index)?;
                params.push(format!("const typename Elem<{t}>::T* in{index}"));
                params.push(format!("long long off{index}"));
                params.push(format!("long long stride{index}"));
            }
            InputKind::Weight | InputKind::ScalarTensor => {
                let t = input_code(index)?;
                params.push(format!("const typename Elem<{t}>::T* in{index}"));
                params.push(format!("long long off{index}"));
            }
        }
    }
    for (index, output) in program.outputs().iter().enumerate() {
        let dtype = binding.output_dtype(output.dtype);
        if dtype.fp8_max().is_some() {
            params.push(format!("unsigned char* out{index}"));
        } else {
            params.push(format!("typename Elem<{}>::T* out{index}", code(dtype)?));
        }
    }
    let _ = writeln!(src, "extern \"C\" __global__ void {ROW_PROGRAM_KERNEL}({}) {{", params.join(", "));
    let _ = writeln!(src, "    __shared__ {c} scratch[{ROW_BLOCK}];");
    let _ = writeln!(src, "    __shared__ double scratch_d[{ROW_BLOCK}];");
    let _ = writeln!(src, "    GPU_ROWS(row, n_rows) {{");
    for (index, step) in steps.iter().enumerate() {
        if step.extent == Extent::Row {
            let _ = writeln!(src, "        double r{index};");
        }
    }
    let schedule = program.schedule();
    let exact = program.exact_in_f32(binding);
    let passes = schedule.elements.len();
    let mut emitted = vec![false; steps.len()];
    let row_steps = |src: &mut String, pass: usize, emitted: &mut Vec<bool>| -> Result<(), Unsupported> {
        for (index, step) in steps.iter().enumerate() {
            if emitted[index] || step.extent != Extent::Row || schedule.phase[index] > pass {
                continue;
            }
            let expr = match step.op {
                Op::Param { input } => match program.inputs()[input].kind {
                    InputKind::Scalar => format!("s{input}"),
                    _ => format!("(double)Elem<{}>::load(in{input}[off{input}])", input_code(input)?),
                },
                Op::Const(v) if v.is_finite() => format!("{v:?}"),
                Op::Const(v) => return Err(unsupported(format!("the constant {v} is not finite"))),
                Op::Width => "(double)width".to_owned(),
                Op::Unary(op, x) => unary(op, value(x, false), "double"),
                Op::Binary(op, a, b) => binary(op, value(a, false), value(b, false)),
                Op::Reduce { .. } => continue,
                Op::Load { .. } | Op::Weight { .. } => unreachable!("loads are element steps"),
            };
            let _ = writeln!(src, "        r{index} = {};", round(expr, step.precision, true)?);
            emitted[index] = true;
        }
        Ok(())
    };
    for pass in 0..passes {
        row_steps(&mut src, pass, &mut emitted)?;
        let reductions = &schedule.reductions[pass];
        for &index in reductions {
            let Op::Reduce { count, .. } = steps[index].op else { unreachable!("reductions are listed") };
            let n = match count {
                None => "(long long)width".to_owned(),
                Some(count) => match steps[count.0 as usize].op {
                    Op::Param { input } if program.inputs()[input].kind == InputKind::Scalar => {
                        // Checked by the host: an integer in 1..=width.
                        format!("(long long)r{}", count.0)
                    }
                    _ => {
                        return Err(unsupported(format!(
                            "%{index} is counted by %{}, not a scalar parameter",
                            count.0
                        )));
                    }
                },
            };
            // Sums accumulate in double (a mean far from zero keeps its bits, as on the cpu).
            let Op::Reduce { op, .. } = steps[index].op else { unreachable!("reductions are listed") };
            let ty = if op == ReduceOp::Sum { "double" } else { c };
            let _ = writeln!(src, "        {ty} a{index} = ({ty})0; const long long n{index} = {n};");
        }
        let last = pass + 1 == passes;
        let _ = writeln!(src, "        for (int j = threadIdx.x; j < width; j += {ROW_BLOCK}) {{");
        for &index in &schedule.elements[pass] {
            let step = steps[index];
            let narrow = binding
                .precision_dtype(step.precision)
                .is_some_and(|d| elem_code(d).is_some_and(|code| code == 1 || code == 2));
            if narrow && !exact[index] && matches!(step.op, Op::Unary(..) | Op::Binary(..)) {
                // Rounded to f16 or bf16 and not exact in the compute type: in double, rounded once
                // (elem.h's double store rounds to odd first), as the reference.
                let wide = |v: ValueId| match steps[v.0 as usize].extent {
                    Extent::Element => format!("(double)e{}", v.0),
                    Extent::Row => format!("r{}", v.0),
                };
                let expr = match step.op {
                    Op::Unary(op, x) => unary(op, wide(x), "double"),
                    Op::Binary(op, a, b) => binary(op, wide(a), wide(b)),
                    _ => unreachable!("matched above"),
                };
                let _ = writeln!(src, "            const {c} e{index} = ({c}){};", round(expr, step.precision, true)?);
                continue;
            }
            let expr = match step.op {
                Op::Load { input, block } => format!(
                    "({c})Elem<{}>::load(in{input}[off{input} + row * stride{input} + {block}LL * width + j])",
                    input_code(input)?
                ),
                Op::Weight { input } => format!("({c})Elem<{}>::load(in{input}[off{input} + j])", input_code(input)?),
                Op::Unary(op, x) => unary(op, value(x, true), c),
                Op::Binary(op, a, b) => binary(op, value(a, true), value(b, true)),
                _ => unreachable!("element steps"),
            };
            let _ = writeln!(src, "            const {c} e{index} = {};", round(expr, step.precision, false)?);
        }
        for &index in reductions {
            let Op::Reduce { op, x, .. } = steps[index].op else { unreachable!("reductions are listed") };
            let term = match op {
                ReduceOp::Sum => format!("c_add(a{index}, (double)e{})", x.0),
                ReduceOp::SumSquares => format!("c_add(a{index}, c_mul(e{0}, e{0}))", x.0),
                ReduceOp::MaxAbs => format!("c_fmax(a{index}, c_fabs(e{}))", x.0),
            };
            let _ = writeln!(src, "            if (j < n{index}) a{index} = {term};");
        }
        if last {
            for (k, output) in program.outputs().iter().enumerate() {
                if steps[output.value.0 as usize].extent != Extent::Element {
                    continue;
                }
                let store = store(program, binding.output_dtype(output.dtype), &format!("e{}", output.value.0))?;
                let _ = writeln!(src, "            out{k}[row * width + j] = {store};");
            }
        }
        let _ = writeln!(src, "        }}");
        for &index in reductions {
            let Op::Reduce { op, .. } = steps[index].op else { unreachable!("reductions are listed") };
            let (combine, scratch) = match op {
                ReduceOp::MaxAbs => ("block_max", "scratch"),
                ReduceOp::SumSquares => ("block_sum", "scratch"),
                ReduceOp::Sum => ("block_sum", "scratch_d"),
            };
            let expr = format!("(double){combine}<{ROW_BLOCK}>(a{index}, {scratch})");
            let _ = writeln!(src, "        r{index} = {};", round(expr, steps[index].precision, true)?);
            emitted[index] = true;
        }
    }
    row_steps(&mut src, passes, &mut emitted)?;
    for (k, output) in program.outputs().iter().enumerate() {
        if steps[output.value.0 as usize].extent == Extent::Row {
            let store = store(program, binding.output_dtype(output.dtype), &format!("r{}", output.value.0))?;
            let _ = writeln!(src, "        if (threadIdx.x == 0) out{k}[row] = {store};");
        }
    }
    src.push_str("    }\n}\n");
    Ok(src)
}

/// The expression storing `value` as a `dtype` element.
fn store(program: &RowProgram, dtype: DType, value: &str) -> Result<String, Unsupported> {
    Ok(match dtype {
        DType::F8E4M3FN => format!("fp8_e4m3((float)({value}))"),
        DType::F8E5M2 => format!("fp8_e5m2((float)({value}))"),
        other => match elem_code(other) {
            Some(code) => format!("Elem<{code}>::store({value})"),
            None => {
                return Err(Unsupported {
                    program: program.name().to_owned(),
                    reason: format!("no store for {other}"),
                });
            }
        },
    })
}

/// The generated kernel run on the emulated GPU (feature `emu`): the program's outputs on `args`
/// (host tensors), as fresh compact tensors, from the source [`gpu_source`] generates compiled as
/// `dialect`'s compiler gets it (cached by the emulator under a hash of the source).
#[cfg(feature = "emu")]
pub fn run_emulated(
    program: &RowProgram,
    args: &[ir_ops::row_program::RowArg<'_>],
    dialect: crate::emu::Dialect,
) -> Result<Vec<ir_core::Tensor>, ir_core::KernelError> {
    use crate::emu::{EmuArg, EmuGrid, EmuProgram};
    use ir_core::{KernelError, Tensor};
    use ir_ops::row_program::RowArg;

    let invalid = |reason: String| KernelError::InvalidArguments { reason };
    let binding = program.bind(args).map_err(|error| invalid(error.to_string()))?;
    let source = gpu_source(program, &binding).map_err(|error| invalid(error.to_string()))?;
    // A count read from a scalar is checked here (the kernel trusts it).
    for (index, step) in program.steps().iter().enumerate() {
        let Op::Reduce { count: Some(count), .. } = step.op else { continue };
        let Op::Param { input } = program.steps()[count.0 as usize].op else { continue };
        if let RowArg::Scalar(c) = args[input]
            && binding.count(c).is_none()
        {
            let error = ir_ops::row_program::RunError::Count {
                program: program.name().to_owned(),
                step: ValueId(index as u32),
                count: c,
                width: binding.width,
            };
            return Err(invalid(error.to_string()));
        }
    }
    let built = EmuProgram::build(dialect, &[], &format!("{ROW_PROGRAM_HEADERS}{source}"))
        .map_err(|error| KernelError::Driver { backend: "emulated gpu", message: error.to_string() })?;
    // Host tensors whose last dimension is contiguous (strided ones copied).
    let mut held: Vec<Option<Tensor>> = Vec::with_capacity(args.len());
    for (input, arg) in program.inputs().iter().zip(args) {
        held.push(match arg {
            RowArg::Tensor(tensor) if tensor.cpu_buffer().is_none() => {
                return Err(KernelError::WrongMemory { param: input.name.clone(), memory: "host" });
            }
            RowArg::Tensor(tensor) if crate::Rows::of(tensor.meta()).is_err() => Some(tensor.contiguous()?),
            _ => None,
        });
    }
    let to_i64 = |v: usize| i64::try_from(v).map_err(|_| crate::out_of_range("extent", v, 0, i64::MAX));
    let mut launch_args =
        vec![EmuArg::i64(to_i64(binding.rows)?), EmuArg::i32(crate::kernel_int(binding.width, "width")?)];
    for ((input, arg), copy) in program.inputs().iter().zip(args).zip(&held) {
        match arg {
            RowArg::Scalar(value) => launch_args.push(EmuArg::f64(*value)),
            RowArg::Tensor(tensor) => {
                let tensor = copy.as_ref().unwrap_or(tensor);
                let buffer = tensor.cpu_buffer().expect("checked above: host tensors");
                let rows = crate::Rows::for_kernel(tensor.meta())?;
                launch_args.push(EmuArg::buffer(buffer.as_ptr(), tensor.dtype().size_in_bytes()));
                launch_args.push(EmuArg::i64(to_i64(rows.offset)?));
                if matches!(input.kind, InputKind::Activation { .. }) {
                    launch_args.push(EmuArg::i64(to_i64(rows.row_stride)?));
                }
            }
        }
    }
    let mut outputs = Vec::with_capacity(program.outputs().len());
    for output in program.outputs() {
        let shape = binding.output_shape(program.steps()[output.value.0 as usize].extent);
        outputs.push(Tensor::zeros(binding.output_dtype(output.dtype), &shape)?);
    }
    for output in &mut outputs {
        let size = output.dtype().size_in_bytes();
        let buffer = output.cpu_buffer_mut()?.expect("a fresh host tensor");
        launch_args.push(EmuArg::buffer(buffer.bytes_mut().as_mut_ptr(), size));
    }
    let blocks = match dialect {
        crate::emu::Dialect::Cuda => u32::try_from(binding.rows).map_err(|_| invalid("too many rows".to_owned()))?,
        crate::emu::Dialect::Hip => u32::try_from(binding.rows.min(1024)).unwrap_or(1024),
    };
    let warp = match dialect {
        crate::emu::Dialect::Cuda => 32,
        crate::emu::Dialect::Hip => 64,
    };
    // SAFETY: the kernel reads input i at `offset + row · row_stride + b · width + j` (activations,
    // b below its blocks, j below width, row below n_rows), `offset + j` (weights) and `offset`
    // (scalar tensors): inside each tensor's rows, which its storage holds (`Rows` of a tensor's
    // layout, checked against its storage when the tensor was made). It writes output k at
    // `row · width + j` or `row`: inside the fresh compact outputs, which nothing else reads or
    // writes while it runs (the inputs are only read).
    unsafe { built.launch(ROW_PROGRAM_KERNEL, EmuGrid { blocks, threads: ROW_BLOCK, warp }, &launch_args) }
        .map_err(|error| KernelError::Driver { backend: "emulated gpu", message: error.to_string() })?;
    drop(held);
    Ok(outputs)
}

#[cfg(all(test, feature = "emu"))]
mod tests;
