// fp8 quantization of the `xpu` provider (OpenCL C 1.2): `static_scaled_fp8_quant` and
// `dynamic_per_token_scaled_fp8_quant`. Built after `element.cl`, per input dtype.
//
// q[row, j] = fp8(x[row, j] / s) with one f32 division (the program is built with
// -cl-fp32-correctly-rounded-divide-sqrt), or with `invert` (a static scale under `rounding =
// "dtype"`, vLLM's rounding points) fp8(x[row, j] * c(1 / s)) and a saturating nearest-even conversion (`fp8_from_f32`, in `element.cl`); the dynamic
// kernel's s = max(min(absmax, ub) / M, 1 / (M * 512)), absmax reduced with fmax (NaN skipped).
// `format` 0 = f8e4m3fn (M = 448), 1 = f8e5m2 (M = 57344). One work-group of QUANT_GROUP
// work-items per row, each owning whole 16-byte chunks of it (`load_chunk`, element.cl: one vector
// load each); q is compact rows of `hidden` bytes.

#define QUANT_GROUP 128

// A double narrows through f32 rounded to odd, which the fp8 rounding then rounds as the double.
inline uchar to_fp8(compute_t v, int format) {
    float f = NARROW_C(v);
    return format == 0 ? fp8_from_f32(f, 3, 7, 448.0f) : fp8_from_f32(f, 2, 15, 57344.0f);
}

inline compute_t fp8_max(int format) { return format == 0 ? 448.0f : 57344.0f; }

// The maximum of `value` over the work-group in a fixed tree order (fmax: NaN skipped); every
// work-item gets it.
inline compute_t quant_group_max(compute_t value, __local compute_t* scratch) {
    int id = get_local_id(0);
    scratch[id] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int width = QUANT_GROUP / 2; width > 0; width >>= 1) {
        if (id < width) scratch[id] = fmax(scratch[id], scratch[id + width]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    compute_t total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

// A value scaled for quantization: divided by s, or multiplied by `inverse` (c(1 / s)) when
// `invert`.
inline compute_t quant_scaled(compute_t v, compute_t s, compute_t inverse, int invert) {
    return invert ? v * inverse : v / s;
}

// Writes the codes of chunk c of a row of x scaled by s (those below `hidden`).
inline void quant_chunk(__global const elem_t* x_row, __global uchar* q_row, long c, int hidden, compute_t s,
                        compute_t inverse, int invert, int format) {
    compute_t a[CHUNK];
    load_chunk(x_row, c, hidden, a);
    for (int i = 0; i < CHUNK; ++i) {
        long j = c * CHUNK + i;
        if (j < hidden) q_row[j] = to_fp8(quant_scaled(a[i], s, inverse, invert), format);
    }
}

__kernel __attribute__((reqd_work_group_size(QUANT_GROUP, 1, 1))) void NAME(static_scaled_fp8_quant)(
    __global uchar* q, long q_offset, __global const elem_t* x, long x_offset, long n_rows, int hidden,
    long x_row_stride, __global const float* scale, long scale_offset, int format, int invert) {
    long row = get_group_id(0);
    __global const elem_t* x_row = x + x_offset + row * x_row_stride;
    __global uchar* q_row = q + q_offset + row * (long)hidden;
    compute_t s = scale[scale_offset];
    compute_t inverse = (compute_t)1.0f / s;
    for (long c = get_local_id(0); c < CHUNKS(hidden); c += QUANT_GROUP) {
        quant_chunk(x_row, q_row, c, hidden, s, inverse, invert, format);
    }
}

__kernel __attribute__((reqd_work_group_size(QUANT_GROUP, 1, 1))) void NAME(dynamic_per_token_scaled_fp8_quant)(
    __global uchar* q, long q_offset, __global float* scales, long scales_offset, __global const elem_t* x,
    long x_offset, long n_rows, int hidden, long x_row_stride, __global const float* scale_ub, long ub_offset,
    int has_ub, int format) {
    __local compute_t scratch[QUANT_GROUP];
    long row = get_group_id(0);
    __global const elem_t* x_row = x + x_offset + row * x_row_stride;
    __global uchar* q_row = q + q_offset + row * (long)hidden;
    compute_t absmax = 0.0f;
    for (long c = get_local_id(0); c < CHUNKS(hidden); c += QUANT_GROUP) {
        compute_t a[CHUNK];
        load_chunk(x_row, c, hidden, a);  // past hidden: zero, which changes no maximum
        for (int i = 0; i < CHUNK; ++i) absmax = fmax(absmax, fabs(a[i]));
    }
    absmax = quant_group_max(absmax, scratch);
    if (has_ub) absmax = fmin(absmax, (compute_t)scale_ub[ub_offset]);
    compute_t max_finite = fp8_max(format);
    compute_t s = fmax(absmax / max_finite, 1.0f / (max_finite * 512.0f));
    if (get_local_id(0) == 0) scales[scales_offset + row] = s;
    for (long c = get_local_id(0); c < CHUNKS(hidden); c += QUANT_GROUP) {
        quant_chunk(x_row, q_row, c, hidden, s, s, 0, format);
    }
}
