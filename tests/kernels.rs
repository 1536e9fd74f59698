//! The kernel correctness harness: every provider this machine can run, both ops, against native
//!, plus in-place semantics through dispatch.

use ir_core::Call;
use ir_core::op::{ArgMeta, InputSpec, OpDef, Overload, Value, tolerance};
use ir_core::{DType, Layout, Support, Tensor, TensorMeta, allclose, bit_eq, shares_storage};
use ir_ops::fused_add_rms_norm::{self, FUSED_ADD_RMS_NORM, fused_add_rms_norm};
use ir_ops::rms_norm::{RMS_NORM, rms_norm};
use kernel_support::KernelDTypes;
use vllm_ir_tests::{Backend, Grid, backends};

const TOKENS: [usize; 6] = [1, 7, 17, 83, 257, 2048];
const SUBSET_TOKENS: [usize; 3] = [1, 7, 257];
const HIDDEN: [usize; 18] =
    [8, 64, 128, 768, 769, 770, 771, 772, 773, 774, 775, 776, 1000, 4096, 5120, 7168, 8192, 8199];
const EPS: f64 = 1e-6;
/// Both roundings of the ops that take one.
const ROUNDINGS: [ir_ops::Rounding; 2] = [ir_ops::Rounding::Exact, ir_ops::Rounding::Dtype];

struct Case {
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
}

fn case(dtype: DType, tokens: usize, hidden: usize, seed: u64) -> Case {
    let spec = InputSpec { num_tokens: tokens, hidden_size: hidden, dtype, epsilon: EPS, seed };
    let args = (FUSED_ADD_RMS_NORM.generate_inputs)(&spec).expect("inputs generate");
    let tensor = |i: usize| args[i].as_tensor().expect("generated tensors").clone();
    Case { x: tensor(0), residual: tensor(1), weight: tensor(2) }
}

/// Asserts that dispatch on these arguments selects the backend's provider (never a silent fallback).
fn assert_selects(backend: &Backend, op: &OpDef, args: &[ArgMeta<'_>]) {
    let selection = backend.registry.select(op.name, args).expect("valid arguments");
    assert_eq!(selection.provider, backend.provider, "{}: rejected {:?}", op.name, selection.rejected);
}

fn grid(dtype: DType, op: &'static OpDef) {
    grid_over(
        dtype,
        op,
        |backend| match backend.grid {
            Grid::Full => &TOKENS,
            Grid::Subset => &SUBSET_TOKENS,
        },
        &HIDDEN,
    );
}

/// Every backend's `op` against native on each (tokens, hidden) pair, with and without a weight.
fn grid_over(dtype: DType, op: &'static OpDef, tokens: impl Fn(&Backend) -> &'static [usize], hidden: &[usize]) {
    for backend in backends() {
        let _guard = backend.registry.override_priority(op.name, &[backend.provider, "native"]).unwrap();
        let tol = tolerance(op, dtype).unwrap();
        for &t in tokens(&backend) {
            for &h in hidden {
                let host = case(dtype, t, h, (t * 10_000 + h) as u64);
                let x = backend.upload(&host.x).unwrap();
                let residual = backend.upload(&host.residual).unwrap();
                let weight = backend.upload(&host.weight).unwrap();
                for with_weight in [true, false] {
                    let (w_host, w) = if with_weight { (Some(&host.weight), Some(&weight)) } else { (None, None) };
                    let label = format!("{} {} T={t} H={h} weight={with_weight}", backend.provider, op.name);
                    let w_meta = w.map_or(ArgMeta::None, |w| ArgMeta::Tensor(w.meta()));
                    if op.name == RMS_NORM.name {
                        assert_selects(&backend, op, &[ArgMeta::Tensor(x.meta()), w_meta, ArgMeta::F64(EPS)]);
                        let got = rms_norm(&backend.registry, &x, w, EPS, None).unwrap().to_cpu().unwrap();
                        let expected = ir_ops::rms_norm::native(&host.x, w_host, EPS, None).unwrap();
                        allclose(&got, &expected, tol.atol, tol.rtol).unwrap_or_else(|e| panic!("{label}: {e}"));
                    } else {
                        let args =
                            [ArgMeta::Tensor(x.meta()), ArgMeta::Tensor(residual.meta()), w_meta, ArgMeta::F64(EPS)];
                        assert_selects(&backend, op, &args);
                        let (out, res) =
                            fused_add_rms_norm(&backend.registry, &x, &residual, w, EPS, None, ir_ops::Rounding::Exact)
                                .unwrap();
                        let (expected_out, expected_res) = ir_ops::fused_add_rms_norm::native(
                            &host.x,
                            &host.residual,
                            w_host,
                            EPS,
                            None,
                            ir_ops::Rounding::Exact,
                        )
                        .unwrap();
                        assert!(bit_eq(&res.to_cpu().unwrap(), &expected_res), "{label}: residual_out is bit-exact");
                        allclose(&out.to_cpu().unwrap(), &expected_out, tol.atol, tol.rtol)
                            .unwrap_or_else(|e| panic!("{label}: {e}"));
                    }
                }
            }
        }
    }
}

#[test]
fn grid_rms_norm_f32() {
    grid(DType::F32, &RMS_NORM);
}

#[test]
fn grid_rms_norm_f16() {
    grid(DType::F16, &RMS_NORM);
}

#[test]
fn grid_rms_norm_bf16() {
    grid(DType::BF16, &RMS_NORM);
}

#[test]
fn grid_fused_add_rms_norm_f32() {
    grid(DType::F32, &FUSED_ADD_RMS_NORM);
}

#[test]
fn grid_fused_add_rms_norm_f16() {
    grid(DType::F16, &FUSED_ADD_RMS_NORM);
}

#[test]
fn grid_fused_add_rms_norm_bf16() {
    grid(DType::BF16, &FUSED_ADD_RMS_NORM);
}

/// Rows as long as the GPU kernels keep whole in registers (H = 16384, 32768: the largest bucket,
/// the most work-items per row) and one element longer, whose tail is read again.
#[test]
fn long_rows_match_native() {
    for dtype in [DType::F32, DType::BF16] {
        for op in [&RMS_NORM, &FUSED_ADD_RMS_NORM] {
            grid_over(dtype, op, |_| &[1, 3], &[16384, 32768, 32769]);
        }
    }
}

#[test]
fn batch_invariance() {
    for backend in backends() {
        let _guards = [
            backend.registry.override_priority("rms_norm", &[backend.provider]).unwrap(),
            backend.registry.override_priority("fused_add_rms_norm", &[backend.provider]).unwrap(),
        ];
        for dtype in [DType::BF16, DType::F32] {
            for hidden in [769, 4096] {
                let host = case(dtype, 2048, hidden, 5);
                let upload = |t: &Tensor| backend.upload(t).unwrap();
                let batch = rms_norm(&backend.registry, &upload(&host.x), Some(&upload(&host.weight)), EPS, None)
                    .unwrap()
                    .to_cpu()
                    .unwrap();
                let (fused_batch, _) = fused_add_rms_norm(
                    &backend.registry,
                    &upload(&host.x),
                    &upload(&host.residual),
                    Some(&upload(&host.weight)),
                    EPS,
                    None,
                    ir_ops::Rounding::Exact,
                )
                .unwrap();
                let fused_batch = fused_batch.to_cpu().unwrap();
                for row in [0, 1, 1023, 2047] {
                    let single_x = host.x.narrow(0, row, 1).unwrap().contiguous().unwrap();
                    let single_r = host.residual.narrow(0, row, 1).unwrap().contiguous().unwrap();
                    let single =
                        rms_norm(&backend.registry, &upload(&single_x), Some(&upload(&host.weight)), EPS, None)
                            .unwrap()
                            .to_cpu()
                            .unwrap();
                    let label = format!("{} {dtype} H={hidden} row {row}", backend.provider);
                    assert!(bit_eq(&single, &batch.narrow(0, row, 1).unwrap()), "{label}: rms_norm");
                    let (fused_single, _) = fused_add_rms_norm(
                        &backend.registry,
                        &upload(&single_x),
                        &upload(&single_r),
                        Some(&upload(&host.weight)),
                        EPS,
                        None,
                        ir_ops::Rounding::Exact,
                    )
                    .unwrap();
                    assert!(
                        bit_eq(&fused_single.to_cpu().unwrap(), &fused_batch.narrow(0, row, 1).unwrap()),
                        "{label}: fused"
                    );
                }
            }
        }
    }
}

#[test]
fn special_values() {
    for backend in backends() {
        let _guard = backend.registry.override_priority("rms_norm", &[backend.provider]).unwrap();
        let run = |x: &Tensor, eps: f64| {
            let x = backend.upload(x).unwrap();
            assert_selects(&backend, &RMS_NORM, &[ArgMeta::Tensor(x.meta()), ArgMeta::None, ArgMeta::F64(eps)]);
            rms_norm(&backend.registry, &x, None, eps, None).unwrap().to_cpu().unwrap().to_f64_vec().unwrap()
        };
        for dtype in backend.element_dtypes() {
            let label = format!("{} {dtype}", backend.provider);
            assert!(run(&Tensor::zeros(dtype, &[2, 64]).unwrap(), EPS).iter().all(|&v| v == 0.0), "{label}: zero rows");
            let mut values = vec![0.5; 3 * 64];
            values[64 + 5] = f64::NAN;
            let y = run(&Tensor::from_f64(dtype, &[3, 64], &values).unwrap(), EPS);
            assert!(y[64..128].iter().all(|v| v.is_nan()), "{label}: NaN row");
            assert!(y[..64].iter().chain(&y[128..]).all(|v| (v - 1.0).abs() < 1e-2), "{label}: other rows intact");
            assert_eq!(run(&Tensor::zeros(dtype, &[0, 64]).unwrap(), EPS).len(), 0, "{label}: T = 0");
            let y = run(&Tensor::from_f64(dtype, &[3, 1], &[2.0, -0.5, 4.0]).unwrap(), 0.0);
            assert_eq!(y, vec![1.0, -1.0, 1.0], "{label}: H = 1");
        }
        let big = Tensor::from_f64(DType::F16, &[2, 64], &[65504.0; 128]).unwrap();
        let y = run(&big, EPS);
        assert!(y.iter().all(|v| (v - 1.0).abs() < 1e-3), "{}: f16 near 65504 gives {:?}", backend.provider, &y[..4]);
    }
}

/// Magnitudes near each dtype's limits: wherever native's result is finite, every provider
/// matches it within the op's tolerance. With |x| near 1e18 and H = 4096 the f32 sum of squares
/// overflows although the mean square fits.
/// One row per scale of `hidden` values of about that magnitude (and signs mixed), a residual of
/// half of it, and a weight of 1.5.
fn magnitude_rows(dtype: DType, scales: &[f64], hidden: usize) -> Case {
    let tokens = scales.len();
    let pattern = |k: usize, shift: usize| (((k * 7 + shift) % 23) as f64 - 11.0) / 11.0;
    let values = |shift: usize, factor: f64| -> Vec<f64> {
        (0..tokens * hidden).map(|k| pattern(k, shift) * scales[k / hidden] * factor).collect()
    };
    Case {
        x: Tensor::from_f64(dtype, &[tokens, hidden], &values(0, 1.0)).unwrap(),
        residual: Tensor::from_f64(dtype, &[tokens, hidden], &values(5, 0.5)).unwrap(),
        weight: Tensor::from_f64(dtype, &[hidden], &vec![1.5; hidden]).unwrap(),
    }
}

#[test]
fn magnitudes_near_the_dtype_limits() {
    let limits: [(DType, &[f64]); 3] = [
        (DType::F32, &[1e18, 4e18, 1.5e19, 3e38, 1e-19, 1e-30]),
        (DType::BF16, &[1e18, 4e18, 1.5e19, 3e38, 1e-19, 1e-30]),
        (DType::F16, &[65504.0, 3e4, 1e-4, 6e-8]),
    ];
    for backend in backends() {
        let _guards = [
            backend.registry.override_priority("rms_norm", &[backend.provider]).unwrap(),
            backend.registry.override_priority("fused_add_rms_norm", &[backend.provider]).unwrap(),
        ];
        for (dtype, scales) in limits {
            for hidden in [64, 4096] {
                let Case { x, residual, weight } = magnitude_rows(dtype, scales, hidden);
                let label = format!("{} {dtype} H={hidden} scales {scales:?}", backend.provider);
                let (dx, dr, dw) =
                    (backend.upload(&x).unwrap(), backend.upload(&residual).unwrap(), backend.upload(&weight).unwrap());

                let expected = ir_ops::rms_norm::native(&x, Some(&weight), EPS, None).unwrap();
                let got = rms_norm(&backend.registry, &dx, Some(&dw), EPS, None).unwrap().to_cpu().unwrap();
                let tol = tolerance(&RMS_NORM, dtype).unwrap();
                assert!(expected.to_f64_vec().unwrap().iter().all(|v| v.is_finite()), "{label}: native is finite");
                allclose(&got, &expected, tol.atol, tol.rtol).unwrap_or_else(|e| panic!("{label} rms_norm: {e}"));

                let (expected_out, expected_res) = ir_ops::fused_add_rms_norm::native(
                    &x,
                    &residual,
                    Some(&weight),
                    EPS,
                    None,
                    ir_ops::Rounding::Exact,
                )
                .unwrap();
                let (out, res) =
                    fused_add_rms_norm(&backend.registry, &dx, &dr, Some(&dw), EPS, None, ir_ops::Rounding::Exact)
                        .unwrap();
                let tol = tolerance(&FUSED_ADD_RMS_NORM, dtype).unwrap();
                assert!(bit_eq(&res.to_cpu().unwrap(), &expected_res), "{label}: residual_out is bit-exact");
                allclose(&out.to_cpu().unwrap(), &expected_out, tol.atol, tol.rtol)
                    .unwrap_or_else(|e| panic!("{label} fused_add_rms_norm: {e}"));
            }
        }
    }
}

#[test]
fn layouts_give_the_values_of_compact_inputs() {
    for backend in backends() {
        let _guards = [
            backend.registry.override_priority("rms_norm", &[backend.provider]).unwrap(),
            backend.registry.override_priority("fused_add_rms_norm", &[backend.provider]).unwrap(),
        ];
        let (t, h) = (9, 128);
        let host = case(DType::BF16, t, h, 77);
        let expected =
            rms_norm(&backend.registry, &backend.upload(&host.x).unwrap(), None, EPS, None).unwrap().to_cpu().unwrap();
        let expected_values = expected.to_f64_vec().unwrap();
        for (row_stride, offset) in [(2 * h, 0), (h + 3, 0), (h, 1), (h + 3, 1)] {
            let storage = Tensor::zeros(DType::BF16, &[row_stride * t + offset]).unwrap();
            let mut strided = storage.as_strided(Layout::new(&[t, h], &[row_stride, 1], offset).unwrap()).unwrap();
            drop(storage);
            strided.copy_from(&host.x).unwrap();
            let x = backend.upload(&strided).unwrap();
            let x = x.as_strided(Layout::new(&[t, h], &[row_stride, 1], offset).unwrap()).unwrap_or(x);
            let meta = x.meta().clone();
            assert_selects(&backend, &RMS_NORM, &[ArgMeta::Tensor(&meta), ArgMeta::None, ArgMeta::F64(EPS)]);
            let y = rms_norm(&backend.registry, &x, None, EPS, None).unwrap().to_cpu().unwrap();
            assert_eq!(y.to_f64_vec().unwrap(), expected_values, "row stride {row_stride}, offset {offset}");
        }
        let three_d = backend.upload(&host.x.reshape(&[3, 3, h]).unwrap()).unwrap();
        let y = rms_norm(&backend.registry, &three_d, None, EPS, None).unwrap().to_cpu().unwrap();
        assert_eq!(y.to_f64_vec().unwrap(), expected_values, "3-D input");
        for head_dim in [64, 128] {
            let wide = case(DType::BF16, 4, 4 * head_dim, 78).x;
            let heads = backend.upload(&wide.reshape(&[4, 4, head_dim]).unwrap()).unwrap();
            let q = heads.narrow(1, 0, 2).unwrap();
            let q_compact = backend
                .upload(&wide.reshape(&[4, 4, head_dim]).unwrap().narrow(1, 0, 2).unwrap().contiguous().unwrap())
                .unwrap();
            let a = rms_norm(&backend.registry, &q, None, EPS, None).unwrap().to_cpu().unwrap();
            let b = rms_norm(&backend.registry, &q_compact, None, EPS, None).unwrap().to_cpu().unwrap();
            assert_eq!(a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap(), "q view, head_dim {head_dim}");
        }
    }
}

#[test]
fn predicates_reject_what_only_native_supports() {
    for backend in backends() {
        let x = TensorMeta {
            device: backend.upload(&Tensor::zeros(DType::BF16, &[1]).unwrap()).unwrap().device(),
            ..TensorMeta::compact(DType::BF16, &[4, 64])
        };
        let w32 = TensorMeta { dtype: DType::F32, ..TensorMeta::compact(DType::F32, &[64]) };
        let w32 = TensorMeta { device: x.device, ..w32 };
        let selection = backend
            .registry
            .select("rms_norm", &[ArgMeta::Tensor(&x), ArgMeta::None, ArgMeta::F64(EPS), ArgMeta::I64(32)])
            .unwrap();
        let _ = selection;
        let providers = backend.registry.resolve_priority("rms_norm", &[backend.provider]).unwrap();
        assert_eq!(providers, vec![backend.provider, "native"]);
        let _guard = backend.registry.override_priority("rms_norm", &[backend.provider]).unwrap();
        let with_variance = backend
            .registry
            .select("rms_norm", &[ArgMeta::Tensor(&x), ArgMeta::None, ArgMeta::F64(EPS), ArgMeta::I64(32)])
            .unwrap();
        let with_f32_weight = backend
            .registry
            .select("rms_norm", &[ArgMeta::Tensor(&x), ArgMeta::Tensor(&w32), ArgMeta::F64(EPS)])
            .unwrap();
        // Every provider takes a Gemma-style f32 weight on bf16 activations (no silent native).
        assert_eq!(with_f32_weight.provider, backend.provider, "{:?}", with_f32_weight.rejected);
        if takes_variance_size(&backend) {
            // No host round trip through native for `variance_size` on a GPU provider.
            assert_eq!(with_variance.provider, backend.provider, "{:?}", with_variance.rejected);
        } else {
            assert_eq!(with_variance.provider, "native");
            assert!(with_variance.rejected[0].reason.contains("variance_size"), "{:?}", with_variance.rejected);
        }
        // Answers do not depend on the number of tokens.
        for tokens in [1, 7, 2048, 65536] {
            for hidden in [7, 8, 4096] {
                let meta = TensorMeta { device: x.device, ..TensorMeta::compact(DType::F16, &[tokens, hidden]) };
                let selection = backend
                    .registry
                    .select("rms_norm", &[ArgMeta::Tensor(&meta), ArgMeta::None, ArgMeta::F64(EPS)])
                    .unwrap();
                assert_eq!(selection.provider, backend.provider, "T={tokens} H={hidden}");
            }
        }
        let _ = Support::Yes;
    }
}

/// Whether the backend's norms take `variance_size` (the GPU providers that compute it on the
/// device; the cpu provider leaves it to native). Every provider takes a weight of another dtype.
fn takes_variance_size(backend: &Backend) -> bool {
    matches!(backend.provider, "xpu" | "cuda" | "rocm" | "emu_cuda" | "emu_hip" | "emu_hip_wave32")
}

/// The coarser of two compute dtypes (bf16, then f16, then f32, then f64): the output of a weighted
/// norm is rounded to both, so it is as precise as the coarser.
fn coarser(a: DType, b: DType) -> DType {
    [DType::BF16, DType::F16, DType::F32].into_iter().find(|&d| a == d || b == d).unwrap_or(DType::F64)
}

#[test]
fn mixed_weight_dtypes_and_variance_size_match_native_on_the_providers_that_take_them() {
    for backend in backends() {
        // f64 x and weights, against each other dtype both ways, where the kernels compute in f64.
        let dtypes = backend.element_dtypes();
        let takes_variance = takes_variance_size(&backend);
        let mut on_device = 0;
        for op in [&RMS_NORM, &FUSED_ADD_RMS_NORM] {
            let _guard = backend.registry.override_priority(op.name, &[backend.provider, "native"]).unwrap();
            for (t, h) in [(7, 64), (3, 770), (2, 4096)] {
                for &x_dtype in &dtypes {
                    let host = case(x_dtype, t, h, (t * 31 + h) as u64);
                    let (x, residual) = (backend.upload(&host.x).unwrap(), backend.upload(&host.residual).unwrap());
                    for &w_dtype in &dtypes {
                        let w_host = Tensor::from_f64(w_dtype, &[h], &host.weight.to_f64_vec().unwrap()).unwrap();
                        let w = backend.upload(&w_host).unwrap();
                        for variance in [None, Some(1), Some(h as i64 / 2 + 1), Some(h as i64)] {
                            let label = format!(
                                "{} {} T={t} H={h} x={x_dtype} w={w_dtype} variance={variance:?}",
                                backend.provider, op.name
                            );
                            let tol = tolerance(op, coarser(x_dtype, w_dtype)).unwrap();
                            let variance_meta = variance.map_or(ArgMeta::None, ArgMeta::I64);
                            let mut metas = vec![ArgMeta::Tensor(x.meta())];
                            if op.name == FUSED_ADD_RMS_NORM.name {
                                metas.push(ArgMeta::Tensor(residual.meta()));
                            }
                            metas.extend([ArgMeta::Tensor(w.meta()), ArgMeta::F64(EPS), variance_meta]);
                            let selection = backend.registry.select(op.name, &metas).unwrap();
                            if takes_variance || variance.is_none() {
                                assert_eq!(selection.provider, backend.provider, "{label}: {:?}", selection.rejected);
                                on_device += 1;
                            } else {
                                assert_eq!(selection.provider, "native", "{label}");
                            }
                            if op.name == RMS_NORM.name {
                                let got = rms_norm(&backend.registry, &x, Some(&w), EPS, variance).unwrap();
                                let expected = ir_ops::rms_norm::native(&host.x, Some(&w_host), EPS, variance).unwrap();
                                allclose(&got.to_cpu().unwrap(), &expected, tol.atol, tol.rtol)
                                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                            } else {
                                let (out, res) = fused_add_rms_norm(
                                    &backend.registry,
                                    &x,
                                    &residual,
                                    Some(&w),
                                    EPS,
                                    variance,
                                    ir_ops::Rounding::Exact,
                                )
                                .unwrap();
                                let (expected_out, expected_res) = ir_ops::fused_add_rms_norm::native(
                                    &host.x,
                                    &host.residual,
                                    Some(&w_host),
                                    EPS,
                                    variance,
                                    ir_ops::Rounding::Exact,
                                )
                                .unwrap();
                                assert!(bit_eq(&res.to_cpu().unwrap(), &expected_res), "{label}: residual bit-exact");
                                allclose(&out.to_cpu().unwrap(), &expected_out, tol.atol, tol.rtol)
                                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                            }
                        }
                    }
                }
            }
        }
        // 2 ops x 3 shapes x n x dtypes x n weight dtypes x (4 variances, or the whole row only).
        let n = dtypes.len();
        let expected = if takes_variance { 2 * 3 * n * n * 4 } else { 2 * 3 * n * n };
        assert_eq!(on_device, expected, "{}: calls that ran on the provider", backend.provider);
    }
}

#[test]
fn the_weight_step_rounds_in_the_weights_dtype_bit_for_bit() {
    // With epsilon 0 and the mean square over the first element only, which is 1, rstd is exactly 1
    // on every path: the results then differ only if the weight step rounds differently (y rounded
    // to the weight's dtype, the product rounded to it, the store rounded to x's dtype).
    let (t, h) = (3, 100);
    for backend in backends() {
        let dtypes = backend.element_dtypes();
        for op in [&RMS_NORM, &FUSED_ADD_RMS_NORM] {
            let _guard = backend.registry.override_priority(op.name, &[backend.provider, "native"]).unwrap();
            for &x_dtype in &dtypes {
                let host = case(x_dtype, t, h, 5);
                let mut x_values = host.x.to_f64_vec().unwrap();
                let mut r_values = host.residual.to_f64_vec().unwrap();
                for row in 0..t {
                    x_values[row * h] = 1.0;
                    r_values[row * h] = 0.0;
                }
                let x_host = Tensor::from_f64(x_dtype, &[t, h], &x_values).unwrap();
                let r_host = Tensor::from_f64(x_dtype, &[t, h], &r_values).unwrap();
                let (x, residual) = (backend.upload(&x_host).unwrap(), backend.upload(&r_host).unwrap());
                for &w_dtype in &dtypes {
                    let w_host = Tensor::from_f64(w_dtype, &[h], &host.weight.to_f64_vec().unwrap()).unwrap();
                    let w = backend.upload(&w_host).unwrap();
                    let label = format!("{} {} x={x_dtype} w={w_dtype}", backend.provider, op.name);
                    let (got, expected) = if op.name == RMS_NORM.name {
                        let got = rms_norm(&backend.registry, &x, Some(&w), 0.0, Some(1)).unwrap();
                        (got, ir_ops::rms_norm::native(&x_host, Some(&w_host), 0.0, Some(1)).unwrap())
                    } else {
                        let (got, _) = fused_add_rms_norm(
                            &backend.registry,
                            &x,
                            &residual,
                            Some(&w),
                            0.0,
                            Some(1),
                            ir_ops::Rounding::Exact,
                        )
                        .unwrap();
                        let native = ir_ops::fused_add_rms_norm::native(
                            &x_host,
                            &r_host,
                            Some(&w_host),
                            0.0,
                            Some(1),
                            ir_ops::Rounding::Exact,
                        );
                        (got, native.unwrap().0)
                    };
                    assert!(bit_eq(&got.to_cpu().unwrap(), &expected), "{label}: the weight step's rounding");
                }
            }
        }
    }
}

#[test]
fn inplace_semantics_through_dispatch() {
    for backend in backends() {
        let _guard = backend.registry.override_priority("fused_add_rms_norm", &[backend.provider]).unwrap();
        let host = case(DType::BF16, 16, 256, 9);
        let x = backend.upload(&host.x).unwrap();
        let residual = backend.upload(&host.residual).unwrap();
        let weight = backend.upload(&host.weight).unwrap();
        let (x_before, r_before) =
            (x.to_cpu().unwrap().deep_clone().unwrap(), residual.to_cpu().unwrap().deep_clone().unwrap());
        let (out, res) =
            fused_add_rms_norm(&backend.registry, &x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact)
                .unwrap();
        assert!(
            bit_eq(&x.to_cpu().unwrap(), &x_before) && bit_eq(&residual.to_cpu().unwrap(), &r_before),
            "functional call leaves inputs"
        );
        assert!(!shares_storage(&out, &x) && !shares_storage(&res, &residual));
        let (x_id, r_id) = (x.storage_id(), residual.storage_id());
        let (inplace_out, inplace_res) = fused_add_rms_norm::maybe_inplace(
            &backend.registry,
            x,
            residual,
            Some(&weight),
            EPS,
            None,
            ir_ops::Rounding::Exact,
        )
        .unwrap();
        assert_eq!(
            (inplace_out.storage_id(), inplace_res.storage_id()),
            (x_id, r_id),
            "{}: written in place",
            backend.provider
        );
        assert!(bit_eq(&inplace_out.to_cpu().unwrap(), &out.to_cpu().unwrap()));
        assert!(bit_eq(&inplace_res.to_cpu().unwrap(), &res.to_cpu().unwrap()));
        let _ = Value::None;
    }
}

/// `fused_add_rms_norm` with `rounding = "dtype"` on 16-bit tensors: every provider takes it and
/// gives the bits of its own `rms_norm` of the rounded sum, in place (a padded residual included),
/// within tolerance of native, with no fallback.
#[test]
fn dtype_rounding_of_the_fused_norm_is_each_providers_norm_of_the_rounded_sum() {
    use ir_ops::Rounding;
    use ir_ops::fused_add_rms_norm::native;
    for backend in backends() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let host = case(dtype, 6, 200, 4);
            let (expected_out, expected_sum) =
                native(&host.x, &host.residual, Some(&host.weight), EPS, None, Rounding::Dtype).unwrap();
            let up = |t: &Tensor| backend.upload(t).unwrap();
            let metas = [&host.x, &host.residual, &host.weight].map(|t| t.meta().clone());
            let args = [
                ArgMeta::Tensor(&metas[0]),
                ArgMeta::Tensor(&metas[1]),
                ArgMeta::Tensor(&metas[2]),
                ArgMeta::F64(EPS),
                ArgMeta::None,
                ArgMeta::Str("dtype"),
            ];
            let metas_on_device: Vec<TensorMeta> =
                [&host.x, &host.residual, &host.weight].iter().map(|t| up(t).meta().clone()).collect();
            let device_args: Vec<ArgMeta<'_>> = args
                .iter()
                .enumerate()
                .map(|(i, a)| if i < 3 { ArgMeta::Tensor(&metas_on_device[i]) } else { *a })
                .collect();
            let supports = backend
                .registry
                .implementation_supports("fused_add_rms_norm", backend.provider, &device_args)
                .expect("registered");
            let label = format!("{} {dtype}", backend.provider);
            let takes_it = matches!(supports, Support::Yes);
            assert!(takes_it, "{label}: every provider takes dtype rounding: {supports:?}");
            let priority = [backend.provider, "native"];
            let _guard = backend.registry.override_priority("fused_add_rms_norm", &priority).unwrap();
            let _norm = backend.registry.override_priority("rms_norm", &[backend.provider]).unwrap();
            // What a provider that takes it computes: its own norm of the rounded sum.
            let rounded = up(&host.x).add(&up(&host.residual)).unwrap();
            let composed =
                rms_norm(&backend.registry, &rounded, Some(&up(&host.weight)), EPS, None).unwrap().to_cpu().unwrap();
            let tol = tolerance(&FUSED_ADD_RMS_NORM, dtype).unwrap();
            let before = backend.registry.selection_record();
            for padded in [false, true] {
                let residual = if padded { row_padded(&host.residual) } else { host.residual.deep_clone().unwrap() };
                let (out, sum) = fused_add_rms_norm::maybe_inplace(
                    &backend.registry,
                    up(&host.x),
                    up(&residual),
                    Some(&up(&host.weight)),
                    EPS,
                    None,
                    Rounding::Dtype,
                )
                .unwrap();
                let (out, sum) =
                    (out.to_cpu().unwrap().contiguous().unwrap(), sum.to_cpu().unwrap().contiguous().unwrap());
                assert!(bit_eq(&out, &composed), "{label} padded={padded}: the norm of the rounded sum");
                allclose(&out, &expected_out, tol.atol, tol.rtol).unwrap_or_else(|e| panic!("{label}: {e}"));
                assert!(bit_eq(&sum, &expected_sum), "{label} padded={padded}: the residual output");
            }
            let record = backend.registry.selection_record().since(&before);
            let fallbacks = record.op("fused_add_rms_norm").map_or(0, |op| op.native_fallbacks);
            assert_eq!(fallbacks, 0, "{label}: no fallback");
        }
    }
}

/// `t` (`[T, W]`) copied into the first W columns of a `[T, W + 3]` buffer and returned as that view:
/// equal values, rows of one stride larger than their length.
fn row_padded(t: &Tensor) -> Tensor {
    let [tokens, width] = t.shape() else { panic!("generated activations are [T, W], got {:?}", t.shape()) };
    let wide = Tensor::zeros(t.dtype(), &[*tokens, width + 3]).unwrap();
    let mut view = wide.slice(1, 0, *width).unwrap();
    drop(wide);
    view.copy_from(t).unwrap();
    if *tokens > 1 {
        assert_eq!(view.layout().strides(), [width + 3, 1], "padded rows");
    }
    view
}

/// Every op the registry defines, on every provider registered for it here, against native on the
/// op's own generated inputs: a new op and a new provider are covered by being defined and
/// registered, with no per-op code in this harness.
#[test]
fn every_op_of_every_provider_matches_native_on_generated_inputs() {
    let shapes: &[(usize, usize)] = &[(1, 64), (7, 769), (17, 4096)];
    for backend in backends() {
        let mut checked_ops = 0;
        for op in backend.registry.ops() {
            let def = backend.registry.op_def(op).expect("listed ops are defined");
            let runs_here = backend.registry.available_providers(op).contains(&backend.provider);
            if !runs_here {
                continue;
            }
            checked_ops += 1;
            for dtype in backend.element_dtypes() {
                for (i, &(tokens, hidden)) in shapes.iter().enumerate() {
                    let label = format!("{} {op} {dtype} T={tokens} H={hidden}", backend.provider);
                    let spec =
                        InputSpec { num_tokens: tokens, hidden_size: hidden, dtype, epsilon: EPS, seed: i as u64 };
                    let host = (def.generate_inputs)(&spec).unwrap();
                    let expected = (def.native)(&host).unwrap_or_else(|e| panic!("{label}: native: {e}"));
                    // Compact activations, then activations whose rows are 3 elements apart more than
                    // their length (a slice of a wider buffer): the same values in another layout.
                    for padded in [false, true] {
                        let args = uploaded(&backend, def, &host, padded);
                        let got = backend
                            .registry
                            .run(Call::new(op, donating(def), args).provider(backend.provider))
                            .unwrap_or_else(|e| panic!("{label} padded={padded}: {e}"));
                        assert_eq!(got.len(), expected.len(), "{label}: output count");
                        for (index, (got, expected)) in got.iter().zip(&expected).enumerate() {
                            let got = got.to_cpu().unwrap();
                            // Each output in its own dtype's tolerance (a quantized output in fp8's).
                            let tol = tolerance(def, expected.dtype()).unwrap();
                            allclose(&got, expected, tol.atol, tol.rtol)
                                .unwrap_or_else(|e| panic!("{label} padded={padded}: output {index}: {e}"));
                        }
                    }
                }
            }
        }
        let defined = backend.registry.ops().len();
        assert_eq!(checked_ops, defined, "{} implements every op the registry defines", backend.provider);
    }
}

/// `t` (`[T, W]`) in a column-major copy: the same values, strides `[1, T]` (a transposed view of a
/// `[W, T]` buffer, dense but not compact).
fn transposed(t: &Tensor) -> Tensor {
    let [tokens, width] = t.shape() else { panic!("generated activations are [T, W], got {:?}", t.shape()) };
    let buffer = t.transpose(0, 1).unwrap().contiguous().unwrap();
    let view = buffer.transpose(0, 1).unwrap();
    drop(buffer);
    if *tokens > 1 && *width > 1 {
        assert_eq!(view.layout().strides(), [1, *tokens], "column-major");
    }
    view
}

/// Every op through dispatch (the backend's provider first, then native) on transposed activations,
/// functional and, for in-place ops, `maybe_inplace`: whichever provider takes them, the outputs have
/// the metadata the op declares (dispatch checks it: a provider returning another layout is an
/// error) and native's values. A provider that rejects the layout leaves it to native, as an
/// engine's call would.
#[test]
fn every_op_gives_its_declared_metadata_and_natives_values_on_transposed_activations() {
    for backend in backends() {
        let ops = backend.registry.ops();
        let _guards: Vec<_> = ops
            .iter()
            .map(|op| backend.registry.override_priority(op, &[backend.provider, "native"]).unwrap())
            .collect();
        for op in ops {
            let def = backend.registry.op_def(op).expect("listed ops are defined");
            let activations = def.activation_indices().unwrap();
            for dtype in backend.element_dtypes() {
                for (i, &(tokens, hidden)) in [(1usize, 64usize), (7, 128)].iter().enumerate() {
                    let label = format!("{} {op} {dtype} T={tokens} H={hidden} transposed", backend.provider);
                    let spec =
                        InputSpec { num_tokens: tokens, hidden_size: hidden, dtype, epsilon: EPS, seed: i as u64 };
                    let host = (def.generate_inputs)(&spec).unwrap();
                    let args: Vec<Value> = host
                        .iter()
                        .enumerate()
                        .map(|(i, v)| match v {
                            Value::Tensor(t) if activations.contains(&i) => Value::Tensor(transposed(t)),
                            other => other.clone(),
                        })
                        .collect();
                    let expected = (def.native)(&args).unwrap_or_else(|e| panic!("{label}: native: {e}"));
                    let metas: Vec<ArgMeta<'_>> = args.iter().map(Value::meta).collect();
                    let declared = (def.meta)(def, &metas).unwrap();
                    for (index, (e, d)) in expected.iter().zip(&declared).enumerate() {
                        assert_eq!(e.meta(), d, "{label}: native's output {index} is what the op declares");
                    }
                    let device_args = |args: &[Value]| -> Vec<Value> {
                        args.iter()
                            .map(|v| match v {
                                Value::Tensor(t) => Value::Tensor(backend.upload(t).unwrap()),
                                other => other.clone(),
                            })
                            .collect()
                    };
                    let mut runs = vec![(
                        "functional",
                        backend.registry.run(Call::new(op, Overload::Default, device_args(&args))),
                    )];
                    if def.allow_inplace {
                        runs.push((
                            "maybe_inplace",
                            backend.registry.run(Call::new(op, Overload::MaybeInplace, device_args(&args))),
                        ));
                    }
                    for (how, got) in runs {
                        let got = got.unwrap_or_else(|e| panic!("{label} {how}: {e}"));
                        for (index, ((got, expected), declared)) in got.iter().zip(&expected).zip(&declared).enumerate()
                        {
                            assert_eq!(got.layout(), &declared.layout, "{label} {how}: output {index}'s layout");
                            let tol = tolerance(def, expected.dtype()).unwrap();
                            allclose(&got.to_cpu().unwrap(), expected, tol.atol, tol.rtol)
                                .unwrap_or_else(|e| panic!("{label} {how}: output {index}: {e}"));
                        }
                    }
                }
            }
        }
    }
}

/// Every f32 that decides an fp8 rounding: each code's value, the midpoints between neighbours and
/// the f32 values either side of them, values beyond the largest finite, infinities, NaN, zeros and
/// the f32 subnormals, with both signs.
fn fp8_deciding_values(dtype: DType) -> Vec<f64> {
    let mut finite: Vec<f64> = (0..=255u8)
        .map(|code| {
            let bytes = Tensor::from_vec(&[1], vec![code as i8]).unwrap();
            // The byte's value read as an fp8 code: reinterpret through the host bytes.
            let mut t = Tensor::zeros(dtype, &[1]).unwrap();
            t.cpu_buffer_mut().unwrap().unwrap().bytes_mut().copy_from_slice(bytes.cpu_buffer().unwrap().bytes());
            t.to_f64_vec().unwrap()[0]
        })
        .filter(|v| v.is_finite() && *v >= 0.0)
        .collect();
    finite.sort_by(f64::total_cmp);
    finite.dedup();
    let mut values = Vec::new();
    for pair in finite.windows(2) {
        let mid = (pair[0] + pair[1]) / 2.0;
        let mid32 = mid as f32;
        values.extend([pair[0], mid, f64::from(mid32.next_up()), f64::from(mid32.next_down())]);
    }
    let max = dtype.fp8_max().unwrap();
    values.extend([
        max,
        max * 1.03,
        max * 1.1,
        1e30,
        f64::INFINITY,
        f64::NAN,
        0.0,
        1e-40,
        f64::from(f32::MIN_POSITIVE),
    ]);
    let negated: Vec<f64> = values.iter().map(|v| -v).collect();
    values.extend(negated);
    values
}

/// The codes of an fp8 tensor (on any device), in logical order.
fn fp8_codes(t: &Tensor) -> Vec<u8> {
    let host = t.to_cpu().unwrap().contiguous().unwrap();
    host.cpu_buffer().unwrap().bytes().to_vec()
}

/// The quantization kernels round exactly as the reference on every provider: one f32 division
/// (correctly rounded) and the saturating nearest-even conversion, checked on every value that
/// decides a rounding, and per-token scales bit for bit.
#[test]
fn fp8_quantization_is_bit_exact_on_every_provider() {
    use ir_ops::dynamic_per_token_scaled_fp8_quant::{self as dynamic, dynamic_per_token_scaled_fp8_quant};
    use ir_ops::static_scaled_fp8_quant::{self as fixed, static_scaled_fp8_quant};
    for backend in backends() {
        let _guards = [
            backend.registry.override_priority("static_scaled_fp8_quant", &[backend.provider]).unwrap(),
            backend.registry.override_priority("dynamic_per_token_scaled_fp8_quant", &[backend.provider]).unwrap(),
        ];
        let upload = |t: &Tensor| backend.upload(t).unwrap();
        for out_dtype in DType::FP8 {
            let label = format!("{} {out_dtype}", backend.provider);
            let values = fp8_deciding_values(out_dtype);
            let mut inputs = vec![(DType::F32, values.clone())];
            if backend.dtypes == KernelDTypes::WithF64 {
                // f64 values a hair either side of each value, midpoints included: rounded once,
                // directly (an f32 in between would round such a value onto the midpoint, a tie).
                let hair = 2f64.powi(-40);
                let nudged = values.iter().flat_map(|&v| [v, v * (1.0 + hair), v * (1.0 - hair)]);
                inputs.push((DType::F64, nudged.collect()));
            }
            for (x_dtype, deciding) in &inputs {
                // Both roundings: one division, or vLLM's product with the rounded reciprocal. Each
                // scale sees the deciding quotients too: each value times the scale, and its f32
                // neighbours, where the two roundings part.
                for (scale, rounding) in
                    [1.0, 0.5, 3.0 / 448.0, 0.3].into_iter().flat_map(|s| ROUNDINGS.map(|r| (s, r)))
                {
                    let scaled = deciding.iter().map(|v| v * f64::from(scale as f32)).flat_map(|v| {
                        let f = v as f32;
                        [v, f64::from(f.next_down()), f64::from(f.next_up())]
                    });
                    let values: Vec<f64> = deciding.iter().copied().chain(scaled).collect();
                    let x = Tensor::from_f64(*x_dtype, &[1, values.len()], &values).unwrap();
                    if scale == 0.3 && *x_dtype == DType::F32 && rounding == ir_ops::Rounding::Dtype {
                        let s = Tensor::from_f64(DType::F32, &[1], &[scale]).unwrap();
                        let exact = fixed::native(&x, &s, out_dtype, ir_ops::Rounding::Exact).unwrap();
                        let parity = fixed::native(&x, &s, out_dtype, rounding).unwrap();
                        assert_ne!(
                            fp8_codes(&exact),
                            fp8_codes(&parity),
                            "{label}: the inputs tell the roundings apart"
                        );
                    }
                    let s = Tensor::from_f64(DType::F32, &[1], &[scale]).unwrap();
                    let got = static_scaled_fp8_quant(&backend.registry, &upload(&x), &upload(&s), out_dtype, rounding)
                        .unwrap();
                    let expected = fixed::native(&x, &s, out_dtype, rounding).unwrap();
                    // The same code, sign of zero included, and every NaN the canonical one.
                    let (got, expected) = (fp8_codes(&got), fp8_codes(&expected));
                    if let Some(i) = got.iter().zip(&expected).position(|(g, e)| g != e) {
                        let v = values[i];
                        panic!(
                            "{label} {x_dtype} scale {scale} {rounding:?}: x = {v} gives {:#04x}, native {:#04x}",
                            got[i], expected[i]
                        );
                    }
                    for (i, _) in values.iter().enumerate().filter(|(_, v)| v.is_nan()) {
                        assert_eq!(got[i], ir_core::FP8_NAN, "{label} {x_dtype}: NaN is the canonical code");
                    }
                }
            }
            // NaNs of every sign and payload, as stored and as arithmetic makes them (0/0, and a
            // scale that turns x into NaN: 0 / 0 and inf / inf), all the one canonical code.
            let nans: Vec<f32> = [0x7fc0_0000u32, 0xffc0_0000, 0x7f80_0001, 0xffa0_0001, 0x7fe0_0000, 0xffff_ffff]
                .into_iter()
                .map(f32::from_bits)
                .chain([0.0f32, f32::INFINITY, -f32::INFINITY, 1.0])
                .collect();
            let x = Tensor::from_vec(&[1, nans.len()], nans.clone()).unwrap();
            for (scale, rounding) in [f64::NAN, 0.0, f64::INFINITY].into_iter().flat_map(|s| ROUNDINGS.map(|r| (s, r)))
            {
                let s = Tensor::from_f64(DType::F32, &[1], &[scale]).unwrap();
                let got = fp8_codes(
                    &static_scaled_fp8_quant(&backend.registry, &upload(&x), &upload(&s), out_dtype, rounding).unwrap(),
                );
                let expected = fp8_codes(&fixed::native(&x, &s, out_dtype, rounding).unwrap());
                assert_eq!(got, expected, "{label} scale {scale} {rounding:?}: the codes of {nans:?}");
                let nan_codes = got.iter().zip(&expected).filter(|(_, e)| {
                    **e & 0x7f == 0x7f || (out_dtype == DType::F8E5M2 && **e & 0x7c == 0x7c && **e & 3 != 0)
                });
                for (g, _) in nan_codes {
                    assert_eq!(*g, ir_core::FP8_NAN, "{label} scale {scale}: every NaN is the canonical code");
                }
            }
            for dtype in backend.element_dtypes() {
                let wide = Tensor::randn(&TensorMeta::compact(dtype, &[67, 773]), 9).unwrap();
                let x = wide.narrow(1, 3, 769).unwrap();
                let ub = Tensor::from_f64(DType::F32, &[1], &[2.5]).unwrap();
                for ub in [None, Some(&ub)] {
                    let ub_device = ub.map(upload);
                    let (q, s) = dynamic_per_token_scaled_fp8_quant(
                        &backend.registry,
                        &upload(&x),
                        ub_device.as_ref(),
                        out_dtype,
                    )
                    .unwrap();
                    let (eq, es) = dynamic::native(&x, ub, out_dtype).unwrap();
                    let with_ub = ub.is_some();
                    assert!(bit_eq(&s.to_cpu().unwrap(), &es), "{label} {dtype} bound {with_ub}: scales");
                    assert!(bit_eq(&q.to_cpu().unwrap(), &eq), "{label} {dtype} bound {with_ub}: q");
                }
            }
        }
    }
}

/// The fused add + norm + quantizations (static and per-token) write the residual into a donated
/// residual's storage and `q` (and the scales) into fresh tensors, on every provider (a padded
/// residual included: the sum goes into its own rows); called functionally, they leave the residual
/// as it was. Both forms give the same bits, the residual output bit-exact against native, `q`
/// within one fp8 step and the scales within the op's tolerance.
#[test]
fn the_fused_quantizations_write_the_residual_in_place_only_when_donated() {
    use ir_ops::fused_add_rms_norm_dynamic_per_token_quant::FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT;
    use ir_ops::fused_add_rms_norm_static_fp8_quant::FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT;
    for backend in backends() {
        for def in [&FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT, &FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT] {
            let op = def.name;
            let dynamic = def.n_outputs == 3;
            let _guard = backend.registry.override_priority(op, &[backend.provider]).unwrap();
            let host = case(DType::BF16, 5, 96, 3);
            // The static scale, or the per-token form's absmax bound (loose enough to bind no row).
            let scale = Tensor::from_f64(DType::F32, &[1], &[if dynamic { 100.0 } else { 0.01 }]).unwrap();
            let up = |t: &Tensor| backend.upload(t).unwrap();
            let args = |residual: Tensor| -> Vec<Value> {
                vec![
                    Value::Tensor(up(&host.x)),
                    Value::Tensor(residual),
                    Value::Tensor(up(&host.weight)),
                    Value::F64(EPS),
                    Value::Tensor(up(&scale)),
                    Value::DType(DType::F8E4M3FN),
                    Value::Str("exact".to_owned()),
                ]
            };
            let host_args = vec![
                Value::Tensor(host.x.clone()),
                Value::Tensor(host.residual.clone()),
                Value::Tensor(host.weight.clone()),
                Value::F64(EPS),
                Value::Tensor(scale.clone()),
                Value::DType(DType::F8E4M3FN),
                Value::Str("exact".to_owned()),
            ];
            let expected = (def.native)(&host_args).unwrap();
            for padded in [false, true] {
                let label = format!("{} {op} padded={padded}", backend.provider);
                let residual_host =
                    if padded { row_padded(&host.residual) } else { host.residual.deep_clone().unwrap() };
                let kept = up(&residual_host);
                let functional = backend.registry.run(Call::new(op, Overload::Default, args(kept.clone()))).unwrap();
                assert_eq!(functional.len(), def.n_outputs, "{label}");
                assert!(
                    bit_eq(&kept.to_cpu().unwrap(), &residual_host),
                    "{label}: the functional call leaves the residual"
                );
                assert!(!shares_storage(&functional[0], &kept), "{label}");

                let donated = up(&residual_host);
                let storage = donated.storage_id();
                let in_place = backend.registry.run(Call::new(op, Overload::MaybeInplace, args(donated))).unwrap();
                assert_eq!(
                    in_place[0].storage_id(),
                    storage,
                    "{label}: the residual output is written into the donated residual"
                );
                for fresh in &in_place[1..] {
                    assert_ne!(fresh.storage_id(), storage, "{label}: q and the scales are fresh");
                }
                for (index, (a, b)) in in_place.iter().zip(&functional).enumerate() {
                    let (a, b) = (a.to_cpu().unwrap(), b.to_cpu().unwrap());
                    assert!(bit_eq(&a, &b), "{label}: output {index}: both forms give the same bits");
                    let a = a.contiguous().unwrap();
                    if index == 0 {
                        assert!(bit_eq(&a, &expected[0]), "{label}: residual_out is bit-exact");
                    } else {
                        let tol = tolerance(def, expected[index].dtype()).unwrap();
                        allclose(&a, &expected[index], tol.atol, tol.rtol)
                            .unwrap_or_else(|e| panic!("{label}: output {index}: {e}"));
                    }
                }
            }
        }
    }
}

/// Native's rotation of `q` (and `key`) with `exact` rounding, heads of `head` elements.
fn exact_rotary(
    positions: &Tensor,
    q: &Tensor,
    key: Option<&Tensor>,
    cache: &Tensor,
    head: usize,
    rotary_dim: usize,
    is_neox: bool,
) -> (Tensor, Option<Tensor>) {
    let exact = ir_ops::Rounding::Exact;
    ir_ops::rotary_embedding::native(positions, q, key, cache, head as i64, rotary_dim as i64, is_neox, exact).unwrap()
}

/// `rotary_embedding` on every provider, bit for bit against native, rotating q and k in their own
/// storage when donated: NeoX and GPT-J pairs, full and partial rotary, with and without a key, q
/// and k as column slices of one `[T, (4 + 2 + 2) · 64]` qkv buffer (rows of the buffer's stride),
/// positions spanning the cache (0 and its last row included). The functional call leaves its
/// arguments as they were.
#[test]
fn rotary_embedding_is_bit_exact_and_in_place_on_every_provider() {
    use ir_ops::rotary_embedding::{self, ROTARY_EMBEDDING, cos_sin_cache, rotary_embedding};
    const HEAD: usize = 64;
    const TOKENS: usize = 9;
    const MAX_POSITION: usize = 40;
    let positions: Vec<i64> = vec![0, 39, 1, 17, 17, 2, 38, 5, 23];
    for backend in backends() {
        let _guard = backend.registry.override_priority(ROTARY_EMBEDDING.name, &[backend.provider]).unwrap();
        let up = |t: &Tensor| backend.upload(t).unwrap();
        let positions = Tensor::from_vec(&[TOKENS], positions.clone()).unwrap();
        for dtype in backend.element_dtypes() {
            let qkv = Tensor::randn(&TensorMeta::compact(dtype, &[TOKENS, 8 * HEAD]), 11).unwrap();
            let q = qkv.narrow(1, 0, 4 * HEAD).unwrap();
            let k = qkv.narrow(1, 4 * HEAD, 2 * HEAD).unwrap();
            assert_eq!(q.layout().strides(), [8 * HEAD, 1], "q is a view of the qkv rows");
            for (is_neox, rotary_dim, with_key) in [
                (true, HEAD, true),
                (false, HEAD, true),
                (true, HEAD / 2, true),
                (false, HEAD / 4, true),
                (true, HEAD, false),
                (false, HEAD / 2, false),
            ] {
                let label =
                    format!("{} {dtype} neox={is_neox} rotary_dim={rotary_dim} key={with_key}", backend.provider);
                let cache = cos_sin_cache(dtype, MAX_POSITION, rotary_dim, 10000.0).unwrap();
                let key = with_key.then_some(&k);
                let (eq, ek) = exact_rotary(&positions, &q, key, &cache, HEAD, rotary_dim, is_neox);
                assert_eq!(ek.is_some(), with_key, "{label}: a key output only with a key");
                let (p_dev, c_dev) = (up(&positions), up(&cache));
                // Functional: fresh outputs, arguments untouched.
                let (q_dev, k_dev) = (up(&q), key.map(up));
                let (fq, fk) = rotary_embedding(
                    &backend.registry,
                    &p_dev,
                    &q_dev,
                    k_dev.as_ref(),
                    &c_dev,
                    HEAD as i64,
                    rotary_dim as i64,
                    is_neox,
                    ir_ops::Rounding::Exact,
                )
                .unwrap_or_else(|e| panic!("{label}: {e}"));
                assert!(bit_eq(&fq.to_cpu().unwrap(), &eq), "{label}: functional query");
                assert!(bit_eq(&q_dev.to_cpu().unwrap(), &q), "{label}: the functional call leaves query");
                assert!(!shares_storage(&fq, &q_dev), "{label}");
                if let (Some(fk), Some(ek), Some(k_dev)) = (&fk, &ek, &k_dev) {
                    assert!(bit_eq(&fk.to_cpu().unwrap(), ek), "{label}: functional key");
                    assert!(bit_eq(&k_dev.to_cpu().unwrap(), &k), "{label}: the functional call leaves key");
                }
                // Donated: rotated in their own storage and layout.
                let (q_dev, k_dev) = (up(&q), key.map(up));
                let q_storage = q_dev.storage_id();
                let k_storage = k_dev.as_ref().map(Tensor::storage_id);
                let (iq, ik) = rotary_embedding::maybe_inplace(
                    &backend.registry,
                    &p_dev,
                    q_dev,
                    k_dev,
                    &c_dev,
                    HEAD as i64,
                    rotary_dim as i64,
                    is_neox,
                    ir_ops::Rounding::Exact,
                )
                .unwrap_or_else(|e| panic!("{label}: {e}"));
                assert_eq!(iq.storage_id(), q_storage, "{label}: query rotated in place");
                assert_eq!(iq.layout(), q.layout(), "{label}: in its own layout");
                assert_eq!(ik.as_ref().map(Tensor::storage_id), k_storage, "{label}: key rotated in place");
                assert!(bit_eq(&iq.to_cpu().unwrap(), &eq), "{label}: in-place query");
                if let (Some(ik), Some(ek)) = (&ik, &ek) {
                    assert!(bit_eq(&ik.to_cpu().unwrap(), ek), "{label}: in-place key");
                }
            }
        }
    }
}

/// A position outside the cos/sin cache is an error naming it on the cpu (and in native), before
/// anything is written.
#[test]
fn rotary_positions_outside_the_cache_are_refused_on_the_cpu() {
    use ir_ops::rotary_embedding::{self, ROTARY_EMBEDDING, cos_sin_cache};
    let backend = backends().into_iter().next().expect("the cpu backend");
    let _guard = backend.registry.override_priority(ROTARY_EMBEDDING.name, &["cpu"]).unwrap();
    let cache = cos_sin_cache(DType::F32, 8, 4, 10000.0).unwrap();
    let q = Tensor::randn(&TensorMeta::compact(DType::F32, &[3, 8]), 1).unwrap();
    // A query without elements (width 0) still has a position per token: checked as native does.
    let empty = Tensor::zeros(DType::F32, &[3, 0]).unwrap();
    for q in [q, empty] {
        for bad in [8i64, -1] {
            let positions = Tensor::from_vec(&[3], vec![0, bad, 2]).unwrap();
            let native =
                ir_ops::rotary_embedding::native(&positions, &q, None, &cache, 4, 4, true, ir_ops::Rounding::Exact);
            assert!(native.is_err(), "native refuses position {bad}");
            let err = rotary_embedding::maybe_inplace(
                &backend.registry,
                &positions,
                q.deep_clone().unwrap(),
                None,
                &cache,
                4,
                4,
                true,
                ir_ops::Rounding::Exact,
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains(&format!("position {bad} of token 1")) && err.contains("0..8"), "{err}");
        }
    }
}

/// The layouts of the rotary bug report: an f32 transposed query `[4, 32]{1, 4}` and a bf16 query
/// `[4, 2, 32]{32, 128, 1}` (its two leading dimensions swapped in memory), with keys of the same
/// layouts, functional and `maybe_inplace`, on every provider: the outputs have the declared
/// layout (the activation's own, copied) and native's bits.
#[test]
fn rotary_on_transposed_and_permuted_activations_keeps_their_layout() {
    use ir_ops::rotary_embedding::{self, ROTARY_EMBEDDING, cos_sin_cache, native, rotary_embedding};
    for backend in backends() {
        let _guard = backend.registry.override_priority(ROTARY_EMBEDDING.name, &[backend.provider, "native"]).unwrap();
        let up = |t: &Tensor| backend.upload(t).unwrap();
        let cases: [(DType, &[usize], &[usize]); 2] =
            [(DType::F32, &[32, 4], &[4, 32]), (DType::BF16, &[2, 4, 32], &[4, 2, 32])];
        for (dtype, stored, shape) in cases {
            // Stored in `stored` order, viewed with the first two dimensions swapped.
            let view = |seed| {
                let buffer = Tensor::randn(&TensorMeta::compact(dtype, stored), seed).unwrap();
                let view = buffer.transpose(0, 1).unwrap();
                assert_eq!(view.shape(), shape);
                view
            };
            let (q, k) = (view(1), view(2));
            let leading = &shape[..shape.len() - 1];
            let count: usize = leading.iter().product();
            let positions = Tensor::from_vec(leading, (0..count as i64).map(|p| (p * 3) % 7).collect()).unwrap();
            let cache = cos_sin_cache(dtype, 7, 16, 10000.0).unwrap();
            let label = format!("{} {dtype} {:?}{:?}", backend.provider, q.shape(), q.layout().strides());
            let (eq, ek) = native(&positions, &q, Some(&k), &cache, 16, 16, true, ir_ops::Rounding::Exact).unwrap();
            let ek = ek.unwrap();
            assert_eq!(eq.layout(), &q.layout().copy_layout(), "{label}: native keeps the layout");
            let (fq, fk) = rotary_embedding(
                &backend.registry,
                &up(&positions),
                &up(&q),
                Some(&up(&k)),
                &up(&cache),
                16,
                16,
                true,
                ir_ops::Rounding::Exact,
            )
            .unwrap_or_else(|e| panic!("{label} functional: {e}"));
            let (mq, mk) = rotary_embedding::maybe_inplace(
                &backend.registry,
                &up(&positions),
                up(&q),
                Some(up(&k)),
                &up(&cache),
                16,
                16,
                true,
                ir_ops::Rounding::Exact,
            )
            .unwrap_or_else(|e| panic!("{label} maybe_inplace: {e}"));
            for (how, got, expected) in [
                ("functional q", fq, &eq),
                ("functional k", fk.unwrap(), &ek),
                ("maybe_inplace q", mq, &eq),
                ("maybe_inplace k", mk.unwrap(), &ek),
            ] {
                let got = got.to_cpu().unwrap();
                assert_eq!(got.shape(), expected.shape(), "{label} {how}");
                assert!(bit_eq(&got, expected), "{label} {how}: native's bits");
            }
        }
    }
}

/// The gated activations over the whole range of the gate, with large `up`, on every provider:
/// gates from −30 to 30 in steps of 0.01 (the tails where `1 + tanh` and `1 + erf` would cancel
/// included) and the extremes (±1e10, the largest finite, infinities, NaN), each times `up` of 1 up to
/// 1e30 (what the dtype holds), against native within the op's own tolerance, everywhere.
#[test]
fn gated_activations_hold_their_tolerance_over_the_whole_gate_range() {
    use ir_ops::gelu_and_mul::{Approximate, GELU_AND_MUL, gelu_and_mul};
    use ir_ops::silu_and_mul::{SILU_AND_MUL, silu_and_mul};
    let mut gates: Vec<f64> = (-3000..=3000).map(|i| f64::from(i) / 100.0).collect();
    gates.extend([1e10, -1e10, f64::from(f32::MAX), f64::from(f32::MIN), f64::INFINITY, f64::NEG_INFINITY, f64::NAN]);
    for backend in backends() {
        let _guards = [
            backend.registry.override_priority(SILU_AND_MUL.name, &[backend.provider]).unwrap(),
            backend.registry.override_priority(GELU_AND_MUL.name, &[backend.provider]).unwrap(),
        ];
        for dtype in backend.element_dtypes() {
            let ups: Vec<f64> =
                [1.0, -3.0, 1e2, 1e4, 1e8, 1e30].into_iter().filter(|&u| dtype.round(u).is_finite()).collect();
            let d = gates.len();
            let mut values = Vec::with_capacity(ups.len() * 2 * d);
            for &up in &ups {
                values.extend(&gates);
                values.extend(std::iter::repeat_n(up, d));
            }
            let x = Tensor::from_f64(dtype, &[ups.len(), 2 * d], &values).unwrap();
            let device_x = backend.upload(&x).unwrap();
            let runs: [(&str, &OpDef, Tensor, Tensor); 3] = [
                (
                    "silu",
                    &SILU_AND_MUL,
                    silu_and_mul(&backend.registry, &device_x).unwrap(),
                    ir_ops::silu_and_mul::native(&x).unwrap(),
                ),
                (
                    "gelu (erf)",
                    &GELU_AND_MUL,
                    gelu_and_mul(&backend.registry, &device_x, Approximate::None).unwrap(),
                    ir_ops::gelu_and_mul::native(&x, Approximate::None).unwrap(),
                ),
                (
                    "gelu (tanh)",
                    &GELU_AND_MUL,
                    gelu_and_mul(&backend.registry, &device_x, Approximate::Tanh).unwrap(),
                    ir_ops::gelu_and_mul::native(&x, Approximate::Tanh).unwrap(),
                ),
            ];
            for (what, def, got, expected) in runs {
                let tol = tolerance(def, dtype).unwrap();
                allclose(&got.to_cpu().unwrap(), &expected, tol.atol, tol.rtol)
                    .unwrap_or_else(|e| panic!("{} {what} {dtype} (ups {ups:?}): {e}", backend.provider));
            }
        }
    }
}

/// Every norm + quantization takes every weight dtype the plain norms take (a Gemma-style f32
/// weight on bf16 activations included) on every provider, with native's results: the residual
/// output bit-exact, the codes and scales within the op's tolerance.
#[test]
fn norm_quantizations_take_every_weight_dtype_the_norms_take() {
    for backend in backends() {
        let dtypes = backend.element_dtypes();
        for def in norm_quant_defs() {
            let op = def.name;
            let _guard = backend.registry.override_priority(op, &[backend.provider, "native"]).unwrap();
            for &x_dtype in &dtypes {
                let host = case(x_dtype, 3, 200, 11);
                for &w_dtype in &dtypes {
                    let label = format!("{} {op} x={x_dtype} w={w_dtype}", backend.provider);
                    let weight = Tensor::from_f64(w_dtype, &[200], &host.weight.to_f64_vec().unwrap()).unwrap();
                    let args =
                        |up: &dyn Fn(&Tensor) -> Tensor| norm_quant_args(def, &host.x, &host.residual, &weight, up);
                    let device_args = args(&|t| backend.upload(t).unwrap());
                    let metas: Vec<ArgMeta<'_>> = device_args.iter().map(Value::meta).collect();
                    let selection = backend.registry.select(op, &metas).unwrap();
                    assert_eq!(selection.provider, backend.provider, "{label}: {:?}", selection.rejected);
                    let got = backend.registry.run(Call::new(op, Overload::Default, device_args)).unwrap();
                    let expected = (def.native)(&args(&|t| t.clone())).unwrap();
                    check_norm_quant_outputs(&label, def, &got, &expected);
                }
            }
        }
    }
}

/// The four norm + quantization ops.
fn norm_quant_defs() -> [&'static OpDef; 4] {
    use ir_ops::fused_add_rms_norm_dynamic_per_token_quant::FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT;
    use ir_ops::fused_add_rms_norm_static_fp8_quant::FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT;
    use ir_ops::rms_norm_dynamic_per_token_quant::RMS_NORM_DYNAMIC_PER_TOKEN_QUANT;
    use ir_ops::rms_norm_static_fp8_quant::RMS_NORM_STATIC_FP8_QUANT;
    [
        &RMS_NORM_STATIC_FP8_QUANT,
        &RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
        &FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT,
        &FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
    ]
}

/// The arguments of a norm + quantization call, each tensor through `up`: x, the residual for a
/// fused op, the weight, epsilon, the scale (0.01 for a static op, an upper bound of 100 for a
/// dynamic one), e4m3 codes and exact rounding.
fn norm_quant_args(
    def: &OpDef,
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    up: &dyn Fn(&Tensor) -> Tensor,
) -> Vec<Value> {
    let scale = if def.name.contains("dynamic") { 100.0 } else { 0.01 };
    let scale = Tensor::from_f64(DType::F32, &[1], &[scale]).unwrap();
    let mut args = vec![Value::Tensor(up(x))];
    if def.name.starts_with("fused_add") {
        args.push(Value::Tensor(up(residual)));
    }
    args.extend([
        Value::Tensor(up(weight)),
        Value::F64(EPS),
        Value::Tensor(up(&scale)),
        Value::DType(DType::F8E4M3FN),
        Value::Str("exact".to_owned()),
    ]);
    args
}

/// A norm + quantization's outputs against native's: a fused op's residual output bit for bit,
/// the codes and scales within the op's tolerance.
fn check_norm_quant_outputs(label: &str, def: &OpDef, got: &[Tensor], expected: &[Tensor]) {
    assert_eq!(got.len(), expected.len(), "{label}: outputs");
    for (index, (a, b)) in got.iter().zip(expected).enumerate() {
        let a = a.to_cpu().unwrap().contiguous().unwrap();
        if def.name.starts_with("fused_add") && index == 0 {
            assert!(bit_eq(&a, b), "{label}: residual_out is bit-exact");
            continue;
        }
        let tol = tolerance(def, b.dtype()).unwrap();
        allclose(&a, b, tol.atol, tol.rtol).unwrap_or_else(|e| panic!("{label}: output {index}: {e}"));
    }
}

/// A row whose f32 sum of squares overflows although its mean square fits (|x| near 1e18 at
/// 4096 columns) is normalized and quantized as the reference does it by every provider's norm +
/// quantization kernels: its sum taken again in double, as the norms take it. Tiny rows (1e-19)
/// whose squares underflow keep theirs too.
#[test]
fn norm_quantizations_keep_rows_whose_f32_sum_of_squares_overflows() {
    let scales = [1e18, 4e18, 1.5e19, 1e-19, 1.0];
    for backend in backends() {
        for def in norm_quant_defs() {
            let op = def.name;
            let _guard = backend.registry.override_priority(op, &[backend.provider]).unwrap();
            for dtype in [DType::F32, DType::BF16] {
                for hidden in [64, 4096] {
                    let Case { x, residual, weight } = magnitude_rows(dtype, &scales, hidden);
                    let label = format!("{} {op} {dtype} H={hidden}", backend.provider);
                    let args = |up: &dyn Fn(&Tensor) -> Tensor| norm_quant_args(def, &x, &residual, &weight, up);
                    let got = backend
                        .registry
                        .run(Call::new(op, Overload::Default, args(&|t| backend.upload(t).unwrap())))
                        .unwrap_or_else(|e| panic!("{label}: {e}"));
                    let expected = (def.native)(&args(&|t| t.clone())).unwrap();
                    for (index, b) in expected.iter().enumerate() {
                        let finite = b.to_f64_vec().unwrap().iter().all(|v| v.is_finite());
                        assert!(finite, "{label}: native's output {index} is finite");
                    }
                    check_norm_quant_outputs(&label, def, &got, &expected);
                }
            }
        }
    }
}

/// `rounding = "dtype"` on the norm + quantizations is the unfused pair with `"dtype"` (the norm of
/// the sum rounded to x's dtype, a static scale's reciprocal), on every provider, no fallback: on
/// the cpu provider bit for bit, elsewhere the residual output bit-exact and the codes and scales
/// within the op's tolerance (a GPU's sum of squares runs in another order). Native's fused op is
/// the native pair bit for bit, and on bf16 the two roundings give different codes.
#[test]
fn norm_quantizations_with_dtype_rounding_are_the_dtype_pair() {
    use ir_core::op::StrEnum;
    use ir_ops::Rounding;
    use ir_ops::fused_add_rms_norm_dynamic_per_token_quant::FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT;
    use ir_ops::fused_add_rms_norm_static_fp8_quant::FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT;
    use ir_ops::rms_norm_dynamic_per_token_quant::RMS_NORM_DYNAMIC_PER_TOKEN_QUANT;
    use ir_ops::rms_norm_static_fp8_quant::RMS_NORM_STATIC_FP8_QUANT;
    let defs = [
        &RMS_NORM_STATIC_FP8_QUANT,
        &RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
        &FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT,
        &FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT,
    ];
    for backend in backends() {
        for def in defs {
            let op = def.name;
            let fused = op.starts_with("fused_add");
            let dynamic = op.contains("dynamic");
            let _guard = backend.registry.override_priority(op, &[backend.provider]).unwrap();
            // A static scale that saturates the tails; a bound loose enough to bind no row.
            let scale = Tensor::from_f64(DType::F32, &[1], &[if dynamic { 100.0 } else { 0.011 }]).unwrap();
            for x_dtype in backend.element_dtypes() {
                // 16 rows of 4096: enough elements near a tie for the roundings to part.
                let host = case(x_dtype, 16, 4096, 13);
                let args = |up: &dyn Fn(&Tensor) -> Tensor, rounding: Rounding| -> Vec<Value> {
                    let mut args = vec![Value::Tensor(up(&host.x))];
                    if fused {
                        args.push(Value::Tensor(up(&host.residual)));
                    }
                    args.extend([
                        Value::Tensor(up(&host.weight)),
                        Value::F64(EPS),
                        Value::Tensor(up(&scale)),
                        Value::DType(DType::F8E4M3FN),
                        Value::Str(rounding.as_str().to_owned()),
                    ]);
                    args
                };
                let label = format!("{} {op} {x_dtype}", backend.provider);
                let expected = (def.native)(&args(&|t| t.clone(), Rounding::Dtype)).unwrap();

                // The pair, natively, with `dtype` rounding.
                let pair = dtype_pair(&ir_ops::registry(), &host, &scale, fused, dynamic);
                let q_index = usize::from(fused);
                for (index, (a, b)) in expected.iter().zip(&pair).enumerate() {
                    assert!(bit_eq(a, b), "{label}: native output {index} is the native pair's");
                }
                let exact_codes = fp8_codes(&(def.native)(&args(&|t| t.clone(), Rounding::Exact)).unwrap()[q_index]);
                let dtype_codes = fp8_codes(&expected[q_index]);
                let mismatches = |a: &[u8], b: &[u8]| a.iter().zip(b).filter(|(a, b)| a != b).count();
                let differ = mismatches(&exact_codes, &dtype_codes);
                if x_dtype == DType::BF16 && fused {
                    eprintln!("{label}: {differ} of {} codes differ between the roundings", exact_codes.len());
                    assert!(differ > 0, "{label}: the roundings part on bf16");
                }

                let up = |t: &Tensor| backend.upload(t).unwrap();
                let got = backend.registry.run(Call::new(op, Overload::Default, args(&up, Rounding::Dtype)));
                let got: Vec<Tensor> = got
                    .unwrap_or_else(|e| panic!("{label}: {e}"))
                    .iter()
                    .map(|t| t.to_cpu().unwrap().contiguous().unwrap())
                    .collect();
                for (index, (a, b)) in got.iter().zip(&expected).enumerate() {
                    if fused && index == 0 {
                        assert!(bit_eq(a, b), "{label}: residual_out is bit-exact");
                        continue;
                    }
                    let tol = tolerance(def, b.dtype()).unwrap();
                    allclose(a, b, tol.atol, tol.rtol).unwrap_or_else(|e| panic!("{label}: output {index}: {e}"));
                }
                // One fp8 step is within the tolerance, so a kernel that ignored the rounding would
                // pass the comparison above: where the roundings part, its codes must be closer to
                // `dtype`'s than to `exact`'s.
                if differ > 0 {
                    let got_codes = fp8_codes(&got[q_index]);
                    let (to_dtype, to_exact) =
                        (mismatches(&got_codes, &dtype_codes), mismatches(&got_codes, &exact_codes));
                    assert!(
                        to_dtype < to_exact,
                        "{label}: {to_dtype} codes differ from dtype's, {to_exact} from exact's"
                    );
                }
                // The provider's own pair with `dtype` rounding gives the fused op's bits on the
                // cpu provider (its fused rows are its unfused rows composed).
                if backend.provider == kernels_cpu::PROVIDER {
                    let registry = &backend.registry;
                    let pair_ops = [
                        "rms_norm",
                        "fused_add_rms_norm",
                        "static_scaled_fp8_quant",
                        "dynamic_per_token_scaled_fp8_quant",
                    ];
                    let _guards = pair_ops.map(|name| registry.override_priority(name, &[backend.provider]).unwrap());
                    let pair = dtype_pair(registry, &host, &scale, fused, dynamic);
                    for (index, (a, b)) in got.iter().zip(&pair).enumerate() {
                        assert!(bit_eq(a, b), "{label}: output {index} is the cpu pair's, bit for bit");
                    }
                }
            }
        }
    }
}

/// The unfused pair of a norm + quantization with `dtype` rounding on `registry`'s providers:
/// `fused_add_rms_norm` (with `residual`) or `rms_norm`, then the static quantization by `scale` or
/// the per-token one. Returns the fused op's outputs: the residual output, then q and the scales.
fn dtype_pair(registry: &ir_core::Registry, host: &Case, scale: &Tensor, fused: bool, dynamic: bool) -> Vec<Tensor> {
    use ir_ops::Rounding;
    use ir_ops::{dynamic_per_token_scaled_fp8_quant, static_scaled_fp8_quant};
    let weight = Some(&host.weight);
    let (normalized, residual_out) = if fused {
        let (out, sum) =
            fused_add_rms_norm(registry, &host.x, &host.residual, weight, EPS, None, Rounding::Dtype).unwrap();
        (out, Some(sum))
    } else {
        (rms_norm(registry, &host.x, weight, EPS, None).unwrap(), None)
    };
    let mut pair: Vec<Tensor> = residual_out.into_iter().collect();
    if dynamic {
        let quant = dynamic_per_token_scaled_fp8_quant::dynamic_per_token_scaled_fp8_quant;
        let (q, s) = quant(registry, &normalized, None, DType::F8E4M3FN).unwrap();
        pair.extend([q, s]);
    } else {
        let quant = static_scaled_fp8_quant::static_scaled_fp8_quant;
        pair.push(quant(registry, &normalized, scale, DType::F8E4M3FN, Rounding::Dtype).unwrap());
    }
    pair.iter().map(|t| t.to_cpu().unwrap().contiguous().unwrap()).collect()
}

/// The bytes of a tensor's whole storage, wherever it lives.
fn storage_bytes(t: &Tensor) -> Vec<u8> {
    match t.storage() {
        ir_core::storage::Storage::Cpu(buffer) => buffer.bytes().to_vec(),
        ir_core::storage::Storage::Device(buffer) => {
            let mut bytes = vec![0u8; buffer.len_bytes()];
            buffer.download(&mut bytes).unwrap();
            bytes
        }
    }
}

/// A view of `layout` holding `values`, in a device storage of `len` elements whose others hold
/// `sentinel` (uploaded whole, then viewed on the device, the whole-storage handle dropped so the
/// view can be donated), and the storage's bytes before any call.
fn guarded_view(backend: &Backend, values: &Tensor, layout: &Layout, len: usize, sentinel: f64) -> (Tensor, Vec<u8>) {
    let mut all = vec![sentinel; len];
    for (index, value) in layout.storage_indices().zip(values.to_f64_vec().unwrap()) {
        all[index] = value;
    }
    let device = backend.upload(&Tensor::from_f64(values.dtype(), &[len], &all).unwrap()).unwrap();
    let before = storage_bytes(&device);
    (device.as_strided(layout.clone()).unwrap(), before)
}

/// `result`'s storage is `before`'s, written in place, and every element outside `layout` kept its
/// bits.
fn assert_outside_unchanged(label: &str, result: &Tensor, before: &[u8], layout: &Layout) {
    let after = storage_bytes(result);
    assert_eq!(after.len(), before.len(), "{label}: written in place");
    let size = result.dtype().size_in_bytes();
    let inside: std::collections::HashSet<usize> = layout.storage_indices().collect();
    let changed = (0..before.len() / size)
        .filter(|i| !inside.contains(i) && after[i * size..][..size] != before[i * size..][..size])
        .count();
    assert_eq!(changed, 0, "{label}: elements outside the layout changed");
}

/// Rows of `hidden` elements, `tokens` of them, 3 elements into a storage and 5 apart: the layout
/// and the storage's length (5 more past the last row).
fn padded_rows(tokens: usize, hidden: usize) -> (Layout, usize) {
    const OFFSET: usize = 3;
    const PAD: usize = 5;
    let stride = hidden + PAD;
    (Layout::new(&[tokens, hidden], &[stride, 1], OFFSET).unwrap(), OFFSET + tokens * stride + PAD)
}

/// An in-place kernel writes its outputs' elements and nothing else: x and the residual as views
/// with an offset and padded rows into storages whose other elements hold a sentinel, donated to
/// `fused_add_rms_norm`; afterwards every element outside the two layouts keeps its bits, and the
/// values inside are native's (within tolerance), on every provider.
#[test]
fn in_place_writes_leave_every_element_outside_the_layout_alone() {
    for backend in backends() {
        let _guard = backend.registry.override_priority("fused_add_rms_norm", &[backend.provider]).unwrap();
        for dtype in backend.element_dtypes() {
            for (tokens, hidden) in [(5, 300), (3, 4096), (2, 8199)] {
                let label = format!("{} {dtype} T={tokens} H={hidden}", backend.provider);
                let host = case(dtype, tokens, hidden, 21);
                let (layout, len) = padded_rows(tokens, hidden);
                let (x, x_before) = guarded_view(&backend, &host.x, &layout, len, 2.5);
                let (residual, r_before) = guarded_view(&backend, &host.residual, &layout, len, -1.5);
                let weight = backend.upload(&host.weight).unwrap();
                let (out, residual_out) = fused_add_rms_norm::maybe_inplace(
                    &backend.registry,
                    x,
                    residual,
                    Some(&weight),
                    EPS,
                    None,
                    ir_ops::Rounding::Exact,
                )
                .unwrap();
                assert_outside_unchanged(&format!("{label}: x"), &out, &x_before, &layout);
                assert_outside_unchanged(&format!("{label}: residual"), &residual_out, &r_before, &layout);
                let (expected_out, expected_res) = ir_ops::fused_add_rms_norm::native(
                    &host.x,
                    &host.residual,
                    Some(&host.weight),
                    EPS,
                    None,
                    ir_ops::Rounding::Exact,
                )
                .unwrap();
                let tol = tolerance(&FUSED_ADD_RMS_NORM, dtype).unwrap();
                allclose(&out.to_cpu().unwrap(), &expected_out, tol.atol, tol.rtol)
                    .unwrap_or_else(|e| panic!("{label}: out: {e}"));
                assert!(bit_eq(&residual_out.to_cpu().unwrap(), &expected_res), "{label}: residual");
            }
        }
    }
}

/// The other in-place kernels write their outputs' elements and nothing else, as the norm does:
/// `rotary_embedding` on a donated query and key (NeoX and GPT-J pairs, full and partial rotary,
/// 16-byte-aligned and odd rows), and the fused norm + quantizations on a donated residual, each a
/// view with an offset and padded rows into a storage of sentinels, on every provider; the values
/// inside are native's.
#[test]
fn in_place_rotary_and_fused_quantizations_leave_every_element_outside_the_layout_alone() {
    use ir_ops::fused_add_rms_norm_dynamic_per_token_quant::FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT;
    use ir_ops::fused_add_rms_norm_static_fp8_quant::FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT;
    use ir_ops::rotary_embedding::{self, ROTARY_EMBEDDING, cos_sin_cache};
    const HEAD: usize = 64;
    let positions: Vec<i64> = vec![0, 39, 17, 5, 23];
    let tokens = positions.len();
    for backend in backends() {
        let up = |t: &Tensor| backend.upload(t).unwrap();
        let positions = Tensor::from_vec(&[tokens], positions.clone()).unwrap();
        let _rotary = backend.registry.override_priority(ROTARY_EMBEDDING.name, &[backend.provider]).unwrap();
        for dtype in backend.element_dtypes() {
            for (is_neox, rotary_dim, heads) in [(true, HEAD, 4), (false, HEAD / 2, 3)] {
                let label = format!("{} {dtype} rotary neox={is_neox} rotary_dim={rotary_dim}", backend.provider);
                let cache = cos_sin_cache(dtype, 40, rotary_dim, 10000.0).unwrap();
                let q = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, heads * HEAD]), 31).unwrap();
                let k = Tensor::randn(&TensorMeta::compact(dtype, &[tokens, HEAD]), 32).unwrap();
                let (q_layout, q_len) = padded_rows(tokens, heads * HEAD);
                let (k_layout, k_len) = padded_rows(tokens, HEAD);
                let (q_dev, q_before) = guarded_view(&backend, &q, &q_layout, q_len, 7.0);
                let (k_dev, k_before) = guarded_view(&backend, &k, &k_layout, k_len, -7.0);
                let (rq, rk) = rotary_embedding::maybe_inplace(
                    &backend.registry,
                    &up(&positions),
                    q_dev,
                    Some(k_dev),
                    &up(&cache),
                    HEAD as i64,
                    rotary_dim as i64,
                    is_neox,
                    ir_ops::Rounding::Exact,
                )
                .unwrap_or_else(|e| panic!("{label}: {e}"));
                let rk = rk.expect("a key output");
                assert_outside_unchanged(&format!("{label}: query"), &rq, &q_before, &q_layout);
                assert_outside_unchanged(&format!("{label}: key"), &rk, &k_before, &k_layout);
                let (eq, ek) = exact_rotary(&positions, &q, Some(&k), &cache, HEAD, rotary_dim, is_neox);
                assert!(bit_eq(&rq.to_cpu().unwrap(), &eq), "{label}: query");
                assert!(bit_eq(&rk.to_cpu().unwrap(), &ek.expect("a key")), "{label}: key");
            }
            for def in [&FUSED_ADD_RMS_NORM_STATIC_FP8_QUANT, &FUSED_ADD_RMS_NORM_DYNAMIC_PER_TOKEN_QUANT] {
                let _guard = backend.registry.override_priority(def.name, &[backend.provider]).unwrap();
                let dynamic = def.n_outputs == 3;
                for hidden in [96, 1000] {
                    let label = format!("{} {dtype} {} H={hidden}", backend.provider, def.name);
                    let host = case(dtype, tokens, hidden, 33);
                    let scale = Tensor::from_f64(DType::F32, &[1], &[if dynamic { 100.0 } else { 0.01 }]).unwrap();
                    let (layout, len) = padded_rows(tokens, hidden);
                    let (residual, before) = guarded_view(&backend, &host.residual, &layout, len, 3.5);
                    let args = |x: Tensor, residual: Tensor, weight: Tensor, scale: Tensor| {
                        vec![
                            Value::Tensor(x),
                            Value::Tensor(residual),
                            Value::Tensor(weight),
                            Value::F64(EPS),
                            Value::Tensor(scale),
                            Value::DType(DType::F8E4M3FN),
                            Value::Str("exact".to_owned()),
                        ]
                    };
                    let device_args = args(up(&host.x), residual, up(&host.weight), up(&scale));
                    let outputs =
                        backend.registry.run(Call::new(def.name, Overload::MaybeInplace, device_args)).unwrap();
                    assert_outside_unchanged(&format!("{label}: residual"), &outputs[0], &before, &layout);
                    let host_args = args(host.x.clone(), host.residual.clone(), host.weight.clone(), scale.clone());
                    let expected = (def.native)(&host_args).unwrap();
                    assert!(bit_eq(&outputs[0].to_cpu().unwrap(), &expected[0]), "{label}: residual_out");
                }
            }
        }
    }
}

/// The emulated providers (the kernel source run on the CPU), which log the kernels they launch.
fn emulated_backends() -> Vec<Backend> {
    backends().into_iter().filter(|b| b.provider.starts_with("emu_")).collect()
}

/// Whether an emulated launch ran a 16-byte kernel: `<kernel>_vec` (the gated ops and the
/// quantizations), a HIP norm of vector width 4 or 8 (`_v4_`, `_v8_`), a CUDA norm program built
/// with `VEC=4` or `VEC=8`, a generated kernel of whole chunks (`RP_VEC=1`).
fn is_16_byte(launch: &kernel_support::emu::EmuLaunch) -> bool {
    let k = &launch.kernel;
    k.ends_with("_vec")
        || k.contains("_v4_")
        || k.contains("_v8_")
        || launch.defines.split(' ').any(|d| d == "VEC=4" || d == "VEC=8" || d == "RP_VEC=1")
}

/// The generated `host` arguments on `backend`'s device, the op's activations compact or (`padded`)
/// in rows 3 elements apart more than their length.
fn uploaded(backend: &Backend, def: &OpDef, host: &[Value], padded: bool) -> Vec<Value> {
    let activations = def.activation_indices().unwrap();
    host.iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::Tensor(t) if padded && activations.contains(&i) => {
                Value::Tensor(backend.upload(&row_padded(t)).unwrap())
            }
            Value::Tensor(t) => Value::Tensor(backend.upload(t).unwrap()),
            other => other.clone(),
        })
        .collect()
}

/// The overload a call of one named provider takes: its activations donated where the op has an
/// in-place form (what a lowered graph's `impl` node passes).
fn donating(def: &OpDef) -> Overload {
    if def.allow_inplace { Overload::MaybeInplace } else { Overload::Default }
}

/// `op` on `backend` with the generated `host` arguments, its activations compact or with padded
/// rows: the outputs on the host, and the kernels the call launched.
fn run_logged(
    backend: &Backend,
    def: &OpDef,
    host: &[Value],
    padded: bool,
) -> (Vec<Tensor>, Vec<kernel_support::emu::EmuLaunch>) {
    let args = uploaded(backend, def, host, padded);
    kernel_support::emu::take_launches();
    let got = backend
        .registry
        .run(Call::new(def.name, donating(def), args).provider(backend.provider))
        .unwrap_or_else(|e| panic!("{} {} padded={padded}: {e}", backend.provider, def.name));
    let launches = kernel_support::emu::take_launches();
    (got.iter().map(|t| t.to_cpu().unwrap()).collect(), launches)
}

/// The ops without a 16-byte kernel: rotary and Qwen3's head norms + rotary (one thread per
/// rotated pair, the generated kernel of a rotary program walks its pairs).
const SCALAR_ONLY: [&str; 2] = ["rotary_embedding", "fused_qk_norm_rope"];

/// Every op, on every emulated provider: rows the host gives its 16-byte kernel (compact, of a
/// multiple of 16 bytes) and the same values in rows 3 elements apart (which only a scalar kernel
/// takes) give the same bits, and the launches show that each kernel ran.
#[test]
fn the_16_byte_and_scalar_kernels_give_the_same_bits() {
    let emulated = emulated_backends();
    if emulated.is_empty() {
        return ir_core::testing::skip("cxx", "no emulated GPU: the 16-byte and scalar kernels not compared");
    }
    for backend in emulated {
        for op in backend.registry.ops() {
            let def = backend.registry.op_def(op).unwrap();
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                for (seed, (tokens, hidden)) in [(3usize, 768usize), (5, 4096)].into_iter().enumerate() {
                    let label = format!("{} {op} {dtype} T={tokens} H={hidden}", backend.provider);
                    let spec =
                        InputSpec { num_tokens: tokens, hidden_size: hidden, dtype, epsilon: EPS, seed: seed as u64 };
                    let host = (def.generate_inputs)(&spec).unwrap();
                    let (wide, wide_launches) = run_logged(&backend, def, &host, false);
                    let (scalar, scalar_launches) = run_logged(&backend, def, &host, true);
                    let has_16_byte = !SCALAR_ONLY.contains(&op);
                    assert_eq!(
                        wide_launches.iter().any(is_16_byte),
                        has_16_byte,
                        "{label}: compact rows launched {wide_launches:?}"
                    );
                    assert!(!scalar_launches.is_empty(), "{label}: padded rows launched nothing");
                    assert!(
                        !scalar_launches.iter().any(is_16_byte),
                        "{label}: padded rows launched {scalar_launches:?}"
                    );
                    for (index, (a, b)) in wide.iter().zip(&scalar).enumerate() {
                        assert!(bit_eq(a, b), "{label}: output {index} differs between the 16-byte and scalar kernels");
                    }
                }
            }
        }
    }
}

/// Qwen3's head norms and rotation on every emulated GPU, in place on query and key rows 3
/// elements apart (the heads of such rows are blocks of rows, as a column slice of qkv's are): the
/// generated kernel walks the heads where they are, with no compact copy launched, and gives the
/// compact rows' bits.
#[test]
fn the_generated_kernels_walk_the_heads_of_padded_rows_where_they_are() {
    let emulated = emulated_backends();
    if emulated.is_empty() {
        return ir_core::testing::skip("cxx", "no emulated GPU: head blocks not walked");
    }
    let def = &ir_ops::fused_qk_norm_rope::FUSED_QK_NORM_ROPE;
    for backend in emulated {
        for dtype in [DType::F32, DType::BF16] {
            for seed in 0..3u64 {
                let spec = InputSpec { num_tokens: 5, hidden_size: 1024, dtype, epsilon: EPS, seed };
                let host = (def.generate_inputs)(&spec).unwrap();
                let label = format!("{} {dtype} seed {seed}", backend.provider);
                let (compact, _) = run_logged(&backend, def, &host, false);
                let (padded, launches) = run_logged(&backend, def, &host, true);
                assert!(
                    !launches.is_empty() && launches.iter().all(|l| &*l.kernel == "row_program"),
                    "{label}: {launches:?}"
                );
                for (index, (a, b)) in compact.iter().zip(&padded).enumerate() {
                    assert!(bit_eq(a, b), "{label}: output {index} differs between compact and padded rows");
                }
            }
        }
    }
}

/// The same source in CUDA's dialect (one block per row, warps of 32) and HIP's (grid-stride rows,
/// its own norm kernels) on a GPU with waves of 32: every op gives the same bits on both, every
/// dtype, compact and padded rows.
#[test]
fn cuda_and_hip_in_waves_of_32_give_the_same_bits() {
    let emulated = emulated_backends();
    let (Some(cuda), Some(hip)) =
        (emulated.iter().find(|b| b.provider == "emu_cuda"), emulated.iter().find(|b| b.provider == "emu_hip_wave32"))
    else {
        return ir_core::testing::skip("cxx", "no emulated GPU: CUDA and HIP not compared");
    };
    let mut compared = 0;
    for op in cuda.registry.ops() {
        let def = cuda.registry.op_def(op).unwrap();
        for dtype in cuda.element_dtypes() {
            for (seed, (tokens, hidden)) in [(1usize, 64usize), (7, 769), (4, 4096)].into_iter().enumerate() {
                let spec =
                    InputSpec { num_tokens: tokens, hidden_size: hidden, dtype, epsilon: EPS, seed: seed as u64 };
                let host = (def.generate_inputs)(&spec).unwrap();
                for padded in [false, true] {
                    let label = format!("{op} {dtype} T={tokens} H={hidden} padded={padded}");
                    let (on_cuda, _) = run_logged(cuda, def, &host, padded);
                    let (on_hip, _) = run_logged(hip, def, &host, padded);
                    for (index, (a, b)) in on_cuda.iter().zip(&on_hip).enumerate() {
                        assert!(bit_eq(a, b), "{label}: output {index} differs between CUDA and HIP in waves of 32");
                    }
                    compared += 1;
                }
            }
        }
    }
    assert_eq!(compared, cuda.registry.ops().len() * 4 * 3 * 2);
}

/// The tensor-level device operations that write their whole output (a compact copy, `cat`,
/// `scale`, `add`, `mul`, an upload next to a tensor) allocate it without zeroing it first: on the
/// emulated CUDA device, which fills such memory with `0xff` bytes (NaN), no zeroed allocation is
/// made and every value is right.
#[test]
fn device_copies_allocate_their_outputs_without_zeroing() {
    if let ir_core::Availability::Unavailable(reason) = kernels_cuda::emu::availability() {
        return ir_core::testing::skip("cxx", &format!("emulated cuda: {reason}"));
    }
    let backend = backends().into_iter().find(|b| b.provider == kernels_cuda::emu::PROVIDER).unwrap();
    let host = Tensor::from_f64(DType::F32, &[4, 6], &(0..24).map(f64::from).collect::<Vec<_>>()).unwrap();
    let device = backend.upload(&host).unwrap();
    let transposed = device.transpose(0, 1).unwrap();
    let before = kernels_cuda::emu::zeroed_allocations();
    let results = [
        ("contiguous", transposed.contiguous().unwrap(), host.transpose(0, 1).unwrap().contiguous().unwrap()),
        ("cat", device.cat(&device, 0).unwrap(), host.cat(&host, 0).unwrap()),
        ("scale", transposed.scale(0.5).unwrap(), host.transpose(0, 1).unwrap().scale(0.5).unwrap()),
        ("add", device.add(&device).unwrap(), host.add(&host).unwrap()),
        ("mul", device.mul(&device).unwrap(), host.mul(&host).unwrap()),
        ("to_device_of", host.to_device_of(&device).unwrap(), host.clone()),
    ];
    assert_eq!(kernels_cuda::emu::zeroed_allocations(), before, "no zeroed allocation");
    for (what, got, expected) in results {
        assert!(matches!(got.storage(), ir_core::storage::Storage::Device(_)), "{what} stays on the device");
        assert!(bit_eq(&got.to_cpu().unwrap(), &expected), "{what}: {:?}", got.to_f64_vec());
    }
}

/// `layer_norm` on every emulated GPU (and a real one where there is one): its row program as a
/// kernel generated for the call's dtypes, chosen for rows of a unit last stride, within the op's
/// tolerance of the native (the program on the reference interpreter), its output on the device
/// with the declared metadata; a layout the generated kernel does not take (a transposed view) is
/// compacted on the device for it.
#[test]
fn layer_norm_runs_as_a_generated_kernel_on_every_gpu_backend() {
    let mut ran = 0;
    for backend in backends() {
        if backend.allocator.is_none() {
            continue;
        }
        ran += 1;
        let (provider, registry) = (backend.provider, &backend.registry);
        let _priorities = registry.override_priority("layer_norm", &[provider, "native"]).unwrap();
        let mut rng = ir_core::testing::InputRng::new(43);
        for (d, dtype) in backend.element_dtypes().into_iter().enumerate() {
            let tolerance = tolerance(&ir_ops::layer_norm::LAYER_NORM, dtype).unwrap();
            // A column slice of a wider buffer (rows of one stride), 3 rows of 300 (more than a
            // block's 256 threads, so threads take two columns).
            let wide = rng.normal(dtype, &[3, 320], 0.5, 1.0).unwrap();
            let x_host = wide.narrow(1, 7, 300).unwrap();
            let w_host = rng.normal(dtype, &[300], 1.0, 0.1).unwrap();
            let b_host = rng.normal(dtype, &[300], 0.0, 0.1).unwrap();
            let transposed_host = rng.normal(dtype, &[300, 3], 0.5, 1.0).unwrap().transpose(0, 1).unwrap();
            let up = |t: &Tensor| backend.upload(t).unwrap();
            let (x, w, b, transposed) = (up(&x_host), up(&w_host), up(&b_host), up(&transposed_host));
            for (x, x_host, compacted) in [(&x, &x_host, vec![]), (&transposed, &transposed_host, vec![0])] {
                let metas = [
                    ArgMeta::Tensor(x.meta()),
                    ArgMeta::Tensor(w.meta()),
                    ArgMeta::Tensor(b.meta()),
                    ArgMeta::F64(1e-5),
                ];
                let selection = registry.select("layer_norm", &metas).unwrap();
                assert_eq!(selection.provider, provider, "{provider} {dtype}");
                assert_eq!(selection.compacted, compacted, "{provider} {dtype}");
                // Each form is a kernel of its own (built for the CPU on an emulated device): all
                // three in the first dtype, the weight and bias form in the others.
                let forms = [
                    (Some(&w), Some(&b), Some(&w_host), Some(&b_host)),
                    (None, None, None, None),
                    (Some(&w), None, Some(&w_host), None),
                ];
                for (weight, bias, weight_host, bias_host) in forms.into_iter().take(if d == 0 { 3 } else { 1 }) {
                    let ours = ir_ops::layer_norm::layer_norm(registry, x, weight, bias, 1e-5).unwrap();
                    assert!(
                        matches!(ours.storage(), ir_core::storage::Storage::Device(_)),
                        "{provider}: on the device"
                    );
                    let native = ir_ops::layer_norm::native(x_host, weight_host, bias_host, 1e-5).unwrap();
                    assert_eq!(ours.shape(), native.shape());
                    assert_eq!(ours.layout(), native.layout(), "{provider} {dtype}: compact, as declared");
                    allclose(&ours.to_cpu().unwrap(), &native, tolerance.atol, tolerance.rtol).unwrap_or_else(
                        |error| {
                            panic!(
                                "{provider} {dtype} {x:?} weight {} bias {}: {error}",
                                weight.is_some(),
                                bias.is_some()
                            )
                        },
                    );
                }
            }
        }
    }
    if ran == 0 {
        ir_core::testing::skip("device", "no GPU backend here: layer_norm's generated kernel not run");
    }
}

/// The generated sandwich norm on each emulated GPU gives its hand-written chain's bits
/// (`rms_norm`, then `fused_add_rms_norm` of its output): the generated kernel lays a row over the
/// hand-written norms' threads, owns their chunks and reduces by their tree, so the sums of
/// squares are the same whatever the access width, and a row whose f32 sum overflows is summed
/// again in double by both. Rows of every threads-per-row bucket and past the registers' cache,
/// compact (whole 16-byte chunks) and padded (element by element), in every compute dtype and
/// both roundings, and with Gemma's f32 weights on 16-bit rows.
#[test]
fn the_generated_sandwich_gives_the_hand_written_norms_bits_on_the_emulated_gpus() {
    use ir_ops::fused_sandwich_rms_norm::FUSED_SANDWICH_RMS_NORM;
    let emulated = emulated_backends();
    if emulated.is_empty() {
        return ir_core::testing::skip("cxx", "no emulated GPU: generated and hand-written norms not compared");
    }
    let def = &FUSED_SANDWICH_RMS_NORM;
    let shapes = [(3usize, 64usize), (5, 100), (4, 1000), (2, 4096), (3, 5000), (1, 8192), (2, 20000)];
    for backend in &emulated {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (seed, (tokens, hidden)) in shapes.into_iter().enumerate() {
                let spec =
                    InputSpec { num_tokens: tokens, hidden_size: hidden, dtype, epsilon: EPS, seed: seed as u64 };
                let mut host = (def.generate_inputs)(&spec).unwrap();
                // Odd seeds in f32 and bf16: rows whose f32 sums of squares overflow although their
                // means fit, which both kernels sum again in double.
                let overflow = dtype != DType::F16 && seed % 2 == 1;
                if overflow {
                    for at in [0, 1] {
                        let values = host[at].as_tensor().unwrap().to_f64_vec().unwrap();
                        let scale = |k: usize| [1.0, 1e18, 4e18, 1.5e19][(k / hidden) % 4];
                        let scaled: Vec<f64> = values.iter().enumerate().map(|(k, v)| v * scale(k)).collect();
                        host[at] = Value::Tensor(Tensor::from_f64(dtype, &[tokens, hidden], &scaled).unwrap());
                    }
                }
                // Gemma's f32 weights on 16-bit rows, at a small, a Llama-sized and a long width.
                let mixes: &[bool] = if dtype != DType::F32 && seed % 3 == 0 { &[false, true] } else { &[false] };
                for (&mixed, padded) in mixes.iter().flat_map(|m| [(m, false), (m, true)]) {
                    let mut host = host.clone();
                    if mixed {
                        for at in [2, 3] {
                            let weight = host[at].as_tensor().unwrap().to_f64_vec().unwrap();
                            host[at] = Value::Tensor(Tensor::from_f64(DType::F32, &[hidden], &weight).unwrap());
                        }
                    }
                    let label = format!(
                        "{} {dtype} T={tokens} H={hidden} padded={padded} overflow={overflow} f32 weights={mixed}",
                        backend.provider
                    );
                    let (fused, launches) = run_logged(backend, def, &host, padded);
                    assert!(
                        launches.len() == 1 && &*launches[0].kernel == "row_program",
                        "{label}: one generated launch, got {launches:?}"
                    );
                    let whole = hidden.is_multiple_of(kernel_support::gpu_chunk(dtype));
                    // One row has no row stride to break its chunks.
                    let wide = whole && (!padded || tokens == 1);
                    assert_eq!(launches.iter().any(is_16_byte), wide, "{label}: {launches:?}");
                    let args = uploaded(backend, def, &host, padded);
                    let norm = backend
                        .registry
                        .run(
                            Call::new(
                                "rms_norm",
                                Overload::Default,
                                vec![args[0].clone(), args[2].clone(), args[4].clone()],
                            )
                            .provider(backend.provider),
                        )
                        .unwrap();
                    let chain = backend
                        .registry
                        .run(
                            Call::new(
                                "fused_add_rms_norm",
                                Overload::Default,
                                vec![
                                    Value::Tensor(norm[0].clone()),
                                    args[1].clone(),
                                    args[3].clone(),
                                    args[4].clone(),
                                    Value::None,
                                    args[5].clone(),
                                ],
                            )
                            .provider(backend.provider),
                        )
                        .unwrap();
                    for (index, (a, b)) in fused.iter().zip(&chain).enumerate() {
                        assert!(bit_eq(a, &b.to_cpu().unwrap()), "{label}: output {index} differs from the chain's");
                    }
                }
            }
        }
    }
}

/// The row program of `def`'s call with `host` arguments, and the arguments it takes (their
/// indices among the op's): the norms and quantizations whose generated kernels stand beside
/// hand-written ones with the same order of operations.
fn program_of_call(def: &OpDef, host: &[Value]) -> (ir_ops::row_program::RowProgram, Vec<usize>) {
    use ir_core::op::StrEnum;
    use ir_ops::row_program::builtin;
    let given = |at: usize| host.get(at).is_some_and(|v| !matches!(v, Value::None));
    let rounding = |at: usize| match host.get(at) {
        Some(Value::Str(text)) => ir_ops::Rounding::from_str(text).unwrap(),
        _ => ir_ops::Rounding::Exact,
    };
    let picked = |at: &[usize]| at.iter().copied().filter(|&i| given(i)).collect();
    match def.name {
        "rms_norm" => (builtin::rms_norm(given(1), given(3)), picked(&[0, 1, 2, 3])),
        "fused_add_rms_norm" => {
            (builtin::fused_add_rms_norm(given(2), given(4), rounding(5)), picked(&[0, 1, 2, 3, 4]))
        }
        "static_scaled_fp8_quant" => {
            let Value::DType(out) = host[2] else { panic!("static quantization's out_dtype") };
            (builtin::static_scaled_fp8_quant(out, rounding(3)).unwrap(), vec![0, 1])
        }
        "dynamic_per_token_scaled_fp8_quant" => {
            let Value::DType(out) = host[2] else { panic!("per-token quantization's out_dtype") };
            (builtin::dynamic_per_token_scaled_fp8_quant(out, given(1)).unwrap(), picked(&[0, 1]))
        }
        other => panic!("no program stands beside a hand-written {other} here"),
    }
}

/// The kernels generated from the programs of `rms_norm`, `fused_add_rms_norm` and the static and
/// per-token quantizations give the hand-written CUDA and HIP kernels' bits on the emulated GPUs,
/// where both fix the order of operations: the norms' chunk ownership and reduction tree (small,
/// Llama-sized and long rows, past the register cache), the quantizations' elementwise codes and
/// order-free absmax. Compact rows (16-byte accesses where a chunk fits) and padded ones, f32, bf16
/// and f16, both roundings. What stands between such a generated kernel and the hand-written one
/// it would replace is the benchmark on a device.
#[test]
fn the_generated_norms_and_quantizations_give_the_hand_written_kernels_bits_on_the_emulated_gpus() {
    use ir_ops::dynamic_per_token_scaled_fp8_quant::DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT;
    use ir_ops::row_program::RowArg;
    use ir_ops::static_scaled_fp8_quant::STATIC_SCALED_FP8_QUANT;
    use kernel_support::emu::Dialect;
    let emulated: Vec<(Backend, Dialect)> = emulated_backends()
        .into_iter()
        .filter_map(|backend| match backend.provider {
            "emu_cuda" => Some((backend, Dialect::Cuda)),
            "emu_hip" => Some((backend, Dialect::Hip)),
            _ => None,
        })
        .collect();
    if emulated.is_empty() {
        return ir_core::testing::skip("cxx", "no emulated GPU: generated and hand-written kernels not compared");
    }
    let defs = [&RMS_NORM, &FUSED_ADD_RMS_NORM, &STATIC_SCALED_FP8_QUANT, &DYNAMIC_PER_TOKEN_SCALED_FP8_QUANT];
    // 8 threads per row; a partial chunk; 64 (Llama's 4096); 256, past the register cache.
    let shapes = [(3usize, 64usize), (5, 100), (2, 4096), (2, 20000)];
    for (backend, dialect) in &emulated {
        for def in defs {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for (seed, (tokens, hidden)) in shapes.into_iter().enumerate() {
                    let spec =
                        InputSpec { num_tokens: tokens, hidden_size: hidden, dtype, epsilon: EPS, seed: seed as u64 };
                    let mut host = (def.generate_inputs)(&spec).unwrap();
                    if def.name == "fused_add_rms_norm" {
                        // Both roundings, by seed.
                        let rounding = ROUNDINGS[seed % 2];
                        host[5] = Value::Str(ir_core::op::StrEnum::as_str(rounding).to_owned());
                    }
                    let (program, picks) = program_of_call(def, &host);
                    let activations = def.activation_indices().unwrap();
                    for padded in [false, true] {
                        let label =
                            format!("{} {} {dtype} T={tokens} H={hidden} padded={padded}", backend.provider, def.name);
                        let (hand, launches) = run_logged(backend, def, &host, padded);
                        assert!(
                            launches.iter().all(|l| &*l.kernel != "row_program"),
                            "{label}: the hand-written kernel ran: {launches:?}"
                        );
                        let tensors: Vec<Option<Tensor>> = host
                            .iter()
                            .enumerate()
                            .map(|(i, v)| match v {
                                Value::Tensor(t) if padded && activations.contains(&i) => Some(row_padded(t)),
                                Value::Tensor(t) => Some(t.clone()),
                                _ => None,
                            })
                            .collect();
                        let args: Vec<RowArg<'_>> = picks
                            .iter()
                            .map(|&i| match &host[i] {
                                Value::Tensor(_) => RowArg::Tensor(tensors[i].as_ref().unwrap()),
                                Value::F64(v) => RowArg::Scalar(*v),
                                Value::I64(v) => RowArg::Scalar(*v as f64),
                                other => panic!("{label}: argument {i} is {other:?}"),
                            })
                            .collect();
                        kernel_support::emu::take_launches();
                        let generated = kernel_support::emu::run_row_program(&program, &args, *dialect, false)
                            .unwrap_or_else(|e| panic!("{label}: generated: {e}"));
                        let launches = kernel_support::emu::take_launches();
                        let whole = hidden.is_multiple_of(kernel_support::gpu_chunk(dtype)) && (!padded || tokens == 1);
                        assert_eq!(launches.iter().any(is_16_byte), whole, "{label}: {launches:?}");
                        assert_eq!(generated.len(), hand.len(), "{label}: outputs");
                        for (index, (g, h)) in generated.iter().zip(&hand).enumerate() {
                            let h = h.contiguous().unwrap();
                            assert!(bit_eq(g, &h), "{label}: output {index} differs from the hand-written kernel's");
                        }
                    }
                }
            }
        }
    }
}
