//! The errors an op's functions and its implementations return: a kernel's (the native reference
//! is one) and, with [`MetaError`](crate::op::MetaError), what a meta function refuses.

use std::fmt;

use crate::TensorError;

/// An error an implementation returns.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A tensor operation inside the kernel failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// Arguments the kernel cannot handle (its predicate should have rejected them), in a case
    /// none of the variants below names.
    #[error("invalid arguments: {reason}")]
    InvalidArguments {
        /// Why.
        reason: String,
    },
    /// An integer argument (a size, stride, offset or count) outside what the kernel takes.
    #[error("invalid arguments: {what} {value} is outside {min}..={max}")]
    OutOfRange {
        /// What the integer is (`row stride`, `variance_size`, ...).
        what: &'static str,
        /// Its value (saturated to the `i64` range).
        value: i64,
        /// The least the kernel takes.
        min: i64,
        /// The most the kernel takes (saturated to `i64::MAX`).
        max: i64,
    },
    /// An operand whose shape or dtype differs from the tensor it must match (an output buffer, an
    /// in-place operand).
    #[error("invalid arguments: {0}")]
    OperandMismatch(Box<OperandMismatch>),
    /// A parameter only the op's native reference implements (a defensive check behind the
    /// provider's predicate).
    #[error("invalid arguments: `{param}` is only supported by native")]
    NativeOnly {
        /// The parameter (`variance_size`).
        param: &'static str,
    },
    /// An element size the backend's copy kernels do not move.
    #[error("invalid arguments: the {backend} copy kernels move no {bytes}-byte elements")]
    ElementSize {
        /// The provider (`cuda`, `xpu`, ...).
        backend: &'static str,
        /// The element size in bytes.
        bytes: usize,
    },
    /// More rows, tokens or elements than one launch's grid holds.
    #[error("invalid arguments: {count} {what} exceed the grid limit")]
    GridLimit {
        /// What the grid counts (`rows`, `tokens`, `elements`).
        what: &'static str,
        /// How many there are.
        count: usize,
    },
    /// An argument that is not in the memory the kernel runs on.
    #[error("invalid arguments: `{param}` is not in {memory} memory")]
    WrongMemory {
        /// The parameter.
        param: String,
        /// The memory the kernel needs (`host`, `CUDA`, ...).
        memory: &'static str,
    },
    /// A dtype the provider's kernels do not compute in.
    #[error("invalid arguments: the {backend} kernels do not compute in {dtype}")]
    UnsupportedDType {
        /// The provider (`cpu`, `cuda`, ...).
        backend: &'static str,
        /// The dtype.
        dtype: crate::DType,
    },
    /// Arguments the op's meta function refuses (a native reference checks them first).
    #[error("invalid arguments: {0}")]
    Meta(Box<super::MetaError>),
    /// An output dtype of a quantization that is not an fp8 dtype.
    #[error("invalid arguments: out_dtype {dtype} is not an fp8 dtype")]
    NotFp8 {
        /// The dtype asked for.
        dtype: crate::DType,
    },
    /// The driver reported an error.
    #[error("{backend} driver error: {message}")]
    Driver {
        /// `cuda`, `rocm`, `xpu`.
        backend: &'static str,
        /// The driver's message.
        message: String,
    },
    /// A kernel failed to compile; the compiler log is kept.
    #[error("compiling `{kernel}` with {options:?} failed:\n{log}")]
    Compile {
        /// Kernel name.
        kernel: String,
        /// Compiler options.
        options: Vec<String>,
        /// Compiler log.
        log: String,
    },
    /// An engine's own implementation failed (its library's error, as text): an op whose kernel
    /// belongs to the engine (a matmul, attention) reports here.
    #[error("{library}: {message}")]
    Engine {
        /// The library or engine that failed (`candle`, ...).
        library: String,
        /// Its message.
        message: String,
    },
}

/// An operand of a kernel that does not match the tensor it must ([`KernelError::OperandMismatch`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{operand}` is {got}, but `{reference}` is {expected}")]
pub struct OperandMismatch {
    /// The operand (`out`, `x_residual`, `destination`).
    pub operand: &'static str,
    /// Its metadata (or layout), printed.
    pub got: String,
    /// The tensor it must match (`x`, `source`).
    pub reference: &'static str,
    /// That tensor's metadata, printed.
    pub expected: String,
}

impl OperandMismatch {
    /// The error for `operand` (printed as `got`) not matching `reference` (printed as `expected`).
    pub fn error(
        operand: &'static str,
        got: impl fmt::Display,
        reference: &'static str,
        expected: impl fmt::Display,
    ) -> KernelError {
        KernelError::OperandMismatch(Box::new(OperandMismatch {
            operand,
            got: got.to_string(),
            reference,
            expected: expected.to_string(),
        }))
    }
}

impl From<super::MetaError> for KernelError {
    fn from(error: super::MetaError) -> KernelError {
        KernelError::Meta(Box::new(error))
    }
}
