// silu_and_mul: out = silu(gate) * up (see gated.cl).

inline float silu_and_mul_prepare(float mean, float std, float f0, float f1, int i0, int i1) { return 0.0f; }

inline float silu_and_mul_activate(float g, float prepared, float f0, float f1, int i0, int i1) {
    return silu_f32(g);
}

GATED_KERNEL(silu_and_mul, 0, silu_and_mul_prepare, silu_and_mul_activate)
