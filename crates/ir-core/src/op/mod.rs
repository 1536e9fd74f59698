//! How an op is declared: the [`OpDef`] each op's one static holds (schema, semantics, meta
//! function, test inputs), its parameter kinds and argument values, and the pieces
//! [`define_op!`](crate::define_op) generates code from. The built-in ops themselves are declared in
//! the `vllm-ir-ops` crate.
//!
//! [`define_op!`](crate::define_op) turns a parameter list written with Rust types into the
//! [`OpDef`] and everything typed around it.
//!
//! Each parameter's Rust type is a *marker* implementing `OpParam`, which says the parameter's
//! [`ParamKind`] and how its value looks to callers, implementations and predicates:
//!
//! | marker | kind | caller / implementation | predicate | `maybe_inplace` caller | in-place implementation |
//! |---|---|---|---|---|---|
//! | [`Activation`] | `Tensor`, donated | `&Tensor` | `&TensorMeta` | `Tensor` (moved in) | [`UniqueTensor`](crate::UniqueTensor) |
//! | `Option<Activation>` | `Optional[Tensor]`, donated when given | `Option<&Tensor>` | `Option<&TensorMeta>` | `Option<Tensor>` | `Option<UniqueTensor>` |
//! | `Tensor` | `Tensor` | `&Tensor` | `&TensorMeta` | `&Tensor` | `&Tensor` |
//! | `Option<Tensor>` | `Optional[Tensor]` | `Option<&Tensor>` | `Option<&TensorMeta>` | same | same |
//! | `f64`, `i64`, `bool`, `DType` | scalar | by value | by value | by value | by value |
//! | `Option<f64>`, … | optional scalar | `Option<_>` | `Option<_>` | same | same |
//! | `Vec<i64>`, `Option<Vec<i64>>` | integer list | `&[i64]`, `Option<&[i64]>` | same | same | same |
//! | a [`str_enum!`](crate::str_enum) type | `Literal["a", "b"]` | the enum | the enum | the enum | the enum |
//!
//! The activations are the `Activation` and `Option<Activation>` parameters, in order; an op with
//! `inplace: true` has a `maybe_inplace` form whose outputs are written into them. An absent
//! optional activation has no output: the outputs are the given activations', in order, then the
//! fresh ones (`rotary_embedding` returns `(query, Option<key>)`, typed `(Tensor, Option<Tensor>)`).

pub(crate) mod declare;
pub(crate) mod error;
mod value;

use std::fmt;

pub use crate::op::declare::{Activation, Handles, StrEnum, mismatched};
pub(crate) use crate::op::error::KernelError;
pub use crate::op::value::{Arg, ArgMeta, BindError, Literal, ParamDef, ParamKind, Value, bind, bind_meta};
pub(crate) use crate::op::value::{default_fits, fill_defaults};
use crate::{DType, Device, Tensor, TensorError, TensorMeta};

/// How many arguments (or their metadata) a call holds without a heap allocation (typed calls keep
/// the arguments themselves in an array of their own): every built-in op's parameter count fits.
pub const INLINE_ARGS: usize = 8;
/// How many outputs (or output metadata) a call holds without a heap allocation: every built-in
/// op's output count fits (an op with more outputs spills them to the heap).
pub const INLINE_OUTPUTS: usize = 2;
/// A call's outputs, inline up to [`INLINE_OUTPUTS`].
pub type Outputs = smallvec::SmallVec<[Tensor; INLINE_OUTPUTS]>;
/// A call's positional arguments, inline up to [`INLINE_ARGS`] (`.into()` from a `Vec`).
pub type Values = smallvec::SmallVec<[Value; INLINE_ARGS]>;
/// A meta function's output metadata, inline up to [`INLINE_OUTPUTS`] (build one with
/// [`smallvec!`], or `.into()` from a `Vec`).
pub type OutputMetas = smallvec::SmallVec<[TensorMeta; INLINE_OUTPUTS]>;
/// Builds an [`Outputs`] or [`OutputMetas`] like `vec!`.
pub use smallvec::smallvec;

/// The reference implementation: plain Rust over bound, validated arguments.
pub type NativeFn = fn(&[Value]) -> Result<Outputs, KernelError>;
/// Computes output metadata from argument metadata and validates the arguments. It receives the
/// op's definition, so its errors name the op from it ([`OpDef::name`]) and a meta function shared
/// by several ops finds their parameters by name ([`OpDef::param_index`]), with no per-op table.
pub type MetaFn = fn(&'static OpDef, &[ArgMeta<'_>]) -> Result<OutputMetas, MetaError>;
/// Produces a complete, deterministic argument list of CPU tensors for tests and benchmarks.
pub type InputGenerator = fn(&InputSpec) -> Result<Vec<Value>, TensorError>;

/// The one definition of an op.
#[derive(Clone, Copy, Debug)]
pub struct OpDef {
    /// Name (`^[a-z_][a-z_0-9]*$`, not a reserved word of the text format).
    pub name: &'static str,
    /// Ordered parameters (all positional).
    pub params: &'static [ParamDef],
    /// Number of tensor outputs (at least 1); the most there can be when an optional activation has
    /// an output (the meta function's list says how many a call has).
    pub n_outputs: usize,
    /// Which tensor parameters `maybe_inplace` donates.
    pub activations: Activations,
    /// Whether the op has a `maybe_inplace` form: then output i ↔ the i-th given activation (an
    /// in-place kernel writes that output into that activation's storage; an absent optional
    /// activation has no output), and any outputs after those are fresh.
    pub allow_inplace: bool,
    /// The semantics.
    pub native: NativeFn,
    /// Shape inference and validation.
    pub meta: MetaFn,
    /// Test inputs.
    pub generate_inputs: InputGenerator,
    /// Per-dtype tolerance overrides, consulted before the global table.
    pub tolerances: &'static [(DType, Tolerance)],
    /// One-line description.
    pub description: &'static str,
}

/// How an op's activations are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// The `Tensor` parameters whose names start with `x`, in order.
    Default,
    /// These parameters, each of kind `Tensor` or `Optional[Tensor]` (donated when given).
    Explicit(&'static [&'static str]),
}

/// The two call forms of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Overload {
    /// The functional call: inputs never change, outputs never alias them.
    Default,
    /// The caller donates the activations; an in-place kernel may write its outputs into them.
    MaybeInplace,
}

/// Absolute and relative tolerance for comparing a provider's result with native.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
}

/// No tolerance is known for this op and dtype.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no tolerance for op `{op}` and dtype {dtype}")]
pub struct NoTolerance {
    /// The op.
    pub op: &'static str,
    /// The dtype.
    pub dtype: DType,
}

/// What an input generator is asked for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InputSpec {
    /// Rows (T).
    pub num_tokens: usize,
    /// Last-dimension length (H).
    pub hidden_size: usize,
    /// Element type of every tensor.
    pub dtype: DType,
    /// The epsilon argument.
    pub epsilon: f64,
    /// PRNG seed; equal specs give bit-identical inputs.
    pub seed: u64,
}

/// Arguments that do not fit an op ([`OpDef::output_metas`]): its parameters, or its meta function.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgsError {
    /// Arguments that do not fit the parameters.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// Arguments the meta function rejects.
    #[error(transparent)]
    Meta(#[from] MetaError),
}

/// An explicit activation list that does not fit the op's parameters ([`OpDef::activation_indices`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ActivationError {
    /// An activation that is not a parameter.
    #[error("op `{op}`: activation `{name}` is not a parameter")]
    Unknown {
        /// The op.
        op: String,
        /// The activation.
        name: String,
    },
    /// An activation that is not a tensor parameter (optional or not).
    #[error("op `{op}`: activation `{name}` must be a Tensor or Optional[Tensor] parameter, not {kind}")]
    NotTensor {
        /// The op.
        op: String,
        /// The activation.
        name: String,
        /// Its kind.
        kind: ParamKind,
    },
}

/// Arguments a meta function rejects. Each names the parameter and what it was compared with.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MetaError {
    /// A tensor of the wrong rank.
    #[error("{op}: `{param}` must have {expected}, got shape {shape:?}")]
    Rank {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
        /// What was expected (`rank >= 1`).
        expected: &'static str,
        /// The shape given.
        shape: Vec<usize>,
    },
    /// A tensor whose shape does not fit another argument's.
    #[error("{op}: `{param}` has shape {shape:?} but {expected} (`{other}` has shape {other_shape:?})")]
    Shape {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// The rule broken (`must equal x's shape`).
        expected: &'static str,
        /// The parameter compared with.
        other: &'static str,
        /// That parameter's shape.
        other_shape: Vec<usize>,
    },
    /// A tensor of a dtype the op does not take.
    #[error("{op}: `{param}` has dtype {dtype} but must be {expected}")]
    DType {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
        /// Its dtype.
        dtype: DType,
        /// The dtypes allowed (`one of f32, f16, bf16, f64`).
        expected: &'static str,
    },
    /// A tensor on another device than a reference argument.
    #[error("{op}: `{param}` is on {device} but `{other}` is on {other_device}")]
    Device {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
        /// Its device.
        device: Device,
        /// The parameter compared with.
        other: &'static str,
        /// That parameter's device.
        other_device: Device,
    },
    /// A scalar out of its range.
    #[error("{op}: `{param}` = {value} is invalid: {reason}")]
    Scalar {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
        /// The value, printed.
        value: String,
        /// The rule broken.
        reason: String,
    },
    /// An argument of the wrong kind reached the meta function (the caller skipped `bind`).
    #[error("{op}: `{param}` has the wrong kind")]
    Kind {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
    },
}

impl MetaError {
    /// `Ok` when `meta` has a dtype models compute in ([`DType::COMPUTE`]), else the error naming it:
    /// the norms and activations take no 8-bit (quantized) tensors.
    pub fn require_compute_dtype(op: &'static str, param: &'static str, meta: &TensorMeta) -> Result<(), MetaError> {
        if meta.dtype.is_compute() {
            return Ok(());
        }
        Err(MetaError::DType { op, param, dtype: meta.dtype, expected: "one of f32, f16, bf16, f64" })
    }
}

/// Keywords of the text format; with the built-ins' names ([`crate::builtin::Builtin`]), the words that cannot
/// name an op or a provider.
pub const KEYWORDS: &[&str] = &["impl", "output", "graph", "none", "true", "false"];

/// Whether `name` is reserved: a keyword of the text format or a built-in's name.
pub fn is_reserved(name: &str) -> bool {
    KEYWORDS.contains(&name) || crate::builtin::Builtin::from_name(name).is_some()
}

/// The global tolerance table, used when an op has no override.
pub fn global_tolerance(dtype: DType) -> Tolerance {
    match dtype {
        DType::F64 => Tolerance { atol: 1e-8, rtol: 1e-8 },
        DType::F32 => Tolerance { atol: 1e-5, rtol: 1.3e-6 },
        DType::F16 => Tolerance { atol: 1e-3, rtol: 1e-3 },
        DType::BF16 => Tolerance { atol: 1e-3, rtol: 1.6e-2 },
        // One step of the format: a step is at most 2^-3 (E4M3) or 2^-2 (E5M2) of the value, and
        // the smallest subnormal (2^-9, 2^-16) near zero.
        DType::F8E4M3FN => Tolerance { atol: 1.0 / 512.0, rtol: 0.125 },
        DType::F8E5M2 => Tolerance { atol: 1.0 / 65536.0, rtol: 0.25 },
        DType::I8 => Tolerance { atol: 1.0, rtol: 0.0 },
        // Positions and indices: equal.
        DType::I64 => Tolerance { atol: 0.0, rtol: 0.0 },
    }
}

/// The tolerance for comparing `op`'s outputs in `dtype` with native: the op's override, else the global table.
pub fn tolerance(op: &OpDef, dtype: DType) -> Result<Tolerance, NoTolerance> {
    let overridden = op.tolerances.iter().find(|(d, _)| *d == dtype).map(|(_, t)| *t);
    Ok(overridden.unwrap_or_else(|| global_tolerance(dtype)))
}

/// Whether `name` matches `^[a-z_][a-z_0-9]*$`.
pub fn is_valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    let Some(first) = chars.next() else { return false };
    (first.is_ascii_lowercase() || first == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

impl OpDef {
    /// The metadata of the outputs for these argument metadata: binds them (filling defaulted
    /// parameters) and runs the meta function. The verifier and the passes ask this of graph calls.
    pub fn output_metas(&'static self, args: Vec<ArgMeta<'_>>) -> Result<Vec<TensorMeta>, ArgsError> {
        let bound = bind_meta(self, args)?;
        Ok((self.meta)(self, &bound)?.into_vec())
    }

    /// Parameter indices of the activations, or why the definition is invalid.
    pub fn activation_indices(&self) -> Result<Vec<usize>, ActivationError> {
        match self.activations {
            Activations::Default => Ok(self
                .params
                .iter()
                .enumerate()
                .filter(|(_, p)| p.kind == ParamKind::Tensor && p.name.starts_with('x'))
                .map(|(i, _)| i)
                .collect()),
            Activations::Explicit(names) => names
                .iter()
                .map(|name| {
                    let index = self.param_index(name).ok_or_else(|| ActivationError::Unknown {
                        op: self.name.to_owned(),
                        name: (*name).to_owned(),
                    })?;
                    let kind = self.params[index].kind;
                    if !matches!(kind, ParamKind::Tensor | ParamKind::OptTensor) {
                        return Err(ActivationError::NotTensor {
                            op: self.name.to_owned(),
                            name: (*name).to_owned(),
                            kind,
                        });
                    }
                    Ok(index)
                })
                .collect(),
        }
    }

    /// The index of the parameter called `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }
}

impl fmt::Display for OpDef {
    /// Prints the signature: `rms_norm(x: Tensor, weight: Optional[Tensor], ...) -> 1 output`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.name)?;
        for (i, param) in self.params.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}: {}", param.name, param.kind)?;
        }
        let plural = if self.n_outputs == 1 { "" } else { "s" };
        write!(f, ") -> {} output{plural}", self.n_outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for good in ["rms_norm", "_a1", "a", "x_9"] {
            assert!(is_valid_name(good), "{good}");
        }
        for bad in ["RmsNorm", "1abc", "a-b", "", "é"] {
            assert!(!is_valid_name(bad), "{bad}");
        }
    }
}
