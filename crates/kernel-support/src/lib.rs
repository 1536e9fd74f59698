//! `kernel-support`: what the kernel crates of vllm-ir-rs (`cpu`, `cuda`, `rocm`, `xpu`) share,
//! kept apart from the engine-facing API of `ir-core` and the op declarations of `ir-ops`: the
//! standard kernel predicates (for the norms, the gated activations, the quantizations and rotary),
//! the row geometry kernels derive from the same metadata, the families' launch plumbing (the gated
//! family's scalar packing and table entries, the norm + quantization and rotary registration
//! helpers, the strided-copy pieces and kernel tables) and access to a device provider's own
//! buffers behind a tensor. With feature `emu`, module `emu` executes the CUDA/HIP kernel source
//! on the CPU (for tests).
//!
//! Nothing here depends on the number of rows, so a provider's answer is the same for 1 or 65536
//! tokens. An engine never needs this crate; a kernel crate needs it, `ir-core` and `ir-ops`.

#[cfg(feature = "emu")]
pub mod emu;
pub mod gpu;
pub mod testing;

use std::borrow::Cow;

use ir_core::op::ArgMeta;
use ir_core::storage::Storage;
use ir_core::{DType, DeviceKind, KernelError, OperandMismatch, Support, Tensor, TensorMeta, UniqueTensor};
use ir_ops::fused_add_rms_norm::FusedAddRmsNormArgs;
use ir_ops::rms_norm::RmsNormArgs;

/// Which of the two norm kernels a GPU variant is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormOp {
    /// `rms_norm`, writing a fresh output.
    RmsNorm,
    /// `fused_add_rms_norm`, in place.
    FusedAddRmsNorm,
}

impl NormOp {
    /// The op's name, the first part of every kernel symbol (`<op>_<dtype>`).
    pub fn name(self) -> &'static str {
        match self {
            NormOp::RmsNorm => "rms_norm",
            NormOp::FusedAddRmsNorm => "fused_add_rms_norm",
        }
    }
}

/// A tensor seen as `n_rows` rows of `hidden` contiguous elements, one row stride apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    /// Number of rows (product of the leading dimensions).
    pub n_rows: usize,
    /// Elements per row (the last dimension).
    pub hidden: usize,
    /// Elements between the starts of consecutive rows (at least `hidden`).
    pub row_stride: usize,
    /// Storage offset of the first element, in elements.
    pub offset: usize,
}

impl Rows {
    /// The row view of `meta`, or why there is none.
    pub fn of(meta: &TensorMeta) -> Result<Rows, Cow<'static, str>> {
        let layout = &meta.layout;
        let hidden = layout.last_dim();
        let last_stride = layout.strides().last().copied().unwrap_or(1);
        if hidden > 1 && last_stride != 1 {
            return Err(Cow::Owned(format!("last dimension has stride {last_stride}, kernels need 1")));
        }
        let Some((n_rows, row_stride)) = layout.as_rows() else {
            return Err(Cow::Owned(format!(
                "layout {} is not rows of one stride (strides {:?})",
                layout,
                layout.strides()
            )));
        };
        let row_stride = if n_rows <= 1 { hidden } else { row_stride };
        if row_stride < hidden {
            return Err(Cow::Owned(format!("row stride {row_stride} is smaller than the hidden size {hidden}")));
        }
        Ok(Rows { n_rows, hidden, row_stride, offset: layout.offset() })
    }

    /// The row view a kernel needs, as a kernel error when there is none (the predicate rejects such
    /// arguments, so this is a defensive check).
    pub fn for_kernel(meta: &TensorMeta) -> Result<Rows, KernelError> {
        Rows::of(meta).map_err(|reason| KernelError::InvalidArguments { reason: reason.into_owned() })
    }

    /// One past the last element the rows touch, relative to `offset`.
    pub fn span(&self) -> usize {
        match self.n_rows {
            0 => 0,
            n => (n - 1) * self.row_stride + self.hidden,
        }
    }
}

/// [`Rows`] as a GPU kernel's integer parameters (`long long n_rows, int hidden, long long
/// row_stride`, and the storage offset for kernels that take it), each converted without loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowArgs {
    /// Number of rows.
    pub n_rows: i64,
    /// Elements per row.
    pub hidden: i32,
    /// Elements between row starts.
    pub row_stride: i64,
    /// Storage offset of the first element, in elements.
    pub offset: i64,
}

impl Rows {
    /// The rows as kernel parameters, or an error naming the one that does not fit ([`kernel_int`]).
    pub fn kernel_args(&self) -> Result<RowArgs, KernelError> {
        Ok(RowArgs {
            n_rows: kernel_int(self.n_rows, "rows")?,
            hidden: kernel_int(self.hidden, "hidden size")?,
            row_stride: kernel_int(self.row_stride, "row stride")?,
            offset: kernel_int(self.offset, "storage offset")?,
        })
    }
}

impl RowArgs {
    /// The rows these parameters were made from ([`Rows::kernel_args`]), for a host kernel handed a
    /// launch, so it need not derive them from the layout again; an error names a negative field.
    pub fn rows(&self) -> Result<Rows, KernelError> {
        let back =
            |value: i64, what: &'static str| usize::try_from(value).map_err(|_| out_of_range(what, value, 0, i64::MAX));
        Ok(Rows {
            n_rows: back(self.n_rows, "rows")?,
            hidden: back(self.hidden.into(), "hidden size")?,
            row_stride: back(self.row_stride, "row stride")?,
            offset: back(self.offset, "storage offset")?,
        })
    }
}

/// Kernels do not implement `variance_size`; a defensive check behind the predicate.
pub fn reject_variance_size(variance_size: Option<i64>) -> Result<(), KernelError> {
    match variance_size {
        None => Ok(()),
        Some(_) => Err(KernelError::NativeOnly { param: "variance_size" }),
    }
}

/// The elements of each row a norm's mean square runs over: `variance_size` (the meta function has
/// checked it lies in 1..=H; checked again here, as a kernel error), else the hidden size.
pub fn norm_variance(variance_size: Option<i64>, hidden: usize) -> Result<usize, KernelError> {
    match variance_size {
        None => Ok(hidden),
        Some(v) => usize::try_from(v)
            .ok()
            .filter(|&v| (1..=hidden).contains(&v))
            .ok_or_else(|| out_of_range("variance_size", v, 1, hidden)),
    }
}

/// Threads cooperating on one row in the CUDA and ROCm kernels, from the hidden size alone:
/// 8/16/32/64/128/256 for H ≤ 64/128/3072/6144/16384/larger.
pub fn gpu_threads_per_row(hidden: usize) -> u32 {
    match hidden {
        0..=64 => 8,
        65..=128 => 16,
        129..=3072 => 32,
        3073..=6144 => 64,
        6145..=16384 => 128,
        _ => 256,
    }
}

/// The elements of one 16-byte chunk of `dtype` (f64: 2), the unit a CUDA/ROCm thread of the
/// norms and gated ops owns.
pub fn gpu_chunk(dtype: DType) -> usize {
    16 / dtype.size_in_bytes().clamp(1, 16)
}

/// The largest block of the CUDA and ROCm gated kernels (`GATED_MAX_BLOCK`, their launch bound).
pub const GATED_MAX_BLOCK: u32 = 1024;

/// The 16-byte chunks of the gate (and of up) a thread of a CUDA or ROCm 16-byte gated kernel
/// loads per step (`gated_unroll` in `kernels/gpu/gated.h`).
pub const GATED_STEP_CHUNKS: usize = 2;

/// Threads per block of a CUDA or ROCm gated row of width `d`, from d and the dtype alone (the
/// row statistics' reduction order follows the block, so both kernels of a width must agree): one
/// step of [`GATED_STEP_CHUNKS`] 16-byte chunks per thread, rounded up to a power of two, from 64
/// (a wavefront) up to [`GATED_MAX_BLOCK`]. A row of up to 16384 16-bit elements is one step of
/// each thread, all its loads in flight at once (the sparse op keeps it through its statistics),
/// and a block of at most 512 threads up to 8192 elements, so two or more blocks share an SM and
/// one block's reductions and barriers hide behind another's loads.
pub fn gated_block(d: usize, dtype: DType) -> u32 {
    let steps = d.div_ceil(gpu_chunk(dtype)).div_ceil(GATED_STEP_CHUNKS).max(1);
    let threads = steps.checked_next_power_of_two().unwrap_or(usize::MAX);
    u32::try_from(threads).map_or(GATED_MAX_BLOCK, |threads| threads.clamp(64, GATED_MAX_BLOCK))
}

/// The longest row a kernel with `threads_per_row` threads per row keeps whole in registers: the
/// largest hidden size that launches with it (the hidden-size buckets), and 32768 for the last,
/// open-ended one.
pub fn largest_cached_row(threads_per_row: u32) -> u32 {
    match threads_per_row {
        ..=8 => 64,
        16 => 128,
        32 => 3072,
        64 => 6144,
        128 => 16384,
        _ => 32768,
    }
}

/// The 16-byte chunks of a row each CUDA/ROCm norm thread keeps in registers (`ROW_CHUNKS` of
/// `kernels/gpu/rms_norm.h`): the whole row up to [`largest_cached_row`]; f64, a reference dtype, gets the f32
/// kernels' chunk count and so their registers: half its row.
pub fn norm_cache_chunks(dtype: DType, threads_per_row: u32) -> u32 {
    let size = if dtype == DType::F64 { 4 } else { dtype.size_in_bytes() as u32 };
    largest_cached_row(threads_per_row).div_ceil(16 / size * threads_per_row)
}

/// The chunks the fused norm keeps (`norm_fused_cache_chunks` in `kernels/gpu/rms_norm.h`): on the 16-byte path x
/// and the residual as stored, as many as [`norm_cache_chunks`] for 16-bit elements (two packed
/// chunks take the registers of one chunk of f32 sums) and half for f32; on the scalar path their
/// sums, as many as `norm_cache_chunks`.
pub fn norm_fused_cache_chunks(dtype: DType, threads_per_row: u32, vectorized: bool) -> u32 {
    let chunks = norm_cache_chunks(dtype, threads_per_row);
    if !vectorized || dtype.size_in_bytes() < 4 { chunks } else { chunks.div_ceil(2) }
}

/// The code the GPU element preludes (`kernels/gpu/elem.h`, `element.cl`) know a
/// compute dtype by (`DTYPE`, `WDTYPE`): f32 0, f16 1, bf16 2, f64 6 (the numbering of
/// [`element_code`], which the strided conversions use for every dtype); an error naming `backend`
/// for a dtype the kernels do not compute on.
pub fn compute_dtype_code(dtype: DType, backend: &'static str) -> Result<u8, KernelError> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 => Ok(element_code(dtype)),
        other => Err(KernelError::UnsupportedDType { backend, dtype: other }),
    }
}

/// The code the GPU kernel sources know an element dtype by: f32 0, f16 1, bf16 2, f8e4m3fn 3,
/// f8e5m2 4, i8 5, f64 6, i64 7.
pub fn element_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::F8E4M3FN => 3,
        DType::F8E5M2 => 4,
        DType::I8 => 5,
        DType::F64 => 6,
        DType::I64 => 7,
    }
}

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

/// What a `rotary_embedding` kernel is given: the geometry, the rows of query, key and the cache,
/// and the positions' storage offset, each as kernel integers.
#[derive(Clone, Copy, Debug)]
pub struct RotaryLaunch {
    /// The call's geometry.
    pub geometry: ir_ops::rotary_embedding::RotaryGeometry,
    /// Query rows.
    pub query: RowArgs,
    /// Key rows (`None` without a key).
    pub key: Option<RowArgs>,
    /// Cache rows.
    pub cache: RowArgs,
    /// Storage offset of the first position, in elements.
    pub positions_offset: i64,
}

impl RotaryLaunch {
    /// The launch of a call on these tensors (the meta function has checked them).
    pub fn of(
        positions: &Tensor,
        query: &Tensor,
        key: Option<&Tensor>,
        cos_sin_cache: &Tensor,
        head_size: i64,
        rotary_dim: i64,
        is_neox_style: bool,
    ) -> Result<RotaryLaunch, KernelError> {
        use ir_ops::rotary_embedding::RotaryGeometry;
        let (q, c) = (query, cos_sin_cache);
        Ok(RotaryLaunch {
            geometry: RotaryGeometry::of_tensors(positions, q, key, c, head_size, rotary_dim, is_neox_style),
            query: Rows::for_kernel(q.meta())?.kernel_args()?,
            key: key.map(|k| Rows::for_kernel(k.meta())?.kernel_args()).transpose()?,
            cache: Rows::for_kernel(c.meta())?.kernel_args()?,
            positions_offset: kernel_int(positions.offset(), "positions offset")?,
        })
    }

    /// Work-items per token (each rotates pairs `i`, `i + threads`, … of every head): the pairs of
    /// the larger of query and key, rounded up to a multiple of 32 and capped at 256.
    pub fn threads_per_token(&self) -> u32 {
        let g = &self.geometry;
        let pairs = g.heads.max(g.kv_heads) * (g.rotary_dim / 2);
        (pairs.div_ceil(32) * 32).clamp(32, 256) as u32
    }

    /// The geometry's integers as the kernels take them: `(heads, kv_heads, head_size, rotary_dim,
    /// max_position)`.
    pub fn dims(&self) -> Result<[i32; 5], KernelError> {
        let g = &self.geometry;
        Ok([
            kernel_int(g.heads, "heads")?,
            kernel_int(g.kv_heads, "key heads")?,
            kernel_int(g.head_size, "head_size")?,
            kernel_int(g.rotary_dim, "rotary_dim")?,
            kernel_int(g.max_position, "cache rows")?,
        ])
    }
}

/// A `rotary_embedding` call as a provider's kernel receives it: the arguments, query and key
/// uniquely owned (the kernel rotates them in their storage), and the launch derived from them.
#[derive(Debug)]
pub struct RotaryCall<'a> {
    /// Token positions (i64).
    pub positions: &'a Tensor,
    /// The query, written in place.
    pub query: UniqueTensor,
    /// The key, written in place, when given.
    pub key: Option<UniqueTensor>,
    /// `[max_position, rotary_dim]`.
    pub cos_sin_cache: &'a Tensor,
    /// Geometry and kernel integers.
    pub launch: RotaryLaunch,
    /// Whether the cos and sin, each product and the sum are rounded to the query's dtype
    /// (`rounding = "dtype"` on 16-bit tensors; [`ir_ops::rotary_embedding::rotate_pair_rounded`]).
    pub round_products: bool,
}

/// A provider's rotary kernel: the rotated query and key, written in their storage.
pub type RotaryKernel = fn(RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError>;

/// Registers a provider's in-place `rotary_embedding` kernel on `device`, with the standard
/// predicate ([`rotary_support`]); `kernel` returns the rotated query and key.
pub fn register_rotary(
    registry: &ir_core::Registry,
    device: DeviceKind,
    spec: ir_core::ImplSpec,
    kernel: RotaryKernel,
) -> Result<(), ir_core::RegistryError> {
    register_rotary_with(registry, device, || KernelDTypes::Reduced, spec, kernel)
}

/// [`register_rotary`] for a provider whose kernel computes on the dtypes `dtypes` says (asked at
/// each selection).
pub fn register_rotary_with(
    registry: &ir_core::Registry,
    device: DeviceKind,
    dtypes: fn() -> KernelDTypes,
    spec: ir_core::ImplSpec,
    kernel: RotaryKernel,
) -> Result<(), ir_core::RegistryError> {
    use ir_ops::rotary_embedding;
    let spec = spec.with_supports(move |args| rotary_support_with(args, device, dtypes()));
    let call = move |positions: &Tensor,
                     query: UniqueTensor,
                     key: Option<UniqueTensor>,
                     cos_sin_cache: &Tensor,
                     head_size: i64,
                     rotary_dim: i64,
                     is_neox_style: bool,
                     rounding: ir_ops::Rounding| {
        let key_tensor = key.as_ref().map(UniqueTensor::tensor);
        let round_products = rounding.rounds_intermediates(query.tensor().dtype());
        let launch = RotaryLaunch::of(
            positions,
            query.tensor(),
            key_tensor,
            cos_sin_cache,
            head_size,
            rotary_dim,
            is_neox_style,
        )?;
        kernel(RotaryCall { positions, query, key, cos_sin_cache, launch, round_products })
    };
    rotary_embedding::register(registry, spec, rotary_embedding::Impl::inplace(call))
}

/// Dimensions a device-side strided copy kernel takes.
pub const COPY_MAX_RANK: usize = 8;

/// The `add` and `mul` kernels of the GPU backends (`binary_strided`): (dtype, operation, kernel
/// name), the same names in the CUDA and ROCm sources. Every dtype.
pub const BINARY_KERNELS: [(DType, ir_core::storage::BinaryOp, &str); 16] = {
    use DType::{BF16, F8E4M3FN, F8E5M2, F16, F32, F64, I8, I64};
    use ir_core::storage::BinaryOp::{Add, Mul};
    [
        (F32, Add, "strided_add_f32"),
        (F16, Add, "strided_add_f16"),
        (BF16, Add, "strided_add_bf16"),
        (F8E4M3FN, Add, "strided_add_f8e4m3fn"),
        (F8E5M2, Add, "strided_add_f8e5m2"),
        (I8, Add, "strided_add_i8"),
        (F64, Add, "strided_add_f64"),
        (I64, Add, "strided_add_i64"),
        (F32, Mul, "strided_mul_f32"),
        (F16, Mul, "strided_mul_f16"),
        (BF16, Mul, "strided_mul_bf16"),
        (F8E4M3FN, Mul, "strided_mul_f8e4m3fn"),
        (F8E5M2, Mul, "strided_mul_f8e5m2"),
        (I8, Mul, "strided_mul_i8"),
        (F64, Mul, "strided_mul_f64"),
        (I64, Mul, "strided_mul_i64"),
    ]
};

/// The conversions the GPU backends' strided conversion kernels make (`copy_` between dtypes and
/// `scale` of device tensors): (source, destination, kernel name), the same names in the CUDA
/// and ROCm sources. Every pair of dtypes.
pub const CONVERT_KERNELS: [(DType, DType, &str); 64] = {
    use DType::{BF16, F8E4M3FN, F8E5M2, F16, F32, F64, I8, I64};
    [
        (F32, F32, "strided_convert_f32_f32"),
        (F32, F16, "strided_convert_f32_f16"),
        (F32, BF16, "strided_convert_f32_bf16"),
        (F32, F8E4M3FN, "strided_convert_f32_f8e4m3fn"),
        (F32, F8E5M2, "strided_convert_f32_f8e5m2"),
        (F32, I8, "strided_convert_f32_i8"),
        (F32, F64, "strided_convert_f32_f64"),
        (F32, I64, "strided_convert_f32_i64"),
        (F16, F32, "strided_convert_f16_f32"),
        (F16, F16, "strided_convert_f16_f16"),
        (F16, BF16, "strided_convert_f16_bf16"),
        (F16, F8E4M3FN, "strided_convert_f16_f8e4m3fn"),
        (F16, F8E5M2, "strided_convert_f16_f8e5m2"),
        (F16, I8, "strided_convert_f16_i8"),
        (F16, F64, "strided_convert_f16_f64"),
        (F16, I64, "strided_convert_f16_i64"),
        (BF16, F32, "strided_convert_bf16_f32"),
        (BF16, F16, "strided_convert_bf16_f16"),
        (BF16, BF16, "strided_convert_bf16_bf16"),
        (BF16, F8E4M3FN, "strided_convert_bf16_f8e4m3fn"),
        (BF16, F8E5M2, "strided_convert_bf16_f8e5m2"),
        (BF16, I8, "strided_convert_bf16_i8"),
        (BF16, F64, "strided_convert_bf16_f64"),
        (BF16, I64, "strided_convert_bf16_i64"),
        (F8E4M3FN, F32, "strided_convert_f8e4m3fn_f32"),
        (F8E4M3FN, F16, "strided_convert_f8e4m3fn_f16"),
        (F8E4M3FN, BF16, "strided_convert_f8e4m3fn_bf16"),
        (F8E4M3FN, F8E4M3FN, "strided_convert_f8e4m3fn_f8e4m3fn"),
        (F8E4M3FN, F8E5M2, "strided_convert_f8e4m3fn_f8e5m2"),
        (F8E4M3FN, I8, "strided_convert_f8e4m3fn_i8"),
        (F8E4M3FN, F64, "strided_convert_f8e4m3fn_f64"),
        (F8E4M3FN, I64, "strided_convert_f8e4m3fn_i64"),
        (F8E5M2, F32, "strided_convert_f8e5m2_f32"),
        (F8E5M2, F16, "strided_convert_f8e5m2_f16"),
        (F8E5M2, BF16, "strided_convert_f8e5m2_bf16"),
        (F8E5M2, F8E4M3FN, "strided_convert_f8e5m2_f8e4m3fn"),
        (F8E5M2, F8E5M2, "strided_convert_f8e5m2_f8e5m2"),
        (F8E5M2, I8, "strided_convert_f8e5m2_i8"),
        (F8E5M2, F64, "strided_convert_f8e5m2_f64"),
        (F8E5M2, I64, "strided_convert_f8e5m2_i64"),
        (I8, F32, "strided_convert_i8_f32"),
        (I8, F16, "strided_convert_i8_f16"),
        (I8, BF16, "strided_convert_i8_bf16"),
        (I8, F8E4M3FN, "strided_convert_i8_f8e4m3fn"),
        (I8, F8E5M2, "strided_convert_i8_f8e5m2"),
        (I8, I8, "strided_convert_i8_i8"),
        (I8, F64, "strided_convert_i8_f64"),
        (I8, I64, "strided_convert_i8_i64"),
        (F64, F32, "strided_convert_f64_f32"),
        (F64, F16, "strided_convert_f64_f16"),
        (F64, BF16, "strided_convert_f64_bf16"),
        (F64, F8E4M3FN, "strided_convert_f64_f8e4m3fn"),
        (F64, F8E5M2, "strided_convert_f64_f8e5m2"),
        (F64, I8, "strided_convert_f64_i8"),
        (F64, F64, "strided_convert_f64_f64"),
        (F64, I64, "strided_convert_f64_i64"),
        (I64, F32, "strided_convert_i64_f32"),
        (I64, F16, "strided_convert_i64_f16"),
        (I64, BF16, "strided_convert_i64_bf16"),
        (I64, F8E4M3FN, "strided_convert_i64_f8e4m3fn"),
        (I64, F8E5M2, "strided_convert_i64_f8e5m2"),
        (I64, I8, "strided_convert_i64_i8"),
        (I64, F64, "strided_convert_i64_f64"),
        (I64, I64, "strided_convert_i64_i64"),
    ]
};

/// The `factor` parameter of a strided conversion kernel (`scale`; 1 for `copy_`): in the source's
/// compute dtype, rounded to it as the host rounds it. f64 for f64 sources; for i64 sources, which
/// the kernels read into f64, the factor rounded to f32 (i64's compute dtype) and passed as f64;
/// f32 for the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ConvertFactor {
    /// An f32 parameter.
    F32(f32),
    /// An f64 parameter.
    F64(f64),
}

impl ConvertFactor {
    /// The parameter for a conversion from `src` scaling by `factor` (none: 1).
    pub fn for_source(src: DType, factor: Option<f64>) -> ConvertFactor {
        let factor = factor.unwrap_or(1.0);
        match src {
            DType::F64 => ConvertFactor::F64(factor),
            DType::I64 => ConvertFactor::F64(f64::from(factor as f32)),
            _ => ConvertFactor::F32(factor as f32),
        }
    }
}

/// Whether a strided conversion (or `add`/`mul`, `src == dst`) between these dtypes computes or
/// stores in f64 on the device: an f64 or i64 source, or an f64 destination. A device without f64
/// arithmetic (some OpenCL GPUs) leaves these to the host.
pub fn converts_through_f64(src: DType, dst: DType) -> bool {
    matches!(src, DType::F64 | DType::I64) || dst == DType::F64
}

/// Bytes a thread of the wide strided copy (`strided_copy_16`) moves: one 16-byte load and store.
pub const WIDE_COPY_BYTES: usize = 16;

/// One launch of a strided copy as the copy kernels take it: shape and strides padded to
/// [`COPY_MAX_RANK`] dimensions (extent 1, stride 0), the element count, and the storage offsets,
/// each converted to a kernel integer. [`CopyDims::pieces`] cuts a copy of any rank into these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyDims {
    /// Extents.
    pub shape: [i64; COPY_MAX_RANK],
    /// Source strides, in elements.
    pub src_strides: [i64; COPY_MAX_RANK],
    /// Destination strides, in elements.
    pub dst_strides: [i64; COPY_MAX_RANK],
    /// The dimensions in use (at least 1): those past it are padding.
    pub rank: i32,
    /// Elements copied.
    pub n: i64,
    /// Source storage offset, in elements.
    pub src_offset: i64,
    /// Destination storage offset, in elements.
    pub dst_offset: i64,
    /// The row-major index of this piece's first element in the whole copy: where its elements
    /// start in a compact destination (the `add`/`mul` kernels write one).
    pub first: i64,
}

/// One dimension of a copy: extent, source stride, destination stride.
type CopyDim = (usize, usize, usize);

/// The launches of one strided copy ([`CopyDims::pieces`]): inline for the usual single launch, so
/// preparing it allocates nothing.
pub type CopyPieces = smallvec::SmallVec<[CopyDims; 1]>;

impl CopyDims {
    /// The copy of the elements `src` describes into `dst_layout` (same shape), as kernel launches
    /// of at most [`COPY_MAX_RANK`] dimensions each, in row-major order of their elements: none for
    /// no elements, one for most copies. Dimensions of extent 1 are dropped and neighbours that
    /// both layouts step through as one are merged, so only a copy still past the kernel's rank
    /// after that takes more than one launch (one per index of its outer dimensions). Errors name
    /// what does not fit: different shapes, a value past a kernel integer.
    pub fn pieces(src: &TensorMeta, dst_layout: &ir_core::Layout) -> Result<CopyPieces, KernelError> {
        if dst_layout.shape() != src.shape() {
            return Err(OperandMismatch::error("destination", dst_layout, "source", src));
        }
        if src.numel() == 0 {
            return Ok(CopyPieces::new());
        }
        let dims = merged_dims(src.layout.shape(), src.layout.strides(), dst_layout.strides());
        let (outer, inner) = dims.split_at(dims.len().saturating_sub(COPY_MAX_RANK));
        let inner_n: usize = inner.iter().map(|d| d.0).product();
        let pieces: usize = outer.iter().map(|d| d.0).product();
        let mut padded = ([1i64; COPY_MAX_RANK], [0i64; COPY_MAX_RANK], [0i64; COPY_MAX_RANK]);
        for (i, &(extent, s, d)) in inner.iter().enumerate() {
            padded.0[i] = kernel_int(extent, "extent")?;
            padded.1[i] = kernel_int(s, "source stride")?;
            padded.2[i] = kernel_int(d, "destination stride")?;
        }
        let rank = i32::try_from(inner.len().max(1)).expect("at most COPY_MAX_RANK dimensions");
        let n = kernel_int(inner_n, "elements")?;
        (0..pieces)
            .map(|piece| {
                // The piece's index in the outer dimensions, innermost fastest.
                let (mut rest, mut src_offset, mut dst_offset) = (piece, src.layout.offset(), dst_layout.offset());
                for &(extent, s, d) in outer.iter().rev() {
                    src_offset += (rest % extent) * s;
                    dst_offset += (rest % extent) * d;
                    rest /= extent;
                }
                Ok(CopyDims {
                    shape: padded.0,
                    src_strides: padded.1,
                    dst_strides: padded.2,
                    rank,
                    n,
                    src_offset: kernel_int(src_offset, "source offset")?,
                    dst_offset: kernel_int(dst_offset, "destination offset")?,
                    first: kernel_int(piece * inner_n, "elements")?,
                })
            })
            .collect()
    }

    /// When both sides of this piece are one compact range (one dimension, unit strides: a copy a
    /// memcpy does), the source and destination byte offsets and the byte count for elements of
    /// `element_size` bytes.
    pub fn compact_bytes(&self, element_size: usize) -> Result<Option<[usize; 3]>, KernelError> {
        let compact = self.rank == 1 && self.src_strides[0] == 1 && self.dst_strides[0] == 1;
        if !compact {
            return Ok(None);
        }
        let [src, dst, _] = self.element_offsets()?;
        let n = usize::try_from(self.n).map_err(|_| out_of_range("elements", self.n, 0, isize::MAX))?;
        Ok(Some([src * element_size, dst * element_size, n * element_size]))
    }

    /// This piece as a copy of 16-byte units ([`WIDE_COPY_BYTES`]), each a thread's one 16-byte
    /// load and store (`strided_copy_16`), for elements of `element_size` bytes: when its innermost
    /// dimension is contiguous on both sides and a whole number of units long, and every other
    /// stride and both offsets are whole units (in bytes). Extents, strides, offsets and counts are
    /// then in units; `None` otherwise (and for elements of 16 bytes or more). The caller checks
    /// that both buffers start 16-byte aligned.
    pub fn widened(&self, element_size: usize) -> Option<CopyDims> {
        if element_size == 0 || element_size >= WIDE_COPY_BYTES || !WIDE_COPY_BYTES.is_multiple_of(element_size) {
            return None;
        }
        let per_unit = i64::try_from(WIDE_COPY_BYTES / element_size).ok()?;
        let inner = usize::try_from(self.rank).ok()?.checked_sub(1)?;
        let whole = |elements: i64| elements % per_unit == 0;
        let contiguous = self.src_strides[inner] == 1 && self.dst_strides[inner] == 1 && whole(self.shape[inner]);
        let outer_whole = (0..inner).all(|k| whole(self.src_strides[k]) && whole(self.dst_strides[k]));
        if !(contiguous && outer_whole && whole(self.src_offset) && whole(self.dst_offset)) {
            return None;
        }
        let mut wide = *self;
        wide.shape[inner] /= per_unit;
        wide.src_strides[inner] = 1;
        wide.dst_strides[inner] = 1;
        for k in 0..inner {
            wide.src_strides[k] /= per_unit;
            wide.dst_strides[k] /= per_unit;
        }
        wide.n /= per_unit;
        wide.src_offset /= per_unit;
        wide.dst_offset /= per_unit;
        wide.first /= per_unit;
        Some(wide)
    }

    /// The source offset, the destination offset and `first`, in elements, as host integers: for
    /// backends that offset pointers rather than pass the offsets. Errors name a negative one (the
    /// fields are public; [`CopyDims::pieces`] never makes one).
    pub fn element_offsets(&self) -> Result<[usize; 3], KernelError> {
        let offset = |value: i64| usize::try_from(value).map_err(|_| out_of_range("copy offset", value, 0, i64::MAX));
        Ok([offset(self.src_offset)?, offset(self.dst_offset)?, offset(self.first)?])
    }
}

/// The dimensions of a copy with extents `shape` between layouts of `src` and `dst` strides, in the
/// same row-major order of elements: extent-1 dimensions dropped, and each dimension merged into
/// the one before it where both layouts step over it as one (the outer stride is the inner one
/// times the inner extent). At least one dimension.
fn merged_dims(shape: &[usize], src: &[usize], dst: &[usize]) -> smallvec::SmallVec<[CopyDim; COPY_MAX_RANK]> {
    let mut dims = smallvec::SmallVec::<[CopyDim; COPY_MAX_RANK]>::new();
    for ((&extent, &s), &d) in shape.iter().zip(src).zip(dst) {
        if extent == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(last) if last.1 == s * extent && last.2 == d * extent => *last = (last.0 * extent, s, d),
            _ => dims.push((extent, s, d)),
        }
    }
    if dims.is_empty() {
        dims.push((1, 0, 0));
    }
    dims
}

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

pub use ir_ops::quant::per_token_scales_shape;

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
    /// ([`ComputeScalar::new`]).
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

/// Converts a size, stride or offset for a kernel's integer parameter (`hidden` is an `int`,
/// rows, strides and offsets are 64-bit), or names the one that does not fit. GPU predicates reject
/// a hidden size past `i32::MAX`; every element index fits `i64` because no tensor exceeds
/// `isize::MAX` bytes. This check keeps a launch from truncating either silently.
pub fn kernel_int<T: TryFrom<usize> + Bounded>(value: usize, what: &'static str) -> Result<T, KernelError> {
    T::try_from(value).map_err(|_| out_of_range(what, value, T::MIN_I128, T::MAX_I128))
}

/// An extent a GPU kernel walks with a 32-bit index in steps of `step` threads (`for (int j =
/// tid; j < n; j += step)`, the gated and quantization rows): it must fit `int` with room for the
/// last step, so the index never passes `i32::MAX` (which would wrap it negative and loop or write
/// out of bounds); else an error naming `what`.
pub fn stepped_extent(value: usize, what: &'static str, step: u32) -> Result<i32, KernelError> {
    let max = i32::MAX - i32::try_from(step).unwrap_or(i32::MAX);
    i32::try_from(value).ok().filter(|&v| v <= max).ok_or_else(|| out_of_range(what, value, 0, max))
}

/// The bounds of a kernel's integer parameter type, for [`kernel_int`]'s error.
pub trait Bounded {
    /// The least value.
    const MIN_I128: i128;
    /// The greatest value.
    const MAX_I128: i128;
}

macro_rules! bounded {
    ($($t:ty),+) => {$(
        impl Bounded for $t {
            const MIN_I128: i128 = <$t>::MIN as i128;
            const MAX_I128: i128 = <$t>::MAX as i128;
        }
    )+};
}
bounded!(i32, u32, i64, u64, usize);

/// [`KernelError::OutOfRange`] for `value` of `what` outside `min..=max` (each saturated to the
/// `i64` range).
pub fn out_of_range(
    what: &'static str,
    value: impl TryInto<i128>,
    min: impl TryInto<i128>,
    max: impl TryInto<i128>,
) -> KernelError {
    let saturate = |v: Option<i128>, missing: i128| v.unwrap_or(missing).clamp(i64::MIN.into(), i64::MAX.into()) as i64;
    KernelError::OutOfRange {
        what,
        value: saturate(value.try_into().ok(), i128::MAX),
        min: saturate(min.try_into().ok(), i128::MIN),
        max: saturate(max.try_into().ok(), i128::MAX),
    }
}

fn no(reason: &'static str) -> Support {
    Support::No(Cow::Borrowed(reason))
}

/// A device provider's own buffer type behind `t`, or an error naming the parameter: "`x` is not in
/// CUDA memory" (`memory` names the provider's memory).
pub fn device_buffer<'t, B: 'static>(t: &'t Tensor, param: &str, memory: &'static str) -> Result<&'t B, KernelError> {
    match t.storage() {
        Storage::Device(buffer) => buffer.as_any().downcast_ref::<B>(),
        Storage::Cpu(_) => None,
    }
    .ok_or_else(|| not_in_memory(param, memory))
}

/// [`device_buffer`] for writing, through the unique ownership an in-place kernel receives.
pub fn device_buffer_mut<'t, B: 'static>(
    t: &'t mut UniqueTensor,
    param: &str,
    memory: &'static str,
) -> Result<&'t mut B, KernelError> {
    match t.storage_mut()? {
        Storage::Device(buffer) => buffer.as_any_mut().downcast_mut::<B>().ok_or_else(|| not_in_memory(param, memory)),
        Storage::Cpu(_) => Err(not_in_memory(param, memory)),
    }
}

fn not_in_memory(param: &str, memory: &'static str) -> KernelError {
    KernelError::WrongMemory { param: param.to_owned(), memory }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::{Device, Layout};

    #[test]
    fn gated_blocks_are_a_step_per_thread_in_powers_of_two() {
        // 16-byte chunks: 8 bf16, 4 f32, 2 f64.
        assert_eq!([DType::BF16, DType::F16, DType::F32, DType::F64].map(gpu_chunk), [8, 8, 4, 2]);
        // At least a wavefront, even for one chunk.
        assert_eq!(gated_block(1, DType::BF16), 64);
        assert_eq!(gated_block(1024, DType::BF16), 64);
        assert_eq!(gated_block(1040, DType::BF16), 128);
        assert_eq!(gated_block(4096, DType::BF16), 256);
        assert_eq!(gated_block(8192, DType::BF16), 512);
        assert_eq!(gated_block(4096, DType::F32), 512);
        assert_eq!(gated_block(14336, DType::BF16), 1024);
        assert_eq!(gated_block(16384, DType::BF16), 1024);
        assert_eq!(gated_block(usize::MAX, DType::BF16), 1024);
        assert_eq!(gated_block(4096, DType::F64), 1024);
        for d in 1..5000 {
            for dtype in [DType::BF16, DType::F32, DType::F64] {
                let block = gated_block(d, dtype);
                assert!(block.is_power_of_two() && (64..=GATED_MAX_BLOCK).contains(&block), "{d} {dtype}");
                // One step per thread whenever the largest block allows it.
                let chunks = d.div_ceil(gpu_chunk(dtype));
                if chunks <= GATED_STEP_CHUNKS * GATED_MAX_BLOCK as usize {
                    assert!(chunks <= GATED_STEP_CHUNKS * block as usize, "{d} {dtype}: {block}");
                    assert!(block == 64 || chunks > GATED_STEP_CHUNKS * block as usize / 2, "{d} {dtype}: {block}");
                }
            }
        }
    }

    fn meta(dtype: DType, shape: &[usize], strides: &[usize], offset: usize) -> TensorMeta {
        TensorMeta { dtype, device: Device::Cpu, layout: Layout::new(shape, strides, offset).unwrap() }
    }

    fn rms(x: &TensorMeta, w: Option<&TensorMeta>, variance: Option<i64>) -> Support {
        let w = w.map_or(ArgMeta::None, ArgMeta::Tensor);
        let v = variance.map_or(ArgMeta::None, ArgMeta::I64);
        rms_norm_support(&[ArgMeta::Tensor(x), w, ArgMeta::F64(1e-6), v], DeviceKind::Cpu)
    }

    #[test]
    fn dtype_codes_match_the_kernel_preludes() {
        let codes: Vec<u8> = [DType::F32, DType::F16, DType::BF16, DType::F64].map(element_code).to_vec();
        assert_eq!(codes, [0, 1, 2, 6]);
        assert_eq!(compute_dtype_code(DType::BF16, "cuda").unwrap(), 2);
        let error = compute_dtype_code(DType::F8E4M3FN, "xpu").unwrap_err();
        assert!(matches!(error, KernelError::UnsupportedDType { backend: "xpu", dtype: DType::F8E4M3FN }));
        assert_eq!(element_code(DType::I64), 7);
    }

    #[test]
    fn row_parameters_give_back_their_rows() {
        for m in [meta(DType::BF16, &[4, 8], &[8, 1], 0), meta(DType::F32, &[3, 2, 8], &[32, 16, 1], 5)] {
            let rows = Rows::for_kernel(&m).unwrap();
            assert_eq!(rows.kernel_args().unwrap().rows().unwrap(), rows, "{m}");
        }
        let negative = RowArgs { n_rows: 2, hidden: 8, row_stride: -8, offset: 0 };
        let err = negative.rows().unwrap_err();
        assert_eq!(err, KernelError::OutOfRange { what: "row stride", value: -8, min: 0, max: i64::MAX });
        assert!(err.to_string().contains("row stride -8 is outside 0..="), "{err}");
    }

    #[test]
    fn integers_past_a_kernel_parameter_and_native_only_parameters_are_typed_errors() {
        let err = kernel_int::<i32>(1 << 31, "hidden size").unwrap_err();
        let expected =
            KernelError::OutOfRange { what: "hidden size", value: 1 << 31, min: i32::MIN.into(), max: i32::MAX.into() };
        assert_eq!(err, expected);
        assert_eq!(kernel_int::<i32>(7, "hidden size"), Ok(7));
        // A block-stride loop's index must not pass i32::MAX on its last step.
        let most = i32::MAX as usize - 256;
        assert_eq!(stepped_extent(most, "output width", 256), Ok(i32::MAX - 256));
        let err = stepped_extent(most + 1, "output width", 256).unwrap_err();
        assert_eq!(
            err,
            KernelError::OutOfRange { what: "output width", value: most as i64 + 1, min: 0, max: most as i64 }
        );
        assert!(stepped_extent(1 << 31, "hidden size", 128).is_err());
        let err = norm_variance(Some(9), 8).unwrap_err();
        assert_eq!(err, KernelError::OutOfRange { what: "variance_size", value: 9, min: 1, max: 8 });
        assert_eq!(norm_variance(Some(8), 8), Ok(8));
        assert_eq!(reject_variance_size(Some(4)), Err(KernelError::NativeOnly { param: "variance_size" }));
    }

    /// The norm + quantization predicates take the element dtypes (the common case: a weight of
    /// x's dtype) or a provider's norm capabilities (a weight of another dtype too).
    #[test]
    fn norm_quant_predicates_take_dtypes_or_capabilities() {
        let x = meta(DType::BF16, &[4, 8], &[8, 1], 0);
        let w32 = meta(DType::F32, &[8], &[1], 0);
        let scale = meta(DType::F32, &[1], &[1], 0);
        let args = [
            ArgMeta::Tensor(&x),
            ArgMeta::Tensor(&w32),
            ArgMeta::F64(1e-6),
            ArgMeta::Tensor(&scale),
            ArgMeta::DType(DType::F8E4M3FN),
            ArgMeta::Str("exact"),
        ];
        let Support::No(reason) = rms_norm_static_fp8_quant_support_with(&args, DeviceKind::Cpu, KernelDTypes::Reduced)
        else {
            panic!("a weight of another dtype needs the capability")
        };
        assert_eq!(reason, "weight dtype f32 differs from x dtype bf16");
        let mixed = NormCapabilities { mixed_weight_dtype: true, ..NormCapabilities::DEFAULT };
        assert_eq!(rms_norm_static_fp8_quant_support_with(&args, DeviceKind::Cpu, mixed), Support::Yes);

        // The fused-add form's `dtype` rounding of a bf16 sum needs its capability.
        let w = meta(DType::BF16, &[8], &[1], 0);
        let fused = |rounding: &'static str| {
            [
                ArgMeta::Tensor(&x),
                ArgMeta::Tensor(&x),
                ArgMeta::Tensor(&w),
                ArgMeta::F64(1e-6),
                ArgMeta::Tensor(&scale),
                ArgMeta::DType(DType::F8E4M3FN),
                ArgMeta::Str(rounding),
            ]
        };
        let plain = NormCapabilities::DEFAULT;
        let rounding = NormCapabilities { dtype_rounding: true, ..NormCapabilities::DEFAULT };
        let support = fused_add_rms_norm_static_fp8_quant_support_with;
        assert_eq!(support(&fused("exact"), DeviceKind::Cpu, plain), Support::Yes);
        let Support::No(reason) = support(&fused("dtype"), DeviceKind::Cpu, plain) else {
            panic!("`dtype` rounding of a bf16 sum needs the capability")
        };
        assert!(reason.contains("rounding \"dtype\""), "{reason}");
        assert_eq!(support(&fused("dtype"), DeviceKind::Cpu, rounding), Support::Yes);
    }

    #[test]
    fn rules() {
        let x = meta(DType::BF16, &[4, 8], &[8, 1], 0);
        let w = meta(DType::BF16, &[8], &[1], 0);
        assert_eq!(rms(&x, Some(&w), None), Support::Yes);
        assert_eq!(rms(&x, None, None), Support::Yes);
        let Support::No(reason) = rms(&x, Some(&w), Some(4)) else { panic!() };
        assert!(reason.contains("variance_size"), "{reason}");
        let Support::No(reason) = rms(&x, Some(&meta(DType::F32, &[8], &[1], 0)), None) else { panic!() };
        assert_eq!(reason, "weight dtype f32 differs from x dtype bf16");
        let f64_x = meta(DType::F64, &[4, 8], &[8, 1], 0);
        assert!(matches!(rms(&f64_x, None, None), Support::No(_)));
        let padded = meta(DType::BF16, &[4, 8], &[11, 1], 1);
        assert_eq!(rms(&padded, None, None), Support::Yes);
        let transposed = meta(DType::BF16, &[8, 4], &[1, 8], 0);
        assert!(matches!(rms(&transposed, None, None), Support::No(_)));
        let heads = meta(DType::BF16, &[4, 2, 64], &[128, 64, 1], 0);
        assert_eq!(rms(&heads, None, None), Support::Yes);
        let strided_weight = meta(DType::BF16, &[8], &[2], 0);
        assert!(matches!(rms(&x, Some(&strided_weight), None), Support::No(_)));
        let mut on_gpu = x.clone();
        on_gpu.device = Device::Cuda(0);
        let Support::No(reason) = rms(&on_gpu, None, None) else { panic!() };
        assert_eq!(reason, "x is on cuda:0, this provider runs on cpu");
    }

    #[test]
    fn f64_is_taken_only_by_kernels_that_compute_in_it() {
        let f64_x = meta(DType::F64, &[4, 8], &[8, 1], 0);
        let f64_w = meta(DType::F64, &[8], &[1], 0);
        let bf16_x = meta(DType::BF16, &[4, 8], &[8, 1], 0);
        let bf16_w = meta(DType::BF16, &[8], &[1], 0);
        let norm = |x: &TensorMeta, w: &TensorMeta, dtypes| {
            let capabilities = NormCapabilities { dtypes, ..NormCapabilities::ALL };
            let args = [ArgMeta::Tensor(x), ArgMeta::Tensor(w), ArgMeta::F64(1e-6), ArgMeta::None];
            rms_norm_support_with(&args, DeviceKind::Cpu, capabilities)
        };
        for (x, w) in [(&f64_x, &f64_w), (&f64_x, &bf16_w), (&bf16_x, &f64_w)] {
            assert_eq!(norm(x, w, KernelDTypes::WithF64), Support::Yes, "x {} w {}", x.dtype, w.dtype);
            let Support::No(reason) = norm(x, w, KernelDTypes::Reduced) else { panic!("f64 refused") };
            assert!(reason.ends_with("dtype f64 is not one of f32, f16, bf16"), "{reason}");
        }
        let gated = |dtypes| gated_support_with(&[ArgMeta::Tensor(&f64_x)], DeviceKind::Cpu, dtypes);
        let quant = |dtypes| quant_support_with(&[ArgMeta::Tensor(&f64_x)], DeviceKind::Cpu, dtypes);
        assert_eq!((gated(KernelDTypes::WithF64), quant(KernelDTypes::WithF64)), (Support::Yes, Support::Yes));
        assert!(matches!(gated(KernelDTypes::Reduced), Support::No(_)));
        assert!(matches!(quant(KernelDTypes::Reduced), Support::No(_)));
        assert!(matches!(gated_support(&[ArgMeta::Tensor(&f64_x)], DeviceKind::Cpu), Support::No(_)), "the default");
        assert_eq!(KernelDTypes::with_f64_if(true), KernelDTypes::WithF64);
        assert!(!KernelDTypes::default().contains(DType::F64) && !KernelDTypes::WithF64.contains(DType::I64));
    }

    #[test]
    fn gpu_geometry_thresholds() {
        let cases = [
            (8, 8),
            (64, 8),
            (65, 16),
            (128, 16),
            (129, 32),
            (3072, 32),
            (3073, 64),
            (6144, 64),
            (6145, 128),
            (16384, 128),
            (16385, 256),
        ];
        for (hidden, threads) in cases {
            assert_eq!(gpu_threads_per_row(hidden), threads, "H {hidden}");
        }
    }

    #[test]
    fn rows() {
        let rows = Rows::of(&meta(DType::F32, &[2, 3, 8], &[48, 16, 1], 5)).unwrap();
        assert_eq!(rows, Rows { n_rows: 6, hidden: 8, row_stride: 16, offset: 5 });
        assert_eq!(rows.span(), 5 * 16 + 8);
        let single = Rows::of(&meta(DType::F32, &[8], &[1], 0)).unwrap();
        assert_eq!((single.n_rows, single.row_stride), (1, 8));
        let empty = Rows::of(&meta(DType::F32, &[0, 8], &[8, 1], 0)).unwrap();
        assert_eq!(empty.span(), 0);
    }

    #[test]
    fn answers_do_not_depend_on_the_number_of_tokens() {
        for hidden in [1, 8, 769, 4096] {
            for (row_stride, offset) in [(hidden, 0), (hidden + 3, 1), (2 * hidden, 0)] {
                let answers: Vec<bool> = [1usize, 7, 2048, 65536]
                    .iter()
                    .flat_map(|&t| {
                        [
                            meta(DType::F16, &[t, hidden], &[row_stride, 1], offset),
                            meta(DType::F16, &[2, t, hidden], &[t * row_stride, row_stride, 1], offset),
                        ]
                    })
                    .map(|x| rms(&x, None, None) == Support::Yes)
                    .collect();
                assert!(answers.iter().all(|&a| a == answers[0]), "H {hidden}, stride {row_stride}: {answers:?}");
            }
        }
    }

    #[test]
    fn a_host_tensor_is_not_a_device_buffer_and_the_error_names_the_parameter() {
        let t = Tensor::zeros(DType::F32, &[2, 4]).unwrap();
        let err = device_buffer::<u8>(&t, "x", "CUDA").unwrap_err();
        assert_eq!(err.to_string(), KernelError::WrongMemory { param: "x".to_owned(), memory: "CUDA" }.to_string());
        let mut unique = UniqueTensor::new(t).unwrap();
        assert!(
            device_buffer_mut::<u8>(&mut unique, "x_residual", "xpu")
                .unwrap_err()
                .to_string()
                .contains("`x_residual` is not in xpu memory")
        );
    }

    /// Every (source, destination) storage index pair the pieces walk, in launch order: each
    /// piece's elements in row-major order of its padded dimensions.
    fn walked(pieces: &[CopyDims]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for piece in pieces {
            for i in 0..piece.n {
                let (mut rest, mut s, mut d) = (i, piece.src_offset, piece.dst_offset);
                for k in (0..COPY_MAX_RANK).rev() {
                    s += (rest % piece.shape[k]) * piece.src_strides[k];
                    d += (rest % piece.shape[k]) * piece.dst_strides[k];
                    rest /= piece.shape[k];
                }
                out.push((s as usize, d as usize));
            }
        }
        out
    }

    /// What a copy between the two layouts moves, element by element.
    fn expected(src: &Layout, dst: &Layout) -> Vec<(usize, usize)> {
        src.storage_indices().zip(dst.storage_indices()).collect()
    }

    #[test]
    fn copy_pieces_merge_what_both_layouts_step_through_as_one() {
        // Compact into compact at any rank: one piece of one dimension.
        let shape = [2, 1, 3, 2, 2, 1, 2, 2, 3, 2, 2];
        let compact = Layout::compact(&shape);
        let pieces = CopyDims::pieces(&meta(DType::F32, &shape, compact.strides(), 0), &compact).unwrap();
        assert_eq!(pieces.len(), 1);
        assert_eq!((pieces[0].rank, pieces[0].n, pieces[0].shape[0], pieces[0].src_strides[0]), (1, 1152, 1152, 1));
        // A row slice of a [4, 6] matrix into compact rows: two dimensions stay.
        let rows = meta(DType::F32, &[4, 3], &[6, 1], 2);
        let pieces = CopyDims::pieces(&rows, &Layout::compact(&[4, 3])).unwrap();
        assert_eq!((pieces.len(), pieces[0].rank), (1, 2));
        assert_eq!(walked(&pieces), expected(&rows.layout, &Layout::compact(&[4, 3])));
        // No elements, no launch.
        assert!(
            CopyDims::pieces(&meta(DType::F32, &[3, 0], &[1, 1], 0), &Layout::compact(&[3, 0])).unwrap().is_empty()
        );
        // Different shapes are refused.
        let err = CopyDims::pieces(&rows, &Layout::compact(&[3, 4])).unwrap_err();
        assert!(matches!(&err, KernelError::OperandMismatch(m) if m.operand == "destination"), "{err}");
    }

    #[test]
    fn a_copy_past_the_kernels_rank_is_cut_into_pieces_over_its_outer_dimensions() {
        // Ten dimensions of extent 2, the source's strides reversed (a full transpose): nothing
        // merges, so the outer two dimensions make four pieces of eight dimensions.
        let shape = [2; 10];
        let compact = Layout::compact(&shape);
        let reversed: Vec<usize> = (0..10).map(|i| 1 << i).collect();
        let src = meta(DType::BF16, &shape, &reversed, 3);
        let dst = Layout::new(&shape, compact.strides(), 5).unwrap();
        let pieces = CopyDims::pieces(&src, &dst).unwrap();
        assert_eq!(pieces.len(), 4);
        assert!(pieces.iter().all(|p| p.rank == 8 && p.n == 256));
        assert_eq!(pieces.iter().map(|p| p.first).collect::<Vec<_>>(), [0, 256, 512, 768]);
        assert_eq!(walked(&pieces), expected(&src.layout, &dst));
    }

    proptest::proptest! {
        /// For any shape up to twelve dimensions, any order of the source's and the destination's
        /// dimensions in memory, padding and offsets: the pieces walk exactly the copy's pairs, in
        /// row-major order, each within the kernel's rank, with `first` counting the elements before.
        #[test]
        fn copy_pieces_walk_every_element_pair_in_order(
            extents in proptest::collection::vec(1usize..4, 1..12),
            src_order in proptest::prelude::any::<u64>(),
            dst_order in proptest::prelude::any::<u64>(),
            pad in 0usize..2,
            offsets in (0usize..7, 0usize..7),
        ) {
            let strided = |order: u64, offset: usize| {
                // The dimensions laid out in memory in a permutation drawn from `order`, the
                // innermost one padded by `pad`.
                let rank = extents.len();
                let mut dims: Vec<usize> = (0..rank).collect();
                let mut bits = order;
                for i in (1..rank).rev() {
                    dims.swap(i, (bits % (i as u64 + 1)) as usize);
                    bits /= i as u64 + 1;
                }
                let mut strides = vec![0; rank];
                let mut step = 1;
                for &d in dims.iter().rev() {
                    strides[d] = step;
                    step *= extents[d] + pad;
                }
                Layout::new(&extents, &strides, offset).unwrap()
            };
            let src = strided(src_order, offsets.0);
            let dst = strided(dst_order, offsets.1);
            let pieces = CopyDims::pieces(&meta(DType::F16, &extents, src.strides(), src.offset()), &dst).unwrap();
            proptest::prop_assert!(pieces.iter().all(|p| (1..=COPY_MAX_RANK as i32).contains(&p.rank)));
            let mut first = 0;
            for p in &pieces {
                proptest::prop_assert_eq!(p.first, first);
                proptest::prop_assert!(p.shape[p.rank as usize..].iter().all(|&e| e == 1));
                first += p.n;
            }
            proptest::prop_assert_eq!(walked(&pieces), expected(&src, &dst));
        }
    }
}
