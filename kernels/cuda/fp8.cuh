// The f32 -> fp8 conversions of the `cuda` kernels, compiled before the quantization kernels
// (`quant.cu`, `norm_quant.cu`) and the strided conversions (`strided_convert.cu`). No headers
// (NVRTC). `fp8_e4m3` and `fp8_e5m2` are what the kernels call: on sm_89 and later the hardware's
// `cvt.rn.satfinite` (one instruction, where the software form is about fifty), elsewhere
// `fp8_from_f32`, the software form with its bits. Both give NaN as the canonical 0x7f (the
// hardware keeps an e5m2 NaN's sign and top payload bit, so the hardware path tests for NaN first).

// f32 -> fp8 with `m_bits` mantissa bits and exponent bias `bias`: NaN becomes the canonical NaN 0x7f,
// magnitudes clamp to `max_finite` (saturation, infinities included), then round to nearest-even
// on the format's grid, exactly in f32 (the grid step is a power of two), and encode the fields.
__device__ __forceinline__ unsigned char fp8_from_f32(float f, int m_bits, int bias, float max_finite) {
    unsigned int bits = __float_as_uint(f);
    unsigned int sign = (bits >> 24) & 0x80u;
    // NaN: one canonical code in both formats (sign clear, all other bits set), whatever the
    // NaN's sign and payload, as every provider writes it and the hardware `cvt` does.
    if (isnan(f)) return (unsigned char)0x7fu;
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


#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FP8_HARDWARE 1
#else
#define FP8_HARDWARE 0
#endif

// f32 -> e5m2 (E5M2) or e4m3. `cvt.rn.satfinite.<format>x2.f32 d, a, b` converts b into d's low
// byte and a into its high one.
template <bool E5M2>
__device__ __forceinline__ unsigned char fp8_convert(float f) {
#if FP8_HARDWARE
    if (isnan(f)) return (unsigned char)0x7fu;
    unsigned short packed;
    if (E5M2) {
        asm("{ cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2; }" : "=h"(packed) : "f"(0.0f), "f"(f));
    } else {
        asm("{ cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2; }" : "=h"(packed) : "f"(0.0f), "f"(f));
    }
    return (unsigned char)packed;
#else
    return E5M2 ? fp8_from_f32(f, 2, 15, 57344.0f) : fp8_from_f32(f, 3, 7, 448.0f);
#endif
}

__device__ __forceinline__ unsigned char fp8_e4m3(float f) { return fp8_convert<false>(f); }
__device__ __forceinline__ unsigned char fp8_e5m2(float f) { return fp8_convert<true>(f); }
