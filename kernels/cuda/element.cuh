// The element type of the `cuda` kernels and its conversions to and from f32, prepended by the crate to
// every kernel source before NVRTC compiles it (NVRTC is given no include path).
//
// Define required: DTYPE  0 = f32, 1 = f16, 2 = bf16.
//
// No CUDA headers are needed: f16 converts with PTX `cvt`, bf16 with bit operations.

#if DTYPE == 0
typedef float elem_t;
#define CHUNK 4
__device__ __forceinline__ float to_f32(elem_t v) { return v; }
__device__ __forceinline__ elem_t from_f32(float v) { return v; }
#define KERNEL_SUFFIX f32
#elif DTYPE == 1
typedef unsigned short elem_t;
#define CHUNK 8
__device__ __forceinline__ float to_f32(elem_t v) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ elem_t from_f32(float f) {
    elem_t v;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(v) : "f"(f));
    return v;
}
#define KERNEL_SUFFIX f16
#elif DTYPE == 2
typedef unsigned short elem_t;
#define CHUNK 8
__device__ __forceinline__ float to_f32(elem_t v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ elem_t from_f32(float f) {
    unsigned int bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (elem_t)((bits >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
    }
    return (elem_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // nearest-even
}
#define KERNEL_SUFFIX bf16
#else
#error "DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

// Rounds to the element type and back (nearest-even).
__device__ __forceinline__ float round_elem(float v) { return to_f32(from_f32(v)); }

// The norm weight's type (define WDTYPE, coded like DTYPE; default DTYPE), which may differ from the
// element type (a Gemma-style f32 weight on bf16 activations): w_to_f32 reads it, round_w rounds to it.
#ifndef WDTYPE
#define WDTYPE DTYPE
#endif
#if WDTYPE == DTYPE
typedef elem_t welem_t;
__device__ __forceinline__ float w_to_f32(welem_t v) { return to_f32(v); }
__device__ __forceinline__ float round_w(float v) { return round_elem(v); }
#elif WDTYPE == 0
typedef float welem_t;
__device__ __forceinline__ float w_to_f32(welem_t v) { return v; }
__device__ __forceinline__ float round_w(float v) { return v; }
#elif WDTYPE == 1
typedef unsigned short welem_t;
__device__ __forceinline__ float w_to_f32(welem_t v) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ float round_w(float v) {
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v));
    return w_to_f32(h);
}
#elif WDTYPE == 2
typedef unsigned short welem_t;
__device__ __forceinline__ float w_to_f32(welem_t v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ float round_w(float v) {
    unsigned int bits = __float_as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(((bits >> 16) | 0x0040u) << 16);
    return w_to_f32((welem_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16));
}
#else
#error "WDTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

#define CONCAT_(a, b) a##_##b
#define CONCAT(a, b) CONCAT_(a, b)
