// RMS normalization followed by fp8 quantization in one kernel (OpenCL C 1.2): the ops
// `rms_norm_static_fp8_quant`, `rms_norm_dynamic_per_token_quant`, `fused_add_rms_norm_static_fp8_quant`
// and `fused_add_rms_norm_dynamic_per_token_quant`. Built after `element.cl` and `quant.cl` (the conversion
// and the group maximum), per input dtype.
//
// One work-group of QUANT_GROUP work-items per row, each owning whole 16-byte chunks of it
// (`load_chunk`, element.cl: one vector load each of x, the residual and the weight). Pass 1 sums the squares of a = x (+ r) in f32
// (a row whose sum overflows: scaled by its largest magnitude, as the norms do); rstd = 1 / sqrt(sum
// / hidden + eps). Pass 2 (dynamic only) reduces the absmax of the normalized
// values z. The last pass recomputes z, writes the residual output (the rounded sum) and
// q = fp8(z / s) (fp8(z * c(1 / s)) with `invert`, a static scale under `rounding = "dtype"`).
// With `round_sum` (`rounding = "dtype"` on 16-bit elements) every pass reads the sum rounded to
// the element type, the residual output's values. z = round(round(a * rstd) * w), rounded to the element type at each step: the
// rounding points of the composition `quant(rms_norm(x))`, where the norm's output is stored in
// x's dtype. The residual is read in every pass and written only in the last, each element by the
// work-item that read it, so the residual output may be the residual's own rows (in place: then
// `residual_out` is `r` and the output strides are the residual's). A program built with a weight
// type WDTYPE other than DTYPE holds `norm_quant_w<weight>_<dtype>`, which reads the weight element
// by element.

// Sums `value` over the work-group in a fixed tree order; every work-item gets the total.
inline compute_t quant_group_sum(compute_t value, __local compute_t* scratch) {
    int id = get_local_id(0);
    scratch[id] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int width = QUANT_GROUP / 2; width > 0; width >>= 1) {
        if (id < width) scratch[id] += scratch[id + width];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    compute_t total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

// Chunk c's values a = x (+ r), in the compute type (zero past `hidden`); the sum rounded to the
// element type with `has_residual == 2` (`round_sum`).
inline void row_values(__global const elem_t* x_row, __global const elem_t* r_row, long c, int hidden,
                       int has_residual, compute_t* a) {
    load_chunk(x_row, c, hidden, a);
    if (has_residual) {
        compute_t b[CHUNK];
        load_chunk(r_row, c, hidden, b);
        for (int i = 0; i < CHUNK; ++i) a[i] += b[i];
        if (has_residual == 2) {
            for (int i = 0; i < CHUNK; ++i) a[i] = round_to_elem(a[i]);
        }
    }
}

// Element j's value a = x (+ r), rounded with `has_residual == 2`: `row_values` one at a time.
inline compute_t row_value(__global const elem_t* x_row, __global const elem_t* r_row, long j, int has_residual) {
    compute_t a = LOAD(x_row, j);
    if (has_residual) a += LOAD(r_row, j);
    if (has_residual == 2) a = round_to_elem(a);
    return a;
}

// The mean square of a row's values when their f32 sum of squares overflowed (|a| above about
// 1.8e19 / sqrt(hidden)) although the mean may fit: the row scaled by its largest magnitude, summed
// serially by the calling work-item, then scaled back, as the norms' `rescaled_mean_square` does.
// A rare path.
inline compute_t quant_rescaled_mean_square(__global const elem_t* x_row, __global const elem_t* r_row, int hidden,
                                            int has_residual) {
    compute_t largest = 0.0f;
    for (long j = 0; j < hidden; ++j) largest = fmax(largest, fabs(row_value(x_row, r_row, j, has_residual)));
    if (!(largest > 0.0f) || isinf(largest)) return INFINITY;
    compute_t sum = 0.0f;
    for (long j = 0; j < hidden; ++j) {
        compute_t s = row_value(x_row, r_row, j, has_residual) / largest;
        sum += s * s;
    }
    return sum / (compute_t)hidden * largest * largest;
}

#if WDTYPE == DTYPE
// The normalized values z of chunk c's values a (in place), weighted by chunk c of w when given.
inline void normalize(compute_t* a, compute_t rstd, __global const welem_t* w_row, long c, int hidden,
                      int has_weight) {
    compute_t wc[CHUNK];
    if (has_weight) load_chunk(w_row, c, hidden, wc);
    for (int i = 0; i < CHUNK; ++i) {
        a[i] = round_to_elem(a[i] * rstd);
        if (has_weight) a[i] = round_to_elem(a[i] * wc[i]);
    }
}
#define NORM_QUANT_NAME NAME(norm_quant)
#else
// A weight of another type (a program built with WDTYPE, element.cl), read element by element: the
// weight step in its type, z = round_x(round_w(round_w(y) * w)), as the reference's step 5 (in
// double when either type is f64; a double z rounds to x's type once).
inline void normalize(compute_t* a, compute_t rstd, __global const welem_t* w_row, long c, int hidden,
                      int has_weight) {
    for (int i = 0; i < CHUNK; ++i) {
        long j = c * CHUNK + i;
        compute_t y = a[i] * rstd;
        if (has_weight) {
            wcompute_t wv = j < hidden ? (wcompute_t)LOAD_W(w_row, j) : (wcompute_t)0;
            wcompute_t z = round_to_w(round_to_w(y) * wv);
#if DTYPE == 6
            a[i] = z;
#elif DTYPE == 0
            a[i] = (float)z;
#else
            a[i] = round_to_elem(W_NARROW(z));
#endif
        } else {
            a[i] = round_to_elem(y);
        }
    }
}
#if WDTYPE == 0
#define NORM_QUANT_W norm_quant_wf32
#elif WDTYPE == 1
#define NORM_QUANT_W norm_quant_wf16
#elif WDTYPE == 2
#define NORM_QUANT_W norm_quant_wbf16
#else
#define NORM_QUANT_W norm_quant_wf64
#endif
// `norm_quant_w<weight>_<dtype>` (NAME pastes after its argument is expanded through this one).
#define NORM_QUANT_NAME_OF(op) NAME(op)
#define NORM_QUANT_NAME NORM_QUANT_NAME_OF(NORM_QUANT_W)
#endif

__kernel __attribute__((reqd_work_group_size(QUANT_GROUP, 1, 1))) void NORM_QUANT_NAME(
    __global uchar* q, long q_offset, __global float* scales, long scales_offset, __global elem_t* residual_out,
    long out_offset, __global const elem_t* x, long x_offset, __global const elem_t* r, long r_offset,
    __global const welem_t* w, long w_offset, long n_rows, int hidden, long x_row_stride, long r_row_stride,
    long out_row_stride, compute_t eps, __global const float* scale, long scale_offset, int has_residual,
    int has_weight, int dynamic, int has_scale, int format, int round_sum, int invert) {
    __local compute_t scratch[QUANT_GROUP];
    has_residual = has_residual ? 1 + (round_sum != 0) : 0;
    long row = get_group_id(0);
    int lid = get_local_id(0);
    __global const elem_t* x_row = x + x_offset + row * x_row_stride;
    __global const elem_t* r_row = r + r_offset + row * r_row_stride;
    __global const welem_t* w_row = w + w_offset;
    __global uchar* q_row = q + q_offset + row * (long)hidden;
    __global elem_t* out_row = residual_out + out_offset + row * out_row_stride;

    const long n = CHUNKS(hidden);
    compute_t squares = 0.0f;
    for (long c = lid; c < n; c += QUANT_GROUP) {
        compute_t a[CHUNK];
        row_values(x_row, r_row, c, hidden, has_residual, a);
        for (int i = 0; i < CHUNK; ++i) squares += a[i] * a[i];  // past hidden: zero
    }
    // The total is every work-item's, so a row that overflowed is rescued by all of them; the
    // absmax's barriers below come before any write of the residual output.
    compute_t total = quant_group_sum(squares, scratch);
    compute_t mean_square =
        isinf(total) ? quant_rescaled_mean_square(x_row, r_row, hidden, has_residual) : total / (compute_t)hidden;
    compute_t rstd = 1.0f / sqrt(mean_square + eps);

    // The reduction runs for static calls too (on zeros), so every barrier is reached
    // unconditionally.
    compute_t absmax = 0.0f;
    if (dynamic) {
        for (long c = lid; c < n; c += QUANT_GROUP) {
            compute_t a[CHUNK];
            row_values(x_row, r_row, c, hidden, has_residual, a);
            normalize(a, rstd, w_row, c, hidden, has_weight);
            for (int i = 0; i < CHUNK; ++i) absmax = fmax(absmax, fabs(a[i]));  // past hidden: zero
        }
    }
    absmax = quant_group_max(absmax, scratch);
    compute_t s;
    if (dynamic) {
        if (has_scale) absmax = fmin(absmax, (compute_t)scale[scale_offset]);
        compute_t max_finite = fp8_max(format);
        s = fmax(absmax / max_finite, 1.0f / (max_finite * 512.0f));
        if (lid == 0) scales[scales_offset + row] = s;
    } else {
        s = scale[scale_offset];
    }
    int by_inverse = !dynamic && invert;
    compute_t inverse = (compute_t)1.0f / s;

    for (long c = lid; c < n; c += QUANT_GROUP) {
        compute_t a[CHUNK];
        row_values(x_row, r_row, c, hidden, has_residual, a);
        for (int i = 0; i < CHUNK; ++i) {
            if (has_residual && c * CHUNK + i < hidden) STORE(out_row, c * CHUNK + i, a[i]);
        }
        normalize(a, rstd, w_row, c, hidden, has_weight);
        for (int i = 0; i < CHUNK; ++i) {
            long j = c * CHUNK + i;
            if (j < hidden) q_row[j] = to_fp8(quant_scaled(a[i], s, inverse, by_inverse), format);
        }
    }
}
