// silu_and_mul: out = silu(gate) * up (see gated.hip.h).

#include "gated.hip.h"

struct SiluAndMul {
    static constexpr bool ROW_STATS = false;
    template <int DTYPE>
    __device__ static Compute<DTYPE> prepare(Compute<DTYPE>, Compute<DTYPE>, const GateScalars<Compute<DTYPE>>&) {
        return 0.0f;
    }
    template <int DTYPE>
    __device__ static Compute<DTYPE> activate(Compute<DTYPE> g, Compute<DTYPE>, const GateScalars<Compute<DTYPE>>&) {
        return silu(g);
    }
};

GATED_KERNELS(silu_and_mul, SiluAndMul)
