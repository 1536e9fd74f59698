// gelu_and_mul_sparse: on the gate of a row, cutoff = round(round(mean) + round(round(std) * f0))
// with f0 = std_multiplier; out = gelu(relu(round(gate - cutoff)), approximate) * up (see gated.cl);
// i0 is `approximate`, 0 = "none" (erf form), 1 = "tanh". relu keeps NaN.

inline compute_t gelu_and_mul_sparse_prepare(compute_t mean, compute_t std, compute_t f0, compute_t f1, int i0, int i1) {
    return round_to_elem(round_to_elem(mean) + round_to_elem(round_to_elem(std) * f0));
}

inline compute_t gelu_and_mul_sparse_activate(compute_t g, compute_t cutoff, compute_t f0, compute_t f1, int i0, int i1) {
    compute_t shifted = round_to_elem(g - cutoff);
    return gelu(shifted < 0.0f ? 0.0f : shifted, i0);
}

GATED_KERNEL(gelu_and_mul_sparse, 1, gelu_and_mul_sparse_prepare, gelu_and_mul_sparse_activate)
