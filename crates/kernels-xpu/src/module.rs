//! Kernel variants, build options and the host-side choice of the reduction.

use std::fmt;

use ir_core::{DType, KernelError};
use kernel_support::KernelDTypes;
pub use kernel_support::NormOp;

/// The element-type prelude every kernel source is built after.
pub const ELEMENT: &str = include_str!("../kernels/element.cl");

/// The norm kernels' source as it is built (the element prelude, then `kernels/rms_norm.cl`).
pub const SOURCE: &str = concat!(include_str!("../kernels/element.cl"), "\n", include_str!("../kernels/rms_norm.cl"));

/// One built form of the kernel source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelVariant {
    /// The kernel.
    pub op: NormOp,
    /// Element type (f32, f16, bf16, or f64 on a device with `cl_khr_fp64`).
    pub dtype: DType,
    /// The weight's dtype when a weight is applied (it may differ from `dtype`; one of the same).
    pub weight: Option<DType>,
    /// Work-items per row.
    pub threads_per_row: u32,
    /// Whether the reduction uses sub-group collectives (else a local-memory tree).
    pub subgroups: bool,
}

/// Elements of a row each work-item keeps in registers between the kernels' two passes (`CACHE` in
/// `rms_norm.cl`).
pub const CACHED_PER_WORK_ITEM: usize = 32;

/// Work-item counts per row the kernels are built for.
pub const THREADS_PER_ROW: [u32; 7] = [8, 32, 64, 128, 256, 512, 1024];

/// Work-items per row, from the hidden size and the device's largest work-group: the fewest (8, with
/// 16 rows per group, up to H = 256; then 32 up to 1024, and doubling) that keep the whole row in
/// their registers ([`CACHED_PER_WORK_ITEM`] each: H = 32 × the work-items, so up to 32768 with
/// 1024), within `max_group_size` (a device with smaller work-groups reads the rest of a longer row
/// twice).
pub fn threads_per_row(hidden: usize, max_group_size: usize) -> u32 {
    let fits = |threads: &u32| hidden <= CACHED_PER_WORK_ITEM * *threads as usize;
    let allowed = |threads: &u32| group_size(*threads) as usize <= max_group_size;
    let mut candidates = THREADS_PER_ROW.into_iter().filter(allowed);
    let smallest = candidates.clone().next().unwrap_or(THREADS_PER_ROW[0]);
    candidates.clone().find(fits).or_else(|| candidates.next_back()).unwrap_or(smallest)
}

/// Work-group size for a number of work-items per row.
pub fn group_size(threads_per_row: u32) -> u32 {
    threads_per_row.max(128)
}

/// Whether to reduce with sub-groups: the device has them, the caller did not force the tree, and
/// no sub-group can span two rows: the largest sub-group size the device may choose
/// (`max_sub_group_size`, known on Intel devices) divides the work-items per row (sizes are powers of
/// two). A device that cannot say (only `cl_khr_subgroups`, whose sub-groups may be 64 wide) uses
/// the local-memory tree.
pub fn use_subgroups(
    device_extensions: &str,
    max_sub_group_size: Option<u32>,
    threads_per_row: u32,
    force_tree: bool,
) -> bool {
    let has_subgroups = device_extensions
        .split_whitespace()
        .any(|extension| extension == "cl_khr_subgroups" || extension == "cl_intel_subgroups");
    let fits = max_sub_group_size.is_some_and(|size| threads_per_row.is_multiple_of(size));
    has_subgroups && !force_tree && threads_per_row >= 32 && fits
}

impl KernelVariant {
    /// The kernel's symbol: `<op>_<dtype>`.
    pub fn kernel_name(&self) -> String {
        let op = self.op.name();
        format!("{op}_{}", self.dtype)
    }

    /// Rows one work-group handles.
    pub fn rows_per_group(&self) -> u32 {
        group_size(self.threads_per_row) / self.threads_per_row
    }

    /// `clBuildProgram` options for this variant (no fast-math options).
    pub fn build_options(&self) -> Result<String, KernelError> {
        Ok(format!(
            "{} -DHAS_WEIGHT={} -DWDTYPE={} -DTHREADS_PER_ROW={} -DROWS_PER_GROUP={} -DUSE_SUBGROUPS={}",
            base_options(self.dtype)?,
            u8::from(self.weight.is_some()),
            dtype_code(self.weight.unwrap_or(self.dtype))?,
            self.threads_per_row,
            self.rows_per_group(),
            u8::from(self.subgroups)
        ))
    }
}

/// The build options every program of a dtype gets (no fast-math options).
pub(crate) fn base_options(dtype: DType) -> Result<String, KernelError> {
    Ok(format!("-cl-std=CL1.2 -cl-fp32-correctly-rounded-divide-sqrt -DDTYPE={}", dtype_code(dtype)?))
}

/// The code the element prelude knows a dtype by (`DTYPE`, `WDTYPE`).
fn dtype_code(dtype: DType) -> Result<u8, KernelError> {
    kernel_support::compute_dtype_code(dtype, "xpu")
}

impl fmt::Display for KernelVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}[weight={}, threads_per_row={}, subgroups={}]",
            self.kernel_name(),
            self.weight.map_or_else(|| "none".to_owned(), |w| w.to_string()),
            self.threads_per_row,
            self.subgroups
        )
    }
}

/// Every variant with the given reduction on elements and weights of `dtypes`: without a weight and
/// with one of each dtype (a weight of another dtype than x at two row widths only: its code differs
/// from the same-dtype form only in the weight step).
pub fn all_variants(subgroups: bool, dtypes: KernelDTypes) -> Vec<KernelVariant> {
    let dtypes: Vec<DType> =
        [DType::F32, DType::F16, DType::BF16, DType::F64].into_iter().filter(|&d| dtypes.contains(d)).collect();
    let mut variants = Vec::new();
    for op in [NormOp::RmsNorm, NormOp::FusedAddRmsNorm] {
        for &dtype in &dtypes {
            for weight in std::iter::once(None).chain(dtypes.iter().copied().map(Some)) {
                for threads_per_row in THREADS_PER_ROW {
                    let mixed = weight.is_some_and(|w| w != dtype);
                    if (subgroups && threads_per_row < 32) || (mixed && !matches!(threads_per_row, 32 | 1024)) {
                        continue;
                    }
                    variants.push(KernelVariant { op, dtype, weight, threads_per_row, subgroups });
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
    fn reduction_choice() {
        let intel = "cl_khr_fp16 cl_intel_subgroups";
        assert!(use_subgroups(intel, Some(32), 64, false));
        assert!(use_subgroups("cl_khr_subgroups", Some(16), 32, false));
        assert!(!use_subgroups("cl_khr_subgroups", Some(16), 32, true), "forced tree");
        assert!(!use_subgroups("cl_khr_subgroups", Some(8), 8, false), "8 work-items per row use the tree");
        assert!(!use_subgroups(intel, Some(64), 32, false), "a 64-wide sub-group would span two rows");
        assert!(!use_subgroups("cl_khr_subgroups", None, 128, false), "an unknown sub-group size");
        assert!(!use_subgroups("cl_khr_fp64 cl_khr_byte_addressable_store", Some(8), 128, false), "PoCL on a CPU");
        assert!(!use_subgroups("cl_intel_subgroups_short", Some(16), 128, false), "only whole extension names count");
    }

    #[test]
    fn geometry_from_hidden_size() {
        assert_eq!((threads_per_row(64, 1024), group_size(8)), (8, 128));
        let small = KernelVariant {
            op: NormOp::RmsNorm,
            dtype: DType::BF16,
            weight: Some(DType::F32),
            threads_per_row: 8,
            subgroups: false,
        };
        assert_eq!(small.rows_per_group(), 16, "16 rows per work-group for small rows");
        // The whole row in registers: 32 elements a work-item.
        for (hidden, threads) in
            [(1, 8), (256, 8), (257, 32), (1024, 32), (2048, 64), (4096, 128), (8199, 512), (32768, 1024)]
        {
            assert_eq!(threads_per_row(hidden, 1024), threads, "H {hidden}");
            assert!(hidden <= CACHED_PER_WORK_ITEM * threads as usize);
        }
        // A device with smaller work-groups takes its largest; longer rows read the rest twice.
        assert_eq!(threads_per_row(32768, 256), 256);
        assert_eq!(threads_per_row(1 << 20, 1024), 1024);
        assert_eq!(threads_per_row(100, 64), 8, "the smallest group (128) even where the device says less");
        assert_eq!((threads_per_row(64, 1024), group_size(1024)), (8, 1024));
        assert!(small.build_options().unwrap().contains("-DROWS_PER_GROUP=16"));
        let options = small.build_options().unwrap();
        assert!(options.contains("-DDTYPE=2") && options.contains("-DWDTYPE=0"), "bf16 x, f32 weight: {options}");
        let unweighted = KernelVariant { weight: None, ..small }.build_options().unwrap();
        assert!(unweighted.contains("-DHAS_WEIGHT=0") && unweighted.contains("-DWDTYPE=2"), "{unweighted}");
        assert!(!small.build_options().unwrap().contains("fast-relaxed-math"));
    }
}
