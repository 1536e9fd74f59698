// The CPU side of the portability layer the CUDA and HIP kernels share (`kernels/gpu`), beside
// `kernels/cuda/port.cuh` and `kernels/rocm/port.hip.h`, with the same names: it lets a C++20
// compiler (g++ or clang) build the kernel source as it is, so the emulated runtime executes it on
// the CPU. Compiled before every other kernel source, after the runtime (`kernels/cpu/runtime.h`),
// which provides the built-ins: `threadIdx`, `blockIdx`, `blockDim`, `gridDim`, `warpSize`,
// `__syncthreads` and the warp shuffles, run by cooperative fibers.
//
// Define `VLLM_IR_EMU_HIP` to build a program as hipcc gets it (grid-stride rows, every dtype in one
// program), else it is built as NVRTC gets it (one block per row, one dtype per program, `DTYPE`).
//
// - f16 bit conversions through `_Float16` (nearest-even), and `f32_round_to_odd`.
// - `c_add`, `c_sub`, `c_mul`, `c_div`, `c_sqrt`: one correctly rounded operation each; the program
//   is compiled with contraction off (`-ffp-contract=off`) and SSE arithmetic, so `a * b` is one
//   IEEE multiplication.
// - `gpu_isnan`, and `GPU_FP8_HARDWARE` 0: fp8 is converted in software (`kernels/gpu/fp8.h`).
// - `gpu_shfl_xor`, `GPU_WARP`, `GPU_NORM_CLAMPED_LOADS`, `GPU_NORM_SCALAR_WEIGHT_AHEAD`,
//   `GPU_NORM_ROUNDED_SQUARES`, `GPU_ROWS`,
//   `GPU_ELEMENTS` and `GPU_KERNEL_DTYPES` as the dialect emulated defines them.

#include <math.h>
#include <string.h>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
// Shared memory: one copy per OS thread, which runs one block at a time (all of its fibers).
#define __shared__ static thread_local

// CUDA's and HIP's integer and float `min`/`max` (the common type of the two arguments).
template <class A, class B> __device__ __forceinline__ auto min(A a, B b) { return b < a ? b : a; }
template <class A, class B> __device__ __forceinline__ auto max(A a, B b) { return a < b ? b : a; }

__device__ __forceinline__ unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
__device__ __forceinline__ float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
__device__ __forceinline__ float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}

// f32 rounded to odd (truncated, the last bit set when anything was lost): rounding it to nearest
// even in a format of at most 22 significand bits equals rounding the double directly.
__device__ __forceinline__ float f32_round_to_odd(double value) {
    float nearest = (float)value;
    if ((double)nearest == value || isinf(nearest) || isnan(value)) return nearest;
    unsigned int bits = __float_as_uint(nearest);
    // Sign-magnitude: decrementing the bits of a non-zero float moves it one step toward zero.
    unsigned int truncated = fabs((double)nearest) > fabs(value) ? bits - 1u : bits;
    return __uint_as_float(truncated | 1u);
}

__device__ __forceinline__ float f16_bits_to_f32(unsigned short v) {
    _Float16 h;
    memcpy(&h, &v, 2);
    return (float)h;
}
__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    _Float16 h = (_Float16)f;  // nearest-even
    unsigned short v;
    memcpy(&v, &h, 2);
    return v;
}

__device__ __forceinline__ float c_add(float a, float b) { return a + b; }
__device__ __forceinline__ double c_add(double a, double b) { return a + b; }
__device__ __forceinline__ float c_sub(float a, float b) { return a - b; }
__device__ __forceinline__ double c_sub(double a, double b) { return a - b; }
__device__ __forceinline__ float c_mul(float a, float b) { return a * b; }
__device__ __forceinline__ double c_mul(double a, double b) { return a * b; }
__device__ __forceinline__ float c_div(float a, float b) { return a / b; }
__device__ __forceinline__ double c_div(double a, double b) { return a / b; }
__device__ __forceinline__ float c_sqrt(float a) { return sqrtf(a); }
__device__ __forceinline__ double c_sqrt(double a) { return sqrt(a); }

__device__ __forceinline__ bool gpu_isnan(float v) { return isnan(v); }

// A 16-byte load in program order (`port.cuh`): on the CPU, the load itself (alignment-checked).
template <class T> __device__ __forceinline__ T gpu_load_in_order(const T* p) { return *p; }

#define GPU_FP8_HARDWARE 0

#if defined(VLLM_IR_EMU_HIP)

template <class T> __device__ __forceinline__ T gpu_shfl_xor(T value, int lane_mask) {
    return __shfl_xor(value, lane_mask);
}
#define GPU_WARP warpSize
#define GPU_NORM_CLAMPED_LOADS 1
#define GPU_NORM_SCALAR_WEIGHT_AHEAD 0
#define GPU_NORM_ROUNDED_SQUARES 1

#define GPU_ROWS(row, n_rows) for (long long row = blockIdx.x; row < (n_rows); row += gridDim.x)
#define GPU_ELEMENTS(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

#define GPU_KERNEL_SCALAR_DTYPES(M, ...) \
    M(0, f32, false, __VA_ARGS__)        \
    M(1, f16, false, __VA_ARGS__)        \
    M(2, bf16, false, __VA_ARGS__)       \
    M(6, f64, false, __VA_ARGS__)

#define GPU_KERNEL_DTYPES(M, ...)     \
    M(0, f32, false, __VA_ARGS__)     \
    M(0, f32_vec, true, __VA_ARGS__)  \
    M(1, f16, false, __VA_ARGS__)     \
    M(1, f16_vec, true, __VA_ARGS__)  \
    M(2, bf16, false, __VA_ARGS__)    \
    M(2, bf16_vec, true, __VA_ARGS__) \
    M(6, f64, false, __VA_ARGS__)

#else

template <class T> __device__ __forceinline__ T gpu_shfl_xor(T value, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, value, lane_mask);
}
#define GPU_WARP 32
#define GPU_NORM_CLAMPED_LOADS 0
#define GPU_NORM_SCALAR_WEIGHT_AHEAD 1
#define GPU_NORM_ROUNDED_SQUARES 0

#define GPU_ROWS(row, n_rows) if (long long row = blockIdx.x; row < (n_rows))
#define GPU_ELEMENTS(i, n) if (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n))

#if !defined(DTYPE)
#define GPU_KERNEL_SCALAR_DTYPES(M, ...)
#define GPU_KERNEL_DTYPES(M, ...)
#elif DTYPE == 0
#define GPU_KERNEL_SCALAR_DTYPES(M, ...) M(0, f32, false, __VA_ARGS__)
#define GPU_KERNEL_DTYPES(M, ...) M(0, f32, false, __VA_ARGS__) M(0, f32_vec, true, __VA_ARGS__)
#elif DTYPE == 1
#define GPU_KERNEL_SCALAR_DTYPES(M, ...) M(1, f16, false, __VA_ARGS__)
#define GPU_KERNEL_DTYPES(M, ...) M(1, f16, false, __VA_ARGS__) M(1, f16_vec, true, __VA_ARGS__)
#elif DTYPE == 2
#define GPU_KERNEL_SCALAR_DTYPES(M, ...) M(2, bf16, false, __VA_ARGS__)
#define GPU_KERNEL_DTYPES(M, ...) M(2, bf16, false, __VA_ARGS__) M(2, bf16_vec, true, __VA_ARGS__)
#elif DTYPE == 6
#define GPU_KERNEL_SCALAR_DTYPES(M, ...) M(6, f64, false, __VA_ARGS__)
#define GPU_KERNEL_DTYPES(M, ...) M(6, f64, false, __VA_ARGS__)
#else
#error "DTYPE must be 0 (f32), 1 (f16), 2 (bf16) or 6 (f64)"
#endif

#endif
