// rotary_embedding, in place on query and key (after the element prelude).
//
// One work-group per token; its work-items share the token's (head, pair) items, the query's then
// the key's. Each pair is rotated with the reference's operations: four products and a difference
// and a sum, each rounded once in the compute dtype (f32; f64 for f64 elements; no contraction into
// fused multiply-adds), then stored in the element type; with `round_products` (the op's
// `rounding = "dtype"`) each product is rounded to the element type first. A token whose position
// lies outside the cache is left as it is (the cpu provider and native report it as an error; a
// kernel cannot). No barrier: items never share data.

#pragma OPENCL FP_CONTRACT OFF

inline void rotate_pair_at(__global elem_t* row, int pair, int half_dim, int head_size, int is_neox,
                           __global const elem_t* cs, int round_products) {
    int head = pair / half_dim;
    int i = pair - head * half_dim;
    int xi = is_neox ? i : 2 * i;
    int yi = is_neox ? half_dim + i : 2 * i + 1;
    __global elem_t* h = row + (long)head * head_size;
    compute_t x = LOAD(h, xi);
    compute_t y = LOAD(h, yi);
    compute_t c = LOAD(cs, i);
    compute_t s = LOAD(cs, half_dim + i);
    compute_t xc = x * c;
    compute_t ys = y * s;
    compute_t yc = y * c;
    compute_t xs = x * s;
    if (round_products) {
        xc = round_to_elem(xc);
        ys = round_to_elem(ys);
        yc = round_to_elem(yc);
        xs = round_to_elem(xs);
    }
    STORE(h, xi, xc - ys);
    STORE(h, yi, yc + xs);
}

__kernel void NAME(rotary_embedding)(__global elem_t* q, long q_offset, long q_row_stride,
                                     __global elem_t* k, long k_offset, long k_row_stride, int has_key,
                                     __global const long* positions, long positions_offset,
                                     __global const elem_t* cache, long cache_offset, long cache_row_stride,
                                     long tokens, int heads, int kv_heads, int head_size, int rotary_dim,
                                     int max_position, int is_neox, int round_products) {
    long token = get_group_id(0);
    if (token >= tokens) return;
    long position = positions[positions_offset + token];
    if (position < 0 || position >= max_position) return;
    __global const elem_t* cs = cache + cache_offset + position * cache_row_stride;
    int half_dim = rotary_dim / 2;
    int lane = get_local_id(0);
    int lanes = get_local_size(0);
    __global elem_t* q_row = q + q_offset + token * q_row_stride;
    for (int pair = lane; pair < heads * half_dim; pair += lanes) {
        rotate_pair_at(q_row, pair, half_dim, head_size, is_neox, cs, round_products);
    }
    if (has_key) {
        __global elem_t* k_row = k + k_offset + token * k_row_stride;
        for (int pair = lane; pair < kv_heads * half_dim; pair += lanes) {
            rotate_pair_at(k_row, pair, half_dim, head_size, is_neox, cs, round_products);
        }
    }
}
