// gelu_and_mul: out = gelu(gate, approximate) * up (see gated.cuh); i0 is `approximate`, 0 = "none"
// (erf form), 1 = "tanh".

struct GeluAndMul {
    static constexpr bool ROW_STATS = false;
    __device__ static compute_t prepare(compute_t, compute_t, const GateScalars&) { return 0.0f; }
    __device__ static compute_t activate(compute_t g, compute_t, const GateScalars& s) { return gelu(g, s.i0); }
};

GATED_KERNEL(gelu_and_mul, GeluAndMul)
