//! The kernel benchmark: cases (op, shape, dtype), the bytes each moves (R95), and one prepared,
//! correctness-checked runner per provider whose [`Timed::time`] criterion calls through
//! `iter_custom`, so allocation, uploads and the restoring of in-place inputs stay outside the
//! timed region (R96).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ir_core::op::fused_add_rms_norm::{self, FUSED_ADD_RMS_NORM};
use ir_core::op::rms_norm::{self, RMS_NORM};
use ir_core::op::{InputSpec, OpDef, tolerance};
use ir_core::storage::DeviceAllocator;
use ir_core::{DType, KernelError, Tensor, UniqueTensor, allclose};
use rayon::prelude::*;

use crate::BenchError;

/// Environment variable restricting the kernel benchmark to some providers (`cuda,copy`).
pub const PROVIDERS_ENV: &str = "VLLM_IR_BENCH_PROVIDERS";

/// The epsilon of every case.
pub const EPSILON: f64 = 1e-6;

/// Below this many bytes per call the copy baseline stays on one thread, like the cpu kernels.
pub const PARALLEL_THRESHOLD_BYTES: usize = kernels_cpu::BYTES_PER_TASK;

/// The op a case runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BenchOp {
    /// `rms_norm` (functional: reads x, writes a fresh output).
    RmsNorm,
    /// `fused_add_rms_norm` (in place on in-place providers: reads and writes x and residual).
    FusedAddRmsNorm,
}

impl BenchOp {
    /// Both ops.
    pub const ALL: [BenchOp; 2] = [BenchOp::RmsNorm, BenchOp::FusedAddRmsNorm];

    /// The op's name.
    pub fn name(self) -> &'static str {
        self.def().name
    }

    /// The op's definition.
    pub fn def(self) -> &'static OpDef {
        match self {
            BenchOp::RmsNorm => &RMS_NORM,
            BenchOp::FusedAddRmsNorm => &FUSED_ADD_RMS_NORM,
        }
    }

    /// Activation buffers the op reads and writes: one (x → out) or two (x and residual).
    pub fn activation_buffers(self) -> usize {
        match self {
            BenchOp::RmsNorm => 1,
            BenchOp::FusedAddRmsNorm => 2,
        }
    }
}

/// `tokens × hidden`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shape {
    /// Rows (T).
    pub tokens: usize,
    /// Row length (H).
    pub hidden: usize,
}

impl Shape {
    /// `tokens × hidden`.
    pub const fn new(tokens: usize, hidden: usize) -> Shape {
        Shape { tokens, hidden }
    }

    /// Whether this is a decode shape (T ≤ 64: launch-bound on GPUs, R97).
    pub fn is_decode(self) -> bool {
        self.tokens <= 64
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.tokens, self.hidden)
    }
}

/// The decode shapes of R96.
pub const DECODE_SHAPES: [Shape; 3] = [Shape::new(1, 4096), Shape::new(16, 4096), Shape::new(64, 8192)];
/// The prefill shapes of R96.
pub const PREFILL_SHAPES: [Shape; 2] = [Shape::new(4096, 4096), Shape::new(2048, 8192)];
/// The shape GPUs add (R96).
pub const GPU_SHAPE: Shape = Shape::new(16384, 8192);
/// The dtypes of R96.
pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// One benchmark case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Case {
    /// The op.
    pub op: BenchOp,
    /// The shape of x (and the residual).
    pub shape: Shape,
    /// The dtype of every tensor (the weight included).
    pub dtype: DType,
}

impl Case {
    /// Bytes the op must move (R95), the weight in the activations' dtype.
    pub fn bytes_moved(&self) -> u64 {
        bytes_moved(self.op, self.shape, self.dtype, Some(self.dtype))
    }

    /// Bytes of one activation buffer (T·H·s).
    pub fn activation_bytes(&self) -> usize {
        self.shape.tokens * self.shape.hidden * self.dtype.size_in_bytes()
    }

    /// The criterion group name: `kernels/<op>/<dtype>/<shape>`.
    pub fn group(&self) -> String {
        format!("kernels/{}/{}/{}", self.op.name(), self.dtype, self.shape)
    }

    /// The criterion group name in the hidden-size sweep: `sweep/<op>/<dtype>/<shape>`.
    pub fn sweep_group(&self) -> String {
        format!("sweep/{}/{}/{}", self.op.name(), self.dtype, self.shape)
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.op.name(), self.dtype, self.shape)
    }
}

/// Bytes moved (R95): `rms_norm` 2·T·H·s + H·s_w, `fused_add_rms_norm` 4·T·H·s + H·s_w (no weight:
/// no weight term).
pub fn bytes_moved(op: BenchOp, shape: Shape, dtype: DType, weight: Option<DType>) -> u64 {
    let activation = (shape.tokens * shape.hidden * dtype.size_in_bytes()) as u64;
    let weight = weight.map_or(0, |w| (shape.hidden * w.size_in_bytes()) as u64);
    2 * op.activation_buffers() as u64 * activation + weight
}

/// The CPU cases: every op × shape × dtype of R96, or (quick) 1×4096 and 4096×4096 in f32 and bf16,
/// the shapes and dtypes the targets name.
pub fn cpu_cases(quick: bool) -> Vec<Case> {
    let (shapes, dtypes): (Vec<Shape>, Vec<DType>) = if quick {
        (vec![DECODE_SHAPES[0], PREFILL_SHAPES[0]], vec![DType::F32, DType::BF16])
    } else {
        (DECODE_SHAPES.iter().chain(&PREFILL_SHAPES).copied().collect(), DTYPES.to_vec())
    };
    cases(&shapes, &dtypes)
}

/// The GPU cases: the CPU shapes plus 16384×8192; bf16 everywhere, f32 and f16 too unless quick.
pub fn gpu_cases(quick: bool) -> Vec<Case> {
    let shapes: Vec<Shape> = DECODE_SHAPES.iter().chain(&PREFILL_SHAPES).chain([&GPU_SHAPE]).copied().collect();
    let dtypes = if quick { vec![DType::BF16] } else { DTYPES.to_vec() };
    cases(&shapes, &dtypes)
}

/// Elements per activation in the hidden-size sweep (32 MB in bf16, the size of 4096 × 4096, so the
/// data streams from memory rather than from a large last-level cache).
pub const SWEEP_ELEMENTS: usize = 16 << 20;

/// The hidden-size sweep: both ops in bf16 at T·H = [`SWEEP_ELEMENTS`], H from 256 to 16384 (quick:
/// 512, 2048, 8192), for the plot of bandwidth against hidden size.
pub fn sweep_cases(quick: bool) -> Vec<Case> {
    let hidden: &[usize] = if quick { &[512, 2048, 8192] } else { &[256, 512, 1024, 2048, 4096, 8192, 16384] };
    let shapes: Vec<Shape> = hidden.iter().map(|&h| Shape::new(SWEEP_ELEMENTS / h, h)).collect();
    cases(&shapes, &[DType::BF16])
}

fn cases(shapes: &[Shape], dtypes: &[DType]) -> Vec<Case> {
    let mut out = Vec::new();
    for op in BenchOp::ALL {
        for &dtype in dtypes {
            for &shape in shapes {
                out.push(Case { op, shape, dtype });
            }
        }
    }
    out
}

/// A case's host inputs (the op's own generator: normal x and residual, weight near 1) and native's
/// results on them.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// The case.
    pub case: Case,
    /// x.
    pub x: Tensor,
    /// The residual (unused by `rms_norm`).
    pub residual: Tensor,
    /// The weight.
    pub weight: Tensor,
}

impl Inputs {
    /// Generates the inputs of `case` from `seed`.
    pub fn generate(case: Case, seed: u64) -> Result<Inputs, BenchError> {
        let spec = InputSpec {
            num_tokens: case.shape.tokens,
            hidden_size: case.shape.hidden,
            dtype: case.dtype,
            epsilon: EPSILON,
            seed,
        };
        let values = (FUSED_ADD_RMS_NORM.generate_inputs)(&spec)?;
        let tensor = |i: usize| values[i].as_tensor().cloned().expect("the generator returns x, residual, weight");
        Ok(Inputs { case, x: tensor(0), residual: tensor(1), weight: tensor(2) })
    }

    /// Native's outputs: `[out]` or `[out, residual]`.
    pub fn expected(&self) -> Result<Vec<Tensor>, BenchError> {
        Ok(match self.case.op {
            BenchOp::RmsNorm => vec![rms_norm::native(&self.x, Some(&self.weight), EPSILON, None)?],
            BenchOp::FusedAddRmsNorm => {
                let (out, residual) =
                    fused_add_rms_norm::native(&self.x, &self.residual, Some(&self.weight), EPSILON, None)?;
                vec![out, residual]
            }
        })
    }

    /// Compares `actual` with `expected` within the op's tolerance for the dtype.
    pub fn check(&self, provider: &str, actual: &[Tensor], expected: &[Tensor]) -> Result<(), BenchError> {
        let mismatch = |detail: String| BenchError::Mismatch {
            provider: provider.to_owned(),
            case: self.case.to_string(),
            detail,
        };
        if actual.len() != expected.len() {
            return Err(mismatch(format!("{} outputs, expected {}", actual.len(), expected.len())));
        }
        let tol = tolerance(self.case.op.def(), self.case.dtype).map_err(|e| mismatch(e.to_string()))?;
        for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
            let a = a.to_cpu()?;
            allclose(&a, e, tol.atol, tol.rtol).map_err(|err| mismatch(format!("output {i}: {err}")))?;
        }
        Ok(())
    }
}

/// A provider or baseline the kernel benchmark runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Provider {
    /// A plain copy moving the activation bytes (1 buffer for `rms_norm`, 2 for the fused op).
    Copy,
    /// The reference implementation (allocates its outputs: its API has no other form).
    Native,
    /// `kernels-cpu`.
    Cpu,
    /// `kernels-xpu` (OpenCL).
    Xpu,
    /// `kernels-cuda`.
    Cuda,
    /// `kernels-rocm`.
    Rocm,
    /// candle-nn's CPU `rms_norm` (and `add` then `rms_norm` for the fused op); feature `candle`.
    Candle,
}

impl Provider {
    /// Every provider and baseline, in table order.
    pub const ALL: [Provider; 7] = [
        Provider::Copy,
        Provider::Native,
        Provider::Cpu,
        Provider::Candle,
        Provider::Xpu,
        Provider::Cuda,
        Provider::Rocm,
    ];

    /// The name in benchmark ids and tables.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Copy => "copy",
            Provider::Native => "native",
            Provider::Cpu => "cpu",
            Provider::Xpu => "xpu",
            Provider::Cuda => "cuda",
            Provider::Rocm => "rocm",
            Provider::Candle => "candle",
        }
    }

    /// Whether it runs on a device (its cases are [`gpu_cases`]; timing synchronizes).
    pub fn is_device(self) -> bool {
        matches!(self, Provider::Xpu | Provider::Cuda | Provider::Rocm)
    }

    /// Whether `VLLM_IR_BENCH_PROVIDERS` (a comma-separated list; unset: all) selects it.
    pub fn selected(self) -> bool {
        match std::env::var(PROVIDERS_ENV) {
            Ok(list) if !list.trim().is_empty() => list.split(',').any(|p| p.trim() == self.name()),
            _ => true,
        }
    }

    /// Whether it can run here; the reason when not.
    pub fn availability(self) -> Result<(), String> {
        let probe = |a: ir_core::Availability| match a {
            ir_core::Availability::Available => Ok(()),
            ir_core::Availability::Unavailable(reason) => Err(reason),
        };
        match self {
            Provider::Copy | Provider::Native | Provider::Cpu => Ok(()),
            Provider::Xpu => probe(kernels_xpu::availability()),
            Provider::Cuda => probe(kernels_cuda::availability()),
            Provider::Rocm => probe(kernels_rocm::availability()),
            Provider::Candle if cfg!(feature = "candle") => Ok(()),
            Provider::Candle => Err("built without feature `candle` (`cargo xtask bench` turns it on)".to_owned()),
        }
    }

    /// A description of the device it runs on, for the report header.
    pub fn device_description(self) -> Option<String> {
        match self {
            Provider::Xpu => kernels_xpu::device().ok().map(|d| format!("{} (OpenCL)", d.name())),
            Provider::Cuda => kernels_cuda::devices().ok().and_then(|d| d.first().map(|d| d.describe())),
            Provider::Rocm => kernels_rocm::allocator().ok().map(|_| "rocm:0".to_owned()),
            _ => None,
        }
    }

    /// Prepares this provider on `inputs`: uploads, runs once and checks the result against native's
    /// (`expected`), so a wrong kernel is never timed.
    pub fn prepare(self, inputs: &Inputs, expected: &[Tensor]) -> Result<Box<dyn Timed>, BenchError> {
        self.availability().map_err(|reason| BenchError::Unavailable { provider: self.name().to_owned(), reason })?;
        let timed: Box<dyn Timed> = match self {
            Provider::Copy => Box::new(CopyBench::new(inputs)?),
            Provider::Native => Box::new(NativeBench::new(inputs, expected)?),
            Provider::Cpu => Box::new(CpuBench::new(inputs, expected)?),
            Provider::Xpu => {
                let allocator = kernels_xpu::allocator().map_err(|reason| unavailable(self, reason))?;
                let kernels =
                    DeviceKernels { rms_norm: kernels_xpu::rms_norm_xpu, fused: kernels_xpu::fused_add_rms_norm_xpu };
                Box::new(DeviceBench::new(self, Arc::new(allocator), kernels, inputs, expected)?)
            }
            Provider::Cuda => {
                let allocator = kernels_cuda::allocator(0).map_err(|reason| unavailable(self, reason))?;
                let kernels = DeviceKernels {
                    rms_norm: kernels_cuda::rms_norm_cuda,
                    fused: kernels_cuda::fused_add_rms_norm_cuda,
                };
                Box::new(DeviceBench::new(self, Arc::new(allocator), kernels, inputs, expected)?)
            }
            Provider::Rocm => {
                let allocator = kernels_rocm::allocator().map_err(|reason| unavailable(self, reason))?;
                let kernels = DeviceKernels {
                    rms_norm: kernels_rocm::rms_norm_rocm,
                    fused: kernels_rocm::fused_add_rms_norm_rocm,
                };
                Box::new(DeviceBench::new(self, Arc::from(allocator), kernels, inputs, expected)?)
            }
            Provider::Candle => candle_bench(inputs, expected)?,
        };
        Ok(timed)
    }
}

fn unavailable(provider: Provider, reason: String) -> BenchError {
    BenchError::Unavailable { provider: provider.name().to_owned(), reason }
}

/// A prepared runner.
pub trait Timed {
    /// Runs the kernel `iters` times and returns the time they took (device work included), setup
    /// between calls excluded.
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError>;

    /// Bytes one call moves, for throughput (the copy baseline moves only the activations).
    fn bytes_per_call(&self) -> u64;
}

/// The copy baseline: the activation buffers copied, split across threads like the cpu kernels.
struct CopyBench {
    sources: Vec<Vec<u8>>,
    destinations: Vec<Vec<u8>>,
}

impl CopyBench {
    fn new(inputs: &Inputs) -> Result<CopyBench, BenchError> {
        let mut sources = vec![host_bytes(&inputs.x)];
        if inputs.case.op == BenchOp::FusedAddRmsNorm {
            sources.push(host_bytes(&inputs.residual));
        }
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

/// Native: allocates its outputs inside the timed region (the reference has no other form).
struct NativeBench {
    inputs: Inputs,
}

impl NativeBench {
    fn new(inputs: &Inputs, expected: &[Tensor]) -> Result<NativeBench, BenchError> {
        let bench = NativeBench { inputs: inputs.clone() };
        inputs.check("native", &bench.call()?, expected)?;
        Ok(bench)
    }

    fn call(&self) -> Result<Vec<Tensor>, BenchError> {
        self.inputs.expected()
    }
}

/// Times `iters` calls of `call`, its results dropped inside the timed region (their allocation is
/// part of the call).
pub(crate) fn time_calls<R>(
    iters: u64,
    mut call: impl FnMut() -> Result<R, BenchError>,
) -> Result<Duration, BenchError> {
    let start = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(call()?);
    }
    Ok(start.elapsed())
}

impl Timed for NativeBench {
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError> {
        time_calls(iters, || self.call())
    }

    fn bytes_per_call(&self) -> u64 {
        self.inputs.case.bytes_moved()
    }
}

/// `kernels-cpu`: `rms_norm` into a preallocated output; the fused op in place on x and residual,
/// restored from the pristine inputs (untimed) before each call.
struct CpuBench {
    inputs: Inputs,
    out: Option<Tensor>,
    residual: Option<Tensor>,
}

impl CpuBench {
    fn new(inputs: &Inputs, expected: &[Tensor]) -> Result<CpuBench, BenchError> {
        let mut bench = CpuBench {
            inputs: inputs.clone(),
            out: Some(inputs.x.deep_clone()?),
            residual: Some(inputs.residual.deep_clone()?),
        };
        bench.call()?;
        let mut outputs = vec![bench.out()?.clone()];
        if inputs.case.op == BenchOp::FusedAddRmsNorm {
            outputs.push(bench.residual.clone().expect("kept between calls"));
        }
        inputs.check("cpu", &outputs, expected)?;
        Ok(bench)
    }

    fn out(&self) -> Result<&Tensor, BenchError> {
        Ok(self.out.as_ref().expect("kept between calls"))
    }

    fn restore(&mut self) -> Result<(), BenchError> {
        if self.inputs.case.op == BenchOp::FusedAddRmsNorm {
            self.out.as_mut().expect("kept between calls").copy_from(&self.inputs.x)?;
            self.residual.as_mut().expect("kept between calls").copy_from(&self.inputs.residual)?;
        }
        Ok(())
    }

    fn call(&mut self) -> Result<(), BenchError> {
        let weight = Some(&self.inputs.weight);
        match self.inputs.case.op {
            BenchOp::RmsNorm => {
                let out = self.out.as_mut().expect("kept between calls");
                kernels_cpu::rms_norm_cpu_into(&self.inputs.x, weight, EPSILON, None, out)?;
            }
            BenchOp::FusedAddRmsNorm => {
                let x = unique(self.out.take())?;
                let residual = unique(self.residual.take())?;
                let (x, residual) = kernels_cpu::fused_add_rms_norm_cpu(x, residual, weight, EPSILON, None)?;
                self.out = Some(x);
                self.residual = Some(residual);
            }
        }
        Ok(())
    }
}

fn unique(t: Option<Tensor>) -> Result<UniqueTensor, BenchError> {
    let t = t.expect("kept between calls");
    UniqueTensor::new(t).map_err(|_| {
        BenchError::Kernel(KernelError::InvalidArguments { reason: "benchmark buffer is shared".to_owned() })
    })
}

impl Timed for CpuBench {
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError> {
        if self.inputs.case.op == BenchOp::RmsNorm {
            let start = Instant::now();
            for _ in 0..iters {
                self.call()?;
            }
            return Ok(start.elapsed());
        }
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            self.restore()?;
            let start = Instant::now();
            self.call()?;
            total += start.elapsed();
        }
        Ok(total)
    }

    fn bytes_per_call(&self) -> u64 {
        self.inputs.case.bytes_moved()
    }
}

type FusedFn =
    fn(UniqueTensor, UniqueTensor, Option<&Tensor>, f64, Option<i64>) -> Result<(Tensor, Tensor), KernelError>;

/// A device provider's two entry points.
struct DeviceKernels {
    rms_norm: rms_norm::RmsNormFn,
    fused: FusedFn,
}

/// A device provider: inputs uploaded once; `rms_norm` allocates its output on the device (its
/// entry point's form), the fused op runs in place on the same device buffers call after call (its
/// values change, its work does not). Timing ends with a download, which waits for the device.
struct DeviceBench {
    case: Case,
    kernels: DeviceKernels,
    x: Option<Tensor>,
    residual: Option<Tensor>,
    weight: Tensor,
}

impl DeviceBench {
    fn new(
        provider: Provider,
        allocator: Arc<dyn DeviceAllocator>,
        kernels: DeviceKernels,
        inputs: &Inputs,
        expected: &[Tensor],
    ) -> Result<DeviceBench, BenchError> {
        let mut bench = DeviceBench {
            case: inputs.case,
            kernels,
            x: Some(inputs.x.to_device(allocator.as_ref())?),
            residual: Some(inputs.residual.to_device(allocator.as_ref())?),
            weight: inputs.weight.to_device(allocator.as_ref())?,
        };
        let outputs = match bench.case.op {
            BenchOp::RmsNorm => vec![bench.call()?.expect("rms_norm returns its output")],
            BenchOp::FusedAddRmsNorm => {
                bench.call()?;
                let outputs = vec![bench.x.clone().expect("kept"), bench.residual.clone().expect("kept")];
                // Back to the pristine inputs for the timed calls.
                bench.x = Some(inputs.x.to_device(allocator.as_ref())?);
                bench.residual = Some(inputs.residual.to_device(allocator.as_ref())?);
                outputs
            }
        };
        inputs.check(provider.name(), &outputs, expected)?;
        Ok(bench)
    }

    fn call(&mut self) -> Result<Option<Tensor>, BenchError> {
        let weight = Some(&self.weight);
        match self.case.op {
            BenchOp::RmsNorm => {
                let x = self.x.as_ref().expect("kept");
                Ok(Some((self.kernels.rms_norm)(x, weight, EPSILON, None)?))
            }
            BenchOp::FusedAddRmsNorm => {
                let (x, residual) = (unique(self.x.take())?, unique(self.residual.take())?);
                let (x, residual) = (self.kernels.fused)(x, residual, weight, EPSILON, None)?;
                self.x = Some(x);
                self.residual = Some(residual);
                Ok(None)
            }
        }
    }

    fn synchronize(&self) -> Result<(), BenchError> {
        self.weight.to_cpu()?;
        Ok(())
    }
}

impl Timed for DeviceBench {
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError> {
        self.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters {
            std::hint::black_box(self.call()?);
        }
        self.synchronize()?;
        Ok(start.elapsed())
    }

    fn bytes_per_call(&self) -> u64 {
        self.case.bytes_moved()
    }
}

#[cfg(feature = "candle")]
fn candle_bench(inputs: &Inputs, expected: &[Tensor]) -> Result<Box<dyn Timed>, BenchError> {
    Ok(Box::new(crate::candle::CandleBench::new(inputs, expected)?))
}

#[cfg(not(feature = "candle"))]
fn candle_bench(_inputs: &Inputs, _expected: &[Tensor]) -> Result<Box<dyn Timed>, BenchError> {
    Err(unavailable(Provider::Candle, "built without feature `candle`".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_moved_follows_r95() {
        // The spec's example: 4096 × 4096 bf16 is 67.1 MB for rms_norm and 134.2 MB fused.
        let shape = Shape::new(4096, 4096);
        assert_eq!(bytes_moved(BenchOp::RmsNorm, shape, DType::BF16, Some(DType::BF16)), 67_117_056);
        assert_eq!(bytes_moved(BenchOp::FusedAddRmsNorm, shape, DType::BF16, Some(DType::BF16)), 134_225_920);
        assert_eq!(bytes_moved(BenchOp::RmsNorm, Shape::new(1, 4096), DType::F32, None), 32_768);
    }

    #[test]
    fn the_case_lists_cover_r96() {
        let full = cpu_cases(false);
        assert_eq!(full.len(), 2 * 5 * 3);
        let quick = cpu_cases(true);
        assert!(quick.iter().all(|c| full.contains(c)));
        for target in [Shape::new(4096, 4096), Shape::new(1, 4096)] {
            for dtype in [DType::F32, DType::BF16] {
                for op in BenchOp::ALL {
                    assert!(quick.contains(&Case { op, shape: target, dtype }), "{op:?} {dtype} {target}");
                }
            }
        }
        assert!(gpu_cases(true).iter().any(|c| c.shape == GPU_SHAPE && c.dtype == DType::BF16));
        for case in sweep_cases(false) {
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

    fn small(op: BenchOp, dtype: DType) -> Inputs {
        Inputs::generate(Case { op, shape: Shape::new(3, 200), dtype }, 5).unwrap()
    }

    #[test]
    fn every_host_runner_checks_and_times() {
        for op in BenchOp::ALL {
            for dtype in DTYPES {
                let inputs = small(op, dtype);
                let expected = inputs.expected().unwrap();
                for provider in [Provider::Copy, Provider::Native, Provider::Cpu] {
                    let mut timed = provider.prepare(&inputs, &expected).unwrap();
                    assert!(timed.time(3).unwrap() > Duration::ZERO);
                    let activations = 2 * op.activation_buffers() as u64 * 600 * dtype.size_in_bytes() as u64;
                    let expected_bytes = if provider == Provider::Copy {
                        activations
                    } else {
                        activations + 200 * dtype.size_in_bytes() as u64
                    };
                    assert_eq!(timed.bytes_per_call(), expected_bytes, "{provider:?} {op:?}");
                }
            }
        }
    }

    #[test]
    fn the_in_place_cpu_runner_restores_its_inputs_between_calls() {
        let inputs = small(BenchOp::FusedAddRmsNorm, DType::F16);
        let expected = inputs.expected().unwrap();
        let mut bench = CpuBench::new(&inputs, &expected).unwrap();
        bench.time(5).unwrap();
        let outputs = [bench.out().unwrap().clone(), bench.residual.clone().unwrap()];
        inputs.check("cpu", &outputs, &expected).expect("the fifth call computed what the first did");
    }

    #[test]
    fn a_wrong_result_is_caught_before_timing() {
        let inputs = small(BenchOp::RmsNorm, DType::F32);
        let wrong = vec![inputs.x.clone()];
        let err = Provider::Cpu.prepare(&inputs, &wrong).err().expect("mismatch");
        assert!(err.to_string().starts_with("cpu rms_norm f32 3x200: result differs from native"), "{err}");
    }

    #[test]
    fn unavailable_providers_say_why() {
        if !cfg!(feature = "candle") {
            let inputs = small(BenchOp::RmsNorm, DType::F32);
            let err = Provider::Candle.prepare(&inputs, &[]).err().expect("no candle");
            assert!(err.to_string().contains("feature `candle`"), "{err}");
        }
        if let Err(reason) = Provider::Cuda.availability() {
            assert!(!reason.is_empty());
        }
    }
}
