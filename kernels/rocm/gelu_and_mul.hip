// gelu_and_mul: out = gelu(gate, approximate) * up (see gated.hip.h); i0 is `approximate`, 0 = "none"
// (erf form), 1 = "tanh".

#include "gated.hip.h"

struct GeluAndMul {
    static constexpr bool ROW_STATS = false;
    template <int DTYPE>
    __device__ static Compute<DTYPE> prepare(Compute<DTYPE>, Compute<DTYPE>, const GateScalars<Compute<DTYPE>>&) {
        return 0.0f;
    }
    template <int DTYPE>
    __device__ static Compute<DTYPE> activate(Compute<DTYPE> g, Compute<DTYPE>, const GateScalars<Compute<DTYPE>>& s) {
        return gelu(g, s.i0);
    }
};

GATED_KERNELS(gelu_and_mul, GeluAndMul)
