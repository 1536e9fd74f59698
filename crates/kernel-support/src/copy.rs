//! The strided-copy pieces: the device kernels' tables (copy, conversion, binary operation), the
//! conversion factors, and `CopyDims`, a strided copy cut into pieces a kernel of bounded rank takes.

use ir_core::{DType, KernelError, OperandMismatch, TensorMeta};

use crate::{kernel_int, out_of_range};

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
