// RMS normalization kernels for the `xpu` provider (OpenCL C 1.2), built at first use per variant.
//
// Variant defines:
//   DTYPE            0 = f32, 1 = f16, 2 = bf16 (see element.cl)
//   HAS_WEIGHT       0 or 1
//   WDTYPE           the weight's type, coded like DTYPE (see element.cl; default DTYPE)
//   THREADS_PER_ROW  work-items cooperating on one row (a power of two)
//   ROWS_PER_GROUP   rows per work-group; the work-group size is THREADS_PER_ROW * ROWS_PER_GROUP
//   USE_SUBGROUPS    1: reduce with sub-group collectives (cl_khr_subgroups / cl_intel_subgroups),
//                    0: reduce with a local-memory tree (always available; forced in tests)
//
// Built after `element.cl` (the element type and its conversions), which the crate prepends.
//
// Numerics as docs/kernels.md states them: f32 squares and sums, the fused sum as one f32 addition, the norm
// from the unrounded sum (recomputed from x and residual by the work-item that owns those elements,
// before it overwrites them), the weight step rounding y to the element type first. No fast-math
// options and no native_rsqrt. Offsets and row strides are in elements and 64-bit. The mean square
// runs over the first `variance` elements of each row (variance_size; the host passes the hidden size
// when it is not given); every element is normalized and written.

#if USE_SUBGROUPS
#if defined(cl_khr_subgroups)
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#elif defined(cl_intel_subgroups)
#pragma OPENCL EXTENSION cl_intel_subgroups : enable
#endif
#endif

#define GROUP_SIZE (THREADS_PER_ROW * ROWS_PER_GROUP)

// Elements of a row each work-item keeps in registers between the two passes. The host gives a row
// enough work-items (within the device's work-group limit) for the whole row to fit, up to
// H = 32 × 1024 = 32768: each element is read once and written once. Longer rows read the rest twice.
// A work-item owns whole chunks (element.cl: 16 bytes, read with one vector load): chunks lane,
// lane + THREADS_PER_ROW, ..., the first CACHE_CHUNKS of them cached.
#define CACHE 32
#define CACHE_CHUNKS (CACHE / CHUNK)

// Sums `value` over the THREADS_PER_ROW work-items of this row; all work-items of the group call it.
inline compute_t row_sum(compute_t value, __local compute_t* scratch) {
    int local_id = get_local_id(0);
    int lane = local_id % THREADS_PER_ROW;
#if USE_SUBGROUPS
    // The host enables this path only when the sub-group size divides THREADS_PER_ROW, so no
    // sub-group spans two rows.
    compute_t partial = sub_group_reduce_add(value);
    int sg_size = get_sub_group_size();
    int sg_id = get_sub_group_id();
    if (get_sub_group_local_id() == 0) scratch[sg_id] = partial;
    barrier(CLK_LOCAL_MEM_FENCE);
    int per_row = THREADS_PER_ROW / sg_size;
    int first = (local_id / THREADS_PER_ROW) * per_row;
    compute_t total = 0.0f;
    for (int i = 0; i < per_row; ++i) total += scratch[first + i];
    return total;
#else
    scratch[local_id] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = THREADS_PER_ROW / 2; stride > 0; stride >>= 1) {
        if (lane < stride) scratch[local_id] += scratch[local_id + stride];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return scratch[local_id - lane];
#endif
}

// The mean square of the first `count` elements of a row when their f32 sum of squares overflowed
// (|x| above about 1.8e19 / sqrt(count))
// although the mean may fit: the row scaled by its largest magnitude, summed serially by the calling
// work-item (no barrier, so any subset of work-items may call it), then scaled back. A rare path.
inline compute_t rescaled_mean_square(__global const elem_t* x_row, __global const elem_t* r_row, int count) {
    compute_t largest = 0.0f;
    for (long j = 0; j < count; ++j) {
        compute_t s = LOAD(x_row, j) + (r_row ? LOAD(r_row, j) : 0.0f);
        largest = fmax(largest, fabs(s));
    }
    if (!(largest > 0.0f) || isinf(largest)) return INFINITY;
    compute_t sum = 0.0f;
    for (long j = 0; j < count; ++j) {
        compute_t s = (LOAD(x_row, j) + (r_row ? LOAD(r_row, j) : 0.0f)) / largest;
        sum += s * s;
    }
    return sum / (compute_t)count * largest * largest;
}

// The weight step in the weight's type (y rounded to it, the product rounded to it); the store then
// rounds to the element type. With the weight in the element type this is the product rounded once.
inline wcompute_t weighted(compute_t y, __global const welem_t* weight, long j) {
#if HAS_WEIGHT
    return round_to_w(round_to_w(y) * LOAD_W(weight, j));
#else
    return y;
#endif
}

__kernel __attribute__((reqd_work_group_size(GROUP_SIZE, 1, 1)))
void NAME(rms_norm)(__global elem_t* out, long out_offset, __global const elem_t* x, long x_offset,
                    __global const welem_t* weight, long weight_offset, compute_t epsilon, long n_rows, int hidden,
                    int variance, long x_row_stride, long out_row_stride) {
    __local compute_t scratch[GROUP_SIZE];
    long row = (long)get_group_id(0) * ROWS_PER_GROUP + get_local_id(0) / THREADS_PER_ROW;
    int lane = get_local_id(0) % THREADS_PER_ROW;
    bool active = row < n_rows;
    __global const elem_t* x_row = x + x_offset + (active ? row : 0) * x_row_stride;
    __global elem_t* out_row = out + out_offset + (active ? row : 0) * out_row_stride;
    __global const welem_t* w = weight + weight_offset;

    // The first CACHE_CHUNKS chunks of each work-item stay in private registers between the passes
    // (unrolled loops, constant indices), their loads all issued before any sum; the rest is read
    // again. Sums run in the work-item's element order.
    const long n_chunks = CHUNKS(hidden);
    compute_t cache[CACHE];
    compute_t sum_sq = 0.0f;
    if (active) {
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long c = lane + (long)k * THREADS_PER_ROW;
            load_chunk(x_row, c < n_chunks ? c : n_chunks, hidden, cache + k * CHUNK);
        }
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long first = (lane + (long)k * THREADS_PER_ROW) * CHUNK;
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) {
                compute_t a = cache[k * CHUNK + i];
                if (first + i < variance) sum_sq += a * a;
            }
        }
        for (long c = lane + (long)CACHE_CHUNKS * THREADS_PER_ROW; c * CHUNK < variance; c += THREADS_PER_ROW) {
            compute_t a[CHUNK];
            load_chunk(x_row, c, hidden, a);
            for (int i = 0; i < CHUNK; ++i) {
                if (c * CHUNK + i < variance) sum_sq += a[i] * a[i];
            }
        }
    }
    compute_t total = row_sum(sum_sq, scratch);
    if (!active) return;
    compute_t mean_square = isinf(total) ? rescaled_mean_square(x_row, 0, variance) : total / (compute_t)variance;
    compute_t rstd = 1.0f / sqrt(mean_square + epsilon);
#pragma unroll
    for (int k = 0; k < CACHE_CHUNKS; ++k) {
        long first = (lane + (long)k * THREADS_PER_ROW) * CHUNK;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            long j = first + i;
            if (j < hidden) WSTORE(out_row, j, weighted(cache[k * CHUNK + i] * rstd, w, j));
        }
    }
    for (long c = lane + (long)CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
        compute_t a[CHUNK];
        load_chunk(x_row, c, hidden, a);
        for (int i = 0; i < CHUNK; ++i) {
            long j = c * CHUNK + i;
            if (j < hidden) WSTORE(out_row, j, weighted(a[i] * rstd, w, j));
        }
    }
}

__kernel __attribute__((reqd_work_group_size(GROUP_SIZE, 1, 1)))
void NAME(fused_add_rms_norm)(__global elem_t* x, long x_offset, __global elem_t* residual, long residual_offset,
                              __global const welem_t* weight, long weight_offset, compute_t epsilon, long n_rows,
                              int hidden, int variance, long x_row_stride, long residual_row_stride) {
    __local compute_t scratch[GROUP_SIZE];
    long row = (long)get_group_id(0) * ROWS_PER_GROUP + get_local_id(0) / THREADS_PER_ROW;
    int lane = get_local_id(0) % THREADS_PER_ROW;
    bool active = row < n_rows;
    __global elem_t* x_row = x + x_offset + (active ? row : 0) * x_row_stride;
    __global elem_t* r_row = residual + residual_offset + (active ? row : 0) * residual_row_stride;
    __global const welem_t* w = weight + weight_offset;

    const long n_chunks = CHUNKS(hidden);
    compute_t cache[CACHE];
    compute_t sum_sq = 0.0f;
    if (active) {
        // x and the residual of every cached chunk loaded before any sum; cache holds s = x + r.
        compute_t residual_cache[CACHE];
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long c = lane + (long)k * THREADS_PER_ROW;
            c = c < n_chunks ? c : n_chunks;
            load_chunk(x_row, c, hidden, cache + k * CHUNK);
            load_chunk(r_row, c, hidden, residual_cache + k * CHUNK);
        }
#pragma unroll
        for (int k = 0; k < CACHE_CHUNKS; ++k) {
            long first = (lane + (long)k * THREADS_PER_ROW) * CHUNK;
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) {
                compute_t s = cache[k * CHUNK + i] + residual_cache[k * CHUNK + i];
                cache[k * CHUNK + i] = s;
                if (first + i < variance) sum_sq += s * s;
            }
        }
        for (long c = lane + (long)CACHE_CHUNKS * THREADS_PER_ROW; c * CHUNK < variance; c += THREADS_PER_ROW) {
            compute_t a[CHUNK], b[CHUNK];
            load_chunk(x_row, c, hidden, a);
            load_chunk(r_row, c, hidden, b);
            for (int i = 0; i < CHUNK; ++i) {
                compute_t s = a[i] + b[i];
                if (c * CHUNK + i < variance) sum_sq += s * s;
            }
        }
    }
    compute_t total = row_sum(sum_sq, scratch);
    compute_t mean_square =
        active && isinf(total) ? rescaled_mean_square(x_row, r_row, variance) : total / (compute_t)variance;
    // The rescue reads the whole row: no work-item of the group writes before every one has read.
    barrier(CLK_GLOBAL_MEM_FENCE);
    if (!active) return;
    compute_t rstd = 1.0f / sqrt(mean_square + epsilon);
    // Each element is owned by one work-item, which writes it from its cache, or recomputes the
    // unrounded sum from x and the residual before overwriting them.
#pragma unroll
    for (int k = 0; k < CACHE_CHUNKS; ++k) {
        long first = (lane + (long)k * THREADS_PER_ROW) * CHUNK;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            long j = first + i;
            if (j < hidden) {
                STORE(r_row, j, cache[k * CHUNK + i]);
                WSTORE(x_row, j, weighted(cache[k * CHUNK + i] * rstd, w, j));
            }
        }
    }
    for (long c = lane + (long)CACHE_CHUNKS * THREADS_PER_ROW; c < n_chunks; c += THREADS_PER_ROW) {
        compute_t a[CHUNK], b[CHUNK];
        load_chunk(x_row, c, hidden, a);
        load_chunk(r_row, c, hidden, b);
        for (int i = 0; i < CHUNK; ++i) {
            long j = c * CHUNK + i;
            if (j < hidden) {
                compute_t s = a[i] + b[i];
                STORE(r_row, j, s);
                WSTORE(x_row, j, weighted(s * rstd, w, j));
            }
        }
    }
}
