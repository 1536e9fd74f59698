// The element type of the `cuda` kernels, its compute type and the conversions between them,
// prepended by the crate (after `narrow.cuh`) to every kernel source before NVRTC compiles it (NVRTC
// is given no include path).
//
// Define required: DTYPE  0 = f32, 1 = f16, 2 = bf16, 6 = f64.
//
// compute_t is the compute dtype c: float, and double for f64 elements (which exist for references).
// to_c widens an element to it, from_c rounds back to the element type (nearest-even, once),
// round_elem does both. The c_* functions are each one correctly rounded operation in the compute
// type, overloaded for float and double (the float ones are the intrinsics the f32 kernels always
// used, so their bits do not change): NVRTC would contract a plain `a * b + c` into an fma. LIT(x)
// writes a decimal constant in the compute type (x##f for float).
//
// No CUDA headers are needed: f16 converts with PTX `cvt`, bf16 with bit operations, and a double
// narrows to f16 or bf16 through f32 rounded to odd (`narrow.cuh`), with one rounding.

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
__device__ __forceinline__ float bf16_bits_to_f32(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((bits >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
    }
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // nearest-even
}
// The same from a double, rounded once.
__device__ __forceinline__ unsigned short f32_to_f16_bits(double v) { return f32_to_f16_bits(f32_round_to_odd(v)); }
__device__ __forceinline__ unsigned short f32_to_bf16_bits(double v) { return f32_to_bf16_bits(f32_round_to_odd(v)); }

// A compute value as the f32 that rounds to a narrower format (f16, bf16, fp8) as the value would.
__device__ __forceinline__ float narrow_f32(float v) { return v; }
__device__ __forceinline__ float narrow_f32(double v) { return f32_round_to_odd(v); }

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
__device__ __forceinline__ float c_fabs(float a) { return fabsf(a); }
__device__ __forceinline__ double c_fabs(double a) { return fabs(a); }
__device__ __forceinline__ float c_fmax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double c_fmax(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float c_fmin(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double c_fmin(double a, double b) { return fmin(a, b); }
__device__ __forceinline__ float c_exp(float a) { return expf(a); }
__device__ __forceinline__ double c_exp(double a) { return exp(a); }
__device__ __forceinline__ float c_erf(float a) { return erff(a); }
__device__ __forceinline__ double c_erf(double a) { return erf(a); }
__device__ __forceinline__ float c_tanh(float a) { return tanhf(a); }
__device__ __forceinline__ double c_tanh(double a) { return tanh(a); }

#if DTYPE == 0
typedef float elem_t;
typedef float compute_t;
#define CHUNK 4
__device__ __forceinline__ compute_t to_c(elem_t v) { return v; }
__device__ __forceinline__ elem_t from_c(compute_t v) { return v; }
#define KERNEL_SUFFIX f32
#elif DTYPE == 1
typedef unsigned short elem_t;
typedef float compute_t;
#define CHUNK 8
__device__ __forceinline__ compute_t to_c(elem_t v) { return f16_bits_to_f32(v); }
__device__ __forceinline__ elem_t from_c(compute_t f) { return f32_to_f16_bits(f); }
#define KERNEL_SUFFIX f16
#elif DTYPE == 2
typedef unsigned short elem_t;
typedef float compute_t;
#define CHUNK 8
__device__ __forceinline__ compute_t to_c(elem_t v) { return bf16_bits_to_f32(v); }
__device__ __forceinline__ elem_t from_c(compute_t f) { return f32_to_bf16_bits(f); }
#define KERNEL_SUFFIX bf16
#elif DTYPE == 6
typedef double elem_t;
typedef double compute_t;
#define CHUNK 2
__device__ __forceinline__ compute_t to_c(elem_t v) { return v; }
__device__ __forceinline__ elem_t from_c(compute_t v) { return v; }
#define KERNEL_SUFFIX f64
#else
#error "DTYPE must be 0 (f32), 1 (f16), 2 (bf16) or 6 (f64)"
#endif

#if DTYPE == 6
#define LIT(x) x
#else
#define LIT(x) x##f
#endif

// Rounds to the element type and back (nearest-even).
__device__ __forceinline__ compute_t round_elem(compute_t v) { return to_c(from_c(v)); }

// The norm weight's type (define WDTYPE, coded like DTYPE; default DTYPE), which may differ from the
// element type (a Gemma-style f32 weight on bf16 activations). The weight step computes in
// wcompute_t: the weight's compute type, double when x or the weight is f64. w_to_wc reads a
// weight, round_w rounds to the weight's type (from a double: once), and store_wc rounds a weight
// step's result to the element type (from a double: once).
#ifndef WDTYPE
#define WDTYPE DTYPE
#endif
#if DTYPE == 6 || WDTYPE == 6
typedef double wcompute_t;
#else
typedef float wcompute_t;
#endif
#if WDTYPE == 0
typedef float welem_t;
__device__ __forceinline__ wcompute_t w_to_wc(welem_t v) { return v; }
__device__ __forceinline__ wcompute_t round_w(wcompute_t v) { return (float)v; }
#elif WDTYPE == 1
typedef unsigned short welem_t;
__device__ __forceinline__ wcompute_t w_to_wc(welem_t v) { return f16_bits_to_f32(v); }
__device__ __forceinline__ wcompute_t round_w(wcompute_t v) { return f16_bits_to_f32(f32_to_f16_bits(v)); }
#elif WDTYPE == 2
typedef unsigned short welem_t;
__device__ __forceinline__ wcompute_t w_to_wc(welem_t v) { return bf16_bits_to_f32(v); }
__device__ __forceinline__ wcompute_t round_w(wcompute_t v) { return bf16_bits_to_f32(f32_to_bf16_bits(v)); }
#elif WDTYPE == 6
typedef double welem_t;
__device__ __forceinline__ wcompute_t w_to_wc(welem_t v) { return v; }
__device__ __forceinline__ wcompute_t round_w(wcompute_t v) { return v; }
#else
#error "WDTYPE must be 0 (f32), 1 (f16), 2 (bf16) or 6 (f64)"
#endif

#if DTYPE == 0
__device__ __forceinline__ elem_t store_wc(wcompute_t v) { return (float)v; }
#elif DTYPE == 1
__device__ __forceinline__ elem_t store_wc(wcompute_t v) { return f32_to_f16_bits(v); }
#elif DTYPE == 2
__device__ __forceinline__ elem_t store_wc(wcompute_t v) { return f32_to_bf16_bits(v); }
#else
__device__ __forceinline__ elem_t store_wc(wcompute_t v) { return v; }
#endif

#define CONCAT_(a, b) a##_##b
#define CONCAT(a, b) CONCAT_(a, b)

// Chunk `c` of a row of `n` elements (elements c*CHUNK .. c*CHUNK+CHUNK-1) as stored, for the
// kernels whose threads own whole chunks (the gated ops, the quantizations). With WHOLE, one 16-byte
// load or store (the host picks it when n % CHUNK == 0: every chunk is whole); without, the elements
// below n one by one, those past it read as zero.
struct alignas(16) row_chunk_t {
    elem_t v[CHUNK];
};

template <bool WHOLE>
__device__ __forceinline__ void load_row_chunk(const elem_t* row, int c, int n, row_chunk_t& out) {
    int first = c * CHUNK;
    if (WHOLE) {
        out = *reinterpret_cast<const row_chunk_t*>(row + first);
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) out.v[i] = first + i < n ? row[first + i] : from_c(0.0f);
    }
}

template <bool WHOLE>
__device__ __forceinline__ void store_row_chunk(elem_t* row, int c, int n, const row_chunk_t& value) {
    int first = c * CHUNK;
    if (WHOLE) {
        *reinterpret_cast<row_chunk_t*>(row + first) = value;
    } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            if (first + i < n) row[first + i] = value.v[i];
        }
    }
}
