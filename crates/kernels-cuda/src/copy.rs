//! `clone`, `contiguous` and `cat` of cuda tensors on the device: `kernels/strided_copy.cu`, one
//! thread per element, each element moved as an unsigned integer of its size (every dtype bit for
//! bit), up to [`COPY_MAX_RANK`] dimensions a launch (a copy past that takes one launch per
//! [`CopyDims::pieces`]); into another device's memory, through the host. `copy_` between dtypes
//! and `scale`: `kernels/strided_convert.cu`, one kernel per pair of [`CONVERT_KERNELS`] (every
//! pair of dtypes); `add` and `mul` there too, one kernel per dtype ([`BINARY_KERNELS`]).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use ir_core::{KernelError, Layout, TensorMeta};
use kernel_support::{ConvertFactor, CopyDims};

use crate::device::{CudaBuffer, driver_error};
use crate::module::compile;

/// The strided copy kernels' source.
pub const STRIDED_COPY: &str = include_str!("../kernels/strided_copy.cu");

pub use kernel_support::COPY_MAX_RANK;

/// Threads per block of the copy.
const COPY_BLOCK: u32 = 256;

/// The strided conversion kernels' source.
pub const STRIDED_CONVERT: &str = include_str!("../kernels/strided_convert.cu");

pub use kernel_support::{BINARY_KERNELS, CONVERT_KERNELS};

/// Compiles the strided conversion program (every kernel of [`CONVERT_KERNELS`]) to PTX for `arch`.
/// The program holds the strided copies too: it is compiled after their source, whose indexing it
/// uses, and the software fp8 conversion.
pub fn compile_convert_ptx(arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    let source = format!("{STRIDED_COPY}\n{}\n{}\n{STRIDED_CONVERT}", crate::module::NARROW, crate::quant::FP8);
    compile(&source, "strided_convert.cu", "strided_convert".to_owned(), Vec::new(), arch)
}

/// The element sizes the program has a kernel for (`strided_copy_<bytes>`).
pub const ELEMENT_SIZES: [usize; 4] = [1, 2, 4, 8];

/// The launch of one thread per element of a piece of `n` elements, in blocks of [`COPY_BLOCK`].
fn launch_config(n: i64) -> Result<LaunchConfig, KernelError> {
    let blocks = u32::try_from((n as u64).div_ceil(u64::from(COPY_BLOCK)))
        .map_err(|_| KernelError::GridLimit { what: "elements", count: n as usize })?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (COPY_BLOCK, 1, 1), shared_mem_bytes: 0 })
}

/// Compiles the strided copy program (all four element sizes) to PTX for `arch`.
pub fn compile_ptx(arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    compile(STRIDED_COPY, "strided_copy.cu", "strided_copy".to_owned(), Vec::new(), arch)
}

/// Copies the elements `src` describes in `from` into `to` with `to_layout`, on `from`'s stream.
pub(crate) fn copy_on_device(
    from: &CudaBuffer,
    src: &TensorMeta,
    to: &mut CudaBuffer,
    to_layout: &Layout,
) -> Result<(), KernelError> {
    let n = src.numel();
    if n == 0 {
        return Ok(());
    }
    let size = src.dtype.size_in_bytes();
    if !ELEMENT_SIZES.contains(&size) {
        return Err(KernelError::ElementSize { backend: "cuda", bytes: size });
    }
    let pieces = CopyDims::pieces(src, to_layout)?;
    let device = std::sync::Arc::clone(&from.device);
    let arch = device.arch;
    let function =
        device.op_function("strided_copy", src.dtype, &format!("strided_copy_{size}"), || compile_ptx(arch))?;
    let stream = std::sync::Arc::clone(from.stream());
    let src_address = from.read_address(&stream);
    let dst_address = to.write_address(&stream);
    for piece in &pieces {
        let [src_offset, dst_offset, _] = piece.element_offsets()?;
        let (src_ptr, dst_ptr) = (src_address.offset(src_offset * size), dst_address.offset(dst_offset * size));
        let config = launch_config(piece.n)?;
        let mut builder = stream.launch_builder(&function);
        // strided_copy_<bytes>(const T* src, T* dst, long long n, Dims8 shape, Dims8 src_strides,
        //                      Dims8 dst_strides), Dims8 being eight long longs by value.
        builder
            .arg(&src_ptr)
            .arg(&dst_ptr)
            .arg(&piece.n)
            .arg(&piece.shape)
            .arg(&piece.src_strides)
            .arg(&piece.dst_strides);
        // SAFETY: the arguments follow the kernel's prototype above, each integer converted without
        // loss, each [i64; 8] laid out as the kernel's `Dims8`. Every element the piece describes is
        // one `src` describes, in `from` (its layout was checked against the storage), or one of
        // `to_layout`, in `to` (allocated for it by the caller); the buffers are distinct (`to` is
        // borrowed mutably). The address guards record both uses on the stream for cudarc's ordering.
        unsafe { builder.launch(config) }.map_err(driver_error)?;
    }
    Ok(())
}

/// Converts the elements `src` describes in `from` into `to` as `to_meta` describes them, on `from`'s
/// stream (see [`DeviceBuffer::convert_strided`](ir_core::storage::DeviceBuffer::convert_strided));
/// `false` when no kernel converts this pair of dtypes.
pub(crate) fn convert_on_device(
    from: &CudaBuffer,
    src: &TensorMeta,
    to: &mut CudaBuffer,
    to_meta: &TensorMeta,
    factor: Option<f64>,
) -> Result<bool, KernelError> {
    let Some(&(_, _, name)) = CONVERT_KERNELS.iter().find(|(s, d, _)| *s == src.dtype && *d == to_meta.dtype) else {
        return Ok(false);
    };
    let n = src.numel();
    if n == 0 {
        return Ok(true);
    }
    let pieces = CopyDims::pieces(src, &to_meta.layout)?;
    let device = std::sync::Arc::clone(&from.device);
    let arch = device.arch;
    // Cached per kernel name (each pair its own entry).
    let function = device.op_function(name, src.dtype, name, || compile_convert_ptx(arch))?;
    let (factor, scaled) = (ConvertFactor::for_source(src.dtype, factor), i32::from(factor.is_some()));
    let stream = std::sync::Arc::clone(from.stream());
    let src_address = from.read_address(&stream);
    let dst_address = to.write_address(&stream);
    for piece in &pieces {
        let [src_offset, dst_offset, _] = piece.element_offsets()?;
        let src_ptr = src_address.offset(src_offset * src.dtype.size_in_bytes());
        let dst_ptr = dst_address.offset(dst_offset * to_meta.dtype.size_in_bytes());
        let config = launch_config(piece.n)?;
        let mut builder = stream.launch_builder(&function);
        // strided_convert_<src>_<dst>(const S* src, D* dst, long long n, Dims8 shape,
        //                             Dims8 src_strides, Dims8 dst_strides, C factor, int scaled),
        // C double for f64 and i64 sources (ConvertFactor::F64), float for the others
        builder
            .arg(&src_ptr)
            .arg(&dst_ptr)
            .arg(&piece.n)
            .arg(&piece.shape)
            .arg(&piece.src_strides)
            .arg(&piece.dst_strides);
        match &factor {
            ConvertFactor::F32(factor) => builder.arg(factor),
            ConvertFactor::F64(factor) => builder.arg(factor),
        };
        builder.arg(&scaled);
        // SAFETY: the arguments follow the kernel's prototype above, each integer converted without
        // loss, each [i64; 8] laid out as the kernel's `Dims8`; the kernel is the one for these two
        // dtypes. Every element the piece describes is one `src` describes, in `from` (its layout
        // was checked against the storage), or one of `to_meta`, in `to`; the buffers are distinct
        // (`to` is borrowed mutably). The address guards record both uses on the stream for
        // cudarc's ordering.
        unsafe { builder.launch(config) }.map_err(driver_error)?;
    }
    Ok(true)
}

/// `add`/`mul` (`op`) of the elements `a` describes in `from` and `b` describes in `other` into the
/// compact `to`, on `from`'s stream (see
/// [`DeviceBuffer::binary_strided`](ir_core::storage::DeviceBuffer::binary_strided)); `false` when
/// no kernel computes this dtype.
pub(crate) fn binary_on_device(
    from: &CudaBuffer,
    a: &TensorMeta,
    other: &CudaBuffer,
    b: &TensorMeta,
    op: ir_core::storage::BinaryOp,
    to: &mut CudaBuffer,
) -> Result<bool, KernelError> {
    let Some(&(_, _, name)) = BINARY_KERNELS.iter().find(|(d, o, _)| *d == a.dtype && *o == op) else {
        return Ok(false);
    };
    let n = a.numel();
    if n == 0 {
        return Ok(true);
    }
    // a's strides as the source's, b's as the destination's: the kernel walks both.
    let pieces = CopyDims::pieces(a, &b.layout)?;
    let device = std::sync::Arc::clone(&from.device);
    let arch = device.arch;
    let function = device.op_function(name, a.dtype, name, || compile_convert_ptx(arch))?;
    let stream = std::sync::Arc::clone(from.stream());
    let size = a.dtype.size_in_bytes();
    let (a_address, b_address) = (from.read_address(&stream), other.read_address(&stream));
    let dst_address = to.write_address(&stream);
    for piece in &pieces {
        let [a_offset, b_offset, first] = piece.element_offsets()?;
        let (a_ptr, b_ptr) = (a_address.offset(a_offset * size), b_address.offset(b_offset * size));
        let dst_ptr = dst_address.offset(first * size);
        let config = launch_config(piece.n)?;
        let mut builder = stream.launch_builder(&function);
        // strided_<op>_<dtype>(const T* a, const T* b, T* dst, long long n, Dims8 shape,
        //                      Dims8 a_strides, Dims8 b_strides)
        builder
            .arg(&a_ptr)
            .arg(&b_ptr)
            .arg(&dst_ptr)
            .arg(&piece.n)
            .arg(&piece.shape)
            .arg(&piece.src_strides)
            .arg(&piece.dst_strides);
        // SAFETY: the arguments follow the kernel's prototype above, each integer converted without
        // loss, each [i64; 8] laid out as the kernel's `Dims8`; the kernel is the one for this dtype
        // and operation. Every element the piece describes is one `a` and `b` describe, in `from`
        // and `other` (their layouts were checked against their storages); `to` (borrowed mutably,
        // so distinct from both) holds the `n` compact elements, of which the piece writes those
        // from `first` on. The address guards record the uses on the stream for cudarc's ordering.
        unsafe { builder.launch(config) }.map_err(driver_error)?;
    }
    Ok(true)
}
