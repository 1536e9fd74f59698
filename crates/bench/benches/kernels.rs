//! Kernel throughput (R95–R97): every available provider of both norm ops beside a copy of the same
//! activation bytes (and candle with feature `candle`), on the same data in the same run.

// A benchmark reports on standard output.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use serde::Serialize;
use vllm_ir_bench::kernels::{Case, Inputs, PROVIDERS_ENV, Provider, cpu_cases, gpu_cases, sweep_cases};
use vllm_ir_bench::output;

#[derive(Serialize)]
struct ProviderStatus {
    provider: &'static str,
    available: bool,
    device: Option<String>,
    reason: Option<String>,
    failures: Vec<String>,
}

fn kernels(c: &mut Criterion) {
    let quick = output::quick();
    let mut statuses: Vec<ProviderStatus> = Provider::ALL
        .iter()
        .map(|&p| {
            let availability = if p.selected() { p.availability() } else { Err(format!("not in ${PROVIDERS_ENV}")) };
            if let Err(reason) = &availability {
                println!("skipped: {}: {reason}", p.name());
            }
            ProviderStatus {
                provider: p.name(),
                available: availability.is_ok(),
                device: p.device_description(),
                reason: availability.err(),
                failures: Vec::new(),
            }
        })
        .collect();
    let any_host = statuses.iter().zip(Provider::ALL).any(|(s, p)| s.available && !p.is_device());
    let any_device = statuses.iter().zip(Provider::ALL).any(|(s, p)| s.available && p.is_device());
    let host = if any_host { cpu_cases(quick) } else { Vec::new() };
    let device = if any_device { gpu_cases(quick) } else { Vec::new() };
    let mut all = host.clone();
    all.extend(device.iter().filter(|c| !host.contains(c)));

    let mut run = |group: String, case: Case, device_case: bool, host_case: bool, sweep: bool| {
        let inputs = Inputs::generate(case, 0).expect("generating inputs");
        let expected = inputs.expected().expect("native runs on every case");
        let mut group = c.benchmark_group(group);
        if case.activation_bytes() >= 1 << 20 {
            group.sampling_mode(SamplingMode::Flat).sample_size(10);
        }
        for (i, &provider) in Provider::ALL.iter().enumerate() {
            let wanted = if provider.is_device() { device_case } else { host_case };
            // The reference is slow: quick runs and the sweep time it only at decode sizes (R90
            // compares with it at 1×4096).
            let skip_native = provider == Provider::Native && !case.shape.is_decode() && (quick || sweep);
            if !wanted || skip_native || !statuses[i].available {
                continue;
            }
            let mut timed = match provider.prepare(&inputs, &expected) {
                Ok(timed) => timed,
                Err(e) => {
                    println!("failed: {e}");
                    statuses[i].failures.push(e.to_string());
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
    for case in sweep_cases(quick) {
        run(case.sweep_group(), case, any_device, any_host, true);
    }
    match output::write_json("providers.json", &statuses) {
        Ok(path) => println!("wrote {}", path.display()),
        Err(e) => println!("warning: {e}"),
    }
}

fn config() -> Criterion {
    let (warm_up, measurement) = if output::quick() { (0.3, 1.0) } else { (1.0, 3.0) };
    Criterion::default()
        .warm_up_time(Duration::from_secs_f64(warm_up))
        .measurement_time(Duration::from_secs_f64(measurement))
        .sample_size(20)
        .configure_from_args()
}

criterion_group! { name = benches; config = config(); targets = kernels }
criterion_main!(benches);
