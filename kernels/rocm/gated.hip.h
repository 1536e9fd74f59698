// The gated activations of the `rocm` provider: `x` is rows of 2d elements, the gate then the up
// projection; `out[row, j] = round(round(act(gate_j)) * up_j)` is rows of d elements.
//
// Each op source includes this header, defines a struct with
//   static constexpr bool ROW_STATS;            // whether `prepare` needs the gate's mean and std
//   template <int DTYPE> __device__ static float prepare(float mean, float std, const GateScalars& s);
//   template <int DTYPE> __device__ static float activate(float g, float prepared, const GateScalars& s);
// (templated on the element type, for ops that round to it: `round_elem<DTYPE>` of element.hip.h)
// and instantiates `GATED_KERNELS(<op name>, <struct>)`, which defines the `extern "C"` kernels
// `<op name>_<dtype>(out, x, n_rows, d, x_row_stride, out_row_stride, f0, f1, i0, i1)` for f32, f16
// and bf16: the op's float parameters in f0, f1 and its string-choice, integer and boolean
// parameters in i0, i1, in declaration order. One block of GATED_BLOCK threads per row. The row
// statistics are the f32 mean and the biased standard deviation (from the f32 mean) of the gate,
// reduced in a fixed order. The numerics are those of the CUDA kernels.

#pragma once

#include "element.hip.h"

#define GATED_BLOCK 256

struct GateScalars {
    float f0, f1;
    int i0, i1;
};

__device__ __forceinline__ float silu_f32(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ float gelu_f32(float g, int approximate) {
    if (approximate == 0) return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    const float k = 0.79788456080286536f;
    return 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g)));
}

// Sums `value` over the block in a fixed tree order; every thread gets the total.
__device__ __forceinline__ float gated_block_sum(float value, float* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = GATED_BLOCK / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] += scratch[threadIdx.x + width];
        __syncthreads();
    }
    float total = scratch[0];
    __syncthreads();
    return total;
}

template <int DTYPE, typename Op>
__device__ __forceinline__ void gated_row(typename Elem<DTYPE>::T* __restrict__ out,
                                          const typename Elem<DTYPE>::T* __restrict__ x, long long n_rows, int d,
                                          long long x_row_stride, long long out_row_stride, GateScalars s) {
    typedef Elem<DTYPE> E;
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const typename E::T* gate = x + row * x_row_stride;
    const typename E::T* up = gate + d;
    typename E::T* out_row = out + row * out_row_stride;
    float prepared = 0.0f;
    if (Op::ROW_STATS) {
        __shared__ float scratch[GATED_BLOCK];
        float sum = 0.0f;
        for (int j = threadIdx.x; j < d; j += GATED_BLOCK) sum += E::load(gate[j]);
        float mean = gated_block_sum(sum, scratch) / (float)d;
        float squares = 0.0f;
        for (int j = threadIdx.x; j < d; j += GATED_BLOCK) {
            float t = E::load(gate[j]) - mean;
            squares += t * t;
        }
        float std = sqrtf(gated_block_sum(squares, scratch) / (float)d);
        prepared = Op::template prepare<DTYPE>(mean, std, s);
    }
    for (int j = threadIdx.x; j < d; j += GATED_BLOCK) {
        float a = round_elem<DTYPE>(Op::template activate<DTYPE>(E::load(gate[j]), prepared, s));
        out_row[j] = E::store(a * E::load(up[j]));
    }
}

#define GATED_KERNEL_DTYPE(name, Op, DTYPE, SUFFIX)                                                            \
    extern "C" __global__ void __launch_bounds__(GATED_BLOCK)                                                  \
        name##_##SUFFIX(Elem<DTYPE>::T* __restrict__ out, const Elem<DTYPE>::T* __restrict__ x,               \
                        long long n_rows, int d, long long x_row_stride, long long out_row_stride, float f0,   \
                        float f1, int i0, int i1) {                                                            \
        gated_row<DTYPE, Op>(out, x, n_rows, d, x_row_stride, out_row_stride, GateScalars{f0, f1, i0, i1});     \
    }

#define GATED_KERNELS(name, Op)               \
    GATED_KERNEL_DTYPE(name, Op, 0, f32)      \
    GATED_KERNEL_DTYPE(name, Op, 1, f16)      \
    GATED_KERNEL_DTYPE(name, Op, 2, bf16)
