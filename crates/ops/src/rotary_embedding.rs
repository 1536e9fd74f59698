//! `rotary_embedding(positions, query, key = none, cos_sin_cache, head_size, rotary_dim,
//! is_neox_style, rounding = "exact") -> (query, key?)`: rotary position embedding of query and key, in place when
//! donated.
//!
//! Shapes: `query` is `[..., n_heads · head_size]`, `key` (optional) `[..., n_kv_heads · head_size]`
//! with the same leading dimensions, `positions` (i64) is those leading dimensions (`[T]` for
//! `[T, n · head_size]` activations), `cos_sin_cache` is `[max_position, rotary_dim]` in query's
//! dtype: row `p` holds `cos(p · θ_i)` for `i < rotary_dim / 2`, then `sin(p · θ_i)`
//! ([`cos_sin_cache`] builds it). Each position must lie in `0..max_position`.
//!
//! For each token `t`, head, and `i < rotary_dim / 2`, with `c = cache[positions[t]][i]` and
//! `s = cache[positions[t]][rotary_dim / 2 + i]`, the pair `(x, y)` of the head's elements
//! - NeoX style (`is_neox_style`): `(i, rotary_dim / 2 + i)`, the halves of the rotated part;
//! - GPT-J style: `(2i, 2i + 1)`, interleaved
//!
//! becomes `x' = x·c − y·s`, `y' = y·c + x·s`. Elements from `rotary_dim` to `head_size` are kept
//! (partial rotary). Rounding points ([`rotate_pair`]): each product, then the difference or sum,
//! is one correctly rounded operation in the compute dtype (f32; f64 for f64 tensors), with no
//! fused multiply-add, then the result is rounded to the dtype. For f16 and bf16 the products are
//! exact, so only the sum and the final conversion round. With `rounding = "dtype"` ([`Rounding`])
//! the cos and sin and each product are rounded to the query's dtype first and the sum or
//! difference of the rounded products is computed in f32 and rounded to the dtype, as PyTorch's
//! `q * cos + rotate_half(q) * sin` and vLLM's CUDA kernel compute it on 16-bit tensors (the same
//! as `"exact"` for f32 and f64).
//!
//! `allow_inplace` with activations `[query, key]`: `maybe_inplace` donates both, and an in-place
//! kernel rotates them in their storage (their own layouts: q and k views of one qkv buffer stay
//! views). With `key` absent the op has one output, the rotated query.

use crate::Rounding;
use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, StrEnum, Value};
use ir_core::{DType, KernelError, Tensor, TensorError, TensorMeta};

ir_core::define_op! {
    /// The definition of `rotary_embedding`.
    op rotary_embedding {
        def: ROTARY_EMBEDDING,
        args: RotaryEmbeddingArgs,
        params: (
            /// Token positions (i64), query's leading dimensions.
            positions: Tensor,
            /// `[..., n_heads · head_size]`.
            query: Activation,
            /// `[..., n_kv_heads · head_size]`, or none.
            key: Option<Activation>,
            /// `[max_position, rotary_dim]`: cos, then sin, per position.
            cos_sin_cache: Tensor,
            /// Elements per head.
            head_size: i64,
            /// Leading elements of each head that rotate (even, at most head_size).
            rotary_dim: i64,
            /// NeoX (halves) or GPT-J (interleaved) pairs.
            is_neox_style: bool,
            /// Whether products stay in f32 or are rounded to the query's dtype.
            rounding: Rounding = Literal::Str("exact"),
        ),
        outputs: (Tensor, Option<Tensor>),
        inplace: true,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "rotary position embedding of query and (optional) key; returns (query, key?)",
    }
}

/// One rotated pair in f32: `(x·c − y·s, y·c + x·s)`, each product and the sum or difference
/// rounded once (no fused multiply-add). Every f32/f16/bf16 provider computes exactly this.
#[inline(always)]
pub fn rotate_pair(x: f32, y: f32, c: f32, s: f32) -> (f32, f32) {
    let (xc, ys) = (x * c, y * s);
    let (yc, xs) = (y * c, x * s);
    (xc - ys, yc + xs)
}

/// [`rotate_pair`] with `dtype` rounding: `round` (to the tensors' 16-bit dtype) applied to the cos
/// and sin, to each product and to the f32 sum or difference of the rounded products.
#[inline(always)]
pub fn rotate_pair_rounded(x: f32, y: f32, c: f32, s: f32, round: impl Fn(f32) -> f32) -> (f32, f32) {
    let (c, s) = (round(c), round(s));
    let (xc, ys) = (round(x * c), round(y * s));
    let (yc, xs) = (round(y * c), round(x * s));
    (round(xc - ys), round(yc + xs))
}

/// [`rotate_pair`] in f64 (the compute dtype of f64 tensors).
fn rotate_pair_f64(x: f64, y: f64, c: f64, s: f64) -> (f64, f64) {
    (x * c - y * s, y * c + x * s)
}

/// The element indices `(x, y)` of pair `i` within a head.
#[inline(always)]
pub fn pair_indices(i: usize, rotary_dim: usize, is_neox_style: bool) -> (usize, usize) {
    if is_neox_style { (i, rotary_dim / 2 + i) } else { (2 * i, 2 * i + 1) }
}

/// The cos/sin cache of `rotary_dim` rotated elements for positions `0..max_position`, with
/// frequencies `θ_i = base^(−2i / rotary_dim)`, computed in f64 and rounded to `dtype`:
/// `[max_position, rotary_dim]`, cos then sin (vLLM's layout).
pub fn cos_sin_cache(dtype: DType, max_position: usize, rotary_dim: usize, base: f64) -> Result<Tensor, TensorError> {
    let half = rotary_dim / 2;
    let mut values = Vec::with_capacity(max_position * rotary_dim);
    for position in 0..max_position {
        let angles = (0..half).map(|i| position as f64 * base.powf(-2.0 * i as f64 / rotary_dim as f64));
        let angles: Vec<f64> = angles.collect();
        values.extend(angles.iter().map(|a| a.cos()));
        values.extend(angles.iter().map(|a| a.sin()));
    }
    Tensor::from_f64(dtype, &[max_position, rotary_dim], &values)
}

/// The geometry of a call, from validated argument metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryGeometry {
    /// Tokens (the product of query's leading dimensions; the positions' count, also when the
    /// query's last dimension is 0).
    pub tokens: usize,
    /// Query heads.
    pub heads: usize,
    /// Key heads (0 without a key).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_size: usize,
    /// Rotated elements per head.
    pub rotary_dim: usize,
    /// Rows of the cache.
    pub max_position: usize,
    /// NeoX or GPT-J pairs.
    pub is_neox_style: bool,
}

impl RotaryGeometry {
    /// The geometry of arguments the meta function accepted.
    pub fn of(args: &RotaryEmbeddingArgs<'_>) -> RotaryGeometry {
        let head_size = usize::try_from(args.head_size).unwrap_or(1).max(1);
        let width = args.query.layout.last_dim();
        let leading = &args.query.shape()[..args.query.layout.rank().saturating_sub(1)];
        RotaryGeometry {
            tokens: leading.iter().product(),
            heads: width / head_size,
            kv_heads: args.key.map_or(0, |k| k.layout.last_dim() / head_size),
            head_size,
            rotary_dim: usize::try_from(args.rotary_dim).unwrap_or(0),
            max_position: args.cos_sin_cache.shape()[0],
            is_neox_style: args.is_neox_style,
        }
    }

    /// The geometry of a call's arguments (validated by the meta function).
    pub fn of_tensors(
        positions: &Tensor,
        query: &Tensor,
        key: Option<&Tensor>,
        cos_sin_cache: &Tensor,
        head_size: i64,
        rotary_dim: i64,
        is_neox_style: bool,
    ) -> RotaryGeometry {
        RotaryGeometry::of(&RotaryEmbeddingArgs {
            positions: positions.meta(),
            query: query.meta(),
            key: key.map(Tensor::meta),
            cos_sin_cache: cos_sin_cache.meta(),
            head_size,
            rotary_dim,
            is_neox_style,
            rounding: Rounding::Exact,
        })
    }
}

/// The reference implementation (the semantics); device tensors go through host memory.
#[allow(clippy::too_many_arguments)] // one argument per parameter of the op
pub fn native(
    positions: &Tensor,
    query: &Tensor,
    key: Option<&Tensor>,
    cos_sin_cache: &Tensor,
    head_size: i64,
    rotary_dim: i64,
    is_neox_style: bool,
    rounding: Rounding,
) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let geometry =
        RotaryGeometry::of_tensors(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style);
    let positions = checked_positions(&positions.to_cpu()?.contiguous()?.to_vec::<i64>()?, geometry.max_position)?;
    let cache = cos_sin_cache.to_f64_vec()?;
    let rotate = |t: &Tensor| -> Result<Tensor, KernelError> {
        let dtype = t.dtype();
        let mut values = t.to_f64_vec()?;
        let width = t.layout().last_dim();
        let (rot, half) = (geometry.rotary_dim, geometry.rotary_dim / 2);
        for (token, &position) in positions.iter().enumerate() {
            let cache_row = &cache[position * rot..][..rot];
            let row = &mut values[token * width..][..width];
            for head in row.chunks_exact_mut(geometry.head_size) {
                for i in 0..half {
                    let (xi, yi) = pair_indices(i, rot, geometry.is_neox_style);
                    let (c, s) = (cache_row[i], cache_row[half + i]);
                    let (x, y) = if dtype == DType::F64 {
                        rotate_pair_f64(head[xi], head[yi], c, s)
                    } else if rounding.rounds_intermediates(dtype) {
                        let round = |v: f32| dtype.round(f64::from(v)) as f32;
                        let (x, y) = rotate_pair_rounded(head[xi] as f32, head[yi] as f32, c as f32, s as f32, round);
                        (f64::from(x), f64::from(y))
                    } else {
                        let (x, y) = rotate_pair(head[xi] as f32, head[yi] as f32, c as f32, s as f32);
                        (f64::from(x), f64::from(y))
                    };
                    (head[xi], head[yi]) = (x, y);
                }
            }
        }
        // The declared layout: a copy of the activation's (its strides when dense, as an in-place
        // provider's output on a clone has them; compact otherwise).
        let rotated = Tensor::from_f64(dtype, t.shape(), &values)?;
        let layout = t.layout().copy_layout();
        let rotated = if layout.is_compact() { rotated } else { rotated.copy_into_layout(layout)? };
        Ok(crate::quant::to_device_of(rotated, t)?)
    };
    Ok((rotate(query)?, key.map(rotate).transpose()?))
}

/// The positions as cache rows, or the error naming the first out of range.
pub fn checked_positions(positions: &[i64], max_position: usize) -> Result<Vec<usize>, KernelError> {
    check_positions(positions, max_position)?;
    Ok(positions.iter().map(|&p| p as usize).collect())
}

/// Whether every position is a row of the cache (`0..max_position`), without allocating: the
/// error names the first that is not. After it, `p as usize` is each position's row.
pub fn check_positions(positions: &[i64], max_position: usize) -> Result<(), KernelError> {
    let outside = |&p: &i64| usize::try_from(p).map_or(true, |p| p >= max_position);
    match positions.iter().position(outside) {
        None => Ok(()),
        Some(token) => Err(KernelError::InvalidArguments {
            reason: format!(
                "rotary_embedding: position {} of token {token} is outside the cos/sin cache (0..{max_position})",
                positions[token]
            ),
        }),
    }
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let args = RotaryEmbeddingArgs::from_meta(args).ok_or(MetaError::Kind { op: def.name, param: "query" })?;
    rotary_meta(def.name, &args)
}

/// The checks and output metadata of a rotation of `args` by op `op` (this op's meta function, and
/// that of the ops that rotate as it does).
pub(crate) fn rotary_meta(
    op: &'static str,
    args: &RotaryEmbeddingArgs<'_>,
) -> Result<ir_core::op::OutputMetas, MetaError> {
    let query = args.query;
    if query.layout.rank() == 0 {
        return Err(MetaError::Rank { op, param: "query", expected: "rank >= 1", shape: vec![] });
    }
    MetaError::require_compute_dtype(op, "query", query)?;
    let scalar = |param, value: i64, reason: String| MetaError::Scalar { op, param, value: value.to_string(), reason };
    let head_size = usize::try_from(args.head_size)
        .ok()
        .filter(|&h| h >= 1)
        .ok_or_else(|| scalar("head_size", args.head_size, "must be at least 1".to_owned()))?;
    let rotary_dim =
        usize::try_from(args.rotary_dim).ok().filter(|&r| r >= 2 && r.is_multiple_of(2) && r <= head_size).ok_or_else(
            || scalar("rotary_dim", args.rotary_dim, format!("must be even and lie in 2..={head_size} (head_size)")),
        )?;
    let leading = &query.shape()[..query.layout.rank() - 1];
    let heads = |param: &'static str, t: &TensorMeta| -> Result<(), MetaError> {
        if !t.layout.last_dim().is_multiple_of(head_size) {
            return Err(scalar(
                "head_size",
                args.head_size,
                format!("must divide the last dimension of `{param}` (shape {:?})", t.shape()),
            ));
        }
        Ok(())
    };
    heads("query", query)?;
    let same_device = |param: &'static str, t: &TensorMeta| -> Result<(), MetaError> {
        if t.device != query.device {
            return Err(MetaError::Device { op, param, device: t.device, other: "query", other_device: query.device });
        }
        Ok(())
    };
    let shape_error = |param: &'static str, t: &TensorMeta, expected: &'static str| MetaError::Shape {
        op,
        param,
        shape: t.shape().to_vec(),
        expected,
        other: "query",
        other_shape: query.shape().to_vec(),
    };
    let positions = args.positions;
    if positions.dtype != DType::I64 {
        return Err(MetaError::DType { op, param: "positions", dtype: positions.dtype, expected: "i64" });
    }
    if positions.shape() != leading {
        return Err(shape_error("positions", positions, "must equal the leading dimensions of query"));
    }
    same_device("positions", positions)?;
    let cache = args.cos_sin_cache;
    if cache.layout.rank() != 2 || cache.shape()[1] != rotary_dim {
        return Err(MetaError::Shape {
            op,
            param: "cos_sin_cache",
            shape: cache.shape().to_vec(),
            expected: "must be [max_position, rotary_dim]",
            other: "query",
            other_shape: query.shape().to_vec(),
        });
    }
    if cache.dtype != query.dtype {
        return Err(MetaError::DType { op, param: "cos_sin_cache", dtype: cache.dtype, expected: "query's dtype" });
    }
    same_device("cos_sin_cache", cache)?;
    let mut outputs: ir_core::op::OutputMetas = ir_core::op::smallvec![TensorMeta {
        dtype: query.dtype,
        device: query.device,
        layout: query.layout.copy_layout()
    }];
    if let Some(key) = args.key {
        if key.dtype != query.dtype {
            return Err(MetaError::DType { op, param: "key", dtype: key.dtype, expected: "query's dtype" });
        }
        if key.layout.rank() != query.layout.rank() || &key.shape()[..leading.len()] != leading {
            return Err(shape_error("key", key, "must have query's leading dimensions"));
        }
        heads("key", key)?;
        same_device("key", key)?;
        outputs.push(TensorMeta { dtype: key.dtype, device: key.device, layout: key.layout.copy_layout() });
    }
    Ok(outputs)
}

/// The generator's geometry for a hidden size: `(query width, head_size)`, the largest power of two
/// from 128 down that gives at least two heads, else one head of the whole width.
pub(crate) fn generated_heads(hidden: usize) -> (usize, usize) {
    let width = hidden.max(2);
    let head_size =
        [128, 64, 32, 16, 8, 4, 2].into_iter().find(|&h| width.is_multiple_of(h) && width / h >= 2).unwrap_or(width);
    (width, head_size)
}

/// `query, key ~ N(0, 1)` of `[T, H]` and `[T, kv]` (a quarter of the heads, at least one), positions
/// spread over a cache of `2T + 7` rows built with base 10000. The seed picks the case, so the
/// harness's seeds cover them: NeoX for even seeds (GPT-J for odd), full rotary when the seed is a
/// multiple of 3 (else half the head), no key when the seed is 2 more than a multiple of 3, and
/// `dtype` rounding when the seed is 1 or 2 more than a multiple of 4.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let (width, head_size) = generated_heads(spec.hidden_size);
    let heads = width / head_size;
    let kv_heads = (heads / 4).max(1);
    let full = spec.seed.is_multiple_of(3);
    let rotary_dim = if full { head_size / 2 * 2 } else { (head_size / 4 * 2).max(2) };
    let with_key = spec.seed % 3 != 2;
    let is_neox_style = spec.seed.is_multiple_of(2);
    let tokens = spec.num_tokens;
    let max_position = 2 * tokens + 7;
    let positions: Vec<i64> =
        (0..tokens).map(|t| ((t * 5 + spec.seed as usize * 3 + 1) % max_position) as i64).collect();
    let query = rng.normal(spec.dtype, &[tokens, width], 0.0, 1.0)?;
    let key = if with_key { Some(rng.normal(spec.dtype, &[tokens, kv_heads * head_size], 0.0, 1.0)?) } else { None };
    Ok(vec![
        Value::Tensor(Tensor::from_vec(&[tokens], positions)?),
        Value::Tensor(query),
        key.map_or(Value::None, Value::Tensor),
        Value::Tensor(cos_sin_cache(spec.dtype, max_position, rotary_dim, 10000.0)?),
        Value::I64(head_size as i64),
        Value::I64(rotary_dim as i64),
        Value::Bool(is_neox_style),
        Value::Str(if matches!(spec.seed % 4, 1 | 2) { Rounding::Dtype } else { Rounding::Exact }.as_str().to_owned()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_names_each_parameter_position() {
        let names =
            ["positions", "query", "key", "cos_sin_cache", "head_size", "rotary_dim", "is_neox_style", "rounding"];
        let consts = [
            RotaryEmbeddingArgs::positions,
            RotaryEmbeddingArgs::query,
            RotaryEmbeddingArgs::key,
            RotaryEmbeddingArgs::cos_sin_cache,
            RotaryEmbeddingArgs::head_size,
            RotaryEmbeddingArgs::rotary_dim,
            RotaryEmbeddingArgs::is_neox_style,
            RotaryEmbeddingArgs::rounding,
        ];
        assert_eq!(ROTARY_EMBEDDING.params.len(), names.len());
        for (name, position) in names.into_iter().zip(consts) {
            assert_eq!(ROTARY_EMBEDDING.param_index(name), Some(position), "{name}");
        }
    }

    fn tensor(dtype: DType, shape: &[usize], values: &[f64]) -> Tensor {
        Tensor::from_f64(dtype, shape, values).unwrap()
    }

    #[test]
    fn a_quarter_turn_swaps_the_halves_neox_and_interleaved() {
        // One position whose cos is 0 and sin 1 (exactly, as stored): x' = -y, y' = x.
        let cache = tensor(DType::F32, &[2, 2], &[1.0, 0.0, 0.0, 1.0]);
        let positions = Tensor::from_vec(&[1], vec![1i64]).unwrap();
        let q = tensor(DType::F32, &[1, 4], &[1.0, 2.0, 3.0, 4.0]);
        // head_size 4, rotary_dim 2: only elements 0 and 1 rotate; 2 and 3 are kept.
        let (out, key) = native(&positions, &q, None, &cache, 4, 2, true, crate::Rounding::Exact).unwrap();
        assert!(key.is_none());
        assert_eq!(out.to_f64_vec().unwrap(), [-2.0, 1.0, 3.0, 4.0]);
        let cache = tensor(DType::F32, &[2, 4], &[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]);
        let (neox, _) = native(&positions, &q, None, &cache, 4, 4, true, crate::Rounding::Exact).unwrap();
        assert_eq!(neox.to_f64_vec().unwrap(), [-3.0, -4.0, 1.0, 2.0], "pairs (0, 2) and (1, 3)");
        let (gptj, _) = native(&positions, &q, None, &cache, 4, 4, false, crate::Rounding::Exact).unwrap();
        assert_eq!(gptj.to_f64_vec().unwrap(), [-2.0, 1.0, -4.0, 3.0], "pairs (0, 1) and (2, 3)");
        // Position 0 is the identity.
        let zero = Tensor::from_vec(&[1], vec![0i64]).unwrap();
        let (same, _) = native(&zero, &q, Some(&q), &cache, 4, 4, false, crate::Rounding::Exact).unwrap();
        assert_eq!(same.to_f64_vec().unwrap(), q.to_f64_vec().unwrap());
    }

    #[test]
    fn products_and_sums_round_once_each_in_f32() {
        // x·c is not exact in f32; the reference rounds it before the difference (no fma).
        let (x, c) = (1.0f32 + f32::EPSILON, 1.0f32 - f32::EPSILON / 2.0);
        let (out, _) = rotate_pair(x, 1.0, c, x * c - 1.0);
        assert_eq!(out, (x * c) - (x * c - 1.0));
    }

    #[test]
    fn out_of_range_positions_are_named() {
        let cache = cos_sin_cache(DType::F32, 4, 2, 10000.0).unwrap();
        let q = tensor(DType::F32, &[2, 2], &[1.0; 4]);
        let positions = Tensor::from_vec(&[2], vec![3i64, 4]).unwrap();
        let err = native(&positions, &q, None, &cache, 2, 2, true, crate::Rounding::Exact).unwrap_err().to_string();
        assert!(err.contains("position 4 of token 1") && err.contains("0..4"), "{err}");
        let negative = Tensor::from_vec(&[2], vec![-1i64, 0]).unwrap();
        assert!(native(&negative, &q, None, &cache, 2, 2, true, crate::Rounding::Exact).is_err());
    }

    #[test]
    fn the_meta_function_names_each_bad_argument() {
        let f = |shape: &[usize], dtype| TensorMeta::compact(dtype, shape);
        let (pos, q, k, cache) =
            (f(&[3], DType::I64), f(&[3, 8], DType::BF16), f(&[3, 4], DType::BF16), f(&[9, 4], DType::BF16));
        let call =
            |pos: &TensorMeta, q: &TensorMeta, k: Option<&TensorMeta>, cache: &TensorMeta, head: i64, rot: i64| {
                let args = vec![
                    ArgMeta::Tensor(pos),
                    ArgMeta::Tensor(q),
                    k.map_or(ArgMeta::None, ArgMeta::Tensor),
                    ArgMeta::Tensor(cache),
                    ArgMeta::I64(head),
                    ArgMeta::I64(rot),
                    ArgMeta::Bool(true),
                    ArgMeta::Str("exact"),
                ];
                meta(&ROTARY_EMBEDDING, &args)
            };
        assert_eq!(call(&pos, &q, Some(&k), &cache, 4, 4).unwrap().len(), 2);
        assert_eq!(call(&pos, &q, None, &cache, 4, 4).unwrap().len(), 1, "no key, one output");
        let param = |r: Result<ir_core::op::OutputMetas, MetaError>| match r.unwrap_err() {
            MetaError::Scalar { param, .. }
            | MetaError::Shape { param, .. }
            | MetaError::DType { param, .. }
            | MetaError::Rank { param, .. } => param,
            other => panic!("{other}"),
        };
        assert_eq!(param(call(&pos, &q, Some(&k), &cache, 3, 2)), "head_size", "3 does not divide 8");
        assert_eq!(param(call(&pos, &q, Some(&k), &cache, 4, 3)), "rotary_dim", "odd");
        assert_eq!(param(call(&pos, &q, Some(&k), &f(&[9, 6], DType::BF16), 4, 6)), "rotary_dim", "above head_size");
        assert_eq!(param(call(&pos, &q, Some(&k), &f(&[9, 2], DType::BF16), 4, 4)), "cos_sin_cache");
        assert_eq!(param(call(&pos, &q, Some(&k), &f(&[9, 4], DType::F32), 4, 4)), "cos_sin_cache", "dtype");
        assert_eq!(param(call(&f(&[3], DType::F32), &q, None, &cache, 4, 4)), "positions", "dtype");
        assert_eq!(param(call(&f(&[2], DType::I64), &q, None, &cache, 4, 4)), "positions", "shape");
        assert_eq!(param(call(&pos, &q, Some(&f(&[2, 4], DType::BF16)), &cache, 4, 4)), "key");
        assert_eq!(param(call(&pos, &q, Some(&f(&[3, 4], DType::F16)), &cache, 4, 4)), "key", "dtype");
        assert_eq!(param(call(&pos, &f(&[3, 8], DType::I8), None, &cache, 4, 4)), "query");
    }

    #[test]
    fn the_cache_holds_cos_then_sin_of_each_frequency() {
        let cache = cos_sin_cache(DType::F64, 3, 4, 100.0).unwrap().to_f64_vec().unwrap();
        // Row 2: angles 2·1 and 2·100^(-1/2).
        let slow = 2.0 * 100f64.powf(-0.5);
        assert_eq!(&cache[8..], &[2f64.cos(), slow.cos(), 2f64.sin(), slow.sin()]);
        assert!((slow - 0.2).abs() < 1e-15);
        assert_eq!(&cache[..4], &[1.0, 1.0, 0.0, 0.0]);
    }
}
