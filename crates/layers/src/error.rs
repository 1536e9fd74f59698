//! `LayerError`, what building or running any layer of this crate can fail with, and
//! `RopeScalingError`, what reading or checking a rotary scaling can.

use ir_core::{CallError, TensorError};

/// Errors of building or running a layer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LayerError {
    /// `var_hidden_size` outside `1..=hidden_size`.
    #[error("var_hidden_size {var_hidden_size} must lie in 1..={hidden_size}")]
    VarHiddenSize {
        /// The layer's hidden size.
        hidden_size: usize,
        /// The requested variance size.
        var_hidden_size: usize,
    },
    /// A hidden size of 0.
    #[error("hidden_size must be at least 1")]
    ZeroHiddenSize,
    /// A weight of the wrong shape.
    #[error(
        "weight of shape {found:?} does not fit RmsNorm with hidden size {hidden_size} (expected shape [{hidden_size}])"
    )]
    WeightShape {
        /// The layer's hidden size.
        hidden_size: usize,
        /// The weight's shape.
        found: Vec<usize>,
    },
    /// `load_weight` on a layer built without a weight.
    #[error("this RmsNorm was built without a weight")]
    NoWeight,
    /// An input whose last dimension is not the hidden size.
    #[error("input `{param}` of shape {shape:?} does not fit RmsNorm with hidden size {hidden_size}")]
    InputShape {
        /// `x` or `residual`.
        param: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// The layer's hidden size.
        hidden_size: usize,
    },
    /// `x` and `residual` of different shapes.
    #[error("x of shape {x:?} and residual of shape {residual:?} differ")]
    ResidualShape {
        /// x's shape.
        x: Vec<usize>,
        /// The residual's shape.
        residual: Vec<usize>,
    },
    /// An activation sparsity outside (0, 1).
    #[error("activation_sparsity {activation_sparsity} must lie strictly between 0 and 1")]
    Sparsity {
        /// The value given.
        activation_sparsity: f64,
    },
    /// An input of a gated activation layer without an even last dimension.
    #[error("{layer} needs an input with an even last dimension, got shape {shape:?}")]
    GatedInput {
        /// The layer.
        layer: &'static str,
        /// The input's shape.
        shape: Vec<usize>,
    },
    /// A quantization scale that is not an f32 tensor of one element, or an output dtype that is not
    /// fp8.
    #[error("QuantFp8 `{name}`: {reason}")]
    Quant {
        /// The layer's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A rotary embedding with an impossible geometry (`rotary_dim` odd or above `head_size`, no
    /// positions, a bad base or dtype).
    #[error("RotaryEmbedding `{name}`: {reason}")]
    Rotary {
        /// The layer's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A rotary frequency scaling with a value out of its range (a caller error).
    #[error(transparent)]
    RopeScaling(#[from] RopeScalingError),
    /// `gate_proj` and `up_proj` weights that do not stack into one projection.
    #[error("gate_proj {gate:?} and up_proj {up:?} weights must both be [d, hidden] of one shape")]
    GateUpShapes {
        /// The gate weight's shape.
        gate: Vec<usize>,
        /// The up weight's shape.
        up: Vec<usize>,
    },
    /// A toy decoder that cannot be built or run.
    #[error("ToyDecoder: {reason}")]
    ToyDecoder {
        /// What is wrong.
        reason: String,
    },
    /// The op call failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// Moving the weight failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// A `rope_scaling` that cannot be used.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RopeScalingError {
    /// An unknown `rope_type`.
    #[error("rope_scaling type `{0}` is not one of linear, dynamic, llama3, yarn (or default)")]
    UnknownType(String),
    /// A field the type needs.
    #[error("rope_scaling `{kind}` needs `{field}`")]
    Missing {
        /// The type.
        kind: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A value out of its range.
    #[error("rope_scaling `{field}` = {value}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
        /// Why.
        reason: &'static str,
    },
}
