// rotary_embedding of the `cuda` provider, in place on query and key. Compiled after
// `element.cuh`, per dtype.
//
// One block per token; its threads share the token's (head, pair) items, the query's then the
// key's. Each pair is rotated with the reference's operations: four products and a difference and
// a sum, each rounded once in the compute type (f32; f64 for f64 elements: `c_mul`, `c_sub`,
// `c_add` of element.cuh, the `__fmul_rn` family's one rounding each: NVRTC contracts plain
// `x * c - y * s` into an fma, which rounds once instead of twice), then stored in the element
// type. With `round_products` (the op's `rounding = "dtype"` on 16-bit elements) each product is
// rounded to the element type before the difference and the sum (the cos and sin are element
// values already), as PyTorch and vLLM's kernel round. A token whose position lies outside the
// cache is left as it is (native and the cpu provider report it as an error; a kernel cannot).
// Positions are i64, as vLLM passes them.

__device__ __forceinline__ void rotate_pair_at(elem_t* __restrict__ row, int pair, int half_dim, int head_size,
                                               int is_neox, const elem_t* __restrict__ cs, int round_products) {
    int head = pair / half_dim;
    int i = pair - head * half_dim;
    int xi = is_neox ? i : 2 * i;
    int yi = is_neox ? half_dim + i : 2 * i + 1;
    elem_t* h = row + (long long)head * head_size;
    compute_t x = to_c(h[xi]);
    compute_t y = to_c(h[yi]);
    compute_t c = to_c(cs[i]);
    compute_t s = to_c(cs[half_dim + i]);
    compute_t xc = c_mul(x, c), ys = c_mul(y, s), yc = c_mul(y, c), xs = c_mul(x, s);
    if (round_products) {
        xc = round_elem(xc);
        ys = round_elem(ys);
        yc = round_elem(yc);
        xs = round_elem(xs);
    }
    h[xi] = from_c(c_sub(xc, ys));
    h[yi] = from_c(c_add(yc, xs));
}

extern "C" __global__ void CONCAT(rotary_embedding, KERNEL_SUFFIX)(
    elem_t* __restrict__ q, long long q_row_stride, elem_t* __restrict__ k, long long k_row_stride, int has_key,
    const long long* __restrict__ positions, const elem_t* __restrict__ cache, long long cache_row_stride,
    long long tokens, int heads, int kv_heads, int head_size, int rotary_dim, int max_position, int is_neox,
    int round_products) {
    long long token = blockIdx.x;
    if (token >= tokens) return;
    long long position = positions[token];
    if (position < 0 || position >= max_position) return;
    const elem_t* cs = cache + position * cache_row_stride;
    int half_dim = rotary_dim / 2;
    elem_t* q_row = q + token * q_row_stride;
    for (int pair = threadIdx.x; pair < heads * half_dim; pair += blockDim.x) {
        rotate_pair_at(q_row, pair, half_dim, head_size, is_neox, cs, round_products);
    }
    if (has_key) {
        elem_t* k_row = k + token * k_row_stride;
        for (int pair = threadIdx.x; pair < kv_heads * half_dim; pair += blockDim.x) {
            rotate_pair_at(k_row, pair, half_dim, head_size, is_neox, cs, round_products);
        }
    }
}
