// The gated activations of the `xpu` provider (OpenCL C 1.2): `x` is rows of 2d elements, the gate
// then the up projection; `out[row, j] = round(round(act(gate_j)) * up_j)` is compact rows of d.
//
// The crate builds `element.cl`, this file and one op's source, in that order, per dtype. The op
// source defines
//   float <op>_prepare(float mean, float std, float f0, float f1, int i0, int i1);
//   float <op>_activate(float g, float prepared, float f0, float f1, int i0, int i1);
// and instantiates `GATED_KERNEL(<op>, <row stats: 0 or 1>, <op>_prepare, <op>_activate)`, which
// defines kernel `<op>_<dtype>(out, x, n_rows, d, x_row_stride, x_offset, f0, f1, i0, i1)`: the op's
// float parameters in f0, f1 and its string-choice, integer and boolean parameters in i0, i1, in
// declaration order. One work-group of GATED_GROUP work-items per row. With row statistics, `prepare`
// receives the f32 mean and the biased standard deviation (from the f32 mean) of the gate, reduced
// in a fixed order. No fast-math options.

#define GATED_GROUP 128

inline float silu_f32(float g) { return g / (1.0f + exp(-g)); }

inline float gelu_f32(float g, int approximate) {
    if (approximate == 0) return 0.5f * g * (1.0f + erf(g * 0.70710678118654752f));
    const float k = 0.79788456080286536f;
    return 0.5f * g * (1.0f + tanh(k * (g + 0.044715f * g * g * g)));
}

// Sums `value` over the work-group in a fixed tree order; every work-item gets the total.
inline float gated_group_sum(float value, __local float* scratch) {
    int id = get_local_id(0);
    scratch[id] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int width = GATED_GROUP / 2; width > 0; width >>= 1) {
        if (id < width) scratch[id] += scratch[id + width];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

// The f32 mean and biased standard deviation of the d gate elements of a row.
inline float2 gated_stats(__global const elem_t* gate, int d, __local float* scratch) {
    float sum = 0.0f;
    for (long j = get_local_id(0); j < d; j += GATED_GROUP) sum += LOAD(gate, j);
    float mean = gated_group_sum(sum, scratch) / (float)d;
    float squares = 0.0f;
    for (long j = get_local_id(0); j < d; j += GATED_GROUP) {
        float t = LOAD(gate, j) - mean;
        squares += t * t;
    }
    return (float2)(mean, sqrt(gated_group_sum(squares, scratch) / (float)d));
}

#define GATED_KERNEL(name, row_stats, prepare, activate)                                                      \
    __kernel __attribute__((reqd_work_group_size(GATED_GROUP, 1, 1))) void NAME(name)(                        \
        __global elem_t* out, __global const elem_t* x, long n_rows, int d, long x_row_stride, long x_offset,   \
        float f0, float f1, int i0, int i1) {                                                                  \
        __local float scratch[GATED_GROUP];                                                                    \
        long row = get_group_id(0);                                                                            \
        __global const elem_t* gate = x + x_offset + row * x_row_stride;                                       \
        __global elem_t* out_row = out + row * (long)d;                                                        \
        float prepared = 0.0f;                                                                                 \
        if (row_stats) {                                                                                       \
            float2 stats = gated_stats(gate, d, scratch);                                                      \
            prepared = prepare(stats.x, stats.y, f0, f1, i0, i1);                                              \
        }                                                                                                      \
        for (long j = get_local_id(0); j < d; j += GATED_GROUP) {                                              \
            float a = round_to_elem(activate(LOAD(gate, j), prepared, f0, f1, i0, i1));                        \
            STORE(out_row, j, a * LOAD(gate, d + j));                                                          \
        }                                                                                                      \
    }
