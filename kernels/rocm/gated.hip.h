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
// `<op name>_<dtype>(out, x, n_rows, d, x_row_stride, out_row_stride, f0, f1, i0, i1)` for f32, f16,
// bf16 and f64: the op's float parameters in f0, f1 (in the compute type) and its string-choice,
// integer and boolean parameters in i0, i1, in declaration order. One block of GATED_BLOCK threads
// per row. The row statistics are the mean and the biased standard deviation (from that mean) of
// the gate, reduced in a fixed order. Every value is in the compute type (f32; f64 for f64
// elements). The numerics are those of the CUDA kernels.

#pragma once

#include "element.hip.h"

#define GATED_BLOCK 256

template <typename C>
struct GateScalars {
    C f0, f1;
    int i0, i1;
};

template <typename C>
__device__ __forceinline__ C silu(C g) {
    return g / (LIT(C, 1.0) + c_exp(-g));
}

template <typename C>
__device__ __forceinline__ C gelu(C g, int approximate) {
    if (approximate == 0) return LIT(C, 0.5) * g * (LIT(C, 1.0) + c_erf(g * LIT(C, 0.70710678118654752440)));
    const C k = LIT(C, 0.79788456080286535588);
    return LIT(C, 0.5) * g * (LIT(C, 1.0) + c_tanh(k * (g + LIT(C, 0.044715) * g * g * g)));
}

// Sums `value` over the block in a fixed tree order; every thread gets the total.
template <typename C>
__device__ __forceinline__ C gated_block_sum(C value, C* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = GATED_BLOCK / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] += scratch[threadIdx.x + width];
        __syncthreads();
    }
    C total = scratch[0];
    __syncthreads();
    return total;
}

template <int DTYPE, typename Op>
__device__ __forceinline__ void gated_row(typename Elem<DTYPE>::T* __restrict__ out,
                                          const typename Elem<DTYPE>::T* __restrict__ x, long long n_rows, int d,
                                          long long x_row_stride, long long out_row_stride,
                                          GateScalars<Compute<DTYPE>> s) {
    typedef Elem<DTYPE> E;
    typedef Compute<DTYPE> C;
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const typename E::T* gate = x + row * x_row_stride;
    const typename E::T* up = gate + d;
    typename E::T* out_row = out + row * out_row_stride;
    C prepared = 0.0f;
    if (Op::ROW_STATS) {
        __shared__ C scratch[GATED_BLOCK];
        C sum = 0.0f;
        for (int j = threadIdx.x; j < d; j += GATED_BLOCK) sum += E::load(gate[j]);
        C mean = gated_block_sum(sum, scratch) / (C)d;
        C squares = 0.0f;
        for (int j = threadIdx.x; j < d; j += GATED_BLOCK) {
            C t = E::load(gate[j]) - mean;
            squares += t * t;
        }
        C std = c_sqrt(gated_block_sum(squares, scratch) / (C)d);
        prepared = Op::template prepare<DTYPE>(mean, std, s);
    }
    for (int j = threadIdx.x; j < d; j += GATED_BLOCK) {
        C a = round_elem<DTYPE>(Op::template activate<DTYPE>(E::load(gate[j]), prepared, s));
        out_row[j] = E::store(a * E::load(up[j]));
    }
}

#define GATED_KERNEL_DTYPE(name, Op, DTYPE, SUFFIX)                                                            \
    extern "C" __global__ void __launch_bounds__(GATED_BLOCK)                                                  \
        name##_##SUFFIX(Elem<DTYPE>::T* __restrict__ out, const Elem<DTYPE>::T* __restrict__ x,               \
                        long long n_rows, int d, long long x_row_stride, long long out_row_stride,             \
                        Compute<DTYPE> f0, Compute<DTYPE> f1, int i0, int i1) {                                \
        gated_row<DTYPE, Op>(out, x, n_rows, d, x_row_stride, out_row_stride,                                  \
                             GateScalars<Compute<DTYPE>>{f0, f1, i0, i1});                                     \
    }

#define GATED_KERNELS(name, Op)               \
    GATED_KERNEL_DTYPE(name, Op, 0, f32)      \
    GATED_KERNEL_DTYPE(name, Op, 1, f16)      \
    GATED_KERNEL_DTYPE(name, Op, 2, bf16)     \
    GATED_KERNEL_DTYPE(name, Op, 6, f64)
