// gelu_and_mul_sparse: on the gate of a row, cutoff = round(round(mean) + round(round(std) * f0))
// with f0 = std_multiplier; out = gelu(relu(round(gate - cutoff)), approximate) * up (see gated.h);
// i0 is `approximate`, 0 = "none" (erf form), 1 = "tanh". relu keeps NaN.

struct GeluAndMulSparse {
    static constexpr bool ROW_STATS = true;
    template <int DT>
    __device__ static Compute<DT> prepare(Compute<DT> mean, Compute<DT> std, const GateScalars<Compute<DT>>& s) {
        return round_elem<DT>(round_elem<DT>(mean) + round_elem<DT>(round_elem<DT>(std) * s.f0));
    }
    template <int DT>
    __device__ static Compute<DT> activate(Compute<DT> g, Compute<DT> cutoff, const GateScalars<Compute<DT>>& s) {
        Compute<DT> shifted = round_elem<DT>(g - cutoff);
        return gelu(shifted < 0.0f ? Compute<DT>(0) : shifted, s.i0);
    }
};

GATED_KERNELS(gelu_and_mul_sparse, GeluAndMulSparse)
