//! The norms' host code and the choice of their 16-byte path.

use ir_core::storage::{DeviceBuffer, Storage};
use ir_core::{DType, KernelError, Tensor, TensorMeta, UniqueTensor};

use super::{BufferArg, GpuRuntime, Grid, KernelArgs};
use crate::{ComputeScalar, NormOp, Rows, device_buffer, device_buffer_mut, kernel_int, norm_variance};

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
    let width = crate::gpu_chunk(dtype);
    norm_vectorizes(dtype)
        && base_aligned(base_alignment)
        && (rows.offset * size).is_multiple_of(16)
        && rows.hidden.is_multiple_of(width)
        && (rows.n_rows <= 1 || rows.row_stride.is_multiple_of(width))
}

/// Whether a buffer whose first byte has `base_alignment` ([`GpuRuntime::base_alignment`]; 0 for a
/// backend without 16-byte paths) starts 16-byte aligned.
pub fn base_aligned(base_alignment: usize) -> bool {
    base_alignment > 0 && base_alignment.is_multiple_of(16)
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
        // One group of rows per block: no grid-stride loop in the norm kernels.
        let grid = Grid { groups, group_size: shape.group_size, what: "rows", grid_stride: false };
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
/// ([`Layout::copy_layout`](ir_core::Layout::copy_layout)). The kernel is `rms_norm_<variant>(elem_t* out, const elem_t* x,
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
