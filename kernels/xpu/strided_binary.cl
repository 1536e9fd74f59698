// `add` and `mul` of two strided tensors of the element type (OpenCL C 1.2, built after
// `element.cl` and `strided_copy.cl`): one work-item per element in row-major order, into a compact
// destination (a launch writes its elements from `first` on: a copy past 8 dimensions takes
// several), computed in f32 (exact for f16 and bf16 operands) and rounded once to the element type,
// as the host computes it (f64, then f32: the same result for one sum or product).
//
// Define required: OP 0 = add, 1 = mul.

__kernel void strided_binary(__global const elem_t* a, long a_offset, __global const elem_t* b, long b_offset,
                             __global elem_t* dst, long first, long n, int rank, long8 shape, long8 a_strides,
                             long8 b_strides) {
    long i = get_global_id(0);
    if (i >= n) return;
    long s = a_offset;
    long t = b_offset;
    strided_offsets(i, rank, shape, a_strides, b_strides, &s, &t);
#if OP == 0
    float v = LOAD(a, s) + LOAD(b, t);
#else
    float v = LOAD(a, s) * LOAD(b, t);
#endif
    STORE(dst, first + i, v);
}
