//! Kernel throughput (R95–R97): every available provider of both norm ops beside a copy of the same
//! activation bytes (and candle with feature `candle`), on the same data in the same run.

// A benchmark reports on standard output.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use serde::Serialize;
use vllm_ir_bench::kernels::{Inputs, Provider, cpu_cases, gpu_cases};
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
            let availability = p.availability();
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
    let any_device = Provider::ALL.iter().any(|p| p.is_device() && p.availability().is_ok());
    let host = cpu_cases(quick);
    let device = if any_device { gpu_cases(quick) } else { Vec::new() };
    let mut all = host.clone();
    all.extend(device.iter().filter(|c| !host.contains(c)));

    for case in all {
        let inputs = Inputs::generate(case, 0).expect("generating inputs");
        let expected = inputs.expected().expect("native runs on every case");
        let mut group = c.benchmark_group(case.group());
        if case.activation_bytes() >= 1 << 20 {
            group.sampling_mode(SamplingMode::Flat).sample_size(10);
        }
        for (i, &provider) in Provider::ALL.iter().enumerate() {
            let wanted = if provider.is_device() { device.contains(&case) } else { host.contains(&case) };
            // The reference is slow; quick runs time it only at decode sizes (R90 compares at 1×4096).
            let skip_native = quick && provider == Provider::Native && !case.shape.is_decode();
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
