//! Execution contexts: the operations model code uses, so one model source runs eagerly or is traced.
//!
//! [`EagerContext`] runs on real [`Tensor`]s through a registry. A tracing context (recording graph
//! nodes instead of running kernels) implements the same trait.

use crate::op::fused_add_rms_norm::{fused_add_rms_norm, fused_add_rms_norm_maybe_inplace};
use crate::op::rms_norm::rms_norm;
use crate::{CallError, Registry, Tensor, TensorMeta};

/// What models need from the place they run in.
pub trait ExecutionContext {
    /// The tensor handle type (a real tensor, or a traced value).
    type Tensor: Clone + std::fmt::Debug;

    /// The metadata of a handle.
    fn meta<'t>(&self, t: &'t Self::Tensor) -> &'t TensorMeta;

    /// Brings a model parameter (a weight) into the context under a stable name.
    fn parameter(&self, name: &str, value: &Tensor) -> Result<Self::Tensor, CallError>;

    /// `rms_norm`, functional.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: Option<&Self::Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<Self::Tensor, CallError>;

    /// `fused_add_rms_norm`, functional.
    fn fused_add_rms_norm(
        &self,
        x: &Self::Tensor,
        x_residual: &Self::Tensor,
        weight: Option<&Self::Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<(Self::Tensor, Self::Tensor), CallError>;

    /// `fused_add_rms_norm`, `maybe_inplace`: `x` and `x_residual` are donated.
    fn fused_add_rms_norm_maybe_inplace(
        &self,
        x: Self::Tensor,
        x_residual: Self::Tensor,
        weight: Option<&Self::Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<(Self::Tensor, Self::Tensor), CallError>;

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

    fn rms_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<Tensor, CallError> {
        rms_norm(self.registry, x, weight, epsilon, variance_size)
    }

    fn fused_add_rms_norm(
        &self,
        x: &Tensor,
        x_residual: &Tensor,
        weight: Option<&Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<(Tensor, Tensor), CallError> {
        fused_add_rms_norm(self.registry, x, x_residual, weight, epsilon, variance_size)
    }

    fn fused_add_rms_norm_maybe_inplace(
        &self,
        x: Tensor,
        x_residual: Tensor,
        weight: Option<&Tensor>,
        epsilon: f64,
        variance_size: Option<i64>,
    ) -> Result<(Tensor, Tensor), CallError> {
        fused_add_rms_norm_maybe_inplace(self.registry, x, x_residual, weight, epsilon, variance_size)
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
