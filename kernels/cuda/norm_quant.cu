// RMS normalization followed by fp8 quantization in one kernel: the ops `rms_norm_static_fp8_quant`,
// `rms_norm_dynamic_per_token_quant` and `fused_add_rms_norm_static_fp8_quant`. Compiled after
// `element.cuh` and `quant.cu` (the conversion and the block maximum), per input dtype.
//
// One block of QUANT_BLOCK threads per row. Pass 1 sums the squares of a = x (+ r) in f32;
// rstd = 1 / sqrt(sum / hidden + eps) (IEEE division and square root). Pass 2 (dynamic only)
// reduces the absmax of the normalized values z. The last pass recomputes z, writes the residual
// output (the rounded sum) and q = fp8(z / s). z = round(round(a * rstd) * w), rounded to the element
// type at each step: the rounding points of the composition `quant(rms_norm(x))`. The residual is
// read in every pass and written only in the last, each element by the thread that read it, so the
// residual output may be the residual's own rows (in place: `residual_out` is `r`, with its stride).

__device__ __forceinline__ float quant_block_sum(float value, float* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = QUANT_BLOCK / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] += scratch[threadIdx.x + width];
        __syncthreads();
    }
    float total = scratch[0];
    __syncthreads();
    return total;
}

extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) CONCAT(norm_quant, KERNEL_SUFFIX)(
    unsigned char* __restrict__ q, float* __restrict__ scales, elem_t* residual_out, const elem_t* x,
    const elem_t* r, const elem_t* __restrict__ w, long long n_rows, int hidden, long long x_row_stride,
    long long r_row_stride, long long out_row_stride, float eps, const float* __restrict__ scale, int has_residual,
    int has_weight,
    int dynamic, int has_scale, int format) {
    __shared__ float scratch[QUANT_BLOCK];
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* x_row = x + row * x_row_stride;
    const elem_t* r_row = r + row * r_row_stride;
    unsigned char* q_row = q + row * (long long)hidden;
    elem_t* out_row = residual_out + row * out_row_stride;

    float squares = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
        float a = to_f32(x_row[j]);
        if (has_residual) a = __fadd_rn(a, to_f32(r_row[j]));
        squares = __fadd_rn(squares, __fmul_rn(a, a));
    }
    float mean_square = __fdiv_rn(quant_block_sum(squares, scratch), (float)hidden);
    float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, eps)));

    float absmax = 0.0f;
    if (dynamic) {
        for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
            float a = to_f32(x_row[j]);
            if (has_residual) a = __fadd_rn(a, to_f32(r_row[j]));
            float z = round_elem(__fmul_rn(a, rstd));
            if (has_weight) z = round_elem(__fmul_rn(z, to_f32(w[j])));
            absmax = fmaxf(absmax, fabsf(z));
        }
    }
    absmax = quant_block_max(absmax, scratch);
    float s;
    if (dynamic) {
        if (has_scale) absmax = fminf(absmax, *scale);
        float max_finite = format == 0 ? 448.0f : 57344.0f;
        s = fmaxf(__fdiv_rn(absmax, max_finite), __fdiv_rn(1.0f, max_finite * 512.0f));
        if (threadIdx.x == 0) scales[row] = s;
    } else {
        s = *scale;
    }

    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
        float a = to_f32(x_row[j]);
        if (has_residual) {
            a = __fadd_rn(a, to_f32(r_row[j]));
            out_row[j] = from_f32(a);
        }
        float z = round_elem(__fmul_rn(a, rstd));
        if (has_weight) z = round_elem(__fmul_rn(z, to_f32(w[j])));
        q_row[j] = to_fp8(__fdiv_rn(z, s), format);
    }
}
