// silu_and_mul: out = silu(gate) * up (see gated.cuh).

struct SiluAndMul {
    static constexpr bool ROW_STATS = false;
    __device__ static compute_t prepare(compute_t, compute_t, const GateScalars&) { return 0.0f; }
    __device__ static compute_t activate(compute_t g, compute_t, const GateScalars&) { return silu(g); }
};

GATED_KERNEL(silu_and_mul, SiluAndMul)
