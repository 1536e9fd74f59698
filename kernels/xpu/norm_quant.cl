// RMS normalization followed by fp8 quantization in one kernel (OpenCL C 1.2): the ops
// `rms_norm_static_fp8_quant`, `rms_norm_dynamic_per_token_quant`, `fused_add_rms_norm_static_fp8_quant`
// and `fused_add_rms_norm_dynamic_per_token_quant`. Built after `element.cl` and `quant.cl` (the conversion
// and the group maximum), per input dtype.
//
// One work-group of QUANT_GROUP work-items per row. Pass 1 sums the squares of a = x (+ r) in f32;
// rstd = 1 / sqrt(sum / hidden + eps). Pass 2 (dynamic only) reduces the absmax of the normalized
// values z. The last pass recomputes z, writes the residual output (the rounded sum) and
// q = fp8(z / s). z = round(round(a * rstd) * w), rounded to the element type at each step: the
// rounding points of the composition `quant(rms_norm(x))`, where the norm's output is stored in
// x's dtype. The residual is read in every pass and written only in the last, each element by the
// work-item that read it, so the residual output may be the residual's own rows (in place: then
// `residual_out` is `r` and the output strides are the residual's).

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

__kernel __attribute__((reqd_work_group_size(QUANT_GROUP, 1, 1))) void NAME(norm_quant)(
    __global uchar* q, long q_offset, __global float* scales, long scales_offset, __global elem_t* residual_out,
    long out_offset, __global const elem_t* x, long x_offset, __global const elem_t* r, long r_offset,
    __global const elem_t* w, long w_offset, long n_rows, int hidden, long x_row_stride, long r_row_stride,
    long out_row_stride, compute_t eps, __global const float* scale, long scale_offset, int has_residual,
    int has_weight, int dynamic, int has_scale, int format) {
    __local compute_t scratch[QUANT_GROUP];
    long row = get_group_id(0);
    int lid = get_local_id(0);
    __global const elem_t* x_row = x + x_offset + row * x_row_stride;
    __global const elem_t* r_row = r + r_offset + row * r_row_stride;
    __global const elem_t* w_row = w + w_offset;
    __global uchar* q_row = q + q_offset + row * (long)hidden;
    __global elem_t* out_row = residual_out + out_offset + row * out_row_stride;

    compute_t squares = 0.0f;
    for (long j = lid; j < hidden; j += QUANT_GROUP) {
        compute_t a = LOAD(x_row, j);
        if (has_residual) a += LOAD(r_row, j);
        squares += a * a;
    }
    compute_t rstd = 1.0f / sqrt(quant_group_sum(squares, scratch) / (compute_t)hidden + eps);

    // The reduction runs for static calls too (on zeros), so every barrier is reached
    // unconditionally.
    compute_t absmax = 0.0f;
    if (dynamic) {
        for (long j = lid; j < hidden; j += QUANT_GROUP) {
            compute_t a = LOAD(x_row, j);
            if (has_residual) a += LOAD(r_row, j);
            compute_t z = round_to_elem(a * rstd);
            if (has_weight) z = round_to_elem(z * LOAD(w_row, j));
            absmax = fmax(absmax, fabs(z));
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

    for (long j = lid; j < hidden; j += QUANT_GROUP) {
        compute_t a = LOAD(x_row, j);
        if (has_residual) {
            a += LOAD(r_row, j);
            STORE(out_row, j, a);
        }
        compute_t z = round_to_elem(a * rstd);
        if (has_weight) z = round_to_elem(z * LOAD(w_row, j));
        q_row[j] = to_fp8(z / s, format);
    }
}
