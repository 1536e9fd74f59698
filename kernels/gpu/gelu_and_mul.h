// gelu_and_mul: out = gelu(gate, approximate) * up (see gated.h); i0 is `approximate`, 0 = "none"
// (erf form), 1 = "tanh".

struct GeluAndMul {
    static constexpr bool ROW_STATS = false;
    template <int DT>
    __device__ static Compute<DT> prepare(Compute<DT>, Compute<DT>, const GateScalars<Compute<DT>>&) {
        return 0.0f;
    }
    template <int DT>
    __device__ static Compute<DT> activate(Compute<DT> g, Compute<DT>, const GateScalars<Compute<DT>>& s) {
        return gelu(g, s.i0);
    }
};

GATED_KERNELS(gelu_and_mul, GeluAndMul)
