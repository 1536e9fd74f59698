// Strided conversion on the device: the elements a source layout describes, into a destination
// layout of the same shape, converted from the source dtype to the destination's, one thread per
// element in row-major order: `copy_` between two dtypes, and `scale` (`scaled` != 0, same dtype)
// as `round_dst(round_c(v * factor))`, c the source's compute dtype, the factor already rounded to
// it by the host. `strided_convert_<src>_<dst>` for every pair of f32, f16, bf16, f8e4m3fn,
// f8e5m2, i8, f64 and i64, with the host's bits (it converts through f64 and rounds once):
// sources f32, f16, bf16, fp8 and i8 are exact in f32 and compute in it, so each result is rounded
// once (to nearest even); f64 and i64 sources compute in f64 (an i64 read rounded to f64 as the
// host reads it, and `scale` of i64 rounds its f64 product to f32, i64's compute dtype); a double
// narrows to f16, bf16 or fp8 through f32 rounded to odd, which then rounds to nearest even with
// the bits of a direct rounding. Into an integer: nearest even, saturated, NaN 0. Compiled after
// `strided_copy.cu`, whose `Dims8` and indexing it uses, `narrow.cuh` (f32 rounded to odd) and
// `fp8.cuh`; the storage offsets are applied to the pointers by the host. No headers (NVRTC).

__device__ __forceinline__ float load_f32(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float half_bits_to_f32(unsigned short v) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ float load_f16(const unsigned short* p, long long i) { return half_bits_to_f32(p[i]); }
__device__ __forceinline__ float load_bf16(const unsigned short* p, long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
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
    return half_bits_to_f32((unsigned short)(((unsigned short)p[i]) << 8));
}

__device__ __forceinline__ float load_i8(const signed char* p, long long i) { return (float)p[i]; }
__device__ __forceinline__ double load_f64(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ double load_i64(const long long* p, long long i) { return __ll2double_rn(p[i]); }

__device__ __forceinline__ void store_f32(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f16(unsigned short* p, long long i, float v) {
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v));
    p[i] = h;
}
__device__ __forceinline__ void store_bf16(unsigned short* p, long long i, float v) {
    unsigned int bits = __float_as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        p[i] = (unsigned short)((bits >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
        return;
    }
    p[i] = (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // nearest-even
}

__device__ __forceinline__ void store_f32(float* p, long long i, double v) { p[i] = __double2float_rn(v); }
__device__ __forceinline__ void store_f16(unsigned short* p, long long i, double v) { store_f16(p, i, f32_round_to_odd(v)); }
__device__ __forceinline__ void store_bf16(unsigned short* p, long long i, double v) { store_bf16(p, i, f32_round_to_odd(v)); }
__device__ __forceinline__ void store_f8e4m3fn(unsigned char* p, long long i, float v) { p[i] = fp8_e4m3(v); }
__device__ __forceinline__ void store_f8e4m3fn(unsigned char* p, long long i, double v) {
    store_f8e4m3fn(p, i, f32_round_to_odd(v));
}
__device__ __forceinline__ void store_f8e5m2(unsigned char* p, long long i, float v) { p[i] = fp8_e5m2(v); }
__device__ __forceinline__ void store_f8e5m2(unsigned char* p, long long i, double v) {
    store_f8e5m2(p, i, f32_round_to_odd(v));
}
__device__ __forceinline__ void store_f64(double* p, long long i, float v) { p[i] = (double)v; }
__device__ __forceinline__ void store_f64(double* p, long long i, double v) { p[i] = v; }
__device__ __forceinline__ void store_i8(signed char* p, long long i, float v) {
    float r = rintf(v);
    p[i] = isnan(v) ? 0 : r <= -128.0f ? -128 : r >= 127.0f ? 127 : (signed char)r;
}
__device__ __forceinline__ void store_i8(signed char* p, long long i, double v) {
    double r = rint(v);
    p[i] = isnan(v) ? 0 : r <= -128.0 ? -128 : r >= 127.0 ? 127 : (signed char)r;
}
// 2^63 is exact in f32 and f64: every r below it in magnitude converts without overflow.
#define I64_MIN ((long long)0x8000000000000000ULL)
#define I64_MAX ((long long)0x7fffffffffffffffULL)
__device__ __forceinline__ void store_i64(long long* p, long long i, float v) {
    float r = rintf(v);
    p[i] = isnan(v) ? 0 : r < -9223372036854775808.0f ? I64_MIN : r >= 9223372036854775808.0f ? I64_MAX : (long long)r;
}
__device__ __forceinline__ void store_i64(long long* p, long long i, double v) {
    double r = rint(v);
    p[i] = isnan(v) ? 0 : r < -9223372036854775808.0 ? I64_MIN : r >= 9223372036854775808.0 ? I64_MAX : (long long)r;
}

// Arithmetic in the compute dtype, each a lone rounded operation (no fused multiply-add to contract),
// and the rounding of i64's f64 results to f32, its compute dtype.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float round_c_f32(float v) { return v; }
__device__ __forceinline__ float round_c_f16(float v) { return v; }
__device__ __forceinline__ float round_c_bf16(float v) { return v; }
__device__ __forceinline__ float round_c_f8e4m3fn(float v) { return v; }
__device__ __forceinline__ float round_c_f8e5m2(float v) { return v; }
__device__ __forceinline__ float round_c_i8(float v) { return v; }
__device__ __forceinline__ double round_c_f64(double v) { return v; }
__device__ __forceinline__ double round_c_i64(double v) { return (double)__double2float_rn(v); }

// C is the source's compute type: `factor` is passed in it (for i64, the f32 factor widened).
#define STRIDED_CONVERT(SRC, S, C, DST, D)                                                                    \
    extern "C" __global__ void strided_convert_##SRC##_##DST(const S* __restrict__ src, D* __restrict__ dst,  \
                                                            long long n, int rank, Dims8 shape, Dims8 src_strides, \
                                                            Dims8 dst_strides, C factor, int scaled) {        \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        if (i >= n) return;                                                                                   \
        long long s, d;                                                                                       \
        bool narrow = fits_31_bits(n, rank, shape, src_strides, dst_strides);                                  \
        strided_offsets(narrow, i, rank, shape, src_strides, dst_strides, s, d);                              \
        C v = load_##SRC(src, s);                                                                             \
        if (scaled) v = round_c_##SRC(mul_rn(v, factor));                                                    \
        store_##DST(dst, d, v);                                                                               \
    }

#define TO_EVERY_TARGET(SRC, S, C)                     \
    STRIDED_CONVERT(SRC, S, C, f32, float)             \
    STRIDED_CONVERT(SRC, S, C, f16, unsigned short)    \
    STRIDED_CONVERT(SRC, S, C, bf16, unsigned short)   \
    STRIDED_CONVERT(SRC, S, C, f8e4m3fn, unsigned char) \
    STRIDED_CONVERT(SRC, S, C, f8e5m2, unsigned char)  \
    STRIDED_CONVERT(SRC, S, C, i8, signed char)        \
    STRIDED_CONVERT(SRC, S, C, f64, double)            \
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
// i64 the f64 result rounded to f32 (its compute dtype).
#define STRIDED_BINARY(OP, NAME, T, C)                                                                        \
    extern "C" __global__ void strided_##OP##_##NAME(const T* __restrict__ a, const T* __restrict__ b,        \
                                                    T* __restrict__ dst, long long n, int rank, Dims8 shape, \
                                                    Dims8 a_strides, Dims8 b_strides) {                      \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        if (i >= n) return;                                                                                   \
        long long s, t;                                                                                       \
        bool narrow = fits_31_bits(n, rank, shape, a_strides, b_strides);                                      \
        strided_offsets(narrow, i, rank, shape, a_strides, b_strides, s, t);                                  \
        C x = load_##NAME(a, s);                                                                              \
        C y = load_##NAME(b, t);                                                                              \
        store_##NAME(dst, i, round_c_##NAME(OP##_rn(x, y)));                                                  \
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
