//! The strided copies, conversions and `add`/`mul` of device buffers.

use ir_core::storage::{BinaryOp, DeviceBuffer, DeviceError, copy_strided_through_host};
use ir_core::{DType, KernelError, Layout, TensorMeta};

use super::{GpuRuntime, Grid, KernelArgs, Scalar, base_aligned};
use crate::{BINARY_KERNELS, CONVERT_KERNELS, ConvertFactor, CopyDims, WIDE_COPY_BYTES};

/// Which strided kernel a copy, conversion or `add`/`mul` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StridedKey {
    /// `strided_copy_<bytes>` for elements of this many bytes (moved as unsigned integers of the
    /// size, so any dtype), or of [`WIDE_COPY_BYTES`] for the 16-byte units of a copy whose rows
    /// allow it ([`CopyDims::widened`]).
    Copy {
        /// Bytes per element: 1, 2, 4, 8, or 16.
        element_size: usize,
    },
    /// `strided_convert_<src>_<dst>` (one of [`CONVERT_KERNELS`]).
    Convert {
        /// The source dtype.
        src: DType,
        /// The destination dtype.
        dst: DType,
    },
    /// `strided_<op>_<dtype>` (one of [`BINARY_KERNELS`]).
    Binary {
        /// The operands' dtype.
        dtype: DType,
        /// `add` or `mul`.
        op: BinaryOp,
    },
}

impl StridedKey {
    /// The kernel's symbol in the CUDA and HIP programs: `strided_copy_<bytes>`, the
    /// [`CONVERT_KERNELS`] or [`BINARY_KERNELS`] entry; `None` for a pair or dtype no kernel takes.
    pub fn symbol(&self) -> Option<&'static str> {
        match *self {
            StridedKey::Copy { element_size } => {
                COPY_SYMBOLS.iter().find(|(bytes, _)| *bytes == element_size).map(|(_, name)| *name)
            }
            StridedKey::Convert { src, dst } => {
                CONVERT_KERNELS.iter().find(|(s, d, _)| *s == src && *d == dst).map(|(_, _, name)| *name)
            }
            StridedKey::Binary { dtype, op } => {
                BINARY_KERNELS.iter().find(|(d, o, _)| *d == dtype && *o == op).map(|(_, _, name)| *name)
            }
        }
    }
}

/// The strided copy kernels by element size.
const COPY_SYMBOLS: [(usize, &str); 5] = [
    (1, "strided_copy_1"),
    (2, "strided_copy_2"),
    (4, "strided_copy_4"),
    (8, "strided_copy_8"),
    (WIDE_COPY_BYTES, "strided_copy_16"),
];

/// A [`DeviceError`] of `buffer`'s device for `operation`.
fn device_error(buffer: &impl DeviceBuffer, operation: &'static str, error: KernelError) -> DeviceError {
    DeviceError { device: buffer.device(), operation, message: error.to_string() }
}

/// [`DeviceBuffer::copy_strided`] of a backend: on the device when `dst` is memory of `from`'s
/// device (one launch per [`CopyDims::pieces`], so any rank), through the host otherwise. The
/// kernel is `strided_copy_<bytes>(const T* src, T* dst, long long n, int rank, Dims8 shape, Dims8
/// src_strides, Dims8 dst_strides)`.
pub fn copy_strided<R: GpuRuntime>(
    from: &R::Buffer,
    src: &TensorMeta,
    dst: &mut dyn DeviceBuffer,
    dst_layout: &Layout,
) -> Result<(), DeviceError> {
    match dst.as_any_mut().downcast_mut::<R::Buffer>().filter(|to| R::same_device(from, to)) {
        Some(to) => {
            let key = StridedKey::Copy { element_size: src.dtype.size_in_bytes() };
            let done = strided::<R>(from, src, to, dst_layout, src.dtype, key, None)
                .map_err(|e| device_error(from, "copy", e))?;
            if done {
                return Ok(());
            }
            copy_strided_through_host(from, src, to, dst_layout)
        }
        None => copy_strided_through_host(from, src, dst, dst_layout),
    }
}

/// [`DeviceBuffer::convert_strided`] of a backend: on the device when `dst` is memory of `from`'s
/// device and the backend converts the pair there; `false` (nothing written) otherwise. The kernel
/// is `strided_convert_<src>_<dst>(const S* src, D* dst, long long n, int rank, Dims8 shape, Dims8
/// src_strides, Dims8 dst_strides, C factor, int scaled)`, C the source's compute type
/// ([`ConvertFactor`]).
pub fn convert_strided<R: GpuRuntime>(
    from: &R::Buffer,
    src: &TensorMeta,
    dst: &mut dyn DeviceBuffer,
    dst_meta: &TensorMeta,
    factor: Option<f64>,
) -> Result<bool, DeviceError> {
    let Some(to) = dst.as_any_mut().downcast_mut::<R::Buffer>().filter(|to| R::same_device(from, to)) else {
        return Ok(false);
    };
    let key = StridedKey::Convert { src: src.dtype, dst: dst_meta.dtype };
    let scale = (ConvertFactor::for_source(src.dtype, factor), i32::from(factor.is_some()));
    strided::<R>(from, src, to, &dst_meta.layout, dst_meta.dtype, key, Some(scale))
        .map_err(|e| device_error(from, "convert", e))
}

/// [`DeviceBuffer::binary_strided`] of a backend: on the device when `other` and `dst` are memory
/// of `from`'s device and `dst` is compact; `false` (nothing written) otherwise. The kernel is
/// `strided_<op>_<dtype>(const T* a, const T* b, T* dst, long long n, int rank, Dims8 shape, Dims8
/// a_strides, Dims8 b_strides)`, writing element i of the row-major order at `dst[i]`.
pub fn binary_strided<R: GpuRuntime>(
    from: &R::Buffer,
    a: &TensorMeta,
    other: &dyn DeviceBuffer,
    b: &TensorMeta,
    op: BinaryOp,
    dst: &mut dyn DeviceBuffer,
    dst_meta: &TensorMeta,
) -> Result<bool, DeviceError> {
    let Some(other) = other.as_any().downcast_ref::<R::Buffer>().filter(|o| R::same_device(from, o)) else {
        return Ok(false);
    };
    let Some(to) = dst.as_any_mut().downcast_mut::<R::Buffer>().filter(|to| R::same_device(from, to)) else {
        return Ok(false);
    };
    if !dst_meta.layout.is_compact_at_zero() {
        return Ok(false);
    }
    let mut run = || -> Result<bool, KernelError> {
        let Some(kernel) = R::strided_kernel(from, StridedKey::Binary { dtype: a.dtype, op })? else {
            return Ok(false);
        };
        if a.numel() == 0 {
            return Ok(true);
        }
        let queue = R::buffer_queue(from);
        // a's strides as the source's, b's as the destination's: the kernel walks both.
        for piece in CopyDims::pieces(a, &b.layout)? {
            let [a_offset, b_offset, first] = piece.element_offsets()?;
            let mut args = KernelArgs::new();
            args.read(from, a_offset, a.dtype).read(other, b_offset, a.dtype).write(to, first, a.dtype);
            args.long(piece.n).int(piece.rank).dims(piece.shape).dims(piece.src_strides).dims(piece.dst_strides);
            // SAFETY: the arguments follow the prototype above, each integer converted without loss
            // (`CopyDims::pieces`); the kernel is the one for this dtype and operation. Every element
            // the piece describes is one `a` and `b` describe, in `from` and `other` (their layouts
            // were checked against their storages); `to` (borrowed mutably, so distinct from both)
            // holds the compact elements, of which the piece writes those from `first` on.
            unsafe { R::launch(&queue, &kernel, copy_grid::<R>(piece.n)?, args) }?;
        }
        R::note_device_copy(from);
        Ok(true)
    };
    run().map_err(|e| device_error(from, op.name(), e))
}

/// The runtime whose kernels a backend's buffer runs its strided operations with: implemented
/// beside the runtime (`impl BufferRuntime for CudaBuffer { type Runtime = Cuda; }`), so the module
/// that defines the buffer and its `impl DeviceBuffer` need not name the runtime, which names it.
pub trait BufferRuntime {
    /// The runtime whose buffer this is.
    type Runtime: GpuRuntime<Buffer = Self>;
}

/// The strided operations of a backend's `impl DeviceBuffer` ([`copy_strided`],
/// [`convert_strided`], [`binary_strided`]), written inside the impl block: over the buffer's
/// [`BufferRuntime`] with `kernel_support::strided_on_device!();`, or over a named runtime with
/// `kernel_support::strided_on_device!(Cuda);`.
#[macro_export]
macro_rules! strided_on_device {
    () => {
        $crate::strided_on_device!(<Self as $crate::gpu::BufferRuntime>::Runtime);
    };
    ($runtime:ty) => {
        /// On the device (the strided copy kernel, one launch per piece of
        /// `kernel_support::CopyDims::pieces`, so any rank) when `dst` is
        /// memory of the same device; through the host otherwise.
        fn copy_strided(
            &self,
            src: &::ir_core::TensorMeta,
            dst: &mut dyn ::ir_core::storage::DeviceBuffer,
            dst_layout: &::ir_core::Layout,
        ) -> ::std::result::Result<(), ::ir_core::storage::DeviceError> {
            $crate::gpu::copy_strided::<$runtime>(self, src, dst, dst_layout)
        }

        /// On the device (the strided conversion kernel of the pair) when `dst` is memory of the
        /// same device and the backend converts the pair there.
        fn convert_strided(
            &self,
            src: &::ir_core::TensorMeta,
            dst: &mut dyn ::ir_core::storage::DeviceBuffer,
            dst_meta: &::ir_core::TensorMeta,
            factor: ::std::option::Option<f64>,
        ) -> ::std::result::Result<bool, ::ir_core::storage::DeviceError> {
            $crate::gpu::convert_strided::<$runtime>(self, src, dst, dst_meta, factor)
        }

        /// On the device (`strided_<op>_<dtype>`) when `other` and `dst` are memory of the same
        /// device and the backend computes the dtype there.
        fn binary_strided(
            &self,
            a: &::ir_core::TensorMeta,
            other: &dyn ::ir_core::storage::DeviceBuffer,
            b: &::ir_core::TensorMeta,
            op: ::ir_core::storage::BinaryOp,
            dst: &mut dyn ::ir_core::storage::DeviceBuffer,
            dst_meta: &::ir_core::TensorMeta,
        ) -> ::std::result::Result<bool, ::ir_core::storage::DeviceError> {
            $crate::gpu::binary_strided::<$runtime>(self, a, other, b, op, dst, dst_meta)
        }
    };
}

/// The launch of one thread per element of a piece of `n` elements.
fn copy_grid<R: GpuRuntime>(n: i64) -> Result<Grid, KernelError> {
    let n = usize::try_from(n).map_err(|_| crate::out_of_range("elements", n, 0, isize::MAX))?;
    Ok(Grid {
        groups: n.div_ceil(R::COPY_GROUP as usize),
        group_size: R::COPY_GROUP,
        what: "elements",
        grid_stride: true,
    })
}

/// Runs the strided copy or conversion `key` (`scale` given for a conversion) over the elements
/// `src` describes in `from`, into `to` with `to_layout` (elements of `to_dtype`), ordered on
/// `from`'s queue; `false` when the backend has no kernel for `key`.
fn strided<R: GpuRuntime>(
    from: &R::Buffer,
    src: &TensorMeta,
    to: &mut R::Buffer,
    to_layout: &Layout,
    to_dtype: DType,
    key: StridedKey,
    scale: Option<(ConvertFactor, i32)>,
) -> Result<bool, KernelError> {
    let Some(kernel) = R::strided_kernel(from, key)? else {
        return Ok(false);
    };
    if src.numel() == 0 {
        return Ok(true);
    }
    let queue = R::buffer_queue(from);
    let pieces = CopyDims::pieces(src, to_layout)?;
    if let (StridedKey::Copy { .. }, [piece]) = (key, pieces.as_slice())
        && let Some([src_offset, dst_offset, bytes]) = piece.compact_bytes(src.dtype.size_in_bytes())?
    {
        // SAFETY: the piece's elements are one compact range of `src` in `from` (its layout was
        // checked against the storage) and one of `to_layout` in `to` (allocated for it by the
        // caller); `CopyDims::compact_bytes` gives their byte offsets and length.
        unsafe { R::copy_bytes(&queue, from, src_offset, to, dst_offset, bytes) }?;
        R::note_device_copy(from);
        return Ok(true);
    }
    let element_size = src.dtype.size_in_bytes();
    // A copy between buffers that both start 16-byte aligned may move 16-byte units; the kernel is
    // looked up (once) at the first piece that can.
    let may_widen = matches!(key, StridedKey::Copy { .. })
        && base_aligned(R::base_alignment(from))
        && base_aligned(R::base_alignment(to));
    let mut wide_kernel: Option<Option<R::Kernel>> = None;
    for piece in pieces {
        if may_widen && let Some(wide) = piece.widened(element_size) {
            let wide_kernel = match &wide_kernel {
                Some(kernel) => kernel,
                None => {
                    wide_kernel.insert(R::strided_kernel(from, StridedKey::Copy { element_size: WIDE_COPY_BYTES })?)
                }
            };
            if let Some(wide_kernel) = wide_kernel {
                let [src_offset, dst_offset, _] = wide.element_offsets()?;
                let mut args = KernelArgs::new();
                args.read_sized(from, src_offset, WIDE_COPY_BYTES).write_sized(&mut *to, dst_offset, WIDE_COPY_BYTES);
                args.long(wide.n).int(wide.rank).dims(wide.shape).dims(wide.src_strides).dims(wide.dst_strides);
                // SAFETY: the copy prototype, each integer converted without loss
                // (`CopyDims::pieces`, and `widened` divides them). The 16-byte units are the bytes
                // of the piece's elements (`widened`: whole units, every stride and offset a
                // multiple of one), so every unit lies in `src`'s elements in `from` or in
                // `to_layout`'s in `to` (allocated for it by the caller; borrowed mutably, so
                // distinct from `from`), and both buffers start 16-byte aligned (`base_aligned`),
                // so every unit is.
                unsafe { R::launch(&queue, wide_kernel, copy_grid::<R>(wide.n)?, args) }?;
                continue;
            }
        }
        let [src_offset, dst_offset, _] = piece.element_offsets()?;
        let mut args = KernelArgs::new();
        args.read(from, src_offset, src.dtype).write(&mut *to, dst_offset, to_dtype);
        args.long(piece.n).int(piece.rank).dims(piece.shape).dims(piece.src_strides).dims(piece.dst_strides);
        if let Some((factor, scaled)) = scale {
            let factor = match factor {
                ConvertFactor::F32(v) => Scalar::F32(v),
                ConvertFactor::F64(v) => Scalar::F64(v),
            };
            args.scalar(factor).int(scaled);
        }
        // SAFETY: the arguments follow the copy or conversion prototype (the conversion's factor and
        // flag only for it, which `scale` is given for, the factor in the source's compute type),
        // each integer converted without loss (`CopyDims::pieces`). Every element the piece
        // describes is one `src` describes, in `from` (its layout was checked against the
        // storage), or one of `to_layout`, in `to` (allocated for it by the caller; borrowed
        // mutably, so distinct from `from`).
        unsafe { R::launch(&queue, &kernel, copy_grid::<R>(piece.n)?, args) }?;
    }
    R::note_device_copy(from);
    Ok(true)
}
