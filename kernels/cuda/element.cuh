// The element type of the `cuda` norms (the kernels CUDA does not share with HIP), its compute type and the conversions between them, one dtype per program: prepended by the
// crate (after the portability header `port.cuh`, whose conversions and `c_*` operations it
// uses) to those kernel sources before NVRTC compiles them (NVRTC is given no
// include path). The kernels CUDA and HIP share use `kernels/gpu/elem.h` instead.
//
// Define required: DTYPE  0 = f32, 1 = f16, 2 = bf16, 6 = f64.
//
// compute_t is the compute dtype c: float, and double for f64 elements (which exist for references).
// to_c widens an element to it, from_c rounds back to the element type (nearest-even, once),
// round_elem does both. LIT(x) writes a decimal constant in the compute type (x##f for float). A
// double narrows to f16 or bf16 through f32 rounded to odd (`port.cuh`), with one rounding.

// The same from a double, rounded once.
__device__ __forceinline__ unsigned short f32_to_f16_bits(double v) { return f32_to_f16_bits(f32_round_to_odd(v)); }
__device__ __forceinline__ unsigned short f32_to_bf16_bits(double v) { return f32_to_bf16_bits(f32_round_to_odd(v)); }

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
