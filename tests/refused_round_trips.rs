//! With host round trips refused (`ir_core::storage::refuse_host_round_trips`), whatever would move
//! device tensors through host memory fails with an error naming it, and nothing is counted; allowed
//! again, the same calls run through the host and are counted. Its own test binary: the refusal
//! and the counter are process-wide.

use ir_core::storage::{HOST_ROUND_TRIP_REFUSED, host_round_trips, refuse_host_round_trips};
use ir_core::{CallError, DType, Tensor, TensorError};
use ir_ops::rms_norm;
use kernel_support::KernelDTypes;
use vllm_ir_tests::on_each_device;

#[test]
fn refused_round_trips_fail_naming_what_would_have_made_them() {
    on_each_device("refusals", |backend| {
        let label = backend.provider;
        // f64 activations: only native takes them where the provider's kernels do not compute in
        // f64; where they do, the priorities leave native alone for the op.
        let computes_f64 = backend.dtypes == KernelDTypes::WithF64;
        let _native_only = computes_f64.then(|| backend.registry.override_priority("rms_norm", &["native"]).unwrap());
        let x = backend.upload(&Tensor::from_f64(DType::F64, &[2, 8], &[0.5; 16]).unwrap()).unwrap();
        // Host values to write into device memory with `copy_`: no device path takes them.
        let host = Tensor::from_f64(DType::F32, &[2, 8], &[1.0; 16]).unwrap();
        let bf16 = backend.upload(&Tensor::from_f64(DType::BF16, &[2, 8], &[1.5; 16]).unwrap()).unwrap();
        let mut target = bf16.deep_clone().unwrap();
        refuse_host_round_trips(true);
        let before = host_round_trips();
        let refused = rms_norm::call(&ir_core::EagerContext::new(&backend.registry), &x, None, 1e-6, None);
        let Err(CallError::HostRoundTripRefused { op, rejected }) = refused else {
            panic!("{label}: native on device tensors must be refused, got {refused:?}")
        };
        assert_eq!(op, "rms_norm");
        if !computes_f64 {
            assert!(rejected.contains(label) && rejected.contains("f64"), "{label}: names the rejection: {rejected}");
        }
        // A built-in without a device kernel for the case.
        let Err(TensorError::Device(error)) = target.copy_from(&host) else {
            panic!("{label}: `copy_` from host memory must be refused")
        };
        assert_eq!(error.operation, "copy_");
        assert!(error.to_string().contains(HOST_ROUND_TRIP_REFUSED), "{error}");
        assert_eq!(host_round_trips(), before, "{label}: nothing refused is counted");
        // What runs on the device is not affected.
        assert!(!bf16.scale(3.0).unwrap().device().is_cpu(), "{label}: scale stays on the device");
        assert!(!bf16.add(&bf16).unwrap().device().is_cpu(), "{label}: bf16 add stays on the device");
        refuse_host_round_trips(false);
        let allowed = rms_norm::call(&ir_core::EagerContext::new(&backend.registry), &x, None, 1e-6, None).unwrap();
        let expected = rms_norm::native(&x.to_cpu().unwrap(), None, 1e-6, None).unwrap();
        assert!(ir_core::bit_eq(&allowed, &expected), "{label}: allowed again, native runs");
        target.copy_from(&host).unwrap();
        assert_eq!(host_round_trips(), before + 2, "{label}: the allowed round trips are counted");
    });
}
