// Strided copy on the device (`clone` and `contiguous` of rocm tensors), as the CUDA kernel does it
// (`kernels/cuda/strided_copy.cu`): one thread per element in row-major order (a grid-stride loop:
// the host caps the grid at HIP's 2^32 work-items, so a thread may take several), each element moved as
// an unsigned integer of its size (every dtype bit for bit), shape and strides padded to eight
// dimensions (extent 1, stride 0) so the loop unrolls with constant indices (no scratch); the
// storage offsets are applied to the pointers by the host.
//
// In the same source (one `Dims8` in the unit of every kernel): the strided conversion (`copy_`
// between dtypes and `scale` of rocm tensors), as `kernels/cuda/strided_convert.cu` does it, for
// every pair of dtypes: `strided_convert_<src>_<dst>` writes `round_dst(v)`, or with `scaled` != 0
// `round_dst(round_c(v * factor))`, c the source's compute dtype, the factor already rounded to it
// by the host. Sources exact in f32 compute in it, each result rounded once (to nearest even); f64
// and i64 sources compute in f64 and narrow to f16, bf16 or fp8 through f32 rounded to odd; into
// an integer: nearest even, saturated, NaN 0. The host's bits in every case.

#include <hip/hip_runtime.h>

#include "element.hip.h"
#include "gpu/fp8.h"

#define COPY_BLOCK 256

struct Dims8 {
    long long v[8];
};

// The storage offsets of element i (row-major) in the source and the destination layouts, in
// index type I. Only the first `rank` dimensions divide (those past it are padding); the unrolled
// loop keeps constant indices either way.
template <typename I>
__device__ __forceinline__ void offsets_in(I i, int rank, const Dims8& shape, const Dims8& src_strides,
                                           const Dims8& dst_strides, long long& s, long long& d) {
    I rest = i, src = 0, dst = 0;
#pragma unroll
    for (int k = 7; k >= 0; --k) {
        if (k >= rank) continue;
        I extent = (I)shape.v[k];
        I index = rest % extent;
        rest /= extent;
        src += index * (I)src_strides.v[k];
        dst += index * (I)dst_strides.v[k];
    }
    s = (long long)src;
    d = (long long)dst;
}

// Whether every element index below n and every offset of both layouts (extents at least 1,
// strides not negative) fits 31 bits, so the offsets are computed with 32-bit divisions, a
// fraction of the instructions of 64-bit ones. The same for every thread of a launch.
__device__ __forceinline__ bool fits_31_bits(long long n, int rank, const Dims8& shape, const Dims8& src_strides,
                                             const Dims8& dst_strides) {
    long long src = 0, dst = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k >= rank) continue;
        src += (shape.v[k] - 1) * src_strides.v[k];
        dst += (shape.v[k] - 1) * dst_strides.v[k];
    }
    return n <= 0x7fffffffLL && src <= 0x7fffffffLL && dst <= 0x7fffffffLL;
}

// The storage offsets of element i, in 32-bit arithmetic where `narrow` (fits_31_bits) says it is
// exact, else in 64-bit.
__device__ __forceinline__ void strided_offsets(bool narrow, long long i, int rank, const Dims8& shape,
                                                const Dims8& src_strides, const Dims8& dst_strides, long long& s,
                                                long long& d) {
    if (narrow) {
        offsets_in<unsigned int>((unsigned int)i, rank, shape, src_strides, dst_strides, s, d);
    } else {
        offsets_in<long long>(i, rank, shape, src_strides, dst_strides, s, d);
    }
}

template <typename T>
__device__ __forceinline__ void strided_copy(const T* __restrict__ src, T* __restrict__ dst, long long n, int rank,
                                             Dims8 shape, Dims8 src_strides, Dims8 dst_strides) {
    const bool narrow = fits_31_bits(n, rank, shape, src_strides, dst_strides);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long s, d;
        strided_offsets(narrow, i, rank, shape, src_strides, dst_strides, s, d);
        dst[d] = src[s];
    }
}

#define STRIDED_COPY(bytes, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                     \
        strided_copy_##bytes(const T* src, T* dst, long long n, int rank, Dims8 shape, Dims8 src_strides,          \
                             Dims8 dst_strides) {                                                                \
        strided_copy<T>(src, dst, n, rank, shape, src_strides, dst_strides);                                     \
    }

STRIDED_COPY(1, unsigned char)
STRIDED_COPY(2, unsigned short)
STRIDED_COPY(4, unsigned int)
STRIDED_COPY(8, unsigned long long)
// The wide copy: 16-byte units of rows contiguous on both sides (`CopyDims::widened` on the host),
// one 16-byte load and store each.
STRIDED_COPY(16, Words)

// Source loads by dtype name: the compute dtypes through `Elem`, the fp8 formats decoded here.
__device__ __forceinline__ float convert_load_f32(const float* p, long long i) { return Elem<0>::load(p[i]); }
__device__ __forceinline__ float convert_load_f16(const unsigned short* p, long long i) { return Elem<1>::load(p[i]); }
__device__ __forceinline__ float convert_load_bf16(const unsigned short* p, long long i) { return Elem<2>::load(p[i]); }
// f8e4m3fn: no infinities, S.1111.111 is NaN; subnormals are m * 2^-9.
__device__ __forceinline__ float convert_load_f8e4m3fn(const unsigned char* p, long long i) {
    unsigned int bits = p[i];
    unsigned int sign = (bits & 0x80u) << 24;
    unsigned int exponent = (bits >> 3) & 0xfu;
    unsigned int mantissa = bits & 0x7u;
    if (exponent == 0xfu && mantissa == 0x7u) return __uint_as_float(sign | 0x7fc00000u);
    if (exponent == 0u) return __uint_as_float(sign | __float_as_uint((float)mantissa * 0.001953125f));
    return __uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}
// f8e5m2 is the top byte of an f16.
__device__ __forceinline__ float convert_load_f8e5m2(const unsigned char* p, long long i) {
    return Elem<1>::load((unsigned short)(((unsigned short)p[i]) << 8));
}

__device__ __forceinline__ float convert_load_i8(const signed char* p, long long i) { return (float)p[i]; }
__device__ __forceinline__ double convert_load_f64(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ double convert_load_i64(const long long* p, long long i) { return (double)p[i]; }

// f32_round_to_odd (a double narrowed with one rounding) is in element.hip.h.

// Destination stores by dtype name, from the f32 or the f64 compute type.
__device__ __forceinline__ void convert_store_f32(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void convert_store_f32(float* p, long long i, double v) { p[i] = (float)v; }
__device__ __forceinline__ void convert_store_f16(unsigned short* p, long long i, float v) { p[i] = Elem<1>::store(v); }
__device__ __forceinline__ void convert_store_f16(unsigned short* p, long long i, double v) {
    p[i] = Elem<1>::store(f32_round_to_odd(v));
}
__device__ __forceinline__ void convert_store_bf16(unsigned short* p, long long i, float v) { p[i] = Elem<2>::store(v); }
__device__ __forceinline__ void convert_store_bf16(unsigned short* p, long long i, double v) {
    p[i] = Elem<2>::store(f32_round_to_odd(v));
}
__device__ __forceinline__ void convert_store_f8e4m3fn(unsigned char* p, long long i, float v) {
    p[i] = fp8_from_f32(v, 3, 7, 448.0f);
}
__device__ __forceinline__ void convert_store_f8e4m3fn(unsigned char* p, long long i, double v) {
    p[i] = fp8_from_f32(f32_round_to_odd(v), 3, 7, 448.0f);
}
__device__ __forceinline__ void convert_store_f8e5m2(unsigned char* p, long long i, float v) {
    p[i] = fp8_from_f32(v, 2, 15, 57344.0f);
}
__device__ __forceinline__ void convert_store_f8e5m2(unsigned char* p, long long i, double v) {
    p[i] = fp8_from_f32(f32_round_to_odd(v), 2, 15, 57344.0f);
}
__device__ __forceinline__ void convert_store_f64(double* p, long long i, float v) { p[i] = (double)v; }
__device__ __forceinline__ void convert_store_f64(double* p, long long i, double v) { p[i] = v; }
template <class C>
__device__ __forceinline__ void convert_store_i8(signed char* p, long long i, C v) {
    C r = rint(v);
    p[i] = isnan(v) ? 0 : r <= (C)-128 ? -128 : r >= (C)127 ? 127 : (signed char)r;
}
// 2^63 is exact in f32 and f64: every r below it in magnitude converts without overflow.
template <class C>
__device__ __forceinline__ void convert_store_i64(long long* p, long long i, C v) {
    C r = rint(v);
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

// C is the source's compute type: `factor` is passed in it (for i64, the f32 factor widened). Each
// product a lone operation (contraction off regardless).
#define STRIDED_CONVERT(SRC, S, C, DST, D)                                                                      \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                    \
        strided_convert_##SRC##_##DST(const S* __restrict__ src, D* __restrict__ dst, long long n, int rank,    \
                                      Dims8 shape,                                                              \
                                      Dims8 src_strides, Dims8 dst_strides, C factor, int scaled) {             \
        _Pragma("clang fp contract(off)") for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  \
                                               i < n; i += (long long)gridDim.x * blockDim.x) {                 \
            long long s, d;                                                                                     \
            strided_offsets(fits_31_bits(n, rank, shape, src_strides, dst_strides), i, rank, shape, src_strides,\
                            dst_strides, s, d);                                                                 \
            C v = convert_load_##SRC(src, s);                                                                   \
            if (scaled) v = round_c_##SRC(v * factor);                                                          \
            convert_store_##DST(dst, d, v);                                                                     \
        }                                                                                                       \
    }

#define TO_EVERY_TARGET(SRC, S, C)                       \
    STRIDED_CONVERT(SRC, S, C, f32, float)               \
    STRIDED_CONVERT(SRC, S, C, f16, unsigned short)      \
    STRIDED_CONVERT(SRC, S, C, bf16, unsigned short)     \
    STRIDED_CONVERT(SRC, S, C, f8e4m3fn, unsigned char)  \
    STRIDED_CONVERT(SRC, S, C, f8e5m2, unsigned char)    \
    STRIDED_CONVERT(SRC, S, C, i8, signed char)          \
    STRIDED_CONVERT(SRC, S, C, f64, double)              \
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
// (`strided_<op>_<dtype>`), as `kernels/cuda/strided_convert.cu` does it: computed in the compute
// dtype and rounded once to the dtype (i64's f64 result rounded to f32 first, as the host does);
// each a lone operation (contraction off regardless).
#define STRIDED_BINARY(OP, EXPR, NAME, T, C)                                                                    \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                    \
        strided_##OP##_##NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ dst, long long n, \
                              int rank, Dims8 shape, Dims8 a_strides, Dims8 b_strides) {                        \
        _Pragma("clang fp contract(off)") for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  \
                                               i < n; i += (long long)gridDim.x * blockDim.x) {                 \
            long long s, t;                                                                                     \
            strided_offsets(fits_31_bits(n, rank, shape, a_strides, b_strides), i, rank, shape, a_strides,      \
                            b_strides, s, t);                                                                   \
            C x = convert_load_##NAME(a, s);                                                                    \
            C y = convert_load_##NAME(b, t);                                                                    \
            convert_store_##NAME(dst, i, round_c_##NAME(EXPR));                                                 \
        }                                                                                                       \
    }

#define ADD_AND_MUL(NAME, T, C)                  \
    STRIDED_BINARY(add, x + y, NAME, T, C)       \
    STRIDED_BINARY(mul, x * y, NAME, T, C)

ADD_AND_MUL(f32, float, float)
ADD_AND_MUL(f16, unsigned short, float)
ADD_AND_MUL(bf16, unsigned short, float)
ADD_AND_MUL(f8e4m3fn, unsigned char, float)
ADD_AND_MUL(f8e5m2, unsigned char, float)
ADD_AND_MUL(i8, signed char, float)
ADD_AND_MUL(f64, double, double)
ADD_AND_MUL(i64, long long, double)
