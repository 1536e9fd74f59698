// The element type of the `xpu` kernels and its conversions to and from f32 (OpenCL C 1.2), prepended
// by the crate to every kernel source before the program is built.
//
// Define required (except for the strided conversions, which use only the helpers before it):
//                 DTYPE  0 = f32, 1 = f16 (vload_half/vstore_half_rte, no cl_khr_fp16 needed),
//                         2 = bf16 (ushort bits). NAME(op) appends the dtype to a kernel name.
//                         6 = f64 (needs cl_khr_fp64; the kernels then compute in f64).
//                 compute_t is the compute dtype c: double for f64 elements, float otherwise; LIT(x)
//                 writes a decimal constant in it (x##f for float, so the f32 kernels keep their bits).
//                 CHUNK elements (16 bytes) make a chunk, which `load_chunk` reads with one vector
//                 load (vloadn needs only the element's alignment) into compute values.
// Define optional: WDTYPE the norm weight's type, coded like DTYPE (default: DTYPE): welem_t,
//                         LOAD_W, wcompute_t (double when x or the weight is f64), round_to_w and
//                         WSTORE, which stores a weight step's result into the element type.

#if defined(cl_khr_fp64)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable

// f32 rounded to odd (truncated, the last bit set when anything was lost): rounding it to nearest
// even in a format of at most 22 significand bits (f16, bf16, fp8) equals rounding the double directly.
inline float f32_round_to_odd(double value) {
    float nearest = (float)value;
    if ((double)nearest == value || isinf(nearest) || isnan(value)) return nearest;
    uint bits = as_uint(nearest);
    // Sign-magnitude: decrementing the bits of a non-zero float moves it one step toward zero.
    uint truncated = fabs((double)nearest) > fabs(value) ? bits - 1u : bits;
    return as_float(truncated | 1u);
}
#endif

inline float bf16_to_f32(ushort v) { return as_float(((uint)v) << 16); }
inline ushort f32_to_bf16(float f) {
    uint bits = as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (ushort)((bits >> 16) | 0x0040u);
    return (ushort)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Rounds to the nearest-even f16 and widens back, through private storage viewed as half.
inline float round_to_f16(float v) {
    ushort bits;
    vstore_half_rte(v, 0, (__private half*)&bits);
    return vload_half(0, (__private const half*)&bits);
}

// f32 -> fp8 with `m_bits` mantissa bits and exponent bias `bias`: NaN becomes the canonical NaN 0x7f,
// magnitudes clamp to `max_finite` (saturation, infinities included), then round to nearest-even on
// the format's grid. Rounding happens in f32 on exact multiples of the grid step (a power of two),
// so `rint` (ties to even) does it; the result is then encoded from its f32 fields.
inline uchar fp8_from_f32(float f, int m_bits, int bias, float max_finite) {
    uint bits = as_uint(f);
    uint sign = (bits >> 24) & 0x80u;
    // NaN: one canonical code in both formats (sign clear, all other bits set), whatever the
    // NaN's sign and payload, as every provider writes it and the hardware `cvt` does.
    if (isnan(f)) return (uchar)0x7fu;
    float a = fmin(fabs(f), max_finite);
    int emin = 1 - bias;
    int e = max((int)((as_uint(a) >> 23) & 0xffu) - 127, emin);
    // 1 / step and step, both powers of two: the scaling is exact.
    float inv_step = as_float((uint)(127 - (e - m_bits)) << 23);
    float step = as_float((uint)(127 + (e - m_bits)) << 23);
    float r = rint(a * inv_step) * step;
    if (r == 0.0f) return (uchar)sign;
    uint rb = as_uint(r);
    int re = (int)((rb >> 23) & 0xffu) - 127;
    uint code;
    if (re >= emin) {
        code = ((uint)(re + bias) << m_bits) | ((rb & 0x7fffffu) >> (23 - m_bits));
    } else {
        // A subnormal: r is a whole number of the smallest subnormal 2^(emin - m_bits).
        code = (uint)(r * as_float((uint)(127 - (emin - m_bits)) << 23));
    }
    return (uchar)(sign | code);
}

#ifdef DTYPE
#if DTYPE == 0
typedef float elem_t;
#define LOAD(p, i) ((p)[i])
#define STORE(p, i, v) ((p)[i] = (v))
#define NAME(op) op##_f32
#elif DTYPE == 1
typedef half elem_t;
#define LOAD(p, i) vload_half((i), (p))
#define STORE(p, i, v) vstore_half_rte((v), (i), (p))
#define NAME(op) op##_f16
#elif DTYPE == 2
typedef ushort elem_t;
#define LOAD(p, i) bf16_to_f32((p)[i])
#define STORE(p, i, v) ((p)[i] = f32_to_bf16(v))
#define NAME(op) op##_bf16
#elif DTYPE == 6
typedef double elem_t;
#define LOAD(p, i) ((p)[i])
#define STORE(p, i, v) ((p)[i] = (v))
#define NAME(op) op##_f64
#else
#error "DTYPE must be 0, 1, 2 or 6"
#endif

// NARROW_C(v): a compute value as the f32 that rounds to a narrower format (f16, bf16, fp8) as v would.
#if DTYPE == 6
typedef double compute_t;
#define LIT(x) x
#define NARROW_C(v) f32_round_to_odd(v)
#else
typedef float compute_t;
#define LIT(x) x##f
#define NARROW_C(v) (v)
#endif

// Rounds to the element type and back (the weight step rounds y first, as native does).
inline compute_t round_to_elem(compute_t v) {
#if DTYPE == 1
    return round_to_f16(v);
#elif DTYPE == 2
    return bf16_to_f32(f32_to_bf16(v));
#else
    return v;
#endif
}

// A chunk: elements c*CHUNK .. c*CHUNK+CHUNK-1 of a row, 16 bytes (4 f32, 8 f16 or bf16, 2 f64),
// which the kernels read with one vector load (VLOAD_CHUNK: vloadn and vload_halfn need only the
// element's alignment, so every row, offset and stride takes it) and keep as CHUNK compute values.
#if DTYPE == 0
#define CHUNK 4
#define VLOAD_CHUNK(c, p) vload4((c), (p))
#define VSTORE_COMPUTE(v, p) vstore4((v), 0, (p))
#elif DTYPE == 1
#define CHUNK 8
#define VLOAD_CHUNK(c, p) vload_half8((c), (p))
#define VSTORE_COMPUTE(v, p) vstore8((v), 0, (p))
#elif DTYPE == 2
#define CHUNK 8
#define VLOAD_CHUNK(c, p) as_float8(convert_uint8(vload8((c), (p))) << 16)
#define VSTORE_COMPUTE(v, p) vstore8((v), 0, (p))
#else
#define CHUNK 2
#define VLOAD_CHUNK(c, p) vload2((c), (p))
#define VSTORE_COMPUTE(v, p) vstore2((v), 0, (p))
#endif

// The chunks of a row of n elements.
#define CHUNKS(n) (((long)(n) + CHUNK - 1) / CHUNK)

// Chunk c of a row of n elements as compute values in `out`: one vector load when the chunk is
// whole, else (a row's last chunk) the elements below n one by one and zero past them.
inline void load_chunk(__global const elem_t* p, long c, long n, compute_t* out) {
    if ((c + 1) * CHUNK <= n) {
        VSTORE_COMPUTE(VLOAD_CHUNK(c, p), out);
    } else {
        for (int i = 0; i < CHUNK; ++i) {
            long j = c * CHUNK + i;
            out[i] = j < n ? LOAD(p, j) : 0.0f;
        }
    }
}

#ifndef WDTYPE
#define WDTYPE DTYPE
#endif

// The weight's type, which may differ from the element type (a Gemma-style f32 weight on bf16
// activations): the norm's weight step computes in it, the store rounds to the element type.
// With f64 on either side the step computes in double: y and the product round to the weight's type
// directly from it (a double narrows to f16 or bf16 through f32 rounded to odd), and WSTORE rounds
// the double result to the element type directly.
#if DTYPE == 6 || WDTYPE == 6
typedef double wcompute_t;
#define W_NARROW(v) f32_round_to_odd(v)
#else
typedef float wcompute_t;
#define W_NARROW(v) (v)
#endif

#if WDTYPE == 0
typedef float welem_t;
#define LOAD_W(p, i) ((p)[i])
inline wcompute_t round_to_w(wcompute_t v) { return (float)v; }
#elif WDTYPE == 1
typedef half welem_t;
#define LOAD_W(p, i) vload_half((i), (p))
inline wcompute_t round_to_w(wcompute_t v) { return round_to_f16(W_NARROW(v)); }
#elif WDTYPE == 2
typedef ushort welem_t;
#define LOAD_W(p, i) bf16_to_f32((p)[i])
inline wcompute_t round_to_w(wcompute_t v) { return bf16_to_f32(f32_to_bf16(W_NARROW(v))); }
#elif WDTYPE == 6
typedef double welem_t;
#define LOAD_W(p, i) ((p)[i])
inline wcompute_t round_to_w(wcompute_t v) { return v; }
#else
#error "WDTYPE must be 0, 1, 2 or 6"
#endif

#if DTYPE == 0 || DTYPE == 6
#define WSTORE(p, i, v) ((p)[i] = (v))
#elif DTYPE == 1
#define WSTORE(p, i, v) vstore_half_rte(W_NARROW(v), (i), (p))
#else
#define WSTORE(p, i, v) ((p)[i] = f32_to_bf16(W_NARROW(v)))
#endif
#endif  // DTYPE
