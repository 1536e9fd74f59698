// The element types of the `rocm` kernels, their compute types and the conversions between them:
// `Elem<0>` f32, `Elem<1>` f16, `Elem<2>` bf16 (as unsigned short bits), all computing in f32, and
// `Elem<6>` f64 (a reference dtype), computing in f64. `load` widens to the compute type `C`;
// `store` rounds to the element type once, from a float or from a double (which narrows to f16 or
// bf16 through f32 rounded to odd). The c_* functions are the math of the kernels, overloaded for
// float (the f-suffixed functions the f32 kernels always used, so their bits do not change) and
// double. Included by every kernel source.

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

__device__ __forceinline__ float c_sqrt(float a) { return sqrtf(a); }
__device__ __forceinline__ double c_sqrt(double a) { return sqrt(a); }
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
// A compute value as the f32 that rounds to a narrower format (f16, bf16, fp8) as the value would.
__device__ __forceinline__ float narrow_f32(float v) { return v; }
__device__ __forceinline__ float narrow_f32(double v) { return f32_round_to_odd(v); }

template <int DTYPE> struct Elem;

template <> struct Elem<0> {
    typedef float T;
    typedef float C;
    static constexpr int CHUNK = 4;
    __device__ static float load(T v) { return v; }
    __device__ static T store(float f) { return f; }
    __device__ static T store(double d) { return (float)d; }
};

template <> struct Elem<1> {
    typedef unsigned short T;
    typedef float C;
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
    __device__ static T store(double d) { return store(f32_round_to_odd(d)); }
};

template <> struct Elem<2> {
    typedef unsigned short T;
    typedef float C;
    static constexpr int CHUNK = 8;
    __device__ static float load(T v) { return __uint_as_float(((unsigned int)v) << 16); }
    __device__ static T store(float f) {
        unsigned int bits = __float_as_uint(f);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return (T)((bits >> 16) | 0x0040u);
        return (T)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
    __device__ static T store(double d) { return store(f32_round_to_odd(d)); }
};

template <> struct Elem<6> {
    typedef double T;
    typedef double C;
    static constexpr int CHUNK = 2;
    __device__ static double load(T v) { return v; }
    __device__ static T store(double d) { return d; }
};

// The compute type of DTYPE elements.
template <int DTYPE> using Compute = typename Elem<DTYPE>::C;

// The compute type of a step mixing two element types: double when either is f64.
template <int A, int B> struct MixedCompute { typedef float T; };
template <int B> struct MixedCompute<6, B> { typedef double T; };
template <int A> struct MixedCompute<A, 6> { typedef double T; };
template <> struct MixedCompute<6, 6> { typedef double T; };

// Rounds to the element type and back (nearest-even, once, from a float or a double).
template <int DTYPE, typename V>
__device__ __forceinline__ V round_elem(V v) {
    return (V)Elem<DTYPE>::load(Elem<DTYPE>::store(v));
}

// A decimal constant in the compute type `V` (the float one as a float literal).
#define LIT(V, x) ((V)(sizeof(V) == 4 ? x##f : x))

// A 16-byte chunk as stored, held as four 32-bit words: held as 16-bit elements, the compiler splits
// the chunk into halves right after its load, which makes the thread wait for the load there.
struct alignas(16) Words {
    unsigned int w[4];
};

// Element `i` of a chunk held as words (little-endian: element 0 is the low half of word 0). Only
// f32, f16 and bf16 chunks are held so (f64 rows never take a 16-byte path).
template <int DTYPE>
__device__ __forceinline__ typename Elem<DTYPE>::T word_element(const Words& words, int i) {
    if constexpr (sizeof(typename Elem<DTYPE>::T) == 2) {
        return (typename Elem<DTYPE>::T)(words.w[i / 2] >> (16 * (i % 2)));
    } else {
        return __uint_as_float(words.w[i]);
    }
}

// A chunk of elements as words (the inverse of word_element).
template <int DTYPE>
__device__ __forceinline__ Words to_words(const typename Elem<DTYPE>::T* v) {
    Words words;
    if constexpr (sizeof(typename Elem<DTYPE>::T) == 2) {
#pragma unroll
        for (int i = 0; i < 4; ++i) words.w[i] = (unsigned int)v[2 * i] | ((unsigned int)v[2 * i + 1] << 16);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) words.w[i] = __float_as_uint(v[i]);
    }
    return words;
}

// Chunk `c` of a row of `d` elements (elements c*CHUNK .. c*CHUNK+CHUNK-1) as stored, for the
// kernels whose threads own whole chunks (the gated ops, the quantizations). The 16-byte kind (VEC)
// is one load or store of `Words` (the host guarantees d % CHUNK == 0: every chunk is whole); the
// scalar kind reads the elements below `d` one by one and zero past them, and writes those below d.
template <int DTYPE, bool VEC> struct RowChunk;

template <int DTYPE> struct RowChunk<DTYPE, true> {
    typedef typename Elem<DTYPE>::T T;
    Words words;
    __device__ __forceinline__ void load(const T* row, int c, int) {
        words = *reinterpret_cast<const Words*>(row + c * Elem<DTYPE>::CHUNK);
    }
    __device__ __forceinline__ T get(int i) const { return word_element<DTYPE>(words, i); }
    __device__ static void store(T* row, int c, int, const T* v) {
        *reinterpret_cast<Words*>(row + c * Elem<DTYPE>::CHUNK) = to_words<DTYPE>(v);
    }
};

template <int DTYPE> struct RowChunk<DTYPE, false> {
    typedef typename Elem<DTYPE>::T T;
    T v[Elem<DTYPE>::CHUNK];
    __device__ __forceinline__ void load(const T* row, int c, int d) {
        int first = c * Elem<DTYPE>::CHUNK;
#pragma unroll
        for (int i = 0; i < Elem<DTYPE>::CHUNK; ++i) v[i] = first + i < d ? row[first + i] : Elem<DTYPE>::store(0.0f);
    }
    __device__ __forceinline__ T get(int i) const { return v[i]; }
    __device__ static void store(T* row, int c, int d, const T* values) {
        int first = c * Elem<DTYPE>::CHUNK;
#pragma unroll
        for (int i = 0; i < Elem<DTYPE>::CHUNK; ++i) {
            if (first + i < d) row[first + i] = values[i];
        }
    }
};
