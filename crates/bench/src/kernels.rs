//! The kernel benchmark, generic over the registry: every op the registry defines × every provider
//! registered for it (plus a copy of the activation bytes and, for the norms, candle), on the op's
//! own generated inputs. Each runner is prepared once: inputs uploaded, one call through the
//! registry's validating entry point checked against native (so a wrong kernel is never timed, and a
//! provider whose predicate rejects the case is reported as rejected), then [`Timed::time`] calls the
//! implementation directly through `iter_custom`, so uploads and the restoring of in-place inputs
//! stay outside the timed region.

use ir_core::Call;
use ir_core::op::Overload;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ir_core::op::{OpDef, Value};
use ir_core::storage::DeviceAllocator;
use ir_core::{CallError, DType, ImplFunc, Registry, Tensor};
use rayon::prelude::*;

use crate::BenchError;
pub use crate::cases::{
    Case, DECODE_SHAPES, DTYPES, EPSILON, GPU_SHAPE, Inputs, PREFILL_SHAPES, SWEEP_ELEMENTS, Shape, Timed, bytes_moved,
    cpu_cases, gpu_cases, sweep_cases,
};

/// Environment variable restricting the kernel benchmark to some providers (`cuda,copy`).
pub const PROVIDERS_ENV: &str = "VLLM_IR_BENCH_PROVIDERS";

/// Below this many bytes per call the copy baseline stays on one thread, like the cpu kernels.
pub const PARALLEL_THRESHOLD_BYTES: usize = kernels_cpu::BYTES_PER_TASK;

/// The registry the benchmark measures: the built-in ops with every kernel provider of this build
/// registered (those that cannot run here say why).
pub fn registry() -> Result<Registry, BenchError> {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry)?;
    kernels_cuda::register(&registry)?;
    kernels_rocm::register(&registry)?;
    kernels_xpu::register(&registry)?;
    Ok(registry)
}

/// Every op `registry` defines, in definition order.
pub fn ops(registry: &Registry) -> Vec<&'static OpDef> {
    registry.ops().into_iter().filter_map(|name| registry.op_def(name)).collect()
}

/// A provider or baseline the kernel benchmark runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Provider {
    /// A plain copy of the op's activation buffers.
    Copy,
    /// A provider registered for the op (`native`, `cpu`, `cuda`, …), called as registered.
    Registered(&'static str),
    /// candle-nn's CPU `rms_norm` (and `add` then `rms_norm` for the fused op); feature `candle`.
    Candle,
    /// The cpu provider's norm, then its quantization, for a norm + quantization op.
    Unfused,
}

/// The table order of the providers this workspace ships; others follow in registration order.
pub const PROVIDER_ORDER: [&str; 8] = ["copy", "native", "cpu", "unfused", "candle", "xpu", "cuda", "rocm"];

/// The ops candle has a counterpart for.
const CANDLE_OPS: [&str; 2] = ["rms_norm", "fused_add_rms_norm"];

impl Provider {
    /// The name in benchmark ids and tables.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Copy => "copy",
            Provider::Registered(name) => name,
            Provider::Candle => "candle",
            Provider::Unfused => "unfused",
        }
    }

    /// The runners of `op`: the copy, every provider registered for it, candle where it has the op.
    pub fn for_op(registry: &Registry, op: &OpDef) -> Vec<Provider> {
        let mut providers = vec![Provider::Copy];
        providers.extend(registry.providers(op.name).into_iter().map(|p| Provider::Registered(p.name)));
        if CANDLE_OPS.contains(&op.name) {
            providers.push(Provider::Candle);
        }
        if crate::unfused::UNFUSED_OPS.contains(&op.name) {
            providers.push(Provider::Unfused);
        }
        providers.sort_by_key(|p| PROVIDER_ORDER.iter().position(|n| *n == p.name()).unwrap_or(PROVIDER_ORDER.len()));
        providers
    }

    /// Whether its tensors live on a device (its cases are [`gpu_cases`]; timing synchronizes).
    pub fn is_device(self) -> bool {
        device_allocator(self.name()).is_some()
    }

    /// Whether `VLLM_IR_BENCH_PROVIDERS` (a comma-separated list; unset: all) selects it.
    pub fn selected(self) -> bool {
        match std::env::var(PROVIDERS_ENV) {
            Ok(list) if !list.trim().is_empty() => list.split(',').any(|p| p.trim() == self.name()),
            _ => true,
        }
    }

    /// Whether it can run here; the reason when not.
    pub fn availability(self, registry: &Registry) -> Result<(), String> {
        match self {
            Provider::Copy | Provider::Unfused => Ok(()),
            Provider::Registered(name) if registry.provider_available(name) => Ok(()),
            Provider::Registered(name) => Err(registry
                .ops()
                .into_iter()
                .flat_map(|op| registry.providers(op))
                .find_map(|p| match p.availability {
                    ir_core::Availability::Unavailable(reason) if p.name == name => Some(reason),
                    _ => None,
                })
                .unwrap_or_else(|| "not registered".to_owned())),
            Provider::Candle if cfg!(feature = "candle") => Ok(()),
            Provider::Candle => Err("built without feature `candle` (`cargo xtask bench` turns it on)".to_owned()),
        }
    }

    /// A description of the device it runs on, for the report header.
    pub fn device_description(self) -> Option<String> {
        match self.name() {
            "xpu" => kernels_xpu::device().ok().map(|d| format!("{} (OpenCL)", d.name())),
            "cuda" => kernels_cuda::devices().ok().and_then(|d| d.first().map(|d| d.describe())),
            "rocm" => kernels_rocm::allocator().ok().map(|_| "rocm:0".to_owned()),
            _ => None,
        }
    }

    /// Prepares this provider on `inputs`: uploads, runs once through the validating entry point and
    /// checks the result against native's, so a wrong kernel is never timed. A provider whose
    /// predicate rejects the case gives [`BenchError::Rejected`].
    pub fn prepare(self, registry: &Registry, inputs: &Inputs) -> Result<Box<dyn Timed>, BenchError> {
        self.availability(registry)
            .map_err(|reason| BenchError::Unavailable { provider: self.name().to_owned(), reason })?;
        Ok(match self {
            Provider::Copy => Box::new(CopyBench::new(inputs)?),
            Provider::Registered(name) => Box::new(ImplBench::new(registry, name, inputs)?),
            Provider::Candle => candle_bench(inputs)?,
            Provider::Unfused => Box::new(crate::unfused::UnfusedBench::new(inputs)?),
        })
    }
}

/// The allocator of a device provider's memory; `None` for providers that run on host tensors.
fn device_allocator(provider: &str) -> Option<Result<Arc<dyn DeviceAllocator>, String>> {
    Some(match provider {
        "cuda" => kernels_cuda::allocator(0).map(|a| Arc::new(a) as Arc<dyn DeviceAllocator>),
        "rocm" => kernels_rocm::allocator().map(Arc::from),
        "xpu" => kernels_xpu::allocator().map(|a| Arc::new(a) as Arc<dyn DeviceAllocator>),
        _ => return None,
    })
}

/// The copy baseline: the op's activation buffers copied, split across threads like the cpu kernels.
struct CopyBench {
    sources: Vec<Vec<u8>>,
    destinations: Vec<Vec<u8>>,
}

impl CopyBench {
    fn new(inputs: &Inputs) -> Result<CopyBench, BenchError> {
        let sources: Vec<Vec<u8>> = inputs.activations().map(host_bytes).collect();
        // Written once so every page is mapped before timing.
        let destinations = sources.iter().map(|s| vec![1u8; s.len()]).collect();
        let mut bench = CopyBench { sources, destinations };
        bench.copy();
        if bench.sources != bench.destinations {
            return Err(BenchError::Mismatch {
                provider: "copy".to_owned(),
                case: inputs.case.to_string(),
                detail: "the copy differs from its source".to_owned(),
            });
        }
        Ok(bench)
    }

    fn copy(&mut self) {
        let sources: Vec<&[u8]> = self.sources.iter().map(Vec::as_slice).collect();
        let mut destinations: Vec<&mut [u8]> = self.destinations.iter_mut().map(Vec::as_mut_slice).collect();
        parallel_copy(&mut destinations, &sources);
    }
}

impl Timed for CopyBench {
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError> {
        let start = Instant::now();
        for _ in 0..iters {
            self.copy();
            std::hint::black_box(&mut self.destinations);
        }
        Ok(start.elapsed())
    }

    fn bytes_per_call(&self) -> u64 {
        2 * self.sources.iter().map(|s| s.len() as u64).sum::<u64>()
    }
}

/// The bytes of a compact host tensor.
fn host_bytes(t: &Tensor) -> Vec<u8> {
    let buffer = t.cpu_buffer().expect("generated inputs live on the host");
    let start = t.offset() * t.dtype().size_in_bytes();
    buffer.bytes()[start..start + t.numel() * t.dtype().size_in_bytes()].to_vec()
}

/// Restores an in-place activation from its pristine copy (untimed): a dense tensor in the
/// pristine one's layout by [`parallel_copy`], on the threads the kernel runs on, as the copy
/// baseline does; any other through `copy_from`. A restore on one thread leaves the others idle,
/// and on a small virtual machine waking them delayed the timed call by up to a millisecond at
/// 4096×4096 (a restored in-place call measured 2.8–4.6 ms against 2.3–2.5 ms for back-to-back calls
/// or after a parallel restore).
fn restore(tensor: &mut Tensor, pristine: &Tensor) -> Result<(), BenchError> {
    let alike = tensor.dtype() == pristine.dtype()
        && tensor.shape() == pristine.shape()
        && tensor.layout().strides() == pristine.layout().strides()
        && tensor.layout().is_dense();
    if let (true, Some(from)) = (alike, pristine.cpu_buffer()) {
        let size = tensor.dtype().size_in_bytes();
        let (bytes, from_at, to_at) = (tensor.numel() * size, pristine.offset() * size, tensor.offset() * size);
        if let ir_core::storage::Storage::Cpu(to) = tensor.storage_mut()? {
            parallel_copy(&mut [&mut to.bytes_mut()[to_at..to_at + bytes]], &[&from.bytes()[from_at..from_at + bytes]]);
            return Ok(());
        }
    }
    tensor.copy_from(pristine)?;
    Ok(())
}

/// Copies each source into its destination; above [`PARALLEL_THRESHOLD_BYTES`] in total, every
/// buffer is cut into one contiguous chunk per rayon thread.
pub fn parallel_copy(destinations: &mut [&mut [u8]], sources: &[&[u8]]) {
    assert_eq!(destinations.len(), sources.len(), "one destination per source");
    let total: usize = sources.iter().map(|s| s.len()).sum();
    if total < PARALLEL_THRESHOLD_BYTES {
        for (d, s) in destinations.iter_mut().zip(sources) {
            d.copy_from_slice(s);
        }
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    for (d, s) in destinations.iter_mut().zip(sources) {
        let chunk = s.len().div_ceil(threads).next_multiple_of(64).max(64);
        d.par_chunks_mut(chunk).zip(s.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
    }
}

/// A registered implementation, called directly ([`ImplFunc::invoke_in`], on arguments kept between
/// calls) after one validated call.
/// Functional implementations allocate their outputs inside the timed region, as every caller of
/// them does. In-place ones write into the activations: on the host these are restored from the
/// pristine inputs (untimed) before each call; on a device they are not (the values change, the work
/// does not), and timing ends with a one-element download, which waits for the device.
struct ImplBench {
    func: ImplFunc,
    /// The arguments; for in-place implementations, the activation slots are `none` here and the
    /// activations live in `current`, so each call gets them uniquely owned.
    args: Vec<Value>,
    activations: Vec<usize>,
    current: Vec<Tensor>,
    pristine: Option<Vec<Tensor>>,
    device_sync: Option<Tensor>,
    bytes: u64,
}

impl ImplBench {
    fn new(registry: &Registry, provider: &'static str, inputs: &Inputs) -> Result<ImplBench, BenchError> {
        let op = inputs.case.op;
        let allocator = device_allocator(provider)
            .transpose()
            .map_err(|reason| BenchError::Unavailable { provider: provider.to_owned(), reason })?;
        let upload = |values: &[Value]| -> Result<Vec<Value>, BenchError> {
            values
                .iter()
                .map(|v| match (v, &allocator) {
                    (Value::Tensor(t), Some(a)) => Ok(Value::Tensor(t.to_device(a.as_ref())?)),
                    (Value::Tensor(t), None) => Ok(Value::Tensor(t.deep_clone()?)),
                    (other, _) => Ok(other.clone()),
                })
                .collect()
        };
        let overload = if op.allow_inplace { Overload::MaybeInplace } else { Overload::Default };
        let first = registry.run(Call::new(op.name, overload, upload(&inputs.values)?).provider(provider)).map_err(
            |e| match e {
                CallError::Unsupported { reason, .. } => {
                    BenchError::Rejected { provider: provider.to_owned(), case: inputs.case.to_string(), reason }
                }
                other => BenchError::Call(other),
            },
        )?;
        inputs.check(provider, &first)?;
        let func = registry.implementation(op.name, provider)?;
        // The given activations (an absent optional one has no output to carry to the next call).
        let activations: Vec<usize> = if func.is_inplace() {
            let given = |i: &usize| matches!(inputs.values.get(*i), Some(Value::Tensor(_)));
            op.activation_indices().map_err(ir_core::RegistryError::from)?.into_iter().filter(given).collect()
        } else {
            Vec::new()
        };
        let mut args = upload(&inputs.values)?;
        let current = activations
            .iter()
            .map(|&i| match std::mem::replace(&mut args[i], Value::None) {
                Value::Tensor(t) => Ok(t),
                _ => Err(BenchError::Kernel(ir_core::op::mismatched(op.name))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let pristine = match (&allocator, func.is_inplace()) {
            (None, true) => Some(activations.iter().map(|&i| inputs.tensor(i).clone()).collect()),
            _ => None,
        };
        let device_sync = allocator.map(|a| Tensor::zeros(DType::F32, &[1])?.to_device(a.as_ref())).transpose()?;
        Ok(ImplBench { func, args, activations, current, pristine, device_sync, bytes: inputs.bytes_moved() })
    }

    /// One call; in-place outputs become the next call's activations.
    fn call(&mut self) -> Result<(), BenchError> {
        if !self.func.is_inplace() {
            std::hint::black_box(self.func.invoke_in(&mut self.args)?);
            return Ok(());
        }
        for (&position, tensor) in self.activations.iter().zip(self.current.drain(..)) {
            self.args[position] = Value::Tensor(tensor);
        }
        self.current.extend(self.func.invoke_in(&mut self.args)?);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), BenchError> {
        if let Some(t) = &self.device_sync {
            t.to_cpu()?;
        }
        Ok(())
    }
}

impl Timed for ImplBench {
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError> {
        if let Some(pristine) = self.pristine.take() {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                for (tensor, source) in self.current.iter_mut().zip(&pristine) {
                    restore(tensor, source)?;
                }
                let start = Instant::now();
                let called = self.call();
                total += start.elapsed();
                if let Err(e) = called {
                    self.pristine = Some(pristine);
                    return Err(e);
                }
            }
            self.pristine = Some(pristine);
            return Ok(total);
        }
        self.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters {
            self.call()?;
        }
        self.synchronize()?;
        Ok(start.elapsed())
    }

    fn bytes_per_call(&self) -> u64 {
        self.bytes
    }
}

#[cfg(feature = "candle")]
fn candle_bench(inputs: &Inputs) -> Result<Box<dyn Timed>, BenchError> {
    Ok(Box::new(crate::candle::CandleBench::new(inputs)?))
}

#[cfg(not(feature = "candle"))]
fn candle_bench(_inputs: &Inputs) -> Result<Box<dyn Timed>, BenchError> {
    Err(BenchError::Unavailable { provider: "candle".to_owned(), reason: "built without feature `candle`".to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir_ops::fused_add_rms_norm::FUSED_ADD_RMS_NORM;
    use ir_ops::rms_norm::RMS_NORM;
    use ir_ops::silu_and_mul::SILU_AND_MUL;

    fn small(op: &'static OpDef, dtype: DType) -> Inputs {
        Inputs::generate(Case { op, shape: Shape::new(3, 200), dtype }, 5).unwrap()
    }

    #[test]
    fn bytes_moved_follows_r95_and_counts_every_tensor() {
        // rms_norm moves 2·T·H·s + H·s_w, the fused op 4·T·H·s + H·s_w.
        let (t, h, s) = (3u64, 200u64, 2u64);
        assert_eq!(small(&RMS_NORM, DType::BF16).bytes_moved(), 2 * t * h * s + h * s);
        assert_eq!(small(&FUSED_ADD_RMS_NORM, DType::BF16).bytes_moved(), 4 * t * h * s + h * s);
        // A gated op reads [T, 2H] and writes [T, H].
        assert_eq!(small(&SILU_AND_MUL, DType::BF16).bytes_moved(), 3 * t * h * s);
    }

    #[test]
    fn the_case_lists_cover_r96_for_every_op() {
        let registry = registry().unwrap();
        let ops = ops(&registry);
        assert!(ops.len() >= 4, "every built-in op is benchmarked");
        let full = cpu_cases(&ops, false);
        // Four decode shapes (1×4096, 8×4096, 64×8192 and 256×4096) and two prefill shapes, three dtypes.
        assert_eq!(full.len(), ops.len() * 6 * 3);
        let quick = cpu_cases(&ops, true);
        assert!(quick.iter().all(|c| full.contains(c)));
        for target in [Shape::new(4096, 4096), Shape::new(1, 4096)] {
            for dtype in [DType::F32, DType::BF16] {
                for &op in &ops {
                    assert!(quick.contains(&Case { op, shape: target, dtype }), "{} {dtype} {target}", op.name);
                }
            }
        }
        assert!(gpu_cases(&ops, true).iter().any(|c| c.shape == GPU_SHAPE && c.dtype == DType::BF16));
        for case in sweep_cases(&ops, false) {
            assert_eq!(case.shape.tokens * case.shape.hidden, SWEEP_ELEMENTS);
        }
    }

    #[test]
    fn parallel_copy_copies_every_byte_above_and_below_the_threshold() {
        for len in [10, PARALLEL_THRESHOLD_BYTES + 12345] {
            let a: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let b: Vec<u8> = (0..len).map(|i| (i * 3 % 241) as u8).collect();
            let (mut da, mut db) = (vec![0u8; len], vec![0u8; len]);
            parallel_copy(&mut [&mut da, &mut db], &[&a, &b]);
            assert!(da == a && db == b, "len {len}");
        }
    }

    #[test]
    fn every_host_runner_of_every_op_checks_and_times() {
        let registry = registry().unwrap();
        for op in ops(&registry) {
            let providers = Provider::for_op(&registry, op);
            assert!(providers.contains(&Provider::Registered("cpu")) && providers.contains(&Provider::Copy));
            for dtype in DTYPES {
                let inputs = small(op, dtype);
                for provider in [Provider::Copy, Provider::Registered("native"), Provider::Registered("cpu")] {
                    let mut timed = provider.prepare(&registry, &inputs).unwrap();
                    assert!(timed.time(3).unwrap() > Duration::ZERO);
                    let expected_bytes = if provider == Provider::Copy {
                        2 * inputs.activation_bytes() as u64
                    } else {
                        inputs.bytes_moved()
                    };
                    assert_eq!(timed.bytes_per_call(), expected_bytes, "{provider:?} {}", op.name);
                }
            }
        }
    }

    #[test]
    fn the_in_place_cpu_runner_restores_its_inputs_between_calls() {
        let registry = registry().unwrap();
        let inputs = small(&FUSED_ADD_RMS_NORM, DType::F16);
        let mut bench = ImplBench::new(&registry, "cpu", &inputs).unwrap();
        assert!(bench.func.is_inplace() && bench.pristine.is_some());
        bench.time(5).unwrap();
        inputs.check("cpu", &bench.current).expect("the fifth call computed what the first did");
    }

    #[test]
    fn a_wrong_kernel_is_caught_before_timing_and_a_rejection_is_named() {
        let registry = registry().unwrap();
        ir_ops::rms_norm::register(&registry, ir_core::ImplSpec::new("wrong"), |x, _, _, _| Ok(x.deep_clone()?))
            .unwrap();
        let inputs = small(&RMS_NORM, DType::F32);
        let err = Provider::Registered("wrong").prepare(&registry, &inputs).err().expect("mismatch");
        assert!(err.to_string().starts_with("wrong rms_norm f32 3x200: result differs from native"), "{err}");
        let f64_inputs = small(&SILU_AND_MUL, DType::F64);
        let err = Provider::Registered("cpu").prepare(&registry, &f64_inputs).err().expect("rejected");
        assert!(matches!(err, BenchError::Rejected { .. }), "{err}");
        assert!(err.to_string().contains("dtype f64 is not one of f32, f16, bf16"), "{err}");
    }

    #[test]
    fn unavailable_providers_say_why() {
        let registry = registry().unwrap();
        if !cfg!(feature = "candle") {
            let inputs = small(&RMS_NORM, DType::F32);
            let err = Provider::Candle.prepare(&registry, &inputs).err().expect("no candle");
            assert!(err.to_string().contains("feature `candle`"), "{err}");
        }
        if let Err(reason) = Provider::Registered("cuda").availability(&registry) {
            assert!(!reason.is_empty());
        }
        assert!(Provider::Registered("cuda").is_device() && !Provider::Registered("cpu").is_device());
    }
}
