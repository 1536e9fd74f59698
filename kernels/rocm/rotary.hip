// rotary_embedding of the `rocm` provider, in place on query and key: `rotary_embedding_<dtype>` for
// f32, f16, bf16 and f64. The numerics are those of the CUDA kernel (`kernels/cuda/rotary.cu`): four
// products and a difference and a sum, each rounded once in the compute type (f32; f64 for f64;
// contraction into fused
// multiply-adds is switched off for them; `tests/hipcc.rs` checks the ISA has none), then stored in the
// element type; with `round_products` each product is rounded to the element type first (the op's
// `rounding = "dtype"`). One block per token; a token whose position lies outside the cache is left
// as it is.

#include "element.hip.h"

#define ROTARY_BLOCK_MAX 256

template <int DTYPE>
__device__ __forceinline__ void rotate_pair_at(typename Elem<DTYPE>::T* row, int pair, int half_dim, int head_size,
                                               int is_neox, const typename Elem<DTYPE>::T* cs, int round_products) {
    // Each product rounds on its own (HIP's `__fmul_rn` is a plain product in a header, which
    // clang would still contract with the sum that follows).
#pragma clang fp contract(off)
    int head = pair / half_dim;
    int i = pair - head * half_dim;
    int xi = is_neox ? i : 2 * i;
    int yi = is_neox ? half_dim + i : 2 * i + 1;
    typename Elem<DTYPE>::T* h = row + (long long)head * head_size;
    Compute<DTYPE> x = Elem<DTYPE>::load(h[xi]);
    Compute<DTYPE> y = Elem<DTYPE>::load(h[yi]);
    Compute<DTYPE> c = Elem<DTYPE>::load(cs[i]);
    Compute<DTYPE> s = Elem<DTYPE>::load(cs[half_dim + i]);
    Compute<DTYPE> xc = x * c, ys = y * s, yc = y * c, xs = x * s;
    if (round_products) {
        xc = round_elem<DTYPE>(xc);
        ys = round_elem<DTYPE>(ys);
        yc = round_elem<DTYPE>(yc);
        xs = round_elem<DTYPE>(xs);
    }
    h[xi] = Elem<DTYPE>::store(xc - ys);
    h[yi] = Elem<DTYPE>::store(yc + xs);
}

template <int DTYPE>
__device__ void rotary_token(typename Elem<DTYPE>::T* q, long long q_row_stride, typename Elem<DTYPE>::T* k,
                             long long k_row_stride, int has_key, const long long* positions,
                             const typename Elem<DTYPE>::T* cache, long long cache_row_stride, long long tokens,
                             int heads, int kv_heads, int head_size, int rotary_dim, int max_position, int is_neox,
                             int round_products) {
    // Grid-stride: the host caps the grid at HIP's 2^32 work-items.
    for (long long token = blockIdx.x; token < tokens; token += gridDim.x) {
        long long position = positions[token];
        if (position < 0 || position >= max_position) continue;
        const typename Elem<DTYPE>::T* cs = cache + position * cache_row_stride;
        int half_dim = rotary_dim / 2;
        typename Elem<DTYPE>::T* q_row = q + token * q_row_stride;
        for (int pair = threadIdx.x; pair < heads * half_dim; pair += blockDim.x) {
            rotate_pair_at<DTYPE>(q_row, pair, half_dim, head_size, is_neox, cs, round_products);
        }
        if (has_key) {
            typename Elem<DTYPE>::T* k_row = k + token * k_row_stride;
            for (int pair = threadIdx.x; pair < kv_heads * half_dim; pair += blockDim.x) {
                rotate_pair_at<DTYPE>(k_row, pair, half_dim, head_size, is_neox, cs, round_products);
            }
        }
    }
}

#define ROTARY_KERNEL_DTYPE(DTYPE, suffix)                                                                          \
    extern "C" __global__ void __launch_bounds__(ROTARY_BLOCK_MAX) rotary_embedding_##suffix(                       \
        Elem<DTYPE>::T* q, long long q_row_stride, Elem<DTYPE>::T* k, long long k_row_stride, int has_key,         \
        const long long* positions, const Elem<DTYPE>::T* cache, long long cache_row_stride, long long tokens,     \
        int heads, int kv_heads, int head_size, int rotary_dim, int max_position, int is_neox,                     \
        int round_products) {                                                                                       \
        rotary_token<DTYPE>(q, q_row_stride, k, k_row_stride, has_key, positions, cache, cache_row_stride, tokens,  \
                            heads, kv_heads, head_size, rotary_dim, max_position, is_neox, round_products);        \
    }

ROTARY_KERNEL_DTYPE(0, f32)
ROTARY_KERNEL_DTYPE(1, f16)
ROTARY_KERNEL_DTYPE(2, bf16)
ROTARY_KERNEL_DTYPE(6, f64)
