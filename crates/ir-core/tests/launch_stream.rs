//! A stream given to the execution context reaches the provider for the call, and only then.

use std::sync::{Arc, Mutex};

use ir_core::{DType, EagerContext, ImplSpec, Tensor};
use ir_ops::rms_norm;

#[derive(Clone, Debug, PartialEq)]
struct EngineStream(u32);

#[test]
fn the_contexts_stream_reaches_the_provider_during_the_call() {
    let registry = ir_ops::registry();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    rms_norm::register(&registry, ImplSpec::new("streamed"), move |x, w, eps, v| {
        log.lock().unwrap().push(ir_core::stream::launch_stream::<EngineStream>());
        rms_norm::native(x, w, eps, v)
    })
    .unwrap();
    let _guard = registry.override_priority("rms_norm", &["streamed"]).unwrap();
    let x = Tensor::ones(DType::F32, &[2, 8]).unwrap();

    let ctx = EagerContext::new(&registry).with_stream(EngineStream(3));
    rms_norm::call(&ctx, &x, None, 1e-6, None).unwrap();
    rms_norm::call(&EagerContext::new(&registry), &x, None, 1e-6, None).unwrap();
    rms_norm::rms_norm(&registry, &x, None, 1e-6, None).unwrap();
    assert_eq!(*seen.lock().unwrap(), [Some(EngineStream(3)), None, None]);
    assert_eq!(ir_core::stream::launch_stream::<EngineStream>(), None, "nothing left behind");
}
