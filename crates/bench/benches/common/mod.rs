//! What every benchmark target shares.

use std::time::Duration;

use criterion::Criterion;
use vllm_ir_bench::output;

/// Criterion configured for these benchmarks: warm-up and measurement seconds from `quick` or
/// `full` (`cargo xtask bench --quick` sets the quick subset), `samples` samples when given, then
/// the command line's options.
pub(crate) fn criterion(quick: (f64, f64), full: (f64, f64), samples: Option<usize>) -> Criterion {
    let (warm_up, measurement) = if output::quick() { quick } else { full };
    let c = Criterion::default()
        .warm_up_time(Duration::from_secs_f64(warm_up))
        .measurement_time(Duration::from_secs_f64(measurement));
    match samples {
        Some(n) => c.sample_size(n),
        None => c,
    }
    .configure_from_args()
}
