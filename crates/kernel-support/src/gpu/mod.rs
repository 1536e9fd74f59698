//! The GPU backend skeleton: what a runtime (CUDA, HIP, OpenCL) gives the host code of a kernel
//! family, and that host code, written once over it.
//!
//! A backend implements [`GpuRuntime`]: its buffer type, the queue a call launches on (a CUDA or
//! HIP stream, an OpenCL command queue), fresh output allocation, kernel lookup by [`KernelKey`],
//! [`NormKey`] and [`StridedKey`], a device memcpy, and one launch taking a [`Grid`] and typed
//! [`KernelArgs`]. A family's host code (the norms, the gated activations, `rotary_embedding`, the
//! fp8 quantizations, the norm + quantizations, and the strided copies, conversions and
//! `add`/`mul` behind `DeviceBuffer`) reads the call, allocates, fills the arguments in the
//! kernel's prototype order and launches; it never names a backend. [`register`] registers a
//! backend's provider for every built-in op.
//!
//! # One prototype for every backend
//!
//! A buffer argument is an element address on CUDA and HIP (the buffer's base plus its offset)
//! and two parameters on OpenCL, which cannot offset a `cl_mem` on the host: the buffer, then a
//! `long` element offset. So an OpenCL kernel declares each buffer parameter followed by its
//! offset, and otherwise the same parameters as its CUDA and HIP versions; the rest (integers and
//! compute-type floats) is passed as it is.

mod gated;
mod norm;
mod program;
mod quant;
mod rotary;
mod strided;
#[cfg(test)]
mod tests;

use ir_core::storage::DeviceBuffer;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};
use ir_ops::fused_add_rms_norm::FusedAddRmsNormImpl;
use smallvec::SmallVec;

pub use gated::{gated_vectorizes, run_gated};
pub use norm::{
    NormKey, NormShape, address_alignment, base_aligned, norm_vectorizes, run_fused_add_rms_norm, run_rms_norm,
    vector_ok,
};
pub use program::{row_program_support_with, run_row_program, run_row_program_in_place};
pub use quant::{NORM_QUANT_KERNEL, run_dynamic_quant, run_norm_quant, run_static_quant};
pub use rotary::run_rotary;
pub use strided::{BufferRuntime, StridedKey, binary_strided, convert_strided, copy_strided};

use crate::{
    ComputeScalar, GatedKernel, KernelDTypes, NormCapabilities, fused_add_rms_norm_support_with, gated_support_with,
    quant_support_with, register_norm_quant_ops, register_rotary_with, rms_norm_support_with,
};

/// What a backend's fresh device memory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// Zeros: what [`DeviceAllocator::allocate`](ir_core::storage::DeviceAllocator::allocate)
    /// promises a caller that may read before writing.
    Zeros,
    /// Whatever the allocation holds: for a kernel's output, which the kernel writes whole.
    Unspecified,
}

/// Which kernel a launch runs: a backend maps it to its compiled function (compiling or loading it
/// at first use).
#[derive(Clone, Copy, Debug)]
pub enum KernelKey<'a> {
    /// A gated activation of the backend's gated table, for an element dtype.
    Gated {
        /// The op and its kernel source.
        op: &'a GatedKernel,
        /// The element dtype.
        dtype: DType,
        /// The 16-byte kernel (`<op>_<dtype>_vec`), for aligned rows.
        vectorized: bool,
    },
    /// `rotary_embedding` for an element dtype.
    Rotary {
        /// The element dtype.
        dtype: DType,
    },
    /// One of the quantization kernels ([`QUANT_KERNELS`](crate::QUANT_KERNELS)) for an input dtype.
    Quant {
        /// The kernel: `static_scaled_fp8_quant`, `dynamic_per_token_scaled_fp8_quant` or `norm_quant`.
        kernel: &'static str,
        /// The input dtype.
        dtype: DType,
        /// The 16-byte kernel (`<kernel>_<dtype>_vec`), for aligned rows.
        vectorized: bool,
    },
    /// The kernel generated from a row program for a call's dtypes
    /// ([`program::gpu_source`](crate::program::gpu_source) on CUDA and HIP): a backend caches it
    /// per device in a [`GeneratedKernels`](crate::program::GeneratedKernels).
    RowProgram {
        /// The program.
        program: &'a ir_ops::row_program::RowProgram,
        /// The call's binding (only its [`Signature`](crate::program::Signature) decides the
        /// kernel).
        binding: &'a ir_ops::row_program::Binding,
        /// How the kernel lays the rows over its threads (part of its signature).
        shape: crate::program::RowShape,
    },
}

impl KernelKey<'_> {
    /// The kernel's symbol: `<op>_<dtype>`, and `<op>_<dtype>_vec` for a 16-byte kernel.
    pub fn symbol(&self) -> String {
        match self {
            KernelKey::Gated { op, dtype, vectorized: false } => op.kernel_name(*dtype),
            KernelKey::Gated { op, dtype, vectorized: true } => format!("{}_vec", op.kernel_name(*dtype)),
            KernelKey::Rotary { dtype } => format!("rotary_embedding_{dtype}"),
            KernelKey::Quant { kernel, dtype, vectorized: false } => format!("{kernel}_{dtype}"),
            KernelKey::Quant { kernel, dtype, vectorized: true } => format!("{kernel}_{dtype}_vec"),
            KernelKey::RowProgram { .. } => crate::program::ROW_PROGRAM_KERNEL.to_owned(),
        }
    }
}

/// The launch shape: `groups` blocks (work-groups) of `group_size` threads (work-items), one
/// dimension; `what` names what one group handles, for the error when a backend cannot launch so
/// many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Blocks (work-groups).
    pub groups: usize,
    /// Threads (work-items) per block.
    pub group_size: u32,
    /// What a group handles ("rows", "tokens").
    pub what: &'static str,
    /// Whether the kernel walks its groups with a grid-stride loop, so a backend may launch fewer
    /// blocks than `groups` (HIP caps its grid so; every HIP kernel but the norms has the loop).
    pub grid_stride: bool,
}

impl Grid {
    fn limit(&self) -> KernelError {
        KernelError::GridLimit { what: self.what, count: self.groups }
    }

    /// The block count of a CUDA launch: at most 2³¹ - 1 (`gridDim.x`).
    pub fn cuda_blocks(&self) -> Result<u32, KernelError> {
        u32::try_from(self.groups).ok().filter(|&g| g <= i32::MAX as u32).ok_or_else(|| self.limit())
    }

    /// The block count of a HIP launch. HIP counts the grid in work-items, which must fit 32 bits,
    /// and `gridDim.x` is at most 2³¹ − 1. A larger grid of a kernel with a grid-stride loop
    /// ([`Grid::grid_stride`]) is capped at the most blocks of `group_size` that fit both, which
    /// then cover every group, each block taking several in turn; for any other kernel it is an
    /// error (as is an empty block).
    pub fn hip_blocks(&self) -> Result<u32, KernelError> {
        if self.group_size == 0 {
            return Err(self.limit());
        }
        let cap = (u32::MAX / self.group_size).min(i32::MAX as u32);
        match u32::try_from(self.groups) {
            Ok(groups) if groups <= cap => Ok(groups),
            _ if self.grid_stride => Ok(cap),
            _ => Err(self.limit()),
        }
    }

    /// The global work size of an OpenCL launch: groups · group size work-items.
    pub fn global_work_size(&self) -> Result<usize, KernelError> {
        self.groups.checked_mul(self.group_size as usize).ok_or_else(|| self.limit())
    }
}

/// A kernel's scalar argument, of the exact type its prototype declares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// `int`.
    I32(i32),
    /// `long long` (CUDA, HIP), `long` (OpenCL).
    I64(i64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
    /// Eight `long long`s by value: `Dims8` (CUDA, HIP), `long8` (OpenCL).
    I64x8([i64; 8]),
}

/// A buffer argument.
#[derive(Debug)]
pub enum BufferArg<'a, B> {
    /// A buffer the kernel reads, from element `offset` on (elements of `element_size` bytes).
    Read {
        /// The memory.
        buffer: &'a B,
        /// The first element the kernel addresses.
        offset: usize,
        /// Bytes per element.
        element_size: usize,
    },
    /// A buffer the kernel writes (and may read), from element `offset` on.
    Write {
        /// The memory, held uniquely for the launch.
        buffer: &'a mut B,
        /// The first element the kernel addresses.
        offset: usize,
        /// Bytes per element.
        element_size: usize,
    },
    /// A buffer parameter the kernel is told (by another argument) never to touch: a null address.
    Null,
}

/// A kernel argument.
#[derive(Debug)]
pub enum KernelArg<'a, B> {
    /// A buffer, read, written or null.
    Buffer(BufferArg<'a, B>),
    /// The buffer argument at position `of` (counting arguments, not parameters) passed again, at
    /// the same element: for a kernel that writes through one parameter what it reads through
    /// another (an output in place of an input).
    Alias {
        /// The position of a [`KernelArg::Buffer`] argument.
        of: usize,
    },
    /// A scalar.
    Scalar(Scalar),
}

/// The arguments of one launch, in the kernel's prototype order (see the module doc for how a
/// backend passes buffers).
#[derive(Debug)]
pub struct KernelArgs<'a, B> {
    args: SmallVec<[KernelArg<'a, B>; 20]>,
}

impl<B> Default for KernelArgs<'_, B> {
    fn default() -> Self {
        KernelArgs { args: SmallVec::new() }
    }
}

impl<'a, B> KernelArgs<'a, B> {
    /// No arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A buffer read from element `offset` on, elements of `dtype`.
    pub fn read(&mut self, buffer: &'a B, offset: usize, dtype: DType) -> &mut Self {
        self.args.push(KernelArg::Buffer(BufferArg::Read { buffer, offset, element_size: dtype.size_in_bytes() }));
        self
    }

    /// A buffer written from element `offset` on, elements of `dtype`.
    pub fn write(&mut self, buffer: &'a mut B, offset: usize, dtype: DType) -> &mut Self {
        self.args.push(KernelArg::Buffer(BufferArg::Write { buffer, offset, element_size: dtype.size_in_bytes() }));
        self
    }

    /// A buffer read from element `offset` on, elements of `element_size` bytes (for kernels whose
    /// elements are no dtype: the 16-byte units of the wide strided copy).
    pub fn read_sized(&mut self, buffer: &'a B, offset: usize, element_size: usize) -> &mut Self {
        self.args.push(KernelArg::Buffer(BufferArg::Read { buffer, offset, element_size }));
        self
    }

    /// A buffer written from element `offset` on, elements of `element_size` bytes.
    pub fn write_sized(&mut self, buffer: &'a mut B, offset: usize, element_size: usize) -> &mut Self {
        self.args.push(KernelArg::Buffer(BufferArg::Write { buffer, offset, element_size }));
        self
    }

    /// A buffer parameter the kernel never touches.
    pub fn null(&mut self) -> &mut Self {
        self.args.push(KernelArg::Buffer(BufferArg::Null));
        self
    }

    /// The buffer argument at position `of` again (see [`KernelArg::Alias`]).
    pub fn alias(&mut self, of: usize) -> &mut Self {
        self.args.push(KernelArg::Alias { of });
        self
    }

    /// A buffer argument made elsewhere.
    pub fn buffer(&mut self, arg: BufferArg<'a, B>) -> &mut Self {
        self.args.push(KernelArg::Buffer(arg));
        self
    }

    /// An `int`.
    pub fn int(&mut self, value: i32) -> &mut Self {
        self.args.push(KernelArg::Scalar(Scalar::I32(value)));
        self
    }

    /// A `long long` (`long` in OpenCL C).
    pub fn long(&mut self, value: i64) -> &mut Self {
        self.args.push(KernelArg::Scalar(Scalar::I64(value)));
        self
    }

    /// A scalar of the type it holds.
    pub fn scalar(&mut self, value: Scalar) -> &mut Self {
        self.args.push(KernelArg::Scalar(value));
        self
    }

    /// Eight `long long`s by value (a strided kernel's shape or strides).
    pub fn dims(&mut self, value: [i64; 8]) -> &mut Self {
        self.args.push(KernelArg::Scalar(Scalar::I64x8(value)));
        self
    }

    /// A `compute_t` of the program `value` was made for ([`ComputeScalar::new`]).
    pub fn compute(&mut self, value: ComputeScalar) -> &mut Self {
        self.args.push(KernelArg::Scalar(match value {
            ComputeScalar::F32(v) => Scalar::F32(v),
            ComputeScalar::F64(v) => Scalar::F64(v),
        }));
        self
    }

    /// How many arguments (a buffer counts once).
    pub fn len(&self) -> usize {
        self.args.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.args.is_empty()
    }
}

/// A launch argument in a backend's terms: a buffer as the backend passes it (`P`), or a scalar.
#[derive(Clone, Debug, PartialEq)]
pub enum Resolved<P> {
    /// A buffer parameter.
    Buffer(P),
    /// A scalar parameter.
    Scalar(Scalar),
}

impl<'a, B> KernelArgs<'a, B> {
    /// The arguments in order with every buffer turned into the backend's parameter by `buffer`
    /// (called once per buffer argument, in order) and every [`KernelArg::Alias`] given the
    /// parameter of the argument it names.
    pub fn resolve<P: Clone>(
        self,
        mut buffer: impl FnMut(BufferArg<'a, B>) -> Result<P, KernelError>,
    ) -> Result<SmallVec<[Resolved<P>; 20]>, KernelError> {
        let mut resolved: SmallVec<[Resolved<P>; 20]> = SmallVec::with_capacity(self.args.len());
        let mut aliases: SmallVec<[(usize, usize); 2]> = SmallVec::new();
        for (position, arg) in self.args.into_iter().enumerate() {
            resolved.push(match arg {
                KernelArg::Buffer(arg) => Resolved::Buffer(buffer(arg)?),
                KernelArg::Alias { of } => {
                    aliases.push((position, of));
                    // Replaced below, once every argument it may name is resolved.
                    Resolved::Scalar(Scalar::I32(0))
                }
                KernelArg::Scalar(scalar) => Resolved::Scalar(scalar),
            });
        }
        for (position, of) in aliases {
            // An alias of an alias (or of itself) finds a placeholder scalar: refused too.
            let Some(Resolved::Buffer(parameter)) = resolved.get(of) else {
                return Err(KernelError::InvalidArguments {
                    reason: format!("kernel argument {position} aliases argument {of}, which is not a buffer"),
                });
            };
            resolved[position] = Resolved::Buffer(parameter.clone());
        }
        Ok(resolved)
    }
}

/// A GPU runtime: what the family host code needs of CUDA, HIP or OpenCL.
pub trait GpuRuntime: 'static {
    /// The backend's memory in "`x` is not in … memory" errors (`"CUDA"`, `"HIP"`, `"xpu"`).
    const MEMORY: &'static str;
    /// Threads (work-items) per block of the quantization kernels: one block per row.
    const QUANT_GROUP: u32;
    /// Threads (work-items) per block of the strided copies, conversions and `add`/`mul`: one per
    /// element.
    const COPY_GROUP: u32;
    /// Whether the runtime's generated kernels take the chunk layout
    /// ([`RowShape::Chunks`](crate::program::RowShape::Chunks)): `true` for a runtime compiling
    /// [`gpu_source`](crate::program::gpu_source) in the shape its key names (CUDA, HIP); an OpenCL
    /// runtime, whose [`opencl_source`](crate::program::opencl_source) kernels walk their rows,
    /// sets `false` and gets [`RowShape::Walk`](crate::program::RowShape::Walk).
    const GENERATED_CHUNKS: bool = true;

    /// Threads (work-items) per block of the gated kernels, one block per row of `d` outputs of
    /// `dtype`.
    fn gated_group(d: usize, dtype: DType) -> u32;

    /// The backend's device memory behind a tensor.
    type Buffer: DeviceBuffer;
    /// What a call's kernels and outputs are ordered on.
    type Queue;
    /// A compiled, loaded kernel.
    type Kernel;

    /// The queue a call whose first activation lives in `first` launches on: the caller's, when
    /// the call came through a context given one, else the buffer's own.
    fn queue(first: &Self::Buffer) -> Result<Self::Queue, KernelError>;

    /// Memory for `len_bytes` on `like`'s device, ordered on `queue`, for a fresh output, with
    /// contents left unspecified ([`Fill::Unspecified`]: no memset, which would add a write of the
    /// whole output to every call): the kernel that fills it writes every element the output's
    /// layout reaches before anything reads it (in queue order).
    fn allocate(like: &Self::Buffer, queue: &Self::Queue, len_bytes: usize) -> Result<Self::Buffer, KernelError>;

    /// The kernel `key` names, on `like`'s device (compiled or loaded at first use, then cached).
    fn kernel(like: &Self::Buffer, key: KernelKey<'_>) -> Result<Self::Kernel, KernelError>;

    /// The norm kernel for `key` on `like`'s device and the shape it launches with (the backend's
    /// threads per row for the hidden size, and its block size).
    fn norm_kernel(like: &Self::Buffer, key: &NormKey) -> Result<(Self::Kernel, NormShape), KernelError>;

    /// The strided kernel `key` names on `like`'s device, or `None` where the backend has none for
    /// it there (a conversion through f64 on a device without f64; the caller then computes on
    /// the host).
    fn strided_kernel(like: &Self::Buffer, key: StridedKey) -> Result<Option<Self::Kernel>, KernelError>;

    /// Copies `bytes` bytes from byte `from_offset` of `from` to byte `to_offset` of `to`, in order
    /// on `queue`, without a kernel (`cuMemcpyDtoDAsync`, `hipMemcpyDtoDAsync`,
    /// `clEnqueueCopyBuffer`): a copy whose source and destination are one compact range each,
    /// such as `clone` of a compact tensor.
    ///
    /// # Safety
    ///
    /// Both ranges lie inside their buffers.
    unsafe fn copy_bytes(
        queue: &Self::Queue,
        from: &Self::Buffer,
        from_offset: usize,
        to: &mut Self::Buffer,
        to_offset: usize,
        bytes: usize,
    ) -> Result<(), KernelError>;

    /// The queue of `buffer`'s own work, where copies out of it are ordered.
    fn buffer_queue(buffer: &Self::Buffer) -> Self::Queue;

    /// Whether two buffers are memory of the same device (a device-side copy between them is
    /// possible).
    fn same_device(a: &Self::Buffer, b: &Self::Buffer) -> bool;

    /// Called once for each copy, conversion or `add`/`mul` done on the device (a backend may count
    /// them for its tests); nothing by default.
    fn note_device_copy(like: &Self::Buffer) {
        let _ = like;
    }

    /// The alignment of `buffer`'s first byte (a power of two; 256 stands for 256 or more), from
    /// which the norms, the gated ops, the quantizations and the wide strided copy decide whether
    /// 16-byte accesses are safe; 0 when it is unknown, so no call takes a 16-byte path.
    fn base_alignment(buffer: &Self::Buffer) -> usize;

    /// Launches `kernel` on `queue`: `grid.groups` groups of `grid.group_size`, with `args`.
    ///
    /// # Safety
    ///
    /// `args` follow the kernel's prototype (count, order, types; each buffer passed as the
    /// module doc says); every element the kernel reads or writes through a buffer argument lies
    /// inside that buffer; a buffer the kernel writes is passed as [`BufferArg::Write`] (held
    /// uniquely) or as an alias of one, a [`KernelArg::Alias`] names an earlier or later buffer
    /// argument, and a [`BufferArg::Null`] parameter is never dereferenced.
    unsafe fn launch(
        queue: &Self::Queue,
        kernel: &Self::Kernel,
        grid: Grid,
        args: KernelArgs<'_, Self::Buffer>,
    ) -> Result<(), KernelError>;
}

/// What a GPU backend registers its provider with.
#[derive(Clone, Copy, Debug)]
pub struct GpuBackend {
    /// The device kind its predicates ask for.
    pub device: DeviceKind,
    /// The element dtypes its kernels compute on, asked at each selection (a device may add f64).
    pub dtypes: fn() -> KernelDTypes,
    /// The provider's spec without a predicate: its name, availability probe and platform
    /// detection (each op's standard predicate is added here).
    pub spec: fn() -> ImplSpec,
    /// Its gated ops: an op is a kernel source and a line of this table.
    pub gated: &'static [GatedKernel],
}

/// Registers runtime `R`'s implementations of every built-in op: the norms (every argument form:
/// a weight of another dtype, `variance_size`; `fused_add_rms_norm` in place), the gated
/// activations, the fp8 quantizations, the norm + quantizations (the fused-add forms in place),
/// `rotary_embedding` (in place), each with the standard predicate on the backend's device and
/// dtypes, and the ops defined by row programs (`layer_norm`, `silu_and_mul_dynamic_fp8_quant`) as
/// the kernels generated from them ([`row_program_support_with`]).
pub fn register<R: GpuRuntime>(registry: &Registry, backend: GpuBackend) -> Result<(), RegistryError> {
    let GpuBackend { device, dtypes, spec, gated } = backend;
    let capabilities = move || NormCapabilities { dtypes: dtypes(), ..NormCapabilities::ALL };
    let rms_spec = spec().with_supports(move |args| rms_norm_support_with(args, device, capabilities()));
    ir_ops::rms_norm::register(registry, rms_spec, run_rms_norm::<R>)?;
    let fused_spec = spec().with_supports(move |args| fused_add_rms_norm_support_with(args, device, capabilities()));
    ir_ops::fused_add_rms_norm::register(registry, fused_spec, FusedAddRmsNormImpl::inplace(fused_add_rms_norm::<R>))?;
    let gated_spec = move || spec().with_supports(move |args| gated_support_with(args, device, dtypes()));
    GatedKernel::register_all(gated, registry, gated_spec, run_gated::<R>)?;
    let quant_spec = move || spec().with_supports(move |args| quant_support_with(args, device, dtypes()));
    ir_ops::static_scaled_fp8_quant::register(registry, quant_spec(), run_static_quant::<R>)?;
    ir_ops::dynamic_per_token_scaled_fp8_quant::register(registry, quant_spec(), run_dynamic_quant::<R>)?;
    register_norm_quant_ops(registry, device, dtypes, spec, run_norm_quant::<R>)?;
    register_rotary_with(registry, device, dtypes, spec(), run_rotary::<R>)?;
    program::register_program_ops::<R>(registry, backend)
}

/// [`run_fused_add_rms_norm`] with the op's `rounding` argument.
fn fused_add_rms_norm<R: GpuRuntime>(
    x: UniqueTensor,
    residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let round_sum = rounding.rounds_intermediates(x.tensor().dtype());
    run_fused_add_rms_norm::<R>(x, residual, weight, epsilon, variance_size, round_sum)
}
