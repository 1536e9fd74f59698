//! `rms_norm(x, weight, epsilon, variance_size) -> out`: root-mean-square normalization of each row.
//!
//! Not `allow_inplace`; activations `[x]`. The math is in R53 of the spec and in `native` below.

use rand::SeedableRng;

use crate::implementation::ImplFunc;
use crate::op::norm_math::{NormParams, native_norm, norm_meta, normal_tensor};
use crate::op::{Activations, ArgMeta, InputSpec, Literal, MetaError, OpDef, Overload, ParamDef, ParamKind, Value};
use crate::{CallError, ImplSpec, KernelError, Registry, RegistryError, Tensor, TensorError, TensorMeta};

/// The definition of `rms_norm`.
pub static RMS_NORM: OpDef = OpDef {
    name: "rms_norm",
    params: &[
        ParamDef { name: "x", kind: ParamKind::Tensor, default: None },
        ParamDef { name: "weight", kind: ParamKind::OptTensor, default: None },
        ParamDef { name: "epsilon", kind: ParamKind::F64, default: None },
        ParamDef { name: "variance_size", kind: ParamKind::OptI64, default: Some(Literal::None) },
    ],
    n_outputs: 1,
    activations: Activations::Default,
    allow_inplace: false,
    native: native_dynamic,
    meta,
    generate_inputs: generate,
    tolerances: &[(crate::DType::F16, crate::op::Tolerance { atol: 1e-2, rtol: 2e-3 })],
    description: "RMS normalization over the last dimension, optionally scaled by a weight",
};

const PARAMS: NormParams = NormParams { op: "rms_norm", x: 0, residual: None, weight: 1, epsilon: 2, variance_size: 3 };

/// The typed implementation signature as a function pointer: `(x, weight, epsilon, variance_size) ->
/// out` (never in place). [`register`] takes any closure of this shape.
pub type RmsNormFn = fn(&Tensor, Option<&Tensor>, f64, Option<i64>) -> Result<Tensor, KernelError>;

/// The functional call: dispatches with the registry's installed priorities.
pub fn rms_norm(
    registry: &Registry,
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, CallError> {
    let args =
        vec![Value::Tensor(x.clone()), Value::opt_tensor(weight), Value::F64(epsilon), Value::opt_i64(variance_size)];
    let mut outputs = registry.call_op(&RMS_NORM, args, Overload::Default)?;
    Ok(outputs.pop().expect("the registry checks the number of outputs"))
}

/// Registers an implementation of `rms_norm` with the typed signature.
#[track_caller]
pub fn register(
    registry: &Registry,
    spec: ImplSpec,
    func: impl Fn(&Tensor, Option<&Tensor>, f64, Option<i64>) -> Result<Tensor, KernelError> + Send + Sync + 'static,
) -> Result<(), RegistryError> {
    let erased = ImplFunc::functional(move |args| {
        let (x, weight, epsilon, variance_size) = unpack(args)?;
        Ok(vec![func(x, weight, epsilon, variance_size)?])
    });
    registry.register_impl(RMS_NORM.name, spec, erased)
}

/// The reference implementation (the semantics).
pub fn native(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, KernelError> {
    Ok(native_norm(x, None, weight, epsilon, variance_size)?.0)
}

/// Typed view of `rms_norm`'s argument metadata, for predicates.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormArgs<'a> {
    /// Input.
    pub x: &'a TensorMeta,
    /// Optional weight.
    pub weight: Option<&'a TensorMeta>,
    /// Epsilon.
    pub epsilon: f64,
    /// Number of leading elements of each row the variance is computed over.
    pub variance_size: Option<i64>,
}

impl<'a> RmsNormArgs<'a> {
    /// Reads a bound argument list; `None` when kinds do not match.
    pub fn from_meta(args: &[ArgMeta<'a>]) -> Option<RmsNormArgs<'a>> {
        Some(RmsNormArgs {
            x: args.first()?.tensor()?,
            weight: opt_tensor(args.get(1)?)?,
            epsilon: args.get(2)?.f64()?,
            variance_size: opt_i64(args.get(3)?)?,
        })
    }
}

pub(crate) fn opt_tensor<'a>(arg: &ArgMeta<'a>) -> Option<Option<&'a TensorMeta>> {
    match arg {
        ArgMeta::None => Some(None),
        ArgMeta::Tensor(meta) => Some(Some(*meta)),
        _ => None,
    }
}

pub(crate) fn opt_i64(arg: &ArgMeta<'_>) -> Option<Option<i64>> {
    match arg {
        ArgMeta::None => Some(None),
        ArgMeta::I64(v) => Some(Some(*v)),
        _ => None,
    }
}

/// `(x, weight, epsilon, variance_size)` borrowed from a bound argument list.
type Unpacked<'a> = (&'a Tensor, Option<&'a Tensor>, f64, Option<i64>);

fn unpack(args: &[Value]) -> Result<Unpacked<'_>, KernelError> {
    let bad = || KernelError::InvalidArguments { reason: "rms_norm arguments do not match its parameters".to_owned() };
    let x = args.first().and_then(Value::as_tensor).ok_or_else(bad)?;
    let weight = match args.get(1) {
        Some(Value::Tensor(w)) => Some(w),
        Some(Value::None) => None,
        _ => return Err(bad()),
    };
    let Some(Value::F64(epsilon)) = args.get(2) else { return Err(bad()) };
    let variance_size = match args.get(3) {
        Some(Value::I64(v)) => Some(*v),
        Some(Value::None) => None,
        _ => return Err(bad()),
    };
    Ok((x, weight, *epsilon, variance_size))
}

fn native_dynamic(args: &[Value]) -> Result<Vec<Tensor>, KernelError> {
    let (x, weight, epsilon, variance_size) = unpack(args)?;
    Ok(vec![native(x, weight, epsilon, variance_size)?])
}

fn meta(args: &[ArgMeta<'_>]) -> Result<Vec<TensorMeta>, MetaError> {
    norm_meta(&PARAMS, args)
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(spec.seed);
    let x = normal_tensor(&mut rng, spec.dtype, &[spec.num_tokens, spec.hidden_size], 0.0, 1.0)?;
    let weight = normal_tensor(&mut rng, spec.dtype, &[spec.hidden_size], 1.0, 0.1)?;
    Ok(vec![Value::Tensor(x), Value::Tensor(weight), Value::F64(spec.epsilon), Value::None])
}
