//! Kernel variants and their symbol names in the code object.

use ir_core::DType;
pub use kernel_support::NormOp;

/// One kernel of the code object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelVariant {
    /// The kernel.
    pub op: NormOp,
    /// Element type (f32, f16, bf16 or f64).
    pub dtype: DType,
    /// The weight's dtype when a weight is applied (it may differ from `dtype`; one of the same).
    pub weight: Option<DType>,
    /// Whether 16-byte accesses are used (same bits as scalar accesses).
    pub vectorized: bool,
    /// Threads cooperating on one row.
    pub threads_per_row: u32,
}

/// Threads per row the code object holds kernels for.
pub const THREADS_PER_ROW: [u32; 6] = [8, 16, 32, 64, 128, 256];

impl KernelVariant {
    /// The symbol: `<op>_<dtype>_w<weight>_v<width>_t<threads per row>`, the weight `0` (none), `1`
    /// (of x's dtype) or its dtype (another one).
    pub fn symbol(&self) -> String {
        let op = self.op.name();
        let width = if self.vectorized { 16 / self.dtype.size_in_bytes() } else { 1 };
        let weight = match self.weight {
            None => "0".to_owned(),
            Some(w) if w == self.dtype => "1".to_owned(),
            Some(w) => w.to_string(),
        };
        format!("{op}_{}_w{weight}_v{width}_t{}", self.dtype, self.threads_per_row)
    }

    /// Threads per block: 128, or 256 for 256 threads per row.
    pub fn block_size(&self) -> u32 {
        if self.threads_per_row > 128 { 256 } else { 128 }
    }
}

/// Threads per row the code object holds kernels with a weight of another dtype than x for: every
/// width, so such a row (Gemma's f32 weight on bf16 activations) launches at the width of its own
/// hidden size and keeps its cached chunks in registers.
pub const MIXED_WEIGHT_THREADS_PER_ROW: [u32; 6] = THREADS_PER_ROW;

/// Threads per row of the kernels mixing f64 (a reference dtype) with another dtype (x f64 and a
/// weight of another dtype, or an f64 weight on other elements): one width.
pub const F64_MIXED_THREADS_PER_ROW: u32 = 32;

pub use kernel_support::gpu::norm_vectorizes as vectorizes;

/// The kernel a norm launch takes and its block shape: the variant of the key at the row width
/// [`launch_threads_per_row`] gives, in blocks of [`KernelVariant::block_size`]. Used by the
/// runtimes that launch (the HIP one and the emulated one).
#[cfg(any(feature = "rocm", feature = "emu"))]
pub(crate) fn norm_launch(key: &kernel_support::gpu::NormKey) -> (KernelVariant, kernel_support::gpu::NormShape) {
    let threads_per_row = launch_threads_per_row(key.hidden, key.dtype, key.weight);
    let variant =
        KernelVariant { op: key.op, dtype: key.dtype, weight: key.weight, vectorized: key.vectorized, threads_per_row };
    let group_size = variant.block_size();
    (variant, kernel_support::gpu::NormShape { group_size, rows_per_group: group_size / threads_per_row })
}

/// Every kernel the code object must contain: without a weight and with one of x's dtype at every
/// row width, and with a weight of each other dtype at [`MIXED_WEIGHT_THREADS_PER_ROW`] (at
/// [`F64_MIXED_THREADS_PER_ROW`] when either side is f64); f64 rows with scalar accesses only.
pub fn all_variants() -> Vec<KernelVariant> {
    const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];
    let mut variants = Vec::new();
    for op in [NormOp::RmsNorm, NormOp::FusedAddRmsNorm] {
        for dtype in DTYPES {
            for weight in std::iter::once(None).chain(DTYPES.map(Some)) {
                for vectorized in [false, true] {
                    for threads_per_row in THREADS_PER_ROW {
                        let widths: &[u32] = match weight.filter(|&w| w != dtype) {
                            None => &THREADS_PER_ROW,
                            Some(w) if w == DType::F64 || dtype == DType::F64 => &[F64_MIXED_THREADS_PER_ROW],
                            Some(_) => &MIXED_WEIGHT_THREADS_PER_ROW,
                        };
                        if !widths.contains(&threads_per_row) || (vectorized && !vectorizes(dtype)) {
                            continue;
                        }
                        variants.push(KernelVariant { op, dtype, weight, vectorized, threads_per_row });
                    }
                }
            }
        }
    }
    variants
}

/// The row width a launch uses: the hidden size's ([`MIXED_WEIGHT_THREADS_PER_ROW`] holds every
/// width for a weight of another dtype), or [`F64_MIXED_THREADS_PER_ROW`] when x or a weight of
/// another dtype is f64 (a reference dtype, whose mixed kernels exist at one width).
pub fn launch_threads_per_row(hidden: usize, dtype: DType, weight: Option<DType>) -> u32 {
    let threads = kernel_support::gpu_threads_per_row(hidden);
    match weight.filter(|&w| w != dtype) {
        Some(weight) if dtype == DType::F64 || weight == DType::F64 => F64_MIXED_THREADS_PER_ROW,
        _ => threads,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols() {
        let v = KernelVariant {
            op: NormOp::FusedAddRmsNorm,
            dtype: DType::BF16,
            weight: Some(DType::BF16),
            vectorized: true,
            threads_per_row: 32,
        };
        assert_eq!(v.symbol(), "fused_add_rms_norm_bf16_w1_v8_t32");
        let mixed = KernelVariant { weight: Some(DType::F32), ..v };
        assert_eq!(mixed.symbol(), "fused_add_rms_norm_bf16_wf32_v8_t32");
        assert_eq!(KernelVariant { weight: None, ..v }.symbol(), "fused_add_rms_norm_bf16_w0_v8_t32");
        // f32/f16/bf16 with no weight or one of x's dtype, and with each other weight, at every width
        // and both access widths; f64 with scalar accesses: no weight or an f64 one at every width,
        // and at one width x f64 with each other weight and each other x with an f64 weight (both
        // access widths).
        assert_eq!(all_variants().len(), 144 + 2 * 3 * 2 * 2 * 6 + 2 * 2 * 6 + 2 * 3 + 2 * 3 * 2);
        // Every launch finds its kernel: mixed weights use the widths the code object has.
        let variants = all_variants();
        let dtypes = [DType::F32, DType::F16, DType::BF16, DType::F64];
        for hidden in [1, 64, 65, 3072, 3073, 6144, 6145, 16384, 16385, 1 << 20] {
            for dtype in dtypes {
                for weight in std::iter::once(None).chain(dtypes.map(Some)) {
                    let threads_per_row = launch_threads_per_row(hidden, dtype, weight);
                    let variant =
                        KernelVariant { op: NormOp::RmsNorm, dtype, weight, vectorized: false, threads_per_row };
                    assert!(variants.contains(&variant), "H {hidden}: {}", variant.symbol());
                }
            }
            assert_eq!(launch_threads_per_row(hidden, DType::BF16, None), kernel_support::gpu_threads_per_row(hidden));
            // Gemma's f32 weight on bf16 rows: the hidden size's own width (its chunks cached).
            let gemma = launch_threads_per_row(hidden, DType::BF16, Some(DType::F32));
            assert_eq!(gemma, kernel_support::gpu_threads_per_row(hidden));
        }
        let f64_weight = KernelVariant { weight: Some(DType::F64), ..v };
        assert_eq!(f64_weight.symbol(), "fused_add_rms_norm_bf16_wf64_v8_t32");
    }
}
