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
// The numerics and the ownership of elements are those of the CUDA kernels, in the compute type
// (f32; f64 for f64 elements, element.hip.h): squares and sums, the fused sum as one addition, the norm from the unrounded sum (cached in registers, else
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

// One 16-byte chunk of a row as stored.
template <int DTYPE> struct alignas(16) Packed {
    typename Elem<DTYPE>::T v[Elem<DTYPE>::CHUNK];
};

// Reads chunk `c` of a row into the compute type. On the 16-byte path (VEC == CHUNK) the host
// guarantees H % CHUNK == 0, so the chunk is whole and loads without a bounds test.
template <int DTYPE, int VEC>
__device__ __forceinline__ void load_chunk(const typename Elem<DTYPE>::T* row, long long c, int hidden,
                                           Compute<DTYPE>* out) {
    typedef Elem<DTYPE> E;
    constexpr int CHUNK = E::CHUNK;
    long long first = c * CHUNK;
    if constexpr (VEC == CHUNK) {
        Packed<DTYPE> packed = *reinterpret_cast<const Packed<DTYPE>*>(row + first);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out[i] = E::load(packed.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out[i] = (first + i < hidden) ? E::load(row[first + i]) : 0.0f;
    }
}

// Writes chunk `c` of a row (the elements below `hidden`) from `values`, already in the element type.
template <int DTYPE, int VEC>
__device__ __forceinline__ void store_elems(typename Elem<DTYPE>::T* row, long long c, int hidden,
                                            const typename Elem<DTYPE>::T* values) {
    typedef Elem<DTYPE> E;
    constexpr int CHUNK = E::CHUNK;
    long long first = c * CHUNK;
    if constexpr (VEC == CHUNK) {
        Packed<DTYPE> packed;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) packed.v[i] = values[i];
        *reinterpret_cast<Packed<DTYPE>*>(row + first) = packed;
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            if (first + i < hidden) row[first + i] = values[i];
        }
    }
}

template <int DTYPE, int VEC>
__device__ __forceinline__ void store_chunk(typename Elem<DTYPE>::T* row, long long c, int hidden,
                                            const Compute<DTYPE>* in) {
    typename Elem<DTYPE>::T values[Elem<DTYPE>::CHUNK];
#pragma unroll
    for (int i = 0; i < Elem<DTYPE>::CHUNK; ++i) values[i] = Elem<DTYPE>::store(in[i]);
    store_elems<DTYPE, VEC>(row, c, hidden, values);
}

// Sums over the TPR threads of a row; every thread of the block calls it.
template <int TPR, int BLOCK, typename V>
__device__ __forceinline__ V row_sum(V value) {
    const int wave = warpSize;
    if (TPR <= wave) {
        for (int offset = TPR / 2; offset > 0; offset >>= 1) value += __shfl_xor(value, offset);
        return value;
    }
    for (int offset = wave / 2; offset > 0; offset >>= 1) value += __shfl_xor(value, offset);
    __shared__ V partials[BLOCK / 32];
    int lane_in_wave = threadIdx.x % wave;
    if (lane_in_wave == 0) partials[threadIdx.x / wave] = value;
    __syncthreads();
    int per_row = TPR / wave;
    int first = (threadIdx.x / TPR) * per_row;
    V total = 0.0f;
    for (int w = 0; w < per_row; ++w) total += partials[first + w];
    return total;
}

// The weight's element type: WDTYPE -1 means no weight (any type serves), else Elem<WDTYPE>.
template <int WDTYPE> struct Weight { typedef typename Elem<WDTYPE>::T T; };
template <> struct Weight<-1> { typedef float T; };

// Scales the chunk by rstd (and the weight, in the weight step's compute type: double when x or the
// weight is f64) and stores it, each element rounded once to the element type.
template <int DTYPE, int WDTYPE, int VEC>
__device__ __forceinline__ void finish_chunk(typename Elem<DTYPE>::T* out_row, const typename Weight<WDTYPE>::T* weight,
                                             long long c, int hidden, Compute<DTYPE>* s, Compute<DTYPE> rstd) {
    typedef Elem<DTYPE> E;
#pragma unroll
    for (int i = 0; i < E::CHUNK; ++i) s[i] *= rstd;
    if constexpr (WDTYPE >= 0) {
        typedef Elem<WDTYPE> W;
        typedef typename MixedCompute<DTYPE, WDTYPE>::T WC;
        WC w[E::CHUNK];
        if constexpr (WDTYPE == DTYPE) {
            load_chunk<DTYPE, VEC>(weight, c, hidden, w);
        } else {
            long long first = c * E::CHUNK;
#pragma unroll
            for (int i = 0; i < E::CHUNK; ++i) w[i] = (first + i < hidden) ? (WC)W::load(weight[first + i]) : WC(0);
        }
        typename E::T values[E::CHUNK];
#pragma unroll
        for (int i = 0; i < E::CHUNK; ++i) values[i] = E::store(round_elem<WDTYPE>(round_elem<WDTYPE>((WC)s[i]) * w[i]));
        store_elems<DTYPE, VEC>(out_row, c, hidden, values);
    } else {
        store_chunk<DTYPE, VEC>(out_row, c, hidden, s);
    }
}

// The second pass issues the weight loads of up to WEIGHT_AHEAD cached chunks before the first
// store of those chunks, so the weight costs one memory round trip per group of chunks, not one per
// chunk (on gfx9 each `s_waitcnt vmcnt(0)` before a weight's use also waits on the stores before
// it). Bounded, so the weight adds at most WEIGHT_AHEAD chunks of registers to the row's cache.
#define WEIGHT_AHEAD 8

// A weight chunk of x's type as stored: one 16-byte chunk.
template <int DTYPE, int WDTYPE> struct alignas(16) WeightChunk {
    typename Weight<WDTYPE>::T v[Elem<DTYPE>::CHUNK];
};

// Reads the weight of chunk `c` (of x's type, on the 16-byte path: one 16-byte load).
template <int DTYPE, int WDTYPE, int VEC>
__device__ __forceinline__ void load_weight(WeightChunk<DTYPE, WDTYPE>& out, const typename Weight<WDTYPE>::T* weight,
                                            long long c, int hidden) {
    static_assert(WDTYPE == DTYPE && VEC == Elem<DTYPE>::CHUNK, "the 16-byte weight path");
    out = *reinterpret_cast<const WeightChunk<DTYPE, WDTYPE>*>(weight + c * Elem<DTYPE>::CHUNK);
}

// finish_chunk with the chunk's weight already loaded: the same bits.
template <int DTYPE, int WDTYPE, int VEC>
__device__ __forceinline__ void finish_loaded(typename Elem<DTYPE>::T* out_row, const WeightChunk<DTYPE, WDTYPE>& wc,
                                              long long c, int hidden, Compute<DTYPE>* s, Compute<DTYPE> rstd) {
    typedef Elem<DTYPE> E;
#pragma unroll
    for (int i = 0; i < E::CHUNK; ++i) s[i] *= rstd;
    if constexpr (WDTYPE >= 0) {
        typedef typename MixedCompute<DTYPE, WDTYPE>::T WC;
        typename E::T values[E::CHUNK];
#pragma unroll
        for (int i = 0; i < E::CHUNK; ++i) {
            WC w = (WC)Elem<WDTYPE>::load(wc.v[i]);
            values[i] = E::store(round_elem<WDTYPE>(round_elem<WDTYPE>((WC)s[i]) * w));
        }
        store_elems<DTYPE, VEC>(out_row, c, hidden, values);
    } else {
        store_chunk<DTYPE, VEC>(out_row, c, hidden, s);
    }
}

// The mean square of the first `count` elements of a row when their f32 sum of squares overflowed
// (|x| above about 1.8e19 / sqrt(count)) although the mean may fit: the elements scaled by their
// largest magnitude, summed serially by the calling thread (no barrier, so any subset of threads may
// call it), then scaled back. A rare path.
template <int DTYPE>
__device__ __noinline__ Compute<DTYPE> rescaled_mean_square(const typename Elem<DTYPE>::T* x_row,
                                                            const typename Elem<DTYPE>::T* r_row, int count) {
    typedef Elem<DTYPE> E;
    typedef Compute<DTYPE> C;
    C largest = 0.0f;
    for (int j = 0; j < count; ++j) {
        C s = E::load(x_row[j]) + (r_row ? E::load(r_row[j]) : C(0));
        largest = c_fmax(largest, c_fabs(s));
    }
    if (!(largest > 0.0f) || isinf(largest)) return (C)__builtin_huge_val();
    C sum = 0.0f;
    for (int j = 0; j < count; ++j) {
        C s = (E::load(x_row[j]) + (r_row ? E::load(r_row[j]) : C(0))) / largest;
        sum += s * s;
    }
    return sum / (C)count * largest * largest;
}

// Chunk `c` of x, plus the residual's for the fused op (one f32 addition per element).
template <int DTYPE, int VEC, bool FUSED>
__device__ __forceinline__ void load_sum(const typename Elem<DTYPE>::T* x_row, const typename Elem<DTYPE>::T* r_row,
                                         long long c, int hidden, Compute<DTYPE>* s) {
    load_chunk<DTYPE, VEC>(x_row, c, hidden, s);
    if (FUSED) {
        Compute<DTYPE> r[Elem<DTYPE>::CHUNK];
        load_chunk<DTYPE, VEC>(r_row, c, hidden, r);
#pragma unroll
        for (int i = 0; i < Elem<DTYPE>::CHUNK; ++i) s[i] += r[i];
    }
}

// What a thread keeps of one cached chunk between the passes. On the 16-byte path, x (and the fused
// op's residual) as stored: all of a thread's loads are issued before any is converted, and packed
// 16-bit chunks take half the registers of their values. On the scalar path (loads per element
// anyway), the values in the compute type (the fused op's unrounded sums).
// (A chunk as stored is held as `Words`, element.hip.h.)
template <int DTYPE, bool PACKED, bool FUSED> struct Slot;
template <int DTYPE, bool FUSED> struct Slot<DTYPE, true, FUSED> {
    Words x, r;
};
template <int DTYPE, bool FUSED> struct Slot<DTYPE, false, FUSED> {
    Compute<DTYPE> s[Elem<DTYPE>::CHUNK];
};

// Fills the slot of chunk `c`: on the 16-byte path its loads only.
template <int DTYPE, int VEC, bool FUSED>
__device__ __forceinline__ void load_slot(Slot<DTYPE, VEC == Elem<DTYPE>::CHUNK, FUSED>& slot,
                                          const typename Elem<DTYPE>::T* x_row, const typename Elem<DTYPE>::T* r_row,
                                          long long c, int hidden) {
    if constexpr (VEC == Elem<DTYPE>::CHUNK) {
        long long first = c * Elem<DTYPE>::CHUNK;
        slot.x = *reinterpret_cast<const Words*>(x_row + first);
        if constexpr (FUSED) slot.r = *reinterpret_cast<const Words*>(r_row + first);
    } else {
        load_sum<DTYPE, VEC, FUSED>(x_row, r_row, c, hidden, slot.s);
    }
}

// The slot's values in the compute type (the fused op's unrounded sum x + residual: the same bits as
// load_sum gives).
template <int DTYPE, int VEC, bool FUSED>
__device__ __forceinline__ void slot_values(const Slot<DTYPE, VEC == Elem<DTYPE>::CHUNK, FUSED>& slot,
                                            Compute<DTYPE>* s) {
    typedef Elem<DTYPE> E;
#pragma unroll
    for (int i = 0; i < E::CHUNK; ++i) {
        if constexpr (VEC == E::CHUNK) {
            s[i] = E::load(word_element<DTYPE>(slot.x, i));
            if constexpr (FUSED) s[i] += E::load(word_element<DTYPE>(slot.r, i));
        } else {
            s[i] = slot.s[i];
        }
    }
}

// Adds the squares of chunk `c`'s elements among the first `variance` of the row to `sum`, in element
// order (the others add an exact 0, so with variance = H the sum is the plain one).
template <int CHUNK, typename V>
__device__ __forceinline__ void add_squares(V& sum, const V* s, long long c, int variance) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) sum += (c * CHUNK + i < variance) ? s[i] * s[i] : 0.0f;
}

template <int DTYPE, int WDTYPE, int VEC, int TPR, int BLOCK, bool FUSED>
__device__ __forceinline__ void norm_impl(typename Elem<DTYPE>::T* first, typename Elem<DTYPE>::T* second,
                                          const typename Weight<WDTYPE>::T* weight, Compute<DTYPE> epsilon,
                                          long long n_rows,
                                          int hidden, int variance, long long first_stride, long long second_stride) {
    // rms_norm: first = out, second = x.  fused: first = x, second = residual (both written).
    typedef Elem<DTYPE> E;
    typedef Compute<DTYPE> C;
    constexpr int CHUNK = E::CHUNK;
    // One group of rows per block, no grid-stride loop: in a loop the largest variants took 256
    // VGPRs instead of 182 (one wave per SIMD). The host refuses a grid past HIP's 2^32 work-items
    // (n_rows × threads per row) instead of capping it.
    long long row = (long long)blockIdx.x * (BLOCK / TPR) + threadIdx.x / TPR;
    int lane = threadIdx.x % TPR;
    bool active = row < n_rows;
    long long n_chunks = ((long long)hidden + CHUNK - 1) / CHUNK;
    typename E::T* a_row = first + (active ? row : 0) * first_stride;
    typename E::T* b_row = second + (active ? row : 0) * second_stride;
    const typename E::T* x_row = FUSED ? a_row : b_row;

    // Each thread's chunks stay in registers between the two passes (the whole row up to the
    // bucket's largest H; longer rows read the rest again): the loops over them are unrolled, so
    // every index into `cache` is a constant (a runtime index would put the array in scratch memory).
    // f64, a reference dtype, keeps the f32 kernels' chunk count and so their registers: half its row.
    // The fused op on the 16-byte path keeps x and the residual as stored: for f32 that is twice the
    // registers of their sums, so it keeps half as many chunks.
    constexpr bool PACKED = VEC == CHUNK;
    constexpr int ROW_CHUNKS = cache_chunks(DTYPE == 6 ? 4 : CHUNK, TPR);
    constexpr int CACHE_CHUNKS =
        PACKED && FUSED && sizeof(typename E::T) >= sizeof(C) ? (ROW_CHUNKS + 1) / 2 : ROW_CHUNKS;
    Slot<DTYPE, PACKED, FUSED> cache[CACHE_CHUNKS];
    C sum_sq = 0.0f;
    if (active && n_chunks > 0) {
        // Every cached chunk's loads are issued before the first is used. On the 16-byte path every
        // slot loads, with no branch between the loads (a slot past the row's end loads the row's
        // last chunk, which it never uses): with a test per chunk the compiler merges each load with
        // its use and waits for the load there.
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * TPR;
            if constexpr (PACKED) {
                load_slot<DTYPE, VEC, FUSED>(cache[k], x_row, b_row, c < n_chunks ? c : n_chunks - 1, hidden);
            } else if (c < n_chunks) {
                load_slot<DTYPE, VEC, FUSED>(cache[k], x_row, b_row, c, hidden);
            }
        }
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * TPR;
            if (c < n_chunks) {
                C s[CHUNK];
                slot_values<DTYPE, VEC, FUSED>(cache[k], s);
                add_squares<CHUNK>(sum_sq, s, c, variance);
            }
        }
        for (long long c = lane + (long long)CACHE_CHUNKS * TPR; c < n_chunks; c += TPR) {
            C s[CHUNK];
            load_sum<DTYPE, VEC, FUSED>(x_row, b_row, c, hidden, s);
            add_squares<CHUNK>(sum_sq, s, c, variance);
        }
    }
    C total = row_sum<TPR, BLOCK>(sum_sq);
    C mean_square = active && isinf(total) ? rescaled_mean_square<DTYPE>(x_row, FUSED ? b_row : nullptr, variance)
                                           : total / (C)variance;
    // The fused rescue reads the whole row: no thread of the block writes before every one has read.
    if (FUSED) __syncthreads();
    if (!active) return;
    C rstd = C(1) / c_sqrt(mean_square + epsilon);
    typename E::T* out_row = a_row;
    // Each chunk belongs to one thread, which recomputes an uncached chunk from x and the residual
    // before it overwrites them.
    if constexpr (WDTYPE == DTYPE && PACKED) {
        // The cached chunks, WEIGHT_AHEAD at a time: the group's 16-byte weight loads, then its
        // stores. The loads have no branch between them (a chunk past the row's end loads the
        // row's last chunk, unused), as in the first pass.
#pragma unroll
        for (int g = 0; g < CACHE_CHUNKS; g += WEIGHT_AHEAD) {
            WeightChunk<DTYPE, WDTYPE> w[WEIGHT_AHEAD];
            if (n_chunks > 0) {
#pragma unroll
                for (int j = 0; j < WEIGHT_AHEAD && g + j < CACHE_CHUNKS; ++j) {
                    long long c = lane + (long long)(g + j) * TPR;
                    load_weight<DTYPE, WDTYPE, VEC>(w[j], weight, c < n_chunks ? c : n_chunks - 1, hidden);
                }
            }
#pragma unroll
            for (int j = 0; j < WEIGHT_AHEAD && g + j < CACHE_CHUNKS; ++j) {
                long long c = lane + (long long)(g + j) * TPR;
                if (c < n_chunks) {
                    C s[CHUNK];
                    slot_values<DTYPE, VEC, FUSED>(cache[g + j], s);
                    if (FUSED) store_chunk<DTYPE, VEC>(b_row, c, hidden, s);
                    finish_loaded<DTYPE, WDTYPE, VEC>(out_row, w[j], c, hidden, s, rstd);
                }
            }
        }
    } else {
        // Scalar accesses (a weight of another dtype is read element by element): each chunk's
        // weight at its use. Loaded ahead, the compiler hoists them into the first pass, where they
        // hold up the first wait on the row's own loads.
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * TPR;
            if (c < n_chunks) {
                C s[CHUNK];
                slot_values<DTYPE, VEC, FUSED>(cache[k], s);
                if (FUSED) store_chunk<DTYPE, VEC>(b_row, c, hidden, s);
                finish_chunk<DTYPE, WDTYPE, VEC>(out_row, weight, c, hidden, s, rstd);
            }
        }
    }
    for (long long c = lane + (long long)CACHE_CHUNKS * TPR; c < n_chunks; c += TPR) {
        C s[CHUNK];
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
                                                 const Weight<WD>::T* weight, Compute<DTYPE> epsilon,              \
                                                 long long n_rows,                                                 \
                                                 int hidden, int variance, long long x_row_stride,                \
                                                 long long out_row_stride) {                                       \
        norm_impl<DTYPE, WD, VEC, TPR, BLOCK_FOR(TPR), false>(out, const_cast<Elem<DTYPE>::T*>(x), weight,        \
                                                              epsilon, n_rows, hidden, variance, out_row_stride,  \
                                                              x_row_stride);                                      \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_FOR(TPR))                                                   \
        fused_add_rms_norm_##NAME##_w##W##_v##VEC##_t##TPR(                                                        \
            Elem<DTYPE>::T* x, Elem<DTYPE>::T* residual, const Weight<WD>::T* weight, Compute<DTYPE> epsilon,      \
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

// A weight of another type than the elements (Gemma's f32 weight on bf16 rows): at every row
// width, as the weight of x's type.
#define DEFINE_MIXED(DTYPE, NAME, WD, W, VEC) DEFINE_TPR(DTYPE, NAME, WD, W, VEC)

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

// f64 (a reference dtype): scalar accesses only, and a weight of another type than the elements on
// either side at one row width (32 threads per row).
DEFINE_TPR(6, f64, -1, 0, 1)
DEFINE_TPR(6, f64, 6, 1, 1)
DEFINE_KERNELS(6, f64, 0, f32, 1, 32)
DEFINE_KERNELS(6, f64, 1, f16, 1, 32)
DEFINE_KERNELS(6, f64, 2, bf16, 1, 32)
DEFINE_KERNELS(0, f32, 6, f64, 1, 32)
DEFINE_KERNELS(0, f32, 6, f64, 4, 32)
DEFINE_KERNELS(1, f16, 6, f64, 1, 32)
DEFINE_KERNELS(1, f16, 6, f64, 8, 32)
DEFINE_KERNELS(2, bf16, 6, f64, 1, 32)
DEFINE_KERNELS(2, bf16, 6, f64, 8, 32)
