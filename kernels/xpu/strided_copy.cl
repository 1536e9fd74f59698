// Strided copy on the device: the elements a source layout describes, into a destination layout of
// the same shape (what `clone` and `contiguous` of an xpu tensor do), one work-item per element in
// row-major order. Dtype-agnostic: ELEM is the unsigned integer type of the element size (uchar,
// ushort, uint, ulong), so every dtype copies bit for bit. Up to 8 dimensions (shape and strides
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

// The storage offsets of element i (row-major) in the source and the destination layouts.
inline void strided_offsets(long i, int rank, long8 shape, long8 src_strides, long8 dst_strides, long* s, long* d) {
    long rest = i;
    for (int k = rank - 1; k >= 0; --k) {
        long extent = at8(shape, k);
        long index = rest % extent;
        rest /= extent;
        *s += index * at8(src_strides, k);
        *d += index * at8(dst_strides, k);
    }
}

#ifdef ELEM
__kernel void strided_copy(__global const ELEM* src, long src_offset, __global ELEM* dst, long dst_offset, long n,
                           int rank, long8 shape, long8 src_strides, long8 dst_strides) {
    long i = get_global_id(0);
    if (i >= n) return;
    long s = src_offset;
    long d = dst_offset;
    strided_offsets(i, rank, shape, src_strides, dst_strides, &s, &d);
    dst[d] = src[s];
}
#endif
