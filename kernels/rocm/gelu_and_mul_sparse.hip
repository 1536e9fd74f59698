// gelu_and_mul_sparse: on the gate of a row, cutoff = round(round(mean) + round(round(std) * f0))
// with f0 = std_multiplier; out = gelu(relu(round(gate - cutoff)), approximate) * up (see
// gated.hip.h); i0 is `approximate`, 0 = "none" (erf form), 1 = "tanh". relu keeps NaN.

#include "gated.hip.h"

struct GeluAndMulSparse {
    static constexpr bool ROW_STATS = true;
    template <int DTYPE>
    __device__ static Compute<DTYPE> prepare(Compute<DTYPE> mean, Compute<DTYPE> std,
                                             const GateScalars<Compute<DTYPE>>& s) {
        return round_elem<DTYPE>(round_elem<DTYPE>(mean) + round_elem<DTYPE>(round_elem<DTYPE>(std) * s.f0));
    }
    template <int DTYPE>
    __device__ static Compute<DTYPE> activate(Compute<DTYPE> g, Compute<DTYPE> cutoff,
                                              const GateScalars<Compute<DTYPE>>& s) {
        Compute<DTYPE> shifted = round_elem<DTYPE>(g - cutoff);
        return gelu(shifted < 0.0f ? Compute<DTYPE>(0) : shifted, s.i0);
    }
};

GATED_KERNELS(gelu_and_mul_sparse, GeluAndMulSparse)
