//! Eager dispatch overhead: `rms_norm` through the registry (metadata, meta function,
//! predicates, selection, record) against the selected kernel called directly, at decode sizes with
//! the CPU platform's two-entry list `[cpu, native]`; and selection alone.

// A benchmark reports on standard output.
#![allow(clippy::print_stdout)]

mod common;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use ir_core::op::ArgMeta;
use ir_core::{Platform, PriorityConfig, Registry, UniqueTensor};
use ir_ops::fused_add_rms_norm;
use ir_ops::fused_add_rms_norm::FUSED_ADD_RMS_NORM;
use ir_ops::rms_norm::RMS_NORM;
use ir_ops::rms_norm::rms_norm;
use vllm_ir_bench::kernels::{Case, EPSILON, Inputs, Shape};
use vllm_ir_bench::output;

fn registry() -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).expect("registering the cpu provider");
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).expect("the cpu platform's priorities");
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["cpu", "native"]), "a two-entry list");
    registry
}

fn dispatch(c: &mut Criterion) {
    let registry = registry();
    let shapes =
        if output::quick() { vec![Shape::new(1, 4096)] } else { vec![Shape::new(1, 4096), Shape::new(16, 4096)] };
    for shape in shapes {
        let case = Case { op: &RMS_NORM, shape, dtype: ir_core::DType::BF16 };
        let inputs = Inputs::generate(case, 0).expect("inputs");
        let (x, w) = (inputs.tensor(0), Some(inputs.tensor(1)));
        let direct = kernels_cpu::rms_norm_cpu(x, w, EPSILON, None).expect("direct call");
        let dispatched = rms_norm(&registry, x, w, EPSILON, None).expect("registry call");
        assert!(ir_core::bit_eq(&direct, &dispatched), "the registry chose the cpu kernel");

        let mut group = c.benchmark_group(format!("dispatch/rms_norm/{shape}"));
        group.bench_function("direct", |b| b.iter(|| kernels_cpu::rms_norm_cpu(x, w, EPSILON, None).unwrap()));
        group.bench_function("registry", |b| b.iter(|| rms_norm(&registry, x, w, EPSILON, None).unwrap()));
        group.finish();

        let group = format!("dispatch/fused_add_rms_norm_maybe_inplace/{shape}");
        bench_maybe_inplace(c, &group, &registry, shape, kernels_cpu::fused_add_rms_norm_cpu);
    }

    // The overhead alone: a provider whose kernel returns a prepared output (no work), called through
    // the registry and directly.
    let overhead_registry = self::registry();
    let case = Case { op: &RMS_NORM, shape: Shape::new(1, 4096), dtype: ir_core::DType::BF16 };
    let inputs = Inputs::generate(case, 0).expect("inputs");
    let (x, w) = (inputs.tensor(0), Some(inputs.tensor(1)));
    let prepared = kernels_cpu::rms_norm_cpu(x, w, EPSILON, None).expect("direct call");
    let noop = {
        let prepared = prepared.clone();
        move |_x: &ir_core::Tensor, _w: Option<&ir_core::Tensor>, _eps: f64, _v: Option<i64>| Ok(prepared.clone())
    };
    let spec = ir_core::ImplSpec::new("noop")
        .with_supports(|args| kernel_support::rms_norm_support(args, ir_core::DeviceKind::Cpu));
    ir_ops::rms_norm::register(&overhead_registry, spec, noop.clone()).expect("registering noop");
    let _noop_first = overhead_registry.override_priority("rms_norm", &["noop"]).expect("noop first");
    let through = rms_norm(&overhead_registry, x, w, EPSILON, None).expect("registry call");
    assert!(ir_core::shares_storage(&through, &prepared), "the registry chose the noop kernel");
    let mut group = c.benchmark_group("dispatch/overhead/rms_norm/1x4096");
    group.bench_function("direct", |b| b.iter(|| noop(x, w, EPSILON, None).unwrap()));
    group.bench_function("registry", |b| b.iter(|| rms_norm(&overhead_registry, x, w, EPSILON, None).unwrap()));
    group.finish();

    // The same for `maybe_inplace` with an in-place provider whose kernel returns its donated
    // activations as they are.
    let noop_inplace = |x: UniqueTensor,
                        r: UniqueTensor,
                        _w: Option<&ir_core::Tensor>,
                        _: f64,
                        _: Option<i64>,
                        _: ir_ops::Rounding| { Ok((x.into_tensor(), r.into_tensor())) };
    let spec = ir_core::ImplSpec::new("noop")
        .with_supports(|args| kernel_support::fused_add_rms_norm_support(args, ir_core::DeviceKind::Cpu));
    ir_ops::fused_add_rms_norm::register(
        &overhead_registry,
        spec,
        ir_ops::fused_add_rms_norm::FusedAddRmsNormImpl::inplace(noop_inplace),
    )
    .expect("registering noop");
    let _noop_fused_first = overhead_registry.override_priority("fused_add_rms_norm", &["noop"]).expect("noop first");
    let group = "dispatch/overhead/fused_add_rms_norm_maybe_inplace/1x4096";
    bench_maybe_inplace(c, group, &overhead_registry, Shape::new(1, 4096), noop_inplace);

    let x = ir_core::TensorMeta::compact(ir_core::DType::BF16, &[1, 4096]);
    let w = ir_core::TensorMeta::compact(ir_core::DType::BF16, &[4096]);
    let metas = [ArgMeta::Tensor(&x), ArgMeta::Tensor(&w), ArgMeta::F64(EPSILON), ArgMeta::None];
    assert_eq!(registry.select("rms_norm", &metas).expect("selection").provider, "cpu");
    let mut group = c.benchmark_group("dispatch/select");
    group.bench_function("rms_norm", |b| b.iter(|| registry.select("rms_norm", &metas).unwrap()));
    group.finish();
}

/// `fused_add_rms_norm_maybe_inplace` through `registry` against `kernel` called directly, on
/// fresh donated activations each call (made outside the timed region); checks first that the
/// registry's call ran in place.
fn bench_maybe_inplace(
    c: &mut Criterion,
    group: &str,
    registry: &Registry,
    shape: Shape,
    kernel: impl Fn(
        UniqueTensor,
        UniqueTensor,
        Option<&ir_core::Tensor>,
        f64,
        Option<i64>,
        ir_ops::Rounding,
    ) -> Result<(ir_core::Tensor, ir_core::Tensor), ir_core::KernelError>,
) {
    let case = Case { op: &FUSED_ADD_RMS_NORM, shape, dtype: ir_core::DType::BF16 };
    let inputs = Inputs::generate(case, 0).expect("inputs");
    let weight = inputs.tensor(2);
    let fresh = || (inputs.tensor(0).deep_clone().unwrap(), inputs.tensor(1).deep_clone().unwrap());
    let (x, r) = fresh();
    let storages = (x.storage_id(), r.storage_id());
    let (out, residual) =
        fused_add_rms_norm::maybe_inplace(registry, x, r, Some(weight), EPSILON, None, ir_ops::Rounding::Exact)
            .expect("call");
    assert_eq!((out.storage_id(), residual.storage_id()), storages, "the registry's call ran in place");
    let mut group = c.benchmark_group(group);
    group.bench_function("direct", |b| {
        b.iter_batched(
            fresh,
            |(x, r)| {
                let (x, r) = (UniqueTensor::new(x).unwrap(), UniqueTensor::new(r).unwrap());
                kernel(x, r, Some(weight), EPSILON, None, ir_ops::Rounding::Exact).unwrap()
            },
            BatchSize::SmallInput,
        )
    });
    group.bench_function("registry", |b| {
        b.iter_batched(
            fresh,
            |(x, r)| {
                fused_add_rms_norm::maybe_inplace(registry, x, r, Some(weight), EPSILON, None, ir_ops::Rounding::Exact)
                    .unwrap()
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

fn config() -> Criterion {
    common::criterion((0.3, 1.0), (1.0, 3.0), None)
}

criterion_group! { name = benches; config = config(); targets = dispatch }
criterion_main!(benches);
