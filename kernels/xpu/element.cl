// The element type of the `xpu` kernels and its conversions to and from f32 (OpenCL C 1.2), prepended
// by the crate to every kernel source before the program is built.
//
// Define required: DTYPE  0 = f32, 1 = f16 (vload_half/vstore_half_rte, no cl_khr_fp16 needed),
//                         2 = bf16 (ushort bits). NAME(op) appends the dtype to a kernel name.

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
inline float bf16_to_f32(ushort v) { return as_float(((uint)v) << 16); }
inline ushort f32_to_bf16(float f) {
    uint bits = as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (ushort)((bits >> 16) | 0x0040u);
    return (ushort)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
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
    // Round to nearest-even f16 and widen, through private storage viewed as half.
    ushort bits;
    vstore_half_rte(v, 0, (__private half*)&bits);
    return vload_half(0, (__private const half*)&bits);
#else
    return bf16_to_f32(f32_to_bf16(v));
#endif
}
