//! Row programs: a memory-bound computation over the rows of its activations, described once as
//! data, with a reference interpreter that defines its semantics.
//!
//! A program maps every row of its activations (the last dimension; every other dimension counts
//! rows) independently. Its row width `W` is the width of one *block*: an activation's last
//! dimension holds one or more blocks of `W` elements (a gated activation's gate and up halves are
//! two). A program is:
//!
//! - **inputs** ([`Input`]): activations (read per element, possibly several blocks of a row), weights
//!   (one vector of `W` elements every row shares: a norm's weight), scalars (an `f64` argument,
//!   such as epsilon), scalar tensors (a one-element `f32` tensor, such as a quantization's scale),
//!   positions (one `i64` per group of consecutive rows: a token's heads) and a rotary cos/sin cache
//!   read at them;
//! - **steps** ([`Step`]), in order, each defining one value: per element (a vector of `W`) or per
//!   row (one number). Loads, constants, elementwise unary and binary operations (a row value
//!   broadcasts over the row), row reductions (sum, sum of squares, max |x|, over the whole row or
//!   its first `n` elements) whose results are row values, and the rotary steps: a column's cosine
//!   and signed sine at the row's position, and a value at the column paired with it;
//! - **outputs** ([`Output`]): element values stored as a tensor of the activations' rows (fresh, or
//!   in place of an activation, which makes an implementation in place) and row values stored as
//!   one value per row (a per-token scale: the activations' shape with last dimension 1).
//!
//! # Semantics and rounding points
//!
//! Every value is held as an `f64`. A step computes its result from its operands in `f64` (a load
//! reads the stored element exactly, an operation is one `f64` operation or libm function, a
//! reduction folds the row in column order) and then rounds it to its [`Precision`]:
//! [`Precision::Wide`] keeps the `f64`, [`Precision::Compute`] rounds to the compute dtype `c` (f32,
//! or f64 for f64 activations: one `f64` operation on f32 operands rounded once to f32 is exactly
//! f32 arithmetic), [`Precision::Like`] to an input's dtype and [`Precision::Dtype`] to a fixed one
//! (fp8 saturates, as [`DType::round`] does). A store rounds to its output's dtype. These are the
//! rounding points of the ops' native references, so a built-in op expressed as a program gives its
//! reference's bits ([`builtin`]).
//!
//! The reference interpreter ([`RowProgram::run`]) folds a reduction sequentially in `f64`. A
//! generated kernel reduces in its backend class's fixed order (the cpu kernels' 32 lanes, a GPU
//! block's tree), as the hand-written kernels do, and meets the op's tolerance where that order
//! changes the bits.
//!
//! # Rotation
//!
//! A cos/sin cache `[max_position, R]` (`R` even, at most `W`: `R/2` cosines, then `R/2` sines per
//! position) pairs the first `R` columns of a row: NeoX-style `(i, R/2 + i)`, GPT-J-style
//! `(2i, 2i + 1)`, for `i < R/2`. At the row's position `p`, [`Op::Cos`] is `cache[p][i]` on both
//! columns of pair `i`, [`Op::Sin`] is `-cache[p][R/2 + i]` on its first column and
//! `+cache[p][R/2 + i]` on its second, and [`Op::Pair`] of `x` is `x` at the other column of the
//! pair. Past the rotated columns they are `1`, `+0` and `-0`, so the rotation
//! `x · cos + pair(x) · sin` ([`Builder::rotate`]) leaves those columns exactly as they are (an
//! infinity included). A position outside the cache is refused by the reference interpreter and
//! the cpu; a generated GPU kernel, which cannot report it, leaves its rows unrotated (every column
//! as past the rotated ones), as the hand-written rotary kernels do.
//!
//! # Text and identity
//!
//! A program prints as text ([`std::fmt::Display`]), one line per input, step and output, and its
//! [`RowProgram::fingerprint`] hashes that text: the key under which code generated from it is
//! cached, stable across processes and toolchains.
//!
//! ```
//! use ir_core::{DType, Tensor};
//! use ir_ops::row_program::{BinaryOp, Precision, RowProgram, RowArg, UnaryOp};
//!
//! // y = exp(x) * 2, rounded to x's dtype.
//! let mut b = RowProgram::builder("exp_twice");
//! let x = b.activation("x", 1);
//! let v = b.load(x, 0);
//! let e = b.unary(UnaryOp::Exp, v, Precision::Compute);
//! let two = b.constant(2.0);
//! let y = b.binary(BinaryOp::Mul, e, two, Precision::Like(x));
//! b.store("y", y, ir_ops::row_program::OutDType::Like(x), None);
//! let program = b.build()?;
//!
//! let input = Tensor::from_f32(DType::F32, &[1, 2], &[0.0, 1.0])?;
//! let out = program.run(&[RowArg::Tensor(&input)])?;
//! assert_eq!(out[0].to_f64_vec()?, [2.0, (1f32.exp() * 2.0) as f64]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod builtin;
mod interp;
mod schedule;

use std::fmt;

use ir_core::DType;

pub use interp::{Binding, InPlaceArg, RowArg};
pub use schedule::Schedule;

/// A step's value: the index of the step that defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// An input's position in the program's argument list.
pub type InputId = usize;

/// What a program reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// A tensor whose rows the program maps; its last dimension holds `blocks` blocks of the row
    /// width (2 for a gated activation's gate and up).
    Activation {
        /// Blocks of the row width in the last dimension (at least 1).
        blocks: usize,
    },
    /// A vector of the row width every row shares (a norm's weight).
    Weight,
    /// An `f64` argument.
    Scalar,
    /// A one-element tensor (a quantization's scale), read as one value.
    ScalarTensor,
    /// Token positions: `i64`, one per group of consecutive rows (the rows split evenly among
    /// them: row `r` of `n` rows reads position `r / (n / positions)`, a token's heads).
    Positions,
    /// A rotary cos/sin cache `[max_position, R]` of a compute dtype, read at the row's position of
    /// input `positions`, its columns paired NeoX-style (`neox`) or GPT-J-style (see the module's
    /// "Rotation").
    CosSinCache {
        /// The positions input.
        positions: InputId,
        /// NeoX-style pairs `(i, R/2 + i)`, else GPT-J-style `(2i, 2i + 1)`.
        neox: bool,
    },
}

impl InputKind {
    /// Whether the argument is a tensor.
    pub fn is_tensor(&self) -> bool {
        !matches!(self, InputKind::Scalar)
    }

    /// Whether the argument is a tensor of a compute dtype (every tensor but positions), which a
    /// precision or an output's dtype may name.
    pub fn has_compute_dtype(&self) -> bool {
        !matches!(self, InputKind::Scalar | InputKind::Positions)
    }
}

/// One input: its name and kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Input {
    /// The parameter's name.
    pub name: String,
    /// What it is.
    pub kind: InputKind,
}

/// Where a step rounds its `f64` result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Not rounded: the `f64` result (a reduction's sum, a libm function composed further).
    Wide,
    /// The compute dtype: f32, or f64 when the first activation is f64.
    Compute,
    /// The dtype of a tensor input.
    Like(InputId),
    /// A fixed dtype (an fp8 dtype saturates).
    Dtype(DType),
}

/// An elementwise function of one value, computed in `f64` (libm's where `std` has none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `|x|`.
    Abs,
    /// `e^x`.
    Exp,
    /// `tanh x`.
    Tanh,
    /// `erf x`.
    Erf,
    /// `erfc x = 1 - erf x` without the cancellation.
    Erfc,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
    /// `√x`.
    Sqrt,
    /// `1 / x`.
    Recip,
    /// `x < 0 ? 0 : x` (NaN and `-0` stay as they are).
    Relu,
    /// `x` itself: a step that only rounds (a conversion with an explicit rounding point).
    Round,
}

impl UnaryOp {
    /// The function in `f64`: the reference semantics every executor follows.
    pub fn eval(self, v: f64) -> f64 {
        match self {
            UnaryOp::Neg => -v,
            UnaryOp::Abs => v.abs(),
            UnaryOp::Exp => v.exp(),
            UnaryOp::Tanh => v.tanh(),
            UnaryOp::Erf => libm::erf(v),
            UnaryOp::Erfc => libm::erfc(v),
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-v).exp()),
            UnaryOp::Sqrt => v.sqrt(),
            UnaryOp::Recip => 1.0 / v,
            UnaryOp::Relu => {
                if v < 0.0 {
                    0.0
                } else {
                    v
                }
            }
            UnaryOp::Round => v,
        }
    }
}

/// An elementwise function of two values (a row value broadcasts over the row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a · b`.
    Mul,
    /// `a / b`.
    Div,
    /// The smaller, `-0` below `+0`; a NaN operand gives the other (IEEE 754-2019
    /// `minimumNumber`).
    Min,
    /// The larger, `+0` above `-0`; a NaN operand gives the other (IEEE 754-2019
    /// `maximumNumber`).
    Max,
}

impl BinaryOp {
    /// The function in `f64`: the reference semantics every executor follows.
    pub fn eval(self, a: f64, b: f64) -> f64 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Min => minimum_number(a, b),
            BinaryOp::Max => maximum_number(a, b),
        }
    }
}

/// IEEE 754-2019 `minimumNumber`: the smaller, `-0` below `+0`, NaN only when both are. (`f64::min`
/// leaves the sign of a zero result unspecified; every executor spells this rule out.)
pub fn minimum_number(a: f64, b: f64) -> f64 {
    if a < b || (a == b && a.is_sign_negative()) || b.is_nan() { a } else { b }
}

/// IEEE 754-2019 `maximumNumber`: the larger, `+0` above `-0`, NaN only when both are.
pub fn maximum_number(a: f64, b: f64) -> f64 {
    if a > b || (a == b && b.is_sign_negative()) || b.is_nan() { a } else { b }
}

/// A row reduction: its result is a row value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// `Σ x`.
    Sum,
    /// `Σ x²`.
    SumSquares,
    /// `max |x|`, NaN elements ignored, 0 for an empty row (fmax semantics).
    MaxAbs,
}

/// What a step computes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    /// Block `block` of activation `input`'s row, per element.
    Load {
        /// The activation.
        input: InputId,
        /// The block of its last dimension.
        block: usize,
    },
    /// A weight's element of the column, per element.
    Weight {
        /// The weight.
        input: InputId,
    },
    /// A scalar or scalar tensor input's value, per row.
    Param {
        /// The input.
        input: InputId,
    },
    /// A constant, per row.
    Const(f64),
    /// The row width `W`, per row.
    Width,
    /// An elementwise function.
    Unary(UnaryOp, ValueId),
    /// An elementwise function of two values.
    Binary(BinaryOp, ValueId, ValueId),
    /// The cosine of each column's rotation at the row's position in cos/sin cache `cache`, per
    /// element (1 past the rotated columns).
    Cos {
        /// The cache.
        cache: InputId,
    },
    /// The signed sine of each column's rotation: `-sin` on the first column of a pair, `+sin` on
    /// the second, `+0` past the rotated columns.
    Sin {
        /// The cache.
        cache: InputId,
    },
    /// Element value `x` at the column paired with each column by cache `cache` (`-0` past the
    /// rotated columns).
    Pair {
        /// The value read at the partner column.
        x: ValueId,
        /// The cache whose pairs (rotated width and style) it follows.
        cache: InputId,
    },
    /// A reduction of an element value over the row's first `count` elements (a row value whose
    /// value is an integer in `1..=W`), or over the whole row.
    Reduce {
        /// The reduction.
        op: ReduceOp,
        /// The element value reduced.
        x: ValueId,
        /// How many leading elements, when not all.
        count: Option<ValueId>,
    },
}

/// Whether a value is one per element of the row or one per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Extent {
    /// A vector of the row width.
    Element,
    /// One value per row.
    Row,
}

/// One step: its operation, the precision its result rounds to and (computed) its extent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    /// What it computes.
    pub op: Op,
    /// Where its result rounds.
    pub precision: Precision,
    /// Per element or per row.
    pub extent: Extent,
}

/// An output's dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutDType {
    /// A tensor input's.
    Like(InputId),
    /// A fixed one.
    Fixed(DType),
}

/// One output: a value stored as a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    /// Its name.
    pub name: String,
    /// The stored value (an element value: the rows' shape with last dimension `W`; a row value:
    /// last dimension 1).
    pub value: ValueId,
    /// Its dtype (the store rounds to it).
    pub dtype: OutDType,
    /// The activation it is written into in place, if any (one block, its dtype, element value).
    pub in_place_of: Option<InputId>,
}

/// Column `j`'s place in the pairs of a cache of `rotated` columns (`R`): its pair's index `i`
/// (the cache column of its cosine; its sine's is `R/2 + i`), whether it is the pair's first column,
/// and its partner column; `None` past the rotated columns.
pub fn rotary_column(j: usize, rotated: usize, neox: bool) -> Option<(usize, bool, usize)> {
    let half = rotated / 2;
    match (j < rotated, neox) {
        (false, _) => None,
        (true, true) if j < half => Some((j, true, j + half)),
        (true, true) => Some((j - half, false, j - half)),
        (true, false) => Some((j / 2, j.is_multiple_of(2), j ^ 1)),
    }
}

/// Why a program is not well formed (found by [`Builder::build`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProgramError {
    /// Two inputs or two outputs share a name.
    #[error("row program `{program}`: the name `{name}` is used twice")]
    DuplicateName {
        /// The program.
        program: String,
        /// The name.
        name: String,
    },
    /// No activation gives the program its rows.
    #[error("row program `{program}` has no activation input")]
    NoActivation {
        /// The program.
        program: String,
    },
    /// A step or output is wrong; the reason names it.
    #[error("row program `{program}`: {what}: {reason}")]
    Invalid {
        /// The program.
        program: String,
        /// The step (`%3`) or output (`out`).
        what: String,
        /// Why.
        reason: String,
    },
}

/// Why a program's call was refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// An argument does not fit the program.
    #[error("row program `{program}`, argument `{param}`: {reason}")]
    Argument {
        /// The program.
        program: String,
        /// The input's name.
        param: String,
        /// Why.
        reason: String,
    },
    /// The call has too many or too few arguments.
    #[error("row program `{program}` takes {expected} arguments, {found} given")]
    Arity {
        /// The program.
        program: String,
        /// Its input count.
        expected: usize,
        /// Arguments given.
        found: usize,
    },
    /// A reduction's count is not an integer in `1..=W` in some row.
    #[error("row program `{program}`, {step}: reduction count {count} is not an integer in 1..={width}")]
    Count {
        /// The program.
        program: String,
        /// The step.
        step: ValueId,
        /// The count.
        count: f64,
        /// The row width.
        width: usize,
    },
    /// Reading or building a tensor failed.
    #[error(transparent)]
    Tensor(#[from] ir_core::TensorError),
}

impl From<RunError> for ir_core::KernelError {
    /// A refused call, as the executors report it: invalid arguments, with the reason.
    fn from(error: RunError) -> ir_core::KernelError {
        ir_core::KernelError::InvalidArguments { reason: error.to_string() }
    }
}

/// A row program: inputs, steps and outputs, well formed (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct RowProgram {
    name: String,
    inputs: Vec<Input>,
    steps: Vec<Step>,
    outputs: Vec<Output>,
    /// The text's hash, computed once by [`Builder::build`].
    fingerprint: u64,
}

impl RowProgram {
    /// A builder for a program named `name`.
    pub fn builder(name: impl Into<String>) -> Builder {
        Builder {
            program: RowProgram {
                name: name.into(),
                inputs: Vec::new(),
                steps: Vec::new(),
                outputs: Vec::new(),
                fingerprint: 0,
            },
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its inputs, in argument order.
    pub fn inputs(&self) -> &[Input] {
        &self.inputs
    }

    /// Its steps; step `i` defines [`ValueId`]`(i)`.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Its outputs, in result order.
    pub fn outputs(&self) -> &[Output] {
        &self.outputs
    }

    /// Whether an output is written in place of an activation (an implementation of the program is
    /// then in place).
    pub fn is_inplace(&self) -> bool {
        self.outputs.iter().any(|output| output.in_place_of.is_some())
    }

    /// The number of row reductions.
    pub fn reductions(&self) -> usize {
        self.steps.iter().filter(|step| matches!(step.op, Op::Reduce { .. })).count()
    }

    /// The cos/sin cache the program's rotary steps ([`Op::Cos`], [`Op::Sin`], [`Op::Pair`]) read
    /// (one per program), if it has any.
    pub fn rotary_cache(&self) -> Option<InputId> {
        self.steps.iter().find_map(|step| match step.op {
            Op::Cos { cache } | Op::Sin { cache } | Op::Pair { cache, .. } => Some(cache),
            _ => None,
        })
    }

    /// A 64-bit FNV-1a hash of the program's text: equal for equal programs, stable across
    /// processes and toolchains (the key of generated code's caches), computed once when the program
    /// is built.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    fn step(&self, value: ValueId) -> Option<&Step> {
        self.steps.get(value.0 as usize)
    }

    fn input_name(&self, input: InputId) -> &str {
        self.inputs.get(input).map_or("?", |i| i.name.as_str())
    }
}

/// Builds a [`RowProgram`]: each method adds an input, a step or an output; [`Builder::build`]
/// checks the whole program.
#[derive(Debug)]
pub struct Builder {
    program: RowProgram,
}

impl Builder {
    fn input(&mut self, name: &str, kind: InputKind) -> InputId {
        self.program.inputs.push(Input { name: name.to_owned(), kind });
        self.program.inputs.len() - 1
    }

    fn push(&mut self, op: Op, precision: Precision) -> ValueId {
        // The extent is computed by `build`, which checks the operands first.
        self.program.steps.push(Step { op, precision, extent: Extent::Element });
        ValueId(u32::try_from(self.program.steps.len() - 1).unwrap_or(u32::MAX))
    }

    /// An activation with `blocks` blocks of the row width in its last dimension.
    pub fn activation(&mut self, name: &str, blocks: usize) -> InputId {
        self.input(name, InputKind::Activation { blocks })
    }

    /// A weight: `W` elements every row shares.
    pub fn weight(&mut self, name: &str) -> InputId {
        self.input(name, InputKind::Weight)
    }

    /// An `f64` argument.
    pub fn scalar(&mut self, name: &str) -> InputId {
        self.input(name, InputKind::Scalar)
    }

    /// A one-element tensor argument.
    pub fn scalar_tensor(&mut self, name: &str) -> InputId {
        self.input(name, InputKind::ScalarTensor)
    }

    /// Token positions (`i64`, one per group of consecutive rows).
    pub fn positions(&mut self, name: &str) -> InputId {
        self.input(name, InputKind::Positions)
    }

    /// A rotary cos/sin cache read at `positions`, with NeoX-style pairs when `neox` (else GPT-J).
    pub fn cos_sin_cache(&mut self, name: &str, positions: InputId, neox: bool) -> InputId {
        self.input(name, InputKind::CosSinCache { positions, neox })
    }

    /// Each column's rotation cosine from `cache` (exact).
    pub fn cos(&mut self, cache: InputId) -> ValueId {
        self.push(Op::Cos { cache }, Precision::Wide)
    }

    /// Each column's signed rotation sine from `cache` (exact).
    pub fn sin(&mut self, cache: InputId) -> ValueId {
        self.push(Op::Sin { cache }, Precision::Wide)
    }

    /// Element value `x` at each column's partner in `cache`'s pairs (exact).
    pub fn pair(&mut self, x: ValueId, cache: InputId) -> ValueId {
        self.push(Op::Pair { x, cache }, Precision::Wide)
    }

    /// The rotation of element value `x` by `cache`: `x · cos + pair(x) · sin`, each product rounded
    /// to `products`, the sum to `precision` (vLLM's rotary: products and sum in f32, or each
    /// rounded to the activation's dtype).
    pub fn rotate(&mut self, x: ValueId, cache: InputId, products: Precision, precision: Precision) -> ValueId {
        let (cos, sin, partner) = (self.cos(cache), self.sin(cache), self.pair(x, cache));
        let straight = self.binary(BinaryOp::Mul, x, cos, products);
        let crossed = self.binary(BinaryOp::Mul, partner, sin, products);
        self.binary(BinaryOp::Add, straight, crossed, precision)
    }

    /// Block `block` of activation `input`, per element, exactly (every stored dtype is exact in
    /// `f64`).
    pub fn load(&mut self, input: InputId, block: usize) -> ValueId {
        self.push(Op::Load { input, block }, Precision::Wide)
    }

    /// Weight `input`'s element of each column (exact).
    pub fn load_weight(&mut self, input: InputId) -> ValueId {
        self.push(Op::Weight { input }, Precision::Wide)
    }

    /// Scalar or scalar tensor `input`'s value, rounded to `precision`.
    pub fn param(&mut self, input: InputId, precision: Precision) -> ValueId {
        self.push(Op::Param { input }, precision)
    }

    /// A constant row value.
    pub fn constant(&mut self, value: f64) -> ValueId {
        self.push(Op::Const(value), Precision::Wide)
    }

    /// The row width, as a row value.
    pub fn width(&mut self) -> ValueId {
        self.push(Op::Width, Precision::Wide)
    }

    /// `op(x)` rounded to `precision`.
    pub fn unary(&mut self, op: UnaryOp, x: ValueId, precision: Precision) -> ValueId {
        self.push(Op::Unary(op, x), precision)
    }

    /// `op(a, b)` rounded to `precision`.
    pub fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId, precision: Precision) -> ValueId {
        self.push(Op::Binary(op, a, b), precision)
    }

    /// `x` rounded to `precision` (a conversion with an explicit rounding point).
    pub fn round(&mut self, x: ValueId, precision: Precision) -> ValueId {
        self.push(Op::Unary(UnaryOp::Round, x), precision)
    }

    /// The reduction of `x` over the row (or its first `count` elements), rounded to `precision`.
    pub fn reduce(&mut self, op: ReduceOp, x: ValueId, count: Option<ValueId>, precision: Precision) -> ValueId {
        self.push(Op::Reduce { op, x, count }, precision)
    }

    /// Stores `value` as output `name` of `dtype`, fresh or in place of activation `in_place_of`.
    pub fn store(&mut self, name: &str, value: ValueId, dtype: OutDType, in_place_of: Option<InputId>) {
        self.program.outputs.push(Output { name: name.to_owned(), value, dtype, in_place_of });
    }

    /// The program, checked: names unique, an activation, every operand defined before its use and
    /// of the extent its use needs, every input reference of the right kind, in-place outputs of
    /// their activation's dtype written once each.
    pub fn build(self) -> Result<RowProgram, ProgramError> {
        let mut program = self.program;
        let invalid = |program: &RowProgram, what: String, reason: String| ProgramError::Invalid {
            program: program.name.clone(),
            what,
            reason,
        };
        for (names, _) in [
            (program.inputs.iter().map(|i| &i.name).collect::<Vec<_>>(), ()),
            (program.outputs.iter().map(|o| &o.name).collect(), ()),
        ] {
            for (index, name) in names.iter().enumerate() {
                if names[..index].contains(name) {
                    return Err(ProgramError::DuplicateName { program: program.name.clone(), name: (*name).clone() });
                }
            }
        }
        if !program.inputs.iter().any(|i| matches!(i.kind, InputKind::Activation { .. })) {
            return Err(ProgramError::NoActivation { program: program.name.clone() });
        }
        let tensor_input = |program: &RowProgram, input: InputId| {
            program.inputs.get(input).is_some_and(|i| i.kind.has_compute_dtype())
        };
        for input in &program.inputs {
            if let InputKind::CosSinCache { positions, .. } = input.kind
                && !matches!(program.inputs.get(positions).map(|i| &i.kind), Some(InputKind::Positions))
            {
                return Err(invalid(
                    &program,
                    format!("input `{}`", input.name),
                    format!("reads its rows at input {positions}, which is no positions input"),
                ));
            }
        }
        let is_cache = |program: &RowProgram, input: InputId| {
            matches!(program.inputs.get(input).map(|i| &i.kind), Some(InputKind::CosSinCache { .. }))
        };
        let mut rotary_cache: Option<InputId> = None;
        for index in 0..program.steps.len() {
            let step = program.steps[index];
            let what = format!("{}", ValueId(index as u32));
            let operand = |program: &RowProgram, value: ValueId| -> Result<Extent, ProgramError> {
                if (value.0 as usize) < index {
                    Ok(program.steps[value.0 as usize].extent)
                } else {
                    Err(invalid(program, what.clone(), format!("operand {value} is not defined before it")))
                }
            };
            if let Precision::Like(input) = step.precision
                && !tensor_input(&program, input)
            {
                return Err(invalid(
                    &program,
                    what,
                    format!("rounds like input {input}, which is no tensor of a compute dtype"),
                ));
            }
            let extent = match step.op {
                Op::Load { input, block } => match program.inputs.get(input).map(|i| &i.kind) {
                    Some(InputKind::Activation { blocks }) if block < *blocks => Extent::Element,
                    Some(InputKind::Activation { blocks }) => {
                        return Err(invalid(&program, what, format!("loads block {block} of {blocks}")));
                    }
                    _ => return Err(invalid(&program, what, format!("loads input {input}, which is no activation"))),
                },
                Op::Weight { input } => match program.inputs.get(input).map(|i| &i.kind) {
                    Some(InputKind::Weight) => Extent::Element,
                    _ => return Err(invalid(&program, what, format!("reads input {input} as a weight"))),
                },
                Op::Param { input } => match program.inputs.get(input).map(|i| &i.kind) {
                    Some(InputKind::Scalar | InputKind::ScalarTensor) => Extent::Row,
                    _ => return Err(invalid(&program, what, format!("reads input {input} as a scalar"))),
                },
                Op::Const(_) | Op::Width => Extent::Row,
                Op::Cos { cache } | Op::Sin { cache } | Op::Pair { cache, .. } => {
                    if !is_cache(&program, cache) {
                        return Err(invalid(&program, what, format!("reads input {cache} as a cos/sin cache")));
                    }
                    if *rotary_cache.get_or_insert(cache) != cache {
                        return Err(invalid(
                            &program,
                            what,
                            "reads another cos/sin cache than an earlier rotary step: a program pairs its columns one way"
                                .to_owned(),
                        ));
                    }
                    if let Op::Pair { x, .. } = step.op
                        && operand(&program, x)? != Extent::Element
                    {
                        return Err(invalid(&program, what, format!("pairs {x}, a row value")));
                    }
                    Extent::Element
                }
                Op::Unary(_, x) => operand(&program, x)?,
                Op::Binary(_, a, b) => match (operand(&program, a)?, operand(&program, b)?) {
                    (Extent::Row, Extent::Row) => Extent::Row,
                    _ => Extent::Element,
                },
                Op::Reduce { x, count, .. } => {
                    if operand(&program, x)? != Extent::Element {
                        return Err(invalid(&program, what, format!("reduces {x}, a row value")));
                    }
                    if let Some(count) = count
                        && operand(&program, count)? != Extent::Row
                    {
                        return Err(invalid(&program, what, format!("counts with {count}, an element value")));
                    }
                    Extent::Row
                }
            };
            program.steps[index].extent = extent;
        }
        let mut written = Vec::new();
        for output in &program.outputs {
            let what = format!("output `{}`", output.name);
            let Some(step) = program.step(output.value) else {
                return Err(invalid(&program, what, format!("stores {}, which no step defines", output.value)));
            };
            if let OutDType::Like(input) = output.dtype
                && !tensor_input(&program, input)
            {
                return Err(invalid(
                    &program,
                    what,
                    format!("has the dtype of input {input}, which is no tensor of a compute dtype"),
                ));
            }
            if let Some(input) = output.in_place_of {
                let one_block =
                    matches!(program.inputs.get(input).map(|i| &i.kind), Some(InputKind::Activation { blocks: 1 }));
                if !one_block {
                    return Err(invalid(
                        &program,
                        what,
                        format!("is written in place of input {input}, which is no one-block activation"),
                    ));
                }
                if output.dtype != OutDType::Like(input) || step.extent != Extent::Element {
                    return Err(invalid(
                        &program,
                        what,
                        "an in-place output is an element value of its activation's dtype".to_owned(),
                    ));
                }
                if written.contains(&input) {
                    return Err(invalid(
                        &program,
                        what,
                        format!("`{}` is written in place twice", program.input_name(input)),
                    ));
                }
                written.push(input);
            }
        }
        program.fingerprint = program
            .to_string()
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3));
        Ok(program)
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Precision::Wide => f.write_str("wide"),
            Precision::Compute => f.write_str("compute"),
            Precision::Like(input) => write!(f, "like #{input}"),
            Precision::Dtype(dtype) => write!(f, "{dtype}"),
        }
    }
}

impl fmt::Display for RowProgram {
    /// One line per input, step and output:
    /// `row_program rms_norm`, `input #0 x: activation(1)`, `%3 = sum_squares %0 : wide`,
    /// `output out = %9 : like #0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "row_program {}", self.name)?;
        for (index, input) in self.inputs.iter().enumerate() {
            let kind = match input.kind {
                InputKind::Activation { blocks } => format!("activation({blocks})"),
                InputKind::Weight => "weight".to_owned(),
                InputKind::Scalar => "scalar".to_owned(),
                InputKind::ScalarTensor => "scalar_tensor".to_owned(),
                InputKind::Positions => "positions".to_owned(),
                InputKind::CosSinCache { positions, neox } => {
                    format!("cos_sin_cache(#{positions}, {})", if neox { "neox" } else { "gptj" })
                }
            };
            writeln!(f, "input #{index} {}: {kind}", input.name)?;
        }
        for (index, step) in self.steps.iter().enumerate() {
            let op = match step.op {
                Op::Load { input, block } => format!("load #{input}[{block}]"),
                Op::Weight { input } => format!("weight #{input}"),
                Op::Param { input } => format!("param #{input}"),
                // Bits, so the text (and the fingerprint) tells every constant apart.
                Op::Const(value) => format!("const {value:e} ({:#018x})", value.to_bits()),
                Op::Width => "width".to_owned(),
                Op::Cos { cache } => format!("cos #{cache}"),
                Op::Sin { cache } => format!("sin #{cache}"),
                Op::Pair { x, cache } => format!("pair {x} by #{cache}"),
                Op::Unary(op, x) => format!("{} {x}", format!("{op:?}").to_lowercase()),
                Op::Binary(op, a, b) => format!("{} {a}, {b}", format!("{op:?}").to_lowercase()),
                Op::Reduce { op, x, count } => {
                    let name = match op {
                        ReduceOp::Sum => "sum",
                        ReduceOp::SumSquares => "sum_squares",
                        ReduceOp::MaxAbs => "max_abs",
                    };
                    match count {
                        Some(count) => format!("{name} {x} first {count}"),
                        None => format!("{name} {x}"),
                    }
                }
            };
            let extent = match step.extent {
                Extent::Element => "",
                Extent::Row => " row",
            };
            writeln!(f, "%{index} = {op} : {}{extent}", step.precision)?;
        }
        for output in &self.outputs {
            let dtype = match output.dtype {
                OutDType::Like(input) => format!("like #{input}"),
                OutDType::Fixed(dtype) => dtype.to_string(),
            };
            match output.in_place_of {
                Some(input) => writeln!(f, "output {} = {} : {dtype} in place of #{input}", output.name, output.value)?,
                None => writeln!(f, "output {} = {} : {dtype}", output.name, output.value)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Builder {
        let mut b = RowProgram::builder("tiny");
        let x = b.activation("x", 1);
        let v = b.load(x, 0);
        b.store("y", v, OutDType::Like(x), None);
        b
    }

    #[test]
    fn a_well_formed_program_builds_and_prints() {
        let mut b = RowProgram::builder("norm");
        let x = b.activation("x", 1);
        let eps = b.scalar("epsilon");
        let v = b.load(x, 0);
        let ss = b.reduce(ReduceOp::SumSquares, v, None, Precision::Wide);
        let e = b.param(eps, Precision::Compute);
        let t = b.binary(BinaryOp::Add, ss, e, Precision::Compute);
        let y = b.binary(BinaryOp::Mul, v, t, Precision::Like(x));
        b.store("y", y, OutDType::Like(x), Some(x));
        let program = b.build().unwrap();
        assert_eq!(program.steps()[ss.0 as usize].extent, Extent::Row);
        assert_eq!(program.steps()[y.0 as usize].extent, Extent::Element);
        assert!(program.is_inplace());
        assert_eq!(program.reductions(), 1);
        let text = program.to_string();
        assert!(text.contains("%1 = sum_squares %0 : wide row"), "{text}");
        assert!(text.contains("output y = %4 : like #0 in place of #0"), "{text}");
    }

    #[test]
    fn the_fingerprint_tells_programs_apart() {
        let a = tiny().build().unwrap();
        assert_eq!(a.fingerprint(), tiny().build().unwrap().fingerprint());
        let mut b = tiny();
        let c = b.constant(1.0);
        b.store("z", c, OutDType::Fixed(DType::F32), None);
        assert_ne!(a.fingerprint(), b.build().unwrap().fingerprint());
        // Constants that print alike are told apart by their bits.
        let with = |value: f64| {
            let mut b = tiny();
            let c = b.constant(value);
            b.store("z", c, OutDType::Fixed(DType::F32), None);
            b.build().unwrap().fingerprint()
        };
        assert_ne!(with(0.0), with(-0.0));
    }

    #[test]
    fn malformed_programs_are_refused_with_what_is_wrong() {
        let refused = |b: Builder, needle: &str| {
            let error = b.build().unwrap_err().to_string();
            assert!(error.contains(needle), "{error}");
        };
        let mut b = RowProgram::builder("p");
        let s = b.scalar("s");
        let v = b.param(s, Precision::Wide);
        b.store("y", v, OutDType::Fixed(DType::F32), None);
        refused(b, "no activation input");

        let mut b = tiny();
        b.activation("x", 1);
        refused(b, "`x` is used twice");

        let mut b = tiny();
        b.push(Op::Unary(UnaryOp::Exp, ValueId(5)), Precision::Wide);
        refused(b, "operand %5 is not defined before it");

        let mut b = tiny();
        b.load(0, 1);
        refused(b, "loads block 1 of 1");

        let mut b = tiny();
        let c = b.constant(1.0);
        b.reduce(ReduceOp::Sum, c, None, Precision::Wide);
        refused(b, "a row value");

        let mut b = tiny();
        let s = b.scalar("s");
        b.load(s, 0);
        refused(b, "no activation");

        let mut b = tiny();
        let s = b.scalar("s");
        b.round(ValueId(0), Precision::Like(s));
        refused(b, "which is no tensor of a compute dtype");

        let mut b = RowProgram::builder("p");
        let x = b.activation("x", 2);
        let v = b.load(x, 0);
        b.store("y", v, OutDType::Like(x), Some(x));
        refused(b, "no one-block activation");

        let mut b = RowProgram::builder("p");
        let x = b.activation("x", 1);
        let v = b.load(x, 0);
        b.store("y", v, OutDType::Like(x), Some(x));
        b.store("z", v, OutDType::Like(x), Some(x));
        refused(b, "written in place twice");

        let mut b = RowProgram::builder("p");
        let x = b.activation("x", 1);
        let v = b.load(x, 0);
        let r = b.reduce(ReduceOp::Sum, v, None, Precision::Wide);
        b.store("y", r, OutDType::Like(x), Some(x));
        refused(b, "an in-place output is an element value");

        let mut b = tiny();
        b.store("z", ValueId(9), OutDType::Fixed(DType::F32), None);
        refused(b, "which no step defines");

        let mut b = tiny();
        let s = b.scalar("s");
        b.cos_sin_cache("cache", s, true);
        refused(b, "input `cache`: reads its rows at input 1, which is no positions input");

        let mut b = tiny();
        b.pair(ValueId(0), 0);
        refused(b, "reads input 0 as a cos/sin cache");

        let mut b = tiny();
        b.cos(0);
        refused(b, "reads input 0 as a cos/sin cache");

        let mut b = tiny();
        let p = b.positions("p");
        let (one, two) = (b.cos_sin_cache("one", p, true), b.cos_sin_cache("two", p, false));
        b.pair(ValueId(0), one);
        b.sin(two);
        refused(b, "reads another cos/sin cache than an earlier rotary step");

        let mut b = tiny();
        let p = b.positions("p");
        let cache = b.cos_sin_cache("cache", p, true);
        let c = b.constant(1.0);
        b.pair(c, cache);
        refused(b, "pairs %1, a row value");

        let mut b = tiny();
        let p = b.positions("p");
        b.round(ValueId(0), Precision::Like(p));
        refused(b, "rounds like input 1, which is no tensor of a compute dtype");
    }

    #[test]
    fn columns_pair_neox_and_gptj_style_and_rotations_print() {
        assert_eq!(rotary_column(1, 8, true), Some((1, true, 5)));
        assert_eq!(rotary_column(5, 8, true), Some((1, false, 1)));
        assert_eq!(rotary_column(4, 8, false), Some((2, true, 5)));
        assert_eq!(rotary_column(5, 8, false), Some((2, false, 4)));
        assert_eq!(rotary_column(8, 8, true), None);
        let program = builtin::rotary(false, crate::Rounding::Exact);
        assert_eq!(program.rotary_cache(), Some(2));
        let text = program.to_string();
        assert!(text.contains("input #2 cos_sin_cache: cos_sin_cache(#0, gptj)"), "{text}");
        assert!(text.contains("%3 = pair %0 by #2 : wide"), "{text}");
    }
}
