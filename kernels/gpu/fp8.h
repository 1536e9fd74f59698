// The f32 -> fp8 conversions of the kernels CUDA and HIP share (`kernels/gpu`), compiled after the
// backend's portability header and before the quantization kernels (`quant.h`, `norm_quant.h`) and
// the strided conversions. `fp8_e4m3` and `fp8_e5m2` are what the kernels call: where the
// portability header has the hardware's conversion (`GPU_FP8_HARDWARE`: CUDA on sm_89 and later,
// `cvt.rn.satfinite`, one instruction where the software form is about fifty) that, elsewhere
// `fp8_from_f32`, the software form with its bits. Both give NaN as the canonical 0x7f.

#ifndef VLLM_IR_GPU_FP8_H
#define VLLM_IR_GPU_FP8_H

// f32 -> fp8 with `m_bits` mantissa bits and exponent bias `bias`: NaN becomes the canonical NaN 0x7f,
// magnitudes clamp to `max_finite` (saturation, infinities included), then round to nearest-even
// on the format's grid, exactly in f32 (the grid step is a power of two), and encode the fields.
__device__ __forceinline__ unsigned char fp8_from_f32(float f, int m_bits, int bias, float max_finite) {
    unsigned int bits = __float_as_uint(f);
    unsigned int sign = (bits >> 24) & 0x80u;
    // NaN: one canonical code in both formats (sign clear, all other bits set), whatever the
    // NaN's sign and payload, as every provider writes it and the hardware `cvt` does.
    if (gpu_isnan(f)) return (unsigned char)0x7fu;
    float a = fminf(fabsf(f), max_finite);
    int emin = 1 - bias;
    int e = max((int)((__float_as_uint(a) >> 23) & 0xffu) - 127, emin);
    float inv_step = __uint_as_float((unsigned int)(127 - (e - m_bits)) << 23);
    float step = __uint_as_float((unsigned int)(127 + (e - m_bits)) << 23);
    float r = rintf(c_mul(a, inv_step)) * step;
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

// f32 -> e5m2 (E5M2) or e4m3. The hardware keeps an e5m2 NaN's sign and top payload bit, so the
// hardware path maps NaN first, as the software does.
template <bool E5M2>
__device__ __forceinline__ unsigned char fp8_convert(float f) {
#if GPU_FP8_HARDWARE
    if (gpu_isnan(f)) return (unsigned char)0x7fu;
    return fp8_hardware<E5M2>(f);
#else
    return E5M2 ? fp8_from_f32(f, 2, 15, 57344.0f) : fp8_from_f32(f, 3, 7, 448.0f);
#endif
}

__device__ __forceinline__ unsigned char fp8_e4m3(float f) { return fp8_convert<false>(f); }
__device__ __forceinline__ unsigned char fp8_e5m2(float f) { return fp8_convert<true>(f); }

#endif  // VLLM_IR_GPU_FP8_H
