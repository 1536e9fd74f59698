// The element types of the `rocm` kernels and their conversions to and from f32: `Elem<0>` f32,
// `Elem<1>` f16, `Elem<2>` bf16 (as unsigned short bits). Included by every kernel source.

#pragma once

#include <hip/hip_runtime.h>

template <int DTYPE> struct Elem;

template <> struct Elem<0> {
    typedef float T;
    static constexpr int CHUNK = 4;
    __device__ static float load(T v) { return v; }
    __device__ static T store(float f) { return f; }
};

template <> struct Elem<1> {
    typedef unsigned short T;
    static constexpr int CHUNK = 8;
    __device__ static float load(T v) {
        _Float16 h;
        __builtin_memcpy(&h, &v, 2);
        return (float)h;
    }
    __device__ static T store(float f) {
        _Float16 h = (_Float16)f;  // nearest-even
        T v;
        __builtin_memcpy(&v, &h, 2);
        return v;
    }
};

template <> struct Elem<2> {
    typedef unsigned short T;
    static constexpr int CHUNK = 8;
    __device__ static float load(T v) { return __uint_as_float(((unsigned int)v) << 16); }
    __device__ static T store(float f) {
        unsigned int bits = __float_as_uint(f);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return (T)((bits >> 16) | 0x0040u);
        return (T)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
};

// Rounds to the element type and back (nearest-even).
template <int DTYPE>
__device__ __forceinline__ float round_elem(float v) {
    return Elem<DTYPE>::load(Elem<DTYPE>::store(v));
}
