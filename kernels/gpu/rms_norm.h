// The RMS norms CUDA and HIP share: `rms_norm` (out = norm(x) * weight) and `fused_add_rms_norm`
// (residual <- round(x + residual), x <- norm(x + residual) * weight, the norm computed from the
// unrounded sum), one templated row kernel, `norm_rows`. Each backend instantiates it: CUDA one
// program per set of defines (`kernels/cuda/rms_norm.cu`, compiled by NVRTC at first use, sized to
// the row width's bucket), HIP every variant in one code object (`kernels/rocm/rms_norm.hip`).
//
// Compiled after the portability header and `elem.h`. Template parameters: DT the element type of x,
// the residual and the output (`Elem<DT>`); WD the weight's (-1: no weight); VW the load width, 1
// (scalar accesses, any alignment) or CHUNK (16-byte accesses: the host picks it when every row
// starts 16-byte aligned and H % CHUNK == 0, so every chunk is whole); TPR the threads per row and
// BLOCK the threads per block (a power of two, a multiple of the warp); ROW_CHUNKS the 16-byte
// chunks of a row each thread keeps in registers between the passes (the whole row up to the
// largest H of the TPR bucket: `kernel_support::norm_cache_chunks`).
//
// Numerics, in the compute type C (f32; f64 for f64 elements): squares accumulate in C; the fused
// sum is one addition in C; the norm is computed from the unrounded sum (cached in registers, else
// recomputed from x and the residual by the thread that owns those elements, before it overwrites
// them); the weight step rounds y to the weight's type, multiplies by the weight and rounds the
// product to the weight's type, in the weight step's compute type (f64 when x or the weight is
// f64), and the store rounds to the element type. Each thread owns whole chunks of CHUNK elements
// (16 bytes) in the same order whatever VW is, so results depend only on the row, H and the dtype.
// The mean square runs over the first `variance` elements of each row (variance_size; the host
// passes H when it is not given); every element is normalized.
//
// Registers: rms_norm keeps x as stored (packed), ROW_CHUNKS chunks. The fused op on the 16-byte
// path keeps x and the residual as stored, recomputing the unrounded sum in the second pass (the
// same bits): as many chunks as ROW_CHUNKS for 16-bit elements, whose two packed chunks take the
// registers of one chunk of f32 sums, half for f32; on the scalar path the unrounded sums,
// ROW_CHUNKS of them. f64, a reference dtype, gets the f32 kernels' chunk count (half its row).
//
// Loads in flight: a thread issues the loads of all its cached chunks (and the fused op's residual
// chunks) before it converts any, so one row costs one memory round trip, not one per chunk; its
// second pass issues the weight loads of up to NORM_WEIGHT_AHEAD cached chunks before the first
// store of those chunks. How a compiler is kept from serializing them is the port's
// (`GPU_NORM_CLAMPED_LOADS`, `GPU_NORM_SCALAR_WEIGHT_AHEAD`, `gpu_load_in_order`).

#ifndef VLLM_IR_GPU_RMS_NORM_H
#define VLLM_IR_GPU_RMS_NORM_H

// The second pass issues the weight loads of up to NORM_WEIGHT_AHEAD cached chunks before the first
// store of those chunks, so the weight costs one memory round trip per group of chunks, not one per
// chunk (a store between two loads keeps each load waiting for the one before; on gfx9 each
// `s_waitcnt vmcnt(0)` before a weight's use also waits on the stores before it). Bounded, so the
// weight adds at most NORM_WEIGHT_AHEAD chunks of registers to the row's cache.
#define NORM_WEIGHT_AHEAD 8

// The weight's element type: WD -1 means no weight (any type serves), else Elem<WD>.
template <int WD> struct NormWeight { typedef typename Elem<WD>::T T; };
template <> struct NormWeight<-1> { typedef float T; };

// Reads chunk `c` of a row into the compute type. On the 16-byte path (VW == CHUNK) the chunk is
// whole and loads without a bounds test; on the scalar path elements at or beyond `hidden` read as 0.
template <int DT, int VW>
__device__ __forceinline__ void norm_load_chunk(const typename Elem<DT>::T* row, long long c, int hidden,
                                                Compute<DT>* out) {
    typedef Elem<DT> E;
    constexpr int CHUNK = E::CHUNK;
    long long first = c * CHUNK;
    if constexpr (VW == CHUNK) {
        Words words = *reinterpret_cast<const Words*>(row + first);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out[i] = E::load(word_element<DT>(words, i));
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out[i] = (first + i < hidden) ? E::load(row[first + i]) : Compute<DT>(0);
    }
}

// Writes chunk `c` of a row (the elements below `hidden`) from `values`, already in the element type.
template <int DT, int VW>
__device__ __forceinline__ void norm_store_elems(typename Elem<DT>::T* row, long long c, int hidden,
                                                 const typename Elem<DT>::T* values) {
    constexpr int CHUNK = Elem<DT>::CHUNK;
    long long first = c * CHUNK;
    if constexpr (VW == CHUNK) {
        *reinterpret_cast<Words*>(row + first) = to_words<DT>(values);
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            if (first + i < hidden) row[first + i] = values[i];
        }
    }
}

// Writes chunk `c` of a row from the compute type, each element rounded once to the element type.
template <int DT, int VW>
__device__ __forceinline__ void norm_store_chunk(typename Elem<DT>::T* row, long long c, int hidden,
                                                 const Compute<DT>* in) {
    typename Elem<DT>::T values[Elem<DT>::CHUNK];
#pragma unroll
    for (int i = 0; i < Elem<DT>::CHUNK; ++i) values[i] = Elem<DT>::store(in[i]);
    norm_store_elems<DT, VW>(row, c, hidden, values);
}

// Sums `value` over the TPR threads of one row; every thread gets the same total. Every thread of
// the block calls it (above a warp it holds a barrier). The tree: butterfly shuffles within a warp
// (of the port's width, `GPU_WARP`), then the warps' sums of a row added in order.
template <int TPR, int BLOCK, typename V>
__device__ __forceinline__ V norm_row_sum(V value) {
    const int warp = GPU_WARP;
    if (TPR <= warp) {
#pragma unroll
        for (int offset = TPR / 2; offset > 0; offset >>= 1) value += gpu_shfl_xor(value, offset);
        return value;
    }
#pragma unroll
    for (int offset = warp / 2; offset > 0; offset >>= 1) value += gpu_shfl_xor(value, offset);
    __shared__ V partials[BLOCK / 32];
    if (threadIdx.x % warp == 0) partials[threadIdx.x / warp] = value;
    __syncthreads();
    int per_row = TPR / warp;
    int first = (threadIdx.x / TPR) * per_row;
    V total = 0;
    for (int w = 0; w < per_row; ++w) total += partials[first + w];
    return total;
}

// The sum of squares of the first `count` elements of a row when their sum in C overflowed (|x|
// above about 1.8e19 / sqrt(count) in f32) although the mean may fit: the squares summed in double,
// serially in element order, by the calling thread (no barrier, so any subset of threads may call
// it). Divided once in double and rounded to C, that is the reference's mean square (its sum is a
// double fold in element order), and a generated kernel's on the same row. A rare path.
template <int DT>
__device__ __noinline__ double norm_wide_sum_squares(const typename Elem<DT>::T* x_row,
                                                      const typename Elem<DT>::T* r_row, int count) {
    typedef Elem<DT> E;
    typedef Compute<DT> C;
    double sum = 0;
    for (int j = 0; j < count; ++j) {
        C s = r_row ? c_add(E::load(x_row[j]), E::load(r_row[j])) : E::load(x_row[j]);
        sum = c_add(sum, c_mul((double)s, (double)s));
    }
    return sum;
}

// Adds the squares of chunk `c`'s elements among the first `variance` of the row to `sum`, in element
// order (the others add an exact 0, so with variance = H the sum is the plain one). Each square and
// each sum rounds on its own, as on the emulated GPU and in a generated kernel: with
// `GPU_NORM_ROUNDED_SQUARES` (HIP) they are a `c_mul` and a `c_add`, which hipcc may not contract
// into a fused multiply-add; NVRTC keeps the select between them apart (`tests/nvrtc.rs` reads the
// PTX), and with the `_rn` intrinsics ptxas took more registers (12 more for bf16 rows past 16384).
template <int CHUNK, typename V>
__device__ __forceinline__ void norm_add_squares(V& sum, const V* s, long long c, int variance) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
#if GPU_NORM_ROUNDED_SQUARES
        sum = c_add(sum, (c * CHUNK + i < variance) ? c_mul(s[i], s[i]) : V(0));
#else
        sum += (c * CHUNK + i < variance) ? s[i] * s[i] : V(0);
#endif
    }
}

// Chunk `c` of x, plus the residual's for the fused op (one addition in C per element).
template <int DT, int VW, bool FUSED>
__device__ __forceinline__ void norm_load_sum(const typename Elem<DT>::T* x_row, const typename Elem<DT>::T* r_row,
                                              long long c, int hidden, Compute<DT>* s) {
    norm_load_chunk<DT, VW>(x_row, c, hidden, s);
    if constexpr (FUSED) {
        Compute<DT> r[Elem<DT>::CHUNK];
        norm_load_chunk<DT, VW>(r_row, c, hidden, r);
#pragma unroll
        for (int i = 0; i < Elem<DT>::CHUNK; ++i) s[i] += r[i];
    }
}

// What a thread keeps of one cached chunk between the passes. On the 16-byte path, x (and the fused
// op's residual) as stored, held as `Words` (elem.h): the loads are issued before any is converted,
// and packed 16-bit chunks take half the registers of their values. On the scalar path, rms_norm's
// x as stored too (elements past `hidden` as 0), the fused op's unrounded sums in C.
template <int DT, bool PACKED, bool FUSED> struct NormSlot;
template <int DT, bool FUSED> struct NormSlot<DT, true, FUSED> {
    Words x, r;
};
template <int DT> struct NormSlot<DT, false, false> {
    typename Elem<DT>::T x[Elem<DT>::CHUNK];
};
template <int DT> struct NormSlot<DT, false, true> {
    Compute<DT> s[Elem<DT>::CHUNK];
};

// Fills the slot of chunk `c`: on the 16-byte path its loads only.
template <int DT, int VW, bool FUSED>
__device__ __forceinline__ void norm_load_slot(NormSlot<DT, VW == Elem<DT>::CHUNK, FUSED>& slot,
                                               const typename Elem<DT>::T* x_row, const typename Elem<DT>::T* r_row,
                                               long long c, int hidden) {
    constexpr int CHUNK = Elem<DT>::CHUNK;
    long long first = c * CHUNK;
    if constexpr (VW == CHUNK) {
        slot.x = *reinterpret_cast<const Words*>(x_row + first);
        if constexpr (FUSED) slot.r = *reinterpret_cast<const Words*>(r_row + first);
    } else if constexpr (!FUSED) {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) slot.x[i] = (first + i < hidden) ? x_row[first + i] : Elem<DT>::store(0.0f);
    } else {
        norm_load_sum<DT, VW, true>(x_row, r_row, c, hidden, slot.s);
    }
}

// The slot's values in C (the fused op's unrounded sum x + residual: the same bits as norm_load_sum).
template <int DT, int VW, bool FUSED>
__device__ __forceinline__ void norm_slot_values(const NormSlot<DT, VW == Elem<DT>::CHUNK, FUSED>& slot,
                                                 Compute<DT>* s) {
    typedef Elem<DT> E;
#pragma unroll
    for (int i = 0; i < E::CHUNK; ++i) {
        if constexpr (VW == E::CHUNK) {
            s[i] = E::load(word_element<DT>(slot.x, i));
            if constexpr (FUSED) s[i] += E::load(word_element<DT>(slot.r, i));
        } else if constexpr (!FUSED) {
            s[i] = E::load(slot.x[i]);
        } else {
            s[i] = slot.s[i];
        }
    }
}

// Calls `f(c, s)` on each cached chunk `c` in the row with its values `s` in C (the fused op's
// unrounded sums), in order; the loop is unrolled, so every index into `cache` is a constant.
template <int DT, int VW, bool FUSED, int TPR, int CACHED, typename F>
__device__ __forceinline__ void norm_each_cached(const NormSlot<DT, VW == Elem<DT>::CHUNK, FUSED> (&cache)[CACHED],
                                                 int lane, long long n_chunks, F f) {
#pragma unroll
    for (int k = 0; k < CACHED; ++k) {
        long long c = lane + (long long)k * TPR;
        if (c < n_chunks) {
            Compute<DT> s[Elem<DT>::CHUNK];
            norm_slot_values<DT, VW, FUSED>(cache[k], s);
            f(c, s);
        }
    }
}

// The weight of one chunk as stored, loaded ahead of the chunk's store. WORDS: a weight of x's type
// on the 16-byte path, one 16-byte load in program order (`gpu_load_in_order`: a read-only load the
// compiler may otherwise sink below the stores before its use); else CHUNK scalar loads of the
// weight's type (elements at or beyond `hidden` read as 0).
template <int DT, int WD, bool WORDS> struct NormWeightChunk;
template <int DT, int WD> struct NormWeightChunk<DT, WD, true> {
    Words words;
    __device__ __forceinline__ void load(const typename NormWeight<WD>::T* weight, long long c, int) {
        words = gpu_load_in_order(reinterpret_cast<const Words*>(weight + c * Elem<DT>::CHUNK));
    }
    __device__ __forceinline__ typename NormWeight<WD>::T get(int i) const { return word_element<WD>(words, i); }
};
template <int DT, int WD> struct NormWeightChunk<DT, WD, false> {
    typedef typename NormWeight<WD>::T T;
    T v[Elem<DT>::CHUNK];
    __device__ __forceinline__ void load(const T* weight, long long c, int hidden) {
        long long first = c * Elem<DT>::CHUNK;
#pragma unroll
        for (int i = 0; i < Elem<DT>::CHUNK; ++i) v[i] = (first + i < hidden) ? weight[first + i] : (T)0;
    }
    __device__ __forceinline__ T get(int i) const { return v[i]; }
};

// Scales the chunk by rstd and by the weight `w` (in the weight step's compute type) and stores it,
// each element rounded once to the element type.
template <int DT, int WD, int VW, typename WChunk>
__device__ __forceinline__ void norm_finish_loaded(typename Elem<DT>::T* out_row, const WChunk& w, long long c,
                                                   int hidden, Compute<DT>* s, Compute<DT> rstd) {
    typedef Elem<DT> E;
#pragma unroll
    for (int i = 0; i < E::CHUNK; ++i) s[i] *= rstd;
    if constexpr (WD >= 0) {
        typedef typename MixedCompute<DT, WD>::T WC;
        typename E::T values[E::CHUNK];
#pragma unroll
        for (int i = 0; i < E::CHUNK; ++i) {
            WC weight = (WC)Elem<WD>::load(w.get(i));
            values[i] = E::store(round_elem<WD>(round_elem<WD>((WC)s[i]) * weight));
        }
        norm_store_elems<DT, VW>(out_row, c, hidden, values);
    } else {
        norm_store_chunk<DT, VW>(out_row, c, hidden, s);
    }
}

// norm_finish_loaded with the chunk's weight loaded at its use (a weight of x's type as x is loaded,
// another type with scalar loads): the same bits.
template <int DT, int WD, int VW>
__device__ __forceinline__ void norm_finish_chunk(typename Elem<DT>::T* out_row,
                                                  const typename NormWeight<WD>::T* weight, long long c, int hidden,
                                                  Compute<DT>* s, Compute<DT> rstd) {
    if constexpr (WD == DT && VW == Elem<DT>::CHUNK) {
        NormWeightChunk<DT, WD, true> w;
        w.words = *reinterpret_cast<const Words*>(weight + c * Elem<DT>::CHUNK);
        norm_finish_loaded<DT, WD, VW>(out_row, w, c, hidden, s, rstd);
    } else {
        NormWeightChunk<DT, WD, false> w;
        if constexpr (WD >= 0) w.load(weight, c, hidden);
        norm_finish_loaded<DT, WD, VW>(out_row, w, c, hidden, s, rstd);
    }
}

// The fused op's cached chunks: on the 16-byte path x and the residual are kept as stored, which
// for f32 takes twice the registers of their sums, so half as many are kept.
template <int DT, int VW, int ROW_CHUNKS>
__device__ constexpr int norm_fused_cache_chunks() {
    return VW == Elem<DT>::CHUNK && sizeof(typename Elem<DT>::T) >= sizeof(Compute<DT>) ? (ROW_CHUNKS + 1) / 2
                                                                                         : ROW_CHUNKS;
}

// One row group of either norm: rows blockIdx.x * (BLOCK / TPR) + threadIdx.x / TPR, TPR threads
// each. rms_norm: first = out, second = x. fused: first = x, second = residual (both written).
// Rows are `first_stride` and `second_stride` elements apart. One group per block, no grid-stride
// loop: in a loop the largest HIP variants took 256 VGPRs instead of 182 (one wave per SIMD); the
// hosts size the grid to the rows (HIP's refuses one past its 2^32 work-items).
template <int DT, int WD, int VW, int TPR, int BLOCK, int ROW_CHUNKS, bool FUSED>
__device__ __forceinline__ void norm_rows(typename Elem<DT>::T* first, typename Elem<DT>::T* second,
                                          const typename NormWeight<WD>::T* weight, Compute<DT> epsilon,
                                          long long n_rows, int hidden, int variance, long long first_stride,
                                          long long second_stride) {
    typedef Elem<DT> E;
    typedef Compute<DT> C;
    constexpr int CHUNK = E::CHUNK;
    static_assert(VW == 1 || VW == CHUNK, "the load width is 1 or a 16-byte chunk");
    long long row = (long long)blockIdx.x * (BLOCK / TPR) + threadIdx.x / TPR;
    int lane = threadIdx.x % TPR;
    bool active = row < n_rows;
    long long n_chunks = ((long long)hidden + CHUNK - 1) / CHUNK;
    typename E::T* a_row = first + (active ? row : 0) * first_stride;
    typename E::T* b_row = second + (active ? row : 0) * second_stride;
    const typename E::T* x_row = FUSED ? a_row : b_row;

    // Each thread's chunks stay in registers between the two passes: the loops over them are
    // unrolled, so every index into `cache` is a constant (a runtime index would put the array in
    // local or scratch memory).
    constexpr bool PACKED = VW == CHUNK;
    constexpr int CACHED = FUSED ? norm_fused_cache_chunks<DT, VW, ROW_CHUNKS>() : ROW_CHUNKS;
    NormSlot<DT, PACKED, FUSED> cache[CACHED];
    C sum_sq = 0;
    if (active && n_chunks > 0) {
        // Every cached chunk's loads are issued before the first is used. With the port's
        // GPU_NORM_CLAMPED_LOADS, the 16-byte loads have no branch between them (a slot past the
        // row's end loads the row's last chunk, which it never uses); else each is predicated on
        // its chunk being in the row.
#pragma unroll
        for (int k = 0; k < CACHED; ++k) {
            long long c = lane + (long long)k * TPR;
            if (PACKED && GPU_NORM_CLAMPED_LOADS) {
                norm_load_slot<DT, VW, FUSED>(cache[k], x_row, b_row, c < n_chunks ? c : n_chunks - 1, hidden);
            } else if (c < n_chunks) {
                norm_load_slot<DT, VW, FUSED>(cache[k], x_row, b_row, c, hidden);
            }
        }
        norm_each_cached<DT, VW, FUSED, TPR>(cache, lane, n_chunks,
                                             [&](long long c, C* s) { norm_add_squares<CHUNK>(sum_sq, s, c, variance); });
        for (long long c = lane + (long long)CACHED * TPR; c < n_chunks; c += TPR) {
            C s[CHUNK];
            norm_load_sum<DT, VW, FUSED>(x_row, b_row, c, hidden, s);
            norm_add_squares<CHUNK>(sum_sq, s, c, variance);
        }
    }
    C total = norm_row_sum<TPR, BLOCK>(sum_sq);
    C mean_square = active && isinf(total)
                        ? (C)c_div(norm_wide_sum_squares<DT>(x_row, FUSED ? b_row : nullptr, variance), (double)variance)
                        : total / (C)variance;
    // The fused rescue reads the whole row: no thread of the block writes before every one has read.
    if (FUSED) __syncthreads();
    if (!active) return;
    C rstd = c_div(C(1), c_sqrt(mean_square + epsilon));
    typename E::T* out_row = a_row;
    // The weight loads of a group of cached chunks go ahead of the group's stores: a weight of x's
    // type on the 16-byte path always, scalar weight loads where the port says they stay in the
    // second pass (GPU_NORM_SCALAR_WEIGHT_AHEAD); otherwise each chunk's weight at its use.
    constexpr bool WORDS = WD == DT && PACKED;
    constexpr bool AHEAD = WORDS || GPU_NORM_SCALAR_WEIGHT_AHEAD;
    if constexpr (AHEAD) {
#pragma unroll
        for (int g = 0; g < CACHED; g += NORM_WEIGHT_AHEAD) {
            NormWeightChunk<DT, WD, WORDS> w[NORM_WEIGHT_AHEAD];
            // Clamped loads need a chunk to clamp to; predicated ones test their own chunk.
            if (WD >= 0 && (!GPU_NORM_CLAMPED_LOADS || n_chunks > 0)) {
#pragma unroll
                for (int j = 0; j < NORM_WEIGHT_AHEAD && g + j < CACHED; ++j) {
                    long long c = lane + (long long)(g + j) * TPR;
                    if (WORDS && GPU_NORM_CLAMPED_LOADS) {
                        w[j].load(weight, c < n_chunks ? c : n_chunks - 1, hidden);
                    } else if (c < n_chunks) {
                        w[j].load(weight, c, hidden);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < NORM_WEIGHT_AHEAD && g + j < CACHED; ++j) {
                long long c = lane + (long long)(g + j) * TPR;
                if (c < n_chunks) {
                    C s[CHUNK];
                    norm_slot_values<DT, VW, FUSED>(cache[g + j], s);
                    if (FUSED) norm_store_chunk<DT, VW>(b_row, c, hidden, s);
                    norm_finish_loaded<DT, WD, VW>(out_row, w[j], c, hidden, s, rstd);
                }
            }
        }
    } else {
        norm_each_cached<DT, VW, FUSED, TPR>(cache, lane, n_chunks, [&](long long c, C* s) {
            if (FUSED) norm_store_chunk<DT, VW>(b_row, c, hidden, s);
            norm_finish_chunk<DT, WD, VW>(out_row, weight, c, hidden, s, rstd);
        });
    }
    // Chunks beyond the cache are recomputed from x and the residual before this thread overwrites
    // them; every chunk belongs to one thread, so no other thread reads what is written here.
    for (long long c = lane + (long long)CACHED * TPR; c < n_chunks; c += TPR) {
        C s[CHUNK];
        norm_load_sum<DT, VW, FUSED>(x_row, b_row, c, hidden, s);
        if (FUSED) norm_store_chunk<DT, VW>(b_row, c, hidden, s);
        norm_finish_chunk<DT, WD, VW>(out_row, weight, c, hidden, s, rstd);
    }
}

#endif  // VLLM_IR_GPU_RMS_NORM_H
