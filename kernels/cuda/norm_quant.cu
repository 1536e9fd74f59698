// RMS normalization followed by fp8 quantization in one kernel: the ops `rms_norm_static_fp8_quant`,
// `rms_norm_dynamic_per_token_quant`, `fused_add_rms_norm_static_fp8_quant` and
// `fused_add_rms_norm_dynamic_per_token_quant`. Compiled after
// `element.cuh` and `quant.cu` (the conversion and the block maximum), per input dtype.
//
// One block of QUANT_BLOCK threads per row, every value in the compute type (element.cuh: f32, f64
// for f64 elements). Pass 1 sums the squares of a = x (+ r);
// rstd = 1 / sqrt(sum / hidden + eps) (IEEE division and square root). Pass 2 (dynamic only)
// reduces the absmax of the normalized values z. The last pass recomputes z, writes the residual
// output (the rounded sum) and q = fp8(z / s). z = round(round(a * rstd) * w), rounded to the element
// type at each step: the rounding points of the composition `quant(rms_norm(x))`. The residual is
// read in every pass and written only in the last, each element by the thread that read it, so the
// residual output may be the residual's own rows (in place: `residual_out` is `r`, with its stride).

// f64 (a reference dtype) keeps the absmax loop rolled: unrolled, ptxas spills a few of its
// doubles to a stack frame.
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

extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) CONCAT(norm_quant, KERNEL_SUFFIX)(
    unsigned char* __restrict__ q, float* __restrict__ scales, elem_t* residual_out, const elem_t* x,
    const elem_t* r, const elem_t* __restrict__ w, long long n_rows, int hidden, long long x_row_stride,
    long long r_row_stride, long long out_row_stride, compute_t eps, const float* __restrict__ scale, int has_residual,
    int has_weight,
    int dynamic, int has_scale, int format) {
    __shared__ compute_t scratch[QUANT_BLOCK];
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* x_row = x + row * x_row_stride;
    const elem_t* r_row = r + row * r_row_stride;
    unsigned char* q_row = q + row * (long long)hidden;
    elem_t* out_row = residual_out + row * out_row_stride;

    compute_t squares = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
        compute_t a = to_c(x_row[j]);
        if (has_residual) a = c_add(a, to_c(r_row[j]));
        squares = c_add(squares, c_mul(a, a));
    }
    compute_t mean_square = c_div(quant_block_sum(squares, scratch), (compute_t)hidden);
    compute_t rstd = c_div(compute_t(1), c_sqrt(c_add(mean_square, eps)));

    compute_t absmax = 0.0f;
    if (dynamic) {
        F64_ROLLED
        for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
            compute_t a = to_c(x_row[j]);
            if (has_residual) a = c_add(a, to_c(r_row[j]));
            compute_t z = round_elem(c_mul(a, rstd));
            if (has_weight) z = round_elem(c_mul(z, to_c(w[j])));
            absmax = c_fmax(absmax, c_fabs(z));
        }
    }
    absmax = quant_block_max(absmax, scratch);
    compute_t s;
    if (dynamic) {
        if (has_scale) absmax = c_fmin(absmax, (compute_t)*scale);
        compute_t max_finite = format == 0 ? 448.0f : 57344.0f;
        s = c_fmax(c_div(absmax, max_finite), c_div(compute_t(1), max_finite * 512));
        if (threadIdx.x == 0) scales[row] = s;
    } else {
        s = *scale;
    }

    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
        compute_t a = to_c(x_row[j]);
        if (has_residual) {
            a = c_add(a, to_c(r_row[j]));
            out_row[j] = from_c(a);
        }
        compute_t z = round_elem(c_mul(a, rstd));
        if (has_weight) z = round_elem(c_mul(z, to_c(w[j])));
        q_row[j] = to_fp8(c_div(z, s), format);
    }
}
