//! `kernels-cpu`: the `cpu` provider of every built-in op: the norms (`fused_add_rms_norm` in place),
//! the gated activations, the fp8 quantizations and the fused norm + quantizations, and
//! `rotary_embedding` (in place on query and key).
//!
//! Plain Rust, no feature and no system library: every machine runs it, so it is the CPU platform's
//! default and every end-to-end test exercises it. Rows are split across threads (rayon) when a call
//! moves more than about 256 KB ([`BYTES_PER_TASK`]), and stay on the calling thread for decode-sized calls; each row's
//! result depends only on that row, so results do not depend on the thread count or batch size.
//!
//! The norms' rows have two paths with the same bits, chosen once per process ([`row_path`]):
//! explicit AVX-512F/BW rows for f32, bf16 and f16 where the CPU has them, and portable rows (multiversioned
//! for AVX-512, AVX2, NEON and the baseline) everywhere else; `VLLM_IR_CPU_ROWS=portable`
//! ([`ROW_PATH_ENV`]) forces the portable ones.
//!
//! [`program::run_row_program`] runs any row program ([`ir_ops::row_program`]) on the cpu, stepping
//! through it a chunk of each row at a time: the executor for fused computations described as data.
//!
//! ```
//! use ir_ops::Rounding;
//! use ir_ops::fused_add_rms_norm;
//! use ir_core::{DType, Platform, PriorityConfig, Registry, Tensor};
//!
//! let registry = ir_ops::registry();
//! kernels_cpu::register(&registry)?;
//! PriorityConfig::platform_default(Platform::Cpu).apply(&registry)?;
//! let x = Tensor::ones(DType::BF16, &[4, 64]).unwrap();
//! let residual = Tensor::zeros(DType::BF16, &[4, 64]).unwrap();
//! let x_storage = x.storage_id();
//! let (out, _) = fused_add_rms_norm::maybe_inplace(&registry, x, residual, None, 1e-6, None, Rounding::Exact)?;
//! assert_eq!(out.storage_id(), x_storage, "written in place");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Logging
//!
//! Target `kernels_cpu`: debug events for the thread split of large calls.

#[cfg(target_arch = "x86_64")]
mod activation;
mod avx512;
mod element;
pub mod gated;
pub mod program;
pub mod quant;
pub mod rotary;
mod rows;
mod stored;

pub use crate::rows::BYTES_PER_TASK;

use ir_core::op::ArgMeta;
use ir_core::storage::Storage;
use ir_core::{
    DType, DeviceKind, ImplSpec, KernelError, OperandMismatch, Registry, RegistryError, Support, Tensor, UniqueTensor,
};
use ir_ops::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
use ir_ops::rms_norm;
use ir_ops::{gelu_and_mul, silu_and_mul};
use kernel_support::{NormCapabilities, RowBlocks, Rows, reject_variance_size};

use crate::element::CpuElement;

/// The provider name.
pub const PROVIDER: &str = "cpu";

/// The environment variable that forces the portable row kernels (`portable`) instead of the
/// explicit SIMD ones this CPU offers (`auto`, the default): both give the same bits.
pub const ROW_PATH_ENV: &str = "VLLM_IR_CPU_ROWS";

/// Which row kernels the norms run on this machine, chosen once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowPath {
    /// Explicit AVX-512F/BW rows for f32, bf16 and f16 (a weight of another dtype than x takes the
    /// portable rows).
    Avx512,
    /// The portable rows (compiled for AVX-512, AVX2 and NEON besides the baseline, picked at run
    /// time), because the CPU has no explicit path or because [`ROW_PATH_ENV`] forced them.
    Portable {
        /// Whether [`ROW_PATH_ENV`] forced them.
        forced: bool,
    },
}

impl RowPath {
    /// Whether the explicit AVX-512 rows run.
    pub fn is_avx512(self) -> bool {
        self == RowPath::Avx512
    }
}

impl std::fmt::Display for RowPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RowPath::Avx512 => f.write_str("avx512 (explicit f32/bf16/f16 rows)"),
            RowPath::Portable { forced: true } => write!(f, "portable (forced by {ROW_PATH_ENV}=portable)"),
            RowPath::Portable { forced: false } => f.write_str("portable (no explicit rows for this CPU)"),
        }
    }
}

/// The row kernels of this process: the explicit AVX-512 rows when the CPU has AVX-512F, unless
/// [`ROW_PATH_ENV`]`=portable`; an unknown value is logged and ignored.
pub fn row_path() -> RowPath {
    static PATH: std::sync::OnceLock<RowPath> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| {
        let forced = match std::env::var(ROW_PATH_ENV) {
            Ok(value) if value == "portable" => true,
            Ok(value) if value == "auto" || value.is_empty() => false,
            Ok(value) => {
                tracing::warn!(target: "kernels_cpu", "{ROW_PATH_ENV}={value:?} is neither `auto` nor `portable`; using auto");
                false
            }
            Err(_) => false,
        };
        #[cfg(target_arch = "x86_64")]
        let explicit = crate::avx512::available();
        #[cfg(not(target_arch = "x86_64"))]
        let explicit = false;
        let path = if explicit && !forced { RowPath::Avx512 } else { RowPath::Portable { forced } };
        tracing::debug!(target: "kernels_cpu", %path, "row kernels");
        path
    })
}

/// What the cpu norms take beyond the common case: a weight of another dtype than x (a Gemma-style
/// f32 weight on bf16 activations), as every GPU provider does.
const NORMS: NormCapabilities =
    NormCapabilities { mixed_weight_dtype: true, dtype_rounding: true, ..NormCapabilities::DEFAULT };

/// Registers the `cpu` implementations of every built-in op.
pub fn register(registry: &Registry) -> Result<(), RegistryError> {
    let rms_spec = ImplSpec::new(PROVIDER).with_supports(rms_norm_support);
    rms_norm::register(registry, rms_spec, rms_norm_cpu)?;
    let fused_spec = ImplSpec::new(PROVIDER)
        .with_supports(|args| kernel_support::fused_add_rms_norm_support_with(args, DeviceKind::Cpu, NORMS));
    fused_add_rms_norm::register(registry, fused_spec, FusedAddRmsNormImpl::inplace(fused_add_rms_norm_cpu))?;
    silu_and_mul::register(registry, gated::spec(), |x| gated::run(x, gated::Silu))?;
    gelu_and_mul::register(registry, gated::spec(), |x, approximate| gated::run(x, gated::Gelu(approximate)))?;
    ir_ops::gelu_and_mul_sparse::register(registry, gated::spec(), |x, m, a| {
        gated::run(x, gated::SparseGelu { std_multiplier: m, approximate: a })
    })?;
    ir_ops::static_scaled_fp8_quant::register(registry, quant::spec(), quant::static_scaled_fp8_quant_cpu)?;
    ir_ops::dynamic_per_token_scaled_fp8_quant::register(
        registry,
        quant::spec(),
        quant::dynamic_per_token_scaled_fp8_quant_cpu,
    )?;
    // The norm + quantizations take every weight the norms take (their rows apply a weight of
    // another dtype as the norms do).
    let spec = |supports: fn(&[ir_core::op::ArgMeta<'_>], DeviceKind, NormCapabilities) -> ir_core::Support| {
        ImplSpec::new(PROVIDER).with_supports(move |args| supports(args, DeviceKind::Cpu, NORMS))
    };
    ir_ops::rms_norm_static_fp8_quant::register(
        registry,
        spec(kernel_support::rms_norm_static_fp8_quant_support_with),
        quant::rms_norm_static_fp8_quant_cpu,
    )?;
    ir_ops::rms_norm_dynamic_per_token_quant::register(
        registry,
        spec(kernel_support::rms_norm_dynamic_per_token_quant_support_with),
        quant::rms_norm_dynamic_per_token_quant_cpu,
    )?;
    ir_ops::fused_add_rms_norm_static_fp8_quant::register(
        registry,
        spec(kernel_support::fused_add_rms_norm_static_fp8_quant_support_with),
        ir_ops::fused_add_rms_norm_static_fp8_quant::Impl::inplace(quant::fused_add_rms_norm_static_fp8_quant_cpu),
    )?;
    ir_ops::fused_add_rms_norm_dynamic_per_token_quant::register(
        registry,
        spec(kernel_support::fused_add_rms_norm_dynamic_per_token_quant_support_with),
        ir_ops::fused_add_rms_norm_dynamic_per_token_quant::Impl::inplace(
            quant::fused_add_rms_norm_dynamic_per_token_quant_cpu,
        ),
    )?;
    rotary::register(registry)?;
    program::register_program_ops(registry)
}

/// The cpu `rms_norm`'s predicate: the standard one, and besides x of rows in blocks
/// ([`RowBlocks`]: the heads of a q or k column slice, which Qwen3 and Gemma 3 normalize) with what
/// the standard predicate takes of a compact x.
fn rms_norm_support(args: &[ArgMeta<'_>]) -> Support {
    let standard = |args: &[ArgMeta<'_>]| kernel_support::rms_norm_support_with(args, DeviceKind::Cpu, NORMS);
    match (standard(args), args.first()) {
        (Support::No(reason), Some(ArgMeta::Tensor(x))) if RowBlocks::of(x).is_ok() => {
            let compact = x.compact_like();
            let mut with_compact = args.to_vec();
            with_compact[0] = ArgMeta::Tensor(&compact);
            match standard(&with_compact) {
                Support::Yes => Support::Yes,
                Support::No(_) => Support::No(reason),
            }
        }
        (support, _) => support,
    }
}

/// `rms_norm` on the CPU: a fresh output with the layout the meta function declares.
pub fn rms_norm_cpu(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, KernelError> {
    // The kernel writes every element of its dense rows.
    let mut out = Tensor::empty_with_layout(x.dtype(), x.layout().copy_layout())?;
    rms_norm_cpu_into(x, weight, epsilon, variance_size, &mut out)?;
    Ok(out)
}

/// `rms_norm` on the CPU into a caller-owned output (an engine's preallocated buffer, a benchmark's
/// untimed allocation). `out` must have x's shape and dtype, be dense in its rows and uniquely owned.
pub fn rms_norm_cpu_into(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    reject_variance_size(variance_size)?;
    if out.dtype() != x.dtype() || out.shape() != x.shape() {
        return Err(OperandMismatch::error("out", out.meta(), "x", x.meta()));
    }
    let out_rows = Rows::for_kernel(out.meta())?;
    // x as rows of one stride, or (the heads of a column slice) as blocks of them, each block's
    // rows the output's next ones.
    let x_blocks = match Rows::of(x.meta()) {
        Ok(rows) => RowBlocks { rows, count: 1, stride: 0 },
        Err(reason) => {
            RowBlocks::of(x.meta()).map_err(|_| KernelError::InvalidArguments { reason: reason.into_owned() })?
        }
    };
    if x_blocks.count == 0 || x_blocks.rows.n_rows == 0 || x_blocks.rows.hidden == 0 {
        return Ok(());
    }
    let weight = RowWeight::of(weight, x.dtype())?;
    let x_buffer = x.cpu_buffer().ok_or_else(|| not_on_cpu("x"))?;
    let out_buffer = out.cpu_buffer_mut()?.ok_or_else(|| not_on_cpu("out"))?;
    let eps = epsilon as f32;
    let per_block = x_blocks.rows.n_rows;
    for index in 0..x_blocks.count {
        let x_rows = x_blocks.block(index);
        let out_rows =
            Rows { n_rows: per_block, offset: out_rows.offset + index * per_block * out_rows.row_stride, ..out_rows };
        match x.dtype() {
            DType::F32 => rows::rms_norm::<f32>(x_buffer, x_rows, out_buffer, out_rows, weight.typed(), eps),
            DType::F16 => rows::rms_norm::<half::f16>(x_buffer, x_rows, out_buffer, out_rows, weight.typed(), eps),
            DType::BF16 => rows::rms_norm::<half::bf16>(x_buffer, x_rows, out_buffer, out_rows, weight.typed(), eps),
            other => return Err(unsupported_dtype(other)),
        }
    }
    Ok(())
}

/// A norm's weight for the rows: in x's dtype straight from its storage, or of another dtype (a
/// Gemma-style f32 weight on bf16 activations) widened to f32 once per call.
pub(crate) enum RowWeight<'a> {
    None,
    Same(&'a ir_core::storage::CpuBuffer, std::ops::Range<usize>),
    Mixed { values: Vec<f32>, round: fn(&mut [f32]) },
}

impl<'a> RowWeight<'a> {
    pub(crate) fn of(weight: Option<&'a Tensor>, dtype: DType) -> Result<RowWeight<'a>, KernelError> {
        match weight {
            None => Ok(RowWeight::None),
            Some(w) if w.dtype() == dtype => {
                let buffer = w.cpu_buffer().ok_or_else(|| not_on_cpu("weight"))?;
                Ok(RowWeight::Same(buffer, w.offset()..w.offset() + w.numel()))
            }
            Some(w) => {
                let round: fn(&mut [f32]) = match w.dtype() {
                    DType::F32 => <f32 as CpuElement>::round_in_place,
                    DType::F16 => <half::f16 as CpuElement>::round_in_place,
                    DType::BF16 => <half::bf16 as CpuElement>::round_in_place,
                    other => return Err(unsupported_dtype(other)),
                };
                Ok(RowWeight::Mixed { values: weight_f32(weight)?.expect("a weight was given"), round })
            }
        }
    }

    /// The weight as rows of element type `T` (x's) read it.
    pub(crate) fn typed<T: CpuElement>(&self) -> rows::Weight<'_, T> {
        match self {
            RowWeight::None => rows::Weight::None,
            RowWeight::Same(buffer, range) => rows::Weight::Same(&buffer.typed::<T>()[range.clone()]),
            RowWeight::Mixed { values, round } => rows::Weight::Mixed(rows::MixedWeight { values, round: *round }),
        }
    }
}

/// `fused_add_rms_norm` on the CPU, in place: `residual ← x + residual` (rounded), `x ← norm(sum)`
/// (of the f32 sum, or with `dtype` rounding of the rounded one: the add, then the `rms_norm` row).
pub fn fused_add_rms_norm_cpu(
    mut x: UniqueTensor,
    mut residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    reject_variance_size(variance_size)?;
    let (dtype, x_rows, residual_rows) = residual_pair_rows(&x, &residual)?;
    let round_sum = rounding.rounds_intermediates(dtype);
    if x_rows.n_rows > 0 && x_rows.hidden > 0 {
        let weight = RowWeight::of(weight, dtype)?;
        let eps = epsilon as f32;
        let Storage::Cpu(x_buffer) = x.storage_mut()? else { return Err(not_on_cpu("x")) };
        let Storage::Cpu(residual_buffer) = residual.storage_mut()? else { return Err(not_on_cpu("x_residual")) };
        let (r_buffer, r_rows) = (residual_buffer, residual_rows);
        match dtype {
            DType::F32 => rows::fused::<f32>(x_buffer, x_rows, r_buffer, r_rows, weight.typed(), eps, round_sum),
            DType::F16 => rows::fused::<half::f16>(x_buffer, x_rows, r_buffer, r_rows, weight.typed(), eps, round_sum),
            DType::BF16 => {
                rows::fused::<half::bf16>(x_buffer, x_rows, r_buffer, r_rows, weight.typed(), eps, round_sum)
            }
            other => return Err(unsupported_dtype(other)),
        }
    }
    Ok((x.into_tensor(), residual.into_tensor()))
}

/// `fused_sandwich_rms_norm` on the CPU, in place: the cpu `rms_norm` and `fused_add_rms_norm`
/// rows composed per row (the unfused pair's bits), x and the residual read and written once, the
/// first norm's output kept in an L1-sized row of scratch. x and the residual are rows of one
/// stride of one dtype (the predicate's and the meta function's rules); each weight is of x's
/// dtype or another float dtype (Gemma's f32 `1 + w`).
pub fn fused_sandwich_rms_norm_cpu(
    mut x: UniqueTensor,
    mut residual: UniqueTensor,
    post_weight: Option<&Tensor>,
    pre_weight: Option<&Tensor>,
    epsilon: f64,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let (dtype, x_rows, residual_rows) = residual_pair_rows(&x, &residual)?;
    let round_sum = rounding.rounds_intermediates(dtype);
    if x_rows.n_rows > 0 && x_rows.hidden > 0 {
        let (post, pre) = (RowWeight::of(post_weight, dtype)?, RowWeight::of(pre_weight, dtype)?);
        let eps = epsilon as f32;
        let Storage::Cpu(x_buffer) = x.storage_mut()? else { return Err(not_on_cpu("x")) };
        let Storage::Cpu(r_buffer) = residual.storage_mut()? else { return Err(not_on_cpu("x_residual")) };
        let (r_rows, round) = (residual_rows, round_sum);
        match dtype {
            DType::F32 => rows::sandwich::<f32>(x_buffer, x_rows, r_buffer, r_rows, &post, &pre, eps, round),
            DType::F16 => rows::sandwich::<half::f16>(x_buffer, x_rows, r_buffer, r_rows, &post, &pre, eps, round),
            DType::BF16 => rows::sandwich::<half::bf16>(x_buffer, x_rows, r_buffer, r_rows, &post, &pre, eps, round),
            other => return Err(unsupported_dtype(other)),
        }
    }
    Ok((x.into_tensor(), residual.into_tensor()))
}

/// x's dtype and the rows of x and of the residual of a fused-add kernel, which share x's dtype and
/// shape.
fn residual_pair_rows(x: &UniqueTensor, residual: &UniqueTensor) -> Result<(DType, Rows, Rows), KernelError> {
    let (x, residual) = (x.tensor(), residual.tensor());
    if residual.dtype() != x.dtype() || residual.shape() != x.shape() {
        return Err(OperandMismatch::error("x_residual", residual.meta(), "x", x.meta()));
    }
    Ok((x.dtype(), Rows::for_kernel(x.meta())?, Rows::for_kernel(residual.meta())?))
}

/// The weight converted to f32 once per call.
pub(crate) fn weight_f32(weight: Option<&Tensor>) -> Result<Option<Vec<f32>>, KernelError> {
    let Some(weight) = weight else { return Ok(None) };
    let buffer = weight.cpu_buffer().ok_or_else(|| not_on_cpu("weight"))?;
    let range = weight.offset()..weight.offset() + weight.numel();
    // Converted into a vector that is written once (no zero fill first).
    let out = match weight.dtype() {
        DType::F32 => buffer.typed::<f32>()[range].to_vec(),
        DType::F16 => half::slice::HalfFloatSliceExt::to_f32_vec(&buffer.typed::<half::f16>()[range]),
        DType::BF16 => half::slice::HalfFloatSliceExt::to_f32_vec(&buffer.typed::<half::bf16>()[range]),
        other => return Err(unsupported_dtype(other)),
    };
    Ok(Some(out))
}

pub(crate) fn not_on_cpu(param: &str) -> KernelError {
    KernelError::WrongMemory { param: param.to_owned(), memory: "host" }
}

pub(crate) fn unsupported_dtype(dtype: DType) -> KernelError {
    KernelError::UnsupportedDType { backend: "cpu", dtype }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::TensorMeta;

    /// Qwen3's and Gemma 3's head norms: the heads of q, a column slice of a merged qkv buffer
    /// viewed `[tokens, heads, head_dim]`, are rows in blocks. The predicate takes them (the
    /// registry then runs the kernel, not native) and the kernel gives the bits of the same rows
    /// made compact, in every dtype, with a weight of x's dtype or f32.
    #[test]
    fn rms_norm_runs_on_the_heads_of_a_column_slice() {
        let registry = ir_ops::registry();
        register(&registry).unwrap();
        let _cpu = registry.override_priority("rms_norm", &[PROVIDER, "native"]).unwrap();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for weight_dtype in [dtype, DType::F32] {
                let (tokens, heads, head_dim, width) = (5, 4, 32, 4 * 32 + 2 * 2 * 32);
                let qkv = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, width]), 3).unwrap();
                let layout = qkv.layout().slice(1, 0, heads * head_dim).unwrap().reshape(&[tokens, heads, head_dim]);
                let q_heads = qkv.as_strided(layout.unwrap()).unwrap();
                assert!(Rows::of(q_heads.meta()).is_err() && RowBlocks::of(q_heads.meta()).is_ok());
                let weight = Tensor::randn(&TensorMeta::compact(weight_dtype, &[head_dim]), 4).unwrap();
                let metas = [
                    ArgMeta::Tensor(q_heads.meta()),
                    ArgMeta::Tensor(weight.meta()),
                    ArgMeta::F64(1e-6),
                    ArgMeta::None,
                ];
                assert_eq!(rms_norm_support(&metas), Support::Yes, "{dtype} weight {weight_dtype}");
                let ours = rms_norm_cpu(&q_heads, Some(&weight), 1e-6, None).unwrap();
                let compact = rms_norm_cpu(&q_heads.contiguous().unwrap(), Some(&weight), 1e-6, None).unwrap();
                assert!(ir_core::bit_eq(&ours, &compact), "{dtype} weight {weight_dtype}");
                let before = registry.selection_record();
                let ctx = ir_core::EagerContext::new(&registry);
                let dispatched = rms_norm::call(&ctx, &q_heads, Some(&weight), 1e-6, None).unwrap();
                let step = registry.selection_record().since(&before);
                assert_eq!((step.selections("rms_norm", PROVIDER), step.native_fallbacks()), (1, 0));
                assert!(ir_core::bit_eq(&dispatched, &compact));
            }
        }
        // Leading dimensions of more than one stride are not blocks (the predicate refuses them).
        let t = Tensor::randn(&TensorMeta::compact(DType::F32, &[4, 6, 8]), 1).unwrap();
        let odd = t.as_strided(t.layout().transpose(0, 1).unwrap().reshape(&[2, 3, 4, 1, 8]).unwrap()).unwrap();
        assert!(RowBlocks::of(odd.meta()).is_err(), "{:?}", odd.layout());
        let metas = [ArgMeta::Tensor(odd.meta()), ArgMeta::None, ArgMeta::F64(1e-6), ArgMeta::None];
        assert!(matches!(rms_norm_support(&metas), Support::No(_)));
    }

    #[test]
    fn rms_norm_into_writes_what_the_functional_kernel_returns() {
        let x = Tensor::randn(&TensorMeta::compact(DType::BF16, &[3, 96]), 7).unwrap();
        let weight = Tensor::randn(&TensorMeta::compact(DType::BF16, &[96]), 8).unwrap();
        let expected = rms_norm_cpu(&x, Some(&weight), 1e-6, None).unwrap();
        let mut out = Tensor::zeros(DType::BF16, &[3, 96]).unwrap();
        rms_norm_cpu_into(&x, Some(&weight), 1e-6, None, &mut out).unwrap();
        assert!(ir_core::bit_eq(&out, &expected));
    }

    #[test]
    fn refusals_name_their_case() {
        let x = Tensor::zeros(DType::F64, &[2, 8]).unwrap();
        let error = rms_norm_cpu(&x, None, 1e-6, None).unwrap_err();
        assert!(matches!(error, KernelError::UnsupportedDType { backend: "cpu", dtype: DType::F64 }), "{error}");
        assert_eq!(error.to_string(), "invalid arguments: the cpu kernels do not compute in f64");
        let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        let scale = Tensor::from_f32(DType::F32, &[1], &[0.5]).unwrap();
        let error =
            crate::quant::static_scaled_fp8_quant_cpu(&x, &scale, DType::BF16, ir_ops::Rounding::Exact).unwrap_err();
        assert!(matches!(error, KernelError::NotFp8 { dtype: DType::BF16 }), "{error}");
    }

    #[test]
    fn rms_norm_into_rejects_an_output_of_another_shape_or_dtype() {
        let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        for mut out in [Tensor::zeros(DType::F32, &[2, 4]).unwrap(), Tensor::zeros(DType::BF16, &[2, 8]).unwrap()] {
            let err = rms_norm_cpu_into(&x, None, 1e-6, None, &mut out).unwrap_err();
            assert!(err.to_string().contains("`out` is"), "{err}");
        }
        let mut shared = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        let _other_handle = shared.clone();
        assert!(rms_norm_cpu_into(&x, None, 1e-6, None, &mut shared).is_err(), "a shared output is never written");
    }
}
