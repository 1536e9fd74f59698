// silu_and_mul: out = silu(gate) * up (see gated.cl).

inline compute_t silu_and_mul_prepare(compute_t mean, compute_t std, compute_t f0, compute_t f1, int i0, int i1) { return 0.0f; }

inline compute_t silu_and_mul_activate(compute_t g, compute_t prepared, compute_t f0, compute_t f1, int i0, int i1) {
    return silu(g);
}

GATED_KERNEL(silu_and_mul, 0, silu_and_mul_prepare, silu_and_mul_activate)
