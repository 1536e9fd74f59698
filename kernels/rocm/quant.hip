// fp8 quantization of the `rocm` provider: `static_scaled_fp8_quant_<dtype>` and
// `dynamic_per_token_scaled_fp8_quant_<dtype>` for f32, f16, bf16 and f64 inputs. The numerics are
// those of the CUDA kernels (`kernels/cuda/quant.cu`): one IEEE division per element in the compute
// type (hipcc's default correctly rounded division; f64 for f64 inputs, a dynamic scale stored as
// f32) and a saturating nearest-even conversion, done in software; `format`
// 0 = f8e4m3fn, 1 = f8e5m2. One block of QUANT_BLOCK threads per row; q is compact rows of `hidden` bytes.

#include "quant.hip.h"

template <int DTYPE>
__device__ void static_quant_row(unsigned char* q, const typename Elem<DTYPE>::T* x, long long n_rows, int hidden,
                                 long long x_row_stride, const float* scale, int format) {
    // Grid-stride: the host caps the grid at HIP's 2^32 work-items.
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const typename Elem<DTYPE>::T* x_row = x + row * x_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        Compute<DTYPE> s = *scale;
        for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) q_row[j] = to_fp8(Elem<DTYPE>::load(x_row[j]) / s, format);
    }
}

template <int DTYPE>
__device__ void dynamic_quant_row(unsigned char* q, float* scales, const typename Elem<DTYPE>::T* x, long long n_rows,
                                  int hidden, long long x_row_stride, const float* scale_ub, int has_ub, int format) {
    typedef Compute<DTYPE> C;
    __shared__ C scratch[QUANT_BLOCK];
    // Grid-stride: the host caps the grid at HIP's 2^32 work-items.
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const typename Elem<DTYPE>::T* x_row = x + row * x_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        C absmax = 0.0f;
        for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) absmax = c_fmax(absmax, c_fabs(Elem<DTYPE>::load(x_row[j])));
        absmax = quant_block_max(absmax, scratch);
        if (has_ub) absmax = c_fmin(absmax, (C)*scale_ub);
        C max_finite = format == 0 ? 448.0f : 57344.0f;
        C s = c_fmax(absmax / max_finite, C(1) / (max_finite * 512));
        if (threadIdx.x == 0) scales[row] = s;
        for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) q_row[j] = to_fp8(Elem<DTYPE>::load(x_row[j]) / s, format);
    }
}

#define QUANT_KERNELS_DTYPE(DTYPE, suffix)                                                                         \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) static_scaled_fp8_quant_##suffix(                     \
        unsigned char* q, const Elem<DTYPE>::T* x, long long n_rows, int hidden, long long x_row_stride,           \
        const float* scale, int format) {                                                                          \
        static_quant_row<DTYPE>(q, x, n_rows, hidden, x_row_stride, scale, format);                                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) dynamic_per_token_scaled_fp8_quant_##suffix(          \
        unsigned char* q, float* scales, const Elem<DTYPE>::T* x, long long n_rows, int hidden,                    \
        long long x_row_stride, const float* scale_ub, int has_ub, int format) {                                   \
        dynamic_quant_row<DTYPE>(q, scales, x, n_rows, hidden, x_row_stride, scale_ub, has_ub, format);            \
    }

QUANT_KERNELS_DTYPE(0, f32)
QUANT_KERNELS_DTYPE(1, f16)
QUANT_KERNELS_DTYPE(2, bf16)
QUANT_KERNELS_DTYPE(6, f64)
