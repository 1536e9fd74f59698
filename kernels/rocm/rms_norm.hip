// RMS normalization kernels for the `rocm` provider, compiled ahead of time by `hipcc --genco`.
//
// One templated implementation per op; every variant is an `extern "C"` kernel named
// `<op>_<dtype>_w<weight>_v<vector width>_t<threads per row>`, so one code object holds them all. The
// weight is `w0` (none), `w1` (of the element type) or `wf32`/`wf16`/`wbf16` (another type: a
// Gemma-style f32 weight on bf16 activations), read with scalar loads; the weight step computes in
// the weight's type (y rounded to it, the product rounded to it) and the store rounds to the element
// type. The mean square runs over the first `variance` elements of each row (variance_size; the host
// passes H when it is not given); every element is normalized.
//
// The numerics and the ownership of elements are those of the CUDA kernels: f32 squares and sums,
// the fused sum as one f32 addition, the norm from the unrounded sum (cached in registers, else
// recomputed by the owning thread before it writes), the weight step rounding y first. Each thread
// owns whole 16-byte chunks in the same order whatever the load width, so results depend only on the
// row, H and the dtype. Reductions use the device's wave size (`warpSize`: 64 on CDNA, 32 on RDNA).

#include "element.hip.h"

// The longest row a kernel with TPR threads per row keeps whole in registers: the largest hidden size
// that launches with it (the CUDA provider's buckets), and 32768 for the last, open-ended one.
__host__ __device__ constexpr int largest_cached_row(int tpr) {
    return tpr <= 8 ? 64 : tpr == 16 ? 128 : tpr == 32 ? 3072 : tpr == 64 ? 6144 : tpr == 128 ? 16384 : 32768;
}

// The chunks of a row each thread keeps in registers: the whole row up to largest_cached_row(TPR).
__host__ __device__ constexpr int cache_chunks(int chunk, int tpr) {
    return (largest_cached_row(tpr) + chunk * tpr - 1) / (chunk * tpr);
}

template <int DTYPE, int VEC>
__device__ __forceinline__ void load_chunk(const typename Elem<DTYPE>::T* row, long long c, int hidden, float* out) {
    typedef Elem<DTYPE> E;
    constexpr int CHUNK = E::CHUNK;
    long long first = c * CHUNK;
    if (VEC == CHUNK && first + CHUNK <= hidden) {
        struct alignas(16) Packed { typename E::T v[CHUNK]; };
        Packed packed = *reinterpret_cast<const Packed*>(row + first);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out[i] = E::load(packed.v[i]);
        return;
    }
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = (first + i < hidden) ? E::load(row[first + i]) : 0.0f;
}

template <int DTYPE, int VEC>
__device__ __forceinline__ void store_chunk(typename Elem<DTYPE>::T* row, long long c, int hidden, const float* in) {
    typedef Elem<DTYPE> E;
    constexpr int CHUNK = E::CHUNK;
    long long first = c * CHUNK;
    if (VEC == CHUNK && first + CHUNK <= hidden) {
        struct alignas(16) Packed { typename E::T v[CHUNK]; };
        Packed packed;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) packed.v[i] = E::store(in[i]);
        *reinterpret_cast<Packed*>(row + first) = packed;
        return;
    }
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
        if (first + i < hidden) row[first + i] = E::store(in[i]);
    }
}

// Sums over the TPR threads of a row; every thread of the block calls it.
template <int TPR, int BLOCK>
__device__ __forceinline__ float row_sum(float value) {
    const int wave = warpSize;
    if (TPR <= wave) {
        for (int offset = TPR / 2; offset > 0; offset >>= 1) value += __shfl_xor(value, offset);
        return value;
    }
    for (int offset = wave / 2; offset > 0; offset >>= 1) value += __shfl_xor(value, offset);
    __shared__ float partials[BLOCK / 32];
    int lane_in_wave = threadIdx.x % wave;
    if (lane_in_wave == 0) partials[threadIdx.x / wave] = value;
    __syncthreads();
    int per_row = TPR / wave;
    int first = (threadIdx.x / TPR) * per_row;
    float total = 0.0f;
    for (int w = 0; w < per_row; ++w) total += partials[first + w];
    return total;
}

// The weight's element type: WDTYPE -1 means no weight (any type serves), else Elem<WDTYPE>.
template <int WDTYPE> struct Weight { typedef typename Elem<WDTYPE>::T T; };
template <> struct Weight<-1> { typedef float T; };

template <int DTYPE, int WDTYPE, int VEC>
__device__ __forceinline__ void finish_chunk(typename Elem<DTYPE>::T* out_row, const typename Weight<WDTYPE>::T* weight,
                                             long long c, int hidden, float* s, float rstd) {
    typedef Elem<DTYPE> E;
#pragma unroll
    for (int i = 0; i < E::CHUNK; ++i) s[i] *= rstd;
    if constexpr (WDTYPE >= 0) {
        typedef Elem<WDTYPE> W;
        float w[E::CHUNK];
        if constexpr (WDTYPE == DTYPE) {
            load_chunk<DTYPE, VEC>(weight, c, hidden, w);
        } else {
            long long first = c * E::CHUNK;
#pragma unroll
            for (int i = 0; i < E::CHUNK; ++i) w[i] = (first + i < hidden) ? W::load(weight[first + i]) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < E::CHUNK; ++i) s[i] = round_elem<WDTYPE>(round_elem<WDTYPE>(s[i]) * w[i]);
    }
    store_chunk<DTYPE, VEC>(out_row, c, hidden, s);
}

// The mean square of the first `count` elements of a row when their f32 sum of squares overflowed
// (|x| above about 1.8e19 / sqrt(count)) although the mean may fit: the elements scaled by their
// largest magnitude, summed serially by the calling thread (no barrier, so any subset of threads may
// call it), then scaled back. A rare path.
template <int DTYPE>
__device__ __noinline__ float rescaled_mean_square(const typename Elem<DTYPE>::T* x_row,
                                                   const typename Elem<DTYPE>::T* r_row, int count) {
    typedef Elem<DTYPE> E;
    float largest = 0.0f;
    for (int j = 0; j < count; ++j) {
        float s = E::load(x_row[j]) + (r_row ? E::load(r_row[j]) : 0.0f);
        largest = fmaxf(largest, fabsf(s));
    }
    if (!(largest > 0.0f) || isinf(largest)) return __builtin_huge_valf();
    float sum = 0.0f;
    for (int j = 0; j < count; ++j) {
        float s = (E::load(x_row[j]) + (r_row ? E::load(r_row[j]) : 0.0f)) / largest;
        sum += s * s;
    }
    return sum / (float)count * largest * largest;
}

// Chunk `c` of x, plus the residual's for the fused op (one f32 addition per element).
template <int DTYPE, int VEC, bool FUSED>
__device__ __forceinline__ void load_sum(const typename Elem<DTYPE>::T* x_row, const typename Elem<DTYPE>::T* r_row,
                                         long long c, int hidden, float* s) {
    load_chunk<DTYPE, VEC>(x_row, c, hidden, s);
    if (FUSED) {
        float r[Elem<DTYPE>::CHUNK];
        load_chunk<DTYPE, VEC>(r_row, c, hidden, r);
#pragma unroll
        for (int i = 0; i < Elem<DTYPE>::CHUNK; ++i) s[i] += r[i];
    }
}

// Adds the squares of chunk `c`'s elements among the first `variance` of the row to `sum`, in element
// order (the others add an exact 0, so with variance = H the sum is the plain one).
template <int CHUNK>
__device__ __forceinline__ void add_squares(float& sum, const float* s, long long c, int variance) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) sum += (c * CHUNK + i < variance) ? s[i] * s[i] : 0.0f;
}

template <int DTYPE, int WDTYPE, int VEC, int TPR, int BLOCK, bool FUSED>
__device__ __forceinline__ void norm_impl(typename Elem<DTYPE>::T* first, typename Elem<DTYPE>::T* second,
                                          const typename Weight<WDTYPE>::T* weight, float epsilon, long long n_rows,
                                          int hidden, int variance, long long first_stride, long long second_stride) {
    // rms_norm: first = out, second = x.  fused: first = x, second = residual (both written).
    typedef Elem<DTYPE> E;
    constexpr int CHUNK = E::CHUNK;
    long long row = (long long)blockIdx.x * (BLOCK / TPR) + threadIdx.x / TPR;
    int lane = threadIdx.x % TPR;
    bool active = row < n_rows;
    long long n_chunks = (hidden + CHUNK - 1) / CHUNK;
    typename E::T* a_row = first + (active ? row : 0) * first_stride;
    typename E::T* b_row = second + (active ? row : 0) * second_stride;
    const typename E::T* x_row = FUSED ? a_row : b_row;

    // Each thread's chunks stay in registers between the two passes (the whole row up to the
    // bucket's largest H; longer rows read the rest again): the loops over them are unrolled, so
    // every index into `cache` is a constant (a runtime index would put the array in scratch memory).
    constexpr int CACHE_CHUNKS = cache_chunks(CHUNK, TPR);
    float cache[CACHE_CHUNKS][CHUNK];
    float sum_sq = 0.0f;
    if (active) {
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * TPR;
            if (c < n_chunks) {
                load_sum<DTYPE, VEC, FUSED>(x_row, b_row, c, hidden, cache[k]);
                add_squares<CHUNK>(sum_sq, cache[k], c, variance);
            }
        }
        for (long long c = lane + (long long)CACHE_CHUNKS * TPR; c < n_chunks; c += TPR) {
            float s[CHUNK];
            load_sum<DTYPE, VEC, FUSED>(x_row, b_row, c, hidden, s);
            add_squares<CHUNK>(sum_sq, s, c, variance);
        }
    }
    float total = row_sum<TPR, BLOCK>(sum_sq);
    float mean_square = active && isinf(total)
                            ? rescaled_mean_square<DTYPE>(x_row, FUSED ? b_row : nullptr, variance)
                            : total / (float)variance;
    // The fused rescue reads the whole row: no thread of the block writes before every one has read.
    if (FUSED) __syncthreads();
    if (!active) return;
    float rstd = 1.0f / sqrtf(mean_square + epsilon);
    typename E::T* out_row = a_row;
    // Each chunk belongs to one thread, which recomputes an uncached chunk from x and the residual
    // before it overwrites them.
#pragma unroll
    for (int k = 0; k < CACHE_CHUNKS; ++k) {
        long long c = lane + (long long)k * TPR;
        if (c < n_chunks) {
            if (FUSED) store_chunk<DTYPE, VEC>(b_row, c, hidden, cache[k]);
            finish_chunk<DTYPE, WDTYPE, VEC>(out_row, weight, c, hidden, cache[k], rstd);
        }
    }
    for (long long c = lane + (long long)CACHE_CHUNKS * TPR; c < n_chunks; c += TPR) {
        float s[CHUNK];
        load_sum<DTYPE, VEC, FUSED>(x_row, b_row, c, hidden, s);
        if (FUSED) store_chunk<DTYPE, VEC>(b_row, c, hidden, s);
        finish_chunk<DTYPE, WDTYPE, VEC>(out_row, weight, c, hidden, s, rstd);
    }
}

#define BLOCK_FOR(TPR) ((TPR) > 128 ? 256 : 128)

// WD: the weight's type code (-1 none); W: its part of the symbol (0, 1, f32, f16, bf16).
#define DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, TPR)                                                                \
    extern "C" __global__ void __launch_bounds__(BLOCK_FOR(TPR))                                                   \
        rms_norm_##NAME##_w##W##_v##VEC##_t##TPR(Elem<DTYPE>::T* out, const Elem<DTYPE>::T* x,                     \
                                                 const Weight<WD>::T* weight, float epsilon, long long n_rows,     \
                                                 int hidden, int variance, long long x_row_stride,                \
                                                 long long out_row_stride) {                                       \
        norm_impl<DTYPE, WD, VEC, TPR, BLOCK_FOR(TPR), false>(out, const_cast<Elem<DTYPE>::T*>(x), weight,        \
                                                              epsilon, n_rows, hidden, variance, out_row_stride,  \
                                                              x_row_stride);                                      \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_FOR(TPR))                                                   \
        fused_add_rms_norm_##NAME##_w##W##_v##VEC##_t##TPR(                                                        \
            Elem<DTYPE>::T* x, Elem<DTYPE>::T* residual, const Weight<WD>::T* weight, float epsilon,               \
            long long n_rows, int hidden, int variance, long long x_row_stride, long long residual_row_stride) {   \
        norm_impl<DTYPE, WD, VEC, TPR, BLOCK_FOR(TPR), true>(x, residual, weight, epsilon, n_rows, hidden,         \
                                                             variance, x_row_stride, residual_row_stride);        \
    }

#define DEFINE_TPR(DTYPE, NAME, WD, W, VEC)     \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 8)   \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 16)  \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 32)  \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 64)  \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 128) \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 256)

// A weight of another type than the elements: at two row widths (32 and 256 threads per row).
#define DEFINE_MIXED(DTYPE, NAME, WD, W, VEC)    \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 32)  \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 256)

#define DEFINE_DTYPE(DTYPE, NAME, CHUNK)     \
    DEFINE_TPR(DTYPE, NAME, -1, 0, 1)        \
    DEFINE_TPR(DTYPE, NAME, -1, 0, CHUNK)    \
    DEFINE_TPR(DTYPE, NAME, DTYPE, 1, 1)     \
    DEFINE_TPR(DTYPE, NAME, DTYPE, 1, CHUNK)

DEFINE_DTYPE(0, f32, 4)
DEFINE_DTYPE(1, f16, 8)
DEFINE_DTYPE(2, bf16, 8)
DEFINE_MIXED(0, f32, 1, f16, 1)
DEFINE_MIXED(0, f32, 1, f16, 4)
DEFINE_MIXED(0, f32, 2, bf16, 1)
DEFINE_MIXED(0, f32, 2, bf16, 4)
DEFINE_MIXED(1, f16, 0, f32, 1)
DEFINE_MIXED(1, f16, 0, f32, 8)
DEFINE_MIXED(1, f16, 2, bf16, 1)
DEFINE_MIXED(1, f16, 2, bf16, 8)
DEFINE_MIXED(2, bf16, 0, f32, 1)
DEFINE_MIXED(2, bf16, 0, f32, 8)
DEFINE_MIXED(2, bf16, 1, f16, 1)
DEFINE_MIXED(2, bf16, 1, f16, 8)
