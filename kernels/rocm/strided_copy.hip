// Strided copy on the device (`clone` and `contiguous` of rocm tensors), as the CUDA kernel does it
// (`kernels/cuda/strided_copy.cu`): one thread per element in row-major order, each element moved as
// an unsigned integer of its size (every dtype bit for bit), shape and strides padded to eight
// dimensions (extent 1, stride 0) so the loop unrolls with constant indices (no scratch); the
// storage offsets are applied to the pointers by the host.
//
// In the same source (one `Dims8` in the unit of every kernel): the strided conversion (`copy_`
// between dtypes and `scale` of rocm tensors), as `kernels/cuda/strided_convert.cu` does it:
// `strided_convert_<src>_<dst>` writes `round_dst(v)`, or with `scaled` != 0
// `round_dst(round_f32(v * factor))`, the factor already rounded to f32 by the host; every source
// value is exact in f32, so each result is rounded once (to nearest even), as the host rounds it.

#include <hip/hip_runtime.h>

#include "element.hip.h"

#define COPY_BLOCK 256

struct Dims8 {
    long long v[8];
};

// The storage offsets of element i (row-major) in the source and the destination layouts.
__device__ __forceinline__ void strided_offsets(long long i, const Dims8& shape, const Dims8& src_strides,
                                                const Dims8& dst_strides, long long& s, long long& d) {
    long long rest = i;
    s = 0;
    d = 0;
#pragma unroll
    for (int k = 7; k >= 0; --k) {
        long long extent = shape.v[k];
        long long index = rest % extent;
        rest /= extent;
        s += index * src_strides.v[k];
        d += index * dst_strides.v[k];
    }
}

template <typename T>
__device__ __forceinline__ void strided_copy(const T* __restrict__ src, T* __restrict__ dst, long long n, Dims8 shape,
                                             Dims8 src_strides, Dims8 dst_strides) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long s, d;
    strided_offsets(i, shape, src_strides, dst_strides, s, d);
    dst[d] = src[s];
}

#define STRIDED_COPY(bytes, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                     \
        strided_copy_##bytes(const T* src, T* dst, long long n, Dims8 shape, Dims8 src_strides, Dims8 dst_strides) { \
        strided_copy<T>(src, dst, n, shape, src_strides, dst_strides);                                           \
    }

STRIDED_COPY(1, unsigned char)
STRIDED_COPY(2, unsigned short)
STRIDED_COPY(4, unsigned int)
STRIDED_COPY(8, unsigned long long)

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

#define STRIDED_CONVERT(SRC, S, DST, D, DTYPE)                                                                  \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                    \
        strided_convert_##SRC##_##DST(const S* __restrict__ src, D* __restrict__ dst, long long n, Dims8 shape, \
                                      Dims8 src_strides, Dims8 dst_strides, float factor, int scaled) {         \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                         \
        if (i >= n) return;                                                                                     \
        long long s, d;                                                                                         \
        strided_offsets(i, shape, src_strides, dst_strides, s, d);                                              \
        float v = convert_load_##SRC(src, s);                                                                   \
        if (scaled) v = v * factor;                                                                             \
        dst[d] = Elem<DTYPE>::store(v);                                                                         \
    }

#define TO_EVERY_TARGET(SRC, S)                         \
    STRIDED_CONVERT(SRC, S, f32, float, 0)              \
    STRIDED_CONVERT(SRC, S, f16, unsigned short, 1)     \
    STRIDED_CONVERT(SRC, S, bf16, unsigned short, 2)

TO_EVERY_TARGET(f32, float)
TO_EVERY_TARGET(f16, unsigned short)
TO_EVERY_TARGET(bf16, unsigned short)
TO_EVERY_TARGET(f8e4m3fn, unsigned char)
TO_EVERY_TARGET(f8e5m2, unsigned char)

// `add` and `mul` of two strided tensors of one dtype into a compact destination
// (`strided_<op>_<dtype>`), as `kernels/cuda/strided_convert.cu` does it: computed in f32 and
// rounded once to the dtype; each a lone operation (contraction off regardless).
#define STRIDED_BINARY(OP, EXPR, NAME, T, DTYPE)                                                                \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                    \
        strided_##OP##_##NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ dst, long long n, \
                              Dims8 shape, Dims8 a_strides, Dims8 b_strides) {                                  \
        _Pragma("clang fp contract(off)") long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;       \
        if (i >= n) return;                                                                                     \
        long long s, t;                                                                                         \
        strided_offsets(i, shape, a_strides, b_strides, s, t);                                                  \
        float x = convert_load_##NAME(a, s);                                                                    \
        float y = convert_load_##NAME(b, t);                                                                    \
        dst[i] = Elem<DTYPE>::store(EXPR);                                                                      \
    }

STRIDED_BINARY(add, x + y, f32, float, 0)
STRIDED_BINARY(add, x + y, f16, unsigned short, 1)
STRIDED_BINARY(add, x + y, bf16, unsigned short, 2)
STRIDED_BINARY(mul, x * y, f32, float, 0)
STRIDED_BINARY(mul, x * y, f16, unsigned short, 1)
STRIDED_BINARY(mul, x * y, bf16, unsigned short, 2)
