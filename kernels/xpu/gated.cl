// The gated activations of the `xpu` provider (OpenCL C 1.2): `x` is rows of 2d elements, the gate
// then the up projection; `out[row, j] = round(round(act(gate_j)) * up_j)` is compact rows of d.
//
// The crate builds `element.cl`, this file and one op's source, in that order, per dtype. The op
// source defines
//   compute_t <op>_prepare(compute_t mean, compute_t std, compute_t f0, compute_t f1, int i0, int i1);
//   compute_t <op>_activate(compute_t g, compute_t prepared, compute_t f0, compute_t f1, int i0, int i1);
// and instantiates `GATED_KERNEL(<op>, <row stats: 0 or 1>, <op>_prepare, <op>_activate)`, which
// defines kernel `<op>_<dtype>(out, x, n_rows, d, x_row_stride, x_offset, f0, f1, i0, i1)`: the op's
// float parameters in f0, f1 and its string-choice, integer and boolean parameters in i0, i1, in
// declaration order. One work-group of GATED_GROUP work-items per row. With row statistics, `prepare`
// receives the mean and the biased standard deviation (from that mean) of the gate, reduced in a
// fixed order. Every value is in the compute dtype (f32; f64 for f64 elements). No fast-math options.

#define GATED_GROUP 128

inline compute_t silu(compute_t g) { return g / (1.0f + exp(-g)); }

inline compute_t gelu(compute_t g, int approximate) {
    if (approximate == 0) return 0.5f * g * (1.0f + erf(g * LIT(0.70710678118654752440)));
    const compute_t k = LIT(0.79788456080286535588);
    return 0.5f * g * (1.0f + tanh(k * (g + LIT(0.044715) * g * g * g)));
}

// Sums `value` over the work-group in a fixed tree order; every work-item gets the total.
inline compute_t gated_group_sum(compute_t value, __local compute_t* scratch) {
    int id = get_local_id(0);
    scratch[id] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int width = GATED_GROUP / 2; width > 0; width >>= 1) {
        if (id < width) scratch[id] += scratch[id + width];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    compute_t total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

// The mean and biased standard deviation of the d gate elements of a row, in the compute dtype.
inline void gated_stats(__global const elem_t* gate, int d, __local compute_t* scratch, compute_t* mean_out,
                        compute_t* std_out) {
    compute_t sum = 0.0f;
    for (long j = get_local_id(0); j < d; j += GATED_GROUP) sum += LOAD(gate, j);
    compute_t mean = gated_group_sum(sum, scratch) / (compute_t)d;
    compute_t squares = 0.0f;
    for (long j = get_local_id(0); j < d; j += GATED_GROUP) {
        compute_t t = LOAD(gate, j) - mean;
        squares += t * t;
    }
    *mean_out = mean;
    *std_out = sqrt(gated_group_sum(squares, scratch) / (compute_t)d);
}

#define GATED_KERNEL(name, row_stats, prepare, activate)                                                      \
    __kernel __attribute__((reqd_work_group_size(GATED_GROUP, 1, 1))) void NAME(name)(                        \
        __global elem_t* out, __global const elem_t* x, long n_rows, int d, long x_row_stride, long x_offset,   \
        compute_t f0, compute_t f1, int i0, int i1) {                                                                  \
        __local compute_t scratch[GATED_GROUP];                                                                    \
        long row = get_group_id(0);                                                                            \
        __global const elem_t* gate = x + x_offset + row * x_row_stride;                                       \
        __global elem_t* out_row = out + row * (long)d;                                                        \
        compute_t prepared = 0.0f;                                                                                 \
        if (row_stats) {                                                                                       \
            compute_t mean, std;                                                                               \
            gated_stats(gate, d, scratch, &mean, &std);                                                        \
            prepared = prepare(mean, std, f0, f1, i0, i1);                                                     \
        }                                                                                                      \
        for (long j = get_local_id(0); j < d; j += GATED_GROUP) {                                              \
            compute_t a = round_to_elem(activate(LOAD(gate, j), prepared, f0, f1, i0, i1));                        \
            STORE(out_row, j, a * LOAD(gate, d + j));                                                          \
        }                                                                                                      \
    }
