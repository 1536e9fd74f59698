// Strided conversion on the device: the elements a source layout describes, into a destination
// layout of the same shape, converted from the source dtype to the destination's, one thread per
// element in row-major order: `copy_` between two dtypes, and `scale` (`scaled` != 0) as
// `round_dst(round_f32(v * factor))`, the factor already rounded to f32 by the host. Every source
// value is exact in f32, so each result is rounded once (to nearest even), as the host's
// conversion through f64 rounds it. `strided_convert_<src>_<dst>` for sources f32, f16, bf16,
// f8e4m3fn, f8e5m2 and destinations f32, f16, bf16. Compiled after `strided_copy.cu`, whose `Dims8`
// and indexing it uses; the storage offsets are applied to the pointers by the host. No headers
// (NVRTC).

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

#define STRIDED_CONVERT(SRC, S, DST, D)                                                                       \
    extern "C" __global__ void strided_convert_##SRC##_##DST(const S* __restrict__ src, D* __restrict__ dst,  \
                                                            long long n, Dims8 shape, Dims8 src_strides,      \
                                                            Dims8 dst_strides, float factor, int scaled) {    \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        if (i >= n) return;                                                                                   \
        long long s, d;                                                                                       \
        strided_offsets(i, shape, src_strides, dst_strides, s, d);                                            \
        float v = load_##SRC(src, s);                                                                         \
        if (scaled) v = v * factor;                                                                           \
        store_##DST(dst, d, v);                                                                               \
    }

#define TO_EVERY_TARGET(SRC, S)                      \
    STRIDED_CONVERT(SRC, S, f32, float)              \
    STRIDED_CONVERT(SRC, S, f16, unsigned short)     \
    STRIDED_CONVERT(SRC, S, bf16, unsigned short)

TO_EVERY_TARGET(f32, float)
TO_EVERY_TARGET(f16, unsigned short)
TO_EVERY_TARGET(bf16, unsigned short)
TO_EVERY_TARGET(f8e4m3fn, unsigned char)
TO_EVERY_TARGET(f8e5m2, unsigned char)

// `add` and `mul` of two strided tensors of one dtype into a compact destination
// (`strided_<op>_<dtype>`): computed in f32 (exact for f16 and bf16 operands) and rounded once
// to the dtype, as the host computes it. The product and the sum are each a lone operation (no
// fused multiply-add to contract).
#define STRIDED_BINARY(OP, EXPR, NAME, T)                                                                     \
    extern "C" __global__ void strided_##OP##_##NAME(const T* __restrict__ a, const T* __restrict__ b,        \
                                                    T* __restrict__ dst, long long n, Dims8 shape,           \
                                                    Dims8 a_strides, Dims8 b_strides) {                      \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                       \
        if (i >= n) return;                                                                                   \
        long long s, t;                                                                                       \
        strided_offsets(i, shape, a_strides, b_strides, s, t);                                                \
        float x = load_##NAME(a, s);                                                                          \
        float y = load_##NAME(b, t);                                                                          \
        store_##NAME(dst, i, EXPR);                                                                           \
    }

STRIDED_BINARY(add, __fadd_rn(x, y), f32, float)
STRIDED_BINARY(add, __fadd_rn(x, y), f16, unsigned short)
STRIDED_BINARY(add, __fadd_rn(x, y), bf16, unsigned short)
STRIDED_BINARY(mul, __fmul_rn(x, y), f32, float)
STRIDED_BINARY(mul, __fmul_rn(x, y), f16, unsigned short)
STRIDED_BINARY(mul, __fmul_rn(x, y), bf16, unsigned short)
