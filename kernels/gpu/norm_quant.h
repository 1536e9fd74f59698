// RMS normalization followed by fp8 quantization in one kernel, shared by CUDA and HIP:
// `norm_quant_<dtype>` and, except for f64, its 16-byte form `norm_quant_<dtype>_vec`, for the ops
// `rms_norm_static_fp8_quant`, `rms_norm_dynamic_per_token_quant`,
// `fused_add_rms_norm_static_fp8_quant` and `fused_add_rms_norm_dynamic_per_token_quant`. Compiled
// after `quant.h` (the conversion, the chunk codes and stores).
//
// One block of QUANT_BLOCK threads per row (`GPU_ROWS`), every value in the
// compute type (f32, f64 for f64 elements), each thread owning chunks t, t + QUANT_BLOCK, ...; the
// `_vec` form has 16-byte loads of x, the residual and the weight, 16-byte stores of the residual
// output and CHUNK-byte stores of q. A thread keeps its first `quant_cache<DT>` chunks of x and the
// residual in registers, their loads all issued before any is read, so a row up to QUANT_BLOCK *
// CHUNK * 4 elements is read once; chunks past them are read again in each pass. Pass 1 sums the
// squares of a = x (+ r) (in the thread's chunk order, then the block's tree); rstd = 1 / sqrt(sum /
// hidden + eps) (IEEE division and square root); a row whose f32 sum overflows is summed again in
// double, serially, as the norms do. Pass 2 (dynamic only: a static scale needs no
// reduction) reduces the absmax of the normalized values z. The last pass recomputes z, writes the
// residual output (the rounded sum) and q = fp8(z / s), or fp8(z * c(1 / s)) with `invert` (a
// static scale under `rounding = "dtype"`). With `round_sum` (`rounding = "dtype"` on 16-bit
// elements) every pass reads the sum rounded to the element type, the residual output's values. z = round(round(a * rstd) * w), rounded to
// the element type at each step: the rounding points of the composition `quant(rms_norm(x))`. Each
// residual element is read and written by the same thread, the write after every read of it, so
// the residual output may be the residual's own rows (in place: `residual_out` is `r`, with its
// stride). A weight of another type than x is read element by element (`norm_quant_w<weight>_<dtype>`).

#ifndef VLLM_IR_GPU_NORM_QUANT_H
#define VLLM_IR_GPU_NORM_QUANT_H

// Chunk values a = x (+ r), in the compute type; the sum rounded to the element type with
// `has_residual == 2` (`round_sum`).
template <int DT, bool VEC>
__device__ __forceinline__ void row_values(const RowChunk<DT, VEC>& xc, const RowChunk<DT, VEC>& rc, int has_residual,
                                           Compute<DT>* a) {
#pragma unroll
    for (int i = 0; i < Elem<DT>::CHUNK; ++i) {
        a[i] = Elem<DT>::load(xc.get(i));
        if (has_residual) a[i] = c_add(a[i], Elem<DT>::load(rc.get(i)));
        if (has_residual == 2) a[i] = round_elem<DT>(a[i]);
    }
}

// Reads chunk `c` of x and, when there is one, of the residual.
template <int DT, bool VEC>
__device__ __forceinline__ void load_pair(const typename Elem<DT>::T* x_row, const typename Elem<DT>::T* r_row, int c,
                                          int hidden, int has_residual, RowChunk<DT, VEC>& xc, RowChunk<DT, VEC>& rc) {
    xc.load(x_row, c, hidden);
    if (has_residual) rc.load(r_row, c, hidden);
}

// The normalized values z of a chunk's values a (in place), weighted by chunk `c` of w when given.
// A weight of x's type (WT == DT) is read as a chunk like x; one of another type element by element
// (scalar loads: its chunks are another size), the weight step in its type as the reference's step
// 5 does: z = round_x(round_w(round_w(y) * w)), computed in double when either type is f64.
template <int DT, int WT, bool VEC>
__device__ __forceinline__ void normalize(Compute<DT>* a, Compute<DT> rstd, const typename Elem<WT>::T* w, int c,
                                          int hidden, int has_weight) {
    if constexpr (WT == DT) {
        RowChunk<DT, VEC> wc;
        if (has_weight) wc.load(w, c, hidden);
#pragma unroll
        for (int i = 0; i < Elem<DT>::CHUNK; ++i) {
            a[i] = round_elem<DT>(c_mul(a[i], rstd));
            if (has_weight) a[i] = round_elem<DT>(c_mul(a[i], Elem<DT>::load(wc.get(i))));
        }
    } else {
        typedef typename MixedCompute<DT, WT>::T M;
        const int first = c * Elem<DT>::CHUNK;
#pragma unroll
        for (int i = 0; i < Elem<DT>::CHUNK; ++i) {
            Compute<DT> y = c_mul(a[i], rstd);
            if (has_weight) {
                M wv = first + i < hidden ? (M)Elem<WT>::load(w[first + i]) : M(0);
                M z = round_elem<WT>(c_mul(round_elem<WT>((M)y), wv));
                a[i] = (Compute<DT>)round_elem<DT>(z);
            } else {
                a[i] = round_elem<DT>(y);
            }
        }
    }
}

// The sum of the squares of a chunk's values, added to `squares` in element order.
template <int DT>
__device__ __forceinline__ void add_squares(const Compute<DT>* a, Compute<DT>& squares) {
#pragma unroll
    for (int i = 0; i < Elem<DT>::CHUNK; ++i) squares = c_add(squares, c_mul(a[i], a[i]));
}

// The sum of squares of a row's values a = x (+ r) (the sum rounded with `has_residual == 2`) when
// their sum in the compute type overflowed although the mean square may fit (|x| above about
// 1.8e19 / sqrt(hidden) in f32): the squares summed in double, serially in element order, by the
// calling thread, as the norms' `norm_wide_sum_squares` does. Divided once in double and rounded to
// the compute type, that is the reference's mean square. A rare path, inlined: as a call it took
// ten more registers in the mixed-weight 16-byte kernels (Gemma's f32 weight on bf16), a quarter of
// their occupancy.
template <int DT>
__device__ __forceinline__ double quant_wide_sum_squares(const typename Elem<DT>::T* x_row,
                                                         const typename Elem<DT>::T* r_row, int hidden,
                                                         int has_residual) {
    double sum = 0;
    for (int j = 0; j < hidden; ++j) {
        Compute<DT> a = Elem<DT>::load(x_row[j]);
        if (has_residual) a = c_add(a, Elem<DT>::load(r_row[j]));
        if (has_residual == 2) a = round_elem<DT>(a);
        sum = c_add(sum, c_mul((double)a, (double)a));
    }
    return sum;
}

// The largest magnitude of a chunk's values, folded into `absmax` (fmax: NaN skipped).
template <int DT>
__device__ __forceinline__ void fold_absmax(const Compute<DT>* a, Compute<DT>& absmax) {
#pragma unroll
    for (int i = 0; i < Elem<DT>::CHUNK; ++i) absmax = c_fmax(absmax, c_fabs(a[i]));
}

// The last pass on one chunk: the residual output (when there is a residual) and q.
template <int DT, int WT, bool VEC>
__device__ __forceinline__ void finish_chunk(const RowChunk<DT, VEC>& xc, const RowChunk<DT, VEC>& rc, int c,
                                             Compute<DT> rstd, QuantScale<Compute<DT>> s, const typename Elem<WT>::T* w,
                                             typename Elem<DT>::T* out_row, unsigned char* q_row, int hidden,
                                             int has_residual, int has_weight, int format) {
    typedef Elem<DT> E;
    Compute<DT> a[E::CHUNK];
    row_values(xc, rc, has_residual, a);
    if (has_residual) {
        typename E::T sum[E::CHUNK];
#pragma unroll
        for (int i = 0; i < E::CHUNK; ++i) sum[i] = E::store(a[i]);
        RowChunk<DT, VEC>::store(out_row, c, hidden, sum);
    }
    normalize<DT, WT, VEC>(a, rstd, w, c, hidden, has_weight);
    Codes<E::CHUNK> codes;
#pragma unroll
    for (int i = 0; i < E::CHUNK; ++i) codes.set(i, to_fp8(s.apply(a[i]), format));
    store_codes<VEC>(q_row, c, hidden, codes);
}

template <int DT, int WT, bool VEC>
__device__ __forceinline__ void norm_quant_rows(unsigned char* __restrict__ q, float* __restrict__ scales,
                                                typename Elem<DT>::T* residual_out, const typename Elem<DT>::T* x,
                                                const typename Elem<DT>::T* r,
                                                const typename Elem<WT>::T* __restrict__ w, long long n_rows,
                                                int hidden, long long x_row_stride, long long r_row_stride,
                                                long long out_row_stride, Compute<DT> eps,
                                                const float* __restrict__ scale, int has_residual, int has_weight,
                                                int dynamic, int has_scale, int format, int round_sum, int invert) {
    typedef Elem<DT> E;
    // 2 marks a residual whose sum is rounded (row_values).
    has_residual = has_residual ? 1 + (round_sum != 0) : 0;
    typedef Compute<DT> C;
    typedef RowChunk<DT, VEC> Chunk;
    constexpr int CACHE = quant_cache<DT>();
    __shared__ C scratch[QUANT_BLOCK];
    const int n = quant_chunks<DT>(hidden);
    const int first_uncached = threadIdx.x + CACHE * QUANT_BLOCK;
    GPU_ROWS(row, n_rows) {
        const typename E::T* x_row = x + row * x_row_stride;
        const typename E::T* r_row = r + row * r_row_stride;
        unsigned char* q_row = q + row * (long long)hidden;
        typename E::T* out_row = residual_out + row * out_row_stride;

        // Every slot loads x and the residual (x again when there is none), with no test between the
        // loads: a slot past the row's end loads its last chunk, which no pass uses. Tested per slot,
        // the compiler read the first chunks before the last loads were issued.
        const typename E::T* r_cached = has_residual ? r_row : x_row;
        Chunk xs[CACHE], rs[CACHE];
#pragma unroll
        for (int k = 0; k < CACHE; ++k) {
            int c = min((int)threadIdx.x + k * QUANT_BLOCK, n - 1);
            xs[k].load(x_row, c, hidden);
            rs[k].load(r_cached, c, hidden);
        }

        // Elements past `hidden` read as zero and add an exact zero.
        C squares = 0.0f;
#pragma unroll
        for (int k = 0; k < CACHE; ++k) {
            if ((int)threadIdx.x + k * QUANT_BLOCK < n) {
                C a[E::CHUNK];
                row_values(xs[k], rs[k], has_residual, a);
                add_squares<DT>(a, squares);
            }
        }
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            Chunk xc, rc;
            load_pair<DT, VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
            C a[E::CHUNK];
            row_values(xc, rc, has_residual, a);
            add_squares<DT>(a, squares);
        }
        const C total = block_sum<QUANT_BLOCK>(squares, scratch);
        C mean_square;
        if (sizeof(C) == 4 && isinf(total)) {
            // Every thread has the block's total, so all take this branch and reach the barrier:
            // the residual output may be r's own rows, and no thread writes them before every one
            // has read them.
            mean_square = (C)c_div(quant_wide_sum_squares<DT>(x_row, r_row, hidden, has_residual), (double)hidden);
            __syncthreads();
        } else {
            mean_square = c_div(total, (C)hidden);
        }
        C rstd = c_div(C(1), c_sqrt(c_add(mean_square, eps)));

        C s;
        if (dynamic) {
            // Elements past `hidden` normalize to zero (or NaN, which fmax skips): the maximum stays.
            C absmax = 0.0f;
#pragma unroll
            for (int k = 0; k < CACHE; ++k) {
                int c = threadIdx.x + k * QUANT_BLOCK;
                if (c < n) {
                    C a[E::CHUNK];
                    row_values(xs[k], rs[k], has_residual, a);
                    normalize<DT, WT, VEC>(a, rstd, w, c, hidden, has_weight);
                    fold_absmax<DT>(a, absmax);
                }
            }
            auto uncached_absmax = [&](int c) {
                Chunk xc, rc;
                load_pair<DT, VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
                C a[E::CHUNK];
                row_values(xc, rc, has_residual, a);
                normalize<DT, WT, VEC>(a, rstd, w, c, hidden, has_weight);
                fold_absmax<DT>(a, absmax);
            };
            if constexpr (DT == 6) {
                // f64 (a reference dtype) keeps this loop rolled: unrolled, ptxas spilled a few of
                // its doubles to a stack frame.
#pragma unroll 1
                for (int c = first_uncached; c < n; c += QUANT_BLOCK) uncached_absmax(c);
            } else {
                for (int c = first_uncached; c < n; c += QUANT_BLOCK) uncached_absmax(c);
            }
            // The branch is the same for the whole block, so every thread reaches the barriers.
            absmax = block_max<QUANT_BLOCK>(absmax, scratch);
            if (has_scale) absmax = c_fmin(absmax, (C)*scale);
            C max_finite = format == 0 ? 448.0f : 57344.0f;
            s = c_fmax(c_div(absmax, max_finite), c_div(C(1), max_finite * 512));
            if (threadIdx.x == 0) scales[row] = s;
        } else {
            s = *scale;
        }
        const QuantScale<C> by = dynamic ? QuantScale<C>::divide(s) : QuantScale<C>::of_static(scale, s, invert);

#pragma unroll
        for (int k = 0; k < CACHE; ++k) {
            int c = threadIdx.x + k * QUANT_BLOCK;
            if (c < n) {
                finish_chunk<DT, WT, VEC>(xs[k], rs[k], c, rstd, by, w, out_row, q_row, hidden, has_residual, has_weight,
                                      format);
            }
        }
        for (int c = first_uncached; c < n; c += QUANT_BLOCK) {
            Chunk xc, rc;
            load_pair<DT, VEC>(x_row, r_row, c, hidden, has_residual, xc, rc);
            finish_chunk<DT, WT, VEC>(xc, rc, c, rstd, by, w, out_row, q_row, hidden, has_residual, has_weight, format);
        }
    }
}

#define NORM_QUANT_KERNEL(DT, SUFFIX, VEC, unused)                                                                 \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) norm_quant_##SUFFIX(                                  \
        unsigned char* __restrict__ q, float* __restrict__ scales, Elem<DT>::T* residual_out, const Elem<DT>::T* x, \
        const Elem<DT>::T* r, const Elem<DT>::T* __restrict__ w, long long n_rows, int hidden,                     \
        long long x_row_stride, long long r_row_stride, long long out_row_stride, Compute<DT> eps,                 \
        const float* __restrict__ scale, int has_residual, int has_weight, int dynamic, int has_scale,             \
        int format, int round_sum, int invert) {                                                                   \
        norm_quant_rows<DT, DT, VEC>(q, scales, residual_out, x, r, w, n_rows, hidden, x_row_stride, r_row_stride, \
                                     out_row_stride, eps, scale, has_residual, has_weight, dynamic, has_scale,     \
                                     format, round_sum, invert);                                                   \
    }

GPU_KERNEL_DTYPES(NORM_QUANT_KERNEL, unused)

// `norm_quant_w<weight>_<dtype>`: the same with a weight of another type WT (a Gemma-style f32 weight
// on bf16 rows). The instance whose weight type is x's own is empty: the host launches
// `norm_quant_<dtype>` for that.
#define NORM_QUANT_MIXED_KERNEL(DT, SUFFIX, VEC, WT, WNAME)                                                        \
    extern "C" __global__ void __launch_bounds__(QUANT_BLOCK) norm_quant_w##WNAME##_##SUFFIX(                       \
        unsigned char* __restrict__ q, float* __restrict__ scales, Elem<DT>::T* residual_out, const Elem<DT>::T* x, \
        const Elem<DT>::T* r, const Elem<WT>::T* __restrict__ w, long long n_rows, int hidden,                     \
        long long x_row_stride, long long r_row_stride, long long out_row_stride, Compute<DT> eps,                 \
        const float* __restrict__ scale, int has_residual, int has_weight, int dynamic, int has_scale,             \
        int format, int round_sum, int invert) {                                                                   \
        if constexpr (WT != DT) {                                                                                  \
            norm_quant_rows<DT, WT, VEC>(q, scales, residual_out, x, r, w, n_rows, hidden, x_row_stride,           \
                                         r_row_stride, out_row_stride, eps, scale, has_residual, has_weight,       \
                                         dynamic, has_scale, format, round_sum, invert);                           \
        }                                                                                                          \
    }

#define NORM_QUANT_MIXED_KERNELS(DT, SUFFIX, VEC, unused)  \
    NORM_QUANT_MIXED_KERNEL(DT, SUFFIX, VEC, 0, f32)       \
    NORM_QUANT_MIXED_KERNEL(DT, SUFFIX, VEC, 1, f16)       \
    NORM_QUANT_MIXED_KERNEL(DT, SUFFIX, VEC, 2, bf16)      \
    NORM_QUANT_MIXED_KERNEL(DT, SUFFIX, VEC, 6, f64)

GPU_KERNEL_DTYPES(NORM_QUANT_MIXED_KERNELS, unused)

#endif  // VLLM_IR_GPU_NORM_QUANT_H
