// fp8 quantization of the `cuda` provider: `static_scaled_fp8_quant` and
// `dynamic_per_token_scaled_fp8_quant`. Compiled after `element.cuh`, per input dtype.
//
// q[row, j] = fp8(x[row, j] / s) with one IEEE f32 division (NVRTC's default -prec-div=true) and a
// saturating nearest-even conversion; the dynamic kernel's s = max(min(absmax, ub) / M,
// 1 / (M * 512)), absmax reduced with fmaxf (NaN skipped). `format` 0 = f8e4m3fn (M = 448),
// 1 = f8e5m2 (M = 57344). One block of QUANT_BLOCK threads per row; q is compact rows of `hidden`
// bytes. The conversion is done in software on every architecture (sm_80 has no fp8 `cvt`), with
// the same bits as the hardware's `cvt.rn.satfinite`.

#define QUANT_BLOCK 256

// f32 -> fp8 with `m_bits` mantissa bits and exponent bias `bias`: NaN stays NaN,
// magnitudes clamp to `max_finite` (saturation, infinities included), then round to nearest-even
// on the format's grid, exactly in f32 (the grid step is a power of two), and encode the fields.
__device__ __forceinline__ unsigned char fp8_from_f32(float f, int m_bits, int bias, float max_finite) {
    unsigned int bits = __float_as_uint(f);
    unsigned int sign = (bits >> 24) & 0x80u;
    // NaN: E4M3FN has one NaN code per sign; E5M2 keeps the payload's top two bits.
    if (isnan(f)) return (unsigned char)(sign | (m_bits == 3 ? 0x7fu : 0x7eu | ((bits >> 21) & 3u)));
    float a = fminf(fabsf(f), max_finite);
    int emin = 1 - bias;
    int e = max((int)((__float_as_uint(a) >> 23) & 0xffu) - 127, emin);
    float inv_step = __uint_as_float((unsigned int)(127 - (e - m_bits)) << 23);
    float step = __uint_as_float((unsigned int)(127 + (e - m_bits)) << 23);
    float r = rintf(__fmul_rn(a, inv_step)) * step;
    if (r == 0.0f) return (unsigned char)sign;
    unsigned int rb = __float_as_uint(r);
    int re = (int)((rb >> 23) & 0xffu) - 127;
    unsigned int code;
    if (re >= emin) {
        code = ((unsigned int)(re + bias) << m_bits) | ((rb & 0x7fffffu) >> (23 - m_bits));
    } else {
        code = (unsigned int)(r * __uint_as_float((unsigned int)(127 - (emin - m_bits)) << 23));
    }
    return (unsigned char)(sign | code);
}

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
