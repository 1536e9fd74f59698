//! Properties and exact values of the native norms.

mod common;

use common::sample;
use half::{bf16, f16};
use ir_core::op::{InputSpec, MetaError, Overload, Value, tolerance};
use ir_core::{DType, Layout, Tensor, TensorMeta, allclose, bit_eq};
use ir_ops::fused_add_rms_norm;
use ir_ops::rms_norm;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn generated(dtype: DType, tokens: usize, hidden: usize, epsilon: f64) -> (Tensor, Tensor, Tensor) {
    let spec = InputSpec { num_tokens: tokens, hidden_size: hidden, dtype, epsilon, seed: 7 };
    let args = (fused_add_rms_norm::FUSED_ADD_RMS_NORM.generate_inputs)(&spec).unwrap();
    let tensor = |i: usize| args[i].as_tensor().unwrap().clone();
    (tensor(0), tensor(1), tensor(2))
}

#[test]
fn properties_per_dtype_and_epsilon() {
    for dtype in DTYPES {
        for eps in [1e-6, 1e-5] {
            let (x, r, w) = generated(dtype, 16, 256, eps);
            let tol = tolerance(&rms_norm::RMS_NORM, dtype).unwrap();
            let y = rms_norm::native(&x, Some(&w), eps, None).unwrap();
            assert_eq!(y.meta(), &TensorMeta::compact(dtype, &[16, 256]));

            let doubled = x.scale(2.0).unwrap();
            let y2 = rms_norm::native(&doubled, Some(&w), eps, None).unwrap();
            allclose(&y2, &y, 1e-3, tol.rtol).unwrap_or_else(|e| panic!("{dtype} eps {eps}: scale invariance: {e}"));

            let unweighted = rms_norm::native(&x, None, eps, None).unwrap();
            let values = unweighted.to_f64_vec().unwrap();
            for row in values.chunks(256) {
                let mean_square = row.iter().map(|v| v * v).sum::<f64>() / 256.0;
                assert!((mean_square - 1.0).abs() < 1e-2, "{dtype}: mean square {mean_square}");
            }
            let ones = rms_norm::native(&x, Some(&Tensor::ones(dtype, &[256]).unwrap()), eps, None).unwrap();
            assert!(bit_eq(&ones, &unweighted), "{dtype}: a ones weight is the identity");

            let (out, residual_out) =
                fused_add_rms_norm::native(&x, &r, Some(&w), eps, None, ir_ops::Rounding::Exact).unwrap();
            let sum = x.add(&r).unwrap();
            assert!(bit_eq(&residual_out, &sum), "{dtype}: residual_out is the once-rounded f32 sum");
            let renormed = rms_norm::native(&residual_out, Some(&w), eps, None).unwrap();
            let fused_tol = tolerance(&fused_add_rms_norm::FUSED_ADD_RMS_NORM, dtype).unwrap();
            allclose(&out, &renormed, fused_tol.atol, fused_tol.rtol).unwrap_or_else(|e| panic!("{dtype}: {e}"));

            let zeros = Tensor::zeros(dtype, &[16, 256]).unwrap();
            let (with_zero, _) =
                fused_add_rms_norm::native(&x, &zeros, Some(&w), eps, None, ir_ops::Rounding::Exact).unwrap();
            allclose(&with_zero, &y, 0.0, 0.0).unwrap_or_else(|e| panic!("{dtype}: fused(x, 0) == rms_norm(x): {e}"));
        }
    }
}

/// An independent reference in plain f32 arithmetic (squares summed in f64), bf16 x and weight.
fn reference_bf16(x: &[f32], w: Option<&[f32]>, eps: f32, variance: usize) -> Vec<f32> {
    let sum: f64 = x[..variance].iter().map(|&a| (a as f64) * (a as f64)).sum();
    let mean_square = (sum / variance as f64) as f32;
    let rstd = 1.0f32 / (mean_square + eps).sqrt();
    x.iter()
        .enumerate()
        .map(|(j, &a)| {
            let y = a * rstd;
            let z = match w {
                Some(w) => bf16::from_f32(bf16::from_f32(y).to_f32() * w[j]).to_f32(),
                None => y,
            };
            bf16::from_f32(z).to_f32()
        })
        .collect()
}

#[test]
fn matches_a_hand_computation_with_and_without_variance_size() {
    let x = sample(DType::BF16, 3, 24, 11);
    let w = generated(DType::BF16, 1, 24, 1e-6).2;
    let x_rows: Vec<f32> = x.to_f64_vec().unwrap().iter().map(|&v| v as f32).collect();
    let w_values: Vec<f32> = w.to_f64_vec().unwrap().iter().map(|&v| v as f32).collect();
    for variance in [None, Some(8), Some(24), Some(1)] {
        for weight in [None, Some(&w)] {
            let y = rms_norm::native(&x, weight, 1e-6, variance).unwrap();
            let expected: Vec<f64> = x_rows
                .chunks(24)
                .flat_map(|row| {
                    reference_bf16(row, weight.map(|_| w_values.as_slice()), 1e-6, variance.unwrap_or(24) as usize)
                })
                .map(|v| v as f64)
                .collect();
            assert_eq!(y.to_f64_vec().unwrap(), expected, "variance {variance:?}, weight {}", weight.is_some());
        }
    }
}

#[test]
fn an_f32_weight_keeps_the_product_in_f32() {
    let x = sample(DType::BF16, 2, 16, 3);
    let w32 = generated(DType::F32, 1, 16, 1e-6).2;
    let y = rms_norm::native(&x, Some(&w32), 1e-6, None).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let x_values: Vec<f32> = x.to_f64_vec().unwrap().iter().map(|&v| v as f32).collect();
    let w_values: Vec<f32> = w32.to_f64_vec().unwrap().iter().map(|&v| v as f32).collect();
    let w_values = &w_values;
    let expected: Vec<f64> = x_values
        .chunks(16)
        .flat_map(|row| {
            let sum: f64 = row.iter().map(|&a| (a as f64) * (a as f64)).sum();
            let rstd = 1.0f32 / ((sum / 16.0) as f32 + 1e-6f32).sqrt();
            row.iter()
                .enumerate()
                .map(move |(j, &a)| bf16::from_f32((a * rstd) * w_values[j]).to_f64())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(y.to_f64_vec().unwrap(), expected);
}

#[test]
fn variance_size_out_of_range_is_an_error() {
    let x = TensorMeta::compact(DType::F32, &[2, 8]);
    for bad in [0, 9, -1] {
        let args = [
            ir_core::op::ArgMeta::Tensor(&x),
            ir_core::op::ArgMeta::None,
            ir_core::op::ArgMeta::F64(1e-6),
            ir_core::op::ArgMeta::I64(bad),
        ];
        let err = (rms_norm::RMS_NORM.meta)(&rms_norm::RMS_NORM, &args).unwrap_err();
        assert!(matches!(&err, MetaError::Scalar { param: "variance_size", .. }), "{err}");
        assert!(err.to_string().contains("must lie in 1..=8"), "{err}");
    }
    for bad_eps in [-1.0, f64::NAN, f64::INFINITY] {
        let args = [ir_core::op::ArgMeta::Tensor(&x), ir_core::op::ArgMeta::None, ir_core::op::ArgMeta::F64(bad_eps)];
        let err = ir_ops::registry().select("rms_norm", &args).unwrap_err();
        assert!(err.to_string().contains("`epsilon`"), "{err}");
    }
}

#[test]
fn meta_errors_name_both_shapes() {
    let registry = ir_ops::registry();
    let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
    let w = Tensor::zeros(DType::F32, &[7]).unwrap();
    let err = rms_norm::rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "rms_norm: `weight` has shape [7] but must be [H] with H the last dimension of x (`x` has shape [2, 8])"
    );
    let scalar = Tensor::zeros(DType::F32, &[]).unwrap();
    let err = rms_norm::rms_norm(&registry, &scalar, None, 1e-6, None).unwrap_err();
    assert_eq!(err.to_string(), "rms_norm: `x` must have rank >= 1, got shape []");
}

#[test]
fn special_values() {
    for dtype in DTYPES {
        let zeros = Tensor::zeros(dtype, &[2, 8]).unwrap();
        let y = rms_norm::native(&zeros, None, 1e-6, None).unwrap();
        assert!(y.to_f64_vec().unwrap().iter().all(|&v| v == 0.0), "{dtype}: an all-zero row gives zeros");

        let mut values = vec![0.5; 3 * 8];
        values[8 + 3] = f64::NAN;
        let x = Tensor::from_f64(dtype, &[3, 8], &values).unwrap();
        let y = rms_norm::native(&x, None, 1e-6, None).unwrap().to_f64_vec().unwrap();
        assert!(y[8..16].iter().all(|v| v.is_nan()), "{dtype}: the NaN row is NaN");
        assert!(y[..8].iter().chain(&y[16..]).all(|v| (v - 1.0).abs() < 1e-2), "{dtype}: other rows intact");

        let empty = Tensor::zeros(dtype, &[0, 8]).unwrap();
        assert_eq!(rms_norm::native(&empty, None, 1e-6, None).unwrap().shape(), &[0, 8]);
        let (out, residual_out) =
            fused_add_rms_norm::native(&empty, &empty, None, 1e-6, None, ir_ops::Rounding::Exact).unwrap();
        assert_eq!((out.numel(), residual_out.numel()), (0, 0));

        let single = Tensor::from_f64(dtype, &[3, 1], &[2.0, -0.5, 4.0]).unwrap();
        let y = rms_norm::native(&single, None, 0.0, None).unwrap().to_f64_vec().unwrap();
        assert_eq!(y, vec![1.0, -1.0, 1.0], "{dtype}: H = 1 normalizes to the sign");
    }
    let big = Tensor::from_f64(DType::F16, &[1, 4], &[65504.0, -65504.0, 60000.0, 65504.0]).unwrap();
    let y = rms_norm::native(&big, None, 1e-6, None).unwrap().to_f64_vec().unwrap();
    assert!(y.iter().all(|v| v.is_finite()), "{y:?}");
    let expected_rms = ((65504f64.powi(2) * 3.0 + 60000f64.powi(2)) / 4.0).sqrt();
    assert!((y[0] - 65504.0 / expected_rms).abs() < 1e-3, "{y:?}");
    let zero_eps = rms_norm::native(&Tensor::zeros(DType::F32, &[1, 4]).unwrap(), None, 0.0, None).unwrap();
    assert!(zero_eps.to_f64_vec().unwrap().iter().all(|v| v.is_nan()), "eps 0 on a zero row gives NaN");
    let f16_max = f16::MAX.to_f64();
    assert_eq!(f16_max, 65504.0);
}

#[test]
fn layouts_give_the_values_of_compact_inputs() {
    let (t, h) = (5, 16);
    let compact = sample(DType::BF16, t, h, 21);
    let residual = sample(DType::BF16, t, h, 22);
    let expected = rms_norm::native(&compact, None, 1e-6, None).unwrap().to_f64_vec().unwrap();
    let (expected_out, expected_res) =
        fused_add_rms_norm::native(&compact, &residual, None, 1e-6, None, ir_ops::Rounding::Exact).unwrap();
    for (row_stride, offset) in [(2 * h, 0), (h + 3, 0), (h, 1), (h + 3, 1)] {
        let mut storage = Tensor::zeros(DType::BF16, &[row_stride * t + offset]).unwrap();
        let view = storage.as_strided(Layout::new(&[t, h], &[row_stride, 1], offset).unwrap()).unwrap();
        drop(storage);
        storage = view;
        storage.copy_from(&compact).unwrap();
        let y = rms_norm::native(&storage, None, 1e-6, None).unwrap();
        assert_eq!(y.to_f64_vec().unwrap(), expected, "row stride {row_stride}, offset {offset}");
        let (out, res) =
            fused_add_rms_norm::native(&storage, &residual, None, 1e-6, None, ir_ops::Rounding::Exact).unwrap();
        assert!(bit_eq(&out, &expected_out) && bit_eq(&res, &expected_res));
    }
    let three_d = compact.reshape(&[1, t, h]).unwrap();
    assert_eq!(rms_norm::native(&three_d, None, 1e-6, None).unwrap().to_f64_vec().unwrap(), expected);
    let heads = sample(DType::BF16, 4, 3 * 128, 23);
    for head_dim in [64, 128] {
        let n_heads = 3 * 128 / head_dim;
        let q = heads.reshape(&[4, n_heads, head_dim]).unwrap();
        let q_copy = q.contiguous().unwrap();
        let a = rms_norm::native(&q, None, 1e-6, None).unwrap();
        let b = rms_norm::native(&q_copy, None, 1e-6, None).unwrap();
        assert!(bit_eq(&a, &b));
        let k = q.transpose(0, 1).unwrap();
        let k_result = rms_norm::native(&k, None, 1e-6, None).unwrap();
        let k_compact = rms_norm::native(&k.contiguous().unwrap(), None, 1e-6, None).unwrap();
        assert!(bit_eq(&k_result, &k_compact));
        assert_eq!(k_result.strides(), k.strides(), "a dense input keeps its strides in the output");
    }
}

#[test]
fn dynamic_native_agrees_with_typed_native() {
    let (x, r, w) = generated(DType::F16, 4, 32, 1e-5);
    let registry = ir_ops::registry();
    let dynamic = registry
        .run(ir_core::Call::new(
            "fused_add_rms_norm",
            Overload::Default,
            vec![Value::Tensor(x.clone()), Value::Tensor(r.clone()), Value::Tensor(w.clone()), Value::F64(1e-5)],
        ))
        .unwrap();
    let (out, res) = fused_add_rms_norm::native(&x, &r, Some(&w), 1e-5, None, ir_ops::Rounding::Exact).unwrap();
    assert!(bit_eq(&dynamic[0], &out) && bit_eq(&dynamic[1], &res));
}

/// `dtype` rounding: the fused norm of bf16/f16 tensors is `rms_norm` of the sum rounded to the
/// dtype (what PyTorch's `residual + x` then a norm computes), which differs from the exact form on
/// some elements; for f32 the two roundings are the same bits.
#[test]
fn dtype_rounding_normalizes_the_rounded_sum() {
    use ir_ops::Rounding;
    for dtype in DTYPES {
        let (x, r, w) = generated(dtype, 16, 256, 1e-6);
        let (out, sum) = fused_add_rms_norm::native(&x, &r, Some(&w), 1e-6, None, Rounding::Dtype).unwrap();
        let rounded_sum = x.add(&r).unwrap();
        assert!(bit_eq(&sum, &rounded_sum), "{dtype}: the residual output is the rounded sum");
        let expected = rms_norm::native(&rounded_sum, Some(&w), 1e-6, None).unwrap();
        assert!(bit_eq(&out, &expected), "{dtype}: the norm of the rounded sum");
        let (exact, exact_sum) = fused_add_rms_norm::native(&x, &r, Some(&w), 1e-6, None, Rounding::Exact).unwrap();
        assert!(bit_eq(&sum, &exact_sum), "{dtype}: the residual output does not depend on the rounding");
        let differing =
            out.to_f64_vec().unwrap().iter().zip(exact.to_f64_vec().unwrap()).filter(|(a, b)| *a != b).count();
        if dtype == DType::F32 {
            assert_eq!(differing, 0, "f32: the same bits");
        } else {
            assert!(differing > 0, "{dtype}: the rounded sum changes some elements");
        }
    }
}

/// `dtype` rounding of rotary: each product rounded to the dtype, the sum or difference computed in
/// f32 and rounded (PyTorch's `q * cos + rotate_half(q) * sin` on bf16 tensors), by hand; f32 is
/// unchanged.
#[test]
fn dtype_rounding_of_rotary_rounds_each_product() {
    use ir_ops::Rounding;
    use ir_ops::rotary_embedding::{cos_sin_cache, native};
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let round = |v: f32| dtype.round(f64::from(v)) as f32;
        let q = sample(dtype, 3, 16, 11);
        let cache = cos_sin_cache(dtype, 8, 16, 10000.0).unwrap();
        let positions = Tensor::from_vec(&[3], vec![1i64, 5, 7]).unwrap();
        let (rotated, _) = native(&positions, &q, None, &cache, 16, 16, true, Rounding::Dtype).unwrap();
        let (exact, _) = native(&positions, &q, None, &cache, 16, 16, true, Rounding::Exact).unwrap();
        let (values, c) = (q.to_f64_vec().unwrap(), cache.to_f64_vec().unwrap());
        let mut expected = values.clone();
        for (token, &p) in [1usize, 5, 7].iter().enumerate() {
            for i in 0..8 {
                let (x, y) = (values[token * 16 + i] as f32, values[token * 16 + 8 + i] as f32);
                let (cos, sin) = (c[p * 16 + i] as f32, c[p * 16 + 8 + i] as f32);
                expected[token * 16 + i] = f64::from(round(round(x * cos) - round(y * sin)));
                expected[token * 16 + 8 + i] = f64::from(round(round(y * cos) + round(x * sin)));
            }
        }
        assert_eq!(rotated.to_f64_vec().unwrap(), expected, "{dtype}");
        let differing = rotated.to_f64_vec().unwrap() != exact.to_f64_vec().unwrap();
        assert_eq!(differing, dtype != DType::F32, "{dtype}: dtype rounding matters for 16-bit tensors only");
    }
}
