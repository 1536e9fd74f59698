//! Work on device tensors stays on the device, on every device backend this machine
//! runs. The toy decoder (`layers::toy`, the demo's model), eager (donated and functional) and
//! compiled by the standard pipeline, with its parameters and activations on the device: the norms,
//! the fused quantizations, the rotary embedding, the activation, and the stand-ins' `contiguous`,
//! `copy_` from fp8, `scale` and `cat` all run there, and the results match the cpu provider's.
//! Every op on arguments whose layouts the device kernels reject (transposed): the provider runs on
//! compact copies made on the device, with the bits of a call on compact arguments, in place where
//! the call is. Its own test binary: the round-trip counter is process-wide, and no test here may
//! make a round trip.

use ir_core::Call;
use ir_core::op::{InputSpec, Overload, Value};
use ir_core::storage::host_round_trips;
use ir_core::{DType, EagerContext, Registry, Tensor, TensorMeta, allclose, bit_eq};
use ir_graph::{InterpOptions, Tracer, interpret};
use ir_ops::BUILTIN_OPS;
use ir_ops::fused_add_rms_norm::FUSED_ADD_RMS_NORM;
use ir_passes::{PassContext, Pipeline, Snapshots};
use layers::toy::{ToyDecoder, ToyDecoderConfig};
use vllm_ir_tests::{Backend, backends, on_each_device};

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
    let cpu_backend = backends().into_iter().next().expect("the cpu backend comes first");
    let host_model = model();
    let ctx = EagerContext::new(&cpu_backend.registry);
    let (x, residual, positions) = activations();
    let (expected, expected_residual) = host_model.forward(&ctx, (x, residual), &positions, false).unwrap();
    on_each_device("the toy decoder", |backend| {
        let allocator = backend.allocator.as_ref().expect("a device backend");
        let label = backend.provider;
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
    });
}

/// `t` uploaded as the transpose of a compact `[.., b, a]` tensor: the same shape and values, the
/// last stride not 1, a layout no device kernel takes as rows.
fn transposed_upload(backend: &Backend, t: &Tensor) -> Tensor {
    let rank = t.shape().len();
    let swapped = t.transpose(rank - 2, rank - 1).unwrap().contiguous().unwrap();
    backend.upload(&swapped).unwrap().transpose(rank - 2, rank - 1).unwrap()
}

#[test]
fn arguments_the_kernels_reject_by_layout_run_on_compact_copies_on_the_device() {
    on_each_device("layouts", |backend| {
        let label = backend.provider;
        // f64 too where the provider's kernels compute in it (an f64 reference on device tensors).
        let mut dtypes = vec![DType::F32, DType::BF16];
        if backend.dtypes == kernel_support::KernelDTypes::WithF64 {
            dtypes.push(DType::F64);
        }
        for def in BUILTIN_OPS {
            for &dtype in &dtypes {
                let spec = InputSpec { num_tokens: 6, hidden_size: 128, dtype, epsilon: 1e-6, seed: 5 };
                let inputs = (def.generate_inputs)(&spec).unwrap();
                let case = format!("{label} {} {dtype}", def.name);
                // Every tensor of rank 2 or more transposed (non-compact), the others uploaded.
                let odd = |values: &[Value]| -> Vec<Value> {
                    values
                        .iter()
                        .map(|v| match v.as_tensor() {
                            Some(t) if t.shape().len() >= 2 => Value::Tensor(transposed_upload(backend, t)),
                            Some(t) => Value::Tensor(backend.upload(t).unwrap()),
                            None => v.clone(),
                        })
                        .collect()
                };
                let compact = |values: &[Value]| -> Vec<Value> {
                    values
                        .iter()
                        .map(|v| match v.as_tensor() {
                            Some(t) => Value::Tensor(backend.upload(t).unwrap()),
                            None => v.clone(),
                        })
                        .collect()
                };
                let args = odd(&inputs);
                let metas: Vec<_> = args.iter().map(Value::meta).collect();
                let selection = backend.registry.select(def.name, &metas).unwrap();
                assert_eq!(selection.provider, label, "{case}: {:?}", selection.rejected);
                assert!(!selection.compacted.is_empty(), "{case}: some argument is made compact");
                let before = host_round_trips();
                let expected = backend.registry.run(Call::new(def.name, Overload::Default, compact(&inputs))).unwrap();
                let got = backend.registry.run(Call::new(def.name, Overload::Default, args)).unwrap();
                let inputs_after = odd(&inputs);
                let donated: Vec<_> =
                    inputs_after.iter().filter_map(Value::as_tensor).map(|t| t.storage_id()).collect();
                let in_place = if def.allow_inplace {
                    let outputs =
                        backend.registry.run(Call::new(def.name, Overload::MaybeInplace, inputs_after)).unwrap();
                    for output in &outputs {
                        assert!(!output.device().is_cpu(), "{case}: on the device");
                    }
                    Some(outputs)
                } else {
                    None
                };
                assert_eq!(host_round_trips(), before, "{case}: device tensors went through host memory");
                assert_eq!(got.len(), expected.len(), "{case}");
                for (index, (got, expected)) in got.iter().zip(&expected).enumerate() {
                    assert!(bit_eq(got, expected), "{case}: output {index} differs from the call on compact arguments");
                }
                if let Some(outputs) = in_place {
                    // The in-place kernel wrote the donated tensors (their own storages, their layouts).
                    let written = outputs.iter().filter(|o| donated.contains(&o.storage_id())).count();
                    assert!(written > 0, "{case}: maybe_inplace writes a donated activation");
                    for (index, (output, expected)) in outputs.iter().zip(&expected).enumerate() {
                        assert!(bit_eq(output, expected), "{case}: maybe_inplace output {index}");
                    }
                }
            }
        }
    });
}

#[test]
fn a_compiled_graph_on_transposed_device_inputs_stays_on_the_device() {
    on_each_device("the compiled graph", |backend| {
        let label = backend.provider;
        let (x, residual, _) = activations();
        let (x_odd, residual_odd) = (transposed_upload(backend, &x), transposed_upload(backend, &residual));
        // x + residual normalized, the sum donated: lowered to the device provider's in-place kernel,
        // which runs on compact copies and writes the results back.
        let tracer = Tracer::new(&backend.registry, "norm");
        let x_in = tracer.input("x", x_odd.meta().clone());
        let residual_in = tracer.input("residual", residual_odd.meta().clone());
        let exact = ir_ops::Rounding::Exact;
        let (out, sum) =
            ir_ops::fused_add_rms_norm::call_maybe_inplace(&tracer, x_in, residual_in, None, 1e-6, None, exact)
                .unwrap();
        let traced = tracer.finish(&[out, sum]);
        let mut graph = traced.graph;
        Pipeline::standard().run(&mut graph, &PassContext::new(&backend.registry), None, Snapshots::Skip).unwrap();
        assert!(graph.to_string().contains(&format!("[{label}]")), "{label}: lowered to the device provider:\n{graph}");
        let before = host_round_trips();
        let inputs = vec![("x".to_owned(), x_odd), ("residual".to_owned(), residual_odd)];
        let run = interpret(&graph, &backend.registry, inputs, InterpOptions::checked()).unwrap();
        assert_eq!(host_round_trips(), before, "{label}: device tensors went through host memory");
        let ctx = EagerContext::new(&backend.registry);
        let (expected, expected_sum) = ir_ops::fused_add_rms_norm::call(
            &ctx,
            &backend.upload(&x).unwrap(),
            &backend.upload(&residual).unwrap(),
            None,
            1e-6,
            None,
            ir_ops::Rounding::Exact,
        )
        .unwrap();
        assert!(bit_eq(&run.outputs[0], &expected) && bit_eq(&run.outputs[1], &expected_sum), "{label}: same bits");
    });
}

/// The norm chains `fuse-row-programs` fuses (Gemma's sandwich, an add + LayerNorm), traced unfused
/// on the device. The standard pipeline fuses the sandwich on CUDA and HIP (its generated kernel
/// reduces as the hand-written norms do) and keeps the other chains apart (an OpenCL kernel
/// reduces by another tree, add + LayerNorm is not proven bit for bit), and the outputs keep their
/// bits. By name the pass fuses both onto the device provider, within tolerance.
#[test]
fn norm_chains_fuse_on_each_device_by_name_and_stay_apart_in_the_exact_form() {
    on_each_device("the fused norm chains", |backend| {
        let label = backend.provider;
        for dtype in [DType::F32, DType::BF16] {
            for hidden in [64usize, 1000] {
                let spec = InputSpec { num_tokens: 3, hidden_size: hidden, dtype, epsilon: 1e-6, seed: 5 };
                let inputs = (FUSED_ADD_RMS_NORM.generate_inputs)(&spec).unwrap();
                let host: Vec<Tensor> = (0..3).map(|i| inputs[i].as_tensor().unwrap().deep_clone().unwrap()).collect();
                let named = || -> Vec<(String, Tensor)> {
                    ["a", "r", "w"]
                        .iter()
                        .zip(&host)
                        .map(|(n, t)| (n.to_string(), backend.upload(t).unwrap()))
                        .collect()
                };
                let given = named();
                let (act, vector) = (given[0].1.meta().to_string(), given[2].1.meta().to_string());
                let text = format!(
                    "graph g(%a: {act}, %r: {act}, %w: {vector}) {{\n\
                       %h = rms_norm(%a, %w, 1e-6, none) : {act}\n\
                       %s = add(%h, %r) : {act}\n\
                       %n = rms_norm(%s, %w, 1e-6, none) : {act}\n\
                       %s2 = add(%n, %s) : {act}\n\
                       %y = layer_norm(%s2, %w, %w, 1e-5) : {act}\n\
                       output(%y, %s2, %n)\n}}\n"
                );
                let graph = ir_graph::parse(&text).unwrap();
                let cx = PassContext::new(&backend.registry);
                let reference = interpret(&graph, &backend.registry, named(), InterpOptions::checked()).unwrap();

                let mut exact = graph.clone();
                let report = Pipeline::standard().run(&mut exact, &cx, None, Snapshots::Skip).unwrap();
                let reports: Vec<String> = report.runs.iter().map(|run| run.report.to_string()).collect();
                let kept = format!("on `{label}` the fused op is within its tolerance of the chain");
                let cuda_or_hip = matches!(label, "cuda" | "emu_cuda" | "rocm" | "emu_hip" | "emu_hip_wave32");
                let fused = if cuda_or_hip { "fused 1 row-program" } else { "fused 0 row-program" };
                assert!(reports.iter().any(|r| r.contains(fused) && r.contains(&kept)), "{label}: {reports:?}");
                assert_eq!(
                    exact.to_string().contains(&format!("fused_sandwich_rms_norm[{label}]")),
                    cuda_or_hip,
                    "{label}: the sandwich fused exactly on CUDA and HIP only:\n{exact}"
                );
                let run = interpret(&exact, &backend.registry, named(), InterpOptions::checked()).unwrap();
                for (i, (got, want)) in run.outputs.iter().zip(&reference.outputs).enumerate() {
                    assert!(bit_eq(got, want), "{label} {dtype} hidden {hidden}: output {i} differs\n{exact}");
                }

                let by_name = Pipeline::from_names(
                    "functionalize,fuse-add-rms-norm-exact,fuse-row-programs,dce,lower,eliminate-clones,dce",
                )
                .unwrap();
                let mut fused = graph.clone();
                by_name.run(&mut fused, &cx, None, Snapshots::Skip).unwrap();
                let printed = fused.to_string();
                assert!(
                    printed.contains(&format!("fused_sandwich_rms_norm[{label}]"))
                        && printed.contains(&format!("fused_add_layer_norm[{label}]")),
                    "{label}: both chains fused onto the device provider:\n{printed}"
                );
                let run = interpret(&fused, &backend.registry, named(), InterpOptions::checked()).unwrap();
                for (i, (got, want)) in run.outputs.iter().zip(&reference.outputs).enumerate() {
                    // Last-bit differences of the norm, grown by the LayerNorm of the sum: ten
                    // steps of the dtype.
                    let t = ir_core::op::global_tolerance(dtype);
                    let close = allclose(got, want, 10.0 * t.atol, 10.0 * t.rtol);
                    assert!(close.is_ok(), "{label} {dtype} hidden {hidden}: output {i}: {close:?}\n{printed}");
                }
            }
        }
    });
}

/// Qwen3's head norms and rotation on each device: the standard pipeline keeps the chain apart
/// (the generated kernel reduces a head otherwise than the device's hand-written norm) and runs it
/// bit for bit; by name the chain becomes one `fused_qk_norm_rope` call on the device provider,
/// within the norm's tolerance.
#[test]
fn head_norms_and_rotation_fuse_on_each_device_by_name_and_stay_apart_in_the_exact_form() {
    use ir_ops::fused_qk_norm_rope::FUSED_QK_NORM_ROPE;
    on_each_device("the head norms and rotation", |backend| {
        let label = backend.provider;
        for dtype in [DType::F32, DType::BF16] {
            // Seed 0: a key, full NeoX rotation, `exact` rounding; heads of 64.
            let spec = InputSpec { num_tokens: 3, hidden_size: 256, dtype, epsilon: 1e-6, seed: 0 };
            let inputs = (FUSED_QK_NORM_ROPE.generate_inputs)(&spec).unwrap();
            let names = ["pos", "q", "k", "wq", "wk", "cache"];
            let host: Vec<Tensor> = (0..6).map(|i| inputs[i].as_tensor().unwrap().deep_clone().unwrap()).collect();
            let named = || -> Vec<(String, Tensor)> {
                names.iter().zip(&host).map(|(n, t)| (n.to_string(), backend.upload(t).unwrap())).collect()
            };
            let given = named();
            let ty = |i: usize| given[i].1.meta().to_string();
            let (Value::I64(head_size), Value::I64(rotary_dim)) = (&inputs[7], &inputs[8]) else { unreachable!() };
            let d = *head_size as usize;
            let heads = |i: usize| given[i].1.shape()[1] / d;
            let compact = |shape: &[usize]| {
                TensorMeta { layout: ir_core::Layout::compact(shape), ..given[1].1.meta().clone() }.to_string()
            };
            let (n, m) = (heads(1), heads(2));
            let text = format!(
                "graph g(%pos: {}, %q: {}, %k: {}, %wq: {}, %wk: {}, %cache: {}) {{\n\
                   %qh = reshape(%q, [3, {n}, {d}]) : {}\n\
                   %qn = rms_norm(%qh, %wq, 1e-6, none) : {}\n\
                   %q2 = reshape(%qn, [3, {}]) : {}\n\
                   %kh = reshape(%k, [3, {m}, {d}]) : {}\n\
                   %kn = rms_norm(%kh, %wk, 1e-6, none) : {}\n\
                   %k2 = reshape(%kn, [3, {}]) : {}\n\
                   %rq, %rk = rotary_embedding(%pos, %q2, %k2, %cache, {d}, {rotary_dim}, true) : {}, {}\n\
                   output(%rq, %rk)\n}}\n",
                ty(0),
                ty(1),
                ty(2),
                ty(3),
                ty(4),
                ty(5),
                compact(&[3, n, d]),
                compact(&[3, n, d]),
                n * d,
                compact(&[3, n * d]),
                compact(&[3, m, d]),
                compact(&[3, m, d]),
                m * d,
                compact(&[3, m * d]),
                compact(&[3, n * d]),
                compact(&[3, m * d]),
            );
            let graph = ir_graph::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            let cx = PassContext::new(&backend.registry);
            let reference = interpret(&graph, &backend.registry, named(), InterpOptions::checked()).unwrap();

            let mut exact = graph.clone();
            let report = Pipeline::standard().run(&mut exact, &cx, None, Snapshots::Skip).unwrap();
            let reports: Vec<String> = report.runs.iter().map(|run| run.report.to_string()).collect();
            assert!(reports.iter().any(|r| r.contains("fused 0 row-program")), "{label}: {reports:?}");
            let run = interpret(&exact, &backend.registry, named(), InterpOptions::checked()).unwrap();
            for (i, (got, want)) in run.outputs.iter().zip(&reference.outputs).enumerate() {
                assert!(bit_eq(got, want), "{label} {dtype}: output {i} differs\n{exact}");
            }

            let by_name =
                Pipeline::from_names("functionalize,fuse-row-programs,dce,lower,eliminate-clones,dce").unwrap();
            let mut fused = graph.clone();
            by_name.run(&mut fused, &cx, None, Snapshots::Skip).unwrap();
            let printed = fused.to_string();
            assert!(printed.contains(&format!("fused_qk_norm_rope[{label}]")), "{label}:\n{printed}");
            let run = interpret(&fused, &backend.registry, named(), InterpOptions::checked()).unwrap();
            let t = ir_core::op::tolerance(&ir_ops::rms_norm::RMS_NORM, dtype).unwrap();
            for (i, (got, want)) in run.outputs.iter().zip(&reference.outputs).enumerate() {
                let close = allclose(got, want, 4.0 * t.atol, 4.0 * t.rtol);
                assert!(close.is_ok(), "{label} {dtype}: output {i}: {close:?}\n{printed}");
            }
        }
    });
}
