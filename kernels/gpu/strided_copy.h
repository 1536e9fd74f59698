// Strided copy on the device, shared by CUDA and HIP: the elements a source layout describes, into
// a destination layout of the same shape (what `clone` and `contiguous` of a device tensor do), one
// thread per element in row-major order (`GPU_ELEMENTS`: a grid-stride loop on HIP, whose grids the
// host caps at 2^32 work-items). Dtype-agnostic: `strided_copy_<bytes>` moves each element as an
// unsigned integer of its size, so every dtype copies bit for bit, and `strided_copy_16` moves the
// 16-byte units of rows contiguous on both sides (`CopyDims::widened` on the host, which checks both
// buffers start 16-byte aligned). Shape and strides are padded to eight dimensions (extent 1,
// stride 0 past the rank), so the loop is fully unrolled with constant indices (no local memory or
// scratch); the storage offsets are applied to the pointers by the host. Compiled after the
// portability header; the strided conversions (`strided_convert.h`) use its indexing.

#ifndef VLLM_IR_GPU_STRIDED_COPY_H
#define VLLM_IR_GPU_STRIDED_COPY_H

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
    GPU_ELEMENTS(i, n) {
        long long s, d;
        strided_offsets(narrow, i, rank, shape, src_strides, dst_strides, s, d);
        dst[d] = src[s];
    }
}

// A 16-byte unit of the wide copy: one 16-byte load and one 16-byte store.
struct alignas(16) Unit16 {
    unsigned int w[4];
};

#define STRIDED_COPY(bytes, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(COPY_BLOCK)                                                     \
        strided_copy_##bytes(const T* __restrict__ src, T* __restrict__ dst, long long n, int rank, Dims8 shape,  \
                             Dims8 src_strides, Dims8 dst_strides) {                                             \
        strided_copy<T>(src, dst, n, rank, shape, src_strides, dst_strides);                                     \
    }

STRIDED_COPY(1, unsigned char)
STRIDED_COPY(2, unsigned short)
STRIDED_COPY(4, unsigned int)
STRIDED_COPY(8, unsigned long long)
STRIDED_COPY(16, Unit16)

#endif  // VLLM_IR_GPU_STRIDED_COPY_H
