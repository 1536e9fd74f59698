// The gated activations of the `cuda` provider: `x` is rows of 2d elements, the gate then the up
// projection; `out[row, j] = round(round(act(gate_j)) * up_j)` is rows of d elements.
//
// The crate compiles `element.cuh`, this file and one op's source, in that order, per dtype. The op
// source defines a struct with
//   static constexpr bool ROW_STATS;            // whether `prepare` needs the gate's mean and std
//   __device__ static compute_t prepare(compute_t mean, compute_t std, const GateScalars& s);
//   __device__ static compute_t activate(compute_t g, compute_t prepared, const GateScalars& s);
// and instantiates `GATED_KERNEL(<op name>, <struct>)`, which defines the `extern "C"` kernels
// `<op name>_<dtype>` (scalar accesses, any alignment) and, except for f64, `<op name>_<dtype>_vec`
// (16-byte loads and stores: the host picks it when x's rows, their up halves and the output rows
// start 16-byte aligned, so d % CHUNK == 0), both `(out, x, n_rows, d, x_row_stride,
// out_row_stride, f0, f1, i0, i1)`: the op's float parameters in f0, f1 and its string-choice,
// integer and boolean parameters in i0, i1, in declaration order.
//
// One block per row, of a power of two of threads the host picks from d alone (one 16-byte chunk
// per thread, 64 up to GATED_MAX_BLOCK). Thread t owns chunks t, t + block, ... of CHUNK elements
// in both kernels, so the row statistics (the mean and the biased standard deviation of the gate
// from that mean, reduced in a fixed order) and so every output have the same bits whichever kernel
// runs. Each step, a thread issues the gate and up loads of GATED_UNROLL chunks before it converts
// any of them. Every value is in the compute type (element.cuh: f32; f64 for f64 elements).

// The largest block (the host picks a power of two from 64 up to it from d alone) and the chunks a
// thread loads per step.
#define GATED_MAX_BLOCK 1024
#define GATED_UNROLL 2

struct GateScalars {
    compute_t f0, f1;
    int i0, i1;
};

__device__ __forceinline__ compute_t silu(compute_t g) { return g / (LIT(1.0) + c_exp(-g)); }

// gelu without cancellation in the negative tail, where `0.5·v·(1 + tanh z)` and
// `0.5·v·(1 + erf(v/√2))` subtract numbers near 1 (the derivation is in the cpu provider's
// `activation` module, which computes the same forms):
// - tanh: v / (1 + e^w), w = -2z = v·(A + B·v²), as v·e^-w / (1 + e^-w) for v < 0 (no overflow);
// - erf: 0.5·v·erfc(-v/√2), erfc(x) = t·e^(-x² + Q(t)), t = 1 / (1 + x/2) (Numerical Recipes'
//   Chebyshev fit, fractional error below 1.2e-7), erfc(-x) = 2 - erfc(x).
// In f32 each exponent is carried in two floats (fmaf gives a product's rounding error exactly, the
// two-sum a sum's), so e^w is as accurate as expf; the products and sums whose errors are taken are
// rounded on their own (`__fmul_rn`, `__fadd_rn`: NVRTC would otherwise contract them into fmas).
// In f64 the plain forms are accurate enough.
__device__ __forceinline__ float gelu_tanh(float v) {
    if (v > 20.0f) return v;          // e^w below half an ulp of 1
    if (v < -20.0f) return v * 0.0f;  // below the smallest subnormal; NaN for -inf
    const float a_hi = -1.59576916694641113e+00f, a_lo = 4.53406805434042326e-08f;
    const float b_hi = -7.13548138737678528e-02f, b_lo = -2.39883246599958966e-09f;
    float v2 = __fmul_rn(v, v), v2_lo = fmaf(v, v, -v2);
    float t = __fmul_rn(b_hi, v2);
    float t_lo = __fadd_rn(fmaf(b_hi, v2, -t), fmaf(b_hi, v2_lo, __fmul_rn(b_lo, v2)));
    float s = __fadd_rn(a_hi, t), bb = __fsub_rn(s, a_hi);
    float s_err = __fadd_rn(__fsub_rn(a_hi, __fsub_rn(s, bb)), __fsub_rn(t, bb));
    float s_lo = __fadd_rn(s_err, __fadd_rn(a_lo, t_lo));
    float w = __fmul_rn(s, v), w_lo = fmaf(s_lo, v, fmaf(s, v, -w));
    bool negative = v < 0.0f;
    float u = negative ? -w : w, u_lo = negative ? -w_lo : w_lo;
    float e = expf(u);
    e = fmaf(e, u_lo, e);
    return __fdiv_rn(negative ? __fmul_rn(v, e) : v, __fadd_rn(1.0f, e));
}

__device__ __forceinline__ double gelu_tanh(double v) {
    const double k = 0.79788456080286535588;
    return v / (1.0 + exp(-2.0 * k * (v + 0.044715 * v * v * v)));
}

__device__ __forceinline__ float gelu_erf(float v) {
    if (v > 14.0f) return v;          // erfc(-v/√2) is 2 to within half an ulp
    if (v < -14.0f) return v * 0.0f;  // below the smallest subnormal; NaN for -inf
    float x = __fmul_rn(fabsf(v), 0.70710678118654752f);
    float t = __fdiv_rn(1.0f, fmaf(x, 0.5f, 1.0f));
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
    float v2 = __fmul_rn(v, v), v2_lo = fmaf(v, v, -v2);
    float h = __fmul_rn(v2, -0.5f);
    float a = __fadd_rn(h, q), bb = __fsub_rn(a, h);
    float a_err = __fadd_rn(__fsub_rn(h, __fsub_rn(a, bb)), __fsub_rn(q, bb));
    float a_lo = fmaf(v2_lo, -0.5f, a_err);
    float e = expf(a);
    float erfc_abs = __fmul_rn(t, fmaf(e, a_lo, e));
    float erfc = v < 0.0f ? erfc_abs : __fsub_rn(2.0f, erfc_abs);
    return __fmul_rn(__fmul_rn(0.5f, v), erfc);
}

__device__ __forceinline__ double gelu_erf(double v) { return 0.5 * v * erfc(-v * 0.70710678118654752440); }

__device__ __forceinline__ compute_t gelu(compute_t g, int approximate) {
    return approximate == 0 ? gelu_erf(g) : gelu_tanh(g);
}

// Sums `value` over the block (blockDim.x threads, a power of two) in a fixed tree order; every
// thread gets the total.
__device__ __forceinline__ compute_t gated_block_sum(compute_t value, compute_t* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = blockDim.x / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] += scratch[threadIdx.x + width];
        __syncthreads();
    }
    compute_t total = scratch[0];
    __syncthreads();
    return total;
}

// Calls `f` on every gate value of a row this thread owns (chunks t, t + step, ...), in order,
// the loads of GATED_UNROLL chunks issued before any is read.
template <bool VEC, typename F>
__device__ __forceinline__ void for_each_gate_value(const elem_t* gate, int n, int d, int step, F f) {
    for (int c0 = threadIdx.x; c0 < n; c0 += GATED_UNROLL * step) {
        row_chunk_t g[GATED_UNROLL];
#pragma unroll
        for (int k = 0; k < GATED_UNROLL; ++k) {
            int c = c0 + k * step;
            if (c < n) load_row_chunk<VEC>(gate, c, d, g[k]);
        }
#pragma unroll
        for (int k = 0; k < GATED_UNROLL; ++k) {
            int c = c0 + k * step;
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) {
                if (c < n && (VEC || c * CHUNK + i < d)) f(to_c(g[k].v[i]));
            }
        }
    }
}

template <typename Op, bool VEC>
__device__ __forceinline__ void gated_row(elem_t* __restrict__ out, const elem_t* __restrict__ x, long long n_rows,
                                          int d, long long x_row_stride, long long out_row_stride,
                                          GateScalars s) {
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* gate = x + row * x_row_stride;
    const elem_t* up = gate + d;
    elem_t* out_row = out + row * out_row_stride;
    const int n = d / CHUNK + (d % CHUNK != 0);
    const int step = blockDim.x;
    compute_t prepared = 0.0f;
    if (Op::ROW_STATS) {
        __shared__ compute_t scratch[GATED_MAX_BLOCK];
        compute_t sum = 0.0f;
        for_each_gate_value<VEC>(gate, n, d, step, [&](compute_t v) { sum += v; });
        compute_t mean = gated_block_sum(sum, scratch) / (compute_t)d;
        compute_t squares = 0.0f;
        for_each_gate_value<VEC>(gate, n, d, step, [&](compute_t v) {
            compute_t t = v - mean;
            squares += t * t;
        });
        compute_t std = c_sqrt(gated_block_sum(squares, scratch) / (compute_t)d);
        prepared = Op::prepare(mean, std, s);
    }
    // Each step issues the gate and up loads of GATED_UNROLL chunks before it converts any.
    for (int c0 = threadIdx.x; c0 < n; c0 += GATED_UNROLL * step) {
        row_chunk_t g[GATED_UNROLL], u[GATED_UNROLL];
#pragma unroll
        for (int k = 0; k < GATED_UNROLL; ++k) {
            int c = c0 + k * step;
            if (c < n) {
                load_row_chunk<VEC>(gate, c, d, g[k]);
                load_row_chunk<VEC>(up, c, d, u[k]);
            }
        }
#pragma unroll
        for (int k = 0; k < GATED_UNROLL; ++k) {
            int c = c0 + k * step;
            if (c < n) {
                row_chunk_t o;
#pragma unroll
                for (int i = 0; i < CHUNK; ++i) {
                    compute_t a = round_elem(Op::activate(to_c(g[k].v[i]), prepared, s));
                    o.v[i] = from_c(a * to_c(u[k].v[i]));
                }
                store_row_chunk<VEC>(out_row, c, d, o);
            }
        }
    }
}

// f64, a reference dtype, has no 16-byte kernel.
#if DTYPE == 6
#define GATED_VEC_KERNEL(name, Op)
#else
#define GATED_VEC_KERNEL(name, Op)                                                                              \
    extern "C" __global__ void __launch_bounds__(GATED_MAX_BLOCK)                                              \
        CONCAT(CONCAT(name, KERNEL_SUFFIX), vec)(elem_t* __restrict__ out, const elem_t* __restrict__ x,       \
                                                 long long n_rows, int d, long long x_row_stride,              \
                                                 long long out_row_stride, compute_t f0, compute_t f1, int i0,  \
                                                 int i1) {                                                      \
        gated_row<Op, true>(out, x, n_rows, d, x_row_stride, out_row_stride, GateScalars{f0, f1, i0, i1});      \
    }
#endif

#define GATED_KERNEL(name, Op)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GATED_MAX_BLOCK)                                              \
        CONCAT(name, KERNEL_SUFFIX)(elem_t* __restrict__ out, const elem_t* __restrict__ x, long long n_rows,  \
                                    int d, long long x_row_stride, long long out_row_stride, compute_t f0, compute_t f1, \
                                    int i0, int i1) {                                                           \
        gated_row<Op, false>(out, x, n_rows, d, x_row_stride, out_row_stride, GateScalars{f0, f1, i0, i1});     \
    }                                                                                                           \
    GATED_VEC_KERNEL(name, Op)
