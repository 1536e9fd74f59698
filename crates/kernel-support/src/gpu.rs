//! The GPU backend skeleton: what a runtime (CUDA, HIP, OpenCL) gives the host code of a kernel
//! family, and that host code, written once over it.
//!
//! A backend implements [`GpuRuntime`]: its buffer type, the queue a call launches on (a CUDA or
//! HIP stream, an OpenCL command queue), fresh output allocation, kernel lookup by [`KernelKey`]
//! and one launch taking a [`Grid`] and typed [`KernelArgs`]. A family's host code (here: the
//! norms, the gated activations, `rotary_embedding`, the fp8 quantizations and the norm +
//! quantizations)
//! reads the call, allocates, fills the arguments in the kernel's prototype order and launches;
//! it never names a backend.
//!
//! # One prototype for every backend
//!
//! A buffer argument is an element address on CUDA and HIP (the buffer's base plus its offset)
//! and two parameters on OpenCL, which cannot offset a `cl_mem` on the host: the buffer, then a
//! `long` element offset. So an OpenCL kernel declares each buffer parameter followed by its
//! offset, and otherwise the same parameters as its CUDA and HIP versions; the rest (integers and
//! compute-type floats) is passed as it is.

use ir_core::op::Value;
use ir_core::storage::{BinaryOp, DeviceBuffer, DeviceError, Storage, copy_strided_through_host};
use ir_core::{
    DType, DeviceKind, ImplSpec, KernelError, Layout, Registry, RegistryError, Tensor, TensorMeta, UniqueTensor,
};
use ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT;
use ir_ops::fused_add_rms_norm::FusedAddRmsNormImpl;
use ir_ops::static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT;
use smallvec::SmallVec;

use crate::{
    BINARY_KERNELS, CONVERT_KERNELS, ComputeScalar, ConvertFactor, CopyDims, GatedCall, GatedGeometry, GatedKernel,
    KernelDTypes, NormCapabilities, NormOp, NormQuantCall, NormQuantOutputs, NormQuantResidual, QUANT_KERNELS,
    RotaryCall, RowArgs, Rows, device_buffer, device_buffer_mut, floor_scales, fp8_format_code,
    fused_add_rms_norm_support_with, gated_support_with, kernel_int, norm_variance, per_token_scales_shape,
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
    },
    /// `rotary_embedding` for an element dtype.
    Rotary {
        /// The element dtype.
        dtype: DType,
    },
    /// One of the quantization kernels ([`QUANT_KERNELS`]) for an input dtype.
    Quant {
        /// The kernel: `static_scaled_fp8_quant`, `dynamic_per_token_scaled_fp8_quant` or `norm_quant`.
        kernel: &'static str,
        /// The input dtype.
        dtype: DType,
    },
}

impl KernelKey<'_> {
    /// The kernel's symbol: `<op>_<dtype>`.
    pub fn symbol(&self) -> String {
        match self {
            KernelKey::Gated { op, dtype } => op.kernel_name(*dtype),
            KernelKey::Rotary { dtype } => format!("rotary_embedding_{dtype}"),
            KernelKey::Quant { kernel, dtype } => format!("{kernel}_{dtype}"),
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
}

impl Grid {
    fn limit(&self) -> KernelError {
        KernelError::GridLimit { what: self.what, count: self.groups }
    }

    /// The block count of a CUDA launch: at most 2³¹ - 1 (`gridDim.x`).
    pub fn cuda_blocks(&self) -> Result<u32, KernelError> {
        u32::try_from(self.groups).ok().filter(|&g| g <= i32::MAX as u32).ok_or_else(|| self.limit())
    }

    /// The block count of a HIP launch: HIP counts the grid in work-items, which must fit 32 bits,
    /// so blocks · block size is at most 2³² - 1.
    pub fn hip_blocks(&self) -> Result<u32, KernelError> {
        let fits = (self.groups as u128) * u128::from(self.group_size) <= u128::from(u32::MAX);
        u32::try_from(self.groups).ok().filter(|_| fits).ok_or_else(|| self.limit())
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
    /// The backend's name in driver errors (`"cuda"`, `"rocm"`, `"xpu"`).
    const BACKEND: &'static str;
    /// Its memory in "`x` is not in … memory" errors (`"CUDA"`, `"HIP"`, `"xpu"`).
    const MEMORY: &'static str;
    /// Threads (work-items) per block of the gated kernels: one block per row.
    const GATED_GROUP: u32;
    /// Threads (work-items) per block of the quantization kernels: one block per row.
    const QUANT_GROUP: u32;
    /// Threads (work-items) per block of the strided copies, conversions and `add`/`mul`: one per
    /// element.
    const COPY_GROUP: u32;

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

    /// The alignment of `buffer`'s first byte (a power of two, at most 256), from which the norms
    /// decide whether 16-byte accesses are safe; 0 for a backend whose norm kernels take no
    /// 16-byte path chosen on the host.
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
/// activations, the fp8 quantizations, the norm + quantizations (the fused-add forms in place) and
/// `rotary_embedding` (in place), each with the standard predicate on the backend's device and
/// dtypes.
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
    register_rotary_with(registry, device, dtypes, spec(), run_rotary::<R>)
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

/// Runs the gated op `op` on the bound `args` (x first) on runtime `R`: a fresh compact
/// `[..., d]` output, one group of [`GpuRuntime::GATED_GROUP`] per row. The kernel is
/// `<op>_<dtype>(out, x, long long n_rows, int d, long long x_row_stride, long long out_row_stride,
/// compute_t f0, compute_t f1, int i0, int i1)`.
pub fn run_gated<R: GpuRuntime>(op: &GatedKernel, args: &[Value]) -> Result<Tensor, KernelError> {
    let GatedCall { x, scalars, geometry } = GatedCall::new(op.def, args)?;
    let empty = geometry.is_empty();
    let GatedGeometry { rows, d, out_layout } = geometry;
    let dtype = x.dtype();
    let x_buffer = device_buffer::<R::Buffer>(x, "x", R::MEMORY)?;
    let queue = R::queue(x_buffer)?;
    let mut out = R::allocate(x_buffer, &queue, out_layout.storage_end() * dtype.size_in_bytes())?;
    if !empty {
        let kernel = R::kernel(x_buffer, KernelKey::Gated { op, dtype })?;
        let [f0, f1] = scalars.floats.map(|v| ComputeScalar::new(dtype, v));
        let d: i32 = kernel_int(d, "output width")?;
        let mut launch = KernelArgs::new();
        launch
            .write(&mut out, 0, dtype)
            .read(x_buffer, rows.offset, dtype)
            .long(kernel_int(rows.n_rows, "rows")?)
            .int(d)
            .long(kernel_int(rows.row_stride, "x row stride")?)
            .long(i64::from(d))
            .compute(f0)
            .compute(f1)
            .int(scalars.ints[0])
            .int(scalars.ints[1]);
        let grid = Grid { groups: rows.n_rows, group_size: R::GATED_GROUP, what: "rows" };
        // SAFETY: the arguments follow the prototype above, each integer converted without loss by
        // `kernel_int`. x's rows lie inside its buffer (its layout was checked against its storage
        // when the tensor was built, and the rows come from that layout); `out` was allocated for
        // the compact output layout, n_rows · d elements, which the kernel writes densely, and is
        // held only here.
        unsafe { R::launch(&queue, &kernel, grid, launch) }?;
    }
    Ok(Tensor::from_storage(Storage::Device(Box::new(out)), dtype, out_layout)?)
}

/// `rotary_embedding` on runtime `R`: rotates query and key (when given) in their storage, one
/// group per token. The positions stay on the device (a call never waits for the host); a token
/// whose position lies outside the cache is left unrotated (the kernel cannot report it). The
/// kernel is `rotary_embedding_<dtype>(q, long long q_row_stride, k, long long k_row_stride, int
/// has_key, const long long* positions, const elem_t* cache, long long cache_row_stride, long long
/// tokens, int heads, int kv_heads, int head_size, int rotary_dim, int max_position, int is_neox,
/// int round_products)`.
pub fn run_rotary<R: GpuRuntime>(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let RotaryCall { positions, mut query, mut key, cos_sin_cache, launch, round_products } = call;
    let dtype = query.tensor().dtype();
    let tokens = launch.geometry.tokens;
    if tokens > 0 {
        let [heads, kv_heads, head_size, rotary_dim, max_position] = launch.dims()?;
        let positions_buffer = device_buffer::<R::Buffer>(positions, "positions", R::MEMORY)?;
        let cache_buffer = device_buffer::<R::Buffer>(cos_sin_cache, "cos_sin_cache", R::MEMORY)?;
        let q_buffer = device_buffer_mut::<R::Buffer>(&mut query, "query", R::MEMORY)?;
        let queue = R::queue(q_buffer)?;
        let kernel = R::kernel(q_buffer, KernelKey::Rotary { dtype })?;
        let k_buffer = match key.as_mut() {
            Some(key) => Some(device_buffer_mut::<R::Buffer>(key, "key", R::MEMORY)?),
            None => None,
        };
        let (q, c) = (launch.query, launch.cache);
        let mut args = KernelArgs::new();
        args.write(q_buffer, offset(q.offset)?, dtype).long(q.row_stride);
        match (k_buffer, launch.key) {
            (Some(buffer), Some(k)) => args.write(buffer, offset(k.offset)?, dtype).long(k.row_stride),
            // Without a key the kernel never touches `k` (`has_key` is 0): null.
            _ => args.null().long(0),
        };
        args.int(i32::from(launch.key.is_some()))
            .read(positions_buffer, offset(launch.positions_offset)?, DType::I64)
            .read(cache_buffer, offset(c.offset)?, dtype)
            .long(c.row_stride)
            .long(q.n_rows)
            .int(heads)
            .int(kv_heads)
            .int(head_size)
            .int(rotary_dim)
            .int(max_position)
            .int(i32::from(launch.geometry.is_neox_style))
            .int(i32::from(round_products));
        let grid = Grid { groups: tokens, group_size: launch.threads_per_token(), what: "tokens" };
        // SAFETY: the arguments follow the prototype above, each integer converted without loss
        // (`Rows::kernel_args`, `RotaryLaunch::dims`). Query's and key's rows lie inside their
        // buffers (their layouts were checked against their storage; the meta function checked
        // that heads · head_size is each row's width), and both are uniquely owned (the call's
        // activations); `tokens` positions lie from their offset (compact, the predicate); a cache
        // row is read only for a position below `max_position`, the cache's row count. A null key
        // is never dereferenced: `has_key` is 0.
        unsafe { R::launch(&queue, &kernel, grid, args) }?;
    }
    Ok((query.into_tensor(), key.map(UniqueTensor::into_tensor)))
}

/// What selects a norm kernel: the op, x's dtype, the weight's (none, x's or another), whether
/// 16-byte accesses are safe, and the hidden size (a backend's row width follows from it alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NormKey {
    /// `rms_norm` or `fused_add_rms_norm`.
    pub op: NormOp,
    /// x's dtype.
    pub dtype: DType,
    /// The weight's dtype, when a weight is applied.
    pub weight: Option<DType>,
    /// Whether x, the output or residual, and a weight of x's dtype allow 16-byte accesses.
    pub vectorized: bool,
    /// Elements per row.
    pub hidden: usize,
}

/// How a norm kernel launches: threads per block, each block handling `rows_per_group` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormShape {
    /// Threads (work-items) per block.
    pub group_size: u32,
    /// Rows one block handles.
    pub rows_per_group: u32,
}

/// Whether rows of `dtype` may launch with 16-byte vector accesses (when aligned): not f64, a
/// reference dtype, whose rows launch with scalar accesses (fewer variants to compile).
pub fn norm_vectorizes(dtype: DType) -> bool {
    dtype != DType::F64
}

/// Whether 16-byte accesses are safe for rows of `dtype` in a buffer whose first byte has
/// `base_alignment`: an aligned start, and a row stride and hidden size that are multiples of the
/// vector width. A base below 16 bytes of alignment never vectorizes, whatever the offset. Decided
/// on the host; both paths give the same bits.
pub fn vector_ok(rows: &Rows, dtype: DType, base_alignment: usize) -> bool {
    let size = dtype.size_in_bytes();
    let width = 16 / size;
    norm_vectorizes(dtype)
        && base_alignment.is_multiple_of(16)
        && base_alignment > 0
        && (rows.offset * size).is_multiple_of(16)
        && rows.hidden.is_multiple_of(width)
        && (rows.n_rows <= 1 || rows.row_stride.is_multiple_of(width))
}

/// The alignment of a device address, as [`GpuRuntime::base_alignment`] reports it: the largest
/// power of two up to 256 dividing it (256 for 0).
pub fn address_alignment(address: u64) -> usize {
    if address == 0 { 256 } else { 1usize << address.trailing_zeros().min(8) }
}

/// A norm launch's weight: its buffer, storage offset (elements) and dtype (which may differ from
/// x's).
type NormWeight<'w, B> = Option<(&'w B, usize, DType)>;

/// What both norm ops' launches share.
struct NormLaunch<'w, B> {
    dtype: DType,
    epsilon: ComputeScalar,
    /// Elements of each row the mean square runs over (in 1..=H).
    variance: usize,
    weight: NormWeight<'w, B>,
}

impl<'w, B: DeviceBuffer> NormLaunch<'w, B> {
    fn new<R: GpuRuntime<Buffer = B>>(
        dtype: DType,
        weight: Option<&'w Tensor>,
        epsilon: f64,
        variance: usize,
    ) -> Result<Self, KernelError> {
        let weight = match weight {
            Some(w) => Some((device_buffer::<B>(w, "weight", R::MEMORY)?, w.offset(), w.dtype())),
            None => None,
        };
        Ok(NormLaunch { dtype, epsilon: ComputeScalar::new(dtype, epsilon), variance, weight })
    }

    /// Whether the weight allows the 16-byte path: none, one of another dtype than x (read with
    /// scalar loads in either path), or one of x's dtype at an aligned address.
    fn weight_vector_ok<R: GpuRuntime<Buffer = B>>(&self, hidden: usize) -> bool {
        self.weight.is_none_or(|(buffer, offset, weight_dtype)| {
            let rows = Rows { n_rows: 1, hidden, row_stride: hidden, offset };
            weight_dtype != self.dtype || vector_ok(&rows, self.dtype, R::base_alignment(buffer))
        })
    }

    fn key(&self, op: NormOp, hidden: usize, vectorized: bool) -> NormKey {
        NormKey { op, dtype: self.dtype, weight: self.weight.map(|(_, _, dtype)| dtype), vectorized, hidden }
    }

    /// Launches a norm kernel over `rows` (the rows it normalizes): `first` and `second` are its two
    /// row buffers (`rms_norm`: the output, then x; `fused_add_rms_norm`: x, then the residual) and
    /// `strides` the two row strides in prototype order (`rms_norm`: x's, then the output's).
    fn launch<R: GpuRuntime<Buffer = B>>(
        &self,
        queue: &R::Queue,
        (kernel, shape): (R::Kernel, NormShape),
        rows: &Rows,
        first: BufferArg<'_, B>,
        second: BufferArg<'_, B>,
        strides: [usize; 2],
    ) -> Result<(), KernelError> {
        let mut args = KernelArgs::new();
        args.buffer(first).buffer(second);
        match self.weight {
            Some((buffer, offset, dtype)) => args.read(buffer, offset, dtype),
            None => args.null(),
        };
        args.compute(self.epsilon)
            .long(kernel_int(rows.n_rows, "rows")?)
            .int(kernel_int(rows.hidden, "hidden size")?)
            .int(kernel_int(self.variance, "variance_size")?)
            .long(kernel_int(strides[0], "row stride")?)
            .long(kernel_int(strides[1], "row stride")?);
        let groups = rows.n_rows.div_ceil(shape.rows_per_group as usize);
        let grid = Grid { groups, group_size: shape.group_size, what: "rows" };
        // SAFETY: the arguments follow the norm prototypes (`run_rms_norm`,
        // `run_fused_add_rms_norm`), each integer converted without loss by `kernel_int`. Every
        // buffer covers the rows it is given for: each tensor's layout was checked against its
        // storage (checked arithmetic) when it was built and the rows come from that layout; the
        // weight holds `hidden` unit-stride elements from its offset (the predicate). The buffers
        // the kernel writes are passed as written (a fresh output, or the call's uniquely owned
        // activations), and without a weight the null one is never read (the kernel is the
        // no-weight variant).
        unsafe { R::launch(queue, &kernel, grid, args) }
    }
}

/// `rms_norm` on runtime `R`: a fresh output with x's layout made compact-in-order
/// ([`Layout::copy_layout`]). The kernel is `rms_norm_<variant>(elem_t* out, const elem_t* x,
/// const welem_t* weight, compute_t epsilon, long long n_rows, int hidden, int variance, long long
/// x_row_stride, long long out_row_stride)`, its variant chosen by [`GpuRuntime::norm_kernel`].
pub fn run_rms_norm<R: GpuRuntime>(
    x: &Tensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
) -> Result<Tensor, KernelError> {
    let dtype = x.dtype();
    let x_rows = Rows::for_kernel(x.meta())?;
    let variance = norm_variance(variance_size, x_rows.hidden)?;
    let x_buffer = device_buffer::<R::Buffer>(x, "x", R::MEMORY)?;
    let out_layout = x.layout().copy_layout();
    let out_rows = Rows::for_kernel(&TensorMeta { layout: out_layout.clone(), ..x.meta().clone() })?;
    let queue = R::queue(x_buffer)?;
    let mut out = R::allocate(x_buffer, &queue, out_layout.storage_end() * dtype.size_in_bytes())?;
    if x_rows.n_rows > 0 && x_rows.hidden > 0 {
        let norm = NormLaunch::new::<R>(dtype, weight, epsilon, variance)?;
        let vectorized = vector_ok(&x_rows, dtype, R::base_alignment(x_buffer))
            && vector_ok(&out_rows, dtype, R::base_alignment(&out))
            && norm.weight_vector_ok::<R>(x_rows.hidden);
        let kernel = R::norm_kernel(x_buffer, &norm.key(NormOp::RmsNorm, x_rows.hidden, vectorized))?;
        let size = dtype.size_in_bytes();
        let out_arg = BufferArg::Write { buffer: &mut out, offset: out_rows.offset, element_size: size };
        let x_arg = BufferArg::Read { buffer: x_buffer, offset: x_rows.offset, element_size: size };
        let strides = [x_rows.row_stride, out_rows.row_stride];
        norm.launch::<R>(&queue, kernel, &x_rows, out_arg, x_arg, strides)?;
    }
    Ok(Tensor::from_storage(Storage::Device(Box::new(out)), dtype, out_layout)?)
}

/// `fused_add_rms_norm` on runtime `R`, in place: `residual ← x + residual`, `x ← norm(sum)`. The
/// kernel is `fused_add_rms_norm_<variant>(elem_t* x, elem_t* residual, const welem_t* weight,
/// compute_t epsilon, long long n_rows, int hidden, int variance, long long x_row_stride, long long
/// residual_row_stride)`. With `dtype` rounding (`round_sum`) the residual holds the rounded sum
/// after the first launch and a second launch, in order on the same queue, writes its `rms_norm`
/// into x: this provider's norm of the rounded sum.
pub fn run_fused_add_rms_norm<R: GpuRuntime>(
    mut x: UniqueTensor,
    mut residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    round_sum: bool,
) -> Result<(Tensor, Tensor), KernelError> {
    let dtype = x.tensor().dtype();
    let x_rows = Rows::for_kernel(x.tensor().meta())?;
    let r_rows = Rows::for_kernel(residual.tensor().meta())?;
    let variance = norm_variance(variance_size, x_rows.hidden)?;
    if x_rows.n_rows > 0 && x_rows.hidden > 0 {
        let norm = NormLaunch::new::<R>(dtype, weight, epsilon, variance)?;
        let x_buffer = device_buffer_mut::<R::Buffer>(&mut x, "x", R::MEMORY)?;
        let r_buffer = device_buffer_mut::<R::Buffer>(&mut residual, "x_residual", R::MEMORY)?;
        let vectorized = vector_ok(&x_rows, dtype, R::base_alignment(x_buffer))
            && vector_ok(&r_rows, dtype, R::base_alignment(r_buffer))
            && norm.weight_vector_ok::<R>(x_rows.hidden);
        let queue = R::queue(x_buffer)?;
        let size = dtype.size_in_bytes();
        let kernel = R::norm_kernel(x_buffer, &norm.key(NormOp::FusedAddRmsNorm, x_rows.hidden, vectorized))?;
        let x_arg = BufferArg::Write { buffer: &mut *x_buffer, offset: x_rows.offset, element_size: size };
        let r_arg = BufferArg::Write { buffer: &mut *r_buffer, offset: r_rows.offset, element_size: size };
        norm.launch::<R>(&queue, kernel, &x_rows, x_arg, r_arg, [x_rows.row_stride, r_rows.row_stride])?;
        if round_sum {
            let kernel = R::norm_kernel(x_buffer, &norm.key(NormOp::RmsNorm, r_rows.hidden, vectorized))?;
            let out_arg = BufferArg::Write { buffer: x_buffer, offset: x_rows.offset, element_size: size };
            let sum_arg = BufferArg::Read { buffer: &*r_buffer, offset: r_rows.offset, element_size: size };
            norm.launch::<R>(&queue, kernel, &r_rows, out_arg, sum_arg, [r_rows.row_stride, x_rows.row_stride])?;
        }
    }
    Ok((x.into_tensor(), residual.into_tensor()))
}

/// Which strided kernel a copy, conversion or `add`/`mul` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StridedKey {
    /// `strided_copy_<bytes>` for elements of this dtype (moved as unsigned integers of its size).
    Copy {
        /// The elements' dtype.
        dtype: DType,
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
            StridedKey::Copy { dtype } => {
                COPY_SYMBOLS.iter().find(|(bytes, _)| *bytes == dtype.size_in_bytes()).map(|(_, name)| *name)
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
const COPY_SYMBOLS: [(usize, &str); 4] =
    [(1, "strided_copy_1"), (2, "strided_copy_2"), (4, "strided_copy_4"), (8, "strided_copy_8")];

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
            let key = StridedKey::Copy { dtype: src.dtype };
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

/// The strided operations of a backend's `impl DeviceBuffer` over runtime `$runtime`
/// ([`copy_strided`], [`convert_strided`], [`binary_strided`]), written inside the impl block:
/// `kernel_support::strided_on_device!(Cuda);`.
#[macro_export]
macro_rules! strided_on_device {
    ($runtime:ty) => {
        /// On the device (the strided copy kernel, one launch per
        /// [`CopyDims::pieces`](kernel_support::CopyDims::pieces), so any rank) when `dst` is
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
    Ok(Grid { groups: n.div_ceil(R::COPY_GROUP as usize), group_size: R::COPY_GROUP, what: "elements" })
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
    for piece in pieces {
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

/// What every quantization launch starts from: x's rows and buffer, the call's queue and the fresh
/// compact q (x's shape in `out_dtype`).
struct QuantStart<'a, R: GpuRuntime> {
    rows: Rows,
    x: &'a R::Buffer,
    queue: R::Queue,
    q: R::Buffer,
}

impl<'a, R: GpuRuntime> QuantStart<'a, R> {
    fn new(x: &'a Tensor, out_dtype: DType) -> Result<Self, KernelError> {
        let rows = Rows::for_kernel(x.meta())?;
        let x_buffer = device_buffer::<R::Buffer>(x, "x", R::MEMORY)?;
        let queue = R::queue(x_buffer)?;
        let q = R::allocate(x_buffer, &queue, x.numel() * out_dtype.size_in_bytes())?;
        Ok(QuantStart { rows, x: x_buffer, queue, q })
    }
}

/// A fresh compact device tensor over `buffer`.
fn compact<B: DeviceBuffer>(buffer: B, dtype: DType, shape: &[usize]) -> Result<Tensor, KernelError> {
    Ok(Tensor::from_storage(Storage::Device(Box::new(buffer)), dtype, Layout::compact(shape))?)
}

fn quant_grid<R: GpuRuntime>(rows: &Rows) -> Grid {
    Grid { groups: rows.n_rows, group_size: R::QUANT_GROUP, what: "rows" }
}

/// `static_scaled_fp8_quant` on runtime `R`: a fresh compact output in `out_dtype`, one group of
/// [`GpuRuntime::QUANT_GROUP`] per row; the scale stays on the device, where the kernel reads it.
/// The kernel is `static_scaled_fp8_quant_<dtype>(unsigned char* q, const elem_t* x, long long
/// n_rows, int hidden, long long x_row_stride, const float* scale, int format)`.
pub fn run_static_quant<R: GpuRuntime>(x: &Tensor, scale: &Tensor, out_dtype: DType) -> Result<Tensor, KernelError> {
    let format = fp8_format_code(out_dtype)?;
    let QuantStart::<R> { rows, x: x_buffer, queue, mut q } = QuantStart::new(x, out_dtype)?;
    if rows.n_rows > 0 && rows.hidden > 0 {
        let scale_buffer = device_buffer::<R::Buffer>(scale, "scale", R::MEMORY)?;
        let kernel = STATIC_SCALED_FP8_QUANT.name;
        let kernel = R::kernel(x_buffer, KernelKey::Quant { kernel, dtype: x.dtype() })?;
        let RowArgs { n_rows, hidden, row_stride, .. } = rows.kernel_args()?;
        let mut args = KernelArgs::new();
        args.write(&mut q, 0, out_dtype)
            .read(x_buffer, rows.offset, x.dtype())
            .long(n_rows)
            .int(hidden)
            .long(row_stride)
            .read(scale_buffer, scale.offset(), DType::F32)
            .int(format);
        // SAFETY: the arguments follow the prototype above, each integer converted without loss by
        // `Rows::kernel_args`. x's rows lie inside its buffer (its layout was checked against its
        // storage, and the rows come from that layout); the scale is one f32 element at its
        // offset; `q` holds n_rows · hidden bytes, written densely, and is held only here.
        unsafe { R::launch(&queue, &kernel, quant_grid::<R>(&rows), args) }?;
    }
    compact(q, out_dtype, x.shape())
}

/// `dynamic_per_token_scaled_fp8_quant` on runtime `R`: fresh compact `(q, scales)`, one group per
/// row. The kernel is `dynamic_per_token_scaled_fp8_quant_<dtype>(unsigned char* q, float* scales,
/// const elem_t* x, long long n_rows, int hidden, long long x_row_stride, const float* scale_ub,
/// int has_ub, int format)`.
pub fn run_dynamic_quant<R: GpuRuntime>(
    x: &Tensor,
    scale_ub: Option<&Tensor>,
    out_dtype: DType,
) -> Result<(Tensor, Tensor), KernelError> {
    let format = fp8_format_code(out_dtype)?;
    let QuantStart::<R> { rows, x: x_buffer, queue, mut q } = QuantStart::new(x, out_dtype)?;
    if rows.hidden == 0 && rows.n_rows > 0 {
        // No element to reduce: every scale is the floor.
        return Ok((compact(q, out_dtype, x.shape())?, floor_scales(x, out_dtype)?));
    }
    let mut scales = R::allocate(x_buffer, &queue, rows.n_rows * DType::F32.size_in_bytes())?;
    if rows.n_rows > 0 {
        let ub_buffer = scale_ub.map(|t| device_buffer::<R::Buffer>(t, "scale_ub", R::MEMORY)).transpose()?;
        let kernel = DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT.name;
        let kernel = R::kernel(x_buffer, KernelKey::Quant { kernel, dtype: x.dtype() })?;
        let RowArgs { n_rows, hidden, row_stride, .. } = rows.kernel_args()?;
        let mut args = KernelArgs::new();
        args.write(&mut q, 0, out_dtype)
            .write(&mut scales, 0, DType::F32)
            .read(x_buffer, rows.offset, x.dtype())
            .long(n_rows)
            .int(hidden)
            .long(row_stride);
        match (ub_buffer, scale_ub) {
            (Some(buffer), Some(ub)) => args.read(buffer, ub.offset(), DType::F32),
            _ => args.null(),
        };
        args.int(i32::from(scale_ub.is_some())).int(format);
        // SAFETY: as in `run_static_quant`; `scales` holds n_rows f32 values, one written per row,
        // and `scale_ub` is read only when `has_ub` is 1.
        unsafe { R::launch(&queue, &kernel, quant_grid::<R>(&rows), args) }?;
    }
    let scales = compact(scales, DType::F32, &per_token_scales_shape(x.shape()))?;
    Ok((compact(q, out_dtype, x.shape())?, scales))
}

/// The four norm + quantization ops on runtime `R`: fresh compact outputs, one group per row. The
/// kernel is `norm_quant_<dtype>(unsigned char* q, float* scales, elem_t* residual_out, const
/// elem_t* x, const elem_t* r, const elem_t* w, long long n_rows, int hidden, long long
/// x_row_stride, long long r_row_stride, long long out_row_stride, compute_t eps, const float*
/// scale, int has_residual, int has_weight, int dynamic, int has_scale, int format)`.
pub fn run_norm_quant<R: GpuRuntime>(call: NormQuantCall<'_>) -> Result<NormQuantOutputs, KernelError> {
    let NormQuantCall { x, mut residual, weight, epsilon, scale, dynamic, out_dtype } = call;
    let format = fp8_format_code(out_dtype)?;
    let dtype = x.dtype();
    let QuantStart::<R> { rows, x: x_buffer, queue, mut q } = QuantStart::new(x, out_dtype)?;
    let mut residual_out = match &residual {
        Some(NormQuantResidual::Read(_)) => Some(R::allocate(x_buffer, &queue, x.numel() * dtype.size_in_bytes())?),
        _ => None,
    };
    let mut scales = if dynamic { Some(R::allocate(x_buffer, &queue, rows.n_rows * 4)?) } else { None };
    if rows.n_rows > 0 && rows.hidden > 0 {
        let residual_rows = residual.as_ref().map(|r| Rows::for_kernel(r.tensor().meta())).transpose()?;
        let weight_buffer = weight.map(|w| device_buffer::<R::Buffer>(w, "weight", R::MEMORY)).transpose()?;
        let scale_param = if dynamic { "scale_ub" } else { "scale" };
        let scale_buffer = scale.map(|s| device_buffer::<R::Buffer>(s, scale_param, R::MEMORY)).transpose()?;
        let kernel = R::kernel(x_buffer, KernelKey::Quant { kernel: NORM_QUANT_KERNEL, dtype })?;
        let RowArgs { n_rows, hidden, row_stride: x_stride, .. } = rows.kernel_args()?;
        let r_stride = residual_rows.map(|r| r.kernel_args()).transpose()?.map_or(0, |r| r.row_stride);
        let flags = [residual.is_some(), weight.is_some(), dynamic, scale.is_some()].map(i32::from);
        let mut args = KernelArgs::new();
        args.write(&mut q, 0, out_dtype);
        match scales.as_mut() {
            Some(scales) => args.write(scales, 0, DType::F32),
            None => args.null(),
        };
        // A fresh residual output is compact; in place, the sum goes into the residual's own rows
        // (argument 4, `r`).
        let out_stride = match (residual_out.as_mut(), residual.is_some()) {
            (Some(out), _) => {
                args.write(out, 0, dtype);
                i64::from(hidden)
            }
            (None, true) => {
                args.alias(4);
                r_stride
            }
            (None, false) => {
                args.null();
                0
            }
        };
        args.read(x_buffer, rows.offset, dtype);
        match (&mut residual, residual_rows) {
            (Some(NormQuantResidual::Read(r)), Some(r_rows)) => {
                args.read(device_buffer::<R::Buffer>(r, "x_residual", R::MEMORY)?, r_rows.offset, dtype)
            }
            (Some(NormQuantResidual::InPlace(r)), Some(r_rows)) => {
                args.write(device_buffer_mut::<R::Buffer>(r, "x_residual", R::MEMORY)?, r_rows.offset, dtype)
            }
            _ => args.null(),
        };
        match (weight_buffer, weight) {
            (Some(buffer), Some(w)) => args.read(buffer, w.offset(), dtype),
            _ => args.null(),
        };
        args.long(n_rows).int(hidden).long(x_stride).long(r_stride).long(out_stride);
        args.compute(ComputeScalar::new(dtype, epsilon));
        match (scale_buffer, scale) {
            (Some(buffer), Some(s)) => args.read(buffer, s.offset(), DType::F32),
            _ => args.null(),
        };
        for flag in flags {
            args.int(flag);
        }
        args.int(format);
        // SAFETY: the arguments follow the prototype above, each integer converted without loss by
        // `Rows::kernel_args`. x's and the residual's rows lie inside their buffers (their layouts
        // were checked against their storage); the weight holds `hidden` unit-stride elements of
        // x's dtype from its offset (the predicate); the scale is one f32 element. `q` holds
        // n_rows · hidden elements written densely, `scales` n_rows; the residual output is a fresh
        // compact buffer of n_rows · hidden elements or, in place, the residual's own rows
        // (uniquely owned: the call's activation, passed as written; each element read before the
        // same thread writes it, only in the last pass). A null buffer is never dereferenced: its
        // flag is 0.
        unsafe { R::launch(&queue, &kernel, quant_grid::<R>(&rows), args) }?;
    }
    let residual_out = residual_out.map(|r| compact(r, dtype, x.shape())).transpose()?;
    let scales = match scales {
        Some(_) if rows.hidden == 0 && rows.n_rows > 0 => Some(floor_scales(x, out_dtype)?),
        Some(s) => Some(compact(s, DType::F32, &per_token_scales_shape(x.shape()))?),
        None => None,
    };
    Ok(NormQuantOutputs { q: compact(q, out_dtype, x.shape())?, scales, residual_out })
}

/// The norm + quantization kernel's name ([`QUANT_KERNELS`]' last).
pub const NORM_QUANT_KERNEL: &str = QUANT_KERNELS[2];

/// A storage offset a kernel integer carried back to an element index.
fn offset(value: i64) -> Result<usize, KernelError> {
    usize::try_from(value).map_err(|_| crate::out_of_range("storage offset", value, 0, isize::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RotaryLaunch;

    #[test]
    fn grids_past_each_backend_limit_are_errors_naming_what_they_count() {
        let grid = |groups: usize, group_size: u32| Grid { groups, group_size, what: "rows" };
        assert_eq!(grid(i32::MAX as usize, 256).cuda_blocks().unwrap(), i32::MAX as u32);
        assert!(matches!(
            grid(i32::MAX as usize + 1, 256).cuda_blocks(),
            Err(KernelError::GridLimit { what: "rows", count }) if count == i32::MAX as usize + 1
        ));
        // HIP: 2^24 rows of 256 work-items is 2^32 work-items, one past the limit.
        assert_eq!(grid((1 << 24) - 1, 256).hip_blocks().unwrap(), (1 << 24) - 1);
        assert!(matches!(grid(1 << 24, 256).hip_blocks(), Err(KernelError::GridLimit { what: "rows", .. })));
        assert!(grid(1 << 32, 1).hip_blocks().is_err());
        assert_eq!(grid(1 << 24, 256).global_work_size().unwrap(), 1 << 32);
        assert!(grid(usize::MAX, 2).global_work_size().is_err());
    }

    /// Describes each argument as a backend would pass it.
    fn describe(args: KernelArgs<'_, u8>) -> Result<Vec<String>, KernelError> {
        let resolved = args.resolve(|arg| {
            Ok(match arg {
                BufferArg::Read { buffer, offset, element_size } => format!("read {buffer} {offset} {element_size}"),
                BufferArg::Write { buffer, offset, element_size } => format!("write {buffer} {offset} {element_size}"),
                BufferArg::Null => "null".to_owned(),
            })
        })?;
        Ok(resolved
            .into_iter()
            .map(|r| match r {
                Resolved::Buffer(b) => b,
                Resolved::Scalar(s) => format!("{s:?}"),
            })
            .collect())
    }

    #[test]
    fn arguments_keep_prototype_order_and_types() {
        let (a, mut b) = (1u8, 2u8);
        let mut args = KernelArgs::new();
        args.alias(1)
            .read(&a, 3, DType::BF16)
            .write(&mut b, 4, DType::F32)
            .null()
            .int(5)
            .long(6)
            .compute(ComputeScalar::new(DType::F64, 0.5))
            .compute(ComputeScalar::new(DType::BF16, 0.5))
            .alias(2);
        assert_eq!(args.len(), 9);
        assert_eq!(
            describe(args).unwrap(),
            [
                "read 1 3 2",
                "read 1 3 2",
                "write 2 4 4",
                "null",
                "I32(5)",
                "I64(6)",
                "F64(0.5)",
                "F32(0.5)",
                "write 2 4 4"
            ]
        );
    }

    #[test]
    fn an_alias_must_name_a_buffer() {
        for (position, of) in [(1, 0), (1, 1), (1, 7), (2, 1)] {
            let mut args = KernelArgs::<u8>::new();
            args.int(0);
            for _ in 1..position {
                args.alias(1);
            }
            args.alias(of);
            let error = describe(args).unwrap_err().to_string();
            assert!(error.contains("not a buffer"), "alias at {position} of {of}: {error}");
        }
    }

    /// Host memory standing in for a device's: lets the family host code run without a device.
    #[derive(Debug)]
    struct HostBuffer(Vec<u8>, usize);

    impl DeviceBuffer for HostBuffer {
        fn device(&self) -> ir_core::Device {
            ir_core::Device::Cuda(0)
        }
        fn len_bytes(&self) -> usize {
            self.0.len()
        }
        fn download(&self, dst: &mut [u8]) -> Result<(), ir_core::storage::DeviceError> {
            dst.copy_from_slice(&self.0);
            Ok(())
        }
        fn upload(&mut self, src: &[u8]) -> Result<(), ir_core::storage::DeviceError> {
            self.0[..src.len()].copy_from_slice(src);
            Ok(())
        }
        fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, ir_core::storage::DeviceError> {
            Ok(Box::new(HostBuffer(vec![0; len_bytes], 256)))
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }

    /// What one launch was given.
    #[derive(Debug, PartialEq)]
    struct Launched {
        symbol: String,
        grid: Grid,
        args: Vec<String>,
    }

    thread_local! {
        static LAUNCHES: std::cell::RefCell<Vec<Launched>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// A runtime that records each launch instead of running it.
    struct Recorder;

    impl GpuRuntime for Recorder {
        const BACKEND: &'static str = "recorder";
        const MEMORY: &'static str = "host-standing-in";
        const GATED_GROUP: u32 = 64;
        const QUANT_GROUP: u32 = 32;
        const COPY_GROUP: u32 = 16;
        type Buffer = HostBuffer;
        type Queue = ();
        type Kernel = String;

        fn queue(_first: &HostBuffer) -> Result<(), KernelError> {
            Ok(())
        }
        fn allocate(_like: &HostBuffer, _queue: &(), len_bytes: usize) -> Result<HostBuffer, KernelError> {
            Ok(HostBuffer(vec![0; len_bytes], 256))
        }
        fn kernel(_like: &HostBuffer, key: KernelKey<'_>) -> Result<String, KernelError> {
            Ok(key.symbol())
        }
        fn norm_kernel(_like: &HostBuffer, key: &NormKey) -> Result<(String, NormShape), KernelError> {
            let NormKey { op, dtype, weight, vectorized, hidden } = key;
            let symbol = format!("{}_{dtype}_w{weight:?}_v{vectorized}_h{hidden}", op.name());
            Ok((symbol, NormShape { group_size: 128, rows_per_group: 4 }))
        }
        fn base_alignment(buffer: &HostBuffer) -> usize {
            buffer.1
        }
        fn strided_kernel(_like: &HostBuffer, key: StridedKey) -> Result<Option<String>, KernelError> {
            // No f64 conversions here, as on an OpenCL device without f64.
            let through_f64 = matches!(key, StridedKey::Convert { src: DType::F64, .. });
            Ok(key.symbol().filter(|_| !through_f64).map(str::to_owned))
        }
        unsafe fn copy_bytes(
            _queue: &(),
            from: &HostBuffer,
            from_offset: usize,
            to: &mut HostBuffer,
            to_offset: usize,
            bytes: usize,
        ) -> Result<(), KernelError> {
            to.0[to_offset..to_offset + bytes].copy_from_slice(&from.0[from_offset..from_offset + bytes]);
            let args = vec![format!("{} bytes @{from_offset} -> @{to_offset}: {bytes}", from.0.len())];
            let grid = Grid { groups: 0, group_size: 0, what: "bytes" };
            LAUNCHES.with(|l| l.borrow_mut().push(Launched { symbol: "copy_bytes".to_owned(), grid, args }));
            Ok(())
        }
        fn buffer_queue(_buffer: &HostBuffer) {}
        fn same_device(_a: &HostBuffer, _b: &HostBuffer) -> bool {
            true
        }
        unsafe fn launch(
            _queue: &(),
            kernel: &String,
            grid: Grid,
            args: KernelArgs<'_, HostBuffer>,
        ) -> Result<(), KernelError> {
            let args = args
                .resolve(|arg| {
                    Ok(match arg {
                        BufferArg::Read { buffer, offset, element_size } => {
                            format!("read {} bytes @{offset}x{element_size}", buffer.0.len())
                        }
                        BufferArg::Write { buffer, offset, element_size } => {
                            format!("write {} bytes @{offset}x{element_size}", buffer.0.len())
                        }
                        BufferArg::Null => "null".to_owned(),
                    })
                })?
                .into_iter()
                .map(|r| match r {
                    Resolved::Buffer(b) => b,
                    Resolved::Scalar(s) => format!("{s:?}"),
                })
                .collect();
            LAUNCHES.with(|l| l.borrow_mut().push(Launched { symbol: kernel.clone(), grid, args }));
            Ok(())
        }
    }

    fn on_host(dtype: DType, shape: &[usize], strides: &[usize], offset: usize, len: usize) -> Tensor {
        on_host_at(256, dtype, shape, strides, offset, len)
    }

    /// A tensor over memory whose first byte has `alignment`.
    fn on_host_at(
        alignment: usize,
        dtype: DType,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        len: usize,
    ) -> Tensor {
        let layout = ir_core::Layout::new(shape, strides, offset).unwrap();
        let buffer = HostBuffer(vec![0; len * dtype.size_in_bytes()], alignment);
        Tensor::from_storage(Storage::Device(Box::new(buffer)), dtype, layout).unwrap()
    }

    fn take_launches() -> Vec<Launched> {
        LAUNCHES.with(|l| std::mem::take(&mut *l.borrow_mut()))
    }

    #[test]
    fn gated_host_code_passes_the_prototype_for_a_strided_x() {
        // Three rows of 2d = 8 elements, 10 apart, from element 2 of a 40-element buffer.
        let x = on_host(DType::BF16, &[3, 8], &[10, 1], 2, 40);
        let op = GatedKernel { def: &ir_ops::gelu_and_mul::GELU_AND_MUL, source: "" };
        let out = run_gated::<Recorder>(&op, &[Value::Tensor(x), Value::Str("tanh".to_owned())]).unwrap();
        assert_eq!(out.shape(), [3, 4]);
        assert!(out.layout().is_compact_at_zero());
        let launches = take_launches();
        assert_eq!(
            launches,
            [Launched {
                symbol: "gelu_and_mul_bf16".to_owned(),
                grid: Grid { groups: 3, group_size: 64, what: "rows" },
                args: [
                    "write 24 bytes @0x2",
                    "read 80 bytes @2x2",
                    "I64(3)",
                    "I32(4)",
                    "I64(10)",
                    "I64(4)",
                    "F32(0.0)",
                    "F32(0.0)",
                    "I32(1)",
                    "I32(0)",
                ]
                .map(str::to_owned)
                .to_vec(),
            }]
        );
        // Nothing to compute: an output, no launch.
        let empty = on_host(DType::F32, &[0, 8], &[8, 1], 0, 0);
        let op = GatedKernel { def: &ir_ops::silu_and_mul::SILU_AND_MUL, source: "" };
        assert_eq!(run_gated::<Recorder>(&op, &[Value::Tensor(empty)]).unwrap().shape(), [0, 4]);
        assert!(take_launches().is_empty());
    }

    #[test]
    fn rotary_host_code_passes_offsets_and_a_null_key() {
        let positions = on_host(DType::I64, &[2], &[1], 1, 3);
        // Two tokens of 2 heads × 4, rows 12 apart from element 4; a cache of 16 rows of 4.
        let query = on_host(DType::F16, &[2, 8], &[12, 1], 4, 28);
        let cache = on_host(DType::F16, &[16, 4], &[4, 1], 0, 64);
        let launch = RotaryLaunch::of(&positions, &query, None, &cache, 4, 4, true).unwrap();
        let query = UniqueTensor::new(query).unwrap();
        let call =
            RotaryCall { positions: &positions, query, key: None, cos_sin_cache: &cache, launch, round_products: true };
        let (q, k) = run_rotary::<Recorder>(call).unwrap();
        assert_eq!((q.offset(), k.is_none()), (4, true));
        let launches = take_launches();
        assert_eq!(launches.len(), 1);
        assert_eq!(launches[0].symbol, "rotary_embedding_f16");
        assert_eq!(launches[0].grid, Grid { groups: 2, group_size: 32, what: "tokens" });
        let expected = [
            "write 56 bytes @4x2",
            "I64(12)",
            "null",
            "I64(0)",
            "I32(0)",
            "read 24 bytes @1x8",
            "read 128 bytes @0x2",
            "I64(4)",
            "I64(2)",
            "I32(2)",
            "I32(0)", // no key heads
            "I32(4)",
            "I32(4)",
            "I32(16)",
            "I32(1)",
            "I32(1)",
        ];
        assert_eq!(launches[0].args, expected.map(str::to_owned));
    }

    #[test]
    fn norm_quant_in_place_writes_the_sum_through_the_residual_itself() {
        // Two rows of 8, x compact, the residual padded to rows of 12; a static scale at offset 1.
        let x = on_host(DType::F16, &[2, 8], &[8, 1], 0, 16);
        let residual = on_host(DType::F16, &[2, 8], &[12, 1], 0, 20);
        let weight = on_host(DType::F16, &[8], &[1], 0, 8);
        let scale = on_host(DType::F32, &[1], &[1], 1, 2);
        let mut residual = UniqueTensor::new(residual).unwrap();
        let call = NormQuantCall {
            x: &x,
            residual: Some(NormQuantResidual::InPlace(&mut residual)),
            weight: Some(&weight),
            epsilon: 1e-6,
            scale: Some(&scale),
            dynamic: false,
            out_dtype: DType::F8E4M3FN,
        };
        let outputs = run_norm_quant::<Recorder>(call).unwrap();
        assert!(outputs.residual_out.is_none() && outputs.scales.is_none());
        let launches = take_launches();
        assert_eq!(launches.len(), 1);
        assert_eq!(launches[0].symbol, "norm_quant_f16");
        assert_eq!(launches[0].grid, Grid { groups: 2, group_size: 32, what: "rows" });
        let expected = [
            "write 16 bytes @0x1", // q
            "null",                // no scales
            "write 40 bytes @0x2", // the residual output: the residual's own rows
            "read 32 bytes @0x2",  // x
            "write 40 bytes @0x2", // the residual
            "read 16 bytes @0x2",  // the weight
            "I64(2)",
            "I32(8)",
            "I64(8)",
            "I64(12)",
            "I64(12)", // the output's rows are the residual's
            "F32(1e-6)",
            "read 8 bytes @1x4", // the scale
            "I32(1)",
            "I32(1)",
            "I32(0)",
            "I32(1)",
            "I32(0)", // e4m3
        ];
        assert_eq!(launches[0].args, expected.map(str::to_owned));
    }

    #[test]
    fn dynamic_quant_of_empty_rows_gives_floor_scales_without_a_launch() {
        let x = on_host(DType::BF16, &[3, 0], &[0, 1], 0, 0);
        let (q, scales) = run_dynamic_quant::<Recorder>(&x, None, DType::F8E5M2).unwrap();
        assert_eq!((q.shape(), scales.shape()), (&[3, 0][..], &[3, 1][..]));
        assert!(take_launches().is_empty());
    }

    #[test]
    fn rms_norm_takes_the_vector_path_only_where_every_address_allows_it() {
        let weight = on_host(DType::BF16, &[64], &[1], 0, 64);
        for (alignment, offset, stride, vectorized) in
            [(256, 0, 64, true), (256, 8, 72, true), (256, 2, 64, false), (8, 0, 64, false), (256, 0, 66, false)]
        {
            let x = on_host_at(alignment, DType::BF16, &[5, 64], &[stride, 1], offset, offset + 5 * stride);
            let out = run_rms_norm::<Recorder>(&x, Some(&weight), 1e-6, None).unwrap();
            assert_eq!(out.shape(), [5, 64]);
            let launches = take_launches();
            assert_eq!(launches.len(), 1);
            let label = format!("alignment {alignment}, offset {offset}, stride {stride}");
            assert_eq!(launches[0].symbol, format!("rms_norm_bf16_wSome(BF16)_v{vectorized}_h64"), "{label}");
            assert_eq!(launches[0].grid, Grid { groups: 2, group_size: 128, what: "rows" }, "{label}");
            let expected = [
                "write 640 bytes @0x2".to_owned(),
                format!("read {} bytes @{offset}x2", (offset + 5 * stride) * 2),
                "read 128 bytes @0x2".to_owned(),
                "F32(1e-6)".to_owned(),
                "I64(5)".to_owned(),
                "I32(64)".to_owned(),
                "I32(64)".to_owned(),
                format!("I64({stride})"),
                "I64(64)".to_owned(),
            ];
            assert_eq!(launches[0].args, expected, "{label}");
        }
        // A weight of another dtype is read with scalar loads either way; one of x's dtype must be
        // aligned too.
        let x = on_host(DType::BF16, &[5, 64], &[64, 1], 0, 320);
        let misaligned = on_host_at(2, DType::BF16, &[64], &[1], 0, 64);
        run_rms_norm::<Recorder>(&x, Some(&misaligned), 1e-6, None).unwrap();
        let f32_weight = on_host_at(4, DType::F32, &[64], &[1], 0, 64);
        run_rms_norm::<Recorder>(&x, Some(&f32_weight), 1e-6, Some(32)).unwrap();
        let launches = take_launches();
        assert!(launches[0].symbol.ends_with("_vfalse_h64"), "{}", launches[0].symbol);
        assert_eq!(launches[1].symbol, "rms_norm_bf16_wSome(F32)_vtrue_h64");
        assert_eq!(launches[1].args[6], "I32(32)", "variance_size");
    }

    #[test]
    fn fused_add_rms_norm_with_dtype_rounding_normalizes_the_stored_sum_in_a_second_launch() {
        let x = UniqueTensor::new(on_host(DType::F16, &[3, 16], &[16, 1], 0, 48)).unwrap();
        let residual = UniqueTensor::new(on_host(DType::F16, &[3, 16], &[24, 1], 8, 80)).unwrap();
        let (x, residual) = run_fused_add_rms_norm::<Recorder>(x, residual, None, 1e-5, None, true).unwrap();
        assert_eq!((x.offset(), residual.offset()), (0, 8));
        let launches = take_launches();
        let symbols: Vec<&str> = launches.iter().map(|l| l.symbol.as_str()).collect();
        assert_eq!(symbols, ["fused_add_rms_norm_f16_wNone_vtrue_h16", "rms_norm_f16_wNone_vtrue_h16"]);
        let buffers = |l: &Launched| (l.args[..3].to_vec(), l.args[7..].to_vec());
        let fused = ["write 96 bytes @0x2", "write 160 bytes @8x2", "null"].map(str::to_owned).to_vec();
        assert_eq!(buffers(&launches[0]), (fused, vec!["I64(16)".to_owned(), "I64(24)".to_owned()]));
        // The norm of the sum: into x, from the residual, strides in (x, out) order.
        let norm = ["write 96 bytes @0x2", "read 160 bytes @8x2", "null"].map(str::to_owned).to_vec();
        assert_eq!(buffers(&launches[1]), (norm, vec!["I64(24)".to_owned(), "I64(16)".to_owned()]));
    }

    #[test]
    fn address_alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(address_alignment(0x7f00_1234_5602), 2);
        assert_eq!(address_alignment(0x7f00_1234_5610), 16);
        assert_eq!(address_alignment(0x7f00_1234_5600), 256);
        assert_eq!(address_alignment(0), 256);
        let rows = Rows { n_rows: 4, hidden: 4096, row_stride: 4096, offset: 0 };
        assert!(!vector_ok(&rows, DType::BF16, address_alignment(0x7f00_1234_5602)), "2 bytes past alignment");
        assert!(!vector_ok(&rows, DType::F32, address_alignment(0x7f00_1234_5608)), "8-byte aligned only");
        assert!(vector_ok(&rows, DType::BF16, address_alignment(0x7f00_1234_5610)));
        assert!(!vector_ok(&rows, DType::F64, 256), "f64 rows launch with scalar accesses");
        assert!(!vector_ok(&rows, DType::F32, 0), "a backend without a host-chosen vector path");
        // A misaligned base made good by the offset is not taken.
        assert!(!vector_ok(&Rows { offset: 1, ..rows }, DType::BF16, address_alignment(0x7f00_1234_560e)));
        assert!(!vector_ok(&Rows { hidden: 4095, ..rows }, DType::BF16, 256), "H not a multiple of 8");
        assert!(!vector_ok(&Rows { row_stride: 4099, ..rows }, DType::BF16, 256), "row stride");
        assert!(vector_ok(&Rows { row_stride: 4100, offset: 4, ..rows }, DType::F32, 256));
    }

    fn storage_of(t: &mut Tensor) -> &mut dyn DeviceBuffer {
        match t.storage_mut().unwrap() {
            Storage::Device(buffer) => buffer.as_mut(),
            Storage::Cpu(_) => unreachable!("made on the recording runtime"),
        }
    }

    fn buffer_of(t: &Tensor) -> &HostBuffer {
        device_buffer::<HostBuffer>(t, "t", "host").unwrap()
    }

    #[test]
    fn strided_copies_conversions_and_binaries_pass_rank_dims_and_offsets() {
        // A transposed [4, 6] f16 view from element 2: no dimension merges, rank 2.
        let src = on_host(DType::F16, &[4, 6], &[1, 4], 2, 26);
        let mut dst = on_host(DType::F16, &[4, 6], &[6, 1], 0, 24);
        let pad = |v: &[i64], fill: i64| std::array::from_fn::<i64, 8, _>(|k| v.get(k).copied().unwrap_or(fill));
        let dims = format!(
            "I64(24) I32(2) {:?} {:?} {:?}",
            Scalar::I64x8(pad(&[4, 6], 1)),
            Scalar::I64x8(pad(&[1, 4], 0)),
            Scalar::I64x8(pad(&[6, 1], 0))
        );
        let dst_layout = dst.layout().clone();
        copy_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &dst_layout).unwrap();
        let meta = dst.meta().clone();
        let converted =
            convert_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &meta, Some(0.5)).unwrap();
        assert!(converted);
        let b = on_host(DType::F16, &[4, 6], &[6, 1], 0, 24);
        let op = BinaryOp::Mul;
        let added = binary_strided::<Recorder>(
            buffer_of(&src),
            src.meta(),
            buffer_of(&b),
            b.meta(),
            op,
            storage_of(&mut dst),
            &meta,
        )
        .unwrap();
        assert!(added);
        let launches = take_launches();
        let symbols: Vec<&str> = launches.iter().map(|l| l.symbol.as_str()).collect();
        assert_eq!(symbols, ["strided_copy_2", "strided_convert_f16_f16", "strided_mul_f16"]);
        for launch in &launches {
            assert_eq!(launch.grid, Grid { groups: 2, group_size: 16, what: "elements" }, "{}", launch.symbol);
        }
        let args = |l: &Launched, buffers: usize| (l.args[..buffers].join(" "), l.args[buffers..buffers + 5].join(" "));
        assert_eq!(args(&launches[0], 2), ("read 52 bytes @2x2 write 48 bytes @0x2".to_owned(), dims.clone()));
        assert_eq!(&launches[1].args[7..], ["F32(0.5)", "I32(1)"]);
        assert_eq!(
            args(&launches[2], 3),
            ("read 52 bytes @2x2 read 48 bytes @0x2 write 48 bytes @0x2".to_owned(), dims.clone())
        );
        // No kernel for the pair: nothing launched, the caller converts on the host.
        let wide = on_host(DType::F64, &[4, 6], &[6, 1], 0, 24);
        let none = convert_strided::<Recorder>(buffer_of(&wide), wide.meta(), storage_of(&mut dst), &meta, None);
        assert!(!none.unwrap());
        // Nothing to copy: no launch.
        let empty = on_host(DType::F16, &[0, 6], &[6, 1], 0, 0);
        let mut empty_dst = on_host(DType::F16, &[0, 6], &[6, 1], 0, 0);
        let layout = empty_dst.layout().clone();
        copy_strided::<Recorder>(buffer_of(&empty), empty.meta(), storage_of(&mut empty_dst), &layout).unwrap();
        assert!(take_launches().is_empty());
    }

    #[test]
    fn a_copy_of_one_compact_range_into_another_is_a_memcpy() {
        // A compact [4, 6] f16 view from element 2, into a compact destination: 48 bytes.
        let mut src = on_host(DType::F16, &[4, 6], &[6, 1], 2, 26);
        if let Storage::Device(buffer) = src.storage_mut().unwrap() {
            buffer.upload(&(0..52).collect::<Vec<u8>>()).unwrap();
        }
        let mut dst = on_host(DType::F16, &[4, 6], &[6, 1], 0, 24);
        let layout = dst.layout().clone();
        copy_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &layout).unwrap();
        let launches = take_launches();
        assert_eq!(launches.len(), 1);
        assert_eq!(
            (launches[0].symbol.as_str(), launches[0].args[0].as_str()),
            ("copy_bytes", "52 bytes @4 -> @0: 48")
        );
        assert_eq!(buffer_of(&dst).0, (4..52).collect::<Vec<u8>>(), "the bytes moved");
        // Into row-padded rows, or converting: kernels, not a memcpy.
        let mut padded = on_host(DType::F16, &[4, 6], &[8, 1], 0, 32);
        let layout = padded.layout().clone();
        copy_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut padded), &layout).unwrap();
        let meta = dst.meta().clone();
        convert_strided::<Recorder>(buffer_of(&src), src.meta(), storage_of(&mut dst), &meta, None).unwrap();
        let symbols: Vec<String> = take_launches().into_iter().map(|l| l.symbol).collect();
        assert_eq!(symbols, ["strided_copy_2", "strided_convert_f16_f16"]);
    }

    #[test]
    fn kernel_symbols_are_op_then_dtype() {
        assert_eq!(KernelKey::Rotary { dtype: DType::BF16 }.symbol(), "rotary_embedding_bf16");
        let op = GatedKernel { def: &ir_ops::silu_and_mul::SILU_AND_MUL, source: "" };
        assert_eq!(KernelKey::Gated { op: &op, dtype: DType::F16 }.symbol(), "silu_and_mul_f16");
    }
}
