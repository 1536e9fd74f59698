// gelu_and_mul: out = gelu(gate, approximate) * up (see gated.cl); i0 is `approximate`, 0 = "none"
// (erf form), 1 = "tanh".

inline float gelu_and_mul_prepare(float mean, float std, float f0, float f1, int i0, int i1) { return 0.0f; }

inline float gelu_and_mul_activate(float g, float prepared, float f0, float f1, int i0, int i1) {
    return gelu_f32(g, i0);
}

GATED_KERNEL(gelu_and_mul, 0, gelu_and_mul_prepare, gelu_and_mul_activate)
