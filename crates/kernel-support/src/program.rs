//! Row programs as CUDA/HIP source: one kernel generated from a program ([`ir_ops::row_program`])
//! for a call's dtypes, compiled after the shared headers (`kernels/gpu/compute.h`, `elem.h`,
//! `fp8.h`) and a backend's portability header, like the hand-written kernels.
//!
//! The kernel computes in the passes of [`RowProgram::schedule`], laid over its threads as its
//! [`RowShape`] says (`GPU_ROWS` over the blocks: one per block on CUDA, a grid-stride loop on
//! HIP). In each pass a thread computes, per column it owns, every element step the pass needs
//! into registers, one fused loop: a value goes from its load to its store or reduction without
//! touching memory. A reduction keeps a partial per thread, in its columns' order (a sum in
//! `double`, so a mean far from zero keeps its bits), combined by a fixed tree, so the bits do not
//! depend on scheduling.
//!
//! - [`RowShape::Chunks`], every program but a rotary one: the hand-written norms' layout. A row
//!   has `threads_per_row` threads; each owns whole chunks of 16 bytes of the first activation's
//!   dtype (chunk `c` on thread `c mod threads_per_row`), keeps the first [`cached_chunks`] of each
//!   activation stream in registers from the pass that first reads it (their loads all issued
//!   before the first is used; the weights' loads issued a group ahead of their use), loads and
//!   stores whole chunks 16 bytes at a time where the host found every buffer aligned, and combines
//!   a reduction by butterfly shuffles then the row's warps in order. The sums of squares are so
//!   the hand-written `rms_norm`'s and `fused_add_rms_norm`'s, bit for bit.
//! - [`RowShape::Walk`], rotary programs: one row per block of [`ROW_BLOCK`] threads, each walking
//!   its columns (`j = threadIdx.x, j + ROW_BLOCK, ...`; a rotary program walks pairs), a reduction
//!   combined by `block_reduce`'s tree (`elem.h`).
//!
//! Row values are `double`, rounded as the program says (the reference's row arithmetic); element
//! values are the compute type (`float`, `double` for f64 activations), each operation one
//! correctly rounded `c_*` call of the portability header, so a `compute` step is the reference's
//! and a `wide` element step is computed in the compute type (within the op's tolerance). Outputs
//! are fresh and compact, or written into their activations ([`Binding::in_place`]).
//!
//! Not generated (an error names it): a step that rounds to an fp8 dtype (fp8 is a store's dtype),
//! a constant that is not finite, a reduction counted by anything but a scalar parameter.

use std::fmt::Write as _;

mod cache;
#[cfg(test)]
mod tests;
pub use cache::DiskCache;

use ir_core::DType;
use ir_ops::row_program::{
    BinaryOp, Binding, Extent, InputKind, Op, Precision, ReduceOp, RowProgram, UnaryOp, ValueId,
};

/// Threads per block of a generated kernel (a power of two: `block_reduce`'s tree).
pub const ROW_BLOCK: u32 = 256;

/// The weight chunks a thread of a [`RowShape::Chunks`] kernel loads ahead of their use, so a
/// weight costs one memory round trip per group of chunks (the hand-written norms' bound).
const WEIGHT_AHEAD: u32 = 8;

/// How a generated CUDA/HIP kernel lays a call's rows over its threads. Part of the kernel's
/// [`Signature`]: the launch follows it ([`RowShape::block`], [`RowShape::groups`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowShape {
    /// One row per block of [`ROW_BLOCK`] threads, each walking its columns `j = thread, thread +
    /// ROW_BLOCK, ...` (a rotary program walks pairs), reductions by `block_reduce`'s tree: the
    /// layout of rotary programs and of every OpenCL kernel.
    Walk,
    /// The hand-written norms' layout: `threads_per_row` threads per row (a power of two), each
    /// owning whole chunks of 16 bytes of the first activation's dtype (chunk `c` on thread `c mod
    /// threads_per_row`, its elements in order), the chunks of a row a thread keeps in registers
    /// loaded before the first is used, and each reduction combined by butterfly shuffles then the
    /// row's warps in order. So a reduction's bits are the hand-written kernel's, whatever the
    /// access width. `vectorized`: every chunk is whole and loaded and stored 16 bytes (fewer
    /// for narrower dtypes) at a time, which the host decides from each buffer's alignment.
    Chunks {
        /// Threads cooperating on a row.
        threads_per_row: u32,
        /// Whether chunks are loaded and stored whole.
        vectorized: bool,
    },
}

impl RowShape {
    /// The shape of a call of `program` bound as `binding` on CUDA or HIP: [`RowShape::Walk`] for a
    /// rotary program (its pairs cross chunks), else [`RowShape::Chunks`] with the hand-written
    /// norms' threads per row for the width ([`gpu_threads_per_row`](crate::gpu_threads_per_row)),
    /// whole chunks when `aligned` (the host's check of every buffer) and no buffer is f64.
    pub fn for_call(program: &RowProgram, binding: &Binding, aligned: bool) -> RowShape {
        if program.rotary_cache().is_some() {
            return RowShape::Walk;
        }
        let f64_buffer = binding.dtypes.iter().flatten().any(|&d| d == DType::F64) || binding.compute == DType::F64;
        RowShape::Chunks {
            threads_per_row: crate::gpu_threads_per_row(binding.width),
            vectorized: aligned && !f64_buffer,
        }
    }

    /// Threads per block: [`ROW_BLOCK`] for a walk, else the hand-written norms' block (256 above
    /// 128 threads per row, else 128).
    pub fn block(&self) -> u32 {
        match *self {
            RowShape::Walk => ROW_BLOCK,
            RowShape::Chunks { threads_per_row, .. } if threads_per_row > 128 => 256,
            RowShape::Chunks { .. } => 128,
        }
    }

    /// Rows one block computes.
    pub fn rows_per_block(&self) -> u32 {
        match *self {
            RowShape::Walk => 1,
            RowShape::Chunks { threads_per_row, .. } => self.block() / threads_per_row,
        }
    }

    /// The blocks that cover `rows` rows.
    pub fn groups(&self, rows: usize) -> usize {
        rows.div_ceil(self.rows_per_block() as usize)
    }
}

impl std::fmt::Display for RowShape {
    /// `walk`, `32 threads per row, 16-byte`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RowShape::Walk => write!(f, "walk"),
            RowShape::Chunks { threads_per_row, vectorized } => {
                let access = if vectorized { "16-byte" } else { "scalar" };
                write!(f, "{threads_per_row} threads per row, {access}")
            }
        }
    }
}

/// The headers a generated kernel is compiled after, in order (after the backend's portability
/// header).
pub const ROW_PROGRAM_HEADERS: &str = concat!(
    include_str!("../kernels/gpu/compute.h"),
    "\n",
    include_str!("../kernels/gpu/elem.h"),
    "\n",
    include_str!("../kernels/gpu/fp8.h"),
    "\n",
);

/// The name of a generated kernel.
pub const ROW_PROGRAM_KERNEL: &str = "row_program";

/// What every generated CUDA/HIP kernel uses beyond the shared headers: erfc in the compute type,
/// and IEEE 754-2019 `minimumNumber`/`maximumNumber` (`-0` below `+0`, a NaN operand gives the
/// other), the rule of [`BinaryOp::Min`] and [`BinaryOp::Max`].
const PRELUDE: &str = r#"__device__ __forceinline__ float rp_erfc(float a) { return erfcf(a); }
__device__ __forceinline__ double rp_erfc(double a) { return erfc(a); }
template <typename C>
__device__ __forceinline__ C rp_min(C a, C b) { return (a < b || (a == b && signbit(a)) || b != b) ? a : b; }
template <typename C>
__device__ __forceinline__ C rp_max(C a, C b) { return (a > b || (a == b && signbit(b)) || b != b) ? a : b; }
"#;

/// What a CUDA/HIP kernel of the [`RowShape::Chunks`] layout uses besides [`PRELUDE`]: a thread's
/// chunk of `CH` elements of `Elem<DT>` as stored (`RpChunk`: 32-bit words filled by 16-, 8- or
/// 4-byte loads on the 16-byte path, where the host guarantees whole aligned chunks; else the
/// elements below the row's width, one by one), a chunk's store (`rp_store_chunk`, the same two
/// kinds), and the row's reduction over its `TPR` threads (`rp_row_reduce`: the hand-written norms'
/// tree, butterfly shuffles within a warp then the row's warps in order, and a barrier after it so
/// the partials may be reused).
const CHUNK_PRELUDE: &str = r#"template <typename T> __device__ __forceinline__ unsigned int rp_bits(T v) {
    if constexpr (sizeof(T) == 4) return __float_as_uint(v); else return (unsigned int)v;
}
template <int DT, int CH, bool VEC> struct RpChunk;
template <int DT, int CH> struct RpChunk<DT, CH, true> {
    typedef typename Elem<DT>::T T;
    static constexpr int N = CH * (int)sizeof(T) / 4;
    unsigned int w[N];
    __device__ __forceinline__ void load(const T* p, int) {
        if constexpr (N % 4 == 0) {
#pragma unroll
            for (int q = 0; q < N / 4; ++q) {
                Words words = reinterpret_cast<const Words*>(p)[q];
#pragma unroll
                for (int i = 0; i < 4; ++i) w[4 * q + i] = words.w[i];
            }
        } else if constexpr (N == 2) {
            unsigned long long pair = *reinterpret_cast<const unsigned long long*>(p);
            w[0] = (unsigned int)pair;
            w[1] = (unsigned int)(pair >> 32);
        } else {
            w[0] = *reinterpret_cast<const unsigned int*>(p);
        }
    }
    __device__ __forceinline__ T get(int i) const {
        if constexpr (sizeof(T) == 2) return (T)(w[i / 2] >> (16 * (i % 2))); else return __uint_as_float(w[i]);
    }
};
template <int DT, int CH> struct RpChunk<DT, CH, false> {
    typedef typename Elem<DT>::T T;
    T v[CH];
    __device__ __forceinline__ void load(const T* p, int n) {
#pragma unroll
        for (int i = 0; i < CH; ++i) v[i] = i < n ? p[i] : Elem<DT>::store(0.0f);
    }
    __device__ __forceinline__ T get(int i) const { return v[i]; }
};
template <int CH, bool VEC, typename T> __device__ __forceinline__ void rp_store_chunk(T* p, const T* v, int n) {
    constexpr int BYTES = CH * (int)sizeof(T);
    if constexpr (VEC && BYTES % 4 == 0) {
        constexpr int PER = 4 / (int)sizeof(T);
        unsigned int w[BYTES / 4];
#pragma unroll
        for (int q = 0; q < BYTES / 4; ++q) {
            w[q] = 0;
#pragma unroll
            for (int b = 0; b < PER; ++b) w[q] |= rp_bits(v[q * PER + b]) << (8 * (int)sizeof(T) * b);
        }
        if constexpr (BYTES % 16 == 0) {
#pragma unroll
            for (int q = 0; q < BYTES / 16; ++q) {
                Words words;
#pragma unroll
                for (int i = 0; i < 4; ++i) words.w[i] = w[4 * q + i];
                reinterpret_cast<Words*>(p)[q] = words;
            }
        } else if constexpr (BYTES == 8) {
            *reinterpret_cast<unsigned long long*>(p) = (unsigned long long)w[0] | ((unsigned long long)w[1] << 32);
        } else {
#pragma unroll
            for (int q = 0; q < BYTES / 4; ++q) reinterpret_cast<unsigned int*>(p)[q] = w[q];
        }
    } else {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            if (i < n) p[i] = v[i];
        }
    }
}
template <int TPR, int BLOCK, typename V, typename F>
__device__ __forceinline__ V rp_row_reduce(V value, V* partials, F combine) {
    const int warp = GPU_WARP;
    if (TPR <= warp) {
#pragma unroll
        for (int offset = TPR / 2; offset > 0; offset >>= 1) value = combine(value, gpu_shfl_xor(value, offset));
        return value;
    }
#pragma unroll
    for (int offset = warp / 2; offset > 0; offset >>= 1) value = combine(value, gpu_shfl_xor(value, offset));
    if (threadIdx.x % warp == 0) partials[threadIdx.x / warp] = value;
    __syncthreads();
    const int per_row = TPR / warp;
    const int first = (threadIdx.x / TPR) * per_row;
    V total = partials[first];
    for (int w = 1; w < per_row; ++w) total = combine(total, partials[first + w]);
    __syncthreads();
    return total;
}
"#;

/// What every generated OpenCL C kernel uses beyond `element.cl`'s helpers (compiled without a
/// `DTYPE`): double (row values are double), no contraction of a multiply and an add, loads and
/// roundings per element type and source type (`_f` float, `_d` double; OpenCL C has no
/// overloading), `minimumNumber`/`maximumNumber`, and the work-group trees of the reductions.
const OPENCL_PRELUDE: &str = r#"#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#pragma OPENCL FP_CONTRACT OFF
#define RP_GROUP 256
inline float rp_f16_round_f(float v) { return round_to_f16(v); }
inline double rp_f16_round_d(double v) { ushort b; vstore_half_rte(v, 0, (__private half*)&b); return (double)vload_half(0, (__private const half*)&b); }
inline float rp_bf16_round_f(float v) { return bf16_to_f32(f32_to_bf16(v)); }
inline double rp_bf16_round_d(double v) { return (double)bf16_to_f32(f32_to_bf16(f32_round_to_odd(v))); }
inline float rp_f32_round_f(float v) { return v; }
inline double rp_f32_round_d(double v) { return (double)(float)v; }
inline float rp_f64_round_f(float v) { return v; }
inline double rp_f64_round_d(double v) { return v; }
inline float rp_min_f(float a, float b) { return (a < b || (a == b && signbit(a)) || b != b) ? a : b; }
inline double rp_min_d(double a, double b) { return (a < b || (a == b && signbit(a)) || b != b) ? a : b; }
inline float rp_max_f(float a, float b) { return (a > b || (a == b && signbit(b)) || b != b) ? a : b; }
inline double rp_max_d(double a, double b) { return (a > b || (a == b && signbit(b)) || b != b) ? a : b; }
inline float rp_narrow_f(float v) { return v; }
inline float rp_narrow_d(double v) { return f32_round_to_odd(v); }
#define RP_BLOCK_REDUCE(NAME, T, COMBINE) \
    inline T NAME(T value, __local T* scratch) { \
        int id = get_local_id(0); \
        scratch[id] = value; \
        barrier(CLK_LOCAL_MEM_FENCE); \
        for (int width = RP_GROUP / 2; width > 0; width >>= 1) { \
            if (id < width) scratch[id] = COMBINE(scratch[id], scratch[id + width]); \
            barrier(CLK_LOCAL_MEM_FENCE); \
        } \
        T total = scratch[0]; \
        barrier(CLK_LOCAL_MEM_FENCE); \
        return total; \
    }
#define RP_ADD(a, b) ((a) + (b))
RP_BLOCK_REDUCE(rp_block_sum_f, float, RP_ADD)
RP_BLOCK_REDUCE(rp_block_sum_d, double, RP_ADD)
RP_BLOCK_REDUCE(rp_block_max_f, float, fmax)
RP_BLOCK_REDUCE(rp_block_max_d, double, fmax)
"#;

/// The OpenCL C helpers a generated kernel is compiled after: `element.cl`'s conversions (f16, bf16,
/// fp8, rounding to odd), without a `DTYPE`.
pub const OPENCL_HEADERS: &str = include_str!("../kernels/xpu/element.cl");

/// Why a program has no GPU source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    /// The program.
    pub program: String,
    /// What is not generated.
    pub reason: String,
}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "row program `{}` has no GPU source: {}", self.program, self.reason)
    }
}

impl std::error::Error for Unsupported {}

impl From<Unsupported> for ir_core::KernelError {
    /// A program a backend cannot generate, refused as invalid arguments with the reason.
    fn from(error: Unsupported) -> ir_core::KernelError {
        ir_core::KernelError::InvalidArguments { reason: error.to_string() }
    }
}

/// `elem.h`'s element type code of `dtype` (`Elem<code>`), if it has one.
fn elem_code(dtype: DType) -> Option<u32> {
    match dtype {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        DType::F64 => Some(6),
        _ => None,
    }
}

/// The source language a kernel is generated in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    /// CUDA and HIP (one source, `kernels/gpu`'s headers).
    CudaHip,
    /// OpenCL C 1.2 with `cl_khr_fp64`.
    OpenCl,
}

/// A C type of a value in generated code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ty {
    Float,
    Double,
}

impl Ty {
    fn name(self) -> &'static str {
        match self {
            Ty::Float => "float",
            Ty::Double => "double",
        }
    }

    /// The suffix of an OpenCL helper taking this type.
    fn suffix(self) -> &'static str {
        match self {
            Ty::Float => "f",
            Ty::Double => "d",
        }
    }
}

/// The pieces of source that differ between targets.
struct Syntax {
    target: Target,
}

impl Syntax {
    /// The pointer type of a buffer of `dtype` (`constant` for an input).
    fn pointer(&self, dtype: DType, input: bool) -> String {
        let c = if input { "const " } else { "" };
        match self.target {
            Target::CudaHip if dtype.fp8_max().is_some() => format!("{c}unsigned char*"),
            Target::CudaHip => format!("{c}typename Elem<{}>::T*", elem_code(dtype).unwrap_or(0)),
            Target::OpenCl => {
                let element = match dtype {
                    DType::F32 => "float",
                    DType::F16 => "half",
                    DType::BF16 => "ushort",
                    DType::F64 => "double",
                    _ => "uchar",
                };
                format!("__global {c}{element}*")
            }
        }
    }

    /// A buffer parameter: the pointer, and on OpenCL its element offset.
    fn buffer_params(&self, name: &str, dtype: DType, input: bool, params: &mut Vec<String>) {
        params.push(format!("{} {name}", self.pointer(dtype, input)));
        if self.target == Target::OpenCl {
            params.push(format!("long {name}_off"));
        }
    }

    /// A positions buffer's parameter (`i64`): the pointer, and on OpenCL its element offset.
    fn positions_params(&self, name: &str, params: &mut Vec<String>) {
        match self.target {
            Target::CudaHip => params.push(format!("const long long* {name}")),
            Target::OpenCl => params.extend([format!("__global const long* {name}"), format!("long {name}_off")]),
        }
    }

    /// The element `index` of buffer `name` of `dtype`, as a float (a double for f64).
    fn load(&self, name: &str, dtype: DType, index: &str) -> String {
        match self.target {
            Target::CudaHip => format!("Elem<{}>::load({name}[{index}])", elem_code(dtype).unwrap_or(0)),
            Target::OpenCl => {
                let at = format!("{name}_off + {index}");
                match dtype {
                    DType::F16 => format!("vload_half({at}, {name})"),
                    DType::BF16 => format!("bf16_to_f32({name}[{at}])"),
                    _ => format!("{name}[{at}]"),
                }
            }
        }
    }

    /// A statement storing `value` (of type `ty`) as element `index` of output `name` of `dtype`.
    fn store(&self, name: &str, dtype: DType, index: &str, value: &str, ty: Ty) -> String {
        match (self.target, dtype) {
            (Target::CudaHip, DType::F8E4M3FN | DType::F8E5M2) => {
                let narrow = match ty {
                    Ty::Float => format!("({value})"),
                    Ty::Double => format!("f32_round_to_odd({value})"),
                };
                let f = if dtype == DType::F8E4M3FN { "fp8_e4m3" } else { "fp8_e5m2" };
                format!("{name}[{index}] = {f}({narrow});")
            }
            (Target::CudaHip, _) => {
                format!("{name}[{index}] = Elem<{}>::store({value});", elem_code(dtype).unwrap_or(0))
            }
            (Target::OpenCl, _) => {
                let at = format!("{name}_off + {index}");
                let narrow = format!("rp_narrow_{}({value})", ty.suffix());
                match dtype {
                    DType::F8E4M3FN => format!("{name}[{at}] = fp8_from_f32({narrow}, 3, 7, 448.0f);"),
                    DType::F8E5M2 => format!("{name}[{at}] = fp8_from_f32({narrow}, 2, 15, 57344.0f);"),
                    DType::F16 => format!("vstore_half_rte({value}, {at}, {name});"),
                    DType::BF16 => format!("{name}[{at}] = f32_to_bf16({narrow});"),
                    DType::F32 => format!("{name}[{at}] = (float)({value});"),
                    _ => format!("{name}[{at}] = {value};"),
                }
            }
        }
    }

    /// `value` (of type `ty`) rounded to `dtype` and back.
    fn round(&self, dtype: DType, value: &str, ty: Ty) -> String {
        match self.target {
            Target::CudaHip => format!("round_elem<{}>({value})", elem_code(dtype).unwrap_or(0)),
            Target::OpenCl => format!("rp_{dtype}_round_{}({value})", ty.suffix()),
        }
    }

    fn unary(&self, op: UnaryOp, a: String, ty: Ty) -> String {
        let t = ty.name();
        match (self.target, op) {
            (_, UnaryOp::Neg) => format!("(-({a}))"),
            (_, UnaryOp::Relu) => format!("(({a}) < ({t})0 ? ({t})0 : ({a}))"),
            (_, UnaryOp::Round) => a,
            (Target::CudaHip, UnaryOp::Abs) => format!("c_fabs({a})"),
            (Target::CudaHip, UnaryOp::Exp) => format!("c_exp({a})"),
            (Target::CudaHip, UnaryOp::Tanh) => format!("c_tanh({a})"),
            (Target::CudaHip, UnaryOp::Erf) => format!("c_erf({a})"),
            (Target::CudaHip, UnaryOp::Erfc) => format!("rp_erfc({a})"),
            (Target::CudaHip, UnaryOp::Sigmoid) => format!("c_div(({t})1, c_add(({t})1, c_exp(-({a}))))"),
            (Target::CudaHip, UnaryOp::Sqrt) => format!("c_sqrt({a})"),
            (Target::CudaHip, UnaryOp::Recip) => format!("c_div(({t})1, {a})"),
            (Target::OpenCl, UnaryOp::Abs) => format!("fabs({a})"),
            (Target::OpenCl, UnaryOp::Exp) => format!("exp({a})"),
            (Target::OpenCl, UnaryOp::Tanh) => format!("tanh({a})"),
            (Target::OpenCl, UnaryOp::Erf) => format!("erf({a})"),
            (Target::OpenCl, UnaryOp::Erfc) => format!("erfc({a})"),
            (Target::OpenCl, UnaryOp::Sigmoid) => format!("(({t})1 / (({t})1 + exp(-({a}))))"),
            (Target::OpenCl, UnaryOp::Sqrt) => format!("sqrt({a})"),
            (Target::OpenCl, UnaryOp::Recip) => format!("(({t})1 / ({a}))"),
        }
    }

    fn binary(&self, op: BinaryOp, a: String, b: String, ty: Ty) -> String {
        match (self.target, op) {
            (Target::CudaHip, BinaryOp::Add) => format!("c_add({a}, {b})"),
            (Target::CudaHip, BinaryOp::Sub) => format!("c_sub({a}, {b})"),
            (Target::CudaHip, BinaryOp::Mul) => format!("c_mul({a}, {b})"),
            (Target::CudaHip, BinaryOp::Div) => format!("c_div({a}, {b})"),
            (Target::CudaHip, BinaryOp::Min) => format!("rp_min({a}, {b})"),
            (Target::CudaHip, BinaryOp::Max) => format!("rp_max({a}, {b})"),
            (Target::OpenCl, BinaryOp::Add) => format!("(({a}) + ({b}))"),
            (Target::OpenCl, BinaryOp::Sub) => format!("(({a}) - ({b}))"),
            (Target::OpenCl, BinaryOp::Mul) => format!("(({a}) * ({b}))"),
            (Target::OpenCl, BinaryOp::Div) => format!("(({a}) / ({b}))"),
            (Target::OpenCl, BinaryOp::Min) => format!("rp_min_{}({a}, {b})", ty.suffix()),
            (Target::OpenCl, BinaryOp::Max) => format!("rp_max_{}({a}, {b})", ty.suffix()),
        }
    }

    /// A reduction's step: `acc` combined with the element value `e` (of type `ty`).
    fn accumulate(&self, op: ReduceOp, acc: &str, e: &str) -> String {
        match (self.target, op) {
            (Target::CudaHip, ReduceOp::Sum) => format!("c_add({acc}, (double){e})"),
            (Target::CudaHip, ReduceOp::SumSquares) => format!("c_add({acc}, c_mul({e}, {e}))"),
            (Target::CudaHip, ReduceOp::MaxAbs) => format!("c_fmax({acc}, c_fabs({e}))"),
            (Target::OpenCl, ReduceOp::Sum) => format!("{acc} + (double){e}"),
            (Target::OpenCl, ReduceOp::SumSquares) => format!("{acc} + {e} * {e}"),
            (Target::OpenCl, ReduceOp::MaxAbs) => format!("fmax({acc}, fabs({e}))"),
        }
    }

    /// The block's combination of the partials `acc` (of type `ty`) of a reduction.
    fn combine(&self, op: ReduceOp, acc: &str, ty: Ty) -> String {
        let scratch = if ty == Ty::Double { "scratch_d" } else { "scratch" };
        match (self.target, op) {
            (Target::CudaHip, ReduceOp::MaxAbs) => format!("block_max<{ROW_BLOCK}>({acc}, {scratch})"),
            (Target::CudaHip, _) => format!("block_sum<{ROW_BLOCK}>({acc}, {scratch})"),
            (Target::OpenCl, ReduceOp::MaxAbs) => format!("rp_block_max_{}({acc}, {scratch})", ty.suffix()),
            (Target::OpenCl, _) => format!("rp_block_sum_{}({acc}, {scratch})", ty.suffix()),
        }
    }

    fn long(&self) -> &'static str {
        match self.target {
            Target::CudaHip => "long long",
            Target::OpenCl => "long",
        }
    }

    fn thread(&self) -> &'static str {
        match self.target {
            Target::CudaHip => "threadIdx.x",
            Target::OpenCl => "get_local_id(0)",
        }
    }
}

/// The CUDA/HIP kernel of `program` for a call bound as `binding`. Its parameters, in order:
/// `long long n_rows, int width`, then per input an activation's `(const T* in, long long
/// row_stride, long long inner, long long outer)` (row `r` at `(r / inner) · outer + (r % inner) ·
/// row_stride`: rows of one stride, `inner` the row count, or blocks of `inner` rows `outer`
/// apart, the heads of a column slice), a positions input's `(const long long* in, long long
/// per)`, a cache's `(const T* in, long long row_stride, int rotated, long long max_position)`, a
/// weight's or a scalar tensor's `(const T* in)`, a scalar's `double`; then per output its `T*
/// out` (`unsigned char*` for fp8), compact. When `binding.in_place` is set, an output stored in
/// place of an activation has no parameter: it is written into that activation (`T* in`, at its
/// rows). Each buffer is passed at its tensor's first element (the [`gpu`](crate::gpu) module's
/// convention: an element address on CUDA and HIP).
///
/// Returns the source (the generated part only: compile it after [`ROW_PROGRAM_HEADERS`]).
pub fn gpu_source(program: &RowProgram, binding: &Binding, shape: RowShape) -> Result<String, Unsupported> {
    generate(program, binding, Target::CudaHip, shape)
}

/// The OpenCL C 1.2 kernel of `program` for a call bound as `binding` (it needs `cl_khr_fp64`:
/// row values are double): the parameters of [`gpu_source`]'s kernel, each buffer followed by its
/// `long` element offset (the [`gpu`](crate::gpu) module's convention on OpenCL), `long` for
/// `long long`. Arithmetic is exact IEEE where the CUDA source's is (no contraction; build with
/// `-cl-fp32-correctly-rounded-divide-sqrt`); exp, tanh, erf and erfc are the device's (within
/// the op's tolerance). Returns the generated part: compile it after [`OPENCL_HEADERS`].
pub fn opencl_source(program: &RowProgram, binding: &Binding) -> Result<String, Unsupported> {
    generate(program, binding, Target::OpenCl, RowShape::Walk)
}

fn generate(program: &RowProgram, binding: &Binding, target: Target, shape: RowShape) -> Result<String, Unsupported> {
    let unsupported = |reason: String| Unsupported { program: program.name().to_owned(), reason };
    // The chunk layout's threads per row and access width, on CUDA/HIP only.
    let chunks = match (target, shape) {
        (Target::CudaHip, RowShape::Chunks { threads_per_row, vectorized }) => {
            if program.rotary_cache().is_some() {
                return Err(unsupported("a rotary program walks its pairs; it has no chunk layout".to_owned()));
            }
            if !threads_per_row.is_power_of_two() {
                return Err(unsupported(format!("{threads_per_row} threads per row is not a power of two")));
            }
            Some((threads_per_row, vectorized))
        }
        _ => None,
    };
    let syntax = Syntax { target };
    let long = syntax.long();
    let c_ty = match binding.compute {
        DType::F64 => Ty::Double,
        _ => Ty::Float,
    };
    let c = c_ty.name();
    let dtype_of = |dtype: DType| -> Result<DType, Unsupported> {
        elem_code(dtype).map(|_| dtype).ok_or_else(|| unsupported(format!("no element type for {dtype}")))
    };
    let input_dtype = |input: usize| dtype_of(binding.dtypes[input].unwrap_or(binding.compute));
    let steps = program.steps();
    // The rounding of a value to `precision`: a row value (or a value computed in double) is
    // double, an element value the compute type.
    let round = |expr: String, precision: Precision, row: bool| -> Result<String, Unsupported> {
        let ty = if row { Ty::Double } else { c_ty };
        Ok(match precision {
            Precision::Wide => expr,
            Precision::Compute if row && c_ty == Ty::Float => format!("(double)(float)({expr})"),
            Precision::Compute => expr,
            Precision::Like(input) => syntax.round(input_dtype(input)?, &expr, ty),
            Precision::Dtype(dtype) if dtype.fp8_max().is_some() => {
                return Err(unsupported(format!("a step rounds to {dtype}, which only a store may")));
            }
            Precision::Dtype(dtype) => syntax.round(dtype_of(dtype)?, &expr, ty),
        })
    };
    // A value in a column's computation: element values carry the column's suffix.
    let value = |v: ValueId, element: bool, column: &Column| match (steps[v.0 as usize].extent, element) {
        (Extent::Element, _) => format!("e{}{}", v.0, column.suffix),
        (Extent::Row, true) => format!("(({c})r{})", v.0),
        (Extent::Row, false) => format!("r{}", v.0),
    };

    // The activation an output is stored into, when the call runs in place.
    let in_place_target = |output: &ir_ops::row_program::Output| output.in_place_of.filter(|_| binding.in_place);
    let written_in_place = |input: usize| program.outputs().iter().any(|o| in_place_target(o) == Some(input));

    let mut src = String::new();
    let in_place = if binding.in_place { ", in place" } else { "" };
    let _ =
        writeln!(src, "// Generated from row program `{}` ({:016x}{in_place}).", program.name(), program.fingerprint());
    src.push_str(match target {
        Target::CudaHip => PRELUDE,
        Target::OpenCl => OPENCL_PRELUDE,
    });
    // The prototype.
    let mut params = vec![format!("{long} n_rows"), "int width".to_owned()];
    for (index, input) in program.inputs().iter().enumerate() {
        match input.kind {
            InputKind::Scalar => params.push(format!("double s{index}")),
            InputKind::Activation { .. } => {
                // Written too when the call stores an output in place of it. Its rows come in
                // blocks of `inner` (`outer` apart), `stride` apart within a block.
                let read_only = !written_in_place(index);
                syntax.buffer_params(&format!("in{index}"), input_dtype(index)?, read_only, &mut params);
                params.extend([
                    format!("{long} stride{index}"),
                    format!("{long} inner{index}"),
                    format!("{long} outer{index}"),
                ]);
            }
            InputKind::Weight | InputKind::ScalarTensor => {
                syntax.buffer_params(&format!("in{index}"), input_dtype(index)?, true, &mut params);
            }
            InputKind::Positions => {
                syntax.positions_params(&format!("in{index}"), &mut params);
                params.push(format!("{long} per{index}"));
            }
            InputKind::CosSinCache { .. } => {
                syntax.buffer_params(&format!("in{index}"), input_dtype(index)?, true, &mut params);
                params.extend([
                    format!("{long} stride{index}"),
                    format!("int rot{index}"),
                    format!("{long} max{index}"),
                ]);
            }
        }
    }
    for (index, output) in program.outputs().iter().enumerate() {
        let dtype = binding.output_dtype(output.dtype);
        if dtype.fp8_max().is_none() {
            dtype_of(dtype)?;
        }
        if in_place_target(output).is_none() {
            syntax.buffer_params(&format!("out{index}"), dtype, false, &mut params);
        }
    }
    let (head, shared, rows) = match target {
        Target::CudaHip => ("extern \"C\" __global__ void", "__shared__", "GPU_ROWS(row, n_rows) {".to_owned()),
        Target::OpenCl => (
            "__kernel __attribute__((reqd_work_group_size(RP_GROUP, 1, 1))) void",
            "__local",
            "for (long row = get_group_id(0); row < n_rows; row += get_num_groups(0)) {".to_owned(),
        ),
    };
    if let Some((tpr, _)) = chunks {
        // Rows of `tpr` threads, `rows_per_block` to a block; the threads of a row past the last
        // compute with no chunk (they take part in the reductions' shuffles and barriers).
        let (block, per_block) = (shape.block(), shape.rows_per_block());
        let chunk = chunk_elements(program, binding);
        src.push_str(CHUNK_PRELUDE);
        // One block per SM at least: ptxas then gives the cached chunks the registers they take
        // (without the bound it capped some kernels at 96 registers and spilled around the calls
        // of f64 division's slow path).
        let _ = writeln!(src, "{head} __launch_bounds__({block}, 1) {ROW_PROGRAM_KERNEL}({}) {{", params.join(", "));
        let _ = writeln!(src, "    {shared} {c} scratch[{block} / 32];");
        let _ = writeln!(src, "    {shared} double scratch_d[{block} / 32];");
        let _ = writeln!(src, "    const int lane = threadIdx.x % {tpr};");
        let _ = writeln!(src, "    const {long} n_groups = (n_rows + {per_block} - 1) / {per_block};");
        let _ = writeln!(src, "    const {long} n_chunks = (({long})width + {chunk} - 1) / {chunk};");
        let _ = writeln!(src, "    GPU_ROWS(group, n_groups) {{");
        let _ = writeln!(src, "        const {long} row_at = group * {per_block} + threadIdx.x / {tpr};");
        let _ = writeln!(src, "        const int live = row_at < n_rows;");
        let _ = writeln!(src, "        const {long} row = live ? row_at : 0;");
        let _ = writeln!(src, "        const {long} nc = live ? n_chunks : 0;");
    } else {
        let _ = writeln!(src, "{head} {ROW_PROGRAM_KERNEL}({}) {{", params.join(", "));
        let _ = writeln!(src, "    {shared} {c} scratch[{ROW_BLOCK}];");
        let _ = writeln!(src, "    {shared} double scratch_d[{ROW_BLOCK}];");
        let _ = writeln!(src, "    {rows}");
    }
    for (index, step) in steps.iter().enumerate() {
        if step.extent == Extent::Row {
            let _ = writeln!(src, "        double r{index};");
        }
    }
    // Each activation's first element of the row.
    for (index, input) in program.inputs().iter().enumerate() {
        if matches!(input.kind, InputKind::Activation { .. }) {
            let _ = writeln!(
                src,
                "        const {long} base{index} = (row / inner{index}) * outer{index} + (row % inner{index}) * stride{index};"
            );
        }
    }
    // A rotary program walks its row by pairs: iteration p < R/2 computes pair p's two columns
    // (`ja`, `jb`) together, so each reads its partner's values from the other; the columns past R
    // come one by one after (`jb` then repeats `ja`, and only `ja` counts). `turn` says whether the
    // iteration rotates: a pair, at a position inside the cache.
    let rotary = program.rotary_cache();
    let columns: Vec<Column> = match rotary {
        None => vec![Column::WALK],
        Some(cache) => {
            let InputKind::CosSinCache { positions, .. } = program.inputs()[cache].kind else {
                unreachable!("a built program's rotary steps read a cache")
            };
            let first = match target {
                Target::CudaHip => String::new(),
                Target::OpenCl => format!("in{positions}_off + "),
            };
            let _ = writeln!(src, "        const {long} pos = in{positions}[{first}row / per{positions}];");
            let _ = writeln!(src, "        const int rhalf = rot{cache} / 2;");
            let _ = writeln!(src, "        const int inside = pos >= 0 && pos < max{cache};");
            vec![
                Column { suffix: "_a", at: "ja", partner: Some("_b"), slot: None },
                Column { suffix: "_b", at: "jb", partner: Some("_a"), slot: None },
            ]
        }
    };
    let schedule = program.schedule();
    let exact = program.exact_in_f32(binding);
    let passes = schedule.elements.len();
    let mut emitted = vec![false; steps.len()];
    let row_steps = |src: &mut String, pass: usize, emitted: &mut Vec<bool>| -> Result<(), Unsupported> {
        for (index, step) in steps.iter().enumerate() {
            if emitted[index] || step.extent != Extent::Row || schedule.phase[index] > pass {
                continue;
            }
            let expr = match step.op {
                Op::Param { input } => match program.inputs()[input].kind {
                    InputKind::Scalar => format!("s{input}"),
                    _ => format!("(double){}", syntax.load(&format!("in{input}"), input_dtype(input)?, "0")),
                },
                Op::Const(v) if v.is_finite() => format!("{v:?}"),
                Op::Const(v) => return Err(unsupported(format!("the constant {v} is not finite"))),
                Op::Width => "(double)width".to_owned(),
                Op::Unary(op, x) => syntax.unary(op, value(x, false, &Column::WALK), Ty::Double),
                Op::Binary(op, a, b) => {
                    syntax.binary(op, value(a, false, &Column::WALK), value(b, false, &Column::WALK), Ty::Double)
                }
                Op::Reduce { .. } => continue,
                Op::Load { .. } | Op::Weight { .. } | Op::Cos { .. } | Op::Sin { .. } | Op::Pair { .. } => {
                    unreachable!("loads and rotary steps are element steps")
                }
            };
            let _ = writeln!(src, "        r{index} = {};", round(expr, step.precision, true)?);
            emitted[index] = true;
        }
        Ok(())
    };
    // Element step `index` at `column`, as a statement defining its value there.
    let element = |index: usize, column: &Column| -> Result<String, Unsupported> {
        let step = steps[index];
        let (sfx, at) = (column.suffix, column.at);
        let narrow = binding
            .precision_dtype(step.precision)
            .is_some_and(|d| elem_code(d).is_some_and(|code| code == 1 || code == 2));
        if narrow && !exact[index] && matches!(step.op, Op::Unary(..) | Op::Binary(..)) {
            // Rounded to f16 or bf16 and not exact in the compute type: in double, rounded once
            // (a double narrows through f32 rounded to odd), as the reference.
            let wide = |v: ValueId| match steps[v.0 as usize].extent {
                Extent::Element => format!("(double)e{}{sfx}", v.0),
                Extent::Row => format!("r{}", v.0),
            };
            let expr = match step.op {
                Op::Unary(op, x) => syntax.unary(op, wide(x), Ty::Double),
                Op::Binary(op, a, b) => syntax.binary(op, wide(a), wide(b), Ty::Double),
                _ => unreachable!("matched above"),
            };
            return Ok(format!("const {c} e{index}{sfx} = ({c}){};", round(expr, step.precision, true)?));
        }
        let expr = match (step.op, column.slot) {
            (Op::Load { input, block }, Some((slot, _))) => {
                format!(
                    "({c})Elem<{}>::load(ld{input}_{block}{slot}.get(i))",
                    elem_code(input_dtype(input)?).unwrap_or(0)
                )
            }
            (Op::Weight { input }, Some((_, slot))) => {
                format!("({c})Elem<{}>::load(wt{input}{slot}.get(i))", elem_code(input_dtype(input)?).unwrap_or(0))
            }
            _ => match step.op {
                Op::Load { input, block } => {
                    let at = format!("base{input} + {block} * ({long})width + {at}");
                    format!("({c}){}", syntax.load(&format!("in{input}"), input_dtype(input)?, &at))
                }
                Op::Weight { input } => {
                    format!("({c}){}", syntax.load(&format!("in{input}"), input_dtype(input)?, at))
                }
                Op::Cos { cache } | Op::Sin { cache } => {
                    // Pair p's cosine is cache column p, its sine column R/2 + p, negated on the first
                    // column.
                    let (column_of, sign, rest) = match (step.op, sfx) {
                        (Op::Cos { .. }, _) => ("p", "", "1"),
                        (_, "_a") => ("rhalf + p", "-", "0"),
                        _ => ("rhalf + p", "", "0"),
                    };
                    let load = syntax.load(
                        &format!("in{cache}"),
                        input_dtype(cache)?,
                        &format!("pos * stride{cache} + {column_of}"),
                    );
                    format!("(turn ? {sign}({c}){load} : ({c}){rest})")
                }
                Op::Pair { x, .. } => {
                    let partner = column.partner.expect("a rotary program's columns come in pairs");
                    format!("(turn ? e{}{partner} : -({c})0)", x.0)
                }
                Op::Unary(op, x) => syntax.unary(op, value(x, true, column), c_ty),
                Op::Binary(op, a, b) => syntax.binary(op, value(a, true, column), value(b, true, column), c_ty),
                _ => unreachable!("element steps"),
            },
        };
        Ok(format!("const {c} e{index}{sfx} = {};", round(expr, step.precision, false)?))
    };
    // A reduction's accumulator type: a sum in double (a mean far from zero keeps its bits, as on
    // the cpu), the others in the compute type.
    let acc_ty = |op: ReduceOp| if op == ReduceOp::Sum { Ty::Double } else { c_ty };
    // Each reduction of a pass: its accumulator and its count, at the top of the pass.
    let init_reductions = |src: &mut String, reductions: &[usize]| -> Result<(), Unsupported> {
        for &index in reductions {
            let Op::Reduce { op, count, .. } = steps[index].op else { unreachable!("reductions are listed") };
            let n = match count {
                None => format!("({long})width"),
                Some(count) => match steps[count.0 as usize].op {
                    Op::Param { input } if program.inputs()[input].kind == InputKind::Scalar => {
                        // Checked by the host: an integer in 1..=width.
                        format!("({long})r{}", count.0)
                    }
                    _ => {
                        return Err(unsupported(format!(
                            "%{index} is counted by %{}, not a scalar parameter",
                            count.0
                        )));
                    }
                },
            };
            let ty = acc_ty(op).name();
            let _ = writeln!(src, "        {ty} a{index} = ({ty})0; const {long} n{index} = {n};");
        }
        Ok(())
    };
    if let Some((tpr, vectorized)) = chunks {
        // Chunk `c` of a row (elements `c·ch ..`) is lane `c mod tpr`'s. A thread's first `cached`
        // chunks of each activation stream stay in registers from the pass that first reads the
        // stream, their loads all issued before the first is used; the chunks past them are
        // loaded again in each pass that reads them.
        let ch = chunk_elements(program, binding);
        let cached = cached_chunks(program, binding, tpr);
        let block = shape.block();
        let vec_of = |dtype: DType| vectorized && dtype != DType::F64;
        let chunk_ty = |input: usize| -> Result<String, Unsupported> {
            let dtype = input_dtype(input)?;
            Ok(format!("RpChunk<{}, {ch}, {}>", elem_code(dtype).unwrap_or(0), vec_of(dtype)))
        };
        // The activation streams (an input's block) and weights each pass reads.
        let reads: Vec<PassReads> = schedule
            .elements
            .iter()
            .map(|elements| {
                let mut reads = PassReads::default();
                for &index in elements {
                    match steps[index].op {
                        Op::Load { input, block } if !reads.loads.contains(&(input, block)) => {
                            reads.loads.push((input, block))
                        }
                        Op::Weight { input } if !reads.weights.contains(&input) => reads.weights.push(input),
                        _ => {}
                    }
                }
                reads
            })
            .collect();
        let mut held: Vec<(usize, usize)> = Vec::new();
        for &stream in reads.iter().flat_map(|reads| &reads.loads) {
            if !held.contains(&stream) {
                held.push(stream);
                let _ = writeln!(src, "        {} ld{}_{}[{cached}];", chunk_ty(stream.0)?, stream.0, stream.1);
            }
        }
        held.clear();
        let stream_at = |(input, block): (usize, usize)| {
            format!("in{input} + base{input} + {block} * ({long})width + c * {ch}, width - (int)(c * {ch})")
        };
        let weight_at = |input: usize| format!("in{input} + c * {ch}, width - (int)(c * {ch})");
        let each_cached = CachedChunks { long, tpr };
        let all_cached = format!("int k = 0; k < {cached}");
        for (pass, PassReads { loads, weights }) in reads.iter().enumerate() {
            row_steps(&mut src, pass, &mut emitted)?;
            let reductions = &schedule.reductions[pass];
            init_reductions(&mut src, reductions)?;
            let last = pass + 1 == passes;
            // The chunk's computation, its stream and weight chunks at `slot`: every element step
            // of the pass per element in order, the reductions' terms, and in the last pass the
            // element outputs, gathered and stored as a chunk.
            let body =
                |src: &mut String, indent: &str, slot: (&'static str, &'static str)| -> Result<(), Unsupported> {
                    let column = Column { suffix: "", at: "j", partner: None, slot: Some(slot) };
                    let _ = writeln!(src, "{indent}const int j0 = (int)(c * {ch});");
                    let element_outputs =
                        || {
                            program.outputs().iter().enumerate().filter(move |(_, output)| {
                                last && steps[output.value.0 as usize].extent == Extent::Element
                            })
                        };
                    for (k, output) in element_outputs() {
                        let dtype = binding.output_dtype(output.dtype);
                        let ty = match elem_code(dtype) {
                            Some(code) => format!("typename Elem<{code}>::T"),
                            None => "unsigned char".to_owned(),
                        };
                        let _ = writeln!(src, "{indent}{ty} o{k}[{ch}];");
                    }
                    let _ = writeln!(src, "#pragma unroll");
                    let _ = writeln!(src, "{indent}for (int i = 0; i < {ch}; ++i) {{");
                    let _ = writeln!(src, "{indent}    const int j = j0 + i;");
                    // Whole chunks on the 16-byte path; else the elements inside the row.
                    let inner = if vectorized {
                        format!("{indent}    ")
                    } else {
                        let _ = writeln!(src, "{indent}    if (j < width) {{");
                        format!("{indent}        ")
                    };
                    for &index in &schedule.elements[pass] {
                        let _ = writeln!(src, "{inner}{}", element(index, &column)?);
                    }
                    for &index in reductions {
                        let Op::Reduce { op, x, .. } = steps[index].op else { unreachable!("reductions are listed") };
                        let term = syntax.accumulate(op, &format!("a{index}"), &format!("e{}", x.0));
                        let _ = writeln!(src, "{inner}if (j < n{index}) a{index} = {term};");
                    }
                    for (k, output) in element_outputs() {
                        let dtype = binding.output_dtype(output.dtype);
                        let _ = writeln!(
                            src,
                            "{inner}{}",
                            syntax.store(&format!("o{k}"), dtype, "i", &format!("e{}", output.value.0), c_ty)
                        );
                    }
                    if !vectorized {
                        let _ = writeln!(src, "{indent}    }}");
                    }
                    let _ = writeln!(src, "{indent}}}");
                    for (k, output) in element_outputs() {
                        let dtype = binding.output_dtype(output.dtype);
                        let at = match in_place_target(output) {
                            Some(input) => format!("in{input} + base{input} + j0"),
                            None => format!("out{k} + row * ({long})width + j0"),
                        };
                        let _ =
                            writeln!(src, "{indent}rp_store_chunk<{ch}, {}>({at}, o{k}, width - j0);", vec_of(dtype));
                    }
                    Ok(())
                };
            // The cached chunks: the streams this pass reads first, every load issued before any
            // chunk is used.
            let fresh: Vec<(usize, usize)> = loads.iter().copied().filter(|s| !held.contains(s)).collect();
            if !fresh.is_empty() {
                each_cached.each(&mut src, "        ", &all_cached, |src, inner| {
                    for &(input, block) in &fresh {
                        let _ = writeln!(src, "{inner}ld{input}_{block}[k].load({});", stream_at((input, block)));
                    }
                    Ok(())
                })?;
                held.extend(fresh);
            }
            if weights.is_empty() {
                each_cached.each(&mut src, "        ", &all_cached, |src, inner| body(src, inner, ("[k]", "")))?;
            } else {
                // The weights' chunks of a group loaded ahead of the group's first use (fewer
                // per group for more weights, bounding their registers).
                let ahead = (WEIGHT_AHEAD / weights.len() as u32).clamp(1, cached);
                let _ = writeln!(src, "#pragma unroll");
                let _ = writeln!(src, "        for (int k0 = 0; k0 < {cached}; k0 += {ahead}) {{");
                for &w in weights {
                    let _ = writeln!(src, "            {} wt{w}[{ahead}];", chunk_ty(w)?);
                }
                let group = format!("int k = k0; k < k0 + {ahead} && k < {cached}");
                each_cached.each(&mut src, "            ", &group, |src, inner| {
                    for &w in weights {
                        let _ = writeln!(src, "{inner}wt{w}[k - k0].load({});", weight_at(w));
                    }
                    Ok(())
                })?;
                each_cached
                    .each(&mut src, "            ", &group, |src, inner| body(src, inner, ("[k]", "[k - k0]")))?;
                let _ = writeln!(src, "        }}");
            }
            // The chunks past the cached ones, loaded where they are used.
            let _ = writeln!(src, "        for ({long} c = lane + ({long}){cached} * {tpr}; c < nc; c += {tpr}) {{");
            for &stream in loads {
                let (input, b) = stream;
                let ty = chunk_ty(input)?;
                let _ = writeln!(src, "            {ty} ld{input}_{b}_t; ld{input}_{b}_t.load({});", stream_at(stream));
            }
            for &w in weights {
                let _ = writeln!(src, "            {} wt{w}_t; wt{w}_t.load({});", chunk_ty(w)?, weight_at(w));
            }
            body(&mut src, "            ", ("_t", "_t"))?;
            let _ = writeln!(src, "        }}");
            for &index in reductions {
                let Op::Reduce { op, .. } = steps[index].op else { unreachable!("reductions are listed") };
                let ty = acc_ty(op);
                let scratch = if ty == Ty::Double { "scratch_d" } else { "scratch" };
                let combine = if op == ReduceOp::MaxAbs { "c_fmax(a, b)" } else { "c_add(a, b)" };
                let t = ty.name();
                let expr = format!(
                    "(double)rp_row_reduce<{tpr}, {block}>(a{index}, {scratch}, []({t} a, {t} b) {{ return {combine}; }})"
                );
                let _ = writeln!(src, "        r{index} = {};", round(expr, steps[index].precision, true)?);
                emitted[index] = true;
                if op == ReduceOp::SumSquares && steps[index].precision == Precision::Wide && c_ty == Ty::Float {
                    // A row whose f32 sum of squares overflowed although its mean may fit: the
                    // reference's sum, in double, serially in element order by each thread of the
                    // row (the hand-written norms' rescue, `norm_wide_sum_squares`), then a
                    // barrier before any thread writes what the others read.
                    let Op::Reduce { x, .. } = steps[index].op else { unreachable!("reductions are listed") };
                    let _ = writeln!(src, "        if (live && isinf(r{index})) {{");
                    let _ = writeln!(src, "            double wide = 0;");
                    let _ = writeln!(src, "            for (int j = 0; j < n{index}; ++j) {{");
                    for step in element_cone(steps, x) {
                        let _ = writeln!(src, "                {}", element(step, &Column::WALK)?);
                    }
                    let e = format!("(double)e{}", x.0);
                    let _ = writeln!(src, "                wide = c_add(wide, c_mul({e}, {e}));");
                    let _ = writeln!(src, "            }}");
                    let _ = writeln!(src, "            r{index} = wide;");
                    let _ = writeln!(src, "        }}");
                    let _ = writeln!(src, "        __syncthreads();");
                }
            }
        }
    } else {
        for pass in 0..passes {
            row_steps(&mut src, pass, &mut emitted)?;
            let reductions = &schedule.reductions[pass];
            init_reductions(&mut src, reductions)?;
            let last = pass + 1 == passes;
            let thread = syntax.thread();
            match rotary {
                None => {
                    let _ = writeln!(src, "        for (int j = {thread}; j < width; j += {ROW_BLOCK}) {{");
                }
                Some(cache) => {
                    let _ = writeln!(src, "        for (int p = {thread}; p < width - rhalf; p += {ROW_BLOCK}) {{");
                    let InputKind::CosSinCache { neox, .. } = program.inputs()[cache].kind else {
                        unreachable!("a built program's rotary steps read a cache")
                    };
                    let (ja, jb) = if neox { ("p", "p + rhalf") } else { ("2 * p", "2 * p + 1") };
                    let _ = writeln!(src, "            const int two = p < rhalf;");
                    let _ = writeln!(src, "            const int turn = two && inside;");
                    let _ = writeln!(src, "            const int ja = two ? {ja} : p + rhalf;");
                    let _ = writeln!(src, "            const int jb = two ? {jb} : ja;");
                }
            }
            // Each column's value of every element step the pass needs, step by step (a pair's
            // partner value exists before the step that reads it).
            for &index in &schedule.elements[pass] {
                for column in &columns {
                    let _ = writeln!(src, "            {}", element(index, column)?);
                }
            }
            let counts = |column: &Column| if column.suffix == "_b" { "two && " } else { "" };
            for &index in reductions {
                let Op::Reduce { op, x, .. } = steps[index].op else { unreachable!("reductions are listed") };
                for column in &columns {
                    let term = syntax.accumulate(op, &format!("a{index}"), &format!("e{}{}", x.0, column.suffix));
                    let _ =
                        writeln!(src, "            if ({}{} < n{index}) a{index} = {term};", counts(column), column.at);
                }
            }
            if last {
                for (k, output) in program.outputs().iter().enumerate() {
                    if steps[output.value.0 as usize].extent != Extent::Element {
                        continue;
                    }
                    let dtype = binding.output_dtype(output.dtype);
                    for column in &columns {
                        // In place: into the activation's element this iteration loaded (each thread
                        // reads its columns of the row before it writes them; no other thread reads them).
                        let at = column.at;
                        let (buffer, at) = match in_place_target(output) {
                            Some(input) => (format!("in{input}"), format!("base{input} + {at}")),
                            None => (format!("out{k}"), format!("row * ({long})width + {at}")),
                        };
                        let store =
                            syntax.store(&buffer, dtype, &at, &format!("e{}{}", output.value.0, column.suffix), c_ty);
                        match column.suffix {
                            "_b" => {
                                let _ = writeln!(src, "            if (two) {store}");
                            }
                            _ => {
                                let _ = writeln!(src, "            {store}");
                            }
                        }
                    }
                }
            }
            let _ = writeln!(src, "        }}");
            for &index in reductions {
                let Op::Reduce { op, .. } = steps[index].op else { unreachable!("reductions are listed") };
                let expr = format!("(double){}", syntax.combine(op, &format!("a{index}"), acc_ty(op)));
                let _ = writeln!(src, "        r{index} = {};", round(expr, steps[index].precision, true)?);
                emitted[index] = true;
            }
        }
    }
    row_steps(&mut src, passes, &mut emitted)?;
    for (k, output) in program.outputs().iter().enumerate() {
        if steps[output.value.0 as usize].extent == Extent::Row {
            let dtype = binding.output_dtype(output.dtype);
            let store = syntax.store(&format!("out{k}"), dtype, "row", &format!("r{}", output.value.0), Ty::Double);
            let first =
                if chunks.is_some() { "live && lane == 0".to_owned() } else { format!("{} == 0", syntax.thread()) };
            let _ = writeln!(src, "        if ({first}) {store}");
        }
    }
    src.push_str("    }\n}\n");
    Ok(src)
}

/// The defines a backend compiles a generated kernel of `shape` with (`RP_TPR`, threads per row;
/// `RP_VEC`, 1 for whole chunks; none for a walk): the source does not read them, they name the
/// shape in a compile's options and in the emulator's launch records.
pub fn shape_defines(shape: RowShape) -> Vec<(&'static str, String)> {
    match shape {
        RowShape::Walk => Vec::new(),
        RowShape::Chunks { threads_per_row, vectorized } => {
            vec![("RP_TPR", threads_per_row.to_string()), ("RP_VEC", u8::from(vectorized).to_string())]
        }
    }
}

/// The elements of a chunk in the [`RowShape::Chunks`] layout: 16 bytes of the first activation's
/// dtype (the unit of the hand-written norms' threads, so their reductions' order).
pub fn chunk_elements(program: &RowProgram, binding: &Binding) -> usize {
    crate::gpu_chunk(row_dtype(program, binding))
}

/// A buffer that a call of a row program reads or writes in chunks (an activation, a weight, a
/// fresh output), as its host found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkBuffer {
    /// Its elements' dtype.
    pub dtype: DType,
    /// The alignment of its first element's address: a power of two, or 0 for a backend without
    /// wide accesses.
    pub alignment: usize,
    /// Its row and block strides in elements (zeros for a fresh compact output, whose rows are
    /// the width apart).
    pub strides: [usize; 2],
}

/// Whether `input` is read in chunks, so its alignment counts for [`chunks_aligned`]: the
/// activations and the weights (positions and a cos/sin cache are read by index).
pub fn read_in_chunks(input: &ir_ops::row_program::Input) -> bool {
    matches!(input.kind, InputKind::Activation { .. } | InputKind::Weight)
}

/// Whether a call may take the [`RowShape::Chunks`] layout's whole-chunk accesses: the row width
/// is a multiple of a chunk ([`chunk_elements`]) and every buffer the call reads or writes in
/// chunks allows a chunk's accesses: its first element's address and each of its strides keep a
/// chunk's alignment (16 bytes, or the chunk's size when smaller: an fp8 output's 8). f64 never.
pub fn chunks_aligned(program: &RowProgram, binding: &Binding, buffers: impl IntoIterator<Item = ChunkBuffer>) -> bool {
    let chunk = chunk_elements(program, binding);
    binding.width.is_multiple_of(chunk) && buffers.into_iter().all(|buffer| chunk_aligned(buffer, chunk))
}

/// Whether `buffer` allows whole-chunk accesses of `chunk` elements.
fn chunk_aligned(buffer: ChunkBuffer, chunk: usize) -> bool {
    let size = buffer.dtype.size_in_bytes();
    let unit = (chunk * size).min(16);
    buffer.dtype != DType::F64
        && unit >= 4
        && unit.is_power_of_two()
        && buffer.alignment >= unit
        && buffer.alignment.is_multiple_of(unit)
        && buffer.strides.iter().all(|stride| (stride * size).is_multiple_of(unit))
}

/// The first activation's dtype, which fixes a chunk's elements.
fn row_dtype(program: &RowProgram, binding: &Binding) -> DType {
    let first = program.inputs().iter().position(|input| matches!(input.kind, InputKind::Activation { .. }));
    first.and_then(|input| binding.dtypes[input]).unwrap_or(binding.compute)
}

/// The chunks of each activation stream (an input's block) a thread of the [`RowShape::Chunks`]
/// layout keeps in registers: the hand-written `rms_norm`'s count for the row's dtype and threads
/// per row ([`norm_cache_chunks`](crate::norm_cache_chunks): the whole row up to the largest width
/// of the bucket), shared among the streams (16-bit streams held packed take half the registers
/// of f32 ones, so two of them keep the whole count, as the hand-written fused norm does).
pub fn cached_chunks(program: &RowProgram, binding: &Binding, threads_per_row: u32) -> u32 {
    let dtype = row_dtype(program, binding);
    let chunks = crate::norm_cache_chunks(dtype, threads_per_row);
    let mut streams = Vec::new();
    for step in program.steps() {
        if let Op::Load { input, block } = step.op
            && !streams.contains(&(input, block))
        {
            streams.push((input, block));
        }
    }
    let budget = if dtype.size_in_bytes() < 4 { 2 * chunks } else { chunks };
    (budget / streams.len().max(1) as u32).clamp(1, chunks.max(1))
}

/// The element steps value `x` is computed from (itself included), in step order.
fn element_cone(steps: &[ir_ops::row_program::Step], x: ValueId) -> Vec<usize> {
    let mut needed = vec![false; x.0 as usize + 1];
    needed[x.0 as usize] = true;
    for index in (0..=x.0 as usize).rev() {
        if !needed[index] {
            continue;
        }
        let operands: &[ValueId] = match &steps[index].op {
            Op::Unary(_, a) => std::slice::from_ref(a),
            Op::Binary(_, a, b) => &[*a, *b],
            Op::Pair { x, .. } => std::slice::from_ref(x),
            _ => &[],
        };
        for operand in operands {
            if steps[operand.0 as usize].extent == Extent::Element {
                needed[operand.0 as usize] = true;
            }
        }
    }
    (0..=x.0 as usize).filter(|&index| needed[index] && steps[index].extent == Extent::Element).collect()
}

/// One column a generated loop iteration computes: its values' suffix, its index variable, and
/// (in a rotary program) the suffix of its partner's values.
struct Column {
    suffix: &'static str,
    at: &'static str,
    partner: Option<&'static str>,
    /// In the chunk layout, where the column's chunk of an activation stream and of a weight are
    /// held (`ld<input>_<block><slot>`, `wt<input><slot>`); element `i` of them is the column.
    slot: Option<(&'static str, &'static str)>,
}

impl Column {
    /// The column `j` of a row walked one element at a time, outside any chunk.
    const WALK: Column = Column { suffix: "", at: "j", partner: None, slot: None };
}

/// The activation streams (an input's block) and the weights one pass of a generated kernel reads,
/// each once, in the order of their first read.
#[derive(Default)]
struct PassReads {
    loads: Vec<(usize, usize)>,
    weights: Vec<usize>,
}

/// The loops over a thread's cached chunks in the [`RowShape::Chunks`] layout: `k` counts them,
/// chunk `c = lane + k·TPR`.
struct CachedChunks<'a> {
    /// The source's 64-bit integer type.
    long: &'a str,
    tpr: u32,
}

impl CachedChunks<'_> {
    /// Emits a loop over the chunks `range` gives (the loop's init and condition on `k`), each
    /// chunk that lies in the row (`c < nc`) given to `inner` with its indent.
    fn each(
        &self,
        src: &mut String,
        indent: &str,
        range: &str,
        inner: impl FnOnce(&mut String, &str) -> Result<(), Unsupported>,
    ) -> Result<(), Unsupported> {
        let long = self.long;
        let _ = writeln!(src, "#pragma unroll");
        let _ = writeln!(src, "{indent}for ({range}; ++k) {{");
        let _ = writeln!(src, "{indent}    const {long} c = lane + ({long})k * {};", self.tpr);
        let _ = writeln!(src, "{indent}    if (c < nc) {{");
        inner(src, &format!("{indent}        "))?;
        let _ = writeln!(src, "{indent}    }}");
        let _ = writeln!(src, "{indent}}}");
        Ok(())
    }
}

/// Checks each reduction count a call passes as a scalar: an integer in `1..=W`
/// ([`Binding::count`]), which the generated kernels trust.
pub fn check_counts(
    program: &RowProgram,
    args: &[ir_ops::row_program::RowArg<'_>],
    binding: &Binding,
) -> Result<(), ir_core::KernelError> {
    for (index, step) in program.steps().iter().enumerate() {
        let Op::Reduce { count: Some(count), .. } = step.op else { continue };
        let Op::Param { input } = program.steps()[count.0 as usize].op else { continue };
        if let Some(&ir_ops::row_program::RowArg::Scalar(c)) = args.get(input) {
            binding.checked_count(program, index, c)?;
        }
    }
    Ok(())
}

/// What a generated kernel is made from besides its program: the compute dtype and each input's
/// dtype (`None` for a scalar), which fix every type in the source.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    /// The compute dtype.
    pub compute: DType,
    /// Each input's dtype.
    pub dtypes: smallvec::SmallVec<[Option<DType>; 8]>,
    /// Whether in-place outputs are written into their activations ([`Binding::in_place`]).
    pub in_place: bool,
    /// How the kernel lays the rows over its threads.
    pub shape: RowShape,
}

impl Signature {
    /// The signature of a call bound as `binding`, launched in `shape`.
    pub fn of(binding: &Binding, shape: RowShape) -> Signature {
        Signature {
            compute: binding.compute,
            dtypes: binding.dtypes.iter().copied().collect(),
            in_place: binding.in_place,
            shape,
        }
    }
}

impl std::fmt::Display for Signature {
    /// `compute f32; bf16, bf16, -`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "compute {};", self.compute)?;
        for (index, dtype) in self.dtypes.iter().enumerate() {
            let sep = if index == 0 { " " } else { ", " };
            match dtype {
                Some(dtype) => write!(f, "{sep}{dtype}")?,
                None => write!(f, "{sep}-")?,
            }
        }
        if self.in_place {
            write!(f, "; in place")?;
        }
        write!(f, "; {}", self.shape)
    }
}

/// A cache of kernels generated from row programs (a backend keeps one per device): a kernel per
/// program and [`Signature`]. A lookup hashes the program's fingerprint and the signature, then
/// compares the whole program, so two programs whose fingerprints collide never share a kernel.
#[derive(Debug)]
pub struct GeneratedKernels<K> {
    kernels: std::collections::HashMap<(u64, Signature), Vec<(RowProgram, K)>>,
}

impl<K> Default for GeneratedKernels<K> {
    fn default() -> Self {
        GeneratedKernels { kernels: std::collections::HashMap::new() }
    }
}

impl<K: Clone> GeneratedKernels<K> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The kernel of `program` for a call bound as `binding` and launched in `shape`, made by
    /// `make` (generation and compilation) on the first lookup; an error is returned and not cached.
    pub fn get_or_make<E>(
        &mut self,
        program: &RowProgram,
        binding: &Binding,
        shape: RowShape,
        make: impl FnOnce() -> Result<K, E>,
    ) -> Result<K, E> {
        let entries = self.kernels.entry((program.fingerprint(), Signature::of(binding, shape))).or_default();
        if let Some((_, kernel)) = entries.iter().find(|(cached, _)| cached == program) {
            return Ok(kernel.clone());
        }
        let kernel = make()?;
        entries.push((program.clone(), kernel.clone()));
        Ok(kernel)
    }

    /// How many kernels it holds.
    pub fn len(&self) -> usize {
        self.kernels.values().map(Vec::len).sum()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
