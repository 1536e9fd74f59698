//! Execution contexts ([`ExecutionContext`] documents them).

use crate::builtin::{Builtin, BuiltinArg, Eval, Scalars, check_args};
use crate::op::{Handles, OpDef, Overload};
use crate::{CallError, Registry, Tensor, TensorMeta};

/// One argument of [`ExecutionContext::call`]: a tensor handle of the context, or a constant.
///
/// Tensor handles are owned: a `maybe_inplace` call donates its activations by moving them in, and a
/// functional call gets a handle copy (cheap: `Tensor` and traced handles are reference counted).
pub type CallArg<T> = crate::op::Arg<T>;

/// The arguments of [`OpCaller::call_op`], inline up to [`INLINE_ARGS`](crate::op::INLINE_ARGS).
pub type CallArgs<T> = smallvec::SmallVec<[CallArg<T>; crate::op::INLINE_ARGS]>;

/// What models need from the place they run in.
///
/// Execution contexts: the operations model code uses, so one model source runs eagerly or is traced.
///
/// [`EagerContext`] runs on real [`Tensor`]s through a registry. A tracing context (recording graph
/// nodes instead of running kernels) implements the same trait.
///
/// Every op goes through one generic [`call`](ExecutionContext::call), so an op defined in any crate
/// (and registered with the context's registry) runs eagerly and is traced with no per-op code in
/// the contexts, and every built-in through [`builtin`](ExecutionContext::builtin); the typed
/// built-in calls (`ctx.add(a, b)`, `ctx.slice(..)`) are [`ExecutionContextExt`]'s.
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

    /// Runs built-in `op` ([`crate::builtin`]) on `args`, of the kinds its table entry lists.
    fn builtin(&self, op: Builtin, args: Vec<BuiltinArg<Self::Tensor>>) -> Result<Self::Tensor, CallError>;
}

/// What the op calls `define_op!` generates run on: a tensor handle type and one generic call of an
/// op. Every [`ExecutionContext`] is one (so `rms_norm::call(&ctx, ..)` runs eagerly and is
/// traced); a tensor library's binding that is no execution context (no built-ins, no metadata of
/// its own), such as `ir_ops::candle_ops::Candle`, is one too, and so gets every op's typed call
/// on its tensors by construction.
pub trait OpCaller {
    /// The tensor handle type.
    type Tensor: Clone;
    /// The calls' error: a dispatch error converts into it.
    type Error: From<CallError>;

    /// Calls `op` with positional arguments (trailing defaults may be omitted), functional or
    /// `maybe_inplace`, as [`ExecutionContext::call`] does.
    fn call_op(
        &self,
        op: &'static OpDef,
        overload: Overload,
        args: CallArgs<Self::Tensor>,
    ) -> Result<Handles<Self::Tensor>, Self::Error>;
}

impl<C: ExecutionContext + ?Sized> OpCaller for C {
    type Tensor = C::Tensor;
    type Error = CallError;

    fn call_op(
        &self,
        op: &'static OpDef,
        overload: Overload,
        args: CallArgs<C::Tensor>,
    ) -> Result<Handles<C::Tensor>, CallError> {
        self.call(op, overload, args.into_vec()).map(Handles::from_vec)
    }
}

/// Typed calls of the built-ins on every execution context: sugar over
/// [`ExecutionContext::builtin`], implemented once for all contexts (a context cannot give one of
/// them another meaning).
pub trait ExecutionContextExt: ExecutionContext {
    /// A view of `start..end` along `dim`.
    fn slice(&self, t: &Self::Tensor, dim: usize, start: usize, end: usize) -> Result<Self::Tensor, CallError> {
        let args = vec![value(t), BuiltinArg::Index(dim), BuiltinArg::Index(start), BuiltinArg::Index(end)];
        self.builtin(Builtin::Slice, args)
    }
    /// A view with two dimensions swapped.
    fn transpose(&self, t: &Self::Tensor, d0: usize, d1: usize) -> Result<Self::Tensor, CallError> {
        self.builtin(Builtin::Transpose, vec![value(t), BuiltinArg::Index(d0), BuiltinArg::Index(d1)])
    }
    /// A view with another shape.
    fn reshape(&self, t: &Self::Tensor, shape: &[usize]) -> Result<Self::Tensor, CallError> {
        self.builtin(Builtin::Reshape, vec![value(t), BuiltinArg::Shape(shape.to_vec())])
    }
    /// A copy (source strides if dense, else compact).
    fn clone_tensor(&self, t: &Self::Tensor) -> Result<Self::Tensor, CallError> {
        self.builtin(Builtin::Clone, vec![value(t)])
    }
    /// A compact copy.
    fn contiguous(&self, t: &Self::Tensor) -> Result<Self::Tensor, CallError> {
        self.builtin(Builtin::Contiguous, vec![value(t)])
    }
    /// Elementwise sum.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, CallError> {
        self.builtin(Builtin::Add, vec![value(a), value(b)])
    }
    /// Elementwise product.
    fn mul(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, CallError> {
        self.builtin(Builtin::Mul, vec![value(a), value(b)])
    }
    /// Multiplication by a constant.
    fn scale(&self, t: &Self::Tensor, factor: f64) -> Result<Self::Tensor, CallError> {
        self.builtin(Builtin::Scale, vec![value(t), BuiltinArg::Float(factor)])
    }
    /// `a` and `b` joined along `dim` (a fresh compact tensor).
    fn cat(&self, a: &Self::Tensor, b: &Self::Tensor, dim: usize) -> Result<Self::Tensor, CallError> {
        self.builtin(Builtin::Cat, vec![value(a), value(b), BuiltinArg::Index(dim)])
    }
}

impl<C: ExecutionContext + ?Sized> ExecutionContextExt for C {}

/// A handle copy of `t` as a built-in argument.
fn value<T: Clone>(t: &T) -> BuiltinArg<T> {
    BuiltinArg::Value(t.clone())
}

/// The `N` outputs of a call of `op`, as an array (a contract violation if the count differs).
pub fn outputs<T, const N: usize>(op: &'static OpDef, outputs: Vec<T>) -> Result<[T; N], CallError> {
    let found = outputs.len();
    outputs.try_into().map_err(|_| output_count(op.name, found, N))
}

/// The error of a context call that returned another number of outputs than declared.
pub fn output_count(op: &'static str, found: usize, expected: usize) -> CallError {
    CallError::ContractViolation {
        op,
        provider: "context",
        problem: format!("returned {found} outputs, expected {expected}"),
    }
}

/// Runs models on real tensors, dispatching through a registry.
#[derive(Clone)]
pub struct EagerContext<'r> {
    /// The registry whose installed priorities choose the kernels.
    pub registry: &'r Registry,
    /// The stream (queue) device kernels of this context's calls launch on, if the caller gave one.
    stream: Option<crate::stream::LaunchStream>,
}

impl std::fmt::Debug for EagerContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EagerContext")
            .field("registry", &self.registry)
            .field("stream", &self.stream.is_some())
            .finish()
    }
}

impl<'r> EagerContext<'r> {
    /// A context dispatching through `registry`.
    pub fn new(registry: &'r Registry) -> EagerContext<'r> {
        EagerContext { registry, stream: None }
    }

    /// The same context whose calls launch device kernels on `stream`: the engine's own stream
    /// handle, of the type the kernel crate documents (`Arc<cudarc::driver::CudaStream>` for
    /// `cuda`). Providers that take no stream, or another type, ignore it; see
    /// [`stream::launch_stream`](crate::stream::launch_stream).
    pub fn with_stream<S: std::any::Any + Send + Sync>(mut self, stream: S) -> EagerContext<'r> {
        self.stream = Some(std::sync::Arc::new(stream));
        self
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
        // An eager context's arguments are the dynamic values themselves.
        let call = crate::Call::new(op, overload, args).with_stream(self.stream.clone());
        Ok(self.registry.run(call)?.into_vec())
    }

    /// Runs the table's computation; `copy_` writes into its first argument, which must be uniquely
    /// owned (move the tensor in).
    fn builtin(&self, op: Builtin, mut args: Vec<BuiltinArg<Tensor>>) -> Result<Tensor, CallError> {
        check_args(op, &args).map_err(|reason| CallError::BuiltinArgs { builtin: op.name(), reason })?;
        match op.def().eval {
            Eval::Result(eval) => {
                let tensors: Vec<&Tensor> = args.iter().filter_map(BuiltinArg::value).collect();
                Ok(eval(&tensors, &Scalars(&args))?)
            }
            Eval::Write(write) => {
                let BuiltinArg::Value(mut target) = std::mem::replace(&mut args[0], BuiltinArg::Index(0)) else {
                    unreachable!("check_args: the first argument is a value")
                };
                let sources: Vec<&Tensor> = args.iter().filter_map(BuiltinArg::value).collect();
                write(&mut target, &sources, &Scalars(&args))?;
                Ok(target)
            }
        }
    }
}

#[cfg(test)]
mod builtin_tests {
    use super::*;
    use crate::{DType, bit_eq};

    #[test]
    fn the_eager_context_runs_every_built_in_through_the_table() {
        let registry = Registry::new();
        let ctx = EagerContext::new(&registry);
        let x = Tensor::from_f64(DType::F32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let t = ctx.transpose(&x, 0, 1).unwrap();
        assert_eq!(t.shape(), &[3, 2]);
        let c = ctx.contiguous(&t).unwrap();
        assert_eq!(c.to_f64_vec().unwrap(), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let sum = ctx.add(&x, &ctx.scale(&x, 2.0).unwrap()).unwrap();
        assert_eq!(sum.to_f64_vec().unwrap(), vec![3.0, 6.0, 9.0, 12.0, 15.0, 18.0]);
        assert!(bit_eq(&ctx.mul(&x, &ctx.clone_tensor(&x).unwrap()).unwrap(), &x.mul(&x).unwrap()));
        assert_eq!(ctx.reshape(&x, &[3, 2]).unwrap().shape(), &[3, 2]);
        assert_eq!(ctx.slice(&x, 1, 1, 3).unwrap().to_f64_vec().unwrap(), vec![2.0, 3.0, 5.0, 6.0]);

        // copy_ writes into its moved-in destination and returns it.
        let dst = Tensor::zeros(DType::BF16, &[2, 3]).unwrap();
        let storage = dst.storage_id();
        let copied = ctx.builtin(Builtin::Copy, vec![BuiltinArg::Value(dst), BuiltinArg::Value(x.clone())]).unwrap();
        assert_eq!(copied.storage_id(), storage);
        assert_eq!(copied.to_f64_vec().unwrap(), x.to_f64_vec().unwrap());
        // A shared destination is refused, not written.
        let shared = Tensor::zeros(DType::F32, &[2, 3]).unwrap();
        let err = ctx.builtin(Builtin::Copy, vec![BuiltinArg::Value(shared.clone()), BuiltinArg::Value(x.clone())]);
        assert!(matches!(err, Err(CallError::Tensor(_))), "{err:?}");
        assert_eq!(shared.to_f64_vec().unwrap(), vec![0.0; 6]);

        // Arguments are checked against the table.
        let err = ctx.builtin(Builtin::Slice, vec![BuiltinArg::Value(x.clone()), BuiltinArg::Index(0)]).unwrap_err();
        assert_eq!(err.to_string(), "built-in `slice`: slice(value, index, index, index) takes 4 arguments, found 2");
        let err = ctx.builtin(Builtin::Scale, vec![BuiltinArg::Value(x.clone()), BuiltinArg::Index(2)]).unwrap_err();
        assert!(err.to_string().contains("argument 1 of scale(value, float) has the wrong kind"), "{err}");
        let err = ctx.add(&x, &Tensor::zeros(DType::F32, &[3, 2]).unwrap()).unwrap_err();
        assert!(err.to_string().contains("add: shapes [2, 3] and [3, 2] differ"), "{err}");
    }
}
