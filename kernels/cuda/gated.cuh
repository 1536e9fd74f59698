// The gated activations of the `cuda` provider: `x` is rows of 2d elements, the gate then the up
// projection; `out[row, j] = round(round(act(gate_j)) * up_j)` is rows of d elements.
//
// The crate compiles `element.cuh`, this file and one op's source, in that order, per dtype. The op
// source defines a struct with
//   static constexpr bool ROW_STATS;            // whether `prepare` needs the gate's mean and std
//   __device__ static compute_t prepare(compute_t mean, compute_t std, const GateScalars& s);
//   __device__ static compute_t activate(compute_t g, compute_t prepared, const GateScalars& s);
// and instantiates `GATED_KERNEL(<op name>, <struct>)`, which defines `extern "C"` kernel
// `<op name>_<dtype>(out, x, n_rows, d, x_row_stride, out_row_stride, f0, f1, i0, i1)`: the op's float
// parameters in f0, f1 and its string-choice, integer and boolean parameters in i0, i1, in
// declaration order. One block of GATED_BLOCK threads per row. The row statistics are the mean and
// the biased standard deviation (from that mean) of the gate, reduced in a fixed order. Every value
// is in the compute type (element.cuh: f32; f64 for f64 elements).

#define GATED_BLOCK 256

struct GateScalars {
    compute_t f0, f1;
    int i0, i1;
};

__device__ __forceinline__ compute_t silu(compute_t g) { return g / (LIT(1.0) + c_exp(-g)); }

__device__ __forceinline__ compute_t gelu(compute_t g, int approximate) {
    if (approximate == 0) return LIT(0.5) * g * (LIT(1.0) + c_erf(g * LIT(0.70710678118654752440)));
    const compute_t k = LIT(0.79788456080286535588);
    return LIT(0.5) * g * (LIT(1.0) + c_tanh(k * (g + LIT(0.044715) * g * g * g)));
}

// Sums `value` over the block in a fixed tree order; every thread gets the total.
__device__ __forceinline__ compute_t gated_block_sum(compute_t value, compute_t* scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = GATED_BLOCK / 2; width > 0; width >>= 1) {
        if (threadIdx.x < width) scratch[threadIdx.x] += scratch[threadIdx.x + width];
        __syncthreads();
    }
    compute_t total = scratch[0];
    __syncthreads();
    return total;
}

template <typename Op>
__device__ __forceinline__ void gated_row(elem_t* __restrict__ out, const elem_t* __restrict__ x, long long n_rows,
                                          int d, long long x_row_stride, long long out_row_stride,
                                          GateScalars s) {
    long long row = blockIdx.x;
    if (row >= n_rows) return;
    const elem_t* gate = x + row * x_row_stride;
    const elem_t* up = gate + d;
    elem_t* out_row = out + row * out_row_stride;
    compute_t prepared = 0.0f;
    if (Op::ROW_STATS) {
        __shared__ compute_t scratch[GATED_BLOCK];
        compute_t sum = 0.0f;
        for (int j = threadIdx.x; j < d; j += GATED_BLOCK) sum += to_c(gate[j]);
        compute_t mean = gated_block_sum(sum, scratch) / (compute_t)d;
        compute_t squares = 0.0f;
        for (int j = threadIdx.x; j < d; j += GATED_BLOCK) {
            compute_t t = to_c(gate[j]) - mean;
            squares += t * t;
        }
        compute_t std = c_sqrt(gated_block_sum(squares, scratch) / (compute_t)d);
        prepared = Op::prepare(mean, std, s);
    }
    for (int j = threadIdx.x; j < d; j += GATED_BLOCK) {
        compute_t a = round_elem(Op::activate(to_c(gate[j]), prepared, s));
        out_row[j] = from_c(a * to_c(up[j]));
    }
}

#define GATED_KERNEL(name, Op)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GATED_BLOCK)                                                  \
        CONCAT(name, KERNEL_SUFFIX)(elem_t* __restrict__ out, const elem_t* __restrict__ x, long long n_rows,  \
                                    int d, long long x_row_stride, long long out_row_stride, compute_t f0, compute_t f1, \
                                    int i0, int i1) {                                                           \
        gated_row<Op>(out, x, n_rows, d, x_row_stride, out_row_stride, GateScalars{f0, f1, i0, i1});            \
    }
