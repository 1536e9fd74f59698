// The element type of the `xpu` kernels and its conversions to and from f32 (OpenCL C 1.2), prepended
// by the crate to every kernel source before the program is built.
//
// Define required: DTYPE  0 = f32, 1 = f16 (vload_half/vstore_half_rte, no cl_khr_fp16 needed),
//                         2 = bf16 (ushort bits). NAME(op) appends the dtype to a kernel name.
// Define optional: WDTYPE the norm weight's type, coded like DTYPE (default: DTYPE): welem_t,
//                         LOAD_W and round_to_w.

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
#else
#error "DTYPE must be 0, 1 or 2"
#endif

// Rounds to the element type and back (the weight step rounds y first, as native does).
inline float round_to_elem(float v) {
#if DTYPE == 0
    return v;
#elif DTYPE == 1
    return round_to_f16(v);
#else
    return bf16_to_f32(f32_to_bf16(v));
#endif
}

#ifndef WDTYPE
#define WDTYPE DTYPE
#endif

// The weight's type, which may differ from the element type (a Gemma-style f32 weight on bf16
// activations): the weight step computes in it (R86 step 5), the store rounds to the element type.
#if WDTYPE == 0
typedef float welem_t;
#define LOAD_W(p, i) ((p)[i])
inline float round_to_w(float v) { return v; }
#elif WDTYPE == 1
typedef half welem_t;
#define LOAD_W(p, i) vload_half((i), (p))
inline float round_to_w(float v) { return round_to_f16(v); }
#elif WDTYPE == 2
typedef ushort welem_t;
#define LOAD_W(p, i) bf16_to_f32((p)[i])
inline float round_to_w(float v) { return bf16_to_f32(f32_to_bf16(v)); }
#else
#error "WDTYPE must be 0, 1 or 2"
#endif
