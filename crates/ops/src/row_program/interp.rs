//! The reference interpreter: a program's semantics, row by row in `f64`, rounding where its steps
//! say (see the module documentation of [`crate::row_program`]).

use ir_core::{DType, Tensor};

use super::{Extent, InputKind, Op, OutDType, Precision, ReduceOp, RowProgram, RunError, ValueId};

/// One argument of a program's call, in input order.
#[derive(Clone, Copy, Debug)]
pub enum RowArg<'a> {
    /// An activation, a weight or a scalar tensor (any layout, any device: read through host memory).
    Tensor(&'a Tensor),
    /// A scalar input's value.
    Scalar(f64),
}

/// An argument of a call run in place: read, or donated (uniquely owned) for the output the
/// program writes in place of it (an executor's in-place entry point takes these).
#[derive(Debug)]
pub enum InPlaceArg<'a> {
    /// Read only, as [`RowProgram::run`] takes it.
    Read(RowArg<'a>),
    /// A donated activation: the program's in-place output of it is written into its storage.
    Donated(&'a mut ir_core::UniqueTensor),
}

impl InPlaceArg<'_> {
    /// The argument as read (a donated tensor as it is before the call).
    pub fn as_read(&self) -> RowArg<'_> {
        match self {
            InPlaceArg::Read(arg) => *arg,
            InPlaceArg::Donated(tensor) => RowArg::Tensor(tensor.tensor()),
        }
    }
}

/// An input's values, read once.
enum Read {
    /// All elements in logical order.
    Values(Vec<f64>),
    /// A scalar's (or a scalar tensor's) value.
    Scalar(f64),
    /// Positions, each checked to be a row of every cache read at it.
    Positions(Vec<usize>),
}

/// A step's value in the current row.
#[derive(Clone, Debug)]
enum Val {
    Element(Vec<f64>),
    Row(f64),
}

/// A call's arguments checked against a program ([`RowProgram::bind`]): the row geometry and each
/// input's dtype, what every executor of the program needs before it reads a value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The row width `W` (one block).
    pub width: usize,
    /// The number of rows.
    pub rows: usize,
    /// The activations' shape but the last dimension.
    pub rows_shape: Vec<usize>,
    /// The compute dtype: f32, or f64 when the first activation is f64.
    pub compute: DType,
    /// Each input's dtype (`None` for a scalar).
    pub dtypes: Vec<Option<DType>>,
    /// Whether the call writes each in-place output into its activation ([`InPlaceArg`]) rather
    /// than into a fresh tensor: [`RowProgram::bind`] leaves it `false`, an executor running the
    /// call in place sets it (a generated kernel's prototype differs).
    pub in_place: bool,
}

impl Binding {
    /// The dtype a precision rounds to (`None` for [`Precision::Wide`]).
    pub fn precision_dtype(&self, precision: Precision) -> Option<DType> {
        match precision {
            Precision::Wide => None,
            Precision::Compute => Some(self.compute),
            Precision::Like(input) => self.dtypes.get(input).copied().flatten(),
            Precision::Dtype(dtype) => Some(dtype),
        }
    }

    /// A reduction's count as the number of leading elements it reduces: `Some` for an integer in
    /// `1..=W`, the only counts every executor accepts.
    pub fn count(&self, count: f64) -> Option<usize> {
        (count >= 1.0 && count <= self.width as f64 && count.fract() == 0.0).then_some(count as usize)
    }

    /// Reduction `step`'s count as [`Binding::count`] takes it, or the error naming `program`, the
    /// step, the count and the width.
    pub fn checked_count(&self, program: &RowProgram, step: usize, count: f64) -> Result<usize, RunError> {
        self.count(count).ok_or_else(|| RunError::Count {
            program: program.name().to_owned(),
            step: ValueId(step as u32),
            count,
            width: self.width,
        })
    }

    /// An output's dtype.
    pub fn output_dtype(&self, dtype: OutDType) -> DType {
        match dtype {
            OutDType::Like(input) => self.dtypes.get(input).copied().flatten().unwrap_or(self.compute),
            OutDType::Fixed(dtype) => dtype,
        }
    }

    /// The shape of an output of `extent`: the rows with last dimension `W` (element values) or 1
    /// (row values).
    pub fn output_shape(&self, extent: Extent) -> Vec<usize> {
        let last = match extent {
            Extent::Element => self.width,
            Extent::Row => 1,
        };
        self.rows_shape.iter().copied().chain([last]).collect()
    }
}

impl RowProgram {
    /// Checks `args` against the program and returns the call's geometry: every activation has the
    /// first one's rows (every dimension but the last) and `blocks · W` columns, with `W` from the
    /// first; a weight has shape `[W]`; a scalar tensor one element; every tensor a compute dtype.
    /// Errors name the input and the rule.
    pub fn bind(&self, args: &[RowArg<'_>]) -> Result<Binding, RunError> {
        if args.len() != self.inputs.len() {
            return Err(RunError::Arity { program: self.name.clone(), expected: self.inputs.len(), found: args.len() });
        }
        let refuse = |input: usize, reason: String| RunError::Argument {
            program: self.name.clone(),
            param: self.inputs[input].name.clone(),
            reason,
        };
        // The row geometry, from the first activation.
        let (first, blocks) = self
            .inputs
            .iter()
            .enumerate()
            .find_map(|(index, input)| match input.kind {
                InputKind::Activation { blocks } => Some((index, blocks)),
                _ => None,
            })
            .expect("a built program has an activation");
        let RowArg::Tensor(lead) = args[first] else { return Err(refuse(first, "must be a tensor".to_owned())) };
        let Some((&last, rows_shape)) = lead.shape().split_last() else {
            return Err(refuse(first, "must have rank >= 1".to_owned()));
        };
        if blocks == 0 || !last.is_multiple_of(blocks) {
            return Err(refuse(first, format!("last dimension {last} is not {blocks} blocks of one width")));
        }
        let width = last / blocks;
        let rows: usize = rows_shape.iter().product();
        let mut dtypes = Vec::with_capacity(args.len());
        for (index, (input, arg)) in self.inputs.iter().zip(args).enumerate() {
            let dtype = match (&input.kind, *arg) {
                (InputKind::Scalar, RowArg::Scalar(_)) => None,
                (InputKind::Scalar, RowArg::Tensor(_)) => return Err(refuse(index, "must be a scalar".to_owned())),
                (_, RowArg::Scalar(_)) => return Err(refuse(index, "must be a tensor".to_owned())),
                (InputKind::Positions, RowArg::Tensor(tensor)) => {
                    if tensor.dtype() != DType::I64 {
                        return Err(refuse(index, format!("has dtype {}, expected i64", tensor.dtype())));
                    }
                    let n = tensor.numel();
                    let even = if n == 0 { rows == 0 } else { rows.is_multiple_of(n) };
                    if !even {
                        return Err(refuse(
                            index,
                            format!(
                                "has {n} positions, which do not split the {rows} rows of `{}` evenly",
                                self.inputs[first].name
                            ),
                        ));
                    }
                    Some(DType::I64)
                }
                (kind, RowArg::Tensor(tensor)) => {
                    let dtype = tensor.dtype();
                    if !dtype.is_compute() {
                        return Err(refuse(
                            index,
                            format!("has dtype {dtype}, not a compute dtype (f32, f16, bf16, f64)"),
                        ));
                    }
                    let (fits, expected) = match kind {
                        InputKind::Activation { blocks } => {
                            let expected: Vec<usize> = rows_shape.iter().copied().chain([blocks * width]).collect();
                            let fits = tensor.shape() == expected.as_slice();
                            (fits, format!("{expected:?} (the rows of `{}`)", self.inputs[first].name))
                        }
                        InputKind::Weight => (tensor.shape() == [width], format!("[{width}]")),
                        InputKind::ScalarTensor => (tensor.numel() == 1, "one element".to_owned()),
                        InputKind::CosSinCache { .. } => {
                            let fits = matches!(tensor.shape(), &[_, r] if r >= 2 && r.is_multiple_of(2) && r <= width);
                            (fits, format!("[max_position, R] with R even in 2..={width} (the row width)"))
                        }
                        InputKind::Scalar | InputKind::Positions => unreachable!("matched above"),
                    };
                    if !fits {
                        return Err(refuse(index, format!("has shape {:?}, expected {expected}", tensor.shape())));
                    }
                    Some(dtype)
                }
            };
            dtypes.push(dtype);
        }
        Ok(Binding {
            width,
            rows,
            rows_shape: rows_shape.to_vec(),
            compute: lead.dtype().compute_dtype(),
            dtypes,
            in_place: false,
        })
    }

    /// Runs the program on `args` with its reference semantics and returns its outputs as fresh
    /// compact CPU tensors, in order (an in-place output is returned like a fresh one: the reference
    /// writes nothing). The arguments are checked by [`RowProgram::bind`].
    pub fn run(&self, args: &[RowArg<'_>]) -> Result<Vec<Tensor>, RunError> {
        let binding = self.bind(args)?;
        let (width, n_rows) = (binding.width, binding.rows);
        let mut read = Vec::with_capacity(args.len());
        for (index, (input, arg)) in self.inputs.iter().zip(args).enumerate() {
            read.push(match (&input.kind, *arg) {
                (_, RowArg::Scalar(value)) => Read::Scalar(value),
                (InputKind::ScalarTensor, RowArg::Tensor(tensor)) => Read::Scalar(tensor.to_f64_vec()?[0]),
                (InputKind::Positions, RowArg::Tensor(tensor)) => {
                    Read::Positions(self.checked_positions(index, tensor, args)?)
                }
                (_, RowArg::Tensor(tensor)) => Read::Values(tensor.to_f64_vec()?),
            });
        }
        let round = |precision: Precision, value: f64| match binding.precision_dtype(precision) {
            None => value,
            Some(dtype) => dtype.round(value),
        };

        let mut stored: Vec<Vec<f64>> = self
            .outputs
            .iter()
            .map(|output| {
                let per_row = match self.steps[output.value.0 as usize].extent {
                    Extent::Element => width,
                    Extent::Row => 1,
                };
                Vec::with_capacity(n_rows * per_row)
            })
            .collect();
        let mut vals: Vec<Val> = Vec::with_capacity(self.steps.len());
        for row in 0..n_rows {
            vals.clear();
            for (index, step) in self.steps.iter().enumerate() {
                let value = match step.op {
                    Op::Load { input, block } => {
                        let Read::Values(values) = &read[input] else { unreachable!("activations are read as values") };
                        let Some(InputKind::Activation { blocks }) = self.inputs.get(input).map(|i| &i.kind) else {
                            unreachable!("a built program loads activations")
                        };
                        let start = row * blocks * width + block * width;
                        Val::Element(values[start..start + width].iter().map(|&v| round(step.precision, v)).collect())
                    }
                    Op::Weight { input } => {
                        let Read::Values(values) = &read[input] else { unreachable!("weights are read as values") };
                        Val::Element(values.iter().map(|&v| round(step.precision, v)).collect())
                    }
                    Op::Param { input } => {
                        let Read::Scalar(value) = read[input] else { unreachable!("params are read as scalars") };
                        Val::Row(round(step.precision, value))
                    }
                    Op::Const(value) => Val::Row(round(step.precision, value)),
                    Op::Width => Val::Row(round(step.precision, width as f64)),
                    Op::Cos { cache } | Op::Sin { cache } => {
                        let (values, rotated, neox, position) = self.cache_row(&read, args, cache, row, n_rows);
                        let cache_row = &values[position * rotated..][..rotated];
                        let sin = matches!(step.op, Op::Sin { .. });
                        Val::Element(
                            (0..width)
                                .map(|j| match (super::rotary_column(j, rotated, neox), sin) {
                                    (None, false) => 1.0,
                                    (None, true) => 0.0,
                                    (Some((i, _, _)), false) => cache_row[i],
                                    (Some((i, first, _)), true) => {
                                        let s = cache_row[rotated / 2 + i];
                                        if first { -s } else { s }
                                    }
                                })
                                .map(|v| round(step.precision, v))
                                .collect(),
                        )
                    }
                    Op::Pair { x, cache } => {
                        let Val::Element(elements) = &vals[x.0 as usize] else {
                            unreachable!("a built program pairs elements")
                        };
                        let (_, rotated, neox, _) = self.cache_row(&read, args, cache, row, n_rows);
                        Val::Element(
                            (0..width)
                                .map(|j| match super::rotary_column(j, rotated, neox) {
                                    Some((_, _, partner)) => elements[partner],
                                    None => -0.0,
                                })
                                .map(|v| round(step.precision, v))
                                .collect(),
                        )
                    }
                    Op::Unary(op, x) => map(&vals[x.0 as usize], |v| round(step.precision, op.eval(v))),
                    Op::Binary(op, a, b) => {
                        zip(&vals[a.0 as usize], &vals[b.0 as usize], |a, b| round(step.precision, op.eval(a, b)))
                    }
                    Op::Reduce { op, x, count } => {
                        let Val::Element(elements) = &vals[x.0 as usize] else {
                            unreachable!("a built program reduces elements")
                        };
                        let n = match count {
                            None => width,
                            Some(count) => {
                                let Val::Row(c) = vals[count.0 as usize] else { unreachable!("counts are row values") };
                                binding.checked_count(self, index, c)?
                            }
                        };
                        Val::Row(round(step.precision, reduce(op, &elements[..n])))
                    }
                };
                vals.push(value);
            }
            for (output, sink) in self.outputs.iter().zip(&mut stored) {
                match &vals[output.value.0 as usize] {
                    Val::Element(values) => sink.extend_from_slice(values),
                    Val::Row(value) => sink.push(*value),
                }
            }
        }

        self.outputs
            .iter()
            .zip(stored)
            .map(|(output, values)| {
                let dtype = binding.output_dtype(output.dtype);
                let shape = binding.output_shape(self.steps[output.value.0 as usize].extent);
                let values: Vec<f64> = values.into_iter().map(|v| dtype.round(v)).collect();
                Ok(Tensor::from_f64(dtype, &shape, &values)?)
            })
            .collect()
    }
}

impl RowProgram {
    /// The positions of input `index` (checked by [`RowProgram::bind`]), each checked to be a row
    /// of every cache read at them.
    fn checked_positions(&self, index: usize, tensor: &Tensor, args: &[RowArg<'_>]) -> Result<Vec<usize>, RunError> {
        let positions = tensor.to_cpu()?.contiguous()?.to_vec::<i64>()?;
        let mut checked = vec![0usize; positions.len()];
        for (cache, input) in self.inputs.iter().enumerate() {
            let InputKind::CosSinCache { positions: read_at, .. } = input.kind else { continue };
            let RowArg::Tensor(cache_tensor) = args[cache] else { unreachable!("bind checked the cache") };
            if read_at != index {
                continue;
            }
            let max = cache_tensor.shape()[0];
            for (group, (&p, row)) in positions.iter().zip(&mut checked).enumerate() {
                *row = usize::try_from(p).ok().filter(|&p| p < max).ok_or_else(|| RunError::Argument {
                    program: self.name.clone(),
                    param: self.inputs[index].name.clone(),
                    reason: format!(
                        "position {p} of row group {group} is outside the cos/sin cache `{}` (0..{max})",
                        input.name
                    ),
                })?;
            }
        }
        Ok(checked)
    }

    /// Cache `cache`'s values, rotated width, style and the row of it row `row` (of `rows`) reads.
    fn cache_row<'v>(
        &self,
        read: &'v [Read],
        args: &[RowArg<'_>],
        cache: usize,
        row: usize,
        rows: usize,
    ) -> (&'v [f64], usize, bool, usize) {
        let InputKind::CosSinCache { positions, neox } = self.inputs[cache].kind else {
            unreachable!("a built program reads caches as caches")
        };
        let (Read::Values(values), Read::Positions(at), RowArg::Tensor(tensor)) =
            (&read[cache], &read[positions], args[cache])
        else {
            unreachable!("caches and positions are read as such")
        };
        (values, tensor.shape()[1], neox, at[row / (rows / at.len())])
    }
}

/// Folds in column order, as the native references do (`Iterator::sum` for the sums).
fn reduce(op: ReduceOp, values: &[f64]) -> f64 {
    match op {
        ReduceOp::Sum => values.iter().sum(),
        ReduceOp::SumSquares => values.iter().map(|v| v * v).sum(),
        ReduceOp::MaxAbs => values.iter().fold(0.0f64, |max, v| max.max(v.abs())),
    }
}

fn map(x: &Val, f: impl Fn(f64) -> f64) -> Val {
    match x {
        Val::Element(values) => Val::Element(values.iter().map(|&v| f(v)).collect()),
        Val::Row(v) => Val::Row(f(*v)),
    }
}

fn zip(a: &Val, b: &Val, f: impl Fn(f64, f64) -> f64) -> Val {
    match (a, b) {
        (Val::Row(a), Val::Row(b)) => Val::Row(f(*a, *b)),
        (Val::Element(a), Val::Row(b)) => Val::Element(a.iter().map(|&a| f(a, *b)).collect()),
        (Val::Row(a), Val::Element(b)) => Val::Element(b.iter().map(|&b| f(*a, b)).collect()),
        (Val::Element(a), Val::Element(b)) => Val::Element(a.iter().zip(b).map(|(&a, &b)| f(a, b)).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BinaryOp, Builder, OutDType};
    use super::*;

    fn program(build: impl FnOnce(&mut Builder)) -> RowProgram {
        let mut b = RowProgram::builder("p");
        build(&mut b);
        b.build().unwrap()
    }

    #[test]
    fn each_step_rounds_where_it_says() {
        // 1 + 2^-30 is an f64 value but not an f32 one: kept wide, rounded to 1 in compute.
        let tiny = (-30f64).exp2();
        let p = program(|b| {
            let x = b.activation("x", 1);
            let v = b.load(x, 0);
            let c = b.constant(tiny);
            let wide = b.binary(BinaryOp::Add, v, c, Precision::Wide);
            let compute = b.binary(BinaryOp::Add, v, c, Precision::Compute);
            let back = b.binary(BinaryOp::Sub, wide, v, Precision::Wide);
            let lost = b.binary(BinaryOp::Sub, compute, v, Precision::Wide);
            b.store("back", back, OutDType::Fixed(DType::F64), None);
            b.store("lost", lost, OutDType::Fixed(DType::F64), None);
        });
        let x = Tensor::from_f64(DType::F32, &[1, 1], &[1.0]).unwrap();
        let out = p.run(&[RowArg::Tensor(&x)]).unwrap();
        assert_eq!(out[0].to_f64_vec().unwrap(), [tiny]);
        assert_eq!(out[1].to_f64_vec().unwrap(), [0.0]);
    }

    #[test]
    fn row_values_broadcast_and_reductions_honour_their_count() {
        let p = program(|b| {
            let x = b.activation("x", 1);
            let n = b.scalar("n");
            let v = b.load(x, 0);
            let count = b.param(n, Precision::Wide);
            let s = b.reduce(ReduceOp::Sum, v, Some(count), Precision::Wide);
            let y = b.binary(BinaryOp::Sub, v, s, Precision::Compute);
            let m = b.reduce(ReduceOp::MaxAbs, v, None, Precision::Wide);
            b.store("y", y, OutDType::Like(x), None);
            b.store("m", m, OutDType::Fixed(DType::F32), None);
        });
        let x = Tensor::from_f64(DType::F32, &[2, 3], &[1.0, 2.0, 4.0, -8.0, f64::NAN, 1.0]).unwrap();
        let out = p.run(&[RowArg::Tensor(&x), RowArg::Scalar(2.0)]).unwrap();
        let y = out[0].to_f64_vec().unwrap();
        assert_eq!(&y[..3], [-2.0, -1.0, 1.0]);
        assert!(y[3..].iter().all(|v| v.is_nan()), "the row's sum over its first 2 is NaN");
        assert_eq!(out[1].shape(), [2, 1]);
        assert_eq!(out[1].to_f64_vec().unwrap(), [4.0, 8.0], "max |x| ignores NaN");
        let error = p.run(&[RowArg::Tensor(&x), RowArg::Scalar(4.0)]).unwrap_err().to_string();
        assert!(error.contains("reduction count 4 is not an integer in 1..=3"), "{error}");
    }

    #[test]
    fn blocks_split_the_last_dimension() {
        let p = program(|b| {
            let x = b.activation("x", 2);
            let (g, u) = (b.load(x, 0), b.load(x, 1));
            let y = b.binary(BinaryOp::Mul, g, u, Precision::Like(x));
            b.store("y", y, OutDType::Like(x), None);
        });
        let x = Tensor::from_f64(DType::BF16, &[1, 4], &[2.0, 3.0, 5.0, 7.0]).unwrap();
        let out = p.run(&[RowArg::Tensor(&x)]).unwrap();
        assert_eq!(out[0].shape(), [1, 2]);
        assert_eq!(out[0].dtype(), DType::BF16);
        assert_eq!(out[0].to_f64_vec().unwrap(), [10.0, 21.0]);
    }

    #[test]
    fn arguments_that_do_not_fit_are_refused_naming_the_input() {
        let p = program(|b| {
            let x = b.activation("x", 2);
            let r = b.activation("r", 1);
            let w = b.weight("w");
            let s = b.scalar_tensor("s");
            let (g, v, wv, sv) = (b.load(x, 0), b.load(r, 0), b.load_weight(w), b.param(s, Precision::Wide));
            let y = b.binary(BinaryOp::Mul, g, v, Precision::Wide);
            let y = b.binary(BinaryOp::Mul, y, wv, Precision::Wide);
            let y = b.binary(BinaryOp::Mul, y, sv, Precision::Like(x));
            b.store("y", y, OutDType::Like(x), None);
        });
        let t = |shape: &[usize]| Tensor::zeros(DType::F32, shape).unwrap();
        let (x, r, w, s) = (t(&[3, 8]), t(&[3, 4]), t(&[4]), t(&[1]));
        let ok = [RowArg::Tensor(&x), RowArg::Tensor(&r), RowArg::Tensor(&w), RowArg::Tensor(&s)];
        assert_eq!(p.run(&ok).unwrap()[0].shape(), [3, 4]);
        let fails = |args: &[RowArg<'_>], needle: &str| {
            let error = p.run(args).unwrap_err().to_string();
            assert!(error.contains(needle), "{error}");
        };
        fails(&ok[..3], "takes 4 arguments, 3 given");
        let bad_r = t(&[2, 4]);
        fails(&[ok[0], RowArg::Tensor(&bad_r), ok[2], ok[3]], "argument `r`: has shape [2, 4], expected [3, 4]");
        let bad_w = t(&[8]);
        fails(&[ok[0], ok[1], RowArg::Tensor(&bad_w), ok[3]], "argument `w`: has shape [8], expected [4]");
        let bad_s = t(&[2]);
        fails(&[ok[0], ok[1], ok[2], RowArg::Tensor(&bad_s)], "argument `s`: has shape [2], expected one element");
        fails(&[ok[0], ok[1], ok[2], RowArg::Scalar(1.0)], "argument `s`: must be a tensor");
        let odd = t(&[3, 7]);
        fails(&[RowArg::Tensor(&odd), ok[1], ok[2], ok[3]], "last dimension 7 is not 2 blocks");
        let ints = Tensor::zeros(DType::I64, &[3, 8]).unwrap();
        fails(&[RowArg::Tensor(&ints), ok[1], ok[2], ok[3]], "not a compute dtype");
    }
}
