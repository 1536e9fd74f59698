// silu_and_mul: out = silu(gate) * up (see gated.cuh).

struct SiluAndMul {
    static constexpr bool ROW_STATS = false;
    __device__ static float prepare(float, float, const GateScalars&) { return 0.0f; }
    __device__ static float activate(float g, float, const GateScalars&) { return silu_f32(g); }
};

GATED_KERNEL(silu_and_mul, SiluAndMul)
