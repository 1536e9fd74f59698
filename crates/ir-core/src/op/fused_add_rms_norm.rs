//! `fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size) -> (out, residual_out)`.
//!
//! `residual_out = x + x_residual` and `out = rms_norm(residual_out)`, computed from the unrounded sum.
//! `allow_inplace`; activations `[x, x_residual]`; `out` ↔ `x`, `residual_out` ↔ `x_residual`.

use rand::SeedableRng;

use crate::implementation::{ImplFunc, take_unique};
use crate::op::norm_math::{NormParams, native_norm, norm_meta, normal_tensor};
use crate::op::rms_norm::{opt_i64, opt_tensor};
use crate::op::{Activations, ArgMeta, InputSpec, Literal, MetaError, OpDef, Overload, ParamDef, ParamKind, Value};
use crate::{CallError, ImplSpec, KernelError, Registry, RegistryError, Tensor, TensorError, TensorMeta, UniqueTensor};

/// The definition of `fused_add_rms_norm`.
pub static FUSED_ADD_RMS_NORM: OpDef = OpDef {
    name: "fused_add_rms_norm",
    params: &[
        ParamDef { name: "x", kind: ParamKind::Tensor, default: None },
        ParamDef { name: "x_residual", kind: ParamKind::Tensor, default: None },
        ParamDef { name: "weight", kind: ParamKind::OptTensor, default: None },
        ParamDef { name: "epsilon", kind: ParamKind::F64, default: None },
        ParamDef { name: "variance_size", kind: ParamKind::OptI64, default: Some(Literal::None) },
    ],
    n_outputs: 2,
    activations: Activations::Default,
    allow_inplace: true,
    native: native_dynamic,
    meta,
    generate_inputs: generate,
    tolerances: &[(crate::DType::F16, crate::op::Tolerance { atol: 1e-2, rtol: 2e-3 })],
    description: "residual add followed by RMS normalization; returns (out, residual_out)",
};

const PARAMS: NormParams =
    NormParams { op: "fused_add_rms_norm", x: 0, residual: Some(1), weight: 2, epsilon: 3, variance_size: 4 };

/// The typed signature of a functional implementation (a closure: it may capture state).
pub type FusedAddRmsNormFn = std::sync::Arc<
    dyn Fn(&Tensor, &Tensor, Option<&Tensor>, f64, Option<i64>) -> Result<(Tensor, Tensor), KernelError> + Send + Sync,
>;

/// The typed signature of an in-place implementation: writes `out` into x's storage and
/// `residual_out` into x_residual's, and returns those two tensors (a closure: it may capture state).
pub type FusedAddRmsNormInplaceFn = std::sync::Arc<
    dyn Fn(UniqueTensor, UniqueTensor, Option<&Tensor>, f64, Option<i64>) -> Result<(Tensor, Tensor), KernelError>
        + Send
        + Sync,
>;

/// The functional call: inputs never change and outputs never alias them.
pub fn fused_add_rms_norm(
    registry: &Registry,
    x: &Tensor,
    x_residual: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<(Tensor, Tensor), CallError> {
    let args = args(x.clone(), x_residual.clone(), weight, epsilon, variance_size);
    pair(registry.call_op(&FUSED_ADD_RMS_NORM, args, Overload::Default)?)
}

/// The `maybe_inplace` call: `x` and `x_residual` are donated (moved in), so an in-place kernel may
/// write the outputs into their storage when nothing else refers to it.
///
/// ```compile_fail
/// # use ir_core::{DType, Registry, Tensor};
/// # use ir_core::op::fused_add_rms_norm::fused_add_rms_norm_maybe_inplace;
/// let registry = Registry::with_builtin_ops();
/// let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
/// let residual = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
/// let (out, new_residual) = fused_add_rms_norm_maybe_inplace(&registry, x, residual, None, 1e-6, None).unwrap();
/// // `x` was donated: using it again does not compile.
/// println!("{:?}", x.shape());
/// ```
pub fn fused_add_rms_norm_maybe_inplace(
    registry: &Registry,
    x: Tensor,
    x_residual: Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<(Tensor, Tensor), CallError> {
    let args = args(x, x_residual, weight, epsilon, variance_size);
    pair(registry.call_op(&FUSED_ADD_RMS_NORM, args, Overload::MaybeInplace)?)
}

/// A typed implementation function of either kind.
pub enum FusedAddRmsNormImpl {
    /// Writes no argument; returns fresh outputs.
    Functional(FusedAddRmsNormFn),
    /// Writes the outputs into the donated activations.
    Inplace(FusedAddRmsNormInplaceFn),
}

impl FusedAddRmsNormImpl {
    /// A functional implementation from a function or closure.
    pub fn functional(
        f: impl Fn(&Tensor, &Tensor, Option<&Tensor>, f64, Option<i64>) -> Result<(Tensor, Tensor), KernelError>
        + Send
        + Sync
        + 'static,
    ) -> FusedAddRmsNormImpl {
        FusedAddRmsNormImpl::Functional(std::sync::Arc::new(f))
    }

    /// An in-place implementation from a function or closure.
    pub fn inplace(
        f: impl Fn(UniqueTensor, UniqueTensor, Option<&Tensor>, f64, Option<i64>) -> Result<(Tensor, Tensor), KernelError>
        + Send
        + Sync
        + 'static,
    ) -> FusedAddRmsNormImpl {
        FusedAddRmsNormImpl::Inplace(std::sync::Arc::new(f))
    }
}

/// Registers an implementation of `fused_add_rms_norm` with a typed signature.
#[track_caller]
pub fn register(registry: &Registry, spec: ImplSpec, func: FusedAddRmsNormImpl) -> Result<(), RegistryError> {
    let erased = match func {
        FusedAddRmsNormImpl::Functional(f) => ImplFunc::functional(move |args| {
            let (x, residual, weight, epsilon, variance_size) = unpack(args)?;
            let (out, residual_out) = f(x, residual, weight, epsilon, variance_size)?;
            Ok(vec![out, residual_out])
        }),
        FusedAddRmsNormImpl::Inplace(f) => ImplFunc::inplace(move |mut args| {
            let x = take_unique(&mut args, 0)?;
            let residual = take_unique(&mut args, 1)?;
            let (weight, epsilon, variance_size) = unpack_scalars(&args)?;
            let (out, residual_out) = f(x, residual, weight, epsilon, variance_size)?;
            Ok(vec![out, residual_out])
        }),
    };
    registry.register_impl(FUSED_ADD_RMS_NORM.name, spec, erased)
}

/// The reference implementation (the semantics).
pub fn native(
    x: &Tensor,
    x_residual: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<(Tensor, Tensor), KernelError> {
    let (out, residual_out) = native_norm(x, Some(x_residual), weight, epsilon, variance_size)?;
    Ok((out, residual_out.expect("a residual was given")))
}

/// Typed view of `fused_add_rms_norm`'s argument metadata, for predicates.
#[derive(Clone, Copy, Debug)]
pub struct FusedAddRmsNormArgs<'a> {
    /// Input.
    pub x: &'a TensorMeta,
    /// Residual input.
    pub x_residual: &'a TensorMeta,
    /// Optional weight.
    pub weight: Option<&'a TensorMeta>,
    /// Epsilon.
    pub epsilon: f64,
    /// Number of leading elements of each row the variance is computed over.
    pub variance_size: Option<i64>,
}

impl<'a> FusedAddRmsNormArgs<'a> {
    /// Reads a bound argument list; `None` when kinds do not match.
    pub fn from_meta(args: &[ArgMeta<'a>]) -> Option<FusedAddRmsNormArgs<'a>> {
        Some(FusedAddRmsNormArgs {
            x: args.first()?.tensor()?,
            x_residual: args.get(1)?.tensor()?,
            weight: opt_tensor(args.get(2)?)?,
            epsilon: args.get(3)?.f64()?,
            variance_size: opt_i64(args.get(4)?)?,
        })
    }
}

fn args(
    x: Tensor,
    x_residual: Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Vec<Value> {
    vec![
        Value::Tensor(x),
        Value::Tensor(x_residual),
        Value::opt_tensor(weight),
        Value::F64(epsilon),
        Value::opt_i64(variance_size),
    ]
}

fn pair(mut outputs: Vec<Tensor>) -> Result<(Tensor, Tensor), CallError> {
    let residual_out = outputs.pop().expect("the registry checks the number of outputs");
    let out = outputs.pop().expect("the registry checks the number of outputs");
    Ok((out, residual_out))
}

type Scalars<'a> = (Option<&'a Tensor>, f64, Option<i64>);

/// `(x, x_residual, weight, epsilon, variance_size)` borrowed from a bound argument list.
type Unpacked<'a> = (&'a Tensor, &'a Tensor, Option<&'a Tensor>, f64, Option<i64>);

fn unpack(args: &[Value]) -> Result<Unpacked<'_>, KernelError> {
    let x = args.first().and_then(Value::as_tensor).ok_or_else(bad_args)?;
    let residual = args.get(1).and_then(Value::as_tensor).ok_or_else(bad_args)?;
    let (weight, epsilon, variance_size) = unpack_scalars(args)?;
    Ok((x, residual, weight, epsilon, variance_size))
}

fn unpack_scalars(args: &[Value]) -> Result<Scalars<'_>, KernelError> {
    let weight = match args.get(2) {
        Some(Value::Tensor(w)) => Some(w),
        Some(Value::None) => None,
        _ => return Err(bad_args()),
    };
    let Some(Value::F64(epsilon)) = args.get(3) else { return Err(bad_args()) };
    let variance_size = match args.get(4) {
        Some(Value::I64(v)) => Some(*v),
        Some(Value::None) => None,
        _ => return Err(bad_args()),
    };
    Ok((weight, *epsilon, variance_size))
}

fn bad_args() -> KernelError {
    KernelError::InvalidArguments { reason: "fused_add_rms_norm arguments do not match its parameters".to_owned() }
}

fn native_dynamic(args: &[Value]) -> Result<Vec<Tensor>, KernelError> {
    let (x, residual, weight, epsilon, variance_size) = unpack(args)?;
    let (out, residual_out) = native(x, residual, weight, epsilon, variance_size)?;
    Ok(vec![out, residual_out])
}

fn meta(args: &[ArgMeta<'_>]) -> Result<Vec<TensorMeta>, MetaError> {
    norm_meta(&PARAMS, args)
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(spec.seed);
    let shape = [spec.num_tokens, spec.hidden_size];
    let x = normal_tensor(&mut rng, spec.dtype, &shape, 0.0, 1.0)?;
    let residual = normal_tensor(&mut rng, spec.dtype, &shape, 0.0, 1.0)?;
    let weight = normal_tensor(&mut rng, spec.dtype, &[spec.hidden_size], 1.0, 0.1)?;
    Ok(vec![Value::Tensor(x), Value::Tensor(residual), Value::Tensor(weight), Value::F64(spec.epsilon), Value::None])
}
