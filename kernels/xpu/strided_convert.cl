// Strided conversion on the device (OpenCL C 1.2, built after the helpers of `element.cl` and
// `strided_copy.cl`'s indexing): the elements a source layout describes, into a destination layout
// of the same shape, converted from the source dtype (SDTYPE) to the destination's (DDTYPE), one
// work-item per element in row-major order: `copy_` between two dtypes, and `scale` (`scaled` != 0,
// same dtype) as `round_dst(round_c(v * factor))`, c the source's compute dtype, the factor already
// rounded to it by the caller. Results have the host's bits: it converts through f64 and rounds once.
//
// Sources f32, f16, bf16, fp8 and i8 are exact in f32 and compute in it: each result is rounded once
// (to nearest even). f64 and i64 sources compute in f64 (needs cl_khr_fp64; an i64 source is
// rounded to f64 as the host reads it, and `scale` rounds its f64 product to f32, i64's compute
// dtype); a double narrows to f16, bf16 or fp8 through f32 rounded to odd, which then rounds to
// nearest even with the bits of a direct rounding. Into an integer: nearest even, saturated, NaN 0.
//
// Defines required: SDTYPE and DDTYPE, each 0 = f32, 1 = f16, 2 = bf16, 3 = f8e4m3fn, 4 = f8e5m2,
// 5 = i8, 6 = f64, 7 = i64 (the `add`/`mul` program defines both as its dtype, for the loads and
// stores).
// Up to 8 dimensions a launch (shape and strides padded with 1 and 0); offsets and strides in elements.

// element.cl enables cl_khr_fp64 where the device has it (the f64 pairs are built only there).

#if SDTYPE == 6 || SDTYPE == 7
typedef double compute_t;
#define COMPUTE_DOUBLE 1
#else
typedef float compute_t;
#endif

#if SDTYPE == 0
typedef float src_t;
inline float load_src(__global const src_t* p, long i) { return p[i]; }
#elif SDTYPE == 1
typedef half src_t;
inline float load_src(__global const src_t* p, long i) { return vload_half(i, p); }
#elif SDTYPE == 2
typedef ushort src_t;
inline float load_src(__global const src_t* p, long i) { return bf16_to_f32(p[i]); }
#elif SDTYPE == 3
typedef uchar src_t;
// f8e4m3fn: no infinities, S.1111.111 is NaN; subnormals are m * 2^-9.
inline float load_src(__global const src_t* p, long i) {
    uint bits = p[i];
    uint sign = (bits & 0x80u) << 24;
    uint exponent = (bits >> 3) & 0xfu;
    uint mantissa = bits & 0x7u;
    if (exponent == 0xfu && mantissa == 0x7u) return as_float(sign | 0x7fc00000u);
    if (exponent == 0u) return as_float(sign | as_uint((float)mantissa * 0x1p-9f));
    return as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}
#elif SDTYPE == 4
typedef uchar src_t;
// f8e5m2 is the top byte of an f16.
inline float load_src(__global const src_t* p, long i) {
    ushort bits = (ushort)(((ushort)p[i]) << 8);
    return vload_half(0, (__private const half*)&bits);
}
#elif SDTYPE == 5
typedef char src_t;
inline float load_src(__global const src_t* p, long i) { return (float)p[i]; }
#elif SDTYPE == 6
typedef double src_t;
inline double load_src(__global const src_t* p, long i) { return p[i]; }
#elif SDTYPE == 7
typedef long src_t;
inline double load_src(__global const src_t* p, long i) { return (double)p[i]; }
#else
#error "SDTYPE must be 0 to 7"
#endif

#ifdef COMPUTE_DOUBLE
// f32_round_to_odd is in element.cl.
#define NARROW(v) f32_round_to_odd(v)
#else
#define NARROW(v) (v)
#endif

#if DDTYPE == 0
typedef float dst_t;
inline void store_dst(__global dst_t* p, long i, compute_t v) { p[i] = (float)v; }
#elif DDTYPE == 1
typedef half dst_t;
inline void store_dst(__global dst_t* p, long i, compute_t v) { vstore_half_rte(NARROW(v), i, p); }
#elif DDTYPE == 2
typedef ushort dst_t;
inline void store_dst(__global dst_t* p, long i, compute_t v) { p[i] = f32_to_bf16(NARROW(v)); }
#elif DDTYPE == 3
typedef uchar dst_t;
inline void store_dst(__global dst_t* p, long i, compute_t v) { p[i] = fp8_from_f32(NARROW(v), 3, 7, 448.0f); }
#elif DDTYPE == 4
typedef uchar dst_t;
inline void store_dst(__global dst_t* p, long i, compute_t v) { p[i] = fp8_from_f32(NARROW(v), 2, 15, 57344.0f); }
#elif DDTYPE == 5
typedef char dst_t;
inline void store_dst(__global dst_t* p, long i, compute_t v) {
    compute_t r = rint(v);
    p[i] = isnan(v) ? (char)0 : r <= -128 ? (char)-128 : r >= 127 ? (char)127 : (char)r;
}
#elif DDTYPE == 6
typedef double dst_t;
inline void store_dst(__global dst_t* p, long i, compute_t v) { p[i] = (double)v; }
#elif DDTYPE == 7
typedef long dst_t;
// 2^63 is exact in f32 and f64: every r below it in magnitude converts without overflow.
inline void store_dst(__global dst_t* p, long i, compute_t v) {
    compute_t r = rint(v);
    p[i] = isnan(v) ? 0L : r < -0x1p63 ? LONG_MIN : r >= 0x1p63 ? LONG_MAX : (long)r;
}
#else
#error "DDTYPE must be 0 to 7"
#endif

// `factor` has the compute dtype: f64 for f64 and i64 sources (rounded to f32 by the caller for
// i64), f32 for the others.
__kernel void strided_convert(__global const src_t* src, long src_offset, __global dst_t* dst, long dst_offset,
                              long n, int rank, long8 shape, long8 src_strides, long8 dst_strides,
                              compute_t factor, int scaled) {
    long i = get_global_id(0);
    if (i >= n) return;
    long s = src_offset;
    long d = dst_offset;
    strided_offsets(fits_31_bits(n, rank, shape, src_strides, dst_strides), i, rank, shape, src_strides, dst_strides, &s,
                    &d);
    compute_t v = load_src(src, s);
    if (scaled) {
        v = v * factor;
#if SDTYPE == 7
        v = (double)(float)v;  // i64 computes in f32: the f64 product rounded to it, as the host does
#endif
    }
    store_dst(dst, d, v);
}
