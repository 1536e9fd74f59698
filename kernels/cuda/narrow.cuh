// Narrowing a double to a format of at most 22 significand bits (f16, bf16, fp8) with one rounding,
// compiled before `element.cuh` and before the strided conversions (`strided_convert.cu`). No
// headers (NVRTC).

// f32 rounded to odd (truncated, the last bit set when anything was lost): rounding it to nearest
// even in a format of at most 22 significand bits equals rounding the double directly.
__device__ __forceinline__ float f32_round_to_odd(double value) {
    float nearest = __double2float_rn(value);
    if ((double)nearest == value || isinf(nearest) || isnan(value)) return nearest;
    unsigned int bits = __float_as_uint(nearest);
    // Sign-magnitude: decrementing the bits of a non-zero float moves it one step toward zero.
    unsigned int truncated = fabs((double)nearest) > fabs(value) ? bits - 1u : bits;
    return __uint_as_float(truncated | 1u);
}
