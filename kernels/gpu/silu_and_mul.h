// silu_and_mul: out = silu(gate) * up (see gated.h).

struct SiluAndMul {
    static constexpr bool ROW_STATS = false;
    template <int DT>
    __device__ static Compute<DT> prepare(Compute<DT>, Compute<DT>, const GateScalars<Compute<DT>>&) {
        return 0.0f;
    }
    template <int DT>
    __device__ static Compute<DT> activate(Compute<DT> g, Compute<DT>, const GateScalars<Compute<DT>>&) {
        return silu(g);
    }
};

GATED_KERNELS(silu_and_mul, SiluAndMul)
