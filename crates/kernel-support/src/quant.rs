//! The quantization families' plumbing: the ops and kernels a GPU provider implements, the fp8
//! format codes, the norm + quantization call and its registration, the scales' host helpers.

use ir_core::op::ArgMeta;
use ir_core::{DType, DeviceKind, KernelError, Support, Tensor, UniqueTensor};

use crate::{
    KernelDTypes, NormCapabilities, fused_add_rms_norm_dynamic_per_token_quant_support_with,
    fused_add_rms_norm_static_fp8_quant_support_with, rms_norm_dynamic_per_token_quant_support_with,
    rms_norm_static_fp8_quant_support_with,
};
use ir_ops::quant::per_token_scales_shape;

/// The six quantization ops a GPU provider implements with the quantization kernels.
pub const QUANT_OPS: [&str; 6] = [
    ir_ops::static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT.name,
    ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT.name,
    ir_ops::rms_norm_static_fp8_quant::RMS_NORM_STATIC_FP8_QUANT.name,
    ir_ops::rms_norm_dynamic_per_token_quant::RMS_NORM_DYNAMIC_PER_TOKEN_QUANT.name,
    ir_ops::fused_add_rms_norm_static_fp8_quant::FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT.name,
    ir_ops::fused_add_rms_norm_dynamic_per_token_quant::FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT.name,
];

/// The GPU quantization kernels, each `<kernel>_<dtype>`: the two quantizations, and `norm_quant`,
/// which serves the four norm + quantization ops.
pub const QUANT_KERNELS: [&str; 3] = [QUANT_OPS[0], QUANT_OPS[1], "norm_quant"];

/// The norm + quantization kernels for a weight of another dtype than x, by the weight's dtype:
/// `norm_quant_w<weight>`, each `<kernel>_<dtype>` (and `_vec`) as the others, in the same programs.
pub const NORM_QUANT_MIXED_KERNELS: [(DType, &str); 4] = [
    (DType::F32, "norm_quant_wf32"),
    (DType::F16, "norm_quant_wf16"),
    (DType::BF16, "norm_quant_wbf16"),
    (DType::F64, "norm_quant_wf64"),
];

/// The norm + quantization kernel for x of `dtype` and a weight of `weight`: `norm_quant`
/// ([`QUANT_KERNELS`]' last) for none or one of x's dtype, else the [`NORM_QUANT_MIXED_KERNELS`]
/// entry of the weight's dtype (`None` for a dtype no kernel takes).
pub fn norm_quant_kernel(dtype: DType, weight: Option<DType>) -> Option<&'static str> {
    match weight {
        Some(w) if w != dtype => NORM_QUANT_MIXED_KERNELS.iter().find(|(d, _)| *d == w).map(|(_, name)| *name),
        _ => Some(QUANT_KERNELS[2]),
    }
}

/// The quantization kernels' `format` argument: 0 for f8e4m3fn, 1 for f8e5m2.
pub fn fp8_format_code(dtype: DType) -> Result<i32, KernelError> {
    match dtype {
        DType::F8E4M3FN => Ok(0),
        DType::F8E5M2 => Ok(1),
        other => Err(KernelError::NotFp8 { dtype: other }),
    }
}

/// One call of a GPU provider's norm + quantization kernel, which serves all four norm +
/// quantization ops (`rms_norm_static_fp8_quant`, `rms_norm_dynamic_per_token_quant`,
/// `fused_add_rms_norm_static_fp8_quant`, `fused_add_rms_norm_dynamic_per_token_quant`).
#[derive(Debug)]
pub struct NormQuantCall<'a> {
    /// The input rows.
    pub x: &'a Tensor,
    /// The residual of the fused-add form.
    pub residual: Option<NormQuantResidual<'a>>,
    /// The weight.
    pub weight: Option<&'a Tensor>,
    /// Epsilon.
    pub epsilon: f64,
    /// The static scale, or the dynamic form's optional bound on the absmax.
    pub scale: Option<&'a Tensor>,
    /// Whether scales are computed per token.
    pub dynamic: bool,
    /// The fp8 output dtype.
    pub out_dtype: DType,
    /// The op's `rounding`: the norm of the rounded sum (fused-add forms, 16-bit x) and a static
    /// scale's reciprocal under `"dtype"`.
    pub rounding: ir_ops::Rounding,
}

/// The residual of a fused-add norm + quantization call.
#[derive(Debug)]
pub enum NormQuantResidual<'a> {
    /// Read; the sum goes to a fresh compact tensor ([`NormQuantOutputs::residual_out`]).
    Read(&'a Tensor),
    /// Read and overwritten with the sum, in its own layout (the in-place kernel's activation).
    InPlace(&'a mut UniqueTensor),
}

impl NormQuantResidual<'_> {
    /// The residual tensor.
    pub fn tensor(&self) -> &Tensor {
        match self {
            NormQuantResidual::Read(t) => t,
            NormQuantResidual::InPlace(t) => t.tensor(),
        }
    }
}

/// What a norm + quantization kernel returns: `q`, the per-token scales of the dynamic form, and
/// the fresh residual output of a fused-add call that read its residual.
#[derive(Debug)]
pub struct NormQuantOutputs {
    /// The quantized rows.
    pub q: Tensor,
    /// One f32 scale per row (dynamic form).
    pub scales: Option<Tensor>,
    /// `x + x_residual` rounded to x's dtype ([`NormQuantResidual::Read`] calls).
    pub residual_out: Option<Tensor>,
}

/// Registers the four norm + quantization ops of a provider whose tensors live on `device`, all
/// served by `run`: `spec` makes each one's spec (the provider's name and probe), to which the op's
/// standard predicate is added for the element dtypes `dtypes` says (asked at each selection, so a
/// provider may answer from the device it finds at run time). The fused-add forms are registered in
/// place on the residual.
pub fn register_norm_quant_ops(
    registry: &ir_core::Registry,
    device: DeviceKind,
    dtypes: fn() -> KernelDTypes,
    spec: impl Fn() -> ir_core::ImplSpec,
    run: fn(NormQuantCall<'_>) -> Result<NormQuantOutputs, KernelError>,
) -> Result<(), ir_core::RegistryError> {
    use ir_ops::{
        fused_add_rms_norm_dynamic_per_token_quant, fused_add_rms_norm_static_fp8_quant,
        rms_norm_dynamic_per_token_quant, rms_norm_static_fp8_quant,
    };
    // A weight of another dtype than x (Gemma's f32 weight on bf16 rows) has its own kernels.
    let capabilities = move || NormCapabilities {
        dtypes: dtypes(),
        dtype_rounding: true,
        mixed_weight_dtype: true,
        ..NormCapabilities::DEFAULT
    };
    let with = |supports: fn(&[ArgMeta<'_>], DeviceKind, NormCapabilities) -> Support| {
        spec().with_supports(move |args| supports(args, device, capabilities()))
    };
    rms_norm_static_fp8_quant::register(
        registry,
        with(rms_norm_static_fp8_quant_support_with),
        move |x, weight, epsilon, scale, out_dtype, rounding| {
            let call = NormQuantCall {
                x,
                residual: None,
                weight,
                epsilon,
                scale: Some(scale),
                dynamic: false,
                out_dtype,
                rounding,
            };
            Ok(run(call)?.q)
        },
    )?;
    rms_norm_dynamic_per_token_quant::register(
        registry,
        with(rms_norm_dynamic_per_token_quant_support_with),
        move |x, weight, epsilon, scale_ub, out_dtype, rounding| {
            let call = NormQuantCall {
                x,
                residual: None,
                weight,
                epsilon,
                scale: scale_ub,
                dynamic: true,
                out_dtype,
                rounding,
            };
            let done = run(call)?;
            let scales = done.scales.ok_or_else(|| missing_output("scales"))?;
            Ok((done.q, scales))
        },
    )?;
    let fused = fused_add_rms_norm_static_fp8_quant::Impl::inplace(
        move |x, mut x_residual, weight, epsilon, scale, out_dtype, rounding| {
            let call = NormQuantCall {
                x,
                residual: Some(NormQuantResidual::InPlace(&mut x_residual)),
                weight,
                epsilon,
                scale: Some(scale),
                dynamic: false,
                out_dtype,
                rounding,
            };
            let done = run(call)?;
            Ok((x_residual.into_tensor(), done.q))
        },
    );
    fused_add_rms_norm_static_fp8_quant::register(
        registry,
        with(fused_add_rms_norm_static_fp8_quant_support_with),
        fused,
    )?;
    let fused_dynamic = fused_add_rms_norm_dynamic_per_token_quant::Impl::inplace(
        move |x, mut x_residual, weight, epsilon, scale_ub, out_dtype, rounding| {
            let call = NormQuantCall {
                x,
                residual: Some(NormQuantResidual::InPlace(&mut x_residual)),
                weight,
                epsilon,
                scale: scale_ub,
                dynamic: true,
                out_dtype,
                rounding,
            };
            let done = run(call)?;
            let scales = done.scales.ok_or_else(|| missing_output("scales"))?;
            Ok((x_residual.into_tensor(), done.q, scales))
        },
    );
    fused_add_rms_norm_dynamic_per_token_quant::register(
        registry,
        with(fused_add_rms_norm_dynamic_per_token_quant_support_with),
        fused_dynamic,
    )
}

fn missing_output(name: &str) -> KernelError {
    KernelError::InvalidArguments { reason: format!("the norm + quantization kernel returned no `{name}`") }
}

/// The per-token scales of rows without elements: every scale is the floor `1 / (M · 512)`, as
/// the reference computes it, on x's device (kernels launch nothing for such rows).
pub fn floor_scales(x: &Tensor, out_dtype: DType) -> Result<Tensor, ir_core::TensorError> {
    let shape = per_token_scales_shape(x.shape());
    let rows: usize = shape.iter().product();
    let floor = f64::from(ir_ops::quant::min_scale(out_dtype));
    let host = Tensor::from_f64(DType::F32, &shape, &vec![floor; rows])?;
    if x.device().is_cpu() { Ok(host) } else { host.to_device_of(x) }
}

/// The f32 value of a one-element scale tensor in host memory (a kernel on the cpu, or a GPU
/// kernel reading a scale the caller kept on the host is not supported: the meta function puts
/// scales on x's device).
pub fn host_scale(scale: &Tensor, param: &str) -> Result<f32, KernelError> {
    let buffer =
        scale.cpu_buffer().ok_or_else(|| KernelError::WrongMemory { param: param.to_owned(), memory: "host" })?;
    buffer.typed::<f32>().get(scale.offset()).copied().ok_or_else(|| KernelError::InvalidArguments {
        reason: format!("`{param}` holds no f32 element at offset {}", scale.offset()),
    })
}
