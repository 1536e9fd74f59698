// The HIP side of the portability layer the CUDA and HIP kernels share (`kernels/gpu`): what hipcc
// spells differently from NVRTC, under the names the shared sources use. The CUDA side is
// `kernels/cuda/port.cuh`, with the same names.
//
// - f16 bit conversions through `_Float16`, and `f32_round_to_odd`, through which a double narrows
//   to a format of at most 22 significand bits with one rounding (bf16's bit operations are the
//   same in both dialects: `kernels/gpu/compute.h`).
// - `c_add`, `c_sub`, `c_mul`, `c_div`, `c_sqrt`: each one correctly rounded operation in the
//   compute type, overloaded for float and double. hipcc contracts `a * b + c` into an fma, so these
//   are functions compiled with contraction off. The operations both compilers spell the same are in
//   `kernels/gpu/compute.h`, included at the end.
// - `gpu_isnan`, and `GPU_FP8_HARDWARE` 0: fp8 is converted in software (`kernels/gpu/fp8.h`).
// - `gpu_load_in_order`, `gpu_shfl_xor` and `GPU_WARP` (the wave's shuffle and width), and how the
//   norms keep loads in flight (`GPU_NORM_CLAMPED_LOADS`, `GPU_NORM_SCALAR_WEIGHT_AHEAD`) and round
//   their squares (`GPU_NORM_ROUNDED_SQUARES`).
// - `GPU_ROWS(row, n_rows)`, the rows a block computes: a grid-stride loop, since the host caps a
//   grid at HIP's 2^32 work-items; likewise `GPU_ELEMENTS(i, n)`, the elements a thread of the
//   strided kernels takes.
// - `GPU_KERNEL_DTYPES(M, ...)`: one code object holds every dtype, so it expands `M(dtype code,
//   kernel suffix, vector form, ...)` for f32, f16, bf16 and f64 and the 16-byte forms of the first
//   three (f64, a reference dtype, has none); `GPU_KERNEL_SCALAR_DTYPES` the four scalar ones only
//   (a family without a 16-byte form).

#pragma once

#include <hip/hip_runtime.h>

// f32 rounded to odd (truncated, the last bit set when anything was lost): rounding it to nearest
// even in a format of at most 22 significand bits equals rounding the double directly.
__device__ __forceinline__ float f32_round_to_odd(double value) {
    float nearest = (float)value;
    if ((double)nearest == value || __builtin_isinf(nearest) || __builtin_isnan(value)) return nearest;
    unsigned int bits = __float_as_uint(nearest);
    // Sign-magnitude: decrementing the bits of a non-zero float moves it one step toward zero.
    unsigned int truncated = fabs((double)nearest) > fabs(value) ? bits - 1u : bits;
    return __uint_as_float(truncated | 1u);
}

__device__ __forceinline__ float f16_bits_to_f32(unsigned short v) {
    _Float16 h;
    __builtin_memcpy(&h, &v, 2);
    return (float)h;
}
__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    _Float16 h = (_Float16)f;  // nearest-even
    unsigned short v;
    __builtin_memcpy(&v, &h, 2);
    return v;
}

#define GPU_ROUNDED_BINARY(name, op)                                                  \
    __device__ __forceinline__ float name(float a, float b) {                         \
        _Pragma("clang fp contract(off)") return a op b;                              \
    }                                                                                 \
    __device__ __forceinline__ double name(double a, double b) {                      \
        _Pragma("clang fp contract(off)") return a op b;                              \
    }
GPU_ROUNDED_BINARY(c_add, +)
GPU_ROUNDED_BINARY(c_sub, -)
GPU_ROUNDED_BINARY(c_mul, *)
GPU_ROUNDED_BINARY(c_div, /)
#undef GPU_ROUNDED_BINARY

__device__ __forceinline__ float c_sqrt(float a) { return sqrtf(a); }
__device__ __forceinline__ double c_sqrt(double a) { return sqrt(a); }

__device__ __forceinline__ bool gpu_isnan(float v) { return __builtin_isnan(v); }

#define GPU_FP8_HARDWARE 0

// A 16-byte load in program order (`port.cuh` needs one to keep ptxas from sinking a read-only load
// below stores): hipcc keeps the plain load where it is written.
template <class T> __device__ __forceinline__ T gpu_load_in_order(const T* p) { return *p; }

// A butterfly shuffle over the wave's lanes (64 on CDNA, 32 on RDNA), and the wave's width.
template <class T> __device__ __forceinline__ T gpu_shfl_xor(T value, int lane_mask) {
    return __shfl_xor(value, lane_mask);
}
#define GPU_WARP warpSize

// How the norms (`kernels/gpu/rms_norm.h`) keep their loads in flight under hipcc: the 16-byte loads
// of the cached chunks and of a group's weight have no branch between them (a chunk past the row's
// end loads the row's last chunk, unused): with a test per chunk the compiler merges each load with
// its use and waits for the load there. A weight of another type than x (scalar loads) is loaded
// at its use: loaded ahead, the compiler hoists those loads into the first pass, where they hold up
// the first wait on the row's own loads.
#define GPU_NORM_CLAMPED_LOADS 1
#define GPU_NORM_SCALAR_WEIGHT_AHEAD 0
// hipcc compiles HIP with contraction on, so a product may fuse with the sum it feeds: the norms'
// sums of squares take `c_mul` and `c_add`, which round each on its own.
#define GPU_NORM_ROUNDED_SQUARES 1

#define GPU_ROWS(row, n_rows) for (long long row = blockIdx.x; row < (n_rows); row += gridDim.x)
#define GPU_ELEMENTS(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

#define GPU_KERNEL_SCALAR_DTYPES(M, ...) \
    M(0, f32, false, __VA_ARGS__)        \
    M(1, f16, false, __VA_ARGS__)        \
    M(2, bf16, false, __VA_ARGS__)       \
    M(6, f64, false, __VA_ARGS__)

#define GPU_KERNEL_DTYPES(M, ...)      \
    M(0, f32, false, __VA_ARGS__)      \
    M(0, f32_vec, true, __VA_ARGS__)   \
    M(1, f16, false, __VA_ARGS__)      \
    M(1, f16_vec, true, __VA_ARGS__)   \
    M(2, bf16, false, __VA_ARGS__)     \
    M(2, bf16_vec, true, __VA_ARGS__)  \
    M(6, f64, false, __VA_ARGS__)

#include "gpu/compute.h"
