//! Execution contexts: the operations model code uses, so one model source runs eagerly or is traced.
//!
//! [`EagerContext`] runs on real [`Tensor`]s through a registry. A tracing context (recording graph
//! nodes instead of running kernels) implements the same trait.

use crate::op::{ArgMeta, OpDef, Overload, Value};
use crate::{CallError, Registry, Tensor, TensorMeta};

/// One argument of [`ExecutionContext::call`]: a tensor handle of the context, or a constant.
///
/// Tensor handles are owned: a `maybe_inplace` call donates its activations by moving them in, and a
/// functional call gets a handle copy (cheap: `Tensor` and traced handles are reference counted).
#[derive(Clone, Debug)]
pub enum CallArg<T> {
    /// A tensor handle.
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
    Str(String),
    /// A dtype.
    DType(crate::DType),
    /// A list of integers.
    Ints(Vec<i64>),
}

impl<T: Clone> CallArg<T> {
    /// A handle copy of `t`, or `none`.
    pub fn opt_tensor(t: Option<&T>) -> CallArg<T> {
        t.map_or(CallArg::None, |t| CallArg::Tensor(t.clone()))
    }
}

impl<T> CallArg<T> {
    /// An integer, or `none`.
    pub fn opt_i64(v: Option<i64>) -> CallArg<T> {
        v.map_or(CallArg::None, CallArg::I64)
    }

    /// The dynamic argument, with `tensor` turning a handle into a [`Value`].
    pub fn into_value(self, tensor: impl FnOnce(T) -> Value) -> Value {
        match self {
            CallArg::Tensor(t) => tensor(t),
            CallArg::None => Value::None,
            CallArg::F64(v) => Value::F64(v),
            CallArg::I64(v) => Value::I64(v),
            CallArg::Bool(v) => Value::Bool(v),
            CallArg::Str(v) => Value::Str(v),
            CallArg::DType(v) => Value::DType(v),
            CallArg::Ints(v) => Value::Ints(v),
        }
    }

    /// What a meta function sees of the argument, with `meta` giving a handle's metadata.
    pub fn meta<'a>(&'a self, meta: impl FnOnce(&'a T) -> &'a TensorMeta) -> ArgMeta<'a> {
        match self {
            CallArg::Tensor(t) => ArgMeta::Tensor(meta(t)),
            CallArg::None => ArgMeta::None,
            CallArg::F64(v) => ArgMeta::F64(*v),
            CallArg::I64(v) => ArgMeta::I64(*v),
            CallArg::Bool(v) => ArgMeta::Bool(*v),
            CallArg::Str(v) => ArgMeta::Str(v),
            CallArg::DType(v) => ArgMeta::DType(*v),
            CallArg::Ints(v) => ArgMeta::Ints(v),
        }
    }
}

/// What models need from the place they run in.
///
/// Every op goes through one generic [`call`](ExecutionContext::call), so an op defined in any crate
/// (and registered with the context's registry) runs eagerly and is traced with no per-op code in
/// the contexts; the typed methods for the built-in ops are sugar over it.
pub trait ExecutionContext {
    /// The tensor handle type (a real tensor, or a traced value).
    type Tensor: Clone + std::fmt::Debug;

    /// The metadata of a handle.
    fn meta<'t>(&self, t: &'t Self::Tensor) -> &'t TensorMeta;

    /// Brings a model parameter (a weight) into the context under a stable name.
    fn parameter(&self, name: &str, value: &Tensor) -> Result<Self::Tensor, CallError>;

    /// Calls `op` with positional arguments (trailing defaults may be omitted), functional or
    /// `maybe_inplace`; validated exactly like the registry's own entry points. The op must be
    /// defined in the context's registry.
    fn call(
        &self,
        op: &'static OpDef,
        overload: Overload,
        args: Vec<CallArg<Self::Tensor>>,
    ) -> Result<Vec<Self::Tensor>, CallError>;

    /// `rms_norm`, functional (sugar for the declaration's [`rms_norm::call`](crate::op::rms_norm::call)).
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: Option<&Self::Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<Self::Tensor, CallError> {
        crate::op::rms_norm::call(self, x, weight, epsilon, variance_size)
    }

    /// `fused_add_rms_norm`, functional.
    fn fused_add_rms_norm(
        &self,
        x: &Self::Tensor,
        x_residual: &Self::Tensor,
        weight: Option<&Self::Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<(Self::Tensor, Self::Tensor), CallError> {
        crate::op::fused_add_rms_norm::call(self, x, x_residual, weight, epsilon, variance_size)
    }

    /// `fused_add_rms_norm`, `maybe_inplace`: `x` and `x_residual` are donated.
    fn fused_add_rms_norm_maybe_inplace(
        &self,
        x: Self::Tensor,
        x_residual: Self::Tensor,
        weight: Option<&Self::Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<(Self::Tensor, Self::Tensor), CallError> {
        crate::op::fused_add_rms_norm::call_maybe_inplace(self, x, x_residual, weight, epsilon, variance_size)
    }

    /// A view of `start..end` along `dim`.
    fn slice(&self, t: &Self::Tensor, dim: usize, start: usize, end: usize) -> Result<Self::Tensor, CallError>;
    /// A view with two dimensions swapped.
    fn transpose(&self, t: &Self::Tensor, d0: usize, d1: usize) -> Result<Self::Tensor, CallError>;
    /// A view with another shape.
    fn reshape(&self, t: &Self::Tensor, shape: &[usize]) -> Result<Self::Tensor, CallError>;
    /// A copy (source strides if dense, else compact).
    fn clone_tensor(&self, t: &Self::Tensor) -> Result<Self::Tensor, CallError>;
    /// A compact copy.
    fn contiguous(&self, t: &Self::Tensor) -> Result<Self::Tensor, CallError>;
    /// Elementwise sum.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, CallError>;
    /// Elementwise product.
    fn mul(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, CallError>;
    /// Multiplication by a constant.
    fn scale(&self, t: &Self::Tensor, factor: f64) -> Result<Self::Tensor, CallError>;
}

/// The `N` outputs of a call of `op`, as an array (a contract violation if the count differs).
pub fn outputs<T, const N: usize>(op: &'static OpDef, outputs: Vec<T>) -> Result<[T; N], CallError> {
    let found = outputs.len();
    outputs.try_into().map_err(|_| CallError::ContractViolation {
        op: op.name,
        provider: "context",
        problem: format!("returned {found} outputs, expected {N}"),
    })
}

/// Runs models on real tensors, dispatching through a registry.
#[derive(Clone, Copy, Debug)]
pub struct EagerContext<'r> {
    /// The registry whose installed priorities choose the kernels.
    pub registry: &'r Registry,
}

impl<'r> EagerContext<'r> {
    /// A context dispatching through `registry`.
    pub fn new(registry: &'r Registry) -> EagerContext<'r> {
        EagerContext { registry }
    }
}

impl ExecutionContext for EagerContext<'_> {
    type Tensor = Tensor;

    fn meta<'t>(&self, t: &'t Tensor) -> &'t TensorMeta {
        t.meta()
    }

    fn parameter(&self, _name: &str, value: &Tensor) -> Result<Tensor, CallError> {
        Ok(value.clone())
    }

    fn call(
        &self,
        op: &'static OpDef,
        overload: Overload,
        args: Vec<CallArg<Tensor>>,
    ) -> Result<Vec<Tensor>, CallError> {
        let values = args.into_iter().map(|arg| arg.into_value(Value::Tensor)).collect();
        self.registry.call_def(op, overload, values)
    }

    fn slice(&self, t: &Tensor, dim: usize, start: usize, end: usize) -> Result<Tensor, CallError> {
        Ok(t.slice(dim, start, end)?)
    }

    fn transpose(&self, t: &Tensor, d0: usize, d1: usize) -> Result<Tensor, CallError> {
        Ok(t.transpose(d0, d1)?)
    }

    fn reshape(&self, t: &Tensor, shape: &[usize]) -> Result<Tensor, CallError> {
        Ok(t.reshape(shape)?)
    }

    fn clone_tensor(&self, t: &Tensor) -> Result<Tensor, CallError> {
        Ok(t.deep_clone()?)
    }

    fn contiguous(&self, t: &Tensor) -> Result<Tensor, CallError> {
        Ok(t.contiguous()?)
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor, CallError> {
        Ok(a.add(b)?)
    }

    fn mul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor, CallError> {
        Ok(a.mul(b)?)
    }

    fn scale(&self, t: &Tensor, factor: f64) -> Result<Tensor, CallError> {
        Ok(t.scale(factor)?)
    }
}
