// The bf16 bit conversions and the compute-type operations CUDA and HIP spell the same, the latter
// overloaded for float (the f-suffixed functions the f32 kernels always used, so their bits do not
// change) and double: compiled right after the backend's portability header
// (`kernels/cuda/port.cuh`, `kernels/rocm/port.hip.h`, which hold the ones that differ: the f16
// conversions, `c_add`, `c_sub`, `c_mul`, `c_div`, `c_sqrt`) and before every other kernel source,
// the norms' included.

#ifndef VLLM_IR_GPU_COMPUTE_H
#define VLLM_IR_GPU_COMPUTE_H

// bf16 as its bits: widening shifts them into an f32; narrowing keeps a NaN a quiet NaN and rounds
// everything else to nearest-even.
__device__ __forceinline__ float bf16_bits_to_f32(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x0040u);  // NaN stays quiet
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);                   // nearest-even
}

__device__ __forceinline__ float c_fabs(float a) { return fabsf(a); }
__device__ __forceinline__ double c_fabs(double a) { return fabs(a); }
__device__ __forceinline__ float c_fmax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double c_fmax(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float c_fmin(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double c_fmin(double a, double b) { return fmin(a, b); }
__device__ __forceinline__ float c_exp(float a) { return expf(a); }
__device__ __forceinline__ double c_exp(double a) { return exp(a); }
__device__ __forceinline__ float c_erf(float a) { return erff(a); }
__device__ __forceinline__ double c_erf(double a) { return erf(a); }
__device__ __forceinline__ float c_tanh(float a) { return tanhf(a); }
__device__ __forceinline__ double c_tanh(double a) { return tanh(a); }

// A compute value as the f32 that rounds to a narrower format (f16, bf16, fp8) as the value would:
// a double through f32 rounded to odd.
__device__ __forceinline__ float narrow_f32(float v) { return v; }
__device__ __forceinline__ float narrow_f32(double v) { return f32_round_to_odd(v); }

#endif  // VLLM_IR_GPU_COMPUTE_H
