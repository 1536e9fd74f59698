// Strided copy on the device: the elements a source layout describes, into a destination layout of
// the same shape (what `clone` and `contiguous` of an xpu tensor do), one work-item per element in
// row-major order. Dtype-agnostic: ELEM is the unsigned integer type of the element size (uchar,
// ushort, uint, ulong), so every dtype copies bit for bit, or uint4 for the wide copy's 16-byte units
// (rows contiguous on both sides: `CopyDims::widened` on the host). Up to 8 dimensions (shape and strides
// padded with 1 and 0); offsets and strides in elements. Without ELEM only the indexing is defined
// (`strided_convert.cl` is built after it).

inline long at8(long8 v, int k) {
    switch (k) {
        case 0: return v.s0;
        case 1: return v.s1;
        case 2: return v.s2;
        case 3: return v.s3;
        case 4: return v.s4;
        case 5: return v.s5;
        case 6: return v.s6;
        default: return v.s7;
    }
}

// Whether every element index below n and every offset of both layouts (extents at least 1,
// strides not negative) fits 31 bits, so the offsets are computed with 32-bit divisions, a fraction
// of the instructions of 64-bit ones. The same for every work-item of a launch.
inline bool fits_31_bits(long n, int rank, long8 shape, long8 src_strides, long8 dst_strides) {
    long src = 0;
    long dst = 0;
    for (int k = 0; k < rank; ++k) {
        src += (at8(shape, k) - 1) * at8(src_strides, k);
        dst += (at8(shape, k) - 1) * at8(dst_strides, k);
    }
    return n <= 0x7fffffffL && src <= 0x7fffffffL && dst <= 0x7fffffffL;
}

// The storage offsets of element i (row-major) in the source and the destination layouts, added to
// *s and *d: in 32-bit arithmetic where `narrow` (fits_31_bits) says it is exact, else in 64-bit.
inline void strided_offsets(bool narrow, long i, int rank, long8 shape, long8 src_strides, long8 dst_strides, long* s,
                            long* d) {
    if (narrow) {
        uint rest = (uint)i;
        uint src = 0;
        uint dst = 0;
        for (int k = rank - 1; k >= 0; --k) {
            uint extent = (uint)at8(shape, k);
            uint index = rest % extent;
            rest /= extent;
            src += index * (uint)at8(src_strides, k);
            dst += index * (uint)at8(dst_strides, k);
        }
        *s += (long)src;
        *d += (long)dst;
    } else {
        long rest = i;
        for (int k = rank - 1; k >= 0; --k) {
            long extent = at8(shape, k);
            long index = rest % extent;
            rest /= extent;
            *s += index * at8(src_strides, k);
            *d += index * at8(dst_strides, k);
        }
    }
}

#ifdef ELEM
__kernel void strided_copy(__global const ELEM* src, long src_offset, __global ELEM* dst, long dst_offset, long n,
                           int rank, long8 shape, long8 src_strides, long8 dst_strides) {
    long i = get_global_id(0);
    if (i >= n) return;
    long s = src_offset;
    long d = dst_offset;
    strided_offsets(fits_31_bits(n, rank, shape, src_strides, dst_strides), i, rank, shape, src_strides, dst_strides, &s,
                    &d);
    dst[d] = src[s];
}
#endif
