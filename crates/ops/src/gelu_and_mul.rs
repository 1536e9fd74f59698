//! `gelu_and_mul(x, approximate = "none") -> out`: `x` is `[..., 2d]`,
//! `out = gelu(x[..., :d], approximate) * x[..., d:]` is `[..., d]`.
//!
//! `approximate` is `"none"` (the erf form, `0.5·v·(1 + erf(v/√2))`) or `"tanh"`
//! (`0.5·v·(1 + tanh(√(2/π)·(v + 0.044715·v³)))`). Per element, with `d` the dtype of x:
//! `a_j = round_d(gelu(g_j))` (gelu in f64), then `out_j = round_d(a_j · u_j)`. Not in place;
//! activations `[x]`.

use crate::gated::{gated_inputs, gated_meta_only_x, gelu_erf, gelu_tanh, native_gated};
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, StrEnum, Value};
use ir_core::{KernelError, Tensor, TensorError};

ir_core::str_enum! {
    /// Which formula `gelu` uses.
    pub enum Approximate {
        /// The exact erf form.
        None = "none",
        /// The tanh approximation.
        Tanh = "tanh",
    }
}

impl Approximate {
    /// `gelu(v)` in f64 with this formula.
    pub fn gelu(self, v: f64) -> f64 {
        match self {
            Approximate::None => gelu_erf(v),
            Approximate::Tanh => gelu_tanh(v),
        }
    }

    /// The formula an input generator uses for `seed`: both are covered by the kernel harness.
    pub(crate) fn for_seed(seed: u64) -> Approximate {
        if seed.is_multiple_of(2) { Approximate::None } else { Approximate::Tanh }
    }
}

ir_core::define_op! {
    /// The definition of `gelu_and_mul`.
    op gelu_and_mul {
        def: GELU_AND_MUL,
        args: GeluAndMulArgs,
        params: (
            /// `[..., 2d]`: the gate, then the up projection.
            x: Activation,
            /// The gelu formula.
            approximate: Approximate = Literal::Str("none"),
        ),
        outputs: Tensor,
        inplace: false,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "gelu (erf or tanh form) of the first half of the last dimension times the second half",
    }
}

/// The reference implementation (the semantics).
pub fn native(x: &Tensor, approximate: Approximate) -> Result<Tensor, KernelError> {
    native_gated(GELU_AND_MUL.name, x, |gate, dtype| {
        gate.iter_mut().for_each(|g| *g = dtype.round(approximate.gelu(*g)));
    })
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    gated_meta_only_x(def.name, args)
}

fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    gated_inputs(spec, [Value::Str(Approximate::for_seed(spec.seed).as_str().to_owned())])
}
