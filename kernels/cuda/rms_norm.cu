// The norm kernels of one `cuda` program, compiled by NVRTC at first use: the shared row kernel
// (`kernels/gpu/rms_norm.h`, after `port.cuh` and `elem.h`, which the crate prepends) instantiated
// for one set of defines, as `rms_norm_<dtype>` and `fused_add_rms_norm_<dtype>`.
//
// Variant defines (all required):
//   DTYPE            0 = f32, 1 = f16, 2 = bf16, 6 = f64 (the element type of x, residual and out)
//   HAS_WEIGHT       0 or 1
//   WDTYPE           the weight's type, coded like DTYPE
//   VEC              1 (scalar loads) or the dtype's CHUNK (16-byte loads); decided on the host from
//                    alignment and H (a multiple of CHUNK: every chunk of a row is whole), so both
//                    paths give identical bits
//   THREADS_PER_ROW  8, 16, 32, 64, 128 or 256
//   BLOCK_SIZE       128 or 256
//   CACHE_CHUNKS     chunks of a row each thread keeps in registers between the passes (the host
//                    sizes it to hold the whole row up to the largest H of the threads-per-row bucket;
//                    f64, a reference dtype, keeps the f32 kernels' register budget: half the row)

#if !defined(DTYPE) || !defined(HAS_WEIGHT) || !defined(WDTYPE) || !defined(VEC) || !defined(THREADS_PER_ROW) || \
    !defined(BLOCK_SIZE) || !defined(CACHE_CHUNKS)
#error "a norm program needs DTYPE, HAS_WEIGHT, WDTYPE, VEC, THREADS_PER_ROW, BLOCK_SIZE and CACHE_CHUNKS"
#endif

// The kernels are declared for one block per SM at least: without the minimum, ptxas spilled a few
// registers of the small-row f32 and f64 kernels around the rare path's call (a row whose sum of
// squares overflows, summed again in double and divided in double).

// The weight's type as the row kernel takes it (-1: none).
#define NORM_WEIGHT (HAS_WEIGHT ? WDTYPE : -1)

#define NORM_KERNELS(DT, NAME, VECTOR_FORM, ...)                                                                   \
    extern "C" __global__ void __launch_bounds__(BLOCK_SIZE, 1)                                                     \
        rms_norm_##NAME(Elem<DT>::T* __restrict__ out, const Elem<DT>::T* __restrict__ x,                          \
                        const NormWeight<NORM_WEIGHT>::T* __restrict__ weight, Compute<DT> epsilon, long long n_rows, \
                        int hidden, int variance, long long x_row_stride, long long out_row_stride) {              \
        norm_rows<DT, NORM_WEIGHT, VEC, THREADS_PER_ROW, BLOCK_SIZE, CACHE_CHUNKS, false>(                         \
            out, const_cast<Elem<DT>::T*>(x), weight, epsilon, n_rows, hidden, variance, out_row_stride,         \
            x_row_stride);                                                                                         \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_SIZE, 1) fused_add_rms_norm_##NAME(                         \
        Elem<DT>::T* __restrict__ x, Elem<DT>::T* __restrict__ residual,                                           \
        const NormWeight<NORM_WEIGHT>::T* __restrict__ weight, Compute<DT> epsilon, long long n_rows, int hidden,   \
        int variance, long long x_row_stride, long long residual_row_stride) {                                    \
        norm_rows<DT, NORM_WEIGHT, VEC, THREADS_PER_ROW, BLOCK_SIZE, CACHE_CHUNKS, true>(                          \
            x, residual, weight, epsilon, n_rows, hidden, variance, x_row_stride, residual_row_stride);           \
    }

// The program's dtype (its scalar form's suffix names the kernels whatever VEC is).
GPU_KERNEL_SCALAR_DTYPES(NORM_KERNELS)
