// gelu_and_mul_sparse: on the gate of a row, cutoff = round(round(mean) + round(round(std) * f0))
// with f0 = std_multiplier; out = gelu(relu(round(gate - cutoff)), approximate) * up (see gated.cuh);
// i0 is `approximate`, 0 = "none" (erf form), 1 = "tanh". relu keeps NaN.

struct GeluAndMulSparse {
    static constexpr bool ROW_STATS = true;
    __device__ static compute_t prepare(compute_t mean, compute_t std, const GateScalars& s) {
        return round_elem(round_elem(mean) + round_elem(round_elem(std) * s.f0));
    }
    __device__ static compute_t activate(compute_t g, compute_t cutoff, const GateScalars& s) {
        compute_t shifted = round_elem(g - cutoff);
        return gelu(shifted < 0.0f ? 0.0f : shifted, s.i0);
    }
};

GATED_KERNEL(gelu_and_mul_sparse, GeluAndMulSparse)
