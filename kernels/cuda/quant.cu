// fp8 quantization of the `cuda` provider: `static_scaled_fp8_quant` and
// `dynamic_per_token_scaled_fp8_quant`. Compiled after `element.cuh` and `fp8.cuh`, per input dtype.
//
// q[row, j] = fp8(x[row, j] / s) with one IEEE f32 division (NVRTC's default -prec-div=true) and a
// saturating nearest-even conversion; the dynamic kernel's s = max(min(absmax, ub) / M,
// 1 / (M * 512)), absmax reduced with fmaxf (NaN skipped). `format` 0 = f8e4m3fn (M = 448),
// 1 = f8e5m2 (M = 57344). One block of QUANT_BLOCK threads per row; q is compact rows of `hidden`
// bytes. The conversion is done in software on every architecture (sm_80 has no fp8 `cvt`), with
// the same bits as the hardware's `cvt.rn.satfinite`.

#define QUANT_BLOCK 256

__device__ __forceinline__ unsigned char to_fp8(float v, int format) {
    return format == 0 ? fp8_from_f32(v, 3, 7, 448.0f) : fp8_from_f32(v, 2, 15, 57344.0f);
}

// The maximum of `value` over the block in a fixed tree order (fmaxf: NaN skipped); every thread gets it.
__device__ __forceinline__ float quant_block_max(float value, float* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = QUANT_BLOCK / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + width]);
        __syncthreads();
    }
    float total = scratch[0];
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
    float s = *scale;
    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) q_row[j] = to_fp8(__fdiv_rn(to_f32(x_row[j]), s), format);
}

extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) CONCAT(dynamic_per_token_scaled_fp8_quant, KERNEL_SUFFIX)(
    unsigned char* __restrict__ q, float* __restrict__ scales, const elem_t* __restrict__ x, long long n_rows,
    int hidden, long long x_row_stride, const float* __restrict__ scale_ub, int has_ub, int format) {
    __shared__ float scratch[QUANT_BLOCK];
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* x_row = x + row * x_row_stride;
    unsigned char* q_row = q + row * (long long)hidden;
    float absmax = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) absmax = fmaxf(absmax, fabsf(to_f32(x_row[j])));
    absmax = quant_block_max(absmax, scratch);
    if (has_ub) absmax = fminf(absmax, *scale_ub);
    float max_finite = format == 0 ? 448.0f : 57344.0f;
    float s = fmaxf(__fdiv_rn(absmax, max_finite), __fdiv_rn(1.0f, max_finite * 512.0f));
    if (threadIdx.x == 0) scales[row] = s;
    for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) q_row[j] = to_fp8(__fdiv_rn(to_f32(x_row[j]), s), format);
}
