// The software f32 -> fp8 conversion of the `cuda` kernels (sm_80 has no fp8 `cvt`), with the bits
// of the hardware's `cvt.rn.satfinite`: compiled before the quantization kernels (`quant.cu`,
// `norm_quant.cu`) and the strided conversions (`strided_convert.cu`). No headers (NVRTC).

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

