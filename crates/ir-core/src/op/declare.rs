//! The parameter markers and output shapes [`define_op!`](crate::define_op) expands to (the table
//! of markers is in the `op` module's documentation), and `str_enum!`. They name the op model and
//! tensors only; the macro itself, whose expansion calls the registry and the contexts, is in
//! `define.rs`.

use crate::op::Arg as CallArg;
use crate::op::{ArgMeta, ParamKind, Value};
use crate::{DType, KernelError, Tensor, TensorError, TensorMeta, UniqueTensor};

/// How one parameter's Rust marker type maps to its kind and to the typed views of its value.
pub trait OpParam {
    /// The parameter kind.
    const KIND: ParamKind;
    /// Whether `maybe_inplace` donates it (only [`Activation`]).
    const DONATED: bool = false;
    /// What functional callers pass and functional implementations receive.
    type Arg<'a>: Copy;
    /// What `supports` predicates see.
    type Meta<'a>: Copy;
    /// What `maybe_inplace` callers pass.
    type Given<'a>;
    /// What in-place implementations receive.
    type InplaceArg<'a>;
    /// What an in-place wrapper moves out of the argument list before borrowing the rest.
    type Taken;
    /// What a call through an [`ExecutionContext`](crate::ExecutionContext) with handles `T` passes.
    type CtxArg<'a, T: 'a>;
    /// What a `maybe_inplace` call through an execution context passes.
    type CtxGiven<'a, T: 'a>;

    /// Reads a bound value; `None` when its kind does not match.
    fn arg(value: &Value) -> Option<Self::Arg<'_>>;
    /// Reads bound metadata; `None` when its kind does not match.
    fn meta<'a>(meta: &ArgMeta<'a>) -> Option<Self::Meta<'a>>;
    /// The metadata of a functional caller's argument (what selection keys on), without a copy.
    fn arg_meta<'a>(arg: Self::Arg<'a>) -> ArgMeta<'a>;
    /// The metadata of a `maybe_inplace` caller's argument.
    fn given_meta<'b, 'a: 'b>(given: &'b Self::Given<'a>) -> ArgMeta<'b>;
    /// The donated tensor of a `maybe_inplace` caller's argument (an activation), to prepare for an
    /// in-place implementation; `None` for other parameters and an absent optional activation.
    fn given_activation<'b, 'a: 'b>(given: &'b mut Self::Given<'a>) -> Option<&'b mut Tensor>;
    /// A `maybe_inplace` caller's argument as an in-place implementation receives it (a prepared
    /// activation becomes a [`UniqueTensor`]).
    fn given_inplace<'a>(given: Self::Given<'a>) -> Result<Self::InplaceArg<'a>, TensorError>;
    /// A `maybe_inplace` caller's argument as a functional implementation receives it (borrowed).
    fn given_arg<'b, 'a: 'b>(given: &'b Self::Given<'a>) -> Self::Arg<'b>;
    /// The value a functional caller's argument becomes.
    fn value(arg: Self::Arg<'_>) -> Value;
    /// The value a `maybe_inplace` caller's argument becomes.
    fn given_value(given: Self::Given<'_>) -> Value;
    /// Moves what the in-place implementation owns out of `args[index]`.
    fn take(args: &mut [Value], index: usize) -> Result<Self::Taken, KernelError>;
    /// The in-place implementation's argument from what was taken and the (remaining) bound value.
    fn inplace_arg(taken: Self::Taken, value: &Value) -> Option<Self::InplaceArg<'_>>;
    /// The context call's argument.
    fn call_arg<'a, T: Clone + 'a>(arg: Self::CtxArg<'a, T>) -> CallArg<T>;
    /// The context `maybe_inplace` call's argument.
    fn given_call_arg<'a, T: Clone + 'a>(given: Self::CtxGiven<'a, T>) -> CallArg<T>;
}

/// A non-tensor value as a context call argument.
fn scalar_call_arg<T>(value: Value) -> CallArg<T> {
    value.map_tensor(|_| unreachable!("scalar markers make no tensors"))
}

/// Marker of a donated tensor parameter (an activation): `maybe_inplace` callers move it in and
/// in-place implementations receive it as a [`UniqueTensor`]; see [`OpParam`].
#[derive(Clone, Copy, Debug)]
pub enum Activation {}

impl OpParam for Activation {
    const KIND: ParamKind = ParamKind::Tensor;
    const DONATED: bool = true;
    type Arg<'a> = &'a Tensor;
    type Meta<'a> = &'a TensorMeta;
    type Given<'a> = Tensor;
    type InplaceArg<'a> = UniqueTensor;
    type Taken = UniqueTensor;

    fn arg(value: &Value) -> Option<&Tensor> {
        <Tensor as OpParam>::arg(value)
    }
    fn meta<'a>(meta: &ArgMeta<'a>) -> Option<&'a TensorMeta> {
        <Tensor as OpParam>::meta(meta)
    }
    fn arg_meta<'a>(arg: Self::Arg<'a>) -> ArgMeta<'a> {
        ArgMeta::Tensor(arg.meta())
    }
    fn given_meta<'b, 'a: 'b>(given: &'b Tensor) -> ArgMeta<'b> {
        ArgMeta::Tensor(given.meta())
    }
    fn given_activation<'b, 'a: 'b>(given: &'b mut Tensor) -> Option<&'b mut Tensor> {
        Some(given)
    }
    #[inline]
    fn given_inplace<'a>(given: Self::Given<'a>) -> Result<Self::InplaceArg<'a>, TensorError> {
        UniqueTensor::writable(given)
    }
    fn given_arg<'b, 'a: 'b>(given: &'b Tensor) -> &'b Tensor {
        given
    }
    fn value(arg: &Tensor) -> Value {
        <Tensor as OpParam>::value(arg)
    }
    fn given_value(given: Tensor) -> Value {
        Value::Tensor(given)
    }
    fn take(args: &mut [Value], index: usize) -> Result<UniqueTensor, KernelError> {
        take_unique(args, index)
    }
    fn inplace_arg(taken: UniqueTensor, _: &Value) -> Option<UniqueTensor> {
        Some(taken)
    }
    type CtxArg<'a, T: 'a> = &'a T;
    type CtxGiven<'a, T: 'a> = T;
    fn call_arg<'a, T: Clone + 'a>(arg: &'a T) -> CallArg<T> {
        CallArg::Tensor(arg.clone())
    }
    fn given_call_arg<'a, T: Clone + 'a>(given: T) -> CallArg<T> {
        CallArg::Tensor(given)
    }
}

/// An optional donated tensor parameter: absent (`none`) or an [`Activation`]. Its output exists only
/// when it is given.
impl OpParam for Option<Activation> {
    const KIND: ParamKind = ParamKind::OptTensor;
    const DONATED: bool = true;
    type Arg<'a> = Option<&'a Tensor>;
    type Meta<'a> = Option<&'a TensorMeta>;
    type Given<'a> = Option<Tensor>;
    type InplaceArg<'a> = Option<UniqueTensor>;
    type Taken = Option<UniqueTensor>;
    type CtxArg<'a, T: 'a> = Option<&'a T>;
    type CtxGiven<'a, T: 'a> = Option<T>;

    fn arg(value: &Value) -> Option<Option<&Tensor>> {
        <Option<Tensor> as OpParam>::arg(value)
    }
    fn meta<'a>(meta: &ArgMeta<'a>) -> Option<Option<&'a TensorMeta>> {
        <Option<Tensor> as OpParam>::meta(meta)
    }
    fn arg_meta<'a>(arg: Self::Arg<'a>) -> ArgMeta<'a> {
        <Option<Tensor> as OpParam>::arg_meta(arg)
    }
    fn given_meta<'b, 'a: 'b>(given: &'b Option<Tensor>) -> ArgMeta<'b> {
        <Option<Tensor> as OpParam>::arg_meta(given.as_ref())
    }
    fn given_activation<'b, 'a: 'b>(given: &'b mut Option<Tensor>) -> Option<&'b mut Tensor> {
        given.as_mut()
    }
    fn given_inplace<'a>(given: Self::Given<'a>) -> Result<Self::InplaceArg<'a>, TensorError> {
        given.map(<Activation as OpParam>::given_inplace).transpose()
    }
    fn given_arg<'b, 'a: 'b>(given: &'b Option<Tensor>) -> Option<&'b Tensor> {
        given.as_ref()
    }
    fn value(arg: Option<&Tensor>) -> Value {
        Value::opt_tensor(arg)
    }
    fn given_value(given: Option<Tensor>) -> Value {
        given.map_or(Value::None, Value::Tensor)
    }
    fn take(args: &mut [Value], index: usize) -> Result<Option<UniqueTensor>, KernelError> {
        match args.get(index) {
            Some(Value::None) => Ok(None),
            _ => take_unique(args, index).map(Some),
        }
    }
    fn inplace_arg(taken: Option<UniqueTensor>, _: &Value) -> Option<Option<UniqueTensor>> {
        Some(taken)
    }
    fn call_arg<'a, T: Clone + 'a>(arg: Option<&'a T>) -> CallArg<T> {
        CallArg::opt_tensor(arg)
    }
    fn given_call_arg<'a, T: Clone + 'a>(given: Option<T>) -> CallArg<T> {
        given.map_or(CallArg::None, CallArg::Tensor)
    }
}

impl OpParam for Tensor {
    const KIND: ParamKind = ParamKind::Tensor;
    type Arg<'a> = &'a Tensor;
    type Meta<'a> = &'a TensorMeta;
    type Given<'a> = &'a Tensor;
    type InplaceArg<'a> = &'a Tensor;
    type Taken = ();
    type CtxArg<'a, T: 'a> = &'a T;
    type CtxGiven<'a, T: 'a> = &'a T;

    fn arg(value: &Value) -> Option<&Tensor> {
        value.as_tensor()
    }
    fn meta<'a>(meta: &ArgMeta<'a>) -> Option<&'a TensorMeta> {
        meta.tensor()
    }
    fn arg_meta<'a>(arg: Self::Arg<'a>) -> ArgMeta<'a> {
        ArgMeta::Tensor(arg.meta())
    }
    fn given_meta<'b, 'a: 'b>(given: &'b &'a Tensor) -> ArgMeta<'b> {
        ArgMeta::Tensor(given.meta())
    }
    fn given_activation<'b, 'a: 'b>(_: &'b mut &'a Tensor) -> Option<&'b mut Tensor> {
        None
    }
    fn given_inplace<'a>(given: Self::Given<'a>) -> Result<Self::InplaceArg<'a>, TensorError> {
        Ok(given)
    }
    fn given_arg<'b, 'a: 'b>(given: &'b &'a Tensor) -> &'b Tensor {
        given
    }
    fn value(arg: &Tensor) -> Value {
        Value::Tensor(arg.clone())
    }
    fn given_value(given: &Tensor) -> Value {
        Value::Tensor(given.clone())
    }
    fn take(_: &mut [Value], _: usize) -> Result<(), KernelError> {
        Ok(())
    }
    fn inplace_arg((): (), value: &Value) -> Option<&Tensor> {
        value.as_tensor()
    }
    fn call_arg<'a, T: Clone + 'a>(arg: &'a T) -> CallArg<T> {
        CallArg::Tensor(arg.clone())
    }
    fn given_call_arg<'a, T: Clone + 'a>(given: &'a T) -> CallArg<T> {
        CallArg::Tensor(given.clone())
    }
}

impl OpParam for Option<Tensor> {
    const KIND: ParamKind = ParamKind::OptTensor;
    type Arg<'a> = Option<&'a Tensor>;
    type Meta<'a> = Option<&'a TensorMeta>;
    type Given<'a> = Option<&'a Tensor>;
    type InplaceArg<'a> = Option<&'a Tensor>;
    type Taken = ();
    type CtxArg<'a, T: 'a> = Option<&'a T>;
    type CtxGiven<'a, T: 'a> = Option<&'a T>;

    fn arg(value: &Value) -> Option<Option<&Tensor>> {
        optional(matches!(value, Value::None), || value.as_tensor())
    }
    fn meta<'a>(meta: &ArgMeta<'a>) -> Option<Option<&'a TensorMeta>> {
        optional(matches!(meta, ArgMeta::None), || meta.tensor())
    }
    fn arg_meta<'a>(arg: Self::Arg<'a>) -> ArgMeta<'a> {
        arg.map_or(ArgMeta::None, |t| ArgMeta::Tensor(t.meta()))
    }
    fn given_meta<'b, 'a: 'b>(given: &'b Option<&'a Tensor>) -> ArgMeta<'b> {
        Self::arg_meta(*given)
    }
    fn given_activation<'b, 'a: 'b>(_: &'b mut Option<&'a Tensor>) -> Option<&'b mut Tensor> {
        None
    }
    fn given_inplace<'a>(given: Self::Given<'a>) -> Result<Self::InplaceArg<'a>, TensorError> {
        Ok(given)
    }
    fn given_arg<'b, 'a: 'b>(given: &'b Option<&'a Tensor>) -> Option<&'b Tensor> {
        *given
    }
    fn value(arg: Option<&Tensor>) -> Value {
        Value::opt_tensor(arg)
    }
    fn given_value(given: Option<&Tensor>) -> Value {
        Value::opt_tensor(given)
    }
    fn take(_: &mut [Value], _: usize) -> Result<(), KernelError> {
        Ok(())
    }
    fn inplace_arg((): (), value: &Value) -> Option<Option<&Tensor>> {
        Self::arg(value)
    }
    fn call_arg<'a, T: Clone + 'a>(arg: Option<&'a T>) -> CallArg<T> {
        CallArg::opt_tensor(arg)
    }
    fn given_call_arg<'a, T: Clone + 'a>(given: Option<&'a T>) -> CallArg<T> {
        CallArg::opt_tensor(given)
    }
}

/// Implements [`OpParam`] for a marker whose in-place and `maybe_inplace` views equal its plain one.
macro_rules! plain_param {
    ($marker:ty, $kind:expr, $arg:ty, $meta:ty, |$v:ident| $from_value:expr, |$m:ident| $from_meta:expr, |$a:ident| $to_value:expr, |$am:ident| $to_meta:expr) => {
        impl OpParam for $marker {
            const KIND: ParamKind = $kind;
            type Arg<'a> = $arg;
            type Meta<'a> = $meta;
            type Given<'a> = $arg;
            type InplaceArg<'a> = $arg;
            type Taken = ();
            type CtxArg<'a, T: 'a> = $arg;
            type CtxGiven<'a, T: 'a> = $arg;

            fn arg($v: &Value) -> Option<Self::Arg<'_>> {
                $from_value
            }
            fn meta<'a>($m: &ArgMeta<'a>) -> Option<Self::Meta<'a>> {
                $from_meta
            }
            fn arg_meta<'a>($am: Self::Arg<'a>) -> ArgMeta<'a> {
                $to_meta
            }
            fn given_meta<'b, 'a: 'b>(given: &'b Self::Given<'a>) -> ArgMeta<'b> {
                Self::arg_meta(*given)
            }
            fn given_activation<'b, 'a: 'b>(_: &'b mut Self::Given<'a>) -> Option<&'b mut Tensor> {
                None
            }
            fn given_inplace<'a>(given: Self::Given<'a>) -> Result<Self::InplaceArg<'a>, TensorError> {
                Ok(given)
            }
            fn given_arg<'b, 'a: 'b>(given: &'b Self::Given<'a>) -> Self::Arg<'b> {
                *given
            }
            fn value($a: Self::Arg<'_>) -> Value {
                $to_value
            }
            fn given_value(given: Self::Given<'_>) -> Value {
                Self::value(given)
            }
            fn take(_: &mut [Value], _: usize) -> Result<(), KernelError> {
                Ok(())
            }
            fn inplace_arg((): (), value: &Value) -> Option<Self::InplaceArg<'_>> {
                Self::arg(value)
            }
            fn call_arg<'a, T: Clone + 'a>(arg: Self::CtxArg<'a, T>) -> CallArg<T> {
                scalar_call_arg(Self::value(arg))
            }
            fn given_call_arg<'a, T: Clone + 'a>(given: Self::CtxGiven<'a, T>) -> CallArg<T> {
                scalar_call_arg(Self::value(given))
            }
        }
    };
}

/// Reads an optional value: `none` is `Some(None)`, a matching value `Some(Some(_))`.
fn optional<T>(is_none: bool, read: impl FnOnce() -> Option<T>) -> Option<Option<T>> {
    if is_none { Some(None) } else { read().map(Some) }
}

/// Implements [`OpParam`] for a scalar marker and its `Option`, given the kinds, the [`Value`]
/// variant and the [`ArgMeta`] accessor.
macro_rules! scalar_param {
    ($t:ty, $kind:ident, $opt_kind:ident, $variant:ident, $accessor:ident) => {
        plain_param!(
            $t,
            ParamKind::$kind,
            $t,
            $t,
            |v| match v {
                Value::$variant(x) => Some(x.clone()),
                _ => None,
            },
            |m| m.$accessor(),
            |a| Value::$variant(a),
            |a| ArgMeta::$variant(a)
        );
        plain_param!(
            Option<$t>,
            ParamKind::$opt_kind,
            Option<$t>,
            Option<$t>,
            |v| optional(matches!(v, Value::None), || <$t>::arg(v)),
            |m| optional(matches!(m, ArgMeta::None), || m.$accessor()),
            |a| a.map_or(Value::None, Value::$variant),
            |a| a.map_or(ArgMeta::None, ArgMeta::$variant)
        );
    };
}

scalar_param!(f64, F64, OptF64, F64, f64);
scalar_param!(i64, I64, OptI64, I64, i64);
scalar_param!(bool, Bool, OptBool, Bool, bool);
scalar_param!(DType, DType, OptDType, DType, dtype);
plain_param!(
    Vec<i64>,
    ParamKind::Ints,
    &'a [i64],
    &'a [i64],
    |v| match v {
        Value::Ints(x) => Some(x.as_slice()),
        _ => None,
    },
    |m| m.ints(),
    |a| Value::Ints(a.to_vec()),
    |a| ArgMeta::Ints(a)
);
plain_param!(
    Option<Vec<i64>>,
    ParamKind::OptInts,
    Option<&'a [i64]>,
    Option<&'a [i64]>,
    |v| optional(matches!(v, Value::None), || <Vec<i64>>::arg(v)),
    |m| optional(matches!(m, ArgMeta::None), || m.ints()),
    |a| a.map_or(Value::None, |a| Value::Ints(a.to_vec())),
    |a| a.map_or(ArgMeta::None, ArgMeta::Ints)
);

/// A string parameter with a fixed set of allowed values, as a Rust enum (declare with
/// [`str_enum!`](crate::str_enum)).
pub trait StrEnum: Copy + Sized + 'static {
    /// The allowed spellings, in declaration order.
    const ALLOWED: &'static [&'static str];
    /// The value spelled `text`.
    fn from_str(text: &str) -> Option<Self>;
    /// The spelling.
    fn as_str(self) -> &'static str;
}

impl<E: StrEnum> OpParam for E {
    const KIND: ParamKind = ParamKind::Str(E::ALLOWED);
    type Arg<'a> = E;
    type Meta<'a> = E;
    type Given<'a> = E;
    type InplaceArg<'a> = E;
    type Taken = ();

    fn arg(value: &Value) -> Option<E> {
        match value {
            Value::Str(text) => E::from_str(text),
            _ => None,
        }
    }
    fn meta<'a>(meta: &ArgMeta<'a>) -> Option<E> {
        meta.str().and_then(E::from_str)
    }
    fn arg_meta<'a>(arg: Self::Arg<'a>) -> ArgMeta<'a> {
        ArgMeta::Str(arg.as_str())
    }
    fn given_meta<'b, 'a: 'b>(given: &'b E) -> ArgMeta<'b> {
        ArgMeta::Str(given.as_str())
    }
    fn given_activation<'b, 'a: 'b>(_: &'b mut E) -> Option<&'b mut Tensor> {
        None
    }
    fn given_inplace<'a>(given: Self::Given<'a>) -> Result<Self::InplaceArg<'a>, TensorError> {
        Ok(given)
    }
    fn given_arg<'b, 'a: 'b>(given: &'b E) -> E {
        *given
    }
    fn value(arg: E) -> Value {
        Value::Str(arg.as_str().to_owned())
    }
    fn given_value(given: E) -> Value {
        Self::value(given)
    }
    fn take(_: &mut [Value], _: usize) -> Result<(), KernelError> {
        Ok(())
    }
    fn inplace_arg((): (), value: &Value) -> Option<E> {
        Self::arg(value)
    }
    type CtxArg<'a, T: 'a> = E;
    type CtxGiven<'a, T: 'a> = E;
    fn call_arg<'a, T: Clone + 'a>(arg: E) -> CallArg<T> {
        CallArg::Str(arg.as_str().to_owned())
    }
    fn given_call_arg<'a, T: Clone + 'a>(given: E) -> CallArg<T> {
        CallArg::Str(given.as_str().to_owned())
    }
}

/// Declares a Rust enum for a string parameter with fixed allowed values, implementing
/// [`StrEnum`] (and so [`OpParam`]): `approximate: Approximate` then has kind
/// `Literal["none", "tanh"]`, and callers pass `Approximate::Tanh`.
///
/// ```
/// ir_core::str_enum! {
///     /// How `gelu` is computed.
///     pub enum Approximate { None = "none", Tanh = "tanh" }
/// }
/// use ir_core::op::StrEnum;
/// assert_eq!(Approximate::ALLOWED, &["none", "tanh"]);
/// assert_eq!(Approximate::from_str("tanh"), Some(Approximate::Tanh));
/// ```
#[macro_export]
macro_rules! str_enum {
    ($(#[$attr:meta])* $vis:vis enum $name:ident { $($(#[$vattr:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$attr])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name {
            $($(#[$vattr])* #[doc = concat!("`\"", $text, "\"`")] $variant),+
        }

        impl $crate::op::StrEnum for $name {
            const ALLOWED: &'static [&'static str] = &[$($text),+];
            fn from_str(text: &str) -> Option<Self> {
                match text {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
            fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }
    };
}

/// The handles of one call's outputs, inline up to [`INLINE_OUTPUTS`](crate::op::INLINE_OUTPUTS).
pub type Handles<T> = smallvec::SmallVec<[T; crate::op::INLINE_OUTPUTS]>;

/// References to one call's output tensors, inline (a typed call checks its outputs through these
/// instead of moving the handles into a list).
pub type TensorRefs<'a> = smallvec::SmallVec<[&'a Tensor; 4]>;

/// The typed outputs of an op: one `Tensor` or a tuple of them.
pub trait OpOutputs: Sized {
    /// How many tensors at most (optional outputs included).
    const N: usize;
    /// The same shape of outputs with handles `T` (an execution context's tensors).
    type Of<T>;
    /// From a list of handles; `None` when its length does not fit (at most [`N`](Self::N), fewer
    /// only by absent optional outputs).
    fn from_handles<T>(outputs: Handles<T>) -> Option<Self::Of<T>>;
    /// Into a list of handles (inline: no allocation).
    fn into_handles<T>(outputs: Self::Of<T>) -> Handles<T>;
    /// The output tensors, in order (an absent optional output has none).
    fn tensors(&self) -> TensorRefs<'_>;
    /// From a call's output tensors; `None` when their number does not fit.
    fn from_outputs(outputs: crate::op::Outputs) -> Option<Self>;
}

/// Exactly `N` handles from `outputs`, or `None`.
fn exactly<T, const N: usize>(outputs: Handles<T>) -> Option<[T; N]> {
    if outputs.len() != N {
        return None;
    }
    // Each handle moved once, straight into its place (handles are about 100 bytes).
    let mut handles = outputs.into_iter();
    Some(std::array::from_fn(|_| handles.next().expect("the length was checked")))
}

impl OpOutputs for Tensor {
    const N: usize = 1;
    type Of<T> = T;
    fn from_handles<T>(mut outputs: Handles<T>) -> Option<T> {
        if outputs.len() != 1 {
            return None;
        }
        outputs.pop()
    }
    fn into_handles<T>(out: T) -> Handles<T> {
        smallvec::smallvec![out]
    }
    fn tensors(&self) -> TensorRefs<'_> {
        smallvec::smallvec![self]
    }
    fn from_outputs(outputs: crate::op::Outputs) -> Option<Tensor> {
        Self::from_handles(outputs)
    }
}

impl OpOutputs for (Tensor, Tensor) {
    const N: usize = 2;
    type Of<T> = (T, T);
    fn from_handles<T>(outputs: Handles<T>) -> Option<(T, T)> {
        let [a, b] = exactly::<T, 2>(outputs)?;
        Some((a, b))
    }
    fn into_handles<T>((a, b): (T, T)) -> Handles<T> {
        smallvec::smallvec![a, b]
    }
    fn tensors(&self) -> TensorRefs<'_> {
        smallvec::smallvec![&self.0, &self.1]
    }
    fn from_outputs(outputs: crate::op::Outputs) -> Option<(Tensor, Tensor)> {
        Self::from_handles(outputs)
    }
}

/// A required output and one that exists only when its optional activation is given: one or two
/// handles.
impl OpOutputs for (Tensor, Option<Tensor>) {
    const N: usize = 2;
    type Of<T> = (T, Option<T>);
    fn from_handles<T>(mut outputs: Handles<T>) -> Option<(T, Option<T>)> {
        match outputs.len() {
            1 => Some((outputs.pop()?, None)),
            2 => {
                let second = outputs.pop();
                Some((outputs.pop()?, second))
            }
            _ => None,
        }
    }
    fn into_handles<T>((a, b): (T, Option<T>)) -> Handles<T> {
        let mut handles: Handles<T> = smallvec::smallvec![a];
        handles.extend(b);
        handles
    }
    fn tensors(&self) -> TensorRefs<'_> {
        let mut tensors: TensorRefs<'_> = smallvec::smallvec![&self.0];
        tensors.extend(self.1.as_ref());
        tensors
    }
    fn from_outputs(outputs: crate::op::Outputs) -> Option<(Tensor, Option<Tensor>)> {
        Self::from_handles(outputs)
    }
}

impl OpOutputs for (Tensor, Tensor, Tensor) {
    const N: usize = 3;
    type Of<T> = (T, T, T);
    fn from_handles<T>(outputs: Handles<T>) -> Option<(T, T, T)> {
        let [a, b, c] = exactly::<T, 3>(outputs)?;
        Some((a, b, c))
    }
    fn into_handles<T>((a, b, c): (T, T, T)) -> Handles<T> {
        smallvec::smallvec![a, b, c]
    }
    fn tensors(&self) -> TensorRefs<'_> {
        smallvec::smallvec![&self.0, &self.1, &self.2]
    }
    fn from_outputs(outputs: crate::op::Outputs) -> Option<(Tensor, Tensor, Tensor)> {
        Self::from_handles(outputs)
    }
}

/// The names of the donated parameters among `names`, where `donated[i]` says whether `names[i]` is.
/// Evaluated at compile time by [`define_op!`](crate::define_op).
pub const fn donated_names<const N: usize, const K: usize>(
    names: [&'static str; N],
    donated: [bool; N],
) -> [&'static str; K] {
    let mut out = [""; K];
    let (mut i, mut k) = (0, 0);
    while i < N {
        if donated[i] {
            assert!(k < K, "more donated parameters than counted");
            out[k] = names[i];
            k += 1;
        }
        i += 1;
    }
    assert!(k == K, "fewer donated parameters than counted");
    out
}

/// How many of `donated` are true (compile time).
pub const fn count_donated<const N: usize>(donated: [bool; N]) -> usize {
    let (mut i, mut k) = (0, 0);
    while i < N {
        if donated[i] {
            k += 1;
        }
        i += 1;
    }
    k
}

/// The error of a typed wrapper whose bound arguments do not fit the declaration.
pub fn mismatched(op: &str) -> KernelError {
    KernelError::InvalidArguments { reason: format!("{op} arguments do not match its parameters") }
}

/// Takes the tensor at `index` out of a bound argument list (for typed wrappers).
pub(crate) fn take_tensor(args: &mut [Value], index: usize) -> Result<Tensor, KernelError> {
    match std::mem::replace(&mut args[index], Value::None) {
        Value::Tensor(t) => Ok(t),
        _ => Err(KernelError::InvalidArguments { reason: format!("argument {index} is not a tensor") }),
    }
}

/// Takes the activation at `index` as a [`UniqueTensor`] (for typed in-place wrappers).
pub(crate) fn take_unique(args: &mut [Value], index: usize) -> Result<UniqueTensor, KernelError> {
    let tensor = take_tensor(args, index)?;
    Ok(UniqueTensor::writable(tensor)?)
}
