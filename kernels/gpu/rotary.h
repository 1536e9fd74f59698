// rotary_embedding, shared by CUDA and HIP: in place on query and key, `rotary_embedding_<dtype>`
// for the dtypes the backend's `GPU_KERNEL_SCALAR_DTYPES` lists. Compiled after the portability
// header and `elem.h`.
//
// One block per token (`GPU_ROWS`); its threads share the token's (head, pair) items, the query's
// then the key's. Each pair is rotated with the reference's operations: four products and a
// difference and a sum, each rounded once in the compute type (f32; f64 for f64 elements: `c_mul`,
// `c_sub`, `c_add`, one rounding each: both compilers contract a plain `x * c - y * s` into an fma,
// which rounds once instead of twice), then stored in the element type. With `round_products` (the
// op's `rounding = "dtype"` on 16-bit elements) each product is rounded to the element type before
// the difference and the sum (the cos and sin are element values already), as PyTorch and vLLM's
// kernel round. A token whose position lies outside the cache is left as it is (native and the cpu
// provider report it as an error; a kernel cannot). Positions are i64, as vLLM passes them.

#ifndef VLLM_IR_GPU_ROTARY_H
#define VLLM_IR_GPU_ROTARY_H

// The largest block the host launches (a multiple of 32 up to it, from the token's pairs).
#define ROTARY_BLOCK_MAX 256

template <int DT>
__device__ __forceinline__ void rotate_pair_at(typename Elem<DT>::T* __restrict__ row, int pair, int half_dim,
                                               int head_size, int is_neox, const typename Elem<DT>::T* __restrict__ cs,
                                               int round_products) {
    typedef Elem<DT> E;
    int head = pair / half_dim;
    int i = pair - head * half_dim;
    int xi = is_neox ? i : 2 * i;
    int yi = is_neox ? half_dim + i : 2 * i + 1;
    typename E::T* h = row + (long long)head * head_size;
    Compute<DT> x = E::load(h[xi]);
    Compute<DT> y = E::load(h[yi]);
    Compute<DT> c = E::load(cs[i]);
    Compute<DT> s = E::load(cs[half_dim + i]);
    Compute<DT> xc = c_mul(x, c), ys = c_mul(y, s), yc = c_mul(y, c), xs = c_mul(x, s);
    if (round_products) {
        xc = round_elem<DT>(xc);
        ys = round_elem<DT>(ys);
        yc = round_elem<DT>(yc);
        xs = round_elem<DT>(xs);
    }
    h[xi] = E::store(c_sub(xc, ys));
    h[yi] = E::store(c_add(yc, xs));
}

template <int DT>
__device__ __forceinline__ void rotary_tokens(typename Elem<DT>::T* __restrict__ q, long long q_row_stride,
                                              typename Elem<DT>::T* __restrict__ k, long long k_row_stride,
                                              int has_key, const long long* __restrict__ positions,
                                              const typename Elem<DT>::T* __restrict__ cache,
                                              long long cache_row_stride, long long tokens, int heads, int kv_heads,
                                              int head_size, int rotary_dim, int max_position, int is_neox,
                                              int round_products) {
    const int half_dim = rotary_dim / 2;
    GPU_ROWS(token, tokens) {
        long long position = positions[token];
        if (position >= 0 && position < max_position) {
            const typename Elem<DT>::T* cs = cache + position * cache_row_stride;
            typename Elem<DT>::T* q_row = q + token * q_row_stride;
            for (int pair = threadIdx.x; pair < heads * half_dim; pair += blockDim.x) {
                rotate_pair_at<DT>(q_row, pair, half_dim, head_size, is_neox, cs, round_products);
            }
            if (has_key) {
                typename Elem<DT>::T* k_row = k + token * k_row_stride;
                for (int pair = threadIdx.x; pair < kv_heads * half_dim; pair += blockDim.x) {
                    rotate_pair_at<DT>(k_row, pair, half_dim, head_size, is_neox, cs, round_products);
                }
            }
        }
    }
}

#define ROTARY_KERNEL(DT, SUFFIX, VEC, unused)                                                                     \
    extern "C" __global__ void __launch_bounds__(ROTARY_BLOCK_MAX) rotary_embedding_##SUFFIX(                       \
        Elem<DT>::T* __restrict__ q, long long q_row_stride, Elem<DT>::T* __restrict__ k, long long k_row_stride,  \
        int has_key, const long long* __restrict__ positions, const Elem<DT>::T* __restrict__ cache,               \
        long long cache_row_stride, long long tokens, int heads, int kv_heads, int head_size, int rotary_dim,      \
        int max_position, int is_neox, int round_products) {                                                       \
        rotary_tokens<DT>(q, q_row_stride, k, k_row_stride, has_key, positions, cache, cache_row_stride, tokens,    \
                          heads, kv_heads, head_size, rotary_dim, max_position, is_neox, round_products);          \
    }

GPU_KERNEL_SCALAR_DTYPES(ROTARY_KERNEL, unused)

#endif  // VLLM_IR_GPU_ROTARY_H
