// The fp8 conversion and the block reductions of the `rocm` quantization kernels (`quant.hip`,
// `norm_quant.hip`); the numerics are those of the CUDA kernels (`kernels/cuda/quant.cu`).

#pragma once

#include "element.hip.h"

#define QUANT_BLOCK 256
#define QUANT_UNROLL 2
#define QUANT_CACHE 4

// The chunks of a row of `hidden` elements of DTYPE.
template <int DTYPE>
__device__ __forceinline__ int quant_chunks(int hidden) {
    return hidden / Elem<DTYPE>::CHUNK + (hidden % Elem<DTYPE>::CHUNK != 0);
}

// A chunk's fp8 codes, four to a 32-bit word (code i in byte i % 4 of word i / 4: bytes of a struct
// written one by one would put it in scratch), stored as one access on the 16-byte path.
template <int CHUNK>
struct alignas(CHUNK >= 4 ? CHUNK : 4) Codes {
    unsigned int w[(CHUNK + 3) / 4];
    __device__ __forceinline__ void set(int i, unsigned char code) {
        unsigned int shifted = (unsigned int)code << (8 * (i % 4));
        w[i / 4] = i % 4 == 0 ? shifted : w[i / 4] | shifted;
    }
};

// Writes chunk `c`'s codes into a row of `hidden` codes (those below `hidden`): one store when VEC
// (4 or 8 bytes, aligned: the row starts a whole chunk of codes).
template <bool VEC, int CHUNK>
__device__ __forceinline__ void store_codes(unsigned char* row, int c, int hidden, const Codes<CHUNK>& codes) {
    int first = c * CHUNK;
    if (VEC) {
        *reinterpret_cast<Codes<CHUNK>*>(row + first) = codes;
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            if (first + i < hidden) row[first + i] = (unsigned char)(codes.w[i / 4] >> (8 * (i % 4)));
        }
    }
}

__device__ __forceinline__ unsigned char fp8_from_f32(float f, int m_bits, int bias, float max_finite) {
    unsigned int bits = __float_as_uint(f);
    unsigned int sign = (bits >> 24) & 0x80u;
    // NaN: one canonical code in both formats (sign clear, all other bits set), whatever the
    // NaN's sign and payload, as every provider writes it and the hardware `cvt` does.
    if (__builtin_isnan(f)) return (unsigned char)0x7fu;
    float a = fminf(fabsf(f), max_finite);
    int emin = 1 - bias;
    int e = max((int)((__float_as_uint(a) >> 23) & 0xffu) - 127, emin);
    float inv_step = __uint_as_float((unsigned int)(127 - (e - m_bits)) << 23);
    float step = __uint_as_float((unsigned int)(127 + (e - m_bits)) << 23);
    float r = rintf(a * inv_step) * step;
    if (r == 0.0f) return (unsigned char)sign;
    unsigned int rb = __float_as_uint(r);
    int re = (int)((rb >> 23) & 0xffu) - 127;
    unsigned int code;
    if (re >= emin) {
        code = ((unsigned int)(re + bias) << m_bits) | ((rb & 0x7fffffu) >> (23 - m_bits));
    } else {
        code = (unsigned int)(r * __uint_as_float((unsigned int)(127 - (emin - m_bits)) << 23));
    }
    return (unsigned char)(sign | code);
}

// A double narrows through f32 rounded to odd, which the fp8 rounding then rounds as the double.
template <typename C>
__device__ __forceinline__ unsigned char to_fp8(C v, int format) {
    float f = narrow_f32(v);
    return format == 0 ? fp8_from_f32(f, 3, 7, 448.0f) : fp8_from_f32(f, 2, 15, 57344.0f);
}

template <typename C>
__device__ __forceinline__ C quant_block_max(C value, C* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = QUANT_BLOCK / 2; width > 0; width >>= 1) {
        if ((int)threadIdx.x < width) scratch[threadIdx.x] = c_fmax(scratch[threadIdx.x], scratch[threadIdx.x + width]);
        __syncthreads();
    }
    C total = scratch[0];
    __syncthreads();
    return total;
}

template <typename C>
__device__ __forceinline__ C quant_block_sum(C value, C* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = QUANT_BLOCK / 2; width > 0; width >>= 1) {
        if ((int)threadIdx.x < width) scratch[threadIdx.x] += scratch[threadIdx.x + width];
        __syncthreads();
    }
    C total = scratch[0];
    __syncthreads();
    return total;
}
