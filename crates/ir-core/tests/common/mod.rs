//! Shared helpers of the `ir-core` integration tests: a capturing tracing subscriber and test providers.

#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};

use ir_core::{ImplSpec, KernelError, Registry, Tensor, UniqueTensor};
use ir_ops::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
use ir_ops::rms_norm;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// One captured event.
#[derive(Clone, Debug)]
pub struct Captured {
    pub level: tracing::Level,
    pub target: String,
    pub message: String,
    pub fields: String,
}

#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Vec<Captured>>>);

impl Capture {
    pub fn events(&self) -> Vec<Captured> {
        self.0.lock().unwrap().clone()
    }

    pub fn count(&self, level: tracing::Level, needle: &str) -> usize {
        self.events().iter().filter(|e| e.level == level && e.message.contains(needle)).count()
    }
}

struct Visitor<'a>(&'a mut Captured);

impl Visit for Visitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0.message = format!("{value:?}");
        } else {
            self.0.fields.push_str(&format!("{}={:?} ", field.name(), value));
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.message = value.to_owned();
        } else {
            self.0.fields.push_str(&format!("{}={} ", field.name(), value));
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _cx: Context<'_, S>) {
        let meta = event.metadata();
        let mut captured = Captured {
            level: *meta.level(),
            target: meta.target().to_owned(),
            message: String::new(),
            fields: String::new(),
        };
        event.record(&mut Visitor(&mut captured));
        self.0.lock().unwrap().push(captured);
    }
}

thread_local! {
    /// The captures open on this thread, innermost last.
    static OPEN: std::cell::RefCell<Vec<Capture>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The process-wide subscriber: hands each event to the innermost capture open on the emitting thread.
///
/// One global subscriber that is interested in every callsite, rather than a scoped subscriber per
/// test: tracing caches each callsite's interest, and a callsite first reached on a thread without a
/// subscriber while another test's scoped subscriber was being registered could stay cached as
/// "never", which dropped the event from a later capture (a flaky count of 0).
struct Router;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Router {
    fn on_event(&self, event: &tracing::Event<'_>, cx: Context<'_, S>) {
        let innermost = OPEN.with(|open| open.borrow().last().cloned());
        if let Some(capture) = innermost {
            tracing_subscriber::Layer::<S>::on_event(&capture, event, cx);
        }
    }
}

/// Runs `f` with every event of this thread captured.
pub fn capture<R>(f: impl FnOnce() -> R) -> (R, Capture) {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Router))
            .expect("no other global subscriber in the ir-core tests");
    });
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            OPEN.with(|open| open.borrow_mut().pop());
        }
    }
    let capture = Capture::default();
    OPEN.with(|open| open.borrow_mut().push(capture.clone()));
    let close = Close;
    let result = f();
    drop(close);
    (result, capture)
}

/// An in-place `fused_add_rms_norm` provider computing native's values into the donated buffers.
pub fn inplace_fused(
    x: UniqueTensor,
    residual: UniqueTensor,
    weight: Option<&Tensor>,
    epsilon: f64,
    variance_size: Option<i64>,
    rounding: ir_ops::Rounding,
) -> Result<(Tensor, Tensor), KernelError> {
    let (out, residual_out) =
        fused_add_rms_norm::native(x.tensor(), residual.tensor(), weight, epsilon, variance_size, rounding)?;
    let mut x = x.into_tensor();
    let mut residual = residual.into_tensor();
    x.copy_from(&out)?;
    residual.copy_from(&residual_out)?;
    Ok((x, residual))
}

/// Registers `name` as an in-place provider of `fused_add_rms_norm` (no predicate).
pub fn register_inplace(registry: &Registry, name: &'static str) {
    fused_add_rms_norm::register(registry, ImplSpec::new(name), FusedAddRmsNormImpl::inplace(inplace_fused)).unwrap();
}

/// Registers `name` as a functional provider of `rms_norm` that scales native's result by `factor`,
/// so tests can tell providers apart by their values.
pub fn register_scaled_rms_norm(registry: &Registry, spec: ImplSpec, factor: f64) {
    rms_norm::register(registry, spec, move |x, w, eps, v| Ok(rms_norm::native(x, w, eps, v)?.scale(factor)?)).unwrap();
}

/// A `[T, H]` tensor of distinct, deterministic values.
pub fn sample(dtype: ir_core::DType, rows: usize, cols: usize, seed: u64) -> Tensor {
    let values: Vec<f64> =
        (0..rows * cols).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f64 / 250.0) - 2.0).collect();
    Tensor::from_f64(dtype, &[rows, cols], &values).unwrap()
}
