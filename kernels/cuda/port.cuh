// The CUDA side of the portability layer the CUDA and HIP kernels share (`kernels/gpu`): what NVRTC
// spells differently from hipcc, under the names the shared sources use. The HIP side is
// `kernels/rocm/port.hip.h`, with the same names. Compiled before every other kernel source; no
// headers (NVRTC is given no include path).
//
// - f16 bit conversions with PTX `cvt`, and `f32_round_to_odd`, through which a double narrows to a
//   format of at most 22 significand bits with one rounding (bf16's bit operations are the same in
//   both dialects: `kernels/gpu/compute.h`).
// - `c_add`, `c_sub`, `c_mul`, `c_div`, `c_sqrt`: each one correctly rounded operation in the
//   compute type, overloaded for float and double (the float ones are the intrinsics: NVRTC would
//   contract a plain `a * b + c` into an fma). The operations both compilers spell the same are in
//   `kernels/gpu/compute.h`, compiled right after this header.
// - `gpu_isnan`, and the fp8 hardware: on sm_89 and later `GPU_FP8_HARDWARE` is 1 and
//   `fp8_hardware<E5M2>` is `cvt.rn.satfinite` (`kernels/gpu/fp8.h` picks it).
// - `gpu_load_in_order`, a 16-byte load ptxas keeps in program order; `gpu_shfl_xor` and
//   `GPU_WARP`, the warp's butterfly shuffle and width; how the norms keep loads in flight
//   (`GPU_NORM_CLAMPED_LOADS`, `GPU_NORM_SCALAR_WEIGHT_AHEAD`, `GPU_NORM_ROUNDED_SQUARES`).
// - `GPU_ROWS(row, n_rows)`, the rows a block computes: CUDA launches one block per row (up to
//   2^31 - 1), so a block takes its own row, `if (row < n_rows)`. Written as a loop over rows,
//   ptxas spilled the dynamic quantization (48 bytes) and the norm + quantization. Likewise
//   `GPU_ELEMENTS(i, n)`, the element a thread of the strided kernels takes (one per thread).
// - `GPU_KERNEL_DTYPES(M, ...)`: a CUDA program is compiled per dtype (define DTYPE: 0 = f32,
//   1 = f16, 2 = bf16, 6 = f64), so it expands `M(dtype code, kernel suffix, vector form, ...)` for
//   DTYPE alone: its scalar kernel and, except for f64 (a reference dtype), its 16-byte one;
//   `GPU_KERNEL_SCALAR_DTYPES` the scalar one only (a family without a 16-byte form).

// f32 rounded to odd (truncated, the last bit set when anything was lost): rounding it to nearest
// even in a format of at most 22 significand bits equals rounding the double directly.
__device__ __forceinline__ float f32_round_to_odd(double value) {
    float nearest = __double2float_rn(value);
    if ((double)nearest == value || isinf(nearest) || isnan(value)) return nearest;
    unsigned int bits = __float_as_uint(nearest);
    // Sign-magnitude: decrementing the bits of a non-zero float moves it one step toward zero.
    unsigned int truncated = fabs((double)nearest) > fabs(value) ? bits - 1u : bits;
    return __uint_as_float(truncated | 1u);
}

__device__ __forceinline__ float f16_bits_to_f32(unsigned short v) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    unsigned short v;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(v) : "f"(f));
    return v;
}

__device__ __forceinline__ float c_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double c_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float c_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double c_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float c_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double c_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float c_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double c_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float c_sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double c_sqrt(double a) { return __dsqrt_rn(a); }

__device__ __forceinline__ bool gpu_isnan(float v) { return isnan(v); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define GPU_FP8_HARDWARE 1
// f32 -> e5m2 (E5M2) or e4m3, saturating, nearest-even. `cvt.rn.satfinite.<format>x2.f32 d, a, b`
// converts b into d's low byte and a into its high one. The hardware keeps an e5m2 NaN's sign and
// top payload bit: the caller maps NaN first.
template <bool E5M2>
__device__ __forceinline__ unsigned char fp8_hardware(float f) {
    unsigned short packed;
    if (E5M2) {
        asm("{ cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2; }" : "=h"(packed) : "f"(0.0f), "f"(f));
    } else {
        asm("{ cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2; }" : "=h"(packed) : "f"(0.0f), "f"(f));
    }
    return (unsigned char)packed;
}
#else
#define GPU_FP8_HARDWARE 0
#endif

// A 16-byte global load kept in program order with the stores around it: a plain `ld.global`,
// where the compiler would pick the non-coherent `ld.global.nc` for read-only data, which ptxas is
// free to sink below stores (to save registers) and so leaves waiting on the store before it.
template <class T> __device__ __forceinline__ T gpu_load_in_order(const T* p) {
    static_assert(sizeof(T) == 16, "a 16-byte chunk");
    union {
        T value;
        unsigned int words[4];
    } out;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(out.words[0]), "=r"(out.words[1]), "=r"(out.words[2]), "=r"(out.words[3])
                 : "l"(p)
                 : "memory");
    return out.value;
}

// A butterfly shuffle over the warp's 32 lanes, every lane taking part, and the warp's width.
template <class T> __device__ __forceinline__ T gpu_shfl_xor(T value, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, value, lane_mask);
}
#define GPU_WARP 32

// How the norms (`kernels/gpu/rms_norm.h`) keep their loads in flight under ptxas: a load of a
// chunk that may lie past the row's end is predicated on the chunk being in the row (ptxas issues
// predicated loads together), and a weight of another type than x, read with scalar loads, is
// loaded a group of chunks ahead of the group's stores like a 16-byte one.
#define GPU_NORM_CLAMPED_LOADS 0
#define GPU_NORM_SCALAR_WEIGHT_AHEAD 1
// NVRTC leaves the norms' squares and sums apart through their select (`tests/nvrtc.rs`).
#define GPU_NORM_ROUNDED_SQUARES 0

#define GPU_ROWS(row, n_rows) if (long long row = blockIdx.x; row < (n_rows))
#define GPU_ELEMENTS(i, n) if (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n))

#if !defined(DTYPE)
#define GPU_KERNEL_SCALAR_DTYPES(M, ...)
#define GPU_KERNEL_DTYPES(M, ...)
#elif DTYPE == 0
#define GPU_KERNEL_SCALAR_DTYPES(M, ...) M(0, f32, false, __VA_ARGS__)
#define GPU_KERNEL_DTYPES(M, ...) M(0, f32, false, __VA_ARGS__) M(0, f32_vec, true, __VA_ARGS__)
#elif DTYPE == 1
#define GPU_KERNEL_SCALAR_DTYPES(M, ...) M(1, f16, false, __VA_ARGS__)
#define GPU_KERNEL_DTYPES(M, ...) M(1, f16, false, __VA_ARGS__) M(1, f16_vec, true, __VA_ARGS__)
#elif DTYPE == 2
#define GPU_KERNEL_SCALAR_DTYPES(M, ...) M(2, bf16, false, __VA_ARGS__)
#define GPU_KERNEL_DTYPES(M, ...) M(2, bf16, false, __VA_ARGS__) M(2, bf16_vec, true, __VA_ARGS__)
#elif DTYPE == 6
#define GPU_KERNEL_SCALAR_DTYPES(M, ...) M(6, f64, false, __VA_ARGS__)
#define GPU_KERNEL_DTYPES(M, ...) M(6, f64, false, __VA_ARGS__)
#else
#error "DTYPE must be 0 (f32), 1 (f16), 2 (bf16) or 6 (f64)"
#endif
