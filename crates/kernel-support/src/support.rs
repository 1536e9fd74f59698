//! The standard kernel predicates: what each family's kernels take (dtype, layout, device,
//! weight), with the capabilities a backend declares (`KernelDTypes`, `NormCapabilities`).

use std::borrow::Cow;

use ir_core::op::ArgMeta;
use ir_core::{DType, DeviceKind, Support, TensorMeta};
use ir_ops::fused_add_rms_norm::FusedAddRmsNormArgs;
use ir_ops::rms_norm::RmsNormArgs;

use crate::Rows;

/// The element dtypes a provider's kernels compute on. Every kernel takes f32, f16 and bf16; f64
/// exists for references, and a GPU provider whose kernels also compute in it keeps an f64
/// reference on its device tensors on the device instead of sending it through host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelDTypes {
    /// f32, f16 and bf16.
    #[default]
    Reduced,
    /// f32, f16, bf16 and f64.
    WithF64,
}

impl KernelDTypes {
    /// `WithF64` when `f64` holds (a device that computes in f64), else `Reduced`.
    pub fn with_f64_if(f64: bool) -> KernelDTypes {
        if f64 { KernelDTypes::WithF64 } else { KernelDTypes::Reduced }
    }

    /// Whether a kernel computes on `dtype` elements.
    pub fn contains(self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || (self == KernelDTypes::WithF64 && dtype == DType::F64)
    }

    /// The dtypes, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            KernelDTypes::Reduced => "f32, f16, bf16",
            KernelDTypes::WithF64 => "f32, f16, bf16, f64",
        }
    }

    /// Why `what` (a tensor parameter's name) of `dtype` is refused, or `Yes`.
    fn support(self, what: &str, dtype: DType) -> Support {
        if self.contains(dtype) {
            Support::Yes
        } else {
            Support::No(Cow::Owned(format!("{what} dtype {dtype} is not one of {}", self.describe())))
        }
    }
}

/// A float scalar argument of a kernel in the kernel's compute dtype: f64 for f64 elements, f32
/// (the value rounded to it) for f32, f16 and bf16, as the reference rounds its scalars to c.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ComputeScalar {
    /// For an f32, f16 or bf16 kernel.
    F32(f32),
    /// For an f64 kernel.
    F64(f64),
}

impl ComputeScalar {
    /// `value` in the compute dtype of `dtype` elements.
    pub fn new(dtype: DType, value: f64) -> ComputeScalar {
        if dtype == DType::F64 { ComputeScalar::F64(value) } else { ComputeScalar::F32(value as f32) }
    }
}

/// What a norm provider computes beyond the common case (an x-dtype weight, the whole row's mean):
/// the predicates accept these arguments only for a provider that says so.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NormCapabilities {
    /// A weight of another compute dtype than x (f32, f16 or bf16, and f64 where `dtypes` has it; a
    /// Gemma-style f32 weight on bf16 activations), applied in the weight's dtype as the spec's
    /// step 5 says.
    pub mixed_weight_dtype: bool,
    /// `variance_size`: the mean square over the first V elements of each row.
    pub variance_size: bool,
    /// The dtypes of x and the weight.
    pub dtypes: KernelDTypes,
    /// `rounding = "dtype"` of `fused_add_rms_norm` and the fused-add norm + quantization ops on
    /// 16-bit tensors: the norm of the sum rounded to x's dtype.
    pub dtype_rounding: bool,
}

impl From<KernelDTypes> for NormCapabilities {
    /// The common case on `dtypes`.
    fn from(dtypes: KernelDTypes) -> NormCapabilities {
        NormCapabilities { dtypes, ..NormCapabilities::DEFAULT }
    }
}

impl NormCapabilities {
    /// The common case (`Default::default()`, usable in constants): no weight of another dtype, no
    /// `variance_size`, f32, f16 and bf16.
    pub const DEFAULT: NormCapabilities = NormCapabilities {
        mixed_weight_dtype: false,
        variance_size: false,
        dtypes: KernelDTypes::Reduced,
        dtype_rounding: false,
    };
    /// Every argument form the reference computes, on f32, f16 and bf16 elements.
    pub const ALL: NormCapabilities = NormCapabilities {
        mixed_weight_dtype: true,
        variance_size: true,
        dtypes: KernelDTypes::Reduced,
        dtype_rounding: true,
    };
}

/// The standard predicate for `rms_norm` on a provider whose tensors live on `device`.
pub fn rms_norm_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    rms_norm_support_with(args, device, NormCapabilities::default())
}

/// [`rms_norm_support`] for a provider with `capabilities` beyond the common case.
pub fn rms_norm_support_with(args: &[ArgMeta<'_>], device: DeviceKind, capabilities: NormCapabilities) -> Support {
    let Some(args) = RmsNormArgs::from_meta(args) else { return no("arguments do not match rms_norm") };
    common_support(args.x, args.weight, args.variance_size, device, capabilities)
}

/// The standard predicate for `fused_add_rms_norm` on a provider whose tensors live on `device`.
pub fn fused_add_rms_norm_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    fused_add_rms_norm_support_with(args, device, NormCapabilities::default())
}

/// [`fused_add_rms_norm_support`] for a provider with `capabilities` beyond the common case.
pub fn fused_add_rms_norm_support_with(
    args: &[ArgMeta<'_>],
    device: DeviceKind,
    capabilities: NormCapabilities,
) -> Support {
    let Some(args) = FusedAddRmsNormArgs::from_meta(args) else {
        return no("arguments do not match fused_add_rms_norm");
    };
    if let Support::No(reason) = common_support(args.x, args.weight, args.variance_size, device, capabilities) {
        return Support::No(reason);
    }
    if args.rounding.rounds_intermediates(args.x.dtype) && !capabilities.dtype_rounding {
        return no("rounding \"dtype\" (the norm of the sum rounded to x's dtype) is not implemented here");
    }
    residual_support(args.x, args.x_residual)
}

/// The fused add + norm + quantization predicates: the norm's without `variance_size`, the
/// rounding's, then the residual's.
fn fused_quant_support(
    x: &TensorMeta,
    x_residual: &TensorMeta,
    weight: Option<&TensorMeta>,
    rounding: ir_ops::Rounding,
    device: DeviceKind,
    capabilities: NormCapabilities,
) -> Support {
    if let Support::No(reason) = common_support(x, weight, None, device, capabilities) {
        return Support::No(reason);
    }
    if rounding.rounds_intermediates(x.dtype) && !capabilities.dtype_rounding {
        return no("rounding \"dtype\" (the norm of the sum rounded to x's dtype) is not implemented here");
    }
    residual_support(x, x_residual)
}

/// The residual's part of the fused predicates: x's dtype, shape and device, rows of one stride.
fn residual_support(x: &TensorMeta, r: &TensorMeta) -> Support {
    if r.dtype != x.dtype {
        return Support::No(Cow::Owned(format!("x_residual dtype {} differs from x dtype {}", r.dtype, x.dtype)));
    }
    if r.device != x.device || r.shape() != x.shape() {
        return no("x_residual must have x's shape and device");
    }
    match Rows::of(r) {
        Ok(_) => Support::Yes,
        Err(reason) => Support::No(Cow::Owned(format!("x_residual: {reason}"))),
    }
}

/// The standard predicate of `rms_norm_static_fp8_quant`: the norm's ([`rms_norm_support`]) without
/// `variance_size`; the scale and output dtype are validated by the meta function.
pub fn rms_norm_static_fp8_quant_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    rms_norm_static_fp8_quant_support_with(args, device, NormCapabilities::DEFAULT)
}

/// [`rms_norm_static_fp8_quant_support`] for a provider whose norm takes `capabilities` (its dtypes, and a
/// weight of another dtype than x; `variance_size` is no parameter of the op), or computes on the
/// element dtypes a [`KernelDTypes`] names (the common case otherwise).
pub fn rms_norm_static_fp8_quant_support_with(
    args: &[ArgMeta<'_>],
    device: DeviceKind,
    capabilities: impl Into<NormCapabilities>,
) -> Support {
    let capabilities = capabilities.into();
    let Some(args) = ir_ops::rms_norm_static_fp8_quant::RmsNormStaticFp8QuantArgs::from_meta(args) else {
        return no("arguments do not match rms_norm_static_fp8_quant");
    };
    common_support(args.x, args.weight, None, device, capabilities)
}

/// The standard predicate of `rms_norm_dynamic_per_token_quant` (as the static form's).
pub fn rms_norm_dynamic_per_token_quant_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    rms_norm_dynamic_per_token_quant_support_with(args, device, NormCapabilities::DEFAULT)
}

/// [`rms_norm_dynamic_per_token_quant_support`] for a provider whose norm takes `capabilities` (its dtypes, and a
/// weight of another dtype than x; `variance_size` is no parameter of the op), or computes on the
/// element dtypes a [`KernelDTypes`] names (the common case otherwise).
pub fn rms_norm_dynamic_per_token_quant_support_with(
    args: &[ArgMeta<'_>],
    device: DeviceKind,
    capabilities: impl Into<NormCapabilities>,
) -> Support {
    let capabilities = capabilities.into();
    let Some(args) = ir_ops::rms_norm_dynamic_per_token_quant::RmsNormDynamicPerTokenQuantArgs::from_meta(args) else {
        return no("arguments do not match rms_norm_dynamic_per_token_quant");
    };
    common_support(args.x, args.weight, None, device, capabilities)
}

/// The standard predicate of `fused_add_rms_norm_static_fp8_quant`: the fused norm's
/// ([`fused_add_rms_norm_support`]) without `variance_size`.
pub fn fused_add_rms_norm_static_fp8_quant_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    fused_add_rms_norm_static_fp8_quant_support_with(args, device, NormCapabilities::DEFAULT)
}

/// [`fused_add_rms_norm_static_fp8_quant_support`] for a provider whose norm takes `capabilities` (its dtypes, and a
/// weight of another dtype than x; `variance_size` is no parameter of the op), or computes on the
/// element dtypes a [`KernelDTypes`] names (the common case otherwise).
pub fn fused_add_rms_norm_static_fp8_quant_support_with(
    args: &[ArgMeta<'_>],
    device: DeviceKind,
    capabilities: impl Into<NormCapabilities>,
) -> Support {
    let capabilities = capabilities.into();
    let Some(args) = ir_ops::fused_add_rms_norm_static_fp8_quant::FusedAddRmsNormStaticFp8QuantArgs::from_meta(args)
    else {
        return no("arguments do not match fused_add_rms_norm_static_fp8_quant");
    };
    fused_quant_support(args.x, args.x_residual, args.weight, args.rounding, device, capabilities)
}

/// The standard predicate of `fused_add_rms_norm_dynamic_per_token_quant` (as the static form's).
pub fn fused_add_rms_norm_dynamic_per_token_quant_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    fused_add_rms_norm_dynamic_per_token_quant_support_with(args, device, NormCapabilities::DEFAULT)
}

/// [`fused_add_rms_norm_dynamic_per_token_quant_support`] for a provider whose norm takes `capabilities` (its dtypes, and a
/// weight of another dtype than x; `variance_size` is no parameter of the op), or computes on the
/// element dtypes a [`KernelDTypes`] names (the common case otherwise).
pub fn fused_add_rms_norm_dynamic_per_token_quant_support_with(
    args: &[ArgMeta<'_>],
    device: DeviceKind,
    capabilities: impl Into<NormCapabilities>,
) -> Support {
    let capabilities = capabilities.into();
    use ir_ops::fused_add_rms_norm_dynamic_per_token_quant::FusedAddRmsNormDynamicPerTokenQuantArgs as Args;
    let Some(args) = Args::from_meta(args) else {
        return no("arguments do not match fused_add_rms_norm_dynamic_per_token_quant");
    };
    fused_quant_support(args.x, args.x_residual, args.weight, args.rounding, device, capabilities)
}

fn common_support(
    x: &TensorMeta,
    weight: Option<&TensorMeta>,
    variance_size: Option<i64>,
    device: DeviceKind,
    capabilities: NormCapabilities,
) -> Support {
    if let Support::No(reason) = capabilities.dtypes.support("x", x.dtype) {
        return Support::No(reason);
    }
    if x.device.kind() != device {
        return Support::No(Cow::Owned(format!("x is on {}, this provider runs on {device}", x.device)));
    }
    if variance_size.is_some() && !capabilities.variance_size {
        return no("variance_size is not supported by this provider");
    }
    if let Some(w) = weight {
        if let Support::No(reason) = capabilities.dtypes.support("weight", w.dtype) {
            return Support::No(reason);
        }
        if w.dtype != x.dtype && !capabilities.mixed_weight_dtype {
            return Support::No(Cow::Owned(format!("weight dtype {} differs from x dtype {}", w.dtype, x.dtype)));
        }
        let unit_stride = w.layout.strides().first().is_none_or(|&s| s == 1 || w.layout.last_dim() <= 1);
        if w.shape() != [x.layout.last_dim()] || !unit_stride || w.device != x.device {
            return no("weight must be a unit-stride [H] tensor on x's device");
        }
    }
    rows_support(x, device, "hidden size")
}

/// The part both standard predicates end with: on a GPU, x's last dimension (`what` names it)
/// fits the kernels' 32-bit integers, and x is rows of one stride with a unit last stride.
fn rows_support(x: &TensorMeta, device: DeviceKind, what: &str) -> Support {
    if device != DeviceKind::Cpu && i32::try_from(x.layout.last_dim()).is_err() {
        return Support::No(Cow::Owned(format!(
            "{what} {} exceeds the GPU kernels' 32-bit limit",
            x.layout.last_dim()
        )));
    }
    match Rows::of(x) {
        Ok(_) => Support::Yes,
        Err(reason) => Support::No(reason),
    }
}

/// The standard predicate of the gated activations (`silu_and_mul`, `gelu_and_mul`, …), whose first
/// parameter is `x: [..., 2d]`: x's dtype is f32, f16 or bf16, x is on `device`, and x is rows of one
/// stride with a unit last stride. Other parameters are validated by the op's meta function.
pub fn gated_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    gated_support_with(args, device, KernelDTypes::Reduced)
}

/// [`gated_support`] for a provider computing on `dtypes`.
pub fn gated_support_with(args: &[ArgMeta<'_>], device: DeviceKind, dtypes: KernelDTypes) -> Support {
    let Some(x) = args.first().and_then(ArgMeta::tensor) else { return no("the first argument must be a tensor") };
    if let Support::No(reason) = dtypes.support("x", x.dtype) {
        return Support::No(reason);
    }
    if x.device.kind() != device {
        return Support::No(Cow::Owned(format!("x is on {}, this provider runs on {device}", x.device)));
    }
    rows_support(x, device, "last dimension")
}

/// The standard predicate of the quantization ops (`static_scaled_fp8_quant`,
/// `dynamic_per_token_scaled_fp8_quant`), whose first parameter is `x: [..., H]`: x's dtype is f32,
/// f16 or bf16, x is on `device`, and x is rows of one stride with a unit last stride. The scales'
/// dtype, size and device and the output dtype are validated by the op's meta function.
pub fn quant_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    quant_support_with(args, device, KernelDTypes::Reduced)
}

/// [`quant_support`] for a provider computing on `dtypes`.
pub fn quant_support_with(args: &[ArgMeta<'_>], device: DeviceKind, dtypes: KernelDTypes) -> Support {
    let Some(x) = args.first().and_then(ArgMeta::tensor) else { return no("the first argument must be a tensor") };
    if let Support::No(reason) = dtypes.support("x", x.dtype) {
        return Support::No(reason);
    }
    if x.device.kind() != device {
        return Support::No(Cow::Owned(format!("x is on {}, this provider runs on {device}", x.device)));
    }
    rows_support(x, device, "hidden size")
}

/// The standard predicate of `rotary_embedding` on a provider whose tensors live on `device`: query
/// in f32, f16 or bf16 on `device`; query, key and the cache rows of one stride with a unit last
/// stride; positions compact (any offset). The meta function validates the rest.
pub fn rotary_support(args: &[ArgMeta<'_>], device: DeviceKind) -> Support {
    rotary_support_with(args, device, KernelDTypes::Reduced)
}

/// [`rotary_support`] for a provider computing on `dtypes`.
pub fn rotary_support_with(args: &[ArgMeta<'_>], device: DeviceKind, dtypes: KernelDTypes) -> Support {
    let Some(args) = ir_ops::rotary_embedding::RotaryEmbeddingArgs::from_meta(args) else {
        return no("arguments do not match rotary_embedding");
    };
    rotation_support(&args, device, dtypes)
}

/// The predicate of `fused_qk_norm_rope` on `device` for a provider computing on `dtypes`: the
/// rotation's rules ([`rotary_support_with`]: query and key rows of one stride, column slices of a
/// qkv buffer included), and both weights on the device in one of `dtypes`. With `heads_as_rows`
/// (an executor of row programs, which walks the heads as its rows), the heads of query and of key
/// (each viewed `[tokens, heads, head_size]`) must be rows of one stride or blocks of them
/// ([`RowBlocks::of_any`](crate::RowBlocks::of_any): the heads of a column slice of qkv are).
pub fn qk_norm_rope_support_with(
    args: &[ArgMeta<'_>],
    device: DeviceKind,
    dtypes: KernelDTypes,
    heads_as_rows: bool,
) -> Support {
    use ir_ops::fused_qk_norm_rope::FusedQkNormRopeArgs;
    let Some(args) = FusedQkNormRopeArgs::from_meta(args) else {
        return no("arguments do not match fused_qk_norm_rope");
    };
    let rotation = args.rotation();
    if let Support::No(reason) = rotation_support(&rotation, device, dtypes) {
        return Support::No(reason);
    }
    for (what, weight) in [("q_weight", Some(args.q_weight)), ("k_weight", args.k_weight)] {
        let Some(weight) = weight else { continue };
        if let Support::No(reason) = dtypes.support(what, weight.dtype) {
            return Support::No(reason);
        }
        if weight.device.kind() != device {
            return Support::No(Cow::Owned(format!("{what} is on {}, this provider runs on {device}", weight.device)));
        }
    }
    if heads_as_rows {
        let head_size = usize::try_from(args.head_size).unwrap_or(1).max(1);
        for (what, t) in [("query", Some(args.query)), ("key", args.key)] {
            let Some(t) = t else { continue };
            let width = t.layout.last_dim();
            let tokens = t.layout.numel() / width.max(1);
            let heads = t
                .layout
                .reshape(&[tokens, width / head_size, head_size])
                .ok()
                .map(|layout| crate::RowBlocks::of_any(&ir_core::TensorMeta { layout, ..t.clone() }).is_ok());
            if heads != Some(true) {
                return Support::No(Cow::Owned(format!(
                    "{what}'s heads are neither rows of one stride nor blocks of them, which a generated kernel walks"
                )));
            }
        }
    }
    Support::Yes
}

/// [`rotary_support_with`]'s rules for a rotation's arguments.
fn rotation_support(
    args: &ir_ops::rotary_embedding::RotaryEmbeddingArgs<'_>,
    device: DeviceKind,
    dtypes: KernelDTypes,
) -> Support {
    let query = args.query;
    if let Support::No(reason) = dtypes.support("query", query.dtype) {
        return Support::No(reason);
    }
    if query.device.kind() != device {
        return Support::No(Cow::Owned(format!("query is on {}, this provider runs on {device}", query.device)));
    }
    if !args.positions.layout.is_compact() {
        return no("positions must be compact");
    }
    for (what, t) in [("query width", Some(query)), ("key width", args.key), ("rotary_dim", Some(args.cos_sin_cache))] {
        if let Some(t) = t
            && let Support::No(reason) = rows_support(t, device, what)
        {
            return Support::No(reason);
        }
    }
    Support::Yes
}

pub(crate) fn no(reason: &'static str) -> Support {
    Support::No(Cow::Borrowed(reason))
}
