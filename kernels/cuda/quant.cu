// fp8 quantization of the `cuda` provider: `static_scaled_fp8_quant` and
// `dynamic_per_token_scaled_fp8_quant`. Compiled after `element.cuh` and `fp8.cuh`, per input dtype.
//
// q[row, j] = fp8(x[row, j] / s) with one IEEE division in the compute type (element.cuh: f32, f64
// for f64 elements, whose quotient narrows through f32 rounded to odd) and a saturating
// nearest-even conversion; the dynamic kernel's s = max(min(absmax, ub) / M, 1 / (M * 512)),
// absmax reduced with fmax (NaN skipped); a dynamic scale is stored as f32. `format` 0 = f8e4m3fn
// (M = 448), 1 = f8e5m2 (M = 57344). q is compact rows of `hidden` bytes. The conversion is the
// hardware's `cvt.rn.satfinite` on sm_89 and later, and software with the same bits before (fp8.cuh).
//
// One block of QUANT_BLOCK threads per row. Each kernel has a scalar form (any alignment) and,
// except for f64, a `_vec` form with the same prototype: 16-byte loads of x (and of the norm's
// residual and weight) and CHUNK-byte stores of q, which the host picks when every row involved
// starts 16-byte aligned and hidden % CHUNK == 0. Thread t owns chunks t, t + QUANT_BLOCK, ... of
// CHUNK elements in both forms, so both give the same bits. Loads in flight: the static kernel
// issues QUANT_UNROLL chunks per step before converting any; the dynamic kernel (and the norm +
// quantization, norm_quant.cu) keeps a thread's first QUANT_CACHE chunks in registers, all their
// loads issued first, so a row up to QUANT_BLOCK * CHUNK * QUANT_CACHE elements (8192 f16/bf16,
// 4096 f32) is read once; the chunks past them are read again for the last pass.

#define QUANT_BLOCK 256
#define QUANT_UNROLL 2
// f64 (a reference dtype) caches fewer: with four, the f64 divisions' slow path took a stack frame.
#if DTYPE == 6
#define QUANT_CACHE 2
#else
#define QUANT_CACHE 4
#endif

__device__ __forceinline__ unsigned char to_fp8(compute_t v, int format) {
    return format == 0 ? fp8_e4m3(narrow_f32(v)) : fp8_e5m2(narrow_f32(v));
}

// The maximum of `value` over the block in a fixed tree order (fmax: NaN skipped); every thread gets it.
__device__ __forceinline__ compute_t quant_block_max(compute_t value, compute_t* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = QUANT_BLOCK / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] = c_fmax(scratch[threadIdx.x], scratch[threadIdx.x + width]);
        __syncthreads();
    }
    compute_t total = scratch[0];
    __syncthreads();
    return total;
}

// A chunk's fp8 codes, four to a 32-bit word (code i in byte i % 4 of word i / 4: bytes of a struct
// written one by one would put it in local memory), stored as one access on the vector path.
struct alignas(CHUNK >= 4 ? CHUNK : 4) qcodes_t {
    unsigned int w[(CHUNK + 3) / 4];
};

__device__ __forceinline__ void set_code(qcodes_t& codes, int i, unsigned char code) {
    unsigned int shifted = (unsigned int)code << (8 * (i % 4));
    codes.w[i / 4] = i % 4 == 0 ? shifted : codes.w[i / 4] | shifted;
}

// The chunks of a row of `hidden` elements.
__device__ __forceinline__ int quant_chunks(int hidden) { return hidden / CHUNK + (hidden % CHUNK != 0); }

// Writes chunk `c`'s codes into a row of `hidden` codes (those below `hidden`): one store when VEC
// (4 or 8 bytes, aligned: the row starts a whole chunk of codes).
template <bool VEC>
__device__ __forceinline__ void store_codes(unsigned char* row, int c, int hidden, const qcodes_t& codes) {
    int first = c * CHUNK;
    if (VEC) {
        *reinterpret_cast<qcodes_t*>(row + first) = codes;
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            if (first + i < hidden) row[first + i] = (unsigned char)(codes.w[i / 4] >> (8 * (i % 4)));
        }
    }
}

// The codes of chunk `value` divided by s.
__device__ __forceinline__ qcodes_t quant_chunk(const row_chunk_t& value, compute_t s, int format) {
    qcodes_t codes;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) set_code(codes, i, to_fp8(c_div(to_c(value.v[i]), s), format));
    return codes;
}

template <bool VEC>
__device__ __forceinline__ void static_quant(unsigned char* __restrict__ q, const elem_t* __restrict__ x,
                                             long long n_rows, int hidden, long long x_row_stride,
                                             const float* __restrict__ scale, int format) {
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* x_row = x + row * x_row_stride;
    unsigned char* q_row = q + row * (long long)hidden;
    const int n = quant_chunks(hidden);
    compute_t s = *scale;
    for (int c0 = threadIdx.x; c0 < n; c0 += QUANT_UNROLL * QUANT_BLOCK) {
        row_chunk_t v[QUANT_UNROLL];
#pragma unroll
        for (int k = 0; k < QUANT_UNROLL; ++k) {
            int c = c0 + k * QUANT_BLOCK;
            if (c < n) load_row_chunk<VEC>(x_row, c, hidden, v[k]);
        }
#pragma unroll
        for (int k = 0; k < QUANT_UNROLL; ++k) {
            int c = c0 + k * QUANT_BLOCK;
            if (c < n) store_codes<VEC>(q_row, c, hidden, quant_chunk(v[k], s, format));
        }
    }
}

template <bool VEC>
__device__ __forceinline__ void dynamic_quant(unsigned char* __restrict__ q, float* __restrict__ scales,
                                              const elem_t* __restrict__ x, long long n_rows, int hidden,
                                              long long x_row_stride, const float* __restrict__ scale_ub, int has_ub,
                                              int format) {
    __shared__ compute_t scratch[QUANT_BLOCK];
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* x_row = x + row * x_row_stride;
    unsigned char* q_row = q + row * (long long)hidden;
    const int n = quant_chunks(hidden);
    // Every slot loads, with no test between the loads: a slot past the row's end loads its last
    // chunk again, which changes no maximum and is never stored (and elements past `hidden` read
    // as zero, which changes none either). Tested per slot, ptxas kept the tests in local memory.
    row_chunk_t cache[QUANT_CACHE];
#pragma unroll
    for (int k = 0; k < QUANT_CACHE; ++k) load_row_chunk<VEC>(x_row, min(threadIdx.x + k * QUANT_BLOCK, n - 1), hidden, cache[k]);
    compute_t absmax = 0.0f;
#pragma unroll
    for (int k = 0; k < QUANT_CACHE; ++k) {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(to_c(cache[k].v[i])));
    }
    for (int c = threadIdx.x + QUANT_CACHE * QUANT_BLOCK; c < n; c += QUANT_BLOCK) {
        row_chunk_t v;
        load_row_chunk<VEC>(x_row, c, hidden, v);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(to_c(v.v[i])));
    }
    absmax = quant_block_max(absmax, scratch);
    if (has_ub) absmax = c_fmin(absmax, (compute_t)*scale_ub);
    compute_t max_finite = format == 0 ? 448.0f : 57344.0f;
    compute_t s = c_fmax(c_div(absmax, max_finite), c_div(compute_t(1), max_finite * 512));
    if (threadIdx.x == 0) scales[row] = s;
#pragma unroll
    for (int k = 0; k < QUANT_CACHE; ++k) {
        int c = threadIdx.x + k * QUANT_BLOCK;
        if (c < n) store_codes<VEC>(q_row, c, hidden, quant_chunk(cache[k], s, format));
    }
    for (int c = threadIdx.x + QUANT_CACHE * QUANT_BLOCK; c < n; c += QUANT_BLOCK) {
        row_chunk_t v;
        load_row_chunk<VEC>(x_row, c, hidden, v);
        store_codes<VEC>(q_row, c, hidden, quant_chunk(v, s, format));
    }
}

#define STATIC_QUANT_KERNEL(NAME, VEC)                                                                           \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK)                                                    \
        NAME(unsigned char* __restrict__ q, const elem_t* __restrict__ x, long long n_rows, int hidden,          \
             long long x_row_stride, const float* __restrict__ scale, int format) {                              \
        static_quant<VEC>(q, x, n_rows, hidden, x_row_stride, scale, format);                                    \
    }

#define DYNAMIC_QUANT_KERNEL(NAME, VEC)                                                                          \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK)                                                    \
        NAME(unsigned char* __restrict__ q, float* __restrict__ scales, const elem_t* __restrict__ x,            \
             long long n_rows, int hidden, long long x_row_stride, const float* __restrict__ scale_ub,           \
             int has_ub, int format) {                                                                           \
        dynamic_quant<VEC>(q, scales, x, n_rows, hidden, x_row_stride, scale_ub, has_ub, format);                \
    }

STATIC_QUANT_KERNEL(CONCAT(static_scaled_fp8_quant, KERNEL_SUFFIX), false)
DYNAMIC_QUANT_KERNEL(CONCAT(dynamic_per_token_scaled_fp8_quant, KERNEL_SUFFIX), false)
#if DTYPE != 6
STATIC_QUANT_KERNEL(CONCAT(CONCAT(static_scaled_fp8_quant, KERNEL_SUFFIX), vec), true)
DYNAMIC_QUANT_KERNEL(CONCAT(CONCAT(dynamic_per_token_scaled_fp8_quant, KERNEL_SUFFIX), vec), true)
#endif
