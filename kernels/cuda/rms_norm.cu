// RMS normalization kernels for the `cuda` provider, compiled by NVRTC at first use per variant.
//
// Variant defines (all required):
//   DTYPE            0 = f32, 1 = f16, 2 = bf16, 6 = f64 (the element type of x, residual and out)
//   HAS_WEIGHT       0 or 1
//   WDTYPE           the weight's type, coded like DTYPE (element.cuh; default DTYPE)
//   VEC              1 (scalar loads) or CHUNK (one 16-byte load per chunk); decided on the host from
//                    alignment and H (a multiple of CHUNK: every chunk of a row is whole), so both
//                    paths must give identical bits
//   THREADS_PER_ROW  8, 16, 32, 64, 128 or 256
//   BLOCK_SIZE       128 or 256
//   CACHE_CHUNKS     chunks of a row each thread keeps in registers between the passes (the host
//                    sizes it to hold the whole row up to the largest H of the threads-per-row bucket;
//                    f64, a reference dtype, keeps the f32 kernels' register budget: half the row)
//
// Registers: each thread keeps its cached chunks of the row between the two passes, so a row up to
// the bucket's largest H is read once and written once; chunks beyond (longer rows only) are read
// again. rms_norm keeps x as stored (packed), CACHE_CHUNKS chunks. The fused op keeps
// FUSED_CACHE_CHUNKS (fused_slot): on the vector path x and the residual as stored, recomputing the
// unrounded sum in the second pass (the same bits): as many chunks as CACHE_CHUNKS for 16-bit
// elements, whose two packed chunks take the registers of one chunk of f32 sums, half for f32; on
// the scalar path the unrounded sums, CACHE_CHUNKS of them.
//
// Loads in flight: a thread issues the loads of all its cached chunks (and the fused op's residual
// chunks) before it converts any, so one row costs one memory round trip, not one per chunk. On the
// vector path every chunk is whole and loads without a bounds test; the only test between chunks
// is whether the chunk exists, which the compiler turns into predicated loads.
//
// Numerics, in the compute type c (element.cuh: f32, and f64 for f64 elements): squares accumulate
// in c; the fused sum is one addition in c; the norm is computed from
// the unrounded sum (cached in registers, else recomputed from x and residual before either is
// overwritten, by the thread that owns those elements); the weight step rounds y to the element type,
// multiplies by the weight in c and rounds once. Each thread owns whole chunks of CHUNK elements
// (16 bytes) in the same order whatever VEC is, so results depend only on the row, H and the dtype.
// The mean square runs over the first `variance` elements of each row (variance_size; the host
// passes H when it is not given); every element is normalized. A weight of another type than the
// elements is read with scalar loads; the weight step computes in the weight's type (y rounded to
// it, the product rounded to it; in f64 when x or the weight is f64) and the store rounds to the
// element type.
//
// Compiled after `port.cuh` and `element.cuh` (the element type and its conversions), which the
// crate prepends.

#if VEC != 1 && VEC != CHUNK
#error "VEC must be 1 or CHUNK"
#endif

#ifndef CACHE_CHUNKS
#error "CACHE_CHUNKS (16-byte chunks of a row each thread keeps in registers) must be defined"
#endif
#define ROWS_PER_BLOCK (BLOCK_SIZE / THREADS_PER_ROW)
#define WARP 32

struct alignas(16) chunk_t {
    elem_t v[CHUNK];
};

// Reads chunk `c` of a row (elements c*CHUNK .. c*CHUNK+CHUNK-1, those below `hidden`) into c.
// On the vector path (VEC == CHUNK) the host guarantees H % CHUNK == 0, so the chunk is whole.
__device__ __forceinline__ void load_chunk(const elem_t* row, long long c, int hidden, compute_t* out) {
    long long first = c * CHUNK;
#if VEC == CHUNK
    chunk_t packed = *reinterpret_cast<const chunk_t*>(row + first);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = to_c(packed.v[i]);
#else
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = (first + i < hidden) ? to_c(row[first + i]) : 0.0f;
#endif
}

// Reads chunk `c` of a row as stored (elements at or beyond `hidden` read as zero), for the
// register cache; `unpack` widens it to c exactly as load_chunk does.
__device__ __forceinline__ void load_packed(const elem_t* row, long long c, int hidden, chunk_t& out) {
    long long first = c * CHUNK;
#if VEC == CHUNK
    out = *reinterpret_cast<const chunk_t*>(row + first);
#else
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out.v[i] = (first + i < hidden) ? row[first + i] : from_c(0.0f);
#endif
}

__device__ __forceinline__ void unpack(const chunk_t& packed, compute_t* out) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = to_c(packed.v[i]);
}

// What the fused op keeps of one cached chunk. On the vector path, x and the residual as stored
// (two 16-byte loads in flight, their unrounded sum recomputed when needed): packed 16-bit elements
// take half the registers of their sums, so two packed chunks cost what one chunk of sums did, and
// f32 chunks cost as much packed as summed, so half as many are cached. On the scalar path (whose
// loads are per element anyway), the unrounded sums, as many chunks as rms_norm caches.
#if VEC == CHUNK
struct fused_slot {
    chunk_t x, r;
};
constexpr int FUSED_CACHE_CHUNKS = sizeof(elem_t) < sizeof(compute_t) ? CACHE_CHUNKS : (CACHE_CHUNKS + 1) / 2;

// Issues the chunk's loads (the caller converts nothing before every slot's loads are issued).
__device__ __forceinline__ void load_slot(fused_slot& slot, const elem_t* x_row, const elem_t* r_row, long long c,
                                          int hidden) {
    load_packed(x_row, c, hidden, slot.x);
    load_packed(r_row, c, hidden, slot.r);
}

// The chunk's unrounded sum x + residual, in c.
__device__ __forceinline__ void slot_sum(const fused_slot& slot, compute_t* out) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = to_c(slot.x.v[i]) + to_c(slot.r.v[i]);
}
#else
struct fused_slot {
    compute_t s[CHUNK];
};
constexpr int FUSED_CACHE_CHUNKS = CACHE_CHUNKS;

__device__ __forceinline__ void load_slot(fused_slot& slot, const elem_t* x_row, const elem_t* r_row, long long c,
                                          int hidden) {
    compute_t r[CHUNK];
    load_chunk(x_row, c, hidden, slot.s);
    load_chunk(r_row, c, hidden, r);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) slot.s[i] += r[i];
}

__device__ __forceinline__ void slot_sum(const fused_slot& slot, compute_t* out) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = slot.s[i];
}
#endif

// Writes chunk `c` of a row (the elements below `hidden`) as stored.
__device__ __forceinline__ void store_packed(elem_t* row, long long c, int hidden, const chunk_t& packed) {
    long long first = c * CHUNK;
#if VEC == CHUNK
    *reinterpret_cast<chunk_t*>(row + first) = packed;
#else
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
        if (first + i < hidden) row[first + i] = packed.v[i];
    }
#endif
}

// Writes chunk `c` of a row from the compute type, rounded to the element type.
__device__ __forceinline__ void store_chunk(elem_t* row, long long c, int hidden, const compute_t* in) {
    chunk_t packed;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) packed.v[i] = from_c(in[i]);
    store_packed(row, c, hidden, packed);
}

// Sums `value` over the THREADS_PER_ROW threads of one row; every thread gets the same total.
// Every thread of the block must call this (it may contain a barrier).
__device__ __forceinline__ compute_t row_sum(compute_t value) {
#if THREADS_PER_ROW <= WARP
#pragma unroll
    for (int offset = THREADS_PER_ROW / 2; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    return value;
#else
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    __shared__ compute_t partials[BLOCK_SIZE / WARP];
    int warp = threadIdx.x / WARP;
    if (threadIdx.x % WARP == 0) partials[warp] = value;
    __syncthreads();
    int first_warp = (threadIdx.x / THREADS_PER_ROW) * (THREADS_PER_ROW / WARP);
    compute_t total = 0.0f;
#pragma unroll
    for (int w = 0; w < THREADS_PER_ROW / WARP; ++w) total += partials[first_warp + w];
    return total;
#endif
}

// The mean square of the first `count` elements of a row when their sum of squares in c overflowed
// (|x| above about 1.8e19 / sqrt(count)) although the mean may fit: the elements scaled by their
// largest magnitude, summed serially by the calling thread (no barrier, so any subset of threads may
// call it), then scaled back. A rare path.
__device__ __noinline__ compute_t rescaled_mean_square(const elem_t* x_row, const elem_t* r_row, int count) {
    compute_t largest = 0.0f;
    for (int j = 0; j < count; ++j) {
        compute_t s = to_c(x_row[j]) + (r_row ? to_c(r_row[j]) : 0.0f);
        largest = c_fmax(largest, c_fabs(s));
    }
    if (!(largest > 0.0f) || isinf(largest)) return compute_t(__int_as_float(0x7f800000));
    compute_t sum = 0.0f;
    for (int j = 0; j < count; ++j) {
        compute_t s = (to_c(x_row[j]) + (r_row ? to_c(r_row[j]) : 0.0f)) / largest;
        sum += s * s;
    }
    return sum / (compute_t)count * largest * largest;
}

// Adds the squares of a chunk's elements that lie among the first `variance` of the row to `sum`, in
// element order (the others add an exact 0, so with variance = H the sum is the plain one).
__device__ __forceinline__ void add_squares(compute_t& sum, const compute_t* s, long long c, int variance) {
    long long first = c * CHUNK;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) sum += (first + i < variance) ? s[i] * s[i] : 0.0f;
}

// Reads the weight of chunk `c` into its compute type: like load_chunk for a weight of the element
// type, with scalar loads for another type (whose chunk is not 16 bytes).
__device__ __forceinline__ void load_weight_chunk(const welem_t* weight, long long c, int hidden, wcompute_t* out) {
#if WDTYPE == DTYPE
    load_chunk(weight, c, hidden, out);
#else
    long long first = c * CHUNK;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = (first + i < hidden) ? w_to_wc(weight[first + i]) : wcompute_t(0);
#endif
}

// Scales the chunk by rstd (and the weight, in the weight's compute type) and stores it rounded.
__device__ __forceinline__ void finish_chunk(elem_t* out_row, const welem_t* weight, long long c, int hidden,
                                             compute_t* s, compute_t rstd) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) s[i] *= rstd;
#if HAS_WEIGHT
    wcompute_t w[CHUNK];
    load_weight_chunk(weight, c, hidden, w);
    chunk_t packed;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) packed.v[i] = store_wc(round_w(round_w(s[i]) * w[i]));
    store_packed(out_row, c, hidden, packed);
#else
    store_chunk(out_row, c, hidden, s);
#endif
}

// The second pass issues the weight loads of up to WEIGHT_AHEAD cached chunks before the first
// store of those chunks, so the weight costs one memory round trip per group of chunks, not one per
// chunk (a store between two loads would otherwise keep each load waiting for the one before).
// Bounded, so the weight chunks add at most WEIGHT_AHEAD chunks of registers to the row's cache.
#define WEIGHT_AHEAD 8

// The 16-byte weight loads are `gpu_load_in_order` (`port.cuh`): a read-only load the compiler may
// otherwise sink below the stores before its use, one chunk at a time again.
// A weight chunk as stored: one 16-byte chunk for a weight of the element type, else CHUNK
// elements of the weight's type (read with scalar loads).
#if WDTYPE == DTYPE
typedef chunk_t wchunk_t;
#else
struct wchunk_t {
    welem_t v[CHUNK];
};
#endif

// Reads the weight of chunk `c` as stored (elements at or beyond `hidden` read as zero).
__device__ __forceinline__ void load_weight_packed(const welem_t* weight, long long c, int hidden, wchunk_t& out) {
#if WDTYPE == DTYPE && VEC == CHUNK
    out = gpu_load_in_order(reinterpret_cast<const chunk_t*>(weight + c * CHUNK));
#elif WDTYPE == DTYPE
    load_packed(weight, c, hidden, out);
#else
    long long first = c * CHUNK;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out.v[i] = (first + i < hidden) ? weight[first + i] : (welem_t)0;
#endif
}

// finish_chunk with the chunk's weight already loaded: the same bits.
__device__ __forceinline__ void finish_loaded(elem_t* out_row, const wchunk_t& w, long long c, int hidden,
                                              compute_t* s, compute_t rstd) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) s[i] *= rstd;
#if HAS_WEIGHT
    chunk_t packed;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) packed.v[i] = store_wc(round_w(round_w(s[i]) * w_to_wc(w.v[i])));
    store_packed(out_row, c, hidden, packed);
#else
    store_chunk(out_row, c, hidden, s);
#endif
}

// Issues the weight loads of cached chunks first .. first + WEIGHT_AHEAD - 1 (those below `cached`
// and in the row).
__device__ __forceinline__ void load_weight_group(const welem_t* weight, int lane, int first, int cached,
                                                  long long n_chunks, int hidden, wchunk_t* w) {
#if HAS_WEIGHT
#pragma unroll
    for (int j = 0; j < WEIGHT_AHEAD; ++j) {
        long long c = lane + (long long)(first + j) * THREADS_PER_ROW;
        if (first + j < cached && c < n_chunks) load_weight_packed(weight, c, hidden, w[j]);
    }
#endif
}

// out[row] = rms_norm(x[row]) * weight. Output rows are `out_row_stride` elements apart.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) CONCAT(rms_norm, KERNEL_SUFFIX)(elem_t* __restrict__ out, const elem_t* __restrict__ x,
                                                          const welem_t* __restrict__ weight, compute_t epsilon,
                                                          long long n_rows, int hidden, int variance,
                                                          long long x_row_stride, long long out_row_stride) {
    long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / THREADS_PER_ROW;
    int lane = threadIdx.x % THREADS_PER_ROW;
    bool active = row < n_rows;
    long long n_chunks = ((long long)hidden + CHUNK - 1) / CHUNK;
    const elem_t* x_row = x + (active ? row : 0) * x_row_stride;
    elem_t* out_row = out + (active ? row : 0) * out_row_stride;

    // The row stays in registers as stored (packed), widened again for the second pass.
    chunk_t cache[CACHE_CHUNKS];
    compute_t sum_sq = 0.0f;
    if (active) {
        // Every cached chunk's load is issued before the first is used.
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * THREADS_PER_ROW;
            if (c < n_chunks) load_packed(x_row, c, hidden, cache[k]);
        }
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * THREADS_PER_ROW;
            if (c < n_chunks) {
                compute_t s[CHUNK];
                unpack(cache[k], s);
                add_squares(sum_sq, s, c, variance);
            }
        }
        for (long long c = lane + (long long)CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
            compute_t s[CHUNK];
            load_chunk(x_row, c, hidden, s);
            add_squares(sum_sq, s, c, variance);
        }
    }
    compute_t total = row_sum(sum_sq);
    if (!active) return;
    compute_t mean_square = isinf(total) ? rescaled_mean_square(x_row, nullptr, variance) : total / (compute_t)variance;
    compute_t rstd = c_div(compute_t(1), c_sqrt(mean_square + epsilon));
    // The cached chunks, WEIGHT_AHEAD at a time: the group's weight loads, then its stores.
#pragma unroll
    for (int g = 0; g < CACHE_CHUNKS; g += WEIGHT_AHEAD) {
        wchunk_t w[WEIGHT_AHEAD];
        load_weight_group(weight, lane, g, CACHE_CHUNKS, n_chunks, hidden, w);
#pragma unroll
        for (int j = 0; j < WEIGHT_AHEAD && g + j < CACHE_CHUNKS; ++j) {
            long long c = lane + (long long)(g + j) * THREADS_PER_ROW;
            if (c < n_chunks) {
                compute_t s[CHUNK];
                unpack(cache[g + j], s);
                finish_loaded(out_row, w[j], c, hidden, s, rstd);
            }
        }
    }
    for (long long c = lane + (long long)CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
        compute_t s[CHUNK];
        load_chunk(x_row, c, hidden, s);
        finish_chunk(out_row, weight, c, hidden, s, rstd);
    }
}

// In place: residual[row] <- round(x + residual), x[row] <- rms_norm(x + residual) * weight, with the
// norm computed from the unrounded sum.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) CONCAT(fused_add_rms_norm, KERNEL_SUFFIX)(elem_t* __restrict__ x,
                                                                    elem_t* __restrict__ residual,
                                                                    const welem_t* __restrict__ weight, compute_t epsilon,
                                                                    long long n_rows, int hidden, int variance,
                                                                    long long x_row_stride,
                                                                    long long residual_row_stride) {
    long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / THREADS_PER_ROW;
    int lane = threadIdx.x % THREADS_PER_ROW;
    bool active = row < n_rows;
    long long n_chunks = ((long long)hidden + CHUNK - 1) / CHUNK;
    elem_t* x_row = x + (active ? row : 0) * x_row_stride;
    elem_t* r_row = residual + (active ? row : 0) * residual_row_stride;

    // The cached chunks (fused_slot: x and residual as stored on the vector path, their sums on the
    // scalar one).
    fused_slot cache[FUSED_CACHE_CHUNKS];
    compute_t sum_sq = 0.0f;
    if (active) {
        // Every cached chunk's loads (x and residual) are issued before the first is used.
#pragma unroll
        for (int k = 0; k < FUSED_CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * THREADS_PER_ROW;
            if (c < n_chunks) load_slot(cache[k], x_row, r_row, c, hidden);
        }
#pragma unroll
        for (int k = 0; k < FUSED_CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * THREADS_PER_ROW;
            if (c < n_chunks) {
                compute_t s[CHUNK];
                slot_sum(cache[k], s);
                add_squares(sum_sq, s, c, variance);
            }
        }
        for (long long c = lane + (long long)FUSED_CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
            compute_t s[CHUNK], r[CHUNK];
            load_chunk(x_row, c, hidden, s);
            load_chunk(r_row, c, hidden, r);
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) s[i] += r[i];
            add_squares(sum_sq, s, c, variance);
        }
    }
    compute_t total = row_sum(sum_sq);
    compute_t mean_square =
        active && isinf(total) ? rescaled_mean_square(x_row, r_row, variance) : total / (compute_t)variance;
    // The rescue reads the whole row: no thread of the block writes before every one has read.
    __syncthreads();
    if (!active) return;
    compute_t rstd = c_div(compute_t(1), c_sqrt(mean_square + epsilon));
    // The cached chunks, WEIGHT_AHEAD at a time: the group's weight loads, then its stores.
#pragma unroll
    for (int g = 0; g < FUSED_CACHE_CHUNKS; g += WEIGHT_AHEAD) {
        wchunk_t w[WEIGHT_AHEAD];
        load_weight_group(weight, lane, g, FUSED_CACHE_CHUNKS, n_chunks, hidden, w);
#pragma unroll
        for (int j = 0; j < WEIGHT_AHEAD && g + j < FUSED_CACHE_CHUNKS; ++j) {
            long long c = lane + (long long)(g + j) * THREADS_PER_ROW;
            if (c < n_chunks) {
                compute_t s[CHUNK];
                slot_sum(cache[g + j], s);
                store_chunk(r_row, c, hidden, s);
                finish_loaded(x_row, w[j], c, hidden, s, rstd);
            }
        }
    }
    // Chunks beyond the cache are recomputed from x and residual before this thread overwrites them;
    // every chunk belongs to one thread, so no other thread reads what is written here.
    for (long long c = lane + (long long)FUSED_CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
        compute_t s[CHUNK], r[CHUNK];
        load_chunk(x_row, c, hidden, s);
        load_chunk(r_row, c, hidden, r);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) s[i] += r[i];
        store_chunk(r_row, c, hidden, s);
        finish_chunk(x_row, weight, c, hidden, s, rstd);
    }
}
