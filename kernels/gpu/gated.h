// The gated activations CUDA and HIP share: `x` is rows of 2d elements, the gate then the up
// projection; out[row, j] = round(activate(gate[j])) * up[j], rounded to the element type.
//
// Compiled after the portability header and `elem.h`, then one op's source (`silu_and_mul.h`, ...),
// which defines a struct with
//   static constexpr bool ROW_STATS;  // whether `prepare` needs the gate's row statistics
//   template <int DT> __device__ static Compute<DT> prepare(Compute<DT> mean, Compute<DT> std,
//                                                          const GateScalars<Compute<DT>>& s);
//   template <int DT> __device__ static Compute<DT> activate(Compute<DT> g, Compute<DT> prepared,
//                                                           const GateScalars<Compute<DT>>& s);
// (templated on the element type, for ops that round to it: `round_elem<DT>` of elem.h) and
// instantiates `GATED_KERNELS(<op name>, <struct>)`, which defines, for the dtypes the backend's
// `GPU_KERNEL_DTYPES` lists, the `extern "C"` kernels `<op name>_<dtype>` (scalar accesses, any
// alignment) and, except for f64, `<op name>_<dtype>_vec` (16-byte loads and stores: the host picks
// it when x's rows, their up halves and the output rows start 16-byte aligned, so d % CHUNK == 0),
// all `(out, x, n_rows, d, x_row_stride, out_row_stride, f0, f1, i0, i1)`: the op's float
// parameters in f0, f1 (in the compute type) and its string-choice, integer and boolean parameters
// in i0, i1, in declaration order.
//
// Each row is computed by one block (`GPU_ROWS`: a grid-stride loop on HIP, whose grids are capped
// at 2^32 work-items; CUDA's grid has a block per row), whose size the host picks from d alone
// (`kernel_support::gated_block`: a power of two, one step of `gated_unroll<true>()` chunks per
// thread, 64 up to GATED_MAX_BLOCK, so a row up to 16384 16-bit elements is one step of each thread
// and rows up to 8192 run blocks of at most 512 threads, two or more per SM).
// Thread t owns chunks t, t + block, ... of CHUNK elements in both kernels, so the row statistics
// (the mean and the biased standard deviation of the gate from that mean, reduced in a fixed order)
// and so every output have the same bits whichever kernel runs. Each step, a thread issues the gate
// and up loads of `gated_unroll` chunks before it converts any of them. Every value is in the
// compute type (f32; f64 for f64 elements).

#ifndef VLLM_IR_GPU_GATED_H
#define VLLM_IR_GPU_GATED_H

// The largest block (the host picks a power of two from 64 up to it from d alone).
#define GATED_MAX_BLOCK 1024

// The chunks a thread loads per step: two of 16 bytes each of the gate and up, or one chunk of
// scalar loads (CHUNK each of the gate and up: with two, ptxas spilled the sparse op's f16 kernel
// at the 64 registers a 1024-thread block leaves). A thread's chunks come in the same order either
// way, so its sums do too.
template <bool VEC>
__device__ constexpr int gated_unroll() {
    return VEC ? 2 : 1;
}

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
// two-sum a sum's), so e^w is as accurate as expf; the products and sums whose errors are taken are
// rounded on their own (`c_mul`, `c_add`, ...: either compiler would otherwise contract them into
// fmas). In f64 the plain forms are accurate enough.
__device__ __forceinline__ float gelu_tanh(float v) {
    if (v > 20.0f) return v;          // e^w below half an ulp of 1
    if (v < -20.0f) return v * 0.0f;  // below the smallest subnormal; NaN for -inf
    const float a_hi = -1.59576916694641113e+00f, a_lo = 4.53406805434042326e-08f;
    const float b_hi = -7.13548138737678528e-02f, b_lo = -2.39883246599958966e-09f;
    float v2 = c_mul(v, v), v2_lo = fmaf(v, v, -v2);
    float t = c_mul(b_hi, v2);
    float t_lo = c_add(fmaf(b_hi, v2, -t), fmaf(b_hi, v2_lo, c_mul(b_lo, v2)));
    float s = c_add(a_hi, t), bb = c_sub(s, a_hi);
    float s_err = c_add(c_sub(a_hi, c_sub(s, bb)), c_sub(t, bb));
    float s_lo = c_add(s_err, c_add(a_lo, t_lo));
    float w = c_mul(s, v), w_lo = fmaf(s_lo, v, fmaf(s, v, -w));
    bool negative = v < 0.0f;
    float u = negative ? -w : w, u_lo = negative ? -w_lo : w_lo;
    float e = expf(u);
    e = fmaf(e, u_lo, e);
    return c_div(negative ? c_mul(v, e) : v, c_add(1.0f, e));
}

__device__ __forceinline__ double gelu_tanh(double v) {
    const double k = 0.79788456080286535588;
    return v / (1.0 + exp(-2.0 * k * (v + 0.044715 * v * v * v)));
}

__device__ __forceinline__ float gelu_erf(float v) {
    if (v > 14.0f) return v;          // erfc(-v/√2) is 2 to within half an ulp
    if (v < -14.0f) return v * 0.0f;  // below the smallest subnormal; NaN for -inf
    float x = c_mul(fabsf(v), 0.70710678118654752f);
    float t = c_div(1.0f, fmaf(x, 0.5f, 1.0f));
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
    float v2 = c_mul(v, v), v2_lo = fmaf(v, v, -v2);
    float h = c_mul(v2, -0.5f);
    float a = c_add(h, q), bb = c_sub(a, h);
    float a_err = c_add(c_sub(h, c_sub(a, bb)), c_sub(q, bb));
    float a_lo = fmaf(v2_lo, -0.5f, a_err);
    float e = expf(a);
    float erfc_abs = c_mul(t, fmaf(e, a_lo, e));
    float erfc = v < 0.0f ? erfc_abs : c_sub(2.0f, erfc_abs);
    return c_mul(c_mul(0.5f, v), erfc);
}

__device__ __forceinline__ double gelu_erf(double v) { return 0.5 * v * erfc(-v * 0.70710678118654752440); }

template <typename C>
__device__ __forceinline__ C gelu(C g, int approximate) {
    return approximate == 0 ? gelu_erf(g) : gelu_tanh(g);
}

// One step of a thread's chunks of a row: chunks c0, c0 + step, ..., `gated_unroll` of them (those
// below n), of the gate and, with UP, of up (which starts d elements after the gate), their loads
// all issued before any is read.
template <int DT, bool VEC>
struct GatedStep {
    static constexpr int UNROLL = gated_unroll<VEC>();
    RowChunk<DT, VEC> g[UNROLL], u[UNROLL];

    template <bool UP>
    __device__ __forceinline__ void load(const typename Elem<DT>::T* gate, int c0, int n, int d, int step) {
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            int c = c0 + k * step;
            if (c < n) {
                g[k].load(gate, c, d);
                if (UP) u[k].load(gate + d, c, d);
            }
        }
    }

    // Calls `f` on the step's gate values, in order.
    template <typename F>
    __device__ __forceinline__ void gate_values(int c0, int n, int d, int step, F f) const {
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            int c = c0 + k * step;
#pragma unroll
            for (int i = 0; i < Elem<DT>::CHUNK; ++i) {
                if (c < n && (VEC || c * Elem<DT>::CHUNK + i < d)) f(Elem<DT>::load(g[k].get(i)));
            }
        }
    }
};

// Calls `f` on the gate values of a row this thread owns from chunk `first` on (first, first +
// step, ...), in order, a step's loads issued before any is read.
template <int DT, bool VEC, typename F>
__device__ __forceinline__ void for_each_gate_value(const typename Elem<DT>::T* gate, int first, int n, int d,
                                                    int step, F f) {
    constexpr int UNROLL = gated_unroll<VEC>();
    for (int c0 = first; c0 < n; c0 += UNROLL * step) {
        GatedStep<DT, VEC> chunks;
        chunks.template load<false>(gate, c0, n, d, step);
        chunks.gate_values(c0, n, d, step, f);
    }
}

template <int DT, typename Op, bool VEC>
__device__ __forceinline__ void gated_rows(typename Elem<DT>::T* __restrict__ out,
                                           const typename Elem<DT>::T* __restrict__ x, long long n_rows, int d,
                                           long long x_row_stride, long long out_row_stride,
                                           GateScalars<Compute<DT>> s) {
    typedef Elem<DT> E;
    typedef Compute<DT> C;
    typedef GatedStep<DT, VEC> Step;
    constexpr int CHUNK = E::CHUNK;
    const int n = d / CHUNK + (d % CHUNK != 0);
    const int step = blockDim.x;
    const int second = threadIdx.x + Step::UNROLL * step;
    GPU_ROWS(row, n_rows) {
        const typename E::T* gate = x + row * x_row_stride;
        typename E::T* out_row = out + row * out_row_stride;
        // The row's output from a loaded step.
        auto finish = [&](const Step& chunks, int c0, C prepared) {
#pragma unroll
            for (int k = 0; k < Step::UNROLL; ++k) {
                int c = c0 + k * step;
                if (c < n) {
                    typename E::T o[CHUNK];
#pragma unroll
                    for (int i = 0; i < CHUNK; ++i) {
                        C a = round_elem<DT>(Op::template activate<DT>(E::load(chunks.g[k].get(i)), prepared, s));
                        o[i] = E::store(a * E::load(chunks.u[k].get(i)));
                    }
                    RowChunk<DT, VEC>::store(out_row, c, d, o);
                }
            }
        };
        if constexpr (Op::ROW_STATS) {
            // The first step's gate and up, loaded before anything reads one and kept through the
            // statistics: a row of at most one step per thread (every row whose block the host
            // sizes to it, up to the largest block) is read once, not the gate three times.
            Step first;
            first.template load<true>(gate, threadIdx.x, n, d, step);
            __shared__ C scratch[GATED_MAX_BLOCK];
            C sum = 0.0f;
            auto add = [&](C v) { sum += v; };
            first.gate_values(threadIdx.x, n, d, step, add);
            for_each_gate_value<DT, VEC>(gate, second, n, d, step, add);
            C mean = block_sum(sum, scratch) / (C)d;
            C squares = 0.0f;
            auto add_square = [&](C v) {
                C t = v - mean;
                squares += t * t;
            };
            first.gate_values(threadIdx.x, n, d, step, add_square);
            for_each_gate_value<DT, VEC>(gate, second, n, d, step, add_square);
            C std = c_sqrt(block_sum(squares, scratch) / (C)d);
            C prepared = Op::template prepare<DT>(mean, std, s);
            finish(first, threadIdx.x, prepared);
            for (int c0 = second; c0 < n; c0 += Step::UNROLL * step) {
                Step chunks;
                chunks.template load<true>(gate, c0, n, d, step);
                finish(chunks, c0, prepared);
            }
        } else {
            // Each step issues the gate and up loads of its chunks before it converts any.
            for (int c0 = threadIdx.x; c0 < n; c0 += Step::UNROLL * step) {
                Step chunks;
                chunks.template load<true>(gate, c0, n, d, step);
                finish(chunks, c0, C(0));
            }
        }
    }
}

// Launch bounds: the largest block, and at least one block per SM (CUDA; HIP reads it as one wave
// per SIMD): given the block size alone, ptxas aimed at two blocks of 1024 per SM, 32 registers a
// thread, and spilled the sparse op's f32 and f64 kernels.
#define GATED_KERNEL(DT, SUFFIX, VEC, name, Op)                                                                \
    extern "C" __global__ void __launch_bounds__(GATED_MAX_BLOCK, 1)                                           \
        name##_##SUFFIX(Elem<DT>::T* __restrict__ out, const Elem<DT>::T* __restrict__ x, long long n_rows,    \
                        int d, long long x_row_stride, long long out_row_stride, Compute<DT> f0,               \
                        Compute<DT> f1, int i0, int i1) {                                                      \
        gated_rows<DT, Op, VEC>(out, x, n_rows, d, x_row_stride, out_row_stride,                               \
                                GateScalars<Compute<DT>>{f0, f1, i0, i1});                                     \
    }

#define GATED_KERNELS(name, Op) GPU_KERNEL_DTYPES(GATED_KERNEL, name, Op)

#endif  // VLLM_IR_GPU_GATED_H
