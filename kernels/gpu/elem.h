// The element types of the kernels CUDA and HIP share (`kernels/gpu`), their compute types and the
// chunks a thread loads. The same text compiles under NVRTC and hipcc: everything that differs
// between the two (the f16 bit conversions, the correctly rounded operations `c_*`, the
// fp8 hardware, which dtypes a program instantiates) comes from the backend's portability header
// (`kernels/cuda/port.cuh`, `kernels/rocm/port.hip.h`), compiled first. NVRTC is given no include
// path, so no shared header includes another: each backend puts them in order (the CUDA crate
// concatenates them; the HIP sources `#include` them).
//
// `Elem<0>` f32, `Elem<1>` f16, `Elem<2>` bf16 (as unsigned short bits), all computing in f32, and
// `Elem<6>` f64 (a reference dtype), computing in f64. `load` widens to the compute type `C`;
// `store` rounds to the element type once, from a float or from a double (which narrows to f16 or
// bf16 through f32 rounded to odd). Template parameters are named DT: the CUDA programs define a
// DTYPE macro.

#ifndef VLLM_IR_GPU_ELEM_H
#define VLLM_IR_GPU_ELEM_H

template <int DT> struct Elem;

template <> struct Elem<0> {
    typedef float T;
    typedef float C;
    static constexpr int CHUNK = 4;
    __device__ static float load(T v) { return v; }
    __device__ static T store(float f) { return f; }
    __device__ static T store(double d) { return (float)d; }
};

template <> struct Elem<1> {
    typedef unsigned short T;
    typedef float C;
    static constexpr int CHUNK = 8;
    __device__ static float load(T v) { return f16_bits_to_f32(v); }
    __device__ static T store(float f) { return f32_to_f16_bits(f); }
    __device__ static T store(double d) { return f32_to_f16_bits(f32_round_to_odd(d)); }
};

template <> struct Elem<2> {
    typedef unsigned short T;
    typedef float C;
    static constexpr int CHUNK = 8;
    __device__ static float load(T v) { return bf16_bits_to_f32(v); }
    __device__ static T store(float f) { return f32_to_bf16_bits(f); }
    __device__ static T store(double d) { return f32_to_bf16_bits(f32_round_to_odd(d)); }
};

template <> struct Elem<6> {
    typedef double T;
    typedef double C;
    static constexpr int CHUNK = 2;
    __device__ static double load(T v) { return v; }
    __device__ static T store(double d) { return d; }
};

// The compute type of DT elements.
template <int DT> using Compute = typename Elem<DT>::C;

// The compute type of a step mixing two element types: double when either is f64.
template <int A, int B> struct MixedCompute { typedef float T; };
template <int B> struct MixedCompute<6, B> { typedef double T; };
template <int A> struct MixedCompute<A, 6> { typedef double T; };
template <> struct MixedCompute<6, 6> { typedef double T; };

// Rounds to the element type and back (nearest-even, once, from a float or a double).
template <int DT, typename V>
__device__ __forceinline__ V round_elem(V v) {
    return (V)Elem<DT>::load(Elem<DT>::store(v));
}

// A decimal constant in the compute type `V` (the float one as a float literal).
#define LIT(V, x) ((V)(sizeof(V) == 4 ? x##f : x))

// A 16-byte chunk as stored, held as four 32-bit words: held as 16-bit elements, hipcc splits the
// chunk into halves right after its load, which makes the thread wait for the load there.
struct alignas(16) Words {
    unsigned int w[4];
};

// Element `i` of a chunk held as words (little-endian: element 0 is the low half of word 0). Only
// f32, f16 and bf16 chunks are held so (f64 rows never take a 16-byte path).
template <int DT>
__device__ __forceinline__ typename Elem<DT>::T word_element(const Words& words, int i) {
    if constexpr (sizeof(typename Elem<DT>::T) == 2) {
        return (typename Elem<DT>::T)(words.w[i / 2] >> (16 * (i % 2)));
    } else {
        return __uint_as_float(words.w[i]);
    }
}

// A chunk of elements as words (the inverse of word_element).
template <int DT>
__device__ __forceinline__ Words to_words(const typename Elem<DT>::T* v) {
    Words words;
    if constexpr (sizeof(typename Elem<DT>::T) == 2) {
#pragma unroll
        for (int i = 0; i < 4; ++i) words.w[i] = (unsigned int)v[2 * i] | ((unsigned int)v[2 * i + 1] << 16);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) words.w[i] = __float_as_uint(v[i]);
    }
    return words;
}

// Chunk `c` of a row of `d` elements (elements c*CHUNK .. c*CHUNK+CHUNK-1) as stored, for the
// kernels whose threads own whole chunks (the gated ops, the quantizations). The 16-byte kind (WIDE)
// is one load or store of `Words` (the host guarantees d % CHUNK == 0: every chunk is whole); the
// scalar kind reads the elements below `d` one by one and zero past them, and writes those below d.
template <int DT, bool WIDE> struct RowChunk;

template <int DT> struct RowChunk<DT, true> {
    typedef typename Elem<DT>::T T;
    Words words;
    __device__ __forceinline__ void load(const T* row, int c, int) {
        words = *reinterpret_cast<const Words*>(row + c * Elem<DT>::CHUNK);
    }
    __device__ __forceinline__ T get(int i) const { return word_element<DT>(words, i); }
    __device__ static void store(T* row, int c, int, const T* v) {
        *reinterpret_cast<Words*>(row + c * Elem<DT>::CHUNK) = to_words<DT>(v);
    }
};

template <int DT> struct RowChunk<DT, false> {
    typedef typename Elem<DT>::T T;
    T v[Elem<DT>::CHUNK];
    __device__ __forceinline__ void load(const T* row, int c, int d) {
        int first = c * Elem<DT>::CHUNK;
#pragma unroll
        for (int i = 0; i < Elem<DT>::CHUNK; ++i) v[i] = first + i < d ? row[first + i] : Elem<DT>::store(0.0f);
    }
    __device__ __forceinline__ T get(int i) const { return v[i]; }
    __device__ static void store(T* row, int c, int d, const T* values) {
        int first = c * Elem<DT>::CHUNK;
#pragma unroll
        for (int i = 0; i < Elem<DT>::CHUNK; ++i) {
            if (first + i < d) row[first + i] = values[i];
        }
    }
};

// Reduces `value` over the block (BLOCK threads, or blockDim.x when BLOCK is 0; a power of two)
// with `combine`, in a fixed tree order; every thread gets the result. `scratch` holds a value per
// thread. A kernel of a fixed block size passes it: with the bound a runtime value, ptxas spilled
// norm + quant's 16-byte kernel.
template <int BLOCK, typename C, typename F>
__device__ __forceinline__ C block_reduce(C value, C* scratch, F combine) {
    const int threads = BLOCK > 0 ? BLOCK : (int)blockDim.x;
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int width = threads / 2; width > 0; width >>= 1) {
        if ((int)threadIdx.x < width) {
            scratch[threadIdx.x] = combine(scratch[threadIdx.x], scratch[threadIdx.x + width]);
        }
        __syncthreads();
    }
    C total = scratch[0];
    __syncthreads();
    return total;
}

// The block's sum, and its maximum (fmax: NaN skipped), by block_reduce.
template <int BLOCK = 0, typename C>
__device__ __forceinline__ C block_sum(C value, C* scratch) {
    return block_reduce<BLOCK>(value, scratch, [](C a, C b) { return a + b; });
}
template <int BLOCK = 0, typename C>
__device__ __forceinline__ C block_max(C value, C* scratch) {
    return block_reduce<BLOCK>(value, scratch, [](C a, C b) { return c_fmax(a, b); });
}

#endif  // VLLM_IR_GPU_ELEM_H
