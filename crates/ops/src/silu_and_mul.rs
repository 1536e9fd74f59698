//! `silu_and_mul(x) -> out`: `x` is `[..., 2d]`, `out = silu(x[..., :d]) * x[..., d:]` is `[..., d]`
//! (the gated MLP of every Llama-style model).
//!
//! Per element, with `d` the dtype of x: `a_j = round_d(silu(g_j))` (silu in f64), then
//! `out_j = round_d(a_j · u_j)`; see [`gated`](crate::gated) for why these are the rounding
//! points. Not in place (the output is half the input); activations `[x]`.

use crate::gated::{gated_inputs, gated_meta_only_x, native_gated, silu};
use ir_core::op::{Activation, ArgMeta, InputSpec, MetaError, Value};
use ir_core::{KernelError, Tensor, TensorError};

ir_core::define_op! {
    /// The definition of `silu_and_mul`.
    op silu_and_mul {
        def: SILU_AND_MUL,
        args: SiluAndMulArgs,
        params: (
            /// `[..., 2d]`: the gate, then the up projection.
            x: Activation,
        ),
        outputs: Tensor,
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "silu of the first half of the last dimension times the second half",
    }
}

/// The reference implementation (the semantics).
pub fn native(x: &Tensor) -> Result<Tensor, KernelError> {
    native_gated(SILU_AND_MUL.name, x, |gate, dtype| gate.iter_mut().for_each(|g| *g = dtype.round(silu(*g))))
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    gated_meta_only_x(def.name, args)
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    gated_inputs(spec, [])
}
