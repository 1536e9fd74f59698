// Strided copy on the device (`clone` and `contiguous` of rocm tensors), as the CUDA kernel does it
// (`kernels/cuda/strided_copy.cu`): one thread per element in row-major order, each element moved as
// an unsigned integer of its size (every dtype bit for bit), shape and strides padded to eight
// dimensions (extent 1, stride 0) so the loop unrolls with constant indices (no scratch); the
// storage offsets are applied to the pointers by the host.

#include <hip/hip_runtime.h>

#define COPY_BLOCK 256

struct Dims8 {
    long long v[8];
};

template <typename T>
__device__ __forceinline__ void strided_copy(const T* __restrict__ src, T* __restrict__ dst, long long n, Dims8 shape,
                                             Dims8 src_strides, Dims8 dst_strides) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long rest = i;
    long long s = 0;
    long long d = 0;
#pragma unroll
    for (int k = 7; k >= 0; --k) {
        long long extent = shape.v[k];
        long long index = rest % extent;
        rest /= extent;
        s += index * src_strides.v[k];
        d += index * dst_strides.v[k];
    }
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
