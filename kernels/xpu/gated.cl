// The gated activations of the `xpu` provider (OpenCL C 1.2): `x` is rows of 2d elements, the gate
// then the up projection; `out[row, j] = round(round(act(gate_j)) * up_j)` is compact rows of d.
//
// The crate builds `element.cl`, this file and one op's source, in that order, per dtype. The op
// source defines
//   compute_t <op>_prepare(compute_t mean, compute_t std, compute_t f0, compute_t f1, int i0, int i1);
//   compute_t <op>_activate(compute_t g, compute_t prepared, compute_t f0, compute_t f1, int i0, int i1);
// and instantiates `GATED_KERNEL(<op>, <row stats: 0 or 1>, <op>_prepare, <op>_activate)`, which
// defines kernel `<op>_<dtype>(out, out_offset, x, x_offset, n_rows, d, x_row_stride, out_row_stride,
// f0, f1, i0, i1)` (each buffer followed by its element offset): the op's
// float parameters in f0, f1 and its string-choice, integer and boolean parameters in i0, i1, in
// declaration order. One work-group of GATED_GROUP work-items per row, each owning whole 16-byte
// chunks of the row (`load_chunk`, element.cl). With row statistics, `prepare`
// receives the mean and the biased standard deviation (from that mean) of the gate, reduced in a
// fixed order. Every value is in the compute dtype (f32; f64 for f64 elements). No fast-math options.

#define GATED_GROUP 128

inline compute_t silu(compute_t g) { return g / (1.0f + exp(-g)); }

// gelu without cancellation in the negative tail, where `0.5·v·(1 + tanh z)` and
// `0.5·v·(1 + erf(v/√2))` subtract numbers near 1 (the derivation is in the cpu provider's
// `activation` module, which computes the same forms):
// - tanh: v / (1 + e^w), w = -2z = v·(A + B·v²), as v·e^-w / (1 + e^-w) for v < 0 (no overflow);
// - erf: 0.5·v·erfc(-v/√2), erfc(x) = t·e^(-x² + Q(t)), t = 1 / (1 + x/2) (Numerical Recipes'
//   Chebyshev fit, fractional error below 1.2e-7), erfc(-x) = 2 - erfc(x).
// In f32 each exponent is carried in two floats (fma gives a product's rounding error exactly, the
// two-sum a sum's), so e^w is as accurate as exp; contraction is off, so every other product and
// sum rounds on its own as the two-float steps need. In f64 the plain forms are accurate enough.
#if DTYPE == 6
inline compute_t gelu_tanh(compute_t v) {
    const double k = 0.79788456080286535588;
    return v / (1.0 + exp(-2.0 * k * (v + 0.044715 * v * v * v)));
}

inline compute_t gelu_erf(compute_t v) { return 0.5 * v * erfc(-v * 0.70710678118654752440); }
#else
inline float gelu_tanh(float v) {
#pragma OPENCL FP_CONTRACT OFF
    if (v > 20.0f) return v;          // e^w below half an ulp of 1
    if (v < -20.0f) return v * 0.0f;  // below the smallest subnormal; NaN for -inf
    const float a_hi = -1.59576916694641113e+00f, a_lo = 4.53406805434042326e-08f;
    const float b_hi = -7.13548138737678528e-02f, b_lo = -2.39883246599958966e-09f;
    float v2 = v * v, v2_lo = fma(v, v, -v2);
    float t = b_hi * v2;
    float t_lo = fma(b_hi, v2, -t) + fma(b_hi, v2_lo, b_lo * v2);
    float s = a_hi + t, bb = s - a_hi;
    float s_lo = ((a_hi - (s - bb)) + (t - bb)) + (a_lo + t_lo);
    float w = s * v, w_lo = fma(s_lo, v, fma(s, v, -w));
    int negative = v < 0.0f;
    float u = negative ? -w : w, u_lo = negative ? -w_lo : w_lo;
    float e = exp(u);
    e = fma(e, u_lo, e);
    return (negative ? v * e : v) / (1.0f + e);
}

inline float gelu_erf(float v) {
#pragma OPENCL FP_CONTRACT OFF
    if (v > 14.0f) return v;          // erfc(-v/√2) is 2 to within half an ulp
    if (v < -14.0f) return v * 0.0f;  // below the smallest subnormal; NaN for -inf
    float x = fabs(v) * 0.70710678118654752f;
    float t = 1.0f / fma(x, 0.5f, 1.0f);
    float q = 0.17087277f;
    q = fma(q, t, -0.82215223f);
    q = fma(q, t, 1.48851587f);
    q = fma(q, t, -1.13520398f);
    q = fma(q, t, 0.27886807f);
    q = fma(q, t, -0.18628806f);
    q = fma(q, t, 0.09678418f);
    q = fma(q, t, 0.37409196f);
    q = fma(q, t, 1.00002368f);
    q = fma(q, t, -1.26551223f);
    float v2 = v * v, v2_lo = fma(v, v, -v2);
    float h = v2 * -0.5f;
    float a = h + q, bb = a - h;
    float a_lo = fma(v2_lo, -0.5f, (h - (a - bb)) + (q - bb));
    float e = exp(a);
    float erfc_abs = t * fma(e, a_lo, e);
    float erfc_v = v < 0.0f ? erfc_abs : 2.0f - erfc_abs;
    return (0.5f * v) * erfc_v;
}
#endif

inline compute_t gelu(compute_t g, int approximate) { return approximate == 0 ? gelu_erf(g) : gelu_tanh(g); }

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
    const long n = CHUNKS(d);
    compute_t sum = 0.0f;
    for (long c = get_local_id(0); c < n; c += GATED_GROUP) {
        compute_t g[CHUNK];
        load_chunk(gate, c, d, g);
        for (int i = 0; i < CHUNK; ++i) sum += g[i];  // past d: zero
    }
    compute_t mean = gated_group_sum(sum, scratch) / (compute_t)d;
    compute_t squares = 0.0f;
    for (long c = get_local_id(0); c < n; c += GATED_GROUP) {
        compute_t g[CHUNK];
        load_chunk(gate, c, d, g);
        for (int i = 0; i < CHUNK; ++i) {
            compute_t t = g[i] - mean;
            if (c * CHUNK + i < d) squares += t * t;
        }
    }
    *mean_out = mean;
    *std_out = sqrt(gated_group_sum(squares, scratch) / (compute_t)d);
}

// Each work-item owns chunks lid, lid + GATED_GROUP, ... of the gate and of up (element.cl: 16 bytes,
// one vector load each), both loaded before either is used.
#define GATED_KERNEL(name, row_stats, prepare, activate)                                                      \
    __kernel __attribute__((reqd_work_group_size(GATED_GROUP, 1, 1))) void NAME(name)(                        \
        __global elem_t* out, long out_offset, __global const elem_t* x, long x_offset, long n_rows, int d,     \
        long x_row_stride, long out_row_stride, compute_t f0, compute_t f1, int i0, int i1) {                  \
        __local compute_t scratch[GATED_GROUP];                                                                \
        long row = get_group_id(0);                                                                            \
        __global const elem_t* gate = x + x_offset + row * x_row_stride;                                       \
        __global elem_t* out_row = out + out_offset + row * out_row_stride;                                    \
        compute_t prepared = 0.0f;                                                                             \
        if (row_stats) {                                                                                       \
            compute_t mean, std;                                                                               \
            gated_stats(gate, d, scratch, &mean, &std);                                                        \
            prepared = prepare(mean, std, f0, f1, i0, i1);                                                     \
        }                                                                                                      \
        for (long c = get_local_id(0); c < CHUNKS(d); c += GATED_GROUP) {                                      \
            compute_t g[CHUNK], u[CHUNK];                                                                      \
            load_chunk(gate, c, d, g);                                                                         \
            load_chunk(gate + d, c, d, u);                                                                     \
            for (int i = 0; i < CHUNK; ++i) {                                                                  \
                long j = c * CHUNK + i;                                                                        \
                compute_t a = round_to_elem(activate(g[i], prepared, f0, f1, i0, i1));                         \
                if (j < d) STORE(out_row, j, a * u[i]);                                                        \
            }                                                                                                  \
        }                                                                                                      \
    }
