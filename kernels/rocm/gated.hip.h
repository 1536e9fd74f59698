// The gated activations of the `rocm` provider: `x` is rows of 2d elements, the gate then the up
// projection; `out[row, j] = round(round(act(gate_j)) * up_j)` is rows of d elements.
//
// Each op source includes this header, defines a struct with
//   static constexpr bool ROW_STATS;            // whether `prepare` needs the gate's mean and std
//   template <int DTYPE> __device__ static Compute<DTYPE> prepare(Compute<DTYPE> mean, Compute<DTYPE> std,
//                                                                const GateScalars<Compute<DTYPE>>& s);
//   template <int DTYPE> __device__ static Compute<DTYPE> activate(Compute<DTYPE> g, Compute<DTYPE> prepared,
//                                                                 const GateScalars<Compute<DTYPE>>& s);
// (templated on the element type, for ops that round to it: `round_elem<DTYPE>` of element.hip.h)
// and instantiates `GATED_KERNELS(<op name>, <struct>)`, which defines the `extern "C"` kernels
// `<op name>_<dtype>` for f32, f16, bf16 and f64 (scalar accesses, any alignment) and
// `<op name>_<dtype>_vec` for f32, f16 and bf16 (16-byte loads and stores: the host picks it when
// x's rows, their up halves and the output rows start 16-byte aligned, so d % CHUNK == 0), all
// `(out, x, n_rows, d, x_row_stride, out_row_stride, f0, f1, i0, i1)`: the op's float parameters in
// f0, f1 (in the compute type) and its string-choice, integer and boolean parameters in i0, i1, in
// declaration order.
//
// One block per row, of a power of two of threads the host picks from d alone (one 16-byte chunk
// per thread, 64 up to the largest block). Thread t owns chunks t, t + block, ... of CHUNK
// elements in both kernels, so the row statistics (the mean and the biased standard deviation of the
// gate from that mean, reduced in a fixed order) and so every output have the same bits whichever
// kernel runs. Each step, a thread issues the gate and up loads of GATED_UNROLL chunks before it
// converts any of them. Every value is in the compute type (f32; f64 for f64 elements). The
// numerics are those of the CUDA kernels.

#pragma once

#include "element.hip.h"

// The largest block (the host picks a power of two from 64 up to it from d alone) and the chunks a
// thread loads per step.
#define GATED_MAX_BLOCK 1024
#define GATED_UNROLL 2

template <typename C>
struct GateScalars {
    C f0, f1;
    int i0, i1;
};

template <typename C>
__device__ __forceinline__ C silu(C g) {
    return g / (LIT(C, 1.0) + c_exp(-g));
}

// gelu without cancellation in the negative tail, where `0.5·v·(1 + tanh z)` and
// `0.5·v·(1 + erf(v/√2))` subtract numbers near 1 (the derivation is in the cpu provider's
// `activation` module, which computes the same forms):
// - tanh: v / (1 + e^w), w = -2z = v·(A + B·v²), as v·e^-w / (1 + e^-w) for v < 0 (no overflow);
// - erf: 0.5·v·erfc(-v/√2), erfc(x) = t·e^(-x² + Q(t)), t = 1 / (1 + x/2) (Numerical Recipes'
//   Chebyshev fit, fractional error below 1.2e-7), erfc(-x) = 2 - erfc(x).
// In f32 each exponent is carried in two floats (fmaf gives a product's rounding error exactly, the
// two-sum a sum's), so e^w is as accurate as expf; contraction is off, so every other product and
// sum rounds on its own as the two-float steps need. In f64 the plain forms are accurate enough.
__device__ __forceinline__ float gelu_tanh(float v) {
#pragma clang fp contract(off)
    if (v > 20.0f) return v;          // e^w below half an ulp of 1
    if (v < -20.0f) return v * 0.0f;  // below the smallest subnormal; NaN for -inf
    const float a_hi = -1.59576916694641113e+00f, a_lo = 4.53406805434042326e-08f;
    const float b_hi = -7.13548138737678528e-02f, b_lo = -2.39883246599958966e-09f;
    float v2 = v * v, v2_lo = fmaf(v, v, -v2);
    float t = b_hi * v2;
    float t_lo = fmaf(b_hi, v2, -t) + fmaf(b_hi, v2_lo, b_lo * v2);
    float s = a_hi + t, bb = s - a_hi;
    float s_lo = ((a_hi - (s - bb)) + (t - bb)) + (a_lo + t_lo);
    float w = s * v, w_lo = fmaf(s_lo, v, fmaf(s, v, -w));
    bool negative = v < 0.0f;
    float u = negative ? -w : w, u_lo = negative ? -w_lo : w_lo;
    float e = expf(u);
    e = fmaf(e, u_lo, e);
    return (negative ? v * e : v) / (1.0f + e);
}

__device__ __forceinline__ double gelu_tanh(double v) {
    const double k = 0.79788456080286535588;
    return v / (1.0 + exp(-2.0 * k * (v + 0.044715 * v * v * v)));
}

__device__ __forceinline__ float gelu_erf(float v) {
#pragma clang fp contract(off)
    if (v > 14.0f) return v;          // erfc(-v/√2) is 2 to within half an ulp
    if (v < -14.0f) return v * 0.0f;  // below the smallest subnormal; NaN for -inf
    float x = fabsf(v) * 0.70710678118654752f;
    float t = 1.0f / fmaf(x, 0.5f, 1.0f);
    float q = 0.17087277f;
    q = fmaf(q, t, -0.82215223f);
    q = fmaf(q, t, 1.48851587f);
    q = fmaf(q, t, -1.13520398f);
    q = fmaf(q, t, 0.27886807f);
    q = fmaf(q, t, -0.18628806f);
    q = fmaf(q, t, 0.09678418f);
    q = fmaf(q, t, 0.37409196f);
    q = fmaf(q, t, 1.00002368f);
    q = fmaf(q, t, -1.26551223f);
    float v2 = v * v, v2_lo = fmaf(v, v, -v2);
    float h = v2 * -0.5f;
    float a = h + q, bb = a - h;
    float a_lo = fmaf(v2_lo, -0.5f, (h - (a - bb)) + (q - bb));
    float e = expf(a);
    float erfc_abs = t * fmaf(e, a_lo, e);
    float erfc = v < 0.0f ? erfc_abs : 2.0f - erfc_abs;
    return (0.5f * v) * erfc;
}

__device__ __forceinline__ double gelu_erf(double v) { return 0.5 * v * erfc(-v * 0.70710678118654752440); }

template <typename C>
__device__ __forceinline__ C gelu(C g, int approximate) {
    return approximate == 0 ? gelu_erf(g) : gelu_tanh(g);
}

// Sums `value` over the block (blockDim.x threads, a power of two) in a fixed tree order; every
// thread gets the total.
template <typename C>
__device__ __forceinline__ C gated_block_sum(C value, C* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = blockDim.x / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] += scratch[threadIdx.x + width];
        __syncthreads();
    }
    C total = scratch[0];
    __syncthreads();
    return total;
}

// Calls `f` on every gate value of a row this thread owns (chunks t, t + step, ...), in order,
// the loads of GATED_UNROLL chunks issued before any is read.
template <int DTYPE, bool VEC, typename F>
__device__ __forceinline__ void for_each_gate_value(const typename Elem<DTYPE>::T* gate, int n, int d, int step, F f) {
    typedef Elem<DTYPE> E;
    constexpr int CHUNK = E::CHUNK;
    for (int c0 = threadIdx.x; c0 < n; c0 += GATED_UNROLL * step) {
        RowChunk<DTYPE, VEC> g[GATED_UNROLL];
#pragma unroll
        for (int k = 0; k < GATED_UNROLL; ++k) {
            int c = c0 + k * step;
            if (c < n) g[k].load(gate, c, d);
        }
#pragma unroll
        for (int k = 0; k < GATED_UNROLL; ++k) {
            int c = c0 + k * step;
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) {
                if (c < n && (VEC || c * CHUNK + i < d)) f(E::load(g[k].get(i)));
            }
        }
    }
}

template <int DTYPE, typename Op, bool VEC>
__device__ __forceinline__ void gated_row(typename Elem<DTYPE>::T* __restrict__ out,
                                          const typename Elem<DTYPE>::T* __restrict__ x, long long n_rows, int d,
                                          long long x_row_stride, long long out_row_stride,
                                          GateScalars<Compute<DTYPE>> s) {
    typedef Elem<DTYPE> E;
    typedef Compute<DTYPE> C;
    typedef RowChunk<DTYPE, VEC> Chunk;
    constexpr int CHUNK = E::CHUNK;
    // Grid-stride: the host caps the grid at HIP's 2^32 work-items.
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const typename E::T* gate = x + row * x_row_stride;
        const typename E::T* up = gate + d;
        typename E::T* out_row = out + row * out_row_stride;
        const int n = d / CHUNK + (d % CHUNK != 0);
        const int step = blockDim.x;
        C prepared = 0.0f;
        if (Op::ROW_STATS) {
            __shared__ C scratch[GATED_MAX_BLOCK];
            C sum = 0.0f;
        for_each_gate_value<DTYPE, VEC>(gate, n, d, step, [&](C v) { sum += v; });
        C mean = gated_block_sum(sum, scratch) / (C)d;
        C squares = 0.0f;
        for_each_gate_value<DTYPE, VEC>(gate, n, d, step, [&](C v) {
            C t = v - mean;
            squares += t * t;
        });
        C std = c_sqrt(gated_block_sum(squares, scratch) / (C)d);
        prepared = Op::template prepare<DTYPE>(mean, std, s);
        }
        // Each step issues the gate and up loads of GATED_UNROLL chunks before it converts any.
        for (int c0 = threadIdx.x; c0 < n; c0 += GATED_UNROLL * step) {
            Chunk g[GATED_UNROLL], u[GATED_UNROLL];
#pragma unroll
            for (int k = 0; k < GATED_UNROLL; ++k) {
                int c = c0 + k * step;
                if (c < n) {
                    g[k].load(gate, c, d);
                    u[k].load(up, c, d);
                }
            }
#pragma unroll
            for (int k = 0; k < GATED_UNROLL; ++k) {
                int c = c0 + k * step;
                if (c < n) {
                    typename E::T o[CHUNK];
#pragma unroll
                    for (int i = 0; i < CHUNK; ++i) {
                        C a = round_elem<DTYPE>(Op::template activate<DTYPE>(E::load(g[k].get(i)), prepared, s));
                        o[i] = E::store(a * E::load(u[k].get(i)));
                    }
                    Chunk::store(out_row, c, d, o);
                }
            }
        }
    }
}

#define GATED_KERNEL_DTYPE(name, Op, DTYPE, SUFFIX, VEC)                                                       \
    extern "C" __global__ void __launch_bounds__(GATED_MAX_BLOCK)                                  \
        name##_##SUFFIX(Elem<DTYPE>::T* __restrict__ out, const Elem<DTYPE>::T* __restrict__ x,               \
                        long long n_rows, int d, long long x_row_stride, long long out_row_stride,             \
                        Compute<DTYPE> f0, Compute<DTYPE> f1, int i0, int i1) {                                \
        gated_row<DTYPE, Op, VEC>(out, x, n_rows, d, x_row_stride, out_row_stride,                             \
                                  GateScalars<Compute<DTYPE>>{f0, f1, i0, i1});                                \
    }

// f64, a reference dtype, has no 16-byte kernel.
#define GATED_KERNELS(name, Op)                          \
    GATED_KERNEL_DTYPE(name, Op, 0, f32, false)          \
    GATED_KERNEL_DTYPE(name, Op, 0, f32_vec, true)       \
    GATED_KERNEL_DTYPE(name, Op, 1, f16, false)          \
    GATED_KERNEL_DTYPE(name, Op, 1, f16_vec, true)       \
    GATED_KERNEL_DTYPE(name, Op, 2, bf16, false)         \
    GATED_KERNEL_DTYPE(name, Op, 2, bf16_vec, true)      \
    GATED_KERNEL_DTYPE(name, Op, 6, f64, false)
