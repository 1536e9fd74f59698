// Strided copy on the device: the elements a source layout describes, into a destination layout of
// the same shape (what `clone` and `contiguous` of a cuda tensor do), one thread per element in
// row-major order. Dtype-agnostic: `strided_copy_<bytes>` moves each element as an unsigned integer
// of its size, so every dtype copies bit for bit. Shape and strides are padded to eight dimensions
// (extent 1, stride 0 past the rank), so the loop is fully unrolled with constant indices (no local
// memory); the storage offsets are applied to the pointers by the host. No headers (NVRTC).

struct Dims8 {
    long long v[8];
};

// The storage offsets of element i (row-major) in the source and the destination layouts.
// Only the first `rank` dimensions divide (those past it are padding); the unrolled loop keeps
// constant indices either way.
__device__ __forceinline__ void strided_offsets(long long i, int rank, const Dims8& shape, const Dims8& src_strides,
                                                const Dims8& dst_strides, long long& s, long long& d) {
    long long rest = i;
    s = 0;
    d = 0;
#pragma unroll
    for (int k = 7; k >= 0; --k) {
        if (k >= rank) continue;
        long long extent = shape.v[k];
        long long index = rest % extent;
        rest /= extent;
        s += index * src_strides.v[k];
        d += index * dst_strides.v[k];
    }
}

template <typename T>
__device__ __forceinline__ void strided_copy(const T* __restrict__ src, T* __restrict__ dst, long long n, int rank,
                                             Dims8 shape, Dims8 src_strides, Dims8 dst_strides) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long s, d;
    strided_offsets(i, rank, shape, src_strides, dst_strides, s, d);
    dst[d] = src[s];
}

#define STRIDED_COPY(bytes, T)                                                                                   \
    extern "C" __global__ void strided_copy_##bytes(const T* src, T* dst, long long n, int rank, Dims8 shape,    \
                                                    Dims8 src_strides, Dims8 dst_strides) {                      \
        strided_copy<T>(src, dst, n, rank, shape, src_strides, dst_strides);                                     \
    }

STRIDED_COPY(1, unsigned char)
STRIDED_COPY(2, unsigned short)
STRIDED_COPY(4, unsigned int)
STRIDED_COPY(8, unsigned long long)
