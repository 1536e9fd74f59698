// Strided conversion on the device (OpenCL C 1.2, built after `element.cl` and `strided_copy.cl`): the elements a source
// layout describes, into a destination layout of the same shape, converted from the source dtype
// to the element type (DTYPE), one work-item per element in row-major order: `copy_` between two
// dtypes, and `scale` (`scaled` != 0) as `round_dst(round_f32(v * factor))`, the factor already
// rounded to f32 by the caller. Every source value is exact in f32, so each result is rounded once
// (to nearest even), as the host's conversion through f64 rounds it.
//
// Define required: SDTYPE the source's dtype: 0 = f32, 1 = f16, 2 = bf16, 3 = f8e4m3fn, 4 = f8e5m2.
// Up to 8 dimensions (shape and strides padded with 1 and 0); offsets and strides in elements.

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
#else
#error "SDTYPE must be 0, 1, 2, 3 or 4"
#endif

__kernel void strided_convert(__global const src_t* src, long src_offset, __global elem_t* dst, long dst_offset,
                              long n, int rank, long8 shape, long8 src_strides, long8 dst_strides, float factor,
                              int scaled) {
    long i = get_global_id(0);
    if (i >= n) return;
    long s = src_offset;
    long d = dst_offset;
    strided_offsets(i, rank, shape, src_strides, dst_strides, &s, &d);
    float v = load_src(src, s);
    if (scaled) v = v * factor;
    STORE(dst, d, v);
}
