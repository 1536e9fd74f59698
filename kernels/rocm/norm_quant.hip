// RMS normalization followed by fp8 quantization in one kernel, `norm_quant_<dtype>` for f32, f16,
// bf16 and f64 (computing in f64) and its 16-byte form `norm_quant_<dtype>_vec` for f32, f16 and
// bf16: the ops `rms_norm_static_fp8_quant`, `rms_norm_dynamic_per_token_quant`,
// `fused_add_rms_norm_static_fp8_quant` and `fused_add_rms_norm_dynamic_per_token_quant`. The
// passes, the chunks a thread owns and keeps in registers, and the rounding points are those of the
// CUDA kernel (`kernels/cuda/norm_quant.cu`): the sum of squares, the absmax of the normalized
// values (dynamic only: a static scale needs no reduction), then the residual output and q. The
// residual output may be the residual's own rows (in place: `residual_out` is `r`, with its
// stride): each element is written by the thread that read it, after its last read.

#include "quant.hip.h"

// Chunk values a = x (+ r), in the compute type.
template <int DTYPE, bool VEC>
__device__ __forceinline__ void row_values(const RowChunk<DTYPE, VEC>& xc, const RowChunk<DTYPE, VEC>& rc,
                                           int has_residual, Compute<DTYPE>* a) {
#pragma unroll
    for (int i = 0; i < Elem<DTYPE>::CHUNK; ++i) {
        a[i] = Elem<DTYPE>::load(xc.get(i));
        if (has_residual) a[i] += Elem<DTYPE>::load(rc.get(i));
    }
}

// Reads chunk `c` of x and, when there is one, of the residual.
template <int DTYPE, bool VEC>
__device__ __forceinline__ void load_pair(const typename Elem<DTYPE>::T* x_row, const typename Elem<DTYPE>::T* r_row,
                                          int c, int hidden, int has_residual, RowChunk<DTYPE, VEC>& xc,
                                          RowChunk<DTYPE, VEC>& rc) {
    xc.load(x_row, c, hidden);
    if (has_residual) rc.load(r_row, c, hidden);
}

// The normalized values z of a chunk's values a (in place), weighted by chunk `c` of w when given.
template <int DTYPE, bool VEC>
__device__ __forceinline__ void normalize(Compute<DTYPE>* a, Compute<DTYPE> rstd, const typename Elem<DTYPE>::T* w,
                                          int c, int hidden, int has_weight) {
    RowChunk<DTYPE, VEC> wc;
    if (has_weight) wc.load(w, c, hidden);
#pragma unroll
    for (int i = 0; i < Elem<DTYPE>::CHUNK; ++i) {
        a[i] = round_elem<DTYPE>(a[i] * rstd);
        if (has_weight) a[i] = round_elem<DTYPE>(a[i] * Elem<DTYPE>::load(wc.get(i)));
    }
}

// The last pass on one chunk: the residual output (when there is a residual) and q.
template <int DTYPE, bool VEC>
__device__ __forceinline__ void finish_chunk(const RowChunk<DTYPE, VEC>& xc, const RowChunk<DTYPE, VEC>& rc, int c,
                                             Compute<DTYPE> rstd, Compute<DTYPE> s, const typename Elem<DTYPE>::T* w,
                                             typename Elem<DTYPE>::T* out_row, unsigned char* q_row, int hidden,
                                             int has_residual, int has_weight, int format) {
    typedef Elem<DTYPE> E;
    Compute<DTYPE> a[E::CHUNK];
    row_values(xc, rc, has_residual, a);
    if (has_residual) {
        typename E::T sum[E::CHUNK];
#pragma unroll
        for (int i = 0; i < E::CHUNK; ++i) sum[i] = E::store(a[i]);
        RowChunk<DTYPE, VEC>::store(out_row, c, hidden, sum);
    }
    normalize<DTYPE, VEC>(a, rstd, w, c, hidden, has_weight);
    Codes<E::CHUNK> codes;
#pragma unroll
    for (int i = 0; i < E::CHUNK; ++i) codes.set(i, to_fp8(a[i] / s, format));
    store_codes<VEC>(q_row, c, hidden, codes);
}

template <int DTYPE, bool VEC>
__device__ void norm_quant_row(unsigned char* q, float* scales, typename Elem<DTYPE>::T* residual_out,
                               const typename Elem<DTYPE>::T* x, const typename Elem<DTYPE>::T* r,
                               const typename Elem<DTYPE>::T* w, long long n_rows, int hidden,
                               long long x_row_stride, long long r_row_stride, long long out_row_stride,
                               Compute<DTYPE> eps, const float* scale, int has_residual, int has_weight, int dynamic,
                               int has_scale, int format) {
    typedef Elem<DTYPE> E;
    typedef Compute<DTYPE> C;
    typedef RowChunk<DTYPE, VEC> Chunk;
    __shared__ C scratch[QUANT_BLOCK];
    const int n = quant_chunks<DTYPE>(hidden);
    const int first_uncached = threadIdx.x + QUANT_CACHE * QUANT_BLOCK;
    // Grid-stride: the host caps the grid at HIP's 2^32 work-items.
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const typename E::T* x_row = x + row * x_row_stride;
        const typename E::T* r_row = r + row * r_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        typename E::T* out_row = residual_out + row * out_row_stride;

        // Every slot loads x and the residual (x again when there is none), with no test between the
        // loads: a slot past the row's end loads its last chunk, which no pass uses.
        const typename E::T* r_cached = has_residual ? r_row : x_row;
        Chunk xs[QUANT_CACHE], rs[QUANT_CACHE];
#pragma unroll
        for (int k = 0; k < QUANT_CACHE; ++k) {
            int c = min(threadIdx.x + k * QUANT_BLOCK, n - 1);
            xs[k].load(x_row, c, hidden);
            rs[k].load(r_cached, c, hidden);
        }

        // Elements past `hidden` read as zero and add an exact zero.
        C squares = 0.0f;
#pragma unroll
        for (int k = 0; k < QUANT_CACHE; ++k) {
            int c = threadIdx.x + k * QUANT_BLOCK;
            if (c < n) {
                C a[E::CHUNK];
                row_values(xs[k], rs[k], has_residual, a);
#pragma unroll
                for (int i = 0; i < E::CHUNK; ++i) squares += a[i] * a[i];
            }
        }
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            Chunk xc, rc;
            load_pair<DTYPE, VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
            C a[E::CHUNK];
            row_values(xc, rc, has_residual, a);
#pragma unroll
            for (int i = 0; i < E::CHUNK; ++i) squares += a[i] * a[i];
        }
        C rstd = C(1) / c_sqrt(quant_block_sum(squares, scratch) / (C)hidden + eps);

        C s;
        if (dynamic) {
            // Elements past `hidden` normalize to zero (or NaN, which fmax skips): the maximum stays.
            C absmax = 0.0f;
#pragma unroll
            for (int k = 0; k < QUANT_CACHE; ++k) {
                int c = threadIdx.x + k * QUANT_BLOCK;
                if (c < n) {
                    C a[E::CHUNK];
                    row_values(xs[k], rs[k], has_residual, a);
                    normalize<DTYPE, VEC>(a, rstd, w, c, hidden, has_weight);
#pragma unroll
                    for (int i = 0; i < E::CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(a[i]));
                }
            }
            for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
                Chunk xc, rc;
                load_pair<DTYPE, VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
                C a[E::CHUNK];
                row_values(xc, rc, has_residual, a);
                normalize<DTYPE, VEC>(a, rstd, w, c, hidden, has_weight);
#pragma unroll
                for (int i = 0; i < E::CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(a[i]));
            }
            // The branch is the same for the whole block, so every thread reaches the barriers.
            absmax = quant_block_max(absmax, scratch);
            if (has_scale) absmax = c_fmin(absmax, (C)*scale);
            C max_finite = format == 0 ? 448.0f : 57344.0f;
            s = c_fmax(absmax / max_finite, C(1) / (max_finite * 512));
            if (threadIdx.x == 0) scales[row] = s;
        } else {
            s = *scale;
        }

#pragma unroll
        for (int k = 0; k < QUANT_CACHE; ++k) {
            int c = threadIdx.x + k * QUANT_BLOCK;
            if (c < n) {
                finish_chunk<DTYPE, VEC>(xs[k], rs[k], c, rstd, s, w, out_row, q_row, hidden, has_residual, has_weight,
                                         format);
            }
        }
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            Chunk xc, rc;
            load_pair<DTYPE, VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
            finish_chunk<DTYPE, VEC>(xc, rc, c, rstd, s, w, out_row, q_row, hidden, has_residual, has_weight, format);
        }
    }
}

#define NORM_QUANT_KERNEL_DTYPE(DTYPE, suffix, VEC)                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) norm_quant_##suffix(                                \
        unsigned char* q, float* scales, Elem<DTYPE>::T* residual_out, const Elem<DTYPE>::T* x,                  \
        const Elem<DTYPE>::T* r, const Elem<DTYPE>::T* w, long long n_rows, int hidden, long long x_row_stride,   \
        long long r_row_stride, long long out_row_stride, Compute<DTYPE> eps, const float* scale, int has_residual,\
        int has_weight, int dynamic, int has_scale, int format) {                                                \
        norm_quant_row<DTYPE, VEC>(q, scales, residual_out, x, r, w, n_rows, hidden, x_row_stride, r_row_stride,  \
                                   out_row_stride, eps, scale, has_residual, has_weight, dynamic, has_scale,     \
                                   format);                                                                      \
    }

// f64, a reference dtype, has no 16-byte kernel.
NORM_QUANT_KERNEL_DTYPE(0, f32, false)
NORM_QUANT_KERNEL_DTYPE(0, f32_vec, true)
NORM_QUANT_KERNEL_DTYPE(1, f16, false)
NORM_QUANT_KERNEL_DTYPE(1, f16_vec, true)
NORM_QUANT_KERNEL_DTYPE(2, bf16, false)
NORM_QUANT_KERNEL_DTYPE(2, bf16_vec, true)
NORM_QUANT_KERNEL_DTYPE(6, f64, false)
