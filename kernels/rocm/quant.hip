// fp8 quantization of the `rocm` provider: `static_scaled_fp8_quant_<dtype>` and
// `dynamic_per_token_scaled_fp8_quant_<dtype>` for f32, f16, bf16 and f64 inputs, and their
// 16-byte forms `<kernel>_<dtype>_vec` for f32, f16 and bf16 (the host picks them when x's rows
// start 16-byte aligned and hidden % CHUNK == 0). The numerics and the work of a thread are those
// of the CUDA kernels (`kernels/cuda/quant.cu`): one IEEE division per element in the compute type
// (hipcc's default correctly rounded division; f64 for f64 inputs, a dynamic scale stored as f32)
// and a saturating nearest-even conversion, done in software; `format` 0 = f8e4m3fn, 1 = f8e5m2.
// One block of QUANT_BLOCK threads per row, thread t owning chunks t, t + QUANT_BLOCK, ...; the
// static kernel issues QUANT_UNROLL chunks' loads per step before converting any, the dynamic one
// keeps its first QUANT_CACHE chunks in registers (loads all issued first). q is compact rows of
// `hidden` bytes.

#include "quant.hip.h"

// The codes of a chunk's values divided by s.
template <int DTYPE, bool VEC>
__device__ __forceinline__ Codes<Elem<DTYPE>::CHUNK> quant_chunk(const RowChunk<DTYPE, VEC>& value, Compute<DTYPE> s,
                                                                int format) {
    Codes<Elem<DTYPE>::CHUNK> codes;
#pragma unroll
    for (int i = 0; i < Elem<DTYPE>::CHUNK; ++i) codes.set(i, to_fp8(Elem<DTYPE>::load(value.get(i)) / s, format));
    return codes;
}

template <int DTYPE, bool VEC>
__device__ void static_quant_row(unsigned char* q, const typename Elem<DTYPE>::T* x, long long n_rows, int hidden,
                                 long long x_row_stride, const float* scale, int format) {
    const int n = quant_chunks<DTYPE>(hidden);
    // Grid-stride: the host caps the grid at HIP's 2^32 work-items.
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const typename Elem<DTYPE>::T* x_row = x + row * x_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        Compute<DTYPE> s = *scale;
        for (int c0 = threadIdx.x; c0 < n; c0 += QUANT_UNROLL * QUANT_BLOCK) {
            RowChunk<DTYPE, VEC> v[QUANT_UNROLL];
#pragma unroll
            for (int k = 0; k < QUANT_UNROLL; ++k) {
                int c = c0 + k * QUANT_BLOCK;
                if (c < n) v[k].load(x_row, c, hidden);
            }
#pragma unroll
            for (int k = 0; k < QUANT_UNROLL; ++k) {
                int c = c0 + k * QUANT_BLOCK;
                if (c < n) store_codes<VEC>(q_row, c, hidden, quant_chunk(v[k], s, format));
            }
        }
    }
}

template <int DTYPE, bool VEC>
__device__ void dynamic_quant_row(unsigned char* q, float* scales, const typename Elem<DTYPE>::T* x, long long n_rows,
                                  int hidden, long long x_row_stride, const float* scale_ub, int has_ub, int format) {
    typedef Compute<DTYPE> C;
    typedef Elem<DTYPE> E;
    __shared__ C scratch[QUANT_BLOCK];
    const int n = quant_chunks<DTYPE>(hidden);
    const int first_uncached = threadIdx.x + QUANT_CACHE * QUANT_BLOCK;
    // Grid-stride: the host caps the grid at HIP's 2^32 work-items.
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const typename E::T* x_row = x + row * x_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        // Every slot loads, with no test between the loads: a slot past the row's end loads its last
        // chunk again, which changes no maximum and is never stored (and elements past `hidden` read
        // as zero, which changes none either).
        RowChunk<DTYPE, VEC> cache[QUANT_CACHE];
#pragma unroll
        for (int k = 0; k < QUANT_CACHE; ++k) cache[k].load(x_row, min(threadIdx.x + k * QUANT_BLOCK, n - 1), hidden);
        C absmax = 0.0f;
#pragma unroll
        for (int k = 0; k < QUANT_CACHE; ++k) {
#pragma unroll
            for (int i = 0; i < E::CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(E::load(cache[k].get(i))));
        }
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            RowChunk<DTYPE, VEC> v;
            v.load(x_row, c, hidden);
#pragma unroll
            for (int i = 0; i < E::CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(E::load(v.get(i))));
        }
        absmax = quant_block_max(absmax, scratch);
        if (has_ub) absmax = c_fmin(absmax, (C)*scale_ub);
        C max_finite = format == 0 ? 448.0f : 57344.0f;
        C s = c_fmax(absmax / max_finite, C(1) / (max_finite * 512));
        if (threadIdx.x == 0) scales[row] = s;
#pragma unroll
        for (int k = 0; k < QUANT_CACHE; ++k) {
            int c = threadIdx.x + k * QUANT_BLOCK;
            if (c < n) store_codes<VEC>(q_row, c, hidden, quant_chunk(cache[k], s, format));
        }
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            RowChunk<DTYPE, VEC> v;
            v.load(x_row, c, hidden);
            store_codes<VEC>(q_row, c, hidden, quant_chunk(v, s, format));
        }
    }
}

#define QUANT_KERNELS_DTYPE(DTYPE, suffix, VEC)                                                                    \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) static_scaled_fp8_quant_##suffix(                     \
        unsigned char* q, const Elem<DTYPE>::T* x, long long n_rows, int hidden, long long x_row_stride,           \
        const float* scale, int format) {                                                                          \
        static_quant_row<DTYPE, VEC>(q, x, n_rows, hidden, x_row_stride, scale, format);                           \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) dynamic_per_token_scaled_fp8_quant_##suffix(          \
        unsigned char* q, float* scales, const Elem<DTYPE>::T* x, long long n_rows, int hidden,                    \
        long long x_row_stride, const float* scale_ub, int has_ub, int format) {                                   \
        dynamic_quant_row<DTYPE, VEC>(q, scales, x, n_rows, hidden, x_row_stride, scale_ub, has_ub, format);       \
    }

// f64, a reference dtype, has no 16-byte kernels.
QUANT_KERNELS_DTYPE(0, f32, false)
QUANT_KERNELS_DTYPE(0, f32_vec, true)
QUANT_KERNELS_DTYPE(1, f16, false)
QUANT_KERNELS_DTYPE(1, f16_vec, true)
QUANT_KERNELS_DTYPE(2, bf16, false)
QUANT_KERNELS_DTYPE(2, bf16_vec, true)
QUANT_KERNELS_DTYPE(6, f64, false)
