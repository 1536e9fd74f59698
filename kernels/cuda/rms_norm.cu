// RMS normalization kernels for the `cuda` provider, compiled by NVRTC at first use per variant.
//
// Variant defines (all required):
//   DTYPE            0 = f32, 1 = f16, 2 = bf16 (the element type of x, residual, weight and out)
//   HAS_WEIGHT       0 or 1
//   WDTYPE           the weight's type, coded like DTYPE (element.cuh; default DTYPE)
//   VEC              1 (scalar loads) or CHUNK (one 16-byte load per chunk); decided on the host from
//                    alignment, so both paths must give identical bits
//   THREADS_PER_ROW  8, 16, 32, 64, 128 or 256
//   BLOCK_SIZE       128 or 256
//   CACHE_CHUNKS     chunks of a row each thread keeps in registers between the passes (the host
//                    sizes it to hold the whole row up to the largest H of the threads-per-row bucket)
//
// Registers: each thread keeps its CACHE_CHUNKS chunks of the row between the two passes, so a row
// up to the bucket's largest H is read once and written once: rms_norm keeps x as stored (packed),
// the fused op the unrounded f32 sums. Chunks beyond (longer rows only) are read again.
//
// Numerics: squares accumulate in f32; the fused sum is one f32 addition; the norm is computed from
// the unrounded sum (cached in registers, else recomputed from x and residual before either is
// overwritten, by the thread that owns those elements); the weight step rounds y to the element type,
// multiplies by the weight in f32 and rounds once. Each thread owns whole chunks of CHUNK elements
// (16 bytes) in the same order whatever VEC is, so results depend only on the row, H and the dtype.
// The mean square runs over the first `variance` elements of each row (variance_size; the host
// passes H when it is not given); every element is normalized. A weight of another type than the
// elements is read with scalar loads; the weight step computes in the weight's type (y rounded to
// it, the product rounded to it) and the store rounds to the element type.
//
// Compiled after `element.cuh` (the element type and its conversions), which the crate prepends.

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

// Reads chunk `c` of a row (elements c*CHUNK .. c*CHUNK+CHUNK-1, those below `hidden`) into f32.
__device__ __forceinline__ void load_chunk(const elem_t* row, long long c, int hidden, float* out) {
    long long first = c * CHUNK;
#if VEC == CHUNK
    if (first + CHUNK <= hidden) {
        chunk_t packed = *reinterpret_cast<const chunk_t*>(row + first);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out[i] = to_f32(packed.v[i]);
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = (first + i < hidden) ? to_f32(row[first + i]) : 0.0f;
}

// Reads chunk `c` of a row as stored (elements at or beyond `hidden` read as zero), for the
// register cache; `unpack` widens it to f32 exactly as load_chunk does.
__device__ __forceinline__ void load_packed(const elem_t* row, long long c, int hidden, chunk_t& out) {
    long long first = c * CHUNK;
#if VEC == CHUNK
    if (first + CHUNK <= hidden) {
        out = *reinterpret_cast<const chunk_t*>(row + first);
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out.v[i] = (first + i < hidden) ? row[first + i] : from_f32(0.0f);
}

__device__ __forceinline__ void unpack(const chunk_t& packed, float* out) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = to_f32(packed.v[i]);
}

__device__ __forceinline__ void store_chunk(elem_t* row, long long c, int hidden, const float* in) {
    long long first = c * CHUNK;
#if VEC == CHUNK
    if (first + CHUNK <= hidden) {
        chunk_t packed;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) packed.v[i] = from_f32(in[i]);
        *reinterpret_cast<chunk_t*>(row + first) = packed;
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
        if (first + i < hidden) row[first + i] = from_f32(in[i]);
    }
}

// Sums `value` over the THREADS_PER_ROW threads of one row; every thread gets the same total.
// Every thread of the block must call this (it may contain a barrier).
__device__ __forceinline__ float row_sum(float value) {
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
    __shared__ float partials[BLOCK_SIZE / WARP];
    int warp = threadIdx.x / WARP;
    if (threadIdx.x % WARP == 0) partials[warp] = value;
    __syncthreads();
    int first_warp = (threadIdx.x / THREADS_PER_ROW) * (THREADS_PER_ROW / WARP);
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < THREADS_PER_ROW / WARP; ++w) total += partials[first_warp + w];
    return total;
#endif
}

// The mean square of the first `count` elements of a row when their f32 sum of squares overflowed
// (|x| above about 1.8e19 / sqrt(count)) although the mean may fit: the elements scaled by their
// largest magnitude, summed serially by the calling thread (no barrier, so any subset of threads may
// call it), then scaled back. A rare path.
__device__ __noinline__ float rescaled_mean_square(const elem_t* x_row, const elem_t* r_row, int count) {
    float largest = 0.0f;
    for (int j = 0; j < count; ++j) {
        float s = to_f32(x_row[j]) + (r_row ? to_f32(r_row[j]) : 0.0f);
        largest = fmaxf(largest, fabsf(s));
    }
    if (!(largest > 0.0f) || isinf(largest)) return __int_as_float(0x7f800000);
    float sum = 0.0f;
    for (int j = 0; j < count; ++j) {
        float s = (to_f32(x_row[j]) + (r_row ? to_f32(r_row[j]) : 0.0f)) / largest;
        sum += s * s;
    }
    return sum / (float)count * largest * largest;
}

// Adds the squares of a chunk's elements that lie among the first `variance` of the row to `sum`, in
// element order (the others add an exact 0, so with variance = H the sum is the plain one).
__device__ __forceinline__ void add_squares(float& sum, const float* s, long long c, int variance) {
    long long first = c * CHUNK;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) sum += (first + i < variance) ? s[i] * s[i] : 0.0f;
}

// Reads the weight of chunk `c` into f32: like load_chunk for a weight of the element type, with
// scalar loads for another type (whose chunk is not 16 bytes).
__device__ __forceinline__ void load_weight_chunk(const welem_t* weight, long long c, int hidden, float* out) {
#if WDTYPE == DTYPE
    load_chunk(weight, c, hidden, out);
#else
    long long first = c * CHUNK;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) out[i] = (first + i < hidden) ? w_to_f32(weight[first + i]) : 0.0f;
#endif
}

// Scales the f32 chunk by rstd (and the weight) and stores it rounded.
__device__ __forceinline__ void finish_chunk(elem_t* out_row, const welem_t* weight, long long c, int hidden,
                                             float* s, float rstd) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) s[i] *= rstd;
#if HAS_WEIGHT
    float w[CHUNK];
    load_weight_chunk(weight, c, hidden, w);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) s[i] = round_w(round_w(s[i]) * w[i]);
#endif
    store_chunk(out_row, c, hidden, s);
}

// out[row] = rms_norm(x[row]) * weight. Output rows are `out_row_stride` elements apart.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) CONCAT(rms_norm, KERNEL_SUFFIX)(elem_t* __restrict__ out, const elem_t* __restrict__ x,
                                                          const welem_t* __restrict__ weight, float epsilon,
                                                          long long n_rows, int hidden, int variance,
                                                          long long x_row_stride, long long out_row_stride) {
    long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / THREADS_PER_ROW;
    int lane = threadIdx.x % THREADS_PER_ROW;
    bool active = row < n_rows;
    long long n_chunks = (hidden + CHUNK - 1) / CHUNK;
    const elem_t* x_row = x + (active ? row : 0) * x_row_stride;
    elem_t* out_row = out + (active ? row : 0) * out_row_stride;

    // The row stays in registers as stored (packed), widened again for the second pass.
    chunk_t cache[CACHE_CHUNKS];
    float sum_sq = 0.0f;
    if (active) {
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * THREADS_PER_ROW;
            if (c < n_chunks) {
                float s[CHUNK];
                load_packed(x_row, c, hidden, cache[k]);
                unpack(cache[k], s);
                add_squares(sum_sq, s, c, variance);
            }
        }
        for (long long c = lane + (long long)CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
            float s[CHUNK];
            load_chunk(x_row, c, hidden, s);
            add_squares(sum_sq, s, c, variance);
        }
    }
    float total = row_sum(sum_sq);
    if (!active) return;
    float mean_square = isinf(total) ? rescaled_mean_square(x_row, nullptr, variance) : total / (float)variance;
    float rstd = 1.0f / sqrtf(mean_square + epsilon);
#pragma unroll
    for (int k = 0; k < CACHE_CHUNKS; ++k) {
        long long c = lane + (long long)k * THREADS_PER_ROW;
        if (c < n_chunks) {
            float s[CHUNK];
            unpack(cache[k], s);
            finish_chunk(out_row, weight, c, hidden, s, rstd);
        }
    }
    for (long long c = lane + (long long)CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
        float s[CHUNK];
        load_chunk(x_row, c, hidden, s);
        finish_chunk(out_row, weight, c, hidden, s, rstd);
    }
}

// In place: residual[row] <- round(x + residual), x[row] <- rms_norm(x + residual) * weight, with the
// norm computed from the unrounded sum.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) CONCAT(fused_add_rms_norm, KERNEL_SUFFIX)(elem_t* __restrict__ x,
                                                                    elem_t* __restrict__ residual,
                                                                    const welem_t* __restrict__ weight, float epsilon,
                                                                    long long n_rows, int hidden, int variance,
                                                                    long long x_row_stride,
                                                                    long long residual_row_stride) {
    long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / THREADS_PER_ROW;
    int lane = threadIdx.x % THREADS_PER_ROW;
    bool active = row < n_rows;
    long long n_chunks = (hidden + CHUNK - 1) / CHUNK;
    elem_t* x_row = x + (active ? row : 0) * x_row_stride;
    elem_t* r_row = residual + (active ? row : 0) * residual_row_stride;

    float cache[CACHE_CHUNKS][CHUNK];
    float sum_sq = 0.0f;
    if (active) {
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long long c = lane + (long long)k * THREADS_PER_ROW;
            if (c < n_chunks) {
                float r[CHUNK];
                load_chunk(x_row, c, hidden, cache[k]);
                load_chunk(r_row, c, hidden, r);
#pragma unroll
                for (int i = 0; i < CHUNK; ++i) cache[k][i] += r[i];
                add_squares(sum_sq, cache[k], c, variance);
            }
        }
        for (long long c = lane + (long long)CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
            float s[CHUNK], r[CHUNK];
            load_chunk(x_row, c, hidden, s);
            load_chunk(r_row, c, hidden, r);
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) s[i] += r[i];
            add_squares(sum_sq, s, c, variance);
        }
    }
    float total = row_sum(sum_sq);
    float mean_square =
        active && isinf(total) ? rescaled_mean_square(x_row, r_row, variance) : total / (float)variance;
    // The rescue reads the whole row: no thread of the block writes before every one has read.
    __syncthreads();
    if (!active) return;
    float rstd = 1.0f / sqrtf(mean_square + epsilon);
    // Chunks beyond the cache are recomputed from x and residual before this thread overwrites them;
    // every chunk belongs to one thread, so no other thread reads what is written here.
    for (long long c = lane + (long long)CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
        float s[CHUNK], r[CHUNK];
        load_chunk(x_row, c, hidden, s);
        load_chunk(r_row, c, hidden, r);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) s[i] += r[i];
        store_chunk(r_row, c, hidden, s);
        finish_chunk(x_row, weight, c, hidden, s, rstd);
    }
#pragma unroll
    for (int k = 0; k < CACHE_CHUNKS; ++k) {
        long long c = lane + (long long)k * THREADS_PER_ROW;
        if (c < n_chunks) {
            store_chunk(r_row, c, hidden, cache[k]);
            finish_chunk(x_row, weight, c, hidden, cache[k], rstd);
        }
    }
}
