//! The gated activations' plumbing: the geometry of x, a call, the kernel table entries and the
//! scalars a gated kernel takes.

use ir_core::{DType, KernelError, Tensor, TensorMeta};

use crate::Rows;

/// What a gated kernel needs of x: its rows (of 2d elements), d, and the compact `[..., d]` layout of
/// the fresh output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatedGeometry {
    /// x as rows of `2d` elements.
    pub rows: Rows,
    /// Elements of each output row.
    pub d: usize,
    /// The output's layout: compact, x's shape with the last dimension halved.
    pub out_layout: ir_core::Layout,
}

impl GatedGeometry {
    /// The geometry of a call on `x`, or why a kernel cannot run it (the predicate and the meta
    /// function reject such arguments first, so this is a defensive check).
    pub fn of(x: &TensorMeta) -> Result<GatedGeometry, KernelError> {
        let rows = Rows::for_kernel(x)?;
        if !rows.hidden.is_multiple_of(2) {
            return Err(KernelError::InvalidArguments { reason: format!("x's last dimension {} is odd", rows.hidden) });
        }
        let d = rows.hidden / 2;
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = d;
        }
        Ok(GatedGeometry { rows, d, out_layout: TensorMeta::compact(x.dtype, &shape).layout })
    }

    /// Whether the call has any element to compute.
    pub fn is_empty(&self) -> bool {
        self.rows.n_rows == 0 || self.d == 0
    }
}

/// What every GPU gated kernel reads from its bound arguments: x (the first argument), the packed
/// scalars and the geometry.
#[derive(Debug)]
pub struct GatedCall<'a> {
    /// The input `[..., 2d]`.
    pub x: &'a Tensor,
    /// The op's scalar parameters, as the kernel takes them.
    pub scalars: GatedScalars,
    /// Rows, d and the output layout.
    pub geometry: GatedGeometry,
}

impl<'a> GatedCall<'a> {
    /// Reads the bound arguments of `def`, an op whose first parameter is x.
    pub fn new(def: &ir_core::op::OpDef, args: &'a [ir_core::op::Value]) -> Result<GatedCall<'a>, KernelError> {
        let x =
            args.first().and_then(ir_core::op::Value::as_tensor).ok_or_else(|| ir_core::op::mismatched(def.name))?;
        Ok(GatedCall { x, scalars: GatedScalars::pack(def, args)?, geometry: GatedGeometry::of(x.meta())? })
    }
}

/// A gated op of a GPU provider and its kernel source (`kernels/<op>.<ext>`); each provider lists
/// its gated ops in one table, so adding an op is its kernel source and one line there.
#[derive(Clone, Copy, Debug)]
pub struct GatedKernel {
    /// The op.
    pub def: &'static ir_core::op::OpDef,
    /// The op's kernel source.
    pub source: &'static str,
}

impl GatedKernel {
    /// The kernel's symbol for `dtype`: `<op>_<dtype>`.
    pub fn kernel_name(&self, dtype: DType) -> String {
        format!("{}_{dtype}", self.def.name)
    }

    /// Registers every kernel of `table` as a functional implementation: `spec` makes each one's
    /// spec (the provider's name, probe and the gated predicate), `run` computes the output from the
    /// bound arguments.
    pub fn register_all(
        table: &'static [GatedKernel],
        registry: &ir_core::Registry,
        spec: impl Fn() -> ir_core::ImplSpec,
        run: fn(&GatedKernel, &[ir_core::op::Value]) -> Result<Tensor, KernelError>,
    ) -> Result<(), ir_core::RegistryError> {
        for kernel in table {
            let func = ir_core::ImplFunc::functional(move |args| Ok(vec![run(kernel, args)?]));
            registry.register_impl(kernel.def.name, spec(), func)?;
        }
        Ok(())
    }
}

/// The scalar arguments of a gated op as a GPU kernel receives them: every float parameter in order
/// in `floats`, every string choice (as its index among the allowed values), integer and boolean in
/// order in `ints`. Kernels take [`GATED_SLOTS`] of each; `none` is rejected.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GatedScalars {
    /// Float parameters, in declaration order, unrounded: a kernel takes each in its compute dtype
    /// ([`ComputeScalar::new`](crate::ComputeScalar::new)).
    pub floats: [f64; GATED_SLOTS],
    /// String-choice, integer and boolean parameters, in declaration order.
    pub ints: [i32; GATED_SLOTS],
}

/// How many float and how many integer scalar slots a gated GPU kernel takes.
pub const GATED_SLOTS: usize = 2;

impl GatedScalars {
    /// Packs `args[1..]` (bound arguments of `def`, an op whose first parameter is x).
    pub fn pack(def: &ir_core::op::OpDef, args: &[ir_core::op::Value]) -> Result<GatedScalars, KernelError> {
        use ir_core::op::{ParamKind, Value};
        let mut packed = GatedScalars::default();
        let (mut floats, mut ints) = (0, 0);
        let too_many = || KernelError::InvalidArguments {
            reason: format!("{} has more than {GATED_SLOTS} float or integer parameters for a gated kernel", def.name),
        };
        for (param, value) in def.params.iter().zip(args).skip(1) {
            let int = match (param.kind, value) {
                (_, Value::F64(v)) => {
                    *packed.floats.get_mut(floats).ok_or_else(too_many)? = *v;
                    floats += 1;
                    continue;
                }
                (ParamKind::Str(allowed), Value::Str(text)) => {
                    allowed.iter().position(|a| a == text).and_then(|i| i32::try_from(i).ok())
                }
                (_, Value::I64(v)) => i32::try_from(*v).ok(),
                (_, Value::Bool(v)) => Some(i32::from(*v)),
                _ => None,
            };
            let int = int.ok_or_else(|| KernelError::InvalidArguments {
                reason: format!("{}: parameter `{}` cannot be passed to a gated kernel", def.name, param.name),
            })?;
            *packed.ints.get_mut(ints).ok_or_else(too_many)? = int;
            ints += 1;
        }
        Ok(packed)
    }
}
