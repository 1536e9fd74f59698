//! The functional call and `maybe_inplace` with in-place and functional providers.

mod common;

use common::{capture, register_inplace, sample};
use ir_core::Call;
use ir_core::{CallError, DType, Layout, Tensor, bit_eq, shares_storage};
use ir_ops::fused_add_rms_norm::{self, fused_add_rms_norm};
use tracing::Level;

const EPS: f64 = 1e-6;

fn inputs(rows: usize, cols: usize) -> (Tensor, Tensor, Tensor) {
    let x = sample(DType::BF16, rows, cols, 1);
    let residual = sample(DType::BF16, rows, cols, 2);
    let weight = sample(DType::BF16, 1, cols, 3).reshape(&[cols]).unwrap();
    (x, residual, weight)
}

#[test]
fn maybe_inplace_with_a_functional_provider_gives_fresh_outputs() {
    let registry = ir_ops::registry();
    let (x, residual, weight) = inputs(8, 16);
    let (expected_out, expected_residual) =
        fused_add_rms_norm(&registry, &x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    let (x_id, residual_id) = (x.storage_id(), residual.storage_id());
    let (out, residual_out) =
        fused_add_rms_norm::maybe_inplace(&registry, x, residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact)
            .unwrap();
    assert!(bit_eq(&out, &expected_out));
    assert!(bit_eq(&residual_out, &expected_residual));
    assert_ne!(out.storage_id(), x_id);
    assert_ne!(residual_out.storage_id(), residual_id);
}

#[test]
fn the_functional_call_with_an_inplace_provider_never_writes_or_aliases_inputs() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let (x, residual, weight) = inputs(8, 16);
    let (x_before, residual_before) = (x.deep_clone().unwrap(), residual.deep_clone().unwrap());
    let (out, residual_out) =
        fused_add_rms_norm(&registry, &x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    assert!(bit_eq(&x, &x_before) && bit_eq(&residual, &residual_before), "inputs unchanged");
    for output in [&out, &residual_out] {
        for input in [&x, &residual, &weight] {
            assert!(!shares_storage(output, input));
        }
    }
    let (native_out, native_residual) =
        fused_add_rms_norm::native(&x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    assert!(bit_eq(&out, &native_out) && bit_eq(&residual_out, &native_residual));
    let record = registry.selection_record();
    assert_eq!(record.op("fused_add_rms_norm").unwrap().defensive_copies, 2);
}

#[test]
fn maybe_inplace_writes_into_uniquely_owned_activations() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let (x, residual, weight) = inputs(8, 16);
    let (expected_out, expected_residual) =
        fused_add_rms_norm(&registry, &x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    let (x_id, residual_id) = (x.storage_id(), residual.storage_id());
    let (x_offset, residual_offset) = (x.offset(), residual.offset());
    let (out, residual_out) =
        fused_add_rms_norm::maybe_inplace(&registry, x, residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact)
            .unwrap();
    assert_eq!((out.storage_id(), out.offset()), (x_id, x_offset));
    assert_eq!((residual_out.storage_id(), residual_out.offset()), (residual_id, residual_offset));
    assert!(bit_eq(&out, &expected_out));
    assert!(bit_eq(&residual_out, &expected_residual));
    assert_eq!(registry.selection_record().op("fused_add_rms_norm").unwrap().inplace_writes, 2);
}

#[test]
fn maybe_inplace_copies_an_activation_someone_can_still_read() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let (x, residual, weight) = inputs(8, 16);
    let (expected_out, expected_residual) =
        fused_add_rms_norm(&registry, &x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    let other_handle = x.clone();
    let view_of_residual = residual.slice(0, 2, 5).unwrap();
    let (handle_before, view_before) = (other_handle.deep_clone().unwrap(), view_of_residual.deep_clone().unwrap());
    let (result, events) = capture(|| {
        fused_add_rms_norm::maybe_inplace(&registry, x, residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact)
            .unwrap()
    });
    let (out, residual_out) = result;
    assert!(bit_eq(&other_handle, &handle_before), "the other handle still reads the old values");
    assert!(bit_eq(&view_of_residual, &view_before), "the view still reads the old values");
    assert!(!shares_storage(&out, &other_handle));
    assert!(!shares_storage(&residual_out, &view_of_residual));
    assert!(bit_eq(&out, &expected_out) && bit_eq(&residual_out, &expected_residual));
    assert_eq!(
        events.count(Level::DEBUG, "activation 0 of op fused_add_rms_norm is shared or read-only; copying instead"),
        1
    );
    assert_eq!(
        events.count(Level::DEBUG, "activation 1 of op fused_add_rms_norm is shared or read-only; copying instead"),
        1
    );
}

#[test]
fn the_same_tensor_donated_twice_is_never_corrupted() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let (x, _, weight) = inputs(4, 16);
    let (expected_out, expected_residual) =
        fused_add_rms_norm::native(&x, &x, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    let (out, residual_out) =
        fused_add_rms_norm::maybe_inplace(&registry, x.clone(), x, Some(&weight), EPS, None, ir_ops::Rounding::Exact)
            .unwrap();
    assert!(bit_eq(&out, &expected_out) && bit_eq(&residual_out, &expected_residual));
    assert!(!shares_storage(&out, &residual_out));
}

#[test]
fn a_weight_viewing_a_donated_activation_forces_a_copy() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let (x, residual, _) = inputs(4, 16);
    let weight = x.slice(0, 0, 1).unwrap().reshape(&[16]).unwrap();
    let weight_before = weight.deep_clone().unwrap();
    let (expected_out, _) =
        fused_add_rms_norm::native(&x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    let (out, _) =
        fused_add_rms_norm::maybe_inplace(&registry, x, residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact)
            .unwrap();
    assert!(bit_eq(&weight, &weight_before), "the weight was read, never overwritten");
    assert!(bit_eq(&out, &expected_out));
}

#[test]
fn padded_rows_keep_their_layout_when_written_in_place() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let storage = sample(DType::BF16, 4, 24, 7);
    let x = storage.as_strided(Layout::new(&[4, 16], &[24, 1], 1).unwrap()).unwrap();
    drop(storage);
    let residual = sample(DType::BF16, 4, 16, 8);
    let (functional_out, _) =
        fused_add_rms_norm(&registry, &x, &residual, None, EPS, None, ir_ops::Rounding::Exact).unwrap();
    assert_eq!(functional_out.strides(), &[16, 1], "a non-dense x gives a compact functional output");
    let (out, _) =
        fused_add_rms_norm::maybe_inplace(&registry, x, residual, None, EPS, None, ir_ops::Rounding::Exact).unwrap();
    assert_eq!((out.strides(), out.offset()), (&[24, 1][..], 1), "the in-place output carries x's layout");
    assert_eq!(out.to_f64_vec().unwrap(), functional_out.to_f64_vec().unwrap());
}

#[test]
fn priority_with_native_fallback_gives_the_providers_bits() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p", "native"]).unwrap();
    let (x, residual, weight) = inputs(8, 16);
    let direct = common::inplace_fused(
        ir_core::UniqueTensor::new(x.deep_clone().unwrap()).unwrap(),
        ir_core::UniqueTensor::new(residual.deep_clone().unwrap()).unwrap(),
        Some(&weight),
        EPS,
        None,
        ir_ops::Rounding::Exact,
    )
    .unwrap();
    let dispatched =
        fused_add_rms_norm::maybe_inplace(&registry, x, residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact)
            .unwrap();
    assert!(bit_eq(&dispatched.0, &direct.0) && bit_eq(&dispatched.1, &direct.1));
}

#[test]
fn validation_happens_before_any_write() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let (x, _, weight) = inputs(8, 16);
    let wrong_residual = sample(DType::BF16, 8, 15, 4);
    let kept = x.clone();
    let before = x.deep_clone().unwrap();
    let err = fused_add_rms_norm::maybe_inplace(
        &registry,
        x,
        wrong_residual,
        Some(&weight),
        EPS,
        None,
        ir_ops::Rounding::Exact,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "fused_add_rms_norm: `x_residual` has shape [8, 15] but must equal the shape of x (`x` has shape [8, 16])"
    );
    assert!(matches!(err, CallError::Meta(_)));
    assert!(bit_eq(&kept, &before));
}

#[test]
fn an_inplace_provider_is_refused_when_outputs_cannot_live_in_the_activations() {
    // A residual in f32 with x in bf16: residual_out is bf16 and cannot be written into the f32 buffer.
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    // The second call finds the selection remembered, with the check's answer.
    for call in 0..2 {
        let (x, _, _) = inputs(2, 8);
        let residual = sample(DType::F32, 2, 8, 5);
        let err = fused_add_rms_norm::maybe_inplace(&registry, x, residual, None, EPS, None, ir_ops::Rounding::Exact)
            .unwrap_err();
        assert!(matches!(err, CallError::InplaceMetaMismatch { index: 1, .. }), "call {call}: {err}");
    }
}

/// `maybe_inplace` runs every kind of implementation with the same results: an in-place one with
/// its typed function (written in place), one registered dynamically (the bound-argument path,
/// written in place), a functional one (fresh outputs, the donated tensors untouched).
#[test]
fn maybe_inplace_runs_typed_dynamic_and_functional_implementations_alike() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "typed");
    let dynamic = ir_core::ImplFunc::inplace(|args: &mut [ir_core::op::Value]| {
        let take = |value: &mut ir_core::op::Value| match std::mem::replace(value, ir_core::op::Value::None) {
            ir_core::op::Value::Tensor(t) => ir_core::UniqueTensor::new(t)
                .map_err(|_| ir_core::KernelError::InvalidArguments { reason: "an activation is shared".to_owned() }),
            _ => Err(ir_core::KernelError::InvalidArguments { reason: "not a tensor".to_owned() }),
        };
        let (x, residual) = (take(&mut args[0])?, take(&mut args[1])?);
        let weight = args[2].as_tensor();
        let (out, residual) = common::inplace_fused(x, residual, weight, EPS, None, ir_ops::Rounding::Exact)?;
        Ok(vec![out, residual])
    });
    registry.register_impl("fused_add_rms_norm", ir_core::ImplSpec::new("dynamic"), dynamic).unwrap();
    fused_add_rms_norm::register(
        &registry,
        ir_core::ImplSpec::new("functional"),
        fused_add_rms_norm::FusedAddRmsNormImpl::functional(fused_add_rms_norm::native),
    )
    .unwrap();
    let (x, residual, weight) = inputs(4, 16);
    let expected =
        fused_add_rms_norm::native(&x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    for (provider, in_place) in [("typed", true), ("dynamic", true), ("functional", false)] {
        let _first = registry.override_priority("fused_add_rms_norm", &[provider]).unwrap();
        let (dx, dr) = (x.deep_clone().unwrap(), residual.deep_clone().unwrap());
        let storages = (dx.storage_id(), dr.storage_id());
        let (out, res) =
            fused_add_rms_norm::maybe_inplace(&registry, dx, dr, Some(&weight), EPS, None, ir_ops::Rounding::Exact)
                .unwrap();
        assert!(bit_eq(&out, &expected.0) && bit_eq(&res, &expected.1), "{provider}");
        assert_eq!((out.storage_id(), res.storage_id()) == storages, in_place, "{provider}: written in place");
    }
    let record = registry.selection_record();
    for provider in ["typed", "dynamic", "functional"] {
        assert_eq!(record.selections("fused_add_rms_norm", provider), 1, "{provider}");
    }
    assert_eq!(record.op("fused_add_rms_norm").unwrap().inplace_writes, 4, "two activations, twice");
}

/// A donated activation whose layout maps several elements to one address (a broadcast view nothing
/// else refers to) is refused before anything is written, on the typed and the bound-argument paths;
/// the functional call copies it and runs.
#[test]
fn a_broadcast_activation_is_never_written_in_place() {
    let registry = ir_ops::registry();
    register_inplace(&registry, "p");
    let _guard = registry.override_priority("fused_add_rms_norm", &["p"]).unwrap();
    let (_, residual, weight) = inputs(4, 16);
    let broadcast = || {
        let row = sample(DType::BF16, 1, 16, 7);
        let layout = Layout::new(&[4, 16], &[0, 1], 0).unwrap();
        let view = row.as_strided(layout).unwrap();
        drop(row);
        view
    };
    let before = broadcast().to_f64_vec().unwrap();
    let err = fused_add_rms_norm::maybe_inplace(
        &registry,
        broadcast(),
        residual.deep_clone().unwrap(),
        Some(&weight),
        EPS,
        None,
        ir_ops::Rounding::Exact,
    )
    .unwrap_err();
    assert!(matches!(err, CallError::OverlappingActivation { op: "fused_add_rms_norm", index: 0, .. }), "{err}");
    assert!(err.to_string().contains("one address"), "{err}");
    let args = vec![
        ir_core::op::Value::Tensor(residual.deep_clone().unwrap()),
        ir_core::op::Value::Tensor(broadcast()),
        ir_core::op::Value::Tensor(weight.clone()),
        ir_core::op::Value::F64(EPS),
        ir_core::op::Value::None,
        ir_core::op::Value::Str("exact".to_owned()),
    ];
    let err = registry.run(Call::new("fused_add_rms_norm", ir_core::op::Overload::MaybeInplace, args)).unwrap_err();
    assert!(matches!(err, CallError::OverlappingActivation { index: 1, .. }), "{err}");
    // The functional call copies the activations first, so the broadcast is only read.
    let x = broadcast();
    let (out, _) =
        fused_add_rms_norm(&registry, &x, &residual, Some(&weight), EPS, None, ir_ops::Rounding::Exact).unwrap();
    assert_eq!(x.to_f64_vec().unwrap(), before, "the broadcast row is unchanged");
    assert_eq!(out.layout(), &Layout::compact(&[4, 16]));
    let unique = ir_core::UniqueTensor::new(broadcast());
    assert!(unique.is_err(), "no unique handle over a broadcast layout");
}
