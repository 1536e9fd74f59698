//! Dynamic arguments: values, their metadata mirror, parameter kinds and binding.

use std::fmt;

use crate::op::OpDef;
use crate::{DType, Tensor, TensorMeta};

/// The kind of one op parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A tensor.
    Tensor,
    /// A tensor or none.
    OptTensor,
    /// A float.
    F64,
    /// A float or none.
    OptF64,
    /// An integer or none.
    OptI64,
    /// An integer.
    I64,
    /// A boolean.
    Bool,
    /// A boolean or none.
    OptBool,
    /// One of these strings (an enum such as `approximate: "none" | "tanh"`).
    Str(&'static [&'static str]),
    /// One of these strings, or none.
    OptStr(&'static [&'static str]),
    /// A dtype (`f32`, `bf16`, …).
    DType,
    /// A dtype or none.
    OptDType,
    /// A list of integers (`[8, 16]`).
    Ints,
    /// A list of integers or none.
    OptInts,
}

impl fmt::Display for ParamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamKind::Tensor => f.write_str("Tensor"),
            ParamKind::OptTensor => f.write_str("Optional[Tensor]"),
            ParamKind::F64 => f.write_str("float"),
            ParamKind::OptF64 => f.write_str("Optional[float]"),
            ParamKind::OptI64 => f.write_str("Optional[int]"),
            ParamKind::I64 => f.write_str("int"),
            ParamKind::Bool => f.write_str("bool"),
            ParamKind::OptBool => f.write_str("Optional[bool]"),
            ParamKind::Str(allowed) => write!(f, "Literal[{}]", quoted(allowed)),
            ParamKind::OptStr(allowed) => write!(f, "Optional[Literal[{}]]", quoted(allowed)),
            ParamKind::DType => f.write_str("dtype"),
            ParamKind::OptDType => f.write_str("Optional[dtype]"),
            ParamKind::Ints => f.write_str("list[int]"),
            ParamKind::OptInts => f.write_str("Optional[list[int]]"),
        }
    }
}

/// A constant default of a parameter: an argument that cannot be a tensor, its string and list
/// in static memory.
pub type Literal = Arg<std::convert::Infallible, &'static str, &'static [i64]>;

/// One parameter of an op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamDef {
    /// Name (`^[a-z_][a-z_0-9]*$`, unique within the op).
    pub name: &'static str,
    /// Kind.
    pub kind: ParamKind,
    /// Value used when a trailing argument is omitted.
    pub default: Option<Literal>,
}

/// One argument of an op, at every level that handles one: `T` is how a tensor is given (a
/// [`Tensor`] in an eager call, its [`TensorMeta`] for predicates and meta functions, a graph value,
/// an execution context's handle), `S` and `L` how a string and an integer list are held (owned or
/// borrowed). Every level's argument is this one type ([`Value`], [`ArgMeta`],
/// [`CallArg`](crate::CallArg), the graph's `Arg`), so converting between them is one
/// [`map_tensor`](Arg::map_tensor) or [`meta_with`](Arg::meta_with), not a match per pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg<T, S = String, L = Vec<i64>> {
    /// A tensor.
    Tensor(T),
    /// `none`.
    None,
    /// A float.
    F64(f64),
    /// An integer.
    I64(i64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(S),
    /// A dtype.
    DType(DType),
    /// A list of integers.
    Ints(L),
}

/// One dynamic argument of an eager call.
pub type Value = Arg<Tensor>;

/// The metadata mirror of a [`Value`]: what `supports` predicates and meta functions see.
pub type ArgMeta<'a> = Arg<&'a TensorMeta, &'a str, &'a [i64]>;

impl<T, S, L> Arg<T, S, L> {
    /// The same argument held another way: its tensor, string or list (whichever it is) turned by
    /// `tensor`, `string` or `ints`.
    #[inline]
    pub fn map<U, S2, L2>(
        self,
        tensor: impl FnOnce(T) -> U,
        string: impl FnOnce(S) -> S2,
        ints: impl FnOnce(L) -> L2,
    ) -> Arg<U, S2, L2> {
        match self {
            Arg::Tensor(t) => Arg::Tensor(tensor(t)),
            Arg::None => Arg::None,
            Arg::F64(v) => Arg::F64(v),
            Arg::I64(v) => Arg::I64(v),
            Arg::Bool(v) => Arg::Bool(v),
            Arg::Str(v) => Arg::Str(string(v)),
            Arg::DType(v) => Arg::DType(v),
            Arg::Ints(v) => Arg::Ints(ints(v)),
        }
    }

    /// The same argument with its tensor (if it is one) turned into `f(tensor)`.
    #[inline]
    pub fn map_tensor<U>(self, f: impl FnOnce(T) -> U) -> Arg<U, S, L> {
        self.map(f, |s| s, |l| l)
    }

    /// The tensor, if this is one.
    pub fn as_tensor(&self) -> Option<&T> {
        match self {
            Arg::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// An integer, or `none`.
    pub fn opt_i64(v: Option<i64>) -> Arg<T, S, L> {
        v.map_or(Arg::None, Arg::I64)
    }
}

impl<T: Clone, S, L> Arg<T, S, L> {
    /// A copy of the tensor `t` (a handle copy for reference-counted tensors), or `none`.
    pub fn opt_tensor(t: Option<&T>) -> Arg<T, S, L> {
        t.map_or(Arg::None, |t| Arg::Tensor(t.clone()))
    }
}

impl<T, S: AsRef<str>, L: AsRef<[i64]>> Arg<T, S, L> {
    /// What a meta function sees of the argument, with `meta` giving a tensor's metadata.
    #[inline]
    pub fn meta_with<'a>(&'a self, meta: impl FnOnce(&'a T) -> &'a TensorMeta) -> ArgMeta<'a> {
        self.borrowed().map(meta, |s| s, |l| l)
    }

    /// The argument borrowed: its tensor, string and list by reference.
    #[inline]
    pub fn borrowed(&self) -> Arg<&T, &str, &[i64]> {
        match self {
            Arg::Tensor(t) => Arg::Tensor(t),
            Arg::None => Arg::None,
            Arg::F64(v) => Arg::F64(*v),
            Arg::I64(v) => Arg::I64(*v),
            Arg::Bool(v) => Arg::Bool(*v),
            Arg::Str(v) => Arg::Str(v.as_ref()),
            Arg::DType(v) => Arg::DType(*v),
            Arg::Ints(v) => Arg::Ints(v.as_ref()),
        }
    }

    /// The constant's metadata form; `None` for a tensor, which the caller looks up.
    pub fn constant_meta(&self) -> Option<ArgMeta<'_>> {
        match self {
            Arg::Tensor(_) => None,
            constant => Some(constant.meta_with(|_| unreachable!("not a tensor"))),
        }
    }

    /// The constant as a dynamic argument; `None` for a tensor, which the caller looks up.
    pub fn constant(&self) -> Option<Value> {
        let constant = self.constant_meta()?;
        Some(constant.map(|_| unreachable!("not a tensor"), str::to_owned, <[i64]>::to_vec))
    }
}

impl<T: PartialEq, S: AsRef<str>, L: AsRef<[i64]>> Arg<T, S, L> {
    /// Whether a meta function and a predicate see the same argument (floats compared by bits, so
    /// a NaN argument equals itself): what makes a remembered selection or meta result reusable.
    #[inline]
    pub fn same_as<S2: AsRef<str>, L2: AsRef<[i64]>>(&self, other: &Arg<T, S2, L2>) -> bool {
        match (self, other) {
            (Arg::Tensor(a), Arg::Tensor(b)) => a == b,
            (Arg::F64(a), Arg::F64(b)) => a.to_bits() == b.to_bits(),
            (Arg::I64(a), Arg::I64(b)) => a == b,
            (Arg::Bool(a), Arg::Bool(b)) => a == b,
            (Arg::Str(a), Arg::Str(b)) => a.as_ref() == b.as_ref(),
            (Arg::DType(a), Arg::DType(b)) => a == b,
            (Arg::Ints(a), Arg::Ints(b)) => a.as_ref() == b.as_ref(),
            (Arg::None, Arg::None) => true,
            _ => false,
        }
    }
}

impl<T> Arg<T> {
    /// The dynamic argument, with `tensor` turning a tensor into a [`Value`]'s (strings and lists
    /// are owned on both sides, so nothing is copied).
    pub fn into_value(self, tensor: impl FnOnce(T) -> Tensor) -> Value {
        self.map_tensor(tensor)
    }
}

/// An argument list that does not fit an op's parameters.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BindError {
    /// More arguments than parameters.
    #[error("op `{op}` takes {expected} arguments but {found} were given")]
    TooManyArgs {
        /// The op.
        op: &'static str,
        /// Number of parameters.
        expected: usize,
        /// Number of arguments.
        found: usize,
    },
    /// An omitted parameter without a default.
    #[error("op `{op}`: missing argument for parameter `{param}`")]
    MissingArg {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
    },
    /// An argument of the wrong kind.
    #[error("op `{op}`: parameter `{param}` expects {expected}, found {found}")]
    KindMismatch {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
        /// Its kind.
        expected: ParamKind,
        /// The kind of the argument given.
        found: &'static str,
    },
    /// A string that is not one of the parameter's allowed values.
    #[error("op `{op}`: parameter `{param}` expects one of {}, found \"{found}\"", quoted(allowed))]
    NotAllowed {
        /// The op.
        op: &'static str,
        /// The parameter.
        param: &'static str,
        /// The allowed values.
        allowed: &'static [&'static str],
        /// The string given.
        found: String,
    },
}

impl Value {
    /// The metadata mirror.
    #[inline]
    pub fn meta(&self) -> ArgMeta<'_> {
        self.meta_with(Tensor::meta)
    }
}

impl From<Literal> for Value {
    fn from(literal: Literal) -> Value {
        literal.map_tensor(|never| match never {}).constant().expect("a literal is a constant")
    }
}

impl Literal {
    /// The metadata form of a default.
    pub fn meta(self) -> ArgMeta<'static> {
        match self {
            Arg::Tensor(never) => match never {},
            Arg::None => Arg::None,
            Arg::F64(v) => Arg::F64(v),
            Arg::I64(v) => Arg::I64(v),
            Arg::Bool(v) => Arg::Bool(v),
            Arg::Str(v) => Arg::Str(v),
            Arg::DType(v) => Arg::DType(v),
            Arg::Ints(v) => Arg::Ints(v),
        }
    }
}

impl<'a> ArgMeta<'a> {
    /// The tensor metadata, if this is a tensor.
    pub fn tensor(&self) -> Option<&'a TensorMeta> {
        match self {
            ArgMeta::Tensor(meta) => Some(meta),
            _ => None,
        }
    }

    /// The float, if this is one.
    pub fn f64(&self) -> Option<f64> {
        match self {
            ArgMeta::F64(v) => Some(*v),
            _ => None,
        }
    }

    /// The integer, if this is one.
    pub fn i64(&self) -> Option<i64> {
        match self {
            ArgMeta::I64(v) => Some(*v),
            _ => None,
        }
    }

    /// The boolean, if this is one.
    pub fn bool(&self) -> Option<bool> {
        match self {
            ArgMeta::Bool(v) => Some(*v),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn str(&self) -> Option<&'a str> {
        match self {
            ArgMeta::Str(v) => Some(v),
            _ => None,
        }
    }

    /// The dtype, if this is one.
    pub fn dtype(&self) -> Option<DType> {
        match self {
            ArgMeta::DType(v) => Some(*v),
            _ => None,
        }
    }

    /// The integer list, if this is one.
    pub fn ints(&self) -> Option<&'a [i64]> {
        match self {
            ArgMeta::Ints(v) => Some(v),
            _ => None,
        }
    }

    /// The spelling of this argument's kind in error messages.
    pub fn kind_name(&self) -> &'static str {
        match self {
            ArgMeta::Tensor(_) => "a tensor",
            ArgMeta::None => "none",
            ArgMeta::F64(_) => "a float",
            ArgMeta::I64(_) => "an integer",
            ArgMeta::Bool(_) => "a boolean",
            ArgMeta::Str(_) => "a string",
            ArgMeta::DType(_) => "a dtype",
            ArgMeta::Ints(_) => "a list of integers",
        }
    }

    /// Whether the argument has the parameter's kind (a string's value is checked separately).
    fn fits(&self, kind: ParamKind) -> bool {
        matches!(
            (kind, self),
            (ParamKind::Tensor, ArgMeta::Tensor(_))
                | (ParamKind::OptTensor, ArgMeta::Tensor(_) | ArgMeta::None)
                | (ParamKind::F64, ArgMeta::F64(_))
                | (ParamKind::OptF64, ArgMeta::F64(_) | ArgMeta::None)
                | (ParamKind::OptI64, ArgMeta::I64(_) | ArgMeta::None)
                | (ParamKind::I64, ArgMeta::I64(_))
                | (ParamKind::Bool, ArgMeta::Bool(_))
                | (ParamKind::OptBool, ArgMeta::Bool(_) | ArgMeta::None)
                | (ParamKind::Str(_), ArgMeta::Str(_))
                | (ParamKind::OptStr(_), ArgMeta::Str(_) | ArgMeta::None)
                | (ParamKind::DType, ArgMeta::DType(_))
                | (ParamKind::OptDType, ArgMeta::DType(_) | ArgMeta::None)
                | (ParamKind::Ints, ArgMeta::Ints(_))
                | (ParamKind::OptInts, ArgMeta::Ints(_) | ArgMeta::None)
        )
    }
}

impl fmt::Display for ArgMeta<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgMeta::Tensor(meta) => write!(f, "{meta}"),
            ArgMeta::None => f.write_str("none"),
            ArgMeta::F64(v) => write!(f, "{v:?}"),
            ArgMeta::I64(v) => write!(f, "{v}"),
            ArgMeta::Bool(v) => write!(f, "{v}"),
            ArgMeta::Str(v) => write!(f, "\"{v}\""),
            ArgMeta::DType(v) => write!(f, "{v}"),
            ArgMeta::Ints(v) => write!(f, "{v:?}"),
        }
    }
}

/// Whether a parameter's default fits it: the kind, and for a string one of the allowed values.
pub(crate) fn default_fits(op: &'static str, param: &ParamDef) -> bool {
    param.default.is_none_or(|default| check_arg(op, param, default.meta()).is_ok())
}

/// Checks arity and kinds against `op`'s parameters and fills omitted trailing parameters with defaults.
pub fn bind(op: &OpDef, mut args: Vec<Value>) -> Result<Vec<Value>, BindError> {
    fill_defaults(op, &mut args)?;
    Ok(args)
}

/// [`bind`] on any argument list, in place.
pub(crate) fn fill_defaults<V>(op: &OpDef, args: &mut V) -> Result<(), BindError>
where
    V: std::ops::Deref<Target = [Value]> + Extend<Value>,
{
    check_args(op, args.iter().map(Value::meta))?;
    let missing = &op.params[args.len()..];
    if let Some(param) = missing.iter().find(|param| param.default.is_none()) {
        return Err(BindError::MissingArg { op: op.name, param: param.name });
    }
    args.extend(missing.iter().filter_map(|param| param.default.map(Value::from)));
    Ok(())
}

/// The metadata form of [`bind`]: defaults are filled in as metadata.
pub fn bind_meta<'a>(op: &OpDef, mut args: Vec<ArgMeta<'a>>) -> Result<Vec<ArgMeta<'a>>, BindError> {
    check_args(op, args.iter().copied())?;
    for param in &op.params[args.len()..] {
        let default = param.default.ok_or(BindError::MissingArg { op: op.name, param: param.name })?;
        args.push(default.meta());
    }
    Ok(args)
}

fn check_args<'a>(op: &OpDef, args: impl ExactSizeIterator<Item = ArgMeta<'a>>) -> Result<(), BindError> {
    if args.len() > op.params.len() {
        return Err(BindError::TooManyArgs { op: op.name, expected: op.params.len(), found: args.len() });
    }
    for (param, arg) in op.params.iter().zip(args) {
        check_arg(op.name, param, arg)?;
    }
    Ok(())
}

/// Whether `arg` fits `param`: its kind, and for a string one of the allowed values.
fn check_arg(op: &'static str, param: &ParamDef, arg: ArgMeta<'_>) -> Result<(), BindError> {
    if !arg.fits(param.kind) {
        return Err(BindError::KindMismatch { op, param: param.name, expected: param.kind, found: arg.kind_name() });
    }
    match (param.kind, arg) {
        (ParamKind::Str(allowed) | ParamKind::OptStr(allowed), ArgMeta::Str(found)) if !allowed.contains(&found) => {
            Err(BindError::NotAllowed { op, param: param.name, allowed, found: found.to_owned() })
        }
        _ => Ok(()),
    }
}

/// The allowed values of a string parameter as the text format spells them: `"none", "tanh"`.
fn quoted(allowed: &[&str]) -> String {
    allowed.iter().map(|a| format!("\"{a}\"")).collect::<Vec<_>>().join(", ")
}
