// gelu_and_mul: out = gelu(gate, approximate) * up (see gated.cl); i0 is `approximate`, 0 = "none"
// (erf form), 1 = "tanh".

inline compute_t gelu_and_mul_prepare(compute_t mean, compute_t std, compute_t f0, compute_t f1, int i0, int i1) { return 0.0f; }

inline compute_t gelu_and_mul_activate(compute_t g, compute_t prepared, compute_t f0, compute_t f1, int i0, int i1) {
    return gelu(g, i0);
}

GATED_KERNEL(gelu_and_mul, 0, gelu_and_mul_prepare, gelu_and_mul_activate)
