//! Kernel variants and their symbol names in the code object.

use ir_core::DType;
pub use ir_core::kernel::NormOp;

/// One kernel of the code object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelVariant {
    /// The kernel.
    pub op: NormOp,
    /// Element type (f32, f16 or bf16).
    pub dtype: DType,
    /// Whether a weight is applied.
    pub has_weight: bool,
    /// Whether 16-byte accesses are used (same bits as scalar accesses).
    pub vectorized: bool,
    /// Threads cooperating on one row.
    pub threads_per_row: u32,
}

/// Threads per row the code object holds kernels for.
pub const THREADS_PER_ROW: [u32; 6] = [8, 16, 32, 64, 128, 256];

impl KernelVariant {
    /// The symbol: `<op>_<dtype>_w<0|1>_v<width>_t<threads per row>`.
    pub fn symbol(&self) -> String {
        let op = self.op.name();
        let width = if self.vectorized { 16 / self.dtype.size_in_bytes() } else { 1 };
        format!("{op}_{}_w{}_v{width}_t{}", self.dtype, u8::from(self.has_weight), self.threads_per_row)
    }

    /// Threads per block: 128, or 256 for 256 threads per row.
    pub fn block_size(&self) -> u32 {
        if self.threads_per_row > 128 { 256 } else { 128 }
    }
}

/// Every kernel the code object must contain.
pub fn all_variants() -> Vec<KernelVariant> {
    let mut variants = Vec::new();
    for op in [NormOp::RmsNorm, NormOp::FusedAddRmsNorm] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for has_weight in [false, true] {
                for vectorized in [false, true] {
                    for threads_per_row in THREADS_PER_ROW {
                        variants.push(KernelVariant { op, dtype, has_weight, vectorized, threads_per_row });
                    }
                }
            }
        }
    }
    variants
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols() {
        let v = KernelVariant {
            op: NormOp::FusedAddRmsNorm,
            dtype: DType::BF16,
            has_weight: true,
            vectorized: true,
            threads_per_row: 32,
        };
        assert_eq!(v.symbol(), "fused_add_rms_norm_bf16_w1_v8_t32");
        assert_eq!(all_variants().len(), 144);
    }
}
