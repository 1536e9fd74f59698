// RMS normalization kernels for the `rocm` provider, compiled ahead of time by `hipcc --genco`: the
// row kernel CUDA and HIP share (`kernels/gpu/rms_norm.h`: numerics, element ownership, registers,
// loads in flight), every variant instantiated in one code object.
//
// Every variant is an `extern "C"` kernel named `<op>_<dtype>_w<weight>_v<vector width>_t<threads
// per row>`. The weight is `w0` (none), `w1` (of the element type) or `wf32`/`wf16`/`wbf16`/`wf64`
// (another type: a Gemma-style f32 weight on bf16 activations), read with scalar loads.
// Reductions use the device's wave size (`warpSize`: 64 on CDNA, 32 on RDNA).

#include "element.hip.h"
#include "gpu/rms_norm.h"

// The longest row a kernel with TPR threads per row keeps whole in registers: the largest hidden size
// that launches with it (the CUDA provider's buckets), and 32768 for the last, open-ended one.
__host__ __device__ constexpr int largest_cached_row(int tpr) {
    return tpr <= 8 ? 64 : tpr == 16 ? 128 : tpr == 32 ? 3072 : tpr == 64 ? 6144 : tpr == 128 ? 16384 : 32768;
}

// The chunks of a row each thread keeps in registers: the whole row up to largest_cached_row(TPR);
// f64, a reference dtype, the f32 kernels' count (`kernel_support::norm_cache_chunks`).
__host__ __device__ constexpr int cache_chunks(int dtype, int tpr) {
    int chunk = dtype == 6 ? 4 : dtype == 0 ? 4 : 8;
    return (largest_cached_row(tpr) + chunk * tpr - 1) / (chunk * tpr);
}

#define BLOCK_FOR(TPR) ((TPR) > 128 ? 256 : 128)

// WD: the weight's type code (-1 none); W: its part of the symbol (0, 1, f32, f16, bf16).
#define DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, TPR)                                                                \
    extern "C" __global__ void __launch_bounds__(BLOCK_FOR(TPR))                                                   \
        rms_norm_##NAME##_w##W##_v##VEC##_t##TPR(Elem<DTYPE>::T* out, const Elem<DTYPE>::T* x,                     \
                                                 const NormWeight<WD>::T* weight, Compute<DTYPE> epsilon,              \
                                                 long long n_rows,                                                 \
                                                 int hidden, int variance, long long x_row_stride,                \
                                                 long long out_row_stride) {                                       \
        norm_rows<DTYPE, WD, VEC, TPR, BLOCK_FOR(TPR), cache_chunks(DTYPE, TPR), false>(                         \
            out, const_cast<Elem<DTYPE>::T*>(x), weight, epsilon, n_rows, hidden, variance, out_row_stride,      \
            x_row_stride);                                                                                         \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_FOR(TPR))                                                   \
        fused_add_rms_norm_##NAME##_w##W##_v##VEC##_t##TPR(                                                        \
            Elem<DTYPE>::T* x, Elem<DTYPE>::T* residual, const NormWeight<WD>::T* weight, Compute<DTYPE> epsilon,      \
            long long n_rows, int hidden, int variance, long long x_row_stride, long long residual_row_stride) {   \
        norm_rows<DTYPE, WD, VEC, TPR, BLOCK_FOR(TPR), cache_chunks(DTYPE, TPR), true>(                          \
            x, residual, weight, epsilon, n_rows, hidden, variance, x_row_stride, residual_row_stride);           \
    }

#define DEFINE_TPR(DTYPE, NAME, WD, W, VEC)     \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 8)   \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 16)  \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 32)  \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 64)  \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 128) \
    DEFINE_KERNELS(DTYPE, NAME, WD, W, VEC, 256)

// A weight of another type than the elements (Gemma's f32 weight on bf16 rows): at every row
// width, as the weight of x's type.
#define DEFINE_MIXED(DTYPE, NAME, WD, W, VEC) DEFINE_TPR(DTYPE, NAME, WD, W, VEC)

#define DEFINE_DTYPE(DTYPE, NAME, CHUNK)     \
    DEFINE_TPR(DTYPE, NAME, -1, 0, 1)        \
    DEFINE_TPR(DTYPE, NAME, -1, 0, CHUNK)    \
    DEFINE_TPR(DTYPE, NAME, DTYPE, 1, 1)     \
    DEFINE_TPR(DTYPE, NAME, DTYPE, 1, CHUNK)

DEFINE_DTYPE(0, f32, 4)
DEFINE_DTYPE(1, f16, 8)
DEFINE_DTYPE(2, bf16, 8)
DEFINE_MIXED(0, f32, 1, f16, 1)
DEFINE_MIXED(0, f32, 1, f16, 4)
DEFINE_MIXED(0, f32, 2, bf16, 1)
DEFINE_MIXED(0, f32, 2, bf16, 4)
DEFINE_MIXED(1, f16, 0, f32, 1)
DEFINE_MIXED(1, f16, 0, f32, 8)
DEFINE_MIXED(1, f16, 2, bf16, 1)
DEFINE_MIXED(1, f16, 2, bf16, 8)
DEFINE_MIXED(2, bf16, 0, f32, 1)
DEFINE_MIXED(2, bf16, 0, f32, 8)
DEFINE_MIXED(2, bf16, 1, f16, 1)
DEFINE_MIXED(2, bf16, 1, f16, 8)

// f64 (a reference dtype): scalar accesses only, and a weight of another type than the elements on
// either side at one row width (32 threads per row).
DEFINE_TPR(6, f64, -1, 0, 1)
DEFINE_TPR(6, f64, 6, 1, 1)
DEFINE_KERNELS(6, f64, 0, f32, 1, 32)
DEFINE_KERNELS(6, f64, 1, f16, 1, 32)
DEFINE_KERNELS(6, f64, 2, bf16, 1, 32)
DEFINE_KERNELS(0, f32, 6, f64, 1, 32)
DEFINE_KERNELS(0, f32, 6, f64, 4, 32)
DEFINE_KERNELS(1, f16, 6, f64, 1, 32)
DEFINE_KERNELS(1, f16, 6, f64, 8, 32)
DEFINE_KERNELS(2, bf16, 6, f64, 1, 32)
DEFINE_KERNELS(2, bf16, 6, f64, 8, 32)
