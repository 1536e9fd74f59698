//! `rotary_embedding` on the cpu, in place on query and key.
//!
//! Each token's row is widened into f32 scratch with its cache row, every pair of every head is
//! rotated with [`rotate_pair`] (the reference's operations, so results are bit-identical to
//! native), and the row is stored back in its own layout (query and key may be views of one qkv
//! buffer's rows). Tokens are split across threads as the norms' rows are. Positions are checked
//! against the cache before anything is written.

use ir_core::storage::{CpuBuffer, Storage};
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};
use ir_ops::rotary_embedding::{check_positions, pair_indices, rotate_pair};
use kernel_support::{RotaryCall, RotaryLaunch, Rows, register_rotary};
use rayon::prelude::*;

use crate::element::CpuElement;
use crate::rows::{Weight, rms_norm_row, rows_per_task, with_scratch};

/// Registers `rotary_embedding` on the cpu (in place).
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    register_rotary(registry, DeviceKind::Cpu, ImplSpec::new(crate::PROVIDER), rotary_embedding_cpu)
}

/// `rotary_embedding` on the cpu: rotates query and key (when given) in their storage and returns them.
pub fn rotary_embedding_cpu(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let RotaryCall { positions, mut query, mut key, cos_sin_cache, launch, round_products } = call;
    let dtype = query.tensor().dtype();
    let pass = Pass::new(positions, cos_sin_cache, &launch, round_products)?;
    for (param, tensor, rows) in [("query", Some(&mut query), Some(launch.query)), ("key", key.as_mut(), launch.key)] {
        let Some(tensor) = tensor else { continue };
        let rows = rows
            .ok_or_else(|| KernelError::InvalidArguments { reason: format!("the launch has no rows for {param}") })?
            .rows()?;
        let Storage::Cpu(buffer) = tensor.storage_mut()? else { return Err(crate::not_on_cpu(param)) };
        match dtype {
            DType::F32 => pass.rotate::<f32>(buffer, rows),
            DType::F16 => pass.rotate::<half::f16>(buffer, rows),
            DType::BF16 => pass.rotate::<half::bf16>(buffer, rows),
            other => return Err(crate::unsupported_dtype(other)),
        }
    }
    Ok((query.into_tensor(), key.map(UniqueTensor::into_tensor)))
}

/// `fused_qk_norm_rope` on the cpu, in place: per token, each head of the query (then the key)
/// normalized by the cpu `rms_norm` row into this thread's scratch (rounded to the tensor's dtype,
/// as `rms_norm` stores it), the row rotated as `rotary_embedding_cpu` rotates it and stored back: the cpu's
/// `rms_norm` and `rotary_embedding` rows composed, so the unfused chain's bits (the op's program's
/// too, tested), reading and writing each row once. Query and key may be column slices of one qkv
/// buffer; positions are checked against the cache before anything is written.
#[allow(clippy::too_many_arguments)] // one argument per parameter of the op
pub fn fused_qk_norm_rope_cpu(
    positions: &Tensor,
    mut query: UniqueTensor,
    mut key: Option<UniqueTensor>,
    q_weight: &Tensor,
    k_weight: Option<&Tensor>,
    cos_sin_cache: &Tensor,
    epsilon: f64,
    head_size: i64,
    rotary_dim: i64,
    is_neox_style: bool,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let dtype = query.tensor().dtype();
    let launch = RotaryLaunch::of(
        positions,
        query.tensor(),
        key.as_ref().map(UniqueTensor::tensor),
        cos_sin_cache,
        head_size,
        rotary_dim,
        is_neox_style,
    )?;
    let pass = Pass::new(positions, cos_sin_cache, &launch, rounding.rounds_intermediates(dtype))?;
    let eps = epsilon as f32;
    for (param, tensor, rows, weight) in
        [("query", Some(&mut query), Some(launch.query), Some(q_weight)), ("key", key.as_mut(), launch.key, k_weight)]
    {
        let Some(tensor) = tensor else { continue };
        let weight = weight.ok_or_else(|| KernelError::InvalidArguments {
            reason: format!("fused_qk_norm_rope: {param} without its norm weight"),
        })?;
        let rows = rows
            .ok_or_else(|| KernelError::InvalidArguments { reason: format!("the launch has no rows for {param}") })?
            .rows()?;
        let weight = crate::RowWeight::of(Some(weight), dtype)?;
        let Storage::Cpu(buffer) = tensor.storage_mut()? else { return Err(crate::not_on_cpu(param)) };
        match dtype {
            DType::F32 => pass.norm_rotate::<f32>(buffer, rows, weight.typed(), eps),
            DType::F16 => pass.norm_rotate::<half::f16>(buffer, rows, weight.typed(), eps),
            DType::BF16 => pass.norm_rotate::<half::bf16>(buffer, rows, weight.typed(), eps),
            other => return Err(crate::unsupported_dtype(other)),
        }
    }
    Ok((query.into_tensor(), key.map(UniqueTensor::into_tensor)))
}

/// What every rotated tensor shares: the checked positions and the cache.
struct Pass<'a> {
    /// Checked by `check_positions`: each is a row of the cache.
    positions: &'a [i64],
    cache: &'a CpuBuffer,
    cache_rows: Rows,
    launch: &'a RotaryLaunch,
    /// `dtype` rounding ([`RotaryCall::round_products`]).
    round_products: bool,
}

impl<'a> Pass<'a> {
    /// The positions (checked in place against the cache: no per-call list) and the cache of a call
    /// launched as `launch`.
    fn new(
        positions: &'a Tensor,
        cos_sin_cache: &'a Tensor,
        launch: &'a RotaryLaunch,
        round_products: bool,
    ) -> Result<Pass<'a>, KernelError> {
        let stored = positions.cpu_buffer().ok_or_else(|| crate::not_on_cpu("positions"))?.typed::<i64>();
        let end = positions.offset().checked_add(launch.geometry.tokens);
        let positions = end
            .and_then(|end| stored.get(positions.offset()..end))
            .ok_or_else(|| KernelError::InvalidArguments { reason: "positions lie outside their buffer".to_owned() })?;
        check_positions(positions, launch.geometry.max_position)?;
        let cache = cos_sin_cache.cpu_buffer().ok_or_else(|| crate::not_on_cpu("cos_sin_cache"))?;
        // The row views the launch was made with (not derived from the layouts a second time).
        Ok(Pass { positions, cache, cache_rows: launch.cache.rows()?, launch, round_products })
    }

    /// The cache's rows as `T`, and their stride.
    fn cache<T: CpuElement>(&self) -> (&[T], usize) {
        let rows = self.cache_rows;
        (&self.cache.typed::<T>()[rows.offset..rows.offset + rows.span()], rows.row_stride)
    }

    /// Rotates the rows of one tensor in place.
    fn rotate<T: CpuElement>(&self, buffer: &mut CpuBuffer, rows: Rows) {
        let g = self.launch.geometry;
        let rot = g.rotary_dim;
        let width = rows.hidden;
        if rows.n_rows == 0 || width == 0 {
            return;
        }
        let (cache, cache_stride) = self.cache::<T>();
        let data = &mut buffer.typed_mut::<T>()[rows.offset..rows.offset + rows.span()];
        let per_task = rows_per_task(width, size_of::<T>());
        let task = |scratch: &mut [f32], (row, &position): (&mut [T], &i64)| {
            let cache_row = &cache[position as usize * cache_stride..][..rot];
            rotate_row(&mut row[..width], cache_row, scratch, g.head_size, g.is_neox_style, self.round_products);
        };
        if rows.n_rows <= per_task {
            // On the calling thread, in its reused scratch (handing one task to the thread pool
            // costs more than a decode-sized call).
            with_scratch(width + rot, |scratch: &mut [f32]| {
                data.chunks_mut(rows.row_stride).zip(self.positions.iter()).for_each(|item| task(scratch, item));
            });
            return;
        }
        data.par_chunks_mut(rows.row_stride)
            .zip(self.positions.par_iter())
            .with_min_len(per_task)
            .for_each_init(|| vec![0f32; width + rot], |scratch, item| task(scratch, item));
    }

    /// Normalizes every head of each row (the cpu `rms_norm` row, into scratch in `T`), then
    /// rotates the row and stores it back, in place.
    fn norm_rotate<T: CpuElement>(&self, buffer: &mut CpuBuffer, rows: Rows, weight: Weight<'_, T>, eps: f32) {
        let g = self.launch.geometry;
        let rot = g.rotary_dim;
        let width = rows.hidden;
        if rows.n_rows == 0 || width == 0 {
            return;
        }
        let (cache, cache_stride) = self.cache::<T>();
        let data = &mut buffer.typed_mut::<T>()[rows.offset..rows.offset + rows.span()];
        let per_task = rows_per_task(width, size_of::<T>());
        let head_size = g.head_size;
        let task = |normed: &mut [T], scratch: &mut [f32], (row, &position): (&mut [T], &i64)| {
            let row = &mut row[..width];
            for (head, out) in row.chunks_exact(head_size).zip(normed.chunks_exact_mut(head_size)) {
                rms_norm_row(head, weight, eps, out, false);
            }
            let cache_row = &cache[position as usize * cache_stride..][..rot];
            rotate_row(normed, cache_row, scratch, head_size, g.is_neox_style, self.round_products);
            row.copy_from_slice(normed);
        };
        if rows.n_rows <= per_task {
            // One scratch: the normalized row (`width` values of T in the room of `width` f32s),
            // then the rotation's f32 row and cache row.
            with_scratch(2 * width + rot, |scratch: &mut [f32]| {
                let (normed, scratch) = scratch.split_at_mut(width);
                let normed = &mut bytemuck::cast_slice_mut::<f32, T>(normed)[..width];
                data.chunks_mut(rows.row_stride)
                    .zip(self.positions.iter())
                    .for_each(|item| task(normed, scratch, item));
            });
            return;
        }
        data.par_chunks_mut(rows.row_stride).zip(self.positions.par_iter()).with_min_len(per_task).for_each_init(
            || (vec![<T as bytemuck::Zeroable>::zeroed(); width], vec![0f32; width + rot]),
            |(normed, scratch), item| task(normed, scratch, item),
        );
    }
}

/// One token's row, in place: widened to f32 with its cache row (`scratch` holds both), every head
/// rotated, stored back. Compiled for AVX-512, AVX2 and NEON besides the baseline and chosen at run
/// time, like the norms' rows (4096×4096 on the development machine, AVX-512: bf16 3.3 ms against
/// 8.0 ms for the baseline build and a 1.7 ms copy; f32 5.2 ms against a 4.2 ms copy); the same bits
/// on every path.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn rotate_row<T: CpuElement>(
    row: &mut [T],
    cache_row: &[T],
    scratch: &mut [f32],
    head_size: usize,
    is_neox_style: bool,
    round_products: bool,
) {
    let (values, cs) = scratch.split_at_mut(row.len());
    let cs = &mut cs[..cache_row.len()];
    let (cos, sin) = T::widen(cache_row, cs).split_at(cache_row.len() / 2);
    let rotary_dim = cache_row.len();
    if round_products && T::ROUNDS_PRODUCTS && rotary_dim == head_size {
        // Every element is rotated, so every value stored is arithmetic on the rounded products:
        // the rotation rounds the sums too (`pre_round`) and the store only cuts them, instead of
        // the store's rounding with its NaN case (with bf16 rounding in software, the store was
        // the row's largest cost). Elements past `rotary_dim` would be stored as loaded, and keep
        // the plain store.
        let rotate = |x: f32, y: f32, c: f32, s: f32| {
            let (xc, ys) = (T::round_product(x * c), T::round_product(y * s));
            let (yc, xs) = (T::round_product(y * c), T::round_product(x * s));
            (T::pre_round(xc - ys), T::pre_round(yc + xs))
        };
        T::update_as_f32_pre_rounded(row, values, |values| {
            for head in values.chunks_exact_mut(head_size) {
                rotate_head(head, cos, sin, is_neox_style, rotate);
            }
        });
        return;
    }
    // An f32 row is rotated where it is; others through `values`.
    T::update_as_f32(row, values, |values| {
        for head in values.chunks_exact_mut(head_size) {
            if round_products {
                rotate_head_rounded::<T>(&mut head[..rotary_dim], cos, sin, is_neox_style);
            } else {
                rotate_head(&mut head[..rotary_dim], cos, sin, is_neox_style, rotate_pair);
            }
        }
    });
}

/// [`rotate_head`] with `dtype` rounding: each of the four products rounded to `T` (the cos and sin
/// are `T` values already, and storing the row rounds the sums), as the reference's
/// `ir_ops::rotary_embedding::rotate_pair_rounded` does. For a type that rounds a product inline
/// (bf16: [`CpuElement::ROUNDS_PRODUCTS`]) it is [`rotate_head`]'s zipped loops with the rounding inside,
/// so it vectorizes as they do; others round the products as slices, [`ROUNDED_CHUNK`] pairs at a
/// time.
#[inline(always)]
fn rotate_head_rounded<T: CpuElement>(rotated: &mut [f32], cos: &[f32], sin: &[f32], is_neox_style: bool) {
    if T::ROUNDS_PRODUCTS {
        let rotate = |x: f32, y: f32, c: f32, s: f32| {
            let (xc, ys) = (T::round_product(x * c), T::round_product(y * s));
            let (yc, xs) = (T::round_product(y * c), T::round_product(x * s));
            (xc - ys, yc + xs)
        };
        return rotate_head(rotated, cos, sin, is_neox_style, rotate);
    }
    let half = rotated.len() / 2;
    let mut products = [[0f32; ROUNDED_CHUNK]; 4];
    for start in (0..half).step_by(ROUNDED_CHUNK) {
        let len = ROUNDED_CHUNK.min(half - start);
        let [xc, ys, yc, xs] = &mut products;
        let width = rotated.len();
        let pairs = || (start..start + len).map(move |i| pair_indices(i, width, is_neox_style));
        for (k, (xi, yi)) in pairs().enumerate() {
            let (x, y, c, s) = (rotated[xi], rotated[yi], cos[start + k], sin[start + k]);
            (xc[k], ys[k], yc[k], xs[k]) = (x * c, y * s, y * c, x * s);
        }
        for p in [&mut xc[..len], &mut ys[..len], &mut yc[..len], &mut xs[..len]] {
            T::round_in_place(p);
        }
        for (k, (xi, yi)) in pairs().enumerate() {
            (rotated[xi], rotated[yi]) = (xc[k] - ys[k], yc[k] + xs[k]);
        }
    }
}

/// Pairs per step of [`rotate_head_rounded`].
const ROUNDED_CHUNK: usize = 64;

/// Rotates one head's first `rotary_dim` elements (`rotated`) in f32: NeoX pairs are the two
/// halves, GPT-J pairs neighbours. Written as zipped slices (no index arithmetic), so the loops
/// vectorize; each pair is `rotate(x, y, cos, sin)` ([`rotate_pair`], as the reference computes
/// it, or its inline `dtype` rounding).
#[inline(always)]
fn rotate_head(
    rotated: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    is_neox_style: bool,
    rotate: impl Fn(f32, f32, f32, f32) -> (f32, f32),
) {
    if is_neox_style {
        let (xs, ys) = rotated.split_at_mut(rotated.len() / 2);
        for (((x, y), &c), &s) in xs.iter_mut().zip(ys.iter_mut()).zip(cos).zip(sin) {
            (*x, *y) = rotate(*x, *y, c, s);
        }
    } else {
        for ((pair, &c), &s) in rotated.chunks_exact_mut(2).zip(cos).zip(sin) {
            (pair[0], pair[1]) = rotate(pair[0], pair[1], c, s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_ops::rotary_embedding::pair_indices;

    /// The rounded rotation, inline (bf16) and by slices (f16), gives the reference's bits for both
    /// pair layouts, heads longer than one slice step included.
    #[test]
    fn the_rounded_rotation_gives_the_references_bits() {
        use ir_ops::rotary_embedding::rotate_pair_rounded;
        fn check<T: CpuElement>(round: fn(f32) -> f32) {
            let pairs = 80;
            let wave = |i: usize, k: f32| round(((i as f32 * k).sin() * 3.7).tan().clamp(-50.0, 50.0));
            // Special values among them: products that overflow, are NaN (inf · 0, a NaN operand),
            // infinite or subnormal.
            let special = [f32::INFINITY, 0.0, f32::NAN, -3.0e38, 1.0e-38, -f32::INFINITY, 2.5e38, -0.0];
            let at = |i: usize, k: f32| if i % 11 == 3 { round(special[(i / 11) % special.len()]) } else { wave(i, k) };
            let cos: Vec<f32> = (0..pairs).map(|i| at(i, 0.37)).collect();
            let sin: Vec<f32> = (0..pairs).map(|i| at(i + 5, 0.91)).collect();
            for neox in [true, false] {
                let head: Vec<f32> = (0..2 * pairs).map(|i| at(i + 1, 1.3)).collect();
                let mut fast = head.clone();
                rotate_head_rounded::<T>(&mut fast, &cos, &sin, neox);
                for i in 0..pairs {
                    let (xi, yi) = pair_indices(i, 2 * pairs, neox);
                    let (x, y) = rotate_pair_rounded(head[xi], head[yi], cos[i], sin[i], round);
                    // The row's store rounds the sums, as the reference's last rounding does.
                    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                    let (fx, fy) = (round(fast[xi]), round(fast[yi]));
                    assert!(same(fx, x) && same(fy, y), "neox={neox} pair {i}: ({fx}, {fy}) against ({x}, {y})");
                }
            }
        }
        check::<half::bf16>(|v| half::bf16::from_f32(v).to_f32());
        check::<half::f16>(|v| half::f16::from_f32(v).to_f32());
    }

    /// A bf16 row rotated whole with `dtype` rounding takes the pre-rounded store (the sums rounded
    /// in the rotation, cut by the store): the same bits, NaN payloads included, as rotating with the
    /// rounded products and storing with the plain store, for both pair layouts.
    #[test]
    fn the_pre_rounded_store_gives_the_plain_stores_bits() {
        use half::bf16;
        let (head_size, heads) = (32usize, 3usize);
        let special = [f32::INFINITY, 0.0, f32::NAN, -3.0e38, 1.0e-38, -f32::INFINITY, 3.3e38, -0.0, 9.2e-41];
        let value = |i: usize, k: f32| {
            let v = if i % 7 == 2 { special[(i / 7) % special.len()] } else { ((i as f32 * k).sin() * 3.7).tan() };
            bf16::from_f32(v)
        };
        // A signaling NaN with a payload, and a quiet one with another.
        let mut row: Vec<bf16> = (0..heads * head_size).map(|i| value(i, 1.3)).collect();
        row[5] = bf16::from_bits(0x7f81);
        row[40] = bf16::from_bits(0xffc3);
        let cache: Vec<bf16> = (0..head_size).map(|i| value(i + 3, 0.37)).collect();
        let (cos, sin) = cache.split_at(head_size / 2);
        let (cos, sin): (Vec<f32>, Vec<f32>) =
            (cos.iter().map(|c| c.to_f32()).collect(), sin.iter().map(|s| s.to_f32()).collect());
        for neox in [true, false] {
            let mut fast = row.clone();
            let mut scratch = vec![0f32; row.len() + head_size];
            rotate_row(&mut fast, &cache, &mut scratch, head_size, neox, true);
            let mut plain = row.clone();
            bf16::update_as_f32(&mut plain, &mut scratch, |values| {
                for head in values.chunks_exact_mut(head_size) {
                    rotate_head_rounded::<bf16>(head, &cos, &sin, neox);
                }
            });
            let bits = |r: &[bf16]| r.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&plain), "neox={neox}");
        }
    }

    #[test]
    fn the_sliced_rotation_pairs_the_elements_the_reference_pairs() {
        let cos: Vec<f32> = (0..4).map(|i| 0.1 * i as f32 + 0.3).collect();
        let sin: Vec<f32> = (0..4).map(|i| 0.7 - 0.05 * i as f32).collect();
        for neox in [true, false] {
            let head: Vec<f32> = (0..8).map(|i| i as f32 * 1.25 - 3.0).collect();
            let mut fast = head.clone();
            rotate_head(&mut fast, &cos, &sin, neox, rotate_pair);
            let mut indexed = head.clone();
            for i in 0..4 {
                let (xi, yi) = pair_indices(i, 8, neox);
                (indexed[xi], indexed[yi]) = rotate_pair(head[xi], head[yi], cos[i], sin[i]);
            }
            assert_eq!(fast, indexed, "neox={neox}");
        }
    }

    /// The composed kernel gives the cpu `rms_norm` of the heads then the rotation's bits (the
    /// unfused chain on the cpu), in place on query and key column slices of one qkv buffer: every
    /// dtype, both styles and roundings, partial and full rotation, weights of x's dtype and f32,
    /// decode and prefill sizes (rows split across threads), awkward values; and the op's program on
    /// the cpu interpreter gives the same bits on compact tensors.
    #[test]
    fn the_fused_qk_norm_rope_gives_the_unfused_cpu_chains_bits() {
        use ir_core::testing::InputRng;
        use ir_ops::Rounding;
        use ir_ops::rotary_embedding::cos_sin_cache;
        let mut rng = InputRng::new(53);
        let (heads, kv_heads, head_size) = (8, 2, 128);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for tokens in [1, 3, 300] {
                let width = (heads + 2 * kv_heads) * head_size;
                let mut values = rng.normal(dtype, &[tokens, width], 0.0, 2.0).unwrap().to_f64_vec().unwrap();
                values[3] = f64::INFINITY;
                values[head_size + 1] = f64::NAN;
                values[2 * head_size..3 * head_size].iter_mut().for_each(|v| *v = 0.0);
                let qkv = Tensor::from_f64(dtype, &[tokens, width], &values).unwrap();
                let positions: Vec<i64> = (0..tokens as i64).map(|t| (t * 7 + 3) % 611).collect();
                let positions = Tensor::from_slice(&[tokens], &positions).unwrap();
                for weight_dtype in [dtype, DType::F32] {
                    let q_weight = rng.normal(weight_dtype, &[head_size], 1.0, 0.2).unwrap();
                    let k_weight = rng.normal(weight_dtype, &[head_size], 1.0, 0.2).unwrap();
                    for (rotary_dim, neox, rounding) in [
                        (head_size, true, Rounding::Exact),
                        (64, false, Rounding::Dtype),
                        (head_size, true, Rounding::Dtype),
                    ] {
                        let what = format!("{dtype} {tokens} weights {weight_dtype} {rotary_dim} {neox} {rounding:?}");
                        let cache = cos_sin_cache(dtype, 611, rotary_dim, 1e6).unwrap();
                        let slice = |t: &Tensor, first: usize, count: usize| {
                            t.narrow(1, first * head_size, count * head_size).unwrap()
                        };
                        let as_heads = |t: &Tensor| t.reshape(&[tokens, t.shape()[1] / head_size, head_size]).unwrap();
                        // The unfused chain on the cpu.
                        let norm = |t: &Tensor, w: &Tensor| {
                            crate::rms_norm_cpu(&as_heads(t), Some(w), 1e-6, None).unwrap().reshape(t.shape()).unwrap()
                        };
                        let (nq, nk) =
                            (norm(&slice(&qkv, 0, heads), &q_weight), norm(&slice(&qkv, heads, kv_heads), &k_weight));
                        let (eq, ek) = ir_ops::rotary_embedding::native(
                            &positions,
                            &nq,
                            Some(&nk),
                            &cache,
                            head_size as i64,
                            rotary_dim as i64,
                            neox,
                            rounding,
                        )
                        .unwrap();
                        // In place on column slices of copies of qkv (each the only view of its storage).
                        let unique_slice = |first: usize, count: usize| {
                            let view = slice(&qkv.deep_clone().unwrap(), first, count);
                            UniqueTensor::new(view).unwrap_or_else(|_| panic!("the only view"))
                        };
                        let (q, k) = (unique_slice(0, heads), unique_slice(heads, kv_heads));
                        let (q, k) = fused_qk_norm_rope_cpu(
                            &positions,
                            q,
                            Some(k),
                            &q_weight,
                            Some(&k_weight),
                            &cache,
                            1e-6,
                            head_size as i64,
                            rotary_dim as i64,
                            neox,
                            rounding,
                        )
                        .unwrap();
                        assert!(ir_core::bit_eq(&q, &eq), "{what}: query");
                        assert!(ir_core::bit_eq(&k.unwrap(), &ek.unwrap()), "{what}: key");
                        // The program on the cpu interpreter, compact tensors.
                        let program = ir_ops::fused_qk_norm_rope::program(neox, rounding);
                        let compact = slice(&qkv, 0, heads).contiguous().unwrap();
                        let args = [
                            ir_ops::row_program::RowArg::Tensor(&positions),
                            ir_ops::row_program::RowArg::Tensor(&as_heads(&compact)),
                            ir_ops::row_program::RowArg::Tensor(&q_weight),
                            ir_ops::row_program::RowArg::Tensor(&cache),
                            ir_ops::row_program::RowArg::Scalar(1e-6),
                        ];
                        let ours = crate::program::run_row_program(program, &args).unwrap();
                        assert!(ir_core::bit_eq(&ours[0].reshape(eq.shape()).unwrap(), &eq), "{what}: the program");
                    }
                }
            }
        }
    }
}
