// `add` and `mul` of two strided tensors of one dtype (OpenCL C 1.2, built after the helpers of
// `element.cl`, `strided_copy.cl`'s indexing and `strided_convert.cl`'s loads and stores, with
// SDTYPE = DDTYPE the dtype): one work-item per element in row-major order, into a compact
// destination (a launch writes its elements from `first` on: one past 8 dimensions takes several),
// computed in the compute dtype and rounded once to the dtype, as the host computes it: f32 for
// every dtype but f64 (exact operands, one rounding: the f64 sum or product of f32 operands rounded
// to f32 is the f32 one), f64 for f64, and for i64 the f64 result rounded to f32 (i64's compute
// dtype) as the host rounds it.
//
// Define required: OP 0 = add, 1 = mul.

__kernel void strided_binary(__global const src_t* a, long a_offset, __global const src_t* b, long b_offset,
                             __global dst_t* dst, long first, long n, int rank, long8 shape, long8 a_strides,
                             long8 b_strides) {
    long i = get_global_id(0);
    if (i >= n) return;
    long s = a_offset;
    long t = b_offset;
    strided_offsets(fits_31_bits(n, rank, shape, a_strides, b_strides), i, rank, shape, a_strides, b_strides, &s, &t);
#if OP == 0
    compute_t v = load_src(a, s) + load_src(b, t);
#else
    compute_t v = load_src(a, s) * load_src(b, t);
#endif
#if SDTYPE == 7
    v = (double)(float)v;
#endif
    store_dst(dst, first + i, v);
}
