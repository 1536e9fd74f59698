//! `define_op!` and `str_enum!`, with the parameter markers and output shapes they expand to (the
//! table of markers is in the `op` module's documentation).

use crate::op::{ArgMeta, ParamKind, Value};
use crate::{CallArg, DType, KernelError, Tensor, TensorError, TensorMeta, UniqueTensor};

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
        crate::implementation::take_unique(args, index)
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
            _ => crate::implementation::take_unique(args, index).map(Some),
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

/// The error of a context call that returned another number of outputs than declared.
pub fn output_count(op: &'static str, found: usize, expected: usize) -> crate::CallError {
    crate::CallError::ContractViolation {
        op,
        provider: "context",
        problem: format!("returned {found} outputs, expected {expected}"),
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

/// Declares an op once; generates its [`OpDef`](crate::op::OpDef) static, the typed functional call, the
/// `maybe_inplace` call (with `inplace: true`), typed registration, a typed argument view for
/// predicates, and the dynamic adapter around the typed native function.
///
/// ```
/// use ir_core::op::{Activation, InputSpec, MetaError, ArgMeta, Value};
/// use ir_core::{KernelError, Tensor, TensorError, TensorMeta};
///
/// ir_core::define_op! {
///     /// `negate(x) -> out`.
///     op negate {
///         def: NEGATE,
///         args: NegateArgs,
///         params: (x: Activation),
///         outputs: Tensor,
///         inplace: false,
///         native: negate_native,
///         meta: |args| Ok(ir_core::op::smallvec![args[0].tensor().unwrap().clone()]),
///         generate: |_spec| Ok(vec![Value::Tensor(Tensor::ones(ir_core::DType::F32, &[2, 4])?)]),
///         tolerances: &[],
///         description: "negation",
///     }
/// }
///
/// fn negate_native(x: &Tensor) -> Result<Tensor, KernelError> {
///     Ok(x.scale(-1.0)?)
/// }
///
/// let registry = ir_core::Registry::new();
/// registry.define_op(&NEGATE)?;
/// let x = Tensor::ones(ir_core::DType::F32, &[2, 4])?;
/// let out = negate(&registry, &x)?;
/// assert_eq!(out.to_f64_vec()?, vec![-1.0; 8]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[macro_export]
macro_rules! define_op {
    (
        $(#[$attr:meta])*
        op $name:ident {
            def: $def:ident,
            args: $args:ident,
            params: ($($(#[$pattr:meta])* $param:ident : $ty:ty $(= $default:expr)?),+ $(,)?),
            outputs: $out:ty,
            inplace: $inplace:tt,
            native: $native:expr,
            meta: $meta:expr,
            generate: $generate:expr,
            tolerances: $tolerances:expr,
            description: $description:expr $(,)?
        }
    ) => {
        $(#[$attr])*
        pub static $def: $crate::op::OpDef = $crate::op::OpDef {
            name: stringify!($name),
            params: &[$($crate::op::ParamDef {
                name: stringify!($param),
                kind: <$ty as $crate::__macro_support::OpParam>::KIND,
                default: $crate::define_op!(@default $($default)?),
            }),+],
            n_outputs: <$out as $crate::__macro_support::OpOutputs>::N,
            activations: $crate::op::Activations::Explicit({
                const NAMES: [&str; [$(stringify!($param)),+].len()] = [$(stringify!($param)),+];
                const DONATED: [bool; NAMES.len()] = [$(<$ty as $crate::__macro_support::OpParam>::DONATED),+];
                const LIST: [&str; $crate::__macro_support::count_donated(DONATED)] = $crate::__macro_support::donated_names(NAMES, DONATED);
                &LIST
            }),
            allow_inplace: $inplace,
            native: {
                fn native_dynamic(
                    args: &[$crate::op::Value],
                ) -> ::std::result::Result<$crate::op::Outputs, $crate::KernelError> {
                    let mut index = 0..;
                    $(let $param = args.get(index.next().expect("unbounded")).and_then(<$ty as $crate::__macro_support::OpParam>::arg)
                        .ok_or_else(|| $crate::op::mismatched(stringify!($name)))?;)+
                    let outputs: $out = ($native)($($param),+)?;
                    Ok(<$out as $crate::__macro_support::OpOutputs>::into_handles(outputs))
                }
                native_dynamic
            },
            meta: $meta,
            generate_inputs: $generate,
            tolerances: $tolerances,
            description: $description,
        };

        #[doc = concat!("Typed view of `", stringify!($name), "`'s argument metadata, for `supports` predicates.")]
        #[derive(Clone, Copy, Debug)]
        pub struct $args<'a> {
            $($(#[$pattr])* #[doc = concat!("`", stringify!($param), "`.")]
            pub $param: <$ty as $crate::__macro_support::OpParam>::Meta<'a>,)+
        }

        impl<'a> $args<'a> {
            /// Reads a bound argument list; `None` when its length or kinds do not match.
            pub fn from_meta(args: &[$crate::op::ArgMeta<'a>]) -> ::std::option::Option<$args<'a>> {
                let mut args = args.iter();
                let view = $args { $($param: <$ty as $crate::__macro_support::OpParam>::meta(args.next()?)?,)+ };
                args.next().is_none().then_some(view)
            }
        }

        $crate::define_op!(@positions $name $args [] $($param)+);
        $crate::define_op!(@functional_call $name $def ($($param : $ty),+) [$out]);
        $crate::define_op!(@ctx_call $name $def Default call CtxArg call_arg ($($param : $ty),+) [$out]
            "functional: inputs never change and outputs never alias them");
        $crate::define_op!(@inplace $inplace $name $def ($($param : $ty),+) $out);
    };

    // The typed signature of a functional implementation of the op, as a trait object.
    (@typed_fn ($($param:ident : $ty:ty),+) [$out:ty]) => {
        dyn for<'a> Fn($(<$ty as $crate::__macro_support::OpParam>::Arg<'a>),+) -> ::std::result::Result<$out, $crate::KernelError>
            + Send + Sync
    };

    // The typed signature of an in-place implementation of the op, as a trait object.
    (@typed_inplace_fn ($($param:ident : $ty:ty),+) [$out:ty]) => {
        dyn for<'a> Fn($(<$ty as $crate::__macro_support::OpParam>::InplaceArg<'a>),+) -> ::std::result::Result<$out, $crate::KernelError>
            + Send + Sync
    };

    (@maybe_inplace_call $name:ident $def:ident ($($param:ident : $ty:ty),+) [$out:ty]) => {
        #[doc = concat!("`", stringify!($name), "` through the registry's installed priorities, `maybe_inplace`: the activations are donated (moved in), so an in-place implementation may write the outputs into their storage when nothing else refers to it.")]
        ///
        /// An implementation registered through this op's `register` runs on the arguments as they
        /// are (a donated activation that something else refers to is copied first); any other goes
        /// through the bound-argument path.
        #[allow(clippy::too_many_arguments)]
        pub fn maybe_inplace(
            registry: &$crate::Registry,
            $($param: <$ty as $crate::__macro_support::OpParam>::Given<'_>),+
        ) -> ::std::result::Result<$out, $crate::CallError> {
            $(#[allow(unused_mut)] let mut $param = $param;)+
            let selected = registry.select_declared(&$def, &[$(<$ty as $crate::__macro_support::OpParam>::given_meta(&$param)),+])?;
            let outputs = if let Some(func) =
                selected.typed_inplace::<$crate::define_op!(@typed_inplace_fn ($($param : $ty),+) [$out])>()
            {
                // Every activation checked before any is copied, then prepared in order.
                let mut index = 0;
                $(if let Some(activation) = <$ty as $crate::__macro_support::OpParam>::given_activation(&mut $param) {
                    selected.check_activation(index, activation)?;
                    index += 1;
                })+
                let _ = index;
                $(if let Some(activation) = <$ty as $crate::__macro_support::OpParam>::given_activation(&mut $param) {
                    selected.prepare_activation(activation)?;
                })+
                let ran: ::std::result::Result<$out, $crate::KernelError> = 'run: {
                    $(let $param = match <$ty as $crate::__macro_support::OpParam>::given_inplace($param) {
                        Ok(arg) => arg,
                        Err(e) => break 'run Err(e.into()),
                    };)+
                    func($($param),+)
                };
                selected.finish(ran)?
            } else if let Some(func) =
                selected.typed_functional::<$crate::define_op!(@typed_fn ($($param : $ty),+) [$out])>()
            {
                selected.finish(func($(<$ty as $crate::__macro_support::OpParam>::given_arg(&$param)),+))?
            } else {
                let mut args = [$(<$ty as $crate::__macro_support::OpParam>::given_value($param)),+];
                <$out as $crate::__macro_support::OpOutputs>::from_outputs(selected.run_bound(&mut args)?)
                    .expect("the registry checks the number of outputs")
            };
            Ok(outputs)
        }
    };

    // Each parameter's position in the argument list, as an associated constant of the view named
    // after the parameter (`RmsNormArgs::weight`), so passes index graph arguments by name.
    (@positions $name:ident $args:ident [$($done:ident)*]) => {};
    (@positions $name:ident $args:ident [$($done:ident)*] $next:ident $($rest:ident)*) => {
        impl $args<'_> {
            #[doc = concat!("The position of `", stringify!($next), "` in `", stringify!($name), "`'s argument list.")]
            #[allow(non_upper_case_globals)]
            pub const $next: usize = 0 $(+ $crate::define_op!(@one $done))*;
        }
        $crate::define_op!(@positions $name $args [$($done)* $next] $($rest)*);
    };
    (@one $done:ident) => {
        1
    };

    (@functional_call $name:ident $def:ident ($($param:ident : $ty:ty),+) [$out:ty]) => {
        #[doc = concat!("`", stringify!($name), "` through the registry's installed priorities, functional: inputs never change and outputs never alias them.")]
        ///
        /// A functional implementation registered through this op's `register` runs on the borrowed
        /// arguments as they are; any other goes through the bound-argument path.
        #[allow(clippy::too_many_arguments)]
        pub fn $name(
            registry: &$crate::Registry,
            $($param: <$ty as $crate::__macro_support::OpParam>::Arg<'_>),+
        ) -> ::std::result::Result<$out, $crate::CallError> {
            let metas = [$(<$ty as $crate::__macro_support::OpParam>::arg_meta($param)),+];
            registry.call_typed::<$crate::define_op!(@typed_fn ($($param : $ty),+) [$out]), $out, _>(
                &$def,
                &metas,
                |func| func($($param),+),
                || [$(<$ty as $crate::__macro_support::OpParam>::value($param)),+],
            )
        }
    };

    (@ctx_call $name:ident $def:ident $overload:ident $ctx_fname:ident $ctx_given:ident $to_call_arg:ident
        ($($param:ident : $ty:ty),+) [$out:ty] $what:literal) => {
        #[doc = concat!("`", stringify!($name), "` through an execution context (eager, traced, or an engine's own), ", $what, ".")]
        #[allow(clippy::too_many_arguments)]
        pub fn $ctx_fname<'a, C: $crate::ExecutionContext + ?Sized>(
            ctx: &C,
            $($param: <$ty as $crate::__macro_support::OpParam>::$ctx_given<'a, C::Tensor>),+
        ) -> ::std::result::Result<<$out as $crate::__macro_support::OpOutputs>::Of<C::Tensor>, $crate::CallError>
        where
            C::Tensor: 'a,
        {
            let args = vec![$(<$ty as $crate::__macro_support::OpParam>::$to_call_arg::<C::Tensor>($param)),+];
            let outputs = ctx.call(&$def, $crate::op::Overload::$overload, args)?;
            let found = outputs.len();
            <$out as $crate::__macro_support::OpOutputs>::from_handles($crate::op::Handles::from_vec(outputs))
                .ok_or_else(|| $crate::__macro_support::output_count($def.name, found, <$out as $crate::__macro_support::OpOutputs>::N))
        }
    };

    (@default) => { None };
    (@default $default:expr) => { Some($default) };

    (@inplace false $name:ident $def:ident ($($param:ident : $ty:ty),+) $out:ty) => {
        #[doc = concat!("Registers a (functional) implementation of `", stringify!($name), "` from a function or closure with the typed signature.")]
        #[track_caller]
        pub fn register(
            registry: &$crate::Registry,
            spec: $crate::ImplSpec,
            func: impl Fn($(<$ty as $crate::__macro_support::OpParam>::Arg<'_>),+) -> ::std::result::Result<$out, $crate::KernelError>
                + Send + Sync + 'static,
        ) -> ::std::result::Result<(), $crate::RegistryError> {
            registry.register_impl($def.name, spec, $crate::define_op!(@functional $name func ($($param : $ty),+) $out))
        }
    };

    (@inplace true $name:ident $def:ident ($($param:ident : $ty:ty),+) $out:ty) => {
        $crate::define_op!(@maybe_inplace_call $name $def ($($param : $ty),+) [$out]);
        $crate::define_op!(@ctx_call $name $def MaybeInplace call_maybe_inplace CtxGiven given_call_arg
            ($($param : $ty),+) [$out]
            "`maybe_inplace`: the activations are donated (moved in), so an in-place implementation may write the outputs into their storage when nothing else refers to it");

        #[doc = concat!("A typed implementation of `", stringify!($name), "`, functional or in place (a closure: it may capture state).")]
        pub enum Impl {
            /// Writes no argument; returns fresh outputs.
            Functional($crate::ImplFunc),
            /// Writes the outputs into the donated activations (received as `UniqueTensor`s) and returns them.
            Inplace($crate::ImplFunc),
        }

        impl Impl {
            /// A functional implementation from a function or closure.
            pub fn functional(
                func: impl Fn($(<$ty as $crate::__macro_support::OpParam>::Arg<'_>),+) -> ::std::result::Result<$out, $crate::KernelError>
                    + Send + Sync + 'static,
            ) -> Impl {
                Impl::Functional($crate::define_op!(@functional $name func ($($param : $ty),+) $out))
            }

            /// An in-place implementation from a function or closure.
            pub fn inplace(
                func: impl Fn($(<$ty as $crate::__macro_support::OpParam>::InplaceArg<'_>),+) -> ::std::result::Result<$out, $crate::KernelError>
                    + Send + Sync + 'static,
            ) -> Impl {
                // One function behind both paths: the bound-argument adapter and the typed call.
                let typed: ::std::sync::Arc<$crate::define_op!(@typed_inplace_fn ($($param : $ty),+) [$out])> =
                    ::std::sync::Arc::new(func);
                let func = ::std::sync::Arc::clone(&typed);
                Impl::Inplace($crate::ImplFunc::inplace(move |args: &mut [$crate::op::Value]| {
                    let mut index = 0..;
                    $(let $param = <$ty as $crate::__macro_support::OpParam>::take(args, index.next().expect("unbounded"))?;)+
                    let mut index = 0..;
                    $(let $param = args.get(index.next().expect("unbounded"))
                        .and_then(|value| <$ty as $crate::__macro_support::OpParam>::inplace_arg($param, value))
                        .ok_or_else(|| $crate::op::mismatched(stringify!($name)))?;)+
                    let outputs: $out = func($($param),+)?;
                    Ok(<$out as $crate::__macro_support::OpOutputs>::into_handles(outputs))
                }).with_typed(::std::sync::Arc::new(typed)))
            }
        }

        #[doc = concat!("Registers an implementation of `", stringify!($name), "`: `Impl::functional(f)` or `Impl::inplace(f)`.")]
        #[track_caller]
        pub fn register(
            registry: &$crate::Registry,
            spec: $crate::ImplSpec,
            func: Impl,
        ) -> ::std::result::Result<(), $crate::RegistryError> {
            let (Impl::Functional(erased) | Impl::Inplace(erased)) = func;
            registry.register_impl($def.name, spec, erased)
        }
    };

    (@functional $name:ident $func:ident ($($param:ident : $ty:ty),+) $out:ty) => {{
        // One function behind both paths: the bound-argument adapter and the typed call.
        let typed: ::std::sync::Arc<$crate::define_op!(@typed_fn ($($param : $ty),+) [$out])> =
            ::std::sync::Arc::new($func);
        let func = ::std::sync::Arc::clone(&typed);
        $crate::ImplFunc::functional(move |args: &[$crate::op::Value]| {
            let mut index = 0..;
            $(let $param = args.get(index.next().expect("unbounded")).and_then(<$ty as $crate::__macro_support::OpParam>::arg)
                .ok_or_else(|| $crate::op::mismatched(stringify!($name)))?;)+
            Ok(<$out as $crate::__macro_support::OpOutputs>::into_handles(func($($param),+)?))
        })
        .with_typed(::std::sync::Arc::new(typed))
    }};
}
