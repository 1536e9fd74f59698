// fp8 quantization, shared by CUDA and HIP: `static_scaled_fp8_quant_<dtype>` and
// `dynamic_per_token_scaled_fp8_quant_<dtype>`, and the chunk codes and stores the norm +
// quantization (`norm_quant.h`) uses too. Compiled after the portability header,
// `elem.h` and `fp8.h`; instantiated for the dtypes the backend's `GPU_KERNEL_DTYPES` lists.
//
// q[row, j] = fp8(x[row, j] / s) with one IEEE division in the compute type (f32, f64 for f64
// elements, whose quotient narrows through f32 rounded to odd) and a saturating nearest-even
// conversion (`fp8.h`); the dynamic kernel's s = max(min(absmax, ub) / M, 1 / (M * 512)), absmax
// reduced with fmax (NaN skipped); a dynamic scale is stored as f32. `format` 0 = f8e4m3fn
// (M = 448), 1 = f8e5m2 (M = 57344). q is compact rows of `hidden` bytes.
//
// Each row is computed by one block of QUANT_BLOCK threads (`GPU_ROWS`: a grid-stride loop on HIP,
// whose grids are capped at 2^32 work-items; CUDA's grid has a block per row). Each kernel has a
// scalar form (any alignment) and, except for f64, a `_vec` form with the same prototype: 16-byte
// loads of x (and of the norm's residual and weight) and CHUNK-byte stores of q, which the host
// picks when every row involved starts 16-byte aligned and hidden % CHUNK == 0. Thread t owns
// chunks t, t + QUANT_BLOCK, ... of CHUNK elements in both forms, so both give the same bits. Loads
// in flight: the static kernel issues QUANT_UNROLL chunks per step before converting any; the
// dynamic kernel (and the norm + quantization) keeps a thread's first `quant_cache<DT>` chunks in
// registers, all their loads issued first, so a row up to QUANT_BLOCK * CHUNK * 4 elements (8192
// f16/bf16, 4096 f32) is read once; the chunks past them are read again for the last pass.

#ifndef VLLM_IR_GPU_QUANT_H
#define VLLM_IR_GPU_QUANT_H

#define QUANT_BLOCK 256
#define QUANT_UNROLL 2

// The chunks a thread keeps in registers. f64 (a reference dtype) keeps fewer: with four, the f64
// divisions' slow path took a stack frame on CUDA.
template <int DT>
__device__ constexpr int quant_cache() {
    return DT == 6 ? 2 : 4;
}

// The chunks of a row of `hidden` elements of DT.
template <int DT>
__device__ __forceinline__ int quant_chunks(int hidden) {
    return hidden / Elem<DT>::CHUNK + (hidden % Elem<DT>::CHUNK != 0);
}

// A chunk's fp8 codes, four to a 32-bit word (code i in byte i % 4 of word i / 4: bytes of a struct
// written one by one would put it in local memory or scratch), stored as one access on the 16-byte
// path.
template <int CHUNK>
struct alignas(CHUNK >= 4 ? CHUNK : 4) Codes {
    unsigned int w[(CHUNK + 3) / 4];
    __device__ __forceinline__ void set(int i, unsigned char code) {
        unsigned int shifted = (unsigned int)code << (8 * (i % 4));
        w[i / 4] = i % 4 == 0 ? shifted : w[i / 4] | shifted;
    }
};

// Writes chunk `c`'s codes into a row of `hidden` codes (those below `hidden`): one store when VEC
// (4 or 8 bytes, aligned: the row starts a whole chunk of codes).
template <bool VEC, int CHUNK>
__device__ __forceinline__ void store_codes(unsigned char* row, int c, int hidden, const Codes<CHUNK>& codes) {
    int first = c * CHUNK;
    if (VEC) {
        *reinterpret_cast<Codes<CHUNK>*>(row + first) = codes;
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            if (first + i < hidden) row[first + i] = (unsigned char)(codes.w[i / 4] >> (8 * (i % 4)));
        }
    }
}

// A compute value's fp8 code; a double narrows through f32 rounded to odd, which the fp8 rounding
// then rounds as the double.
template <typename C>
__device__ __forceinline__ unsigned char to_fp8(C v, int format) {
    float f = narrow_f32(v);
    return format == 0 ? fp8_e4m3(f) : fp8_e5m2(f);
}

// A row's scale as a quantization applies it: divided by (the default), or multiplied by its
// reciprocal c(1 / s) (`rounding = "dtype"` of a static scale: vLLM's rounding points).
template <typename C>
struct QuantScale {
    C s;
    C inverse;
    int invert;

    // Divides by `s`.
    __device__ __forceinline__ static QuantScale divide(C s) {
        QuantScale q;
        q.s = s;
        q.inverse = C(0);
        q.invert = 0;
        return q;
    }

    // The static scale at `scale` (its value `s`), inverted when `invert`. Called after a kernel
    // issued its first loads: the reciprocal reads the scale again through a volatile pointer, so
    // the compiler cannot hoist the division, and the wait on the scale, before those loads.
    __device__ __forceinline__ static QuantScale of_static(const float* scale, C s, int invert) {
        QuantScale q = divide(s);
        if (invert) {
            q.inverse = c_div(C(1), (C)*(const volatile float*)scale);
            q.invert = 1;
        }
        return q;
    }

    __device__ __forceinline__ C apply(C v) const { return invert ? c_mul(v, inverse) : c_div(v, s); }
};

// The codes of a chunk's values scaled by s.
template <int DT, bool VEC>
__device__ __forceinline__ Codes<Elem<DT>::CHUNK> quant_chunk(const RowChunk<DT, VEC>& value,
                                                             QuantScale<Compute<DT>> s, int format) {
    Codes<Elem<DT>::CHUNK> codes;
#pragma unroll
    for (int i = 0; i < Elem<DT>::CHUNK; ++i) codes.set(i, to_fp8(s.apply(Elem<DT>::load(value.get(i))), format));
    return codes;
}

template <int DT, bool VEC>
__device__ __forceinline__ void static_quant_rows(unsigned char* __restrict__ q,
                                                  const typename Elem<DT>::T* __restrict__ x, long long n_rows,
                                                  int hidden, long long x_row_stride,
                                                  const float* __restrict__ scale, int format, int invert) {
    const int n = quant_chunks<DT>(hidden);
    const Compute<DT> s = *scale;
    GPU_ROWS(row, n_rows) {
        const typename Elem<DT>::T* x_row = x + row * x_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        for (int c0 = threadIdx.x; c0 < n; c0 += QUANT_UNROLL * QUANT_BLOCK) {
            RowChunk<DT, VEC> v[QUANT_UNROLL];
#pragma unroll
            for (int k = 0; k < QUANT_UNROLL; ++k) {
                int c = c0 + k * QUANT_BLOCK;
                if (c < n) v[k].load(x_row, c, hidden);
            }
            const QuantScale<Compute<DT>> by = QuantScale<Compute<DT>>::of_static(scale, s, invert);
#pragma unroll
            for (int k = 0; k < QUANT_UNROLL; ++k) {
                int c = c0 + k * QUANT_BLOCK;
                if (c < n) store_codes<VEC>(q_row, c, hidden, quant_chunk(v[k], by, format));
            }
        }
    }
}

template <int DT, bool VEC>
__device__ __forceinline__ void dynamic_quant_rows(unsigned char* __restrict__ q, float* __restrict__ scales,
                                                   const typename Elem<DT>::T* __restrict__ x, long long n_rows,
                                                   int hidden, long long x_row_stride,
                                                   const float* __restrict__ scale_ub, int has_ub, int format) {
    typedef Compute<DT> C;
    typedef Elem<DT> E;
    constexpr int CACHE = quant_cache<DT>();
    __shared__ C scratch[QUANT_BLOCK];
    const int n = quant_chunks<DT>(hidden);
    const int first_uncached = threadIdx.x + CACHE * QUANT_BLOCK;
    GPU_ROWS(row, n_rows) {
        const typename E::T* x_row = x + row * x_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        // Every slot loads, with no test between the loads: a slot past the row's end loads its last
        // chunk again, which changes no maximum and is never stored (and elements past `hidden` read
        // as zero, which changes none either). Tested per slot, ptxas kept the tests in local memory.
        RowChunk<DT, VEC> cache[CACHE];
#pragma unroll
        for (int k = 0; k < CACHE; ++k) cache[k].load(x_row, min((int)threadIdx.x + k * QUANT_BLOCK, n - 1), hidden);
        C absmax = 0.0f;
#pragma unroll
        for (int k = 0; k < CACHE; ++k) {
#pragma unroll
            for (int i = 0; i < E::CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(E::load(cache[k].get(i))));
        }
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            RowChunk<DT, VEC> v;
            v.load(x_row, c, hidden);
#pragma unroll
            for (int i = 0; i < E::CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(E::load(v.get(i))));
        }
        absmax = block_max<QUANT_BLOCK>(absmax, scratch);
        if (has_ub) absmax = c_fmin(absmax, (C)*scale_ub);
        C max_finite = format == 0 ? 448.0f : 57344.0f;
        C s = c_fmax(c_div(absmax, max_finite), c_div(C(1), max_finite * 512));
        if (threadIdx.x == 0) scales[row] = s;
        const QuantScale<C> by = QuantScale<C>::divide(s);
#pragma unroll
        for (int k = 0; k < CACHE; ++k) {
            int c = threadIdx.x + k * QUANT_BLOCK;
            if (c < n) store_codes<VEC>(q_row, c, hidden, quant_chunk(cache[k], by, format));
        }
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            RowChunk<DT, VEC> v;
            v.load(x_row, c, hidden);
            store_codes<VEC>(q_row, c, hidden, quant_chunk(v, by, format));
        }
    }
}

#define QUANT_KERNELS(DT, SUFFIX, VEC, unused)                                                                     \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) static_scaled_fp8_quant_##SUFFIX(                     \
        unsigned char* __restrict__ q, const Elem<DT>::T* __restrict__ x, long long n_rows, int hidden,            \
        long long x_row_stride, const float* __restrict__ scale, int format, int invert) {                         \
        static_quant_rows<DT, VEC>(q, x, n_rows, hidden, x_row_stride, scale, format, invert);                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) dynamic_per_token_scaled_fp8_quant_##SUFFIX(          \
        unsigned char* __restrict__ q, float* __restrict__ scales, const Elem<DT>::T* __restrict__ x,              \
        long long n_rows, int hidden, long long x_row_stride, const float* __restrict__ scale_ub, int has_ub,      \
        int format) {                                                                                              \
        dynamic_quant_rows<DT, VEC>(q, scales, x, n_rows, hidden, x_row_stride, scale_ub, has_ub, format);         \
    }

GPU_KERNEL_DTYPES(QUANT_KERNELS, unused)

#endif  // VLLM_IR_GPU_QUANT_H
