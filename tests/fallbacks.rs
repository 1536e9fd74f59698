//! No silent slow path: the cpu provider takes the weights a real checkpoint brings (Gemma's f32
//! weight on bf16 activations), `RmsNorm`'s default weight takes every activation dtype, a call
//! that falls past the listed providers to `native` is counted, said once at WARN level and refused
//! by a strict registry, and an engine can attribute one step's selections to that step.

use std::sync::{Arc, Mutex};

use ir_core::{CallError, DType, EagerContext, Platform, PriorityConfig, Registry, Tensor, TensorMeta, bit_eq};
use ir_ops::rms_norm::rms_norm;
use ir_ops::silu_and_mul::silu_and_mul;
use layers::RmsNorm;

fn cpu_registry() -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).unwrap();
    registry
}

/// Rows whose sum `x + r` is one dyadic value `c` per row (different per row), so the mean square
/// and `rstd` are the same bits on every path (the sum of squares is exact): the outputs then
/// differ only if the weight step rounds differently from native (y rounded to the weight's dtype,
/// the product rounded to it, the store rounded to x's).
fn rows_of_one_sum(dtype: DType, tokens: usize, hidden: usize) -> (Tensor, Tensor) {
    let sums = [0.75, 1.25, 3.0, 0.375, 1.5];
    let mut x = Vec::with_capacity(tokens * hidden);
    let mut r = Vec::with_capacity(tokens * hidden);
    for row in 0..tokens {
        let c: f64 = sums[row % sums.len()];
        for j in 0..hidden {
            let part = ((row * 31 + j * 17) % 129) as f64 / 64.0 - 1.0;
            x.push(c - part);
            r.push(part);
        }
    }
    let x = Tensor::from_f64(dtype, &[tokens, hidden], &x).unwrap();
    let r = Tensor::from_f64(dtype, &[tokens, hidden], &r).unwrap();
    (x, r)
}

#[test]
fn gemma_style_weights_run_on_the_cpu_provider_with_natives_bits() {
    let registry = cpu_registry();
    let (tokens, hidden) = (5, 320);
    for (x_dtype, w_dtype) in
        [(DType::BF16, DType::F32), (DType::F16, DType::F32), (DType::F32, DType::BF16), (DType::BF16, DType::F16)]
    {
        let label = format!("x={x_dtype} w={w_dtype}");
        let (x, residual) = rows_of_one_sum(x_dtype, tokens, hidden);
        let w = Tensor::randn(&TensorMeta::compact(w_dtype, &[hidden]), 3).unwrap();
        let before = registry.selection_record();
        // rms_norm of the sum itself (x + r computed once, exactly).
        let sum =
            ir_ops::fused_add_rms_norm::native(&x, &residual, None, 0.0, None, ir_ops::Rounding::Exact).unwrap().1;
        let got = rms_norm(&registry, &sum, Some(&w), 0.0, None).unwrap();
        let expected = ir_ops::rms_norm::native(&sum, Some(&w), 0.0, None).unwrap();
        assert!(bit_eq(&got, &expected), "rms_norm {label}");
        let (out, res) = ir_ops::fused_add_rms_norm::fused_add_rms_norm(
            &registry,
            &x,
            &residual,
            Some(&w),
            0.0,
            None,
            ir_ops::Rounding::Exact,
        )
        .unwrap();
        let (expected_out, expected_res) =
            ir_ops::fused_add_rms_norm::native(&x, &residual, Some(&w), 0.0, None, ir_ops::Rounding::Exact).unwrap();
        assert!(bit_eq(&out, &expected_out) && bit_eq(&res, &expected_res), "fused {label}");
        // Random rows too, within the op's tolerance (the sum of squares may differ in its last bit).
        let x = Tensor::randn(&TensorMeta::compact(x_dtype, &[tokens, hidden]), 4).unwrap();
        let got = rms_norm(&registry, &x, Some(&w), 1e-6, None).unwrap();
        let expected = ir_ops::rms_norm::native(&x, Some(&w), 1e-6, None).unwrap();
        ir_core::allclose(&got, &expected, 2e-2, 2e-2).unwrap_or_else(|e| panic!("{label}: {e}"));
        let step = registry.selection_record().since(&before);
        assert_eq!(step.selections("rms_norm", "cpu"), 2, "{label}");
        assert_eq!(step.selections("fused_add_rms_norm", "cpu"), 1, "{label}");
        assert_eq!(step.native_fallbacks(), 0, "{label}");
    }
}

#[test]
fn the_default_norm_weight_takes_the_activations_dtype() {
    let registry = cpu_registry();
    let ctx = EagerContext::new(&registry);
    let norm = RmsNorm::builder(64).build().unwrap();
    assert!(norm.has_weight() && norm.weight().is_none(), "ones of each call's dtype");
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = Tensor::randn(&TensorMeta::compact(dtype, &[3, 64]), 4).unwrap();
        let before = registry.selection_record();
        let got = norm.forward(&ctx, &x).unwrap();
        let ones = Tensor::ones(dtype, &[64]).unwrap();
        assert!(bit_eq(&got, &kernels_cpu::rms_norm_cpu(&x, Some(&ones), 1e-6, None).unwrap()), "{dtype}");
        let step = registry.selection_record().since(&before);
        assert_eq!((step.selections("rms_norm", "cpu"), step.native_fallbacks()), (1, 0), "{dtype}");
    }
}

/// Collects WARN events of `ir_core::dispatch` (a minimal subscriber for this thread).
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl tracing::Subscriber for Warnings {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Message<'a>(&'a mut String);
        impl tracing::field::Visit for Message<'_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    *self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = String::new();
        event.record(&mut Message(&mut message));
        self.0.lock().unwrap().push(message);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Runs in a child process of its own: `tracing` caches whether a call site is wanted once per
/// process, from the thread that first reaches it, so a sibling test with no subscriber that reaches
/// the warning first would leave this test's scoped subscriber blind.
#[test]
fn a_fallback_is_counted_warned_once_per_reason_and_refused_when_strict() {
    if std::env::var_os("VLLM_IR_TEST_WARNINGS_CHILD").is_none() {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_fallback_is_counted_warned_once_per_reason_and_refused_when_strict", "--nocapture"])
            .env("VLLM_IR_TEST_WARNINGS_CHILD", "1")
            .env_remove("VLLM_IR_STRICT")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success() && text.contains("1 passed"), "the child failed:\n{text}\n{stderr}");
        return;
    }
    let registry = cpu_registry();
    // f64 activations: the cpu provider rejects them, native runs.
    let x = Tensor::randn(&TensorMeta::compact(DType::F64, &[2, 16]), 5).unwrap();
    let warnings = Warnings::default();
    let before = registry.selection_record();
    tracing::subscriber::with_default(warnings.clone(), || {
        for _ in 0..3 {
            silu_and_mul(&registry, &x).unwrap();
        }
        // Another reason is said once too.
        let other = Tensor::randn(&TensorMeta::compact(DType::F64, &[2, 8]), 6).unwrap();
        silu_and_mul(&registry, &other).unwrap();
    });
    let step = registry.selection_record().since(&before);
    assert_eq!(step.op("silu_and_mul").unwrap().native_fallbacks, 4, "every call counted");
    assert_eq!(step.selections("silu_and_mul", "native"), 4);
    let table = step.to_string();
    let row = table.lines().find(|l| l.starts_with("silu_and_mul")).unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("native x4") && row.trim_end().ends_with('4'), "the table's fallbacks column: {table}");
    assert_eq!(table.lines().count(), 2, "only the ops that ran: {table}");
    let said = warnings.0.lock().unwrap().clone();
    let fallbacks: Vec<_> = said.iter().filter(|m| m.contains("native runs instead")).collect();
    assert_eq!(fallbacks.len(), 1, "one reason, said once: {said:?}");
    assert!(fallbacks[0].contains("cpu:") && fallbacks[0].contains("f64"), "names the provider and reason: {said:?}");
    assert!(fallbacks[0].contains("VLLM_IR_STRICT"), "names the switch: {said:?}");

    registry.set_strict(true);
    assert!(registry.is_strict());
    // The remembered selection is refused too, and nothing runs.
    let err = silu_and_mul(&registry, &x).unwrap_err();
    assert!(matches!(err, CallError::NativeFallback { op: "silu_and_mul", .. }), "{err}");
    assert!(err.to_string().contains("cpu:"), "{err}");
    assert_eq!(registry.selection_record().since(&before).selections("silu_and_mul", "native"), 4);
    // What a provider takes still runs; native chosen knowingly is no fallback.
    silu_and_mul(&registry, &Tensor::ones(DType::F32, &[2, 16]).unwrap()).unwrap();
    let _native = registry.override_priority("silu_and_mul", &["native"]).unwrap();
    silu_and_mul(&registry, &x).unwrap();
    registry.set_strict(false);
}

#[test]
fn strict_registries_from_the_environment() {
    // The variable is read when a registry is created: checked in a child process, so other tests'
    // registries never see it.
    if std::env::var_os("VLLM_IR_TEST_STRICT_CHILD").is_some() {
        let registry = cpu_registry();
        assert!(registry.is_strict(), "VLLM_IR_STRICT=1 makes new registries strict");
        let x = Tensor::ones(DType::F64, &[2, 16]).unwrap();
        assert!(matches!(silu_and_mul(&registry, &x), Err(CallError::NativeFallback { .. })));
        return;
    }
    assert!(!cpu_registry().is_strict() || std::env::var("VLLM_IR_STRICT").is_ok_and(|v| v == "1"));
    let exe = std::env::current_exe().unwrap();
    let output = std::process::Command::new(exe)
        .args(["--exact", "strict_registries_from_the_environment", "--nocapture"])
        .env("VLLM_IR_TEST_STRICT_CHILD", "1")
        .env("VLLM_IR_STRICT", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "child failed:\n{text}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(text.contains("1 passed"), "the child ran the test:\n{text}");
}

/// A call that falls to `native` because every provider listed before it is unavailable here (no
/// device) is a fallback too: counted and said, and refused by a strict registry.
#[test]
fn falling_past_unavailable_providers_is_a_fallback() {
    let registry = ir_ops::registry();
    let absent = ir_core::ImplSpec::new("absent_gpu")
        .with_probe(|| ir_core::Availability::Unavailable("no device in this test".to_owned()));
    ir_ops::silu_and_mul::register(&registry, absent, ir_ops::silu_and_mul::native).unwrap();
    registry.set_default("silu_and_mul", &["absent_gpu", "native"]).unwrap();
    assert_eq!(registry.installed_priority("silu_and_mul").unwrap(), ["native"], "the reachable providers");
    let x = Tensor::ones(DType::F32, &[2, 16]).unwrap();
    silu_and_mul(&registry, &x).unwrap();
    silu_and_mul(&registry, &x).unwrap();
    let record = registry.selection_record();
    assert_eq!(record.op("silu_and_mul").unwrap().native_fallbacks, 2, "counted:\n{record}");
    registry.set_strict(true);
    let err = silu_and_mul(&registry, &x).unwrap_err();
    assert!(matches!(err, CallError::NativeFallback { op: "silu_and_mul", .. }), "{err}");
    assert!(err.to_string().contains("absent_gpu: unavailable: no device in this test"), "{err}");
    // Native chosen knowingly is no fallback.
    let _native = registry.override_priority("silu_and_mul", &["native"]).unwrap();
    silu_and_mul(&registry, &x).unwrap();
}

/// Lowering a call to `native` past the providers listed before it is a fallback: counted and said
/// by a lenient registry, refused by a strict one (the pass fails naming the node and the reason).
#[test]
fn lowering_to_a_fallback_is_a_fallback() {
    let text = "graph g(%x: f64[2,16]) {
        %0 = silu_and_mul(%x) : f64[2,8]
        output(%0)
    }";
    let registry = cpu_registry();
    let mut graph = ir_graph::parse(text).unwrap();
    let report = ir_passes::Pipeline::standard()
        .run(&mut graph, &ir_passes::PassContext::new(&registry), None, ir_passes::Snapshots::Skip)
        .unwrap();
    assert!(graph.to_string().contains("impl silu_and_mul[native]"), "{report:?}\n{graph}");
    assert_eq!(registry.selection_record().op("silu_and_mul").unwrap().native_fallbacks, 1, "counted once");

    registry.set_strict(true);
    let mut graph = ir_graph::parse(text).unwrap();
    let err = ir_passes::Pipeline::standard()
        .run(&mut graph, &ir_passes::PassContext::new(&registry), None, ir_passes::Snapshots::Skip)
        .unwrap_err();
    let message = err.to_string();
    assert!(message.contains("silu_and_mul") && message.contains("cpu:"), "{message}");
    assert!(message.contains("strict"), "{message}");
    // What the cpu provider takes still lowers under strict.
    let mut graph = ir_graph::parse(&text.replace("f64", "f32")).unwrap();
    ir_passes::Pipeline::standard()
        .run(&mut graph, &ir_passes::PassContext::new(&registry), None, ir_passes::Snapshots::Skip)
        .unwrap();
    assert!(graph.to_string().contains("impl silu_and_mul[cpu]"), "{graph}");
}

/// `VLLM_IR_STRICT` takes the usual boolean spellings and refuses anything else with an error naming
/// the variable (checked in child processes, so other tests' registries never see it).
#[test]
fn strict_takes_boolean_spellings_and_refuses_the_rest() {
    if let Some(expected) = std::env::var_os("VLLM_IR_TEST_STRICT_SPELLING") {
        let parsed = ir_core::strict_from_env();
        let shown = match &parsed {
            Ok(strict) => format!("ok {strict}"),
            Err(error) => format!("error {error}"),
        };
        assert!(shown.starts_with(expected.to_str().unwrap()), "{shown}");
        if let Err(error) = parsed {
            assert!(error.to_string().contains("VLLM_IR_STRICT"), "{error}");
            assert!(cpu_registry().is_strict(), "a registry made anyway is strict");
            assert!(vllm_ir_registry_refuses(), "the facade refuses the value");
        }
        return;
    }
    let cases = [
        ("1", "ok true"),
        ("true", "ok true"),
        ("YES", "ok true"),
        ("on", "ok true"),
        (" 1", "ok true"),
        ("0", "ok false"),
        ("off", "ok false"),
        ("", "ok false"),
        ("2", "error"),
        ("maybe", "error"),
    ];
    for (value, expected) in cases {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "strict_takes_boolean_spellings_and_refuses_the_rest", "--nocapture"])
            .env("VLLM_IR_TEST_STRICT_SPELLING", expected)
            .env("VLLM_IR_STRICT", value)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success() && text.contains("1 passed"), "{value:?}:\n{text}\n{stderr}");
    }
}

fn vllm_ir_registry_refuses() -> bool {
    vllm_ir::registry_with(PriorityConfig::platform_default(Platform::Cpu))
        .is_err_and(|error| error.to_string().contains("VLLM_IR_STRICT"))
}
