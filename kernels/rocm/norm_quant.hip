// RMS normalization followed by fp8 quantization in one kernel, `norm_quant_<dtype>` for f32, f16,
// bf16 and f64 (computing in f64): the ops `rms_norm_static_fp8_quant`, `rms_norm_dynamic_per_token_quant`,
// `fused_add_rms_norm_static_fp8_quant` and `fused_add_rms_norm_dynamic_per_token_quant`. The passes and rounding points are those of the CUDA
// kernel (`kernels/cuda/norm_quant.cu`): the sum of squares, the absmax of the normalized values
// (dynamic), then the residual output and q. Every barrier is reached by the whole block. The
// residual output may be the residual's own rows (in place: `residual_out` is `r`, with its stride).

#include "quant.hip.h"

template <int DTYPE>
__device__ void norm_quant_row(unsigned char* q, float* scales, typename Elem<DTYPE>::T* residual_out,
                               const typename Elem<DTYPE>::T* x, const typename Elem<DTYPE>::T* r,
                               const typename Elem<DTYPE>::T* w, long long n_rows, int hidden,
                               long long x_row_stride, long long r_row_stride, long long out_row_stride,
                               Compute<DTYPE> eps,
                               const float* scale,
                               int has_residual, int has_weight, int dynamic, int has_scale, int format) {
    typedef Elem<DTYPE> E;
    typedef Compute<DTYPE> C;
    __shared__ C scratch[QUANT_BLOCK];
    // Grid-stride: the host caps the grid at HIP's 2^32 work-items.
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const typename E::T* x_row = x + row * x_row_stride;
        const typename E::T* r_row = r + row * r_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        typename E::T* out_row = residual_out + row * out_row_stride;

        C squares = 0.0f;
        for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
            C a = E::load(x_row[j]);
            if (has_residual) a += E::load(r_row[j]);
            squares += a * a;
        }
        C rstd = C(1) / c_sqrt(quant_block_sum(squares, scratch) / (C)hidden + eps);

        C absmax = 0.0f;
        if (dynamic) {
            for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
                C a = E::load(x_row[j]);
                if (has_residual) a += E::load(r_row[j]);
                C z = round_elem<DTYPE>(a * rstd);
                if (has_weight) z = round_elem<DTYPE>(z * E::load(w[j]));
                absmax = c_fmax(absmax, c_fabs(z));
            }
        }
        absmax = quant_block_max(absmax, scratch);
        C s;
        if (dynamic) {
            if (has_scale) absmax = c_fmin(absmax, (C)*scale);
            C max_finite = format == 0 ? 448.0f : 57344.0f;
            s = c_fmax(absmax / max_finite, C(1) / (max_finite * 512));
            if (threadIdx.x == 0) scales[row] = s;
        } else {
            s = *scale;
        }

        for (int j = threadIdx.x; j < hidden; j += QUANT_BLOCK) {
            C a = E::load(x_row[j]);
            if (has_residual) {
                a += E::load(r_row[j]);
                out_row[j] = E::store(a);
            }
            C z = round_elem<DTYPE>(a * rstd);
            if (has_weight) z = round_elem<DTYPE>(z * E::load(w[j]));
            q_row[j] = to_fp8(z / s, format);
        }
    }
}

#define NORM_QUANT_KERNEL_DTYPE(DTYPE, suffix)                                                                   \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) norm_quant_##suffix(                                \
        unsigned char* q, float* scales, Elem<DTYPE>::T* residual_out, const Elem<DTYPE>::T* x,                  \
        const Elem<DTYPE>::T* r, const Elem<DTYPE>::T* w, long long n_rows, int hidden, long long x_row_stride,   \
        long long r_row_stride, long long out_row_stride, Compute<DTYPE> eps, const float* scale, int has_residual,\
        int has_weight, int dynamic, int has_scale, int format) {                                                \
        norm_quant_row<DTYPE>(q, scales, residual_out, x, r, w, n_rows, hidden, x_row_stride, r_row_stride,       \
                              out_row_stride, eps, scale, has_residual, has_weight, dynamic, has_scale, format); \
    }

NORM_QUANT_KERNEL_DTYPE(0, f32)
NORM_QUANT_KERNEL_DTYPE(1, f16)
NORM_QUANT_KERNEL_DTYPE(2, bf16)
NORM_QUANT_KERNEL_DTYPE(6, f64)
