// silu_and_mul: out = silu(gate) * up (see gated.hip.h).

#include "gated.hip.h"

struct SiluAndMul {
    static constexpr bool ROW_STATS = false;
    template <int DTYPE>
    __device__ static float prepare(float, float, const GateScalars&) { return 0.0f; }
    template <int DTYPE>
    __device__ static float activate(float g, float, const GateScalars&) { return silu_f32(g); }
};

GATED_KERNELS(silu_and_mul, SiluAndMul)
