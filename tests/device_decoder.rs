//! The toy decoder (`layers::toy`, the demo's model) on every device backend this machine runs:
//! eager (donated and functional) and compiled by the standard pipeline, with its parameters and
//! activations on the device. No step moves device tensors through host memory (issue 14 item 4:
//! the norms, the fused quantizations, the rotary embedding, the activation, and the stand-ins'
//! `contiguous`, `copy_` from fp8, `scale` and `cat` all run on the device), and the results match
//! the cpu provider's. Its own test binary: the round-trip counter is process-wide.

use ir_core::op::InputSpec;
use ir_core::op::fused_add_rms_norm::FUSED_ADD_RMS_NORM;
use ir_core::storage::host_round_trips;
use ir_core::{DType, EagerContext, Platform, PriorityConfig, Registry, Tensor, TensorMeta, allclose, bit_eq};
use ir_graph::{InterpOptions, Tracer, interpret};
use ir_passes::{PassContext, Pipeline, Snapshots};
use layers::toy::{ToyDecoder, ToyDecoderConfig};
use vllm_ir_tests::backends;

const TOKENS: usize = 5;
const HIDDEN: usize = 256;

fn model() -> ToyDecoder {
    let config = ToyDecoderConfig { layers: 2, hidden: HIDDEN, max_position: 64, dtype: DType::BF16, seed: 7 };
    ToyDecoder::new(config).unwrap()
}

/// Host activations `(x, residual, positions)`.
fn activations() -> (Tensor, Tensor, Tensor) {
    let spec = InputSpec { num_tokens: TOKENS, hidden_size: HIDDEN, dtype: DType::BF16, epsilon: 1e-6, seed: 11 };
    let inputs = (FUSED_ADD_RMS_NORM.generate_inputs)(&spec).unwrap();
    let positions = Tensor::from_vec(&[TOKENS], vec![0i64, 3, 9, 27, 63]).unwrap();
    (
        inputs[0].as_tensor().unwrap().deep_clone().unwrap(),
        inputs[1].as_tensor().unwrap().deep_clone().unwrap(),
        positions,
    )
}

/// The model traced (donating when `donate`) and compiled by the standard pipeline, run by the
/// checked interpreter on `inputs` (x, residual, positions).
fn compiled(
    registry: &Registry,
    model: &ToyDecoder,
    inputs: (Tensor, Tensor, Tensor),
    donate: bool,
) -> (Tensor, Tensor) {
    let tracer = Tracer::new(registry, "decoder");
    let device = inputs.0.device();
    let meta = TensorMeta { device, ..TensorMeta::compact(DType::BF16, &[TOKENS, HIDDEN]) };
    let x = tracer.input("x", meta.clone());
    let residual = tracer.input("residual", meta);
    let positions = tracer.input("positions", TensorMeta { device, ..TensorMeta::compact(DType::I64, &[TOKENS]) });
    let (out, new_residual) = model.forward(&tracer, (x, residual), &positions, donate).unwrap();
    let traced = tracer.finish(&[out, new_residual]);
    let mut graph = traced.graph;
    Pipeline::standard().run(&mut graph, &PassContext::new(registry), None, Snapshots::Skip).unwrap();
    let mut named =
        vec![("x".to_owned(), inputs.0), ("residual".to_owned(), inputs.1), ("positions".to_owned(), inputs.2)];
    named.extend(traced.parameters.iter().map(|(name, t)| (name.clone(), t.clone())));
    let run = interpret(&graph, registry, named, InterpOptions::checked()).unwrap();
    let mut outputs = run.outputs.into_iter();
    (outputs.next().unwrap(), outputs.next().unwrap())
}

#[test]
fn the_toy_decoder_stays_on_the_device_and_matches_the_cpu() {
    let mut ran = 0;
    let cpu_backend = backends().into_iter().next().expect("the cpu backend comes first");
    let host_model = model();
    let ctx = EagerContext::new(&cpu_backend.registry);
    let (x, residual, positions) = activations();
    let (expected, expected_residual) = host_model.forward(&ctx, (x, residual), &positions, false).unwrap();
    for backend in backends() {
        let Some(allocator) = &backend.allocator else { continue };
        let label = backend.provider;
        // The priorities an engine on this platform gets: its provider first, then native.
        let platform = Platform::ALL.into_iter().find(|p| p.provider() == label).expect("a device platform");
        let _priorities = PriorityConfig::platform_default(platform).apply_scoped(&backend.registry).unwrap();
        let mut device_model = model();
        device_model.to_device(allocator.as_ref()).unwrap();
        let upload = || {
            let (x, residual, positions) = activations();
            (backend.upload(&x).unwrap(), backend.upload(&residual).unwrap(), backend.upload(&positions).unwrap())
        };
        let before = host_round_trips();
        let ctx = EagerContext::new(&backend.registry);
        let (x, residual, positions) = upload();
        let functional = device_model.forward(&ctx, (x, residual), &positions, false).unwrap();
        let (x, residual, positions) = upload();
        let donated = device_model.forward(&ctx, (x, residual), &positions, true).unwrap();
        let compiled_donated = compiled(&backend.registry, &device_model, upload(), true);
        let compiled_functional = compiled(&backend.registry, &device_model, upload(), false);
        assert_eq!(host_round_trips(), before, "{label}: device tensors went through host memory");
        for (name, run) in
            [("donated", &donated), ("compiled", &compiled_donated), ("compiled functional", &compiled_functional)]
        {
            assert!(!run.0.device().is_cpu() && !run.1.device().is_cpu(), "{label} {name}: results on the device");
            assert!(
                bit_eq(&run.0, &functional.0) && bit_eq(&run.1, &functional.1),
                "{label} {name}: same bits as eager functional"
            );
        }
        // Another provider's kernels round differently inside the row reductions; fp8 then moves
        // a value by at most one step of its grid (1/8 relative), which the next norm carries.
        allclose(&functional.1.to_cpu().unwrap(), &expected_residual, 0.25, 0.125)
            .unwrap_or_else(|e| panic!("{label} residual vs cpu: {e}"));
        allclose(&functional.0.to_cpu().unwrap(), &expected, 0.25, 0.125)
            .unwrap_or_else(|e| panic!("{label} output vs cpu: {e}"));
        ran += 1;
    }
    if ran == 0 {
        ir_core::testing::skip("device", "no device backend on this machine: the toy decoder ran on the cpu only");
    }
}
