//! Kernel throughput, generic over the registry: every op it defines × every provider
//! registered for the op, beside a copy of the op's activation bytes (and candle for the norms, with
//! feature `candle`), on the same data in the same run. A new op or provider is benchmarked by being
//! defined and registered.

// A benchmark reports on standard output.
#![allow(clippy::print_stdout)]

mod common;

use std::collections::BTreeMap;

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use serde::Serialize;
use vllm_ir_bench::kernels::{Case, Inputs, PROVIDERS_ENV, Provider, cpu_cases, gpu_cases, ops, registry, sweep_cases};
use vllm_ir_bench::{BenchError, output};

#[derive(Serialize)]
struct ProviderStatus {
    provider: &'static str,
    available: bool,
    device: Option<String>,
    reason: Option<String>,
    failures: Vec<String>,
    /// Criterion groups whose case the provider's predicate rejects, with the reason.
    rejected: Vec<(String, String)>,
}

fn kernels(c: &mut Criterion) {
    let quick = output::quick();
    let registry = registry().expect("registering the kernel providers");
    let ops = ops(&registry);
    let mut providers: Vec<Provider> = ops.iter().flat_map(|op| Provider::for_op(&registry, op)).collect();
    providers.sort_by_key(|p| {
        vllm_ir_bench::kernels::PROVIDER_ORDER.iter().position(|n| *n == p.name()).unwrap_or(usize::MAX)
    });
    providers.dedup();
    let mut statuses: BTreeMap<&'static str, ProviderStatus> = providers
        .iter()
        .map(|&p| {
            let availability =
                if p.selected() { p.availability(&registry) } else { Err(format!("not in ${PROVIDERS_ENV}")) };
            if let Err(reason) = &availability {
                println!("skipped: {}: {reason}", p.name());
            }
            let status = ProviderStatus {
                provider: p.name(),
                available: availability.is_ok(),
                device: p.device_description(),
                reason: availability.err(),
                failures: Vec::new(),
                rejected: Vec::new(),
            };
            (p.name(), status)
        })
        .collect();
    let runs = |device: bool| providers.iter().any(|p| p.is_device() == device && statuses[p.name()].available);
    let (any_host, any_device) = (runs(false), runs(true));
    let host = if any_host { cpu_cases(&ops, quick) } else { Vec::new() };
    let device = if any_device { gpu_cases(&ops, quick) } else { Vec::new() };
    let mut all = host.clone();
    all.extend(device.iter().filter(|c| !host.contains(c)));

    // Criterion filters benchmark ids after setup; skip the setup (inputs, native, uploads) of cases
    // the filter excludes, so a filtered run times only what it names.
    let filter = output::filter(std::env::args());
    let mut run = |group_name: String, case: Case, device_case: bool, host_case: bool, sweep: bool| {
        let providers = Provider::for_op(&registry, case.op);
        if let Some(filter) = &filter
            && !providers.iter().any(|p| filter.is_match(&format!("{group_name}/{}", p.name())))
        {
            return;
        }
        let inputs = Inputs::generate(case, 0).expect("generating inputs and native's outputs");
        let mut group = c.benchmark_group(&group_name);
        if inputs.activation_bytes() >= 1 << 20 {
            group.sampling_mode(SamplingMode::Flat).sample_size(10);
        }
        for provider in providers {
            let wanted = if provider.is_device() { device_case } else { host_case };
            // The reference is slow: quick runs and the sweep time it only at decode sizes (the
            // cpu target compares with it at 1×4096).
            let skip_native = provider.name() == "native" && !case.shape.is_decode() && (quick || sweep);
            let status = statuses.get_mut(provider.name()).expect("every provider has a status");
            if !wanted || skip_native || !status.available {
                continue;
            }
            let mut timed = match provider.prepare(&registry, &inputs) {
                Ok(timed) => timed,
                Err(BenchError::Rejected { reason, .. }) => {
                    println!("rejected: {} {case}: {reason}", provider.name());
                    status.rejected.push((group_name.clone(), reason));
                    continue;
                }
                Err(e) => {
                    println!("failed: {e}");
                    status.failures.push(e.to_string());
                    continue;
                }
            };
            group.throughput(Throughput::Bytes(timed.bytes_per_call()));
            group.bench_function(provider.name(), |b| {
                b.iter_custom(|iters| timed.time(iters).unwrap_or_else(|e| panic!("{}: {e}", provider.name())))
            });
        }
        group.finish();
    };
    for case in all {
        run(case.group(), case, device.contains(&case), host.contains(&case), false);
    }
    for case in sweep_cases(&ops, quick) {
        run(case.sweep_group(), case, any_device, any_host, true);
    }
    let statuses: Vec<ProviderStatus> = statuses.into_values().collect();
    match output::write_json("providers.json", &statuses) {
        Ok(path) => println!("wrote {}", path.display()),
        Err(e) => println!("warning: {e}"),
    }
}

fn config() -> Criterion {
    common::criterion((0.3, 1.0), (1.0, 3.0), Some(20))
}

criterion_group! { name = benches; config = config(); targets = kernels }
criterion_main!(benches);
