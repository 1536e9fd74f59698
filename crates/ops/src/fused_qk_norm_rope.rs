//! `fused_qk_norm_rope(positions, query, key?, q_weight, k_weight?, cos_sin_cache, epsilon,
//! head_size, rotary_dim, is_neox_style, rounding = "exact") -> (query, key?)`: Qwen3's per-head
//! norms of the query and key, then their rotation, as one op.
//!
//! Qwen3 (and Gemma 3, OLMo 2) normalize every query and key head with an RMS norm
//! (`q_norm`, `k_norm`, a weight of `head_size`) before rotary. Unfused that is `rms_norm` of the
//! heads of query and of key (each viewed `[tokens, heads, head_size]`) then `rotary_embedding` of
//! both; this op is that chain, bit for bit: each head normalized (rounded to the query's dtype, as
//! `rms_norm` stores it) and rotated by the cache row of its token's position, as
//! `rotary_embedding` rotates it (`rounding` is the rotation's). The normalized heads are never
//! stored. [`row_program::builtin::rms_norm_rotary`](crate::row_program::builtin::rms_norm_rotary)
//! is that computation for one tensor as a row program: `native` runs it on the reference
//! interpreter for the query and the key, every GPU provider as the kernel generated from it, and
//! the cpu provider composes its `rms_norm` and `rotary_embedding` rows per token.
//!
//! `allow_inplace`; activations `[query, key]`, written in place (column slices of one qkv buffer
//! included), each output in its activation's layout when that is dense. The key is optional, as
//! `rotary_embedding`'s is (with its weight): lowering rotates a key that shares the query's
//! storage in a call of its own, as the query of that call, so each call writes its slice where it
//! is.

use ir_core::op::{Activation, ArgMeta, InputSpec, Literal, MetaError, StrEnum, Value};
use ir_core::{KernelError, Tensor, TensorError, TensorMeta, UniqueTensor};

use crate::Rounding;
use crate::rotary_embedding::{RotaryEmbeddingArgs, cos_sin_cache, rotary_meta};
use crate::row_program::{InPlaceArg, RowArg, RowProgram};

ir_core::define_op! {
    /// The definition of `fused_qk_norm_rope`.
    op fused_qk_norm_rope {
        def: FUSED_QK_NORM_ROPE,
        args: FusedQkNormRopeArgs,
        params: (
            /// Token positions (i64), query's leading dimensions.
            positions: Tensor,
            /// `[..., n_heads · head_size]`.
            query: Activation,
            /// `[..., n_kv_heads · head_size]`, or none.
            key: Option<Activation>,
            /// The query heads' norm weight, `[head_size]`.
            q_weight: Tensor,
            /// The key heads' norm weight, `[head_size]` (none without a key).
            k_weight: Option<Tensor>,
            /// `[max_position, rotary_dim]`: cos, then sin, per position.
            cos_sin_cache: Tensor,
            /// Epsilon of both norms.
            epsilon: f64,
            /// Elements per head.
            head_size: i64,
            /// Leading elements of each head that rotate (even, at most head_size).
            rotary_dim: i64,
            /// NeoX (halves) or GPT-J (interleaved) pairs.
            is_neox_style: bool,
            /// Whether the rotation's products stay in f32 or are rounded to the query's dtype.
            rounding: Rounding = Literal::Str("exact"),
        ),
        outputs: (Tensor, Option<Tensor>),
        inplace: true,
        native: native,
        meta: meta,
        generate: generate,
        tolerances: &[],
        description: "RMS norm of every query and key head, then rotary position embedding; returns (query, key)",
    }
}

/// The program that normalizes and rotates one tensor's heads, in `rounding`, NeoX-style when
/// `neox`, built once per process.
pub fn program(neox: bool, rounding: Rounding) -> &'static RowProgram {
    static PROGRAMS: std::sync::OnceLock<[RowProgram; 4]> = std::sync::OnceLock::new();
    let programs = PROGRAMS.get_or_init(|| {
        use crate::row_program::builtin::rms_norm_rotary;
        [
            rms_norm_rotary(false, Rounding::Exact),
            rms_norm_rotary(true, Rounding::Exact),
            rms_norm_rotary(false, Rounding::Dtype),
            rms_norm_rotary(true, Rounding::Dtype),
        ]
    });
    &programs[usize::from(rounding == Rounding::Dtype) * 2 + usize::from(neox)]
}

/// `t` (`[..., heads · head_size]`) viewed as its heads, `[tokens, heads, head_size]`.
fn heads(t: &Tensor, head_size: usize) -> Result<Tensor, TensorError> {
    let width = t.layout().last_dim();
    let tokens = t.numel() / width.max(1);
    t.reshape(&[tokens, width / head_size, head_size])
}

/// The head size of a call the meta function accepted.
fn head_size_of(head_size: i64) -> usize {
    usize::try_from(head_size).unwrap_or(1).max(1)
}

/// The reference implementation: the meta function's checks, then the program of each tensor's
/// heads on the reference interpreter; the outputs in the declared layouts (each activation's, when
/// dense).
#[allow(clippy::too_many_arguments)] // one argument per parameter of the op
pub fn native(
    positions: &Tensor,
    query: &Tensor,
    key: Option<&Tensor>,
    q_weight: &Tensor,
    k_weight: Option<&Tensor>,
    cos_sin_cache: &Tensor,
    epsilon: f64,
    head_size: i64,
    rotary_dim: i64,
    is_neox_style: bool,
    rounding: Rounding,
) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let metas = [
        ArgMeta::Tensor(positions.meta()),
        ArgMeta::Tensor(query.meta()),
        optional(key),
        ArgMeta::Tensor(q_weight.meta()),
        optional(k_weight),
        ArgMeta::Tensor(cos_sin_cache.meta()),
        ArgMeta::F64(epsilon),
        ArgMeta::I64(head_size),
        ArgMeta::I64(rotary_dim),
        ArgMeta::Bool(is_neox_style),
        ArgMeta::Str(rounding.as_str()),
    ];
    (FUSED_QK_NORM_ROPE.meta)(&FUSED_QK_NORM_ROPE, &metas)?;
    let program = program(is_neox_style, rounding);
    let head_size = head_size_of(head_size);
    let run = |t: &Tensor, weight: &Tensor| -> Result<Tensor, KernelError> {
        let t_heads = heads(t, head_size)?;
        let args = [
            RowArg::Tensor(positions),
            RowArg::Tensor(&t_heads),
            RowArg::Tensor(weight),
            RowArg::Tensor(cos_sin_cache),
            RowArg::Scalar(epsilon),
        ];
        let out = program.run(&args)?.pop().expect("one output").reshape(t.shape())?;
        let out = out.copy_into_layout(t.layout().copy_layout())?;
        Ok(if t.device().is_cpu() { out } else { out.to_device_of(t)? })
    };
    let key = match (key, k_weight) {
        (Some(key), Some(k_weight)) => Some(run(key, k_weight)?),
        _ => None,
    };
    Ok((run(query, q_weight)?, key))
}

/// The op on an executor that runs row programs in place (`run`: the cpu's
/// `run_row_program_in_place`, a GPU backend's): the program of each tensor's heads, with the
/// query, then the key, donated and written in place. Each activation's heads must be rows of one
/// stride for the executor (a compact query; not a column slice of a wider buffer).
#[allow(clippy::too_many_arguments)] // one argument per parameter of the op, and the executor
pub fn run_in_place(
    run: impl Fn(&RowProgram, &mut [InPlaceArg<'_>]) -> Result<Vec<Option<Tensor>>, KernelError>,
    positions: &Tensor,
    query: UniqueTensor,
    key: Option<UniqueTensor>,
    q_weight: &Tensor,
    k_weight: Option<&Tensor>,
    cos_sin_cache: &Tensor,
    epsilon: f64,
    head_size: i64,
    is_neox_style: bool,
    rounding: Rounding,
) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let program = program(is_neox_style, rounding);
    let head_size = head_size_of(head_size);
    let one = |t: UniqueTensor, weight: &Tensor| -> Result<Tensor, KernelError> {
        let shape = t.tensor().shape().to_vec();
        let view = heads(&t.into_tensor(), head_size)?;
        let mut t_heads = unique(view)?;
        run(
            program,
            &mut [
                InPlaceArg::Read(RowArg::Tensor(positions)),
                InPlaceArg::Donated(&mut t_heads),
                InPlaceArg::Read(RowArg::Tensor(weight)),
                InPlaceArg::Read(RowArg::Tensor(cos_sin_cache)),
                InPlaceArg::Read(RowArg::Scalar(epsilon)),
            ],
        )?;
        Ok(t_heads.into_tensor().reshape(&shape)?)
    };
    let key = match (key, k_weight) {
        (Some(key), Some(k_weight)) => Some(one(key, k_weight)?),
        _ => None,
    };
    Ok((one(query, q_weight)?, key))
}

/// A tensor argument's metadata, or none.
fn optional(t: Option<&Tensor>) -> ArgMeta<'_> {
    t.map_or(ArgMeta::None, |t| ArgMeta::Tensor(t.meta()))
}

/// A view of a donated activation, which holds its storage alone once the activation is dropped.
fn unique(view: Tensor) -> Result<UniqueTensor, KernelError> {
    UniqueTensor::new(view).map_err(|_| KernelError::InvalidArguments {
        reason: "fused_qk_norm_rope: a donated activation's storage is shared".to_owned(),
    })
}

fn meta(def: &'static ir_core::op::OpDef, args: &[ArgMeta<'_>]) -> Result<ir_core::op::OutputMetas, MetaError> {
    let op = def.name;
    let args = FusedQkNormRopeArgs::from_meta(args).ok_or(MetaError::Kind { op, param: "query" })?;
    let outputs = rotary_meta(op, &args.rotation())?;
    let head_size = head_size_of(args.head_size);
    weight_fits(op, "q_weight", args.q_weight, args.query, head_size)?;
    match (args.key, args.k_weight) {
        (Some(_), Some(k_weight)) => weight_fits(op, "k_weight", k_weight, args.query, head_size)?,
        (None, None) => {}
        (key, _) => {
            return Err(MetaError::Scalar {
                op,
                param: "k_weight",
                value: if key.is_some() { "none" } else { "a tensor" }.to_owned(),
                reason: "is given exactly when a key is (the key heads' norm weight)".to_owned(),
            });
        }
    }
    if !(args.epsilon.is_finite() && args.epsilon >= 0.0) {
        return Err(MetaError::Scalar {
            op,
            param: "epsilon",
            value: format!("{:?}", args.epsilon),
            reason: "must be finite and >= 0".to_owned(),
        });
    }
    Ok(outputs)
}

impl<'a> FusedQkNormRopeArgs<'a> {
    /// The rotation's arguments, as `rotary_embedding` takes them.
    pub fn rotation(&self) -> RotaryEmbeddingArgs<'a> {
        RotaryEmbeddingArgs {
            positions: self.positions,
            query: self.query,
            key: self.key,
            cos_sin_cache: self.cos_sin_cache,
            head_size: self.head_size,
            rotary_dim: self.rotary_dim,
            is_neox_style: self.is_neox_style,
            rounding: self.rounding,
        }
    }
}

/// A head norm's weight: `[head_size]`, a compute dtype, on the query's device.
fn weight_fits(
    op: &'static str,
    param: &'static str,
    weight: &TensorMeta,
    query: &TensorMeta,
    head_size: usize,
) -> Result<(), MetaError> {
    MetaError::require_compute_dtype(op, param, weight)?;
    if weight.shape() != [head_size] {
        return Err(MetaError::Shape {
            op,
            param,
            shape: weight.shape().to_vec(),
            expected: "must be [head_size]",
            other: "query",
            other_shape: query.shape().to_vec(),
        });
    }
    if weight.device != query.device {
        return Err(MetaError::Device { op, param, device: weight.device, other: "query", other_device: query.device });
    }
    Ok(())
}

/// Qwen3's form: `[T, H]` queries and `[T, H/4]` keys (at least one head) of heads of 128 (or the
/// largest of 64..2 that gives two query heads), weights near 1, positions spread over a cache of
/// `2T + 7` rows with base 10000. The seed picks the case: NeoX for even seeds, full rotation for
/// multiples of 3 (else half the head), no key for seeds 2 past a multiple of 3, `dtype` rounding
/// for seeds 1 or 2 past a multiple of 4.
fn generate(spec: &InputSpec) -> Result<Vec<Value>, TensorError> {
    let mut rng = ir_core::testing::InputRng::new(spec.seed);
    let (width, head_size) = crate::rotary_embedding::generated_heads(spec.hidden_size);
    let heads = width / head_size;
    let kv_heads = (heads / 4).max(1);
    let rotary_dim = if spec.seed.is_multiple_of(3) { head_size / 2 * 2 } else { (head_size / 4 * 2).max(2) };
    let tokens = spec.num_tokens;
    let max_position = 2 * tokens + 7;
    let positions: Vec<i64> =
        (0..tokens).map(|t| ((t * 5 + spec.seed as usize * 3 + 1) % max_position) as i64).collect();
    let with_key = spec.seed % 3 != 2;
    let query = rng.normal(spec.dtype, &[tokens, width], 0.0, 2.0)?;
    let key = with_key.then(|| rng.normal(spec.dtype, &[tokens, kv_heads * head_size], 0.0, 2.0)).transpose()?;
    let q_weight = rng.normal(spec.dtype, &[head_size], 1.0, 0.1)?;
    let k_weight = with_key.then(|| rng.normal(spec.dtype, &[head_size], 1.0, 0.1)).transpose()?;
    let rounding = if matches!(spec.seed % 4, 1 | 2) { Rounding::Dtype } else { Rounding::Exact };
    Ok(vec![
        Value::Tensor(Tensor::from_vec(&[tokens], positions)?),
        Value::Tensor(query),
        key.map_or(Value::None, Value::Tensor),
        Value::Tensor(q_weight),
        k_weight.map_or(Value::None, Value::Tensor),
        Value::Tensor(cos_sin_cache(spec.dtype, max_position, rotary_dim, 10000.0)?),
        Value::F64(spec.epsilon),
        Value::I64(head_size as i64),
        Value::I64(rotary_dim as i64),
        Value::Bool(spec.seed.is_multiple_of(2)),
        Value::Str(rounding.as_str().to_owned()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_core::testing::InputRng;
    use ir_core::{DType, bit_eq};

    /// The op is `rms_norm` of each head of query and key, then `rotary_embedding`, bit for bit: in
    /// every compute dtype, both styles and roundings, a partial and a full rotation, weights of the
    /// query's dtype and f32, query and key column slices of one qkv buffer.
    #[test]
    fn the_fused_op_gives_the_unfused_chains_bits() {
        let mut rng = InputRng::new(37);
        let (tokens, heads, kv_heads, head_size) = (5, 4, 2, 16);
        let positions = Tensor::from_slice::<i64>(&[tokens], &[3, 0, 8, 8, 1]).unwrap();
        for dtype in DType::COMPUTE {
            let qkv = rng.normal(dtype, &[tokens, (heads + 2 * kv_heads) * head_size], 0.0, 2.0).unwrap();
            let query = qkv.narrow(1, 0, heads * head_size).unwrap();
            let key = qkv.narrow(1, heads * head_size, kv_heads * head_size).unwrap();
            for weight_dtype in [dtype, DType::F32] {
                let q_weight = rng.normal(weight_dtype, &[head_size], 1.0, 0.2).unwrap();
                let k_weight = rng.normal(weight_dtype, &[head_size], 1.0, 0.2).unwrap();
                for rotary_dim in [8, head_size] {
                    let cache = cos_sin_cache(dtype, 9, rotary_dim, 10000.0).unwrap();
                    for (neox, rounding) in [(true, Rounding::Exact), (false, Rounding::Dtype), (true, Rounding::Dtype)]
                    {
                        let what = format!("{dtype} weights {weight_dtype} rotary {rotary_dim} {neox} {rounding:?}");
                        let (q, k) = native(
                            &positions,
                            &query,
                            Some(&key),
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
                        let norm = |t: &Tensor, w: &Tensor| {
                            let h = super::heads(t, head_size).unwrap();
                            crate::rms_norm::native(&h, Some(w), 1e-6, None).unwrap().reshape(t.shape()).unwrap()
                        };
                        let (nq, nk) = (norm(&query, &q_weight), norm(&key, &k_weight));
                        let (eq, ek) = crate::rotary_embedding::native(
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
                        assert!(bit_eq(&q, &eq), "{what}: query");
                        assert!(bit_eq(&k.unwrap(), &ek.unwrap()), "{what}: key");
                        let (alone, none) = native(
                            &positions,
                            &query,
                            None,
                            &q_weight,
                            None,
                            &cache,
                            1e-6,
                            head_size as i64,
                            rotary_dim as i64,
                            neox,
                            rounding,
                        )
                        .unwrap();
                        assert!(bit_eq(&alone, &eq) && none.is_none(), "{what}: without a key");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_refused_naming_the_parameter() {
        let positions = Tensor::from_slice::<i64>(&[2], &[0, 1]).unwrap();
        let query = Tensor::zeros(DType::F32, &[2, 16]).unwrap();
        let key = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
        let weight = Tensor::zeros(DType::F32, &[8]).unwrap();
        let cache = Tensor::zeros(DType::F32, &[4, 8]).unwrap();
        let call = |q_weight: &Tensor, k_weight: &Tensor, epsilon: f64, positions: &Tensor| {
            native(
                positions,
                &query,
                Some(&key),
                q_weight,
                Some(k_weight),
                &cache,
                epsilon,
                8,
                8,
                true,
                Rounding::Exact,
            )
            .unwrap_err()
            .to_string()
        };
        let short = Tensor::zeros(DType::F32, &[4]).unwrap();
        let error = call(&short, &weight, 1e-6, &positions);
        assert!(error.contains("q_weight") && error.contains("[head_size]"), "{error}");
        let error = call(&weight, &short, 1e-6, &positions);
        assert!(error.contains("k_weight"), "{error}");
        let error = call(&weight, &weight, f64::NAN, &positions);
        assert!(error.contains("epsilon"), "{error}");
        let outside = Tensor::from_slice::<i64>(&[2], &[0, 4]).unwrap();
        let error = call(&weight, &weight, 1e-6, &outside);
        assert!(error.contains("position 4"), "{error}");
        let error = native(&positions, &query, Some(&key), &weight, None, &cache, 1e-6, 8, 8, true, Rounding::Exact)
            .unwrap_err()
            .to_string();
        assert!(error.contains("`k_weight` = none is invalid"), "{error}");
        let error = native(&positions, &query, None, &weight, Some(&weight), &cache, 1e-6, 8, 8, true, Rounding::Exact)
            .unwrap_err()
            .to_string();
        assert!(error.contains("`k_weight` = a tensor is invalid"), "{error}");
        let ok =
            native(&positions, &query, Some(&key), &weight, Some(&weight), &cache, 1e-6, 8, 8, true, Rounding::Exact);
        assert!(ok.is_ok());
    }
}
