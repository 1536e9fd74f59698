// fp8 quantization of the `cuda` provider: `static_scaled_fp8_quant` and
// `dynamic_per_token_scaled_fp8_quant`. Compiled after `element.cuh` and `fp8.cuh`, per input dtype.
//
// q[row, j] = fp8(x[row, j] / s) with one IEEE division in the compute type (element.cuh: f32, f64
// for f64 elements, whose quotient narrows through f32 rounded to odd) and a saturating
// nearest-even conversion; the dynamic kernel's s = max(min(absmax, ub) / M,
// 1 / (M * 512)), absmax reduced with fmax (NaN skipped); a dynamic scale is stored as f32. `format` 0 = f8e4m3fn (M = 448),
// 1 = f8e5m2 (M = 57344). One block of QUANT_BLOCK threads per row; q is compact rows of `hidden`
// bytes. The conversion is the hardware's `cvt.rn.satfinite` on sm_89 and later, and software
// with the same bits before (fp8.cuh).

#define QUANT_BLOCK 256

__device__ __forceinline__ unsigned char to_fp8(compute_t v, int format) {
    return format == 0 ? fp8_e4m3(narrow_f32(v)) : fp8_e5m2(narrow_f32(v));
}

// The maximum of `value` over the block in a fixed tree order (fmax: NaN skipped); every thread gets it.
__device__ __forceinline__ compute_t quant_block_max(compute_t value, compute_t* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = QUANT_BLOCK / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] = c_fmax(scratch[threadIdx.x], scratch[threadIdx.x + width]);
        __syncthreads();
    }
    compute_t total = scratch[0];
    __syncthreads();
    return total;
}

extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) CONCAT(static_scaled_fp8_quant, KERNEL_SUFFIX)(
    unsigned char* __restrict__ q, const elem_t* __restrict__ x, long long n_rows, int hidden,
    long long x_row_stride, const float* __restrict__ scale, int format) {
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* x_row = x + row * x_row_stride;
    unsigned char* q_row = q + row * (long long)hidden;
    compute_t s = *scale;
    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) q_row[j] = to_fp8(c_div(to_c(x_row[j]), s), format);
}

extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) CONCAT(dynamic_per_token_scaled_fp8_quant, KERNEL_SUFFIX)(
    unsigned char* __restrict__ q, float* __restrict__ scales, const elem_t* __restrict__ x, long long n_rows,
    int hidden, long long x_row_stride, const float* __restrict__ scale_ub, int has_ub, int format) {
    __shared__ compute_t scratch[QUANT_BLOCK];
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* x_row = x + row * x_row_stride;
    unsigned char* q_row = q + row * (long long)hidden;
    compute_t absmax = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) absmax = c_fmax(absmax, c_fabs(to_c(x_row[j])));
    absmax = quant_block_max(absmax, scratch);
    if (has_ub) absmax = c_fmin(absmax, (compute_t)*scale_ub);
    compute_t max_finite = format == 0 ? 448.0f : 57344.0f;
    compute_t s = c_fmax(c_div(absmax, max_finite), c_div(compute_t(1), max_finite * 512));
    if (threadIdx.x == 0) scales[row] = s;
    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) q_row[j] = to_fp8(c_div(to_c(x_row[j]), s), format);
}
