// Strided conversion and `add`/`mul` on the device, shared by CUDA and HIP: the elements a source
// layout describes, into a destination layout of the same shape, converted from the source dtype
// to the destination's, one thread per element in row-major order (`GPU_ELEMENTS`): `copy_`
// between two dtypes, and `scale` (`scaled` != 0, same dtype) as `round_dst(round_c(v * factor))`,
// c the source's compute dtype, the factor already rounded to it by the host.
// `strided_convert_<src>_<dst>` for every pair of f32, f16, bf16, f8e4m3fn, f8e5m2, i8, f64 and
// i64, with the host's bits (it converts through f64 and rounds once): sources f32, f16, bf16, fp8
// and i8 are exact in f32 and compute in it, so each result is rounded once (to nearest even); f64
// and i64 sources compute in f64 (an i64 read rounded to f64 as the host reads it, and `scale` of
// i64 rounds its f64 product to f32, i64's compute dtype); a double narrows to f16, bf16 or fp8
// through f32 rounded to odd, which then rounds to nearest even with the bits of a direct
// rounding. Into an integer: nearest even, saturated, NaN 0. fp8 stores use the quantizations'
// conversion (`fp8.h`). Compiled after the portability header, `fp8.h` and `strided_copy.h`, whose
// indexing it uses; the storage offsets are applied to the pointers by the host.

#ifndef VLLM_IR_GPU_STRIDED_CONVERT_H
#define VLLM_IR_GPU_STRIDED_CONVERT_H

// Source loads by dtype name, into the source's compute type.
__device__ __forceinline__ float load_f32(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_f16(const unsigned short* p, long long i) { return f16_bits_to_f32(p[i]); }
__device__ __forceinline__ float load_bf16(const unsigned short* p, long long i) { return bf16_bits_to_f32(p[i]); }
// f8e4m3fn: no infinities, S.1111.111 is NaN; subnormals are m * 2^-9.
__device__ __forceinline__ float load_f8e4m3fn(const unsigned char* p, long long i) {
    unsigned int bits = p[i];
    unsigned int sign = (bits & 0x80u) << 24;
    unsigned int exponent = (bits >> 3) & 0xfu;
    unsigned int mantissa = bits & 0x7u;
    if (exponent == 0xfu && mantissa == 0x7u) return __uint_as_float(sign | 0x7fc00000u);
    if (exponent == 0u) return __uint_as_float(sign | __float_as_uint((float)mantissa * 0.001953125f));
    return __uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}
// f8e5m2 is the top byte of an f16.
__device__ __forceinline__ float load_f8e5m2(const unsigned char* p, long long i) {
    return f16_bits_to_f32((unsigned short)(((unsigned short)p[i]) << 8));
}
__device__ __forceinline__ float load_i8(const signed char* p, long long i) { return (float)p[i]; }
__device__ __forceinline__ double load_f64(const double* p, long long i) { return p[i]; }
// Rounded to nearest, as the host reads an i64.
__device__ __forceinline__ double load_i64(const long long* p, long long i) { return (double)p[i]; }

// Destination stores by dtype name, from the f32 or the f64 compute type (a double narrows once).
__device__ __forceinline__ void store_f32(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(float* p, long long i, double v) { p[i] = (float)v; }
__device__ __forceinline__ void store_f16(unsigned short* p, long long i, float v) { p[i] = f32_to_f16_bits(v); }
__device__ __forceinline__ void store_f16(unsigned short* p, long long i, double v) {
    p[i] = f32_to_f16_bits(f32_round_to_odd(v));
}
__device__ __forceinline__ void store_bf16(unsigned short* p, long long i, float v) { p[i] = f32_to_bf16_bits(v); }
__device__ __forceinline__ void store_bf16(unsigned short* p, long long i, double v) {
    p[i] = f32_to_bf16_bits(f32_round_to_odd(v));
}
__device__ __forceinline__ void store_f8e4m3fn(unsigned char* p, long long i, float v) { p[i] = fp8_e4m3(v); }
__device__ __forceinline__ void store_f8e4m3fn(unsigned char* p, long long i, double v) {
    p[i] = fp8_e4m3(f32_round_to_odd(v));
}
__device__ __forceinline__ void store_f8e5m2(unsigned char* p, long long i, float v) { p[i] = fp8_e5m2(v); }
__device__ __forceinline__ void store_f8e5m2(unsigned char* p, long long i, double v) {
    p[i] = fp8_e5m2(f32_round_to_odd(v));
}
__device__ __forceinline__ void store_f64(double* p, long long i, float v) { p[i] = (double)v; }
__device__ __forceinline__ void store_f64(double* p, long long i, double v) { p[i] = v; }

// Nearest even, in the compute type.
__device__ __forceinline__ float round_even(float v) { return rintf(v); }
__device__ __forceinline__ double round_even(double v) { return rint(v); }

template <class C>
__device__ __forceinline__ void store_i8(signed char* p, long long i, C v) {
    C r = round_even(v);
    p[i] = isnan(v) ? 0 : r <= (C)-128 ? -128 : r >= (C)127 ? 127 : (signed char)r;
}
// 2^63 is exact in f32 and f64: every r below it in magnitude converts without overflow.
template <class C>
__device__ __forceinline__ void store_i64(long long* p, long long i, C v) {
    C r = round_even(v);
    const C limit = (C)9223372036854775808.0;
    p[i] = isnan(v) ? 0 : r < -limit ? (long long)0x8000000000000000ULL : r >= limit ? 0x7fffffffffffffffLL : (long long)r;
}

// The rounding of a result to the source's compute dtype: f32 and f64 results are already in it;
// i64's f64 results round to f32, its compute dtype.
__device__ __forceinline__ float round_c_f32(float v) { return v; }
__device__ __forceinline__ float round_c_f16(float v) { return v; }
__device__ __forceinline__ float round_c_bf16(float v) { return v; }
__device__ __forceinline__ float round_c_f8e4m3fn(float v) { return v; }
__device__ __forceinline__ float round_c_f8e5m2(float v) { return v; }
__device__ __forceinline__ float round_c_i8(float v) { return v; }
__device__ __forceinline__ double round_c_f64(double v) { return v; }
__device__ __forceinline__ double round_c_i64(double v) { return (double)(float)v; }

// C is the source's compute type: `factor` is passed in it (for i64, the f32 factor widened). The
// product is a lone rounded operation (`c_mul`).
#define STRIDED_CONVERT(SRC, S, C, DST, D)                                                                      \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                    \
        strided_convert_##SRC##_##DST(const S* __restrict__ src, D* __restrict__ dst, long long n, int rank,    \
                                      Dims8 shape, Dims8 src_strides, Dims8 dst_strides, C factor, int scaled) { \
        const bool narrow = fits_31_bits(n, rank, shape, src_strides, dst_strides);                             \
        GPU_ELEMENTS(i, n) {                                                                                    \
            long long s, d;                                                                                     \
            strided_offsets(narrow, i, rank, shape, src_strides, dst_strides, s, d);                            \
            C v = load_##SRC(src, s);                                                                           \
            if (scaled) v = round_c_##SRC(c_mul(v, factor));                                                    \
            store_##DST(dst, d, v);                                                                             \
        }                                                                                                       \
    }

#define TO_EVERY_TARGET(SRC, S, C)                      \
    STRIDED_CONVERT(SRC, S, C, f32, float)              \
    STRIDED_CONVERT(SRC, S, C, f16, unsigned short)     \
    STRIDED_CONVERT(SRC, S, C, bf16, unsigned short)    \
    STRIDED_CONVERT(SRC, S, C, f8e4m3fn, unsigned char) \
    STRIDED_CONVERT(SRC, S, C, f8e5m2, unsigned char)   \
    STRIDED_CONVERT(SRC, S, C, i8, signed char)         \
    STRIDED_CONVERT(SRC, S, C, f64, double)             \
    STRIDED_CONVERT(SRC, S, C, i64, long long)

TO_EVERY_TARGET(f32, float, float)
TO_EVERY_TARGET(f16, unsigned short, float)
TO_EVERY_TARGET(bf16, unsigned short, float)
TO_EVERY_TARGET(f8e4m3fn, unsigned char, float)
TO_EVERY_TARGET(f8e5m2, unsigned char, float)
TO_EVERY_TARGET(i8, signed char, float)
TO_EVERY_TARGET(f64, double, double)
TO_EVERY_TARGET(i64, long long, double)

// `add` and `mul` of two strided tensors of one dtype into a compact destination
// (`strided_<op>_<dtype>`): computed in the compute dtype and rounded once to the dtype, as the
// host computes it: f32 for every dtype but f64 (exact operands, one rounding), f64 for f64, and for
// i64 the f64 result rounded to f32 (its compute dtype). Each a lone rounded operation (`c_add`,
// `c_mul`).
#define STRIDED_BINARY(OP, NAME, T, C)                                                                          \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                    \
        strided_##OP##_##NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ dst, long long n, \
                              int rank, Dims8 shape, Dims8 a_strides, Dims8 b_strides) {                        \
        const bool narrow = fits_31_bits(n, rank, shape, a_strides, b_strides);                                 \
        GPU_ELEMENTS(i, n) {                                                                                    \
            long long s, t;                                                                                     \
            strided_offsets(narrow, i, rank, shape, a_strides, b_strides, s, t);                                \
            C x = load_##NAME(a, s);                                                                            \
            C y = load_##NAME(b, t);                                                                            \
            store_##NAME(dst, i, round_c_##NAME(c_##OP(x, y)));                                                 \
        }                                                                                                       \
    }

#define ADD_AND_MUL(NAME, T, C)       \
    STRIDED_BINARY(add, NAME, T, C)   \
    STRIDED_BINARY(mul, NAME, T, C)

ADD_AND_MUL(f32, float, float)
ADD_AND_MUL(f16, unsigned short, float)
ADD_AND_MUL(bf16, unsigned short, float)
ADD_AND_MUL(f8e4m3fn, unsigned char, float)
ADD_AND_MUL(f8e5m2, unsigned char, float)
ADD_AND_MUL(i8, signed char, float)
ADD_AND_MUL(f64, double, double)
ADD_AND_MUL(i64, long long, double)

#endif  // VLLM_IR_GPU_STRIDED_CONVERT_H
