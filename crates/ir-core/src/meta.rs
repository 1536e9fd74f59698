//! Per-tensor metadata: dtype, device and layout.

use std::fmt;

use crate::{DType, Device, Layout};

/// The largest byte extent of a tensor: Rust allocations and pointer offsets are bounded by
/// `isize::MAX` bytes, so the verifier, the parser and every tensor constructor reject larger ones.
pub const MAX_TENSOR_BYTES: usize = isize::MAX as usize;

/// The metadata of a tensor or graph value (the "fake tensor"): all a `supports` predicate sees.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Where the storage lives.
    pub device: Device,
    /// Shape, strides and offset.
    pub layout: Layout,
}

impl TensorMeta {
    /// Metadata of a compact CPU tensor.
    pub fn compact(dtype: DType, shape: &[usize]) -> TensorMeta {
        TensorMeta { dtype, device: Device::Cpu, layout: Layout::compact(shape) }
    }

    /// The metadata of a compact copy of this tensor: its dtype, shape and device, compact at offset 0.
    pub fn compact_like(&self) -> TensorMeta {
        TensorMeta { device: self.device, ..TensorMeta::compact(self.dtype, self.shape()) }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Bytes needed to hold the elements this metadata reaches (offset included), or `None` when that
    /// exceeds [`MAX_TENSOR_BYTES`] (computed with checked arithmetic, so it never wraps).
    pub fn storage_bytes(&self) -> Option<usize> {
        self.layout.storage_end().checked_mul(self.dtype.size_in_bytes()).filter(|&bytes| bytes <= MAX_TENSOR_BYTES)
    }

    /// Whether dtype, device and shape match (the layout may differ).
    #[inline]
    pub fn same_kind_and_shape(&self, other: &TensorMeta) -> bool {
        self.dtype == other.dtype && self.device == other.device && crate::layout::dims_eq(self.shape(), other.shape())
    }
}

impl fmt::Display for TensorMeta {
    /// Prints the text-format type: `bf16[8,16]{16,1}+5@cuda:0` (compact strides, offset 0 and `@cpu` omitted).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.layout)?;
        if !self.device.is_cpu() {
            write!(f, "@{}", self.device)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display() {
        let meta = TensorMeta {
            dtype: DType::BF16,
            device: Device::Cuda(0),
            layout: Layout::new(&[8, 8], &[16, 1], 5).unwrap(),
        };
        assert_eq!(meta.to_string(), "bf16[8,8]{16,1}+5@cuda:0");
        assert_eq!(TensorMeta::compact(DType::F32, &[2, 3]).to_string(), "f32[2,3]");
    }
}
