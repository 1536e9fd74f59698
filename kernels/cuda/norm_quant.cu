// RMS normalization followed by fp8 quantization in one kernel: the ops `rms_norm_static_fp8_quant`,
// `rms_norm_dynamic_per_token_quant`, `fused_add_rms_norm_static_fp8_quant` and
// `fused_add_rms_norm_dynamic_per_token_quant`. Compiled after `element.cuh` and `quant.cu` (the
// conversion, the chunk loads and stores, the block maximum), per input dtype.
//
// One block of QUANT_BLOCK threads per row, every value in the compute type (element.cuh: f32, f64
// for f64 elements), each thread owning chunks t, t + QUANT_BLOCK, ... (quant.cu), a scalar form
// and, except for f64, a `_vec` form (16-byte loads of x, the residual and the weight, 16-byte
// stores of the residual output, CHUNK-byte stores of q). A thread keeps its first QUANT_CACHE
// chunks of x and the residual in registers, their loads all issued before any is read, so a row
// up to QUANT_BLOCK * CHUNK * QUANT_CACHE elements is read once; chunks past them are read again in
// each pass. Pass 1 sums the squares of a = x (+ r) (in the thread's chunk order, then the block's
// tree); rstd = 1 / sqrt(sum / hidden + eps) (IEEE division and square root). Pass 2 (dynamic only:
// a static scale needs no reduction) reduces the absmax of the normalized values z. The last pass
// recomputes z, writes the residual output (the rounded sum) and q = fp8(z / s). z = round(round(a *
// rstd) * w), rounded to the element type at each step: the rounding points of the composition
// `quant(rms_norm(x))`. Each residual element is read and written by the same thread, the write
// after every read of it, so the residual output may be the residual's own rows (in place:
// `residual_out` is `r`, with its stride).

// f64 (a reference dtype) keeps the loop over uncached chunks in the absmax pass rolled: unrolled,
// ptxas spills a few of its doubles to a stack frame.
#if DTYPE == 6
#define F64_ROLLED _Pragma("unroll 1")
#else
#define F64_ROLLED
#endif

__device__ __forceinline__ compute_t quant_block_sum(compute_t value, compute_t* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = QUANT_BLOCK / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] += scratch[threadIdx.x + width];
        __syncthreads();
    }
    compute_t total = scratch[0];
    __syncthreads();
    return total;
}

// Chunk `c`'s values a = x (+ r), in the compute type.
__device__ __forceinline__ void row_values(const row_chunk_t& xc, const row_chunk_t& rc, int has_residual, compute_t* a) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
        a[i] = to_c(xc.v[i]);
        if (has_residual) a[i] = c_add(a[i], to_c(rc.v[i]));
    }
}

// Calls `f(c, a)` on each cached chunk c of the row (those that exist) with its values a = x (+ r).
template <typename F>
__device__ __forceinline__ void for_each_cached(const row_chunk_t (&xs)[QUANT_CACHE], const row_chunk_t (&rs)[QUANT_CACHE],
                                                int n, int has_residual, F f) {
#pragma unroll
    for (int k = 0; k < QUANT_CACHE; ++k) {
        int c = threadIdx.x + k * QUANT_BLOCK;
        if (c < n) {
            compute_t a[CHUNK];
            row_values(xs[k], rs[k], has_residual, a);
            f(c, a);
        }
    }
}

// Reads chunk `c` of x and, when there is one, of the residual.
template <bool VEC>
__device__ __forceinline__ void load_pair(const elem_t* x_row, const elem_t* r_row, int c, int hidden,
                                          int has_residual, row_chunk_t& xc, row_chunk_t& rc) {
    load_row_chunk<VEC>(x_row, c, hidden, xc);
    if (has_residual) load_row_chunk<VEC>(r_row, c, hidden, rc);
}

// The normalized values z of a chunk's values a (in place), weighted by chunk `c` of w when given.
template <bool VEC>
__device__ __forceinline__ void normalize(compute_t* a, compute_t rstd, const elem_t* w, int c, int hidden,
                                          int has_weight) {
    row_chunk_t wc;
    if (has_weight) load_row_chunk<VEC>(w, c, hidden, wc);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
        a[i] = round_elem(c_mul(a[i], rstd));
        if (has_weight) a[i] = round_elem(c_mul(a[i], to_c(wc.v[i])));
    }
}

// The last pass on one chunk: the residual output (when there is a residual) and q.
template <bool VEC>
__device__ __forceinline__ void finish_chunk(const row_chunk_t& xc, const row_chunk_t& rc, int c, compute_t rstd,
                                             compute_t s, const elem_t* w, elem_t* out_row, unsigned char* q_row,
                                             int hidden, int has_residual, int has_weight, int format) {
    compute_t a[CHUNK];
    row_values(xc, rc, has_residual, a);
    if (has_residual) {
        row_chunk_t sum;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) sum.v[i] = from_c(a[i]);
        store_row_chunk<VEC>(out_row, c, hidden, sum);
    }
    normalize<VEC>(a, rstd, w, c, hidden, has_weight);
    qcodes_t codes;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) set_code(codes, i, to_fp8(c_div(a[i], s), format));
    store_codes<VEC>(q_row, c, hidden, codes);
}

template <bool VEC>
__device__ __forceinline__ void norm_quant(unsigned char* __restrict__ q, float* __restrict__ scales,
                                           elem_t* residual_out, const elem_t* x, const elem_t* r,
                                           const elem_t* __restrict__ w, long long n_rows, int hidden,
                                           long long x_row_stride, long long r_row_stride, long long out_row_stride,
                                           compute_t eps, const float* __restrict__ scale, int has_residual,
                                           int has_weight, int dynamic, int has_scale, int format) {
    __shared__ compute_t scratch[QUANT_BLOCK];
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* x_row = x + row * x_row_stride;
    const elem_t* r_row = r + row * r_row_stride;
    unsigned char* q_row = q + row * (long long)hidden;
    elem_t* out_row = residual_out + row * out_row_stride;
    const int n = quant_chunks(hidden);
    const int first_uncached = threadIdx.x + QUANT_CACHE * QUANT_BLOCK;

    // Every slot loads x and the residual (x again when there is none), with no test between the
    // loads: a slot past the row's end loads its last chunk, which no pass uses. Tested per slot,
    // the compiler read the first chunks before the last loads were issued.
    const elem_t* r_cached = has_residual ? r_row : x_row;
    row_chunk_t xs[QUANT_CACHE], rs[QUANT_CACHE];
#pragma unroll
    for (int k = 0; k < QUANT_CACHE; ++k) {
        int c = min(threadIdx.x + k * QUANT_BLOCK, n - 1);
        load_row_chunk<VEC>(x_row, c, hidden, xs[k]);
        load_row_chunk<VEC>(r_cached, c, hidden, rs[k]);
    }

    // Elements past `hidden` read as zero and add an exact zero.
    compute_t squares = 0.0f;
    for_each_cached(xs, rs, n, has_residual, [&](int, compute_t* a) {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) squares = c_add(squares, c_mul(a[i], a[i]));
    });
    for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
        row_chunk_t xc, rc;
        load_pair<VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
        compute_t a[CHUNK];
        row_values(xc, rc, has_residual, a);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) squares = c_add(squares, c_mul(a[i], a[i]));
    }
    compute_t mean_square = c_div(quant_block_sum(squares, scratch), (compute_t)hidden);
    compute_t rstd = c_div(compute_t(1), c_sqrt(c_add(mean_square, eps)));

    compute_t s;
    if (dynamic) {
        // Elements past `hidden` normalize to zero (or NaN, which fmax skips): the maximum stays.
        compute_t absmax = 0.0f;
        for_each_cached(xs, rs, n, has_residual, [&](int c, compute_t* a) {
            normalize<VEC>(a, rstd, w, c, hidden, has_weight);
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(a[i]));
        });
        F64_ROLLED
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            row_chunk_t xc, rc;
            load_pair<VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
            compute_t a[CHUNK];
            row_values(xc, rc, has_residual, a);
            normalize<VEC>(a, rstd, w, c, hidden, has_weight);
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(a[i]));
        }
        // The branch is the same for the whole block, so every thread reaches the barriers.
        absmax = quant_block_max(absmax, scratch);
        if (has_scale) absmax = c_fmin(absmax, (compute_t)*scale);
        compute_t max_finite = format == 0 ? 448.0f : 57344.0f;
        s = c_fmax(c_div(absmax, max_finite), c_div(compute_t(1), max_finite * 512));
        if (threadIdx.x == 0) scales[row] = s;
    } else {
        s = *scale;
    }

#pragma unroll
    for (int k = 0; k < QUANT_CACHE; ++k) {
        int c = threadIdx.x + k * QUANT_BLOCK;
        if (c < n) finish_chunk<VEC>(xs[k], rs[k], c, rstd, s, w, out_row, q_row, hidden, has_residual, has_weight, format);
    }
    for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
        row_chunk_t xc, rc;
        load_pair<VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
        finish_chunk<VEC>(xc, rc, c, rstd, s, w, out_row, q_row, hidden, has_residual, has_weight, format);
    }
}

#define NORM_QUANT_KERNEL(NAME, VEC)                                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK)                                                     \
        NAME(unsigned char* __restrict__ q, float* __restrict__ scales, elem_t* residual_out, const elem_t* x,    \
             const elem_t* r, const elem_t* __restrict__ w, long long n_rows, int hidden, long long x_row_stride, \
             long long r_row_stride, long long out_row_stride, compute_t eps, const float* __restrict__ scale,    \
             int has_residual, int has_weight, int dynamic, int has_scale, int format) {                          \
        norm_quant<VEC>(q, scales, residual_out, x, r, w, n_rows, hidden, x_row_stride, r_row_stride,             \
                        out_row_stride, eps, scale, has_residual, has_weight, dynamic, has_scale, format);         \
    }

NORM_QUANT_KERNEL(CONCAT(norm_quant, KERNEL_SUFFIX), false)
#if DTYPE != 6
NORM_QUANT_KERNEL(CONCAT(CONCAT(norm_quant, KERNEL_SUFFIX), vec), true)
#endif
