//! The cases the benchmarks run and what a runner is: shapes, dtypes and cases (op × shape ×
//! dtype), each case's generated inputs with native's outputs and the check against them, the bytes
//! a call moves, and the `Timed` runner every provider's benchmark implements ([`crate::kernels`]
//! builds them; [`crate::unfused`] and the candle baseline are runners too).

use std::fmt;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use ir_core::op::{InputSpec, OpDef, Value, tolerance};
use ir_core::{DType, Tensor, allclose};

use crate::BenchError;

/// The epsilon of every case.
pub const EPSILON: f64 = 1e-6;

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

    /// Whether this is a decode shape (T ≤ 64: launch-bound on GPUs).
    pub fn is_decode(self) -> bool {
        self.tokens <= 64
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.tokens, self.hidden)
    }
}

/// The decode shapes (1×4096, 8×4096, 64×8192), and 256×4096 (a large decode batch).
pub const DECODE_SHAPES: [Shape; 4] =
    [Shape::new(1, 4096), Shape::new(16, 4096), Shape::new(64, 8192), Shape::new(256, 4096)];
/// The prefill shapes.
pub const PREFILL_SHAPES: [Shape; 2] = [Shape::new(4096, 4096), Shape::new(2048, 8192)];
/// The shape GPUs add.
pub const GPU_SHAPE: Shape = Shape::new(16384, 8192);
/// The dtypes.
pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// One benchmark case.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// The op.
    pub op: &'static OpDef,
    /// Tokens and hidden size, as the op's input generator reads them.
    pub shape: Shape,
    /// The dtype of every tensor.
    pub dtype: DType,
}

impl PartialEq for Case {
    fn eq(&self, other: &Case) -> bool {
        (self.op.name, self.shape, self.dtype) == (other.op.name, other.shape, other.dtype)
    }
}

impl Eq for Case {}

impl Hash for Case {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.op.name, self.shape, self.dtype).hash(state);
    }
}

impl Case {
    /// The criterion group name: `kernels/<op>/<dtype>/<shape>`.
    pub fn group(&self) -> String {
        format!("kernels/{}/{}/{}", self.op.name, self.dtype, self.shape)
    }

    /// The criterion group name in the hidden-size sweep: `sweep/<op>/<dtype>/<shape>`.
    pub fn sweep_group(&self) -> String {
        format!("sweep/{}/{}/{}", self.op.name, self.dtype, self.shape)
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.op.name, self.dtype, self.shape)
    }
}

/// Bytes a call must move: every tensor argument read once and every output written once. For the
/// norms this is `rms_norm` 2·T·H·s + H·s_w, `fused_add_rms_norm` 4·T·H·s + H·s_w; for a
/// gated activation on `[T, 2H]`, 3·T·H·s.
pub fn bytes_moved(args: &[Value], outputs: &[Tensor]) -> u64 {
    let bytes = |t: &Tensor| (t.numel() * t.dtype().size_in_bytes()) as u64;
    args.iter().filter_map(Value::as_tensor).map(bytes).sum::<u64>() + outputs.iter().map(bytes).sum::<u64>()
}

/// The CPU cases: every op × shape × dtype, or (quick) 1×4096 and 4096×4096 in f32 and bf16,
/// the shapes and dtypes the targets name.
pub fn cpu_cases(ops: &[&'static OpDef], quick: bool) -> Vec<Case> {
    let (shapes, dtypes): (Vec<Shape>, Vec<DType>) = if quick {
        (vec![DECODE_SHAPES[0], PREFILL_SHAPES[0]], vec![DType::F32, DType::BF16])
    } else {
        (DECODE_SHAPES.iter().chain(&PREFILL_SHAPES).copied().collect(), DTYPES.to_vec())
    };
    cases(ops, &shapes, &dtypes)
}

/// The GPU cases: the CPU shapes plus 16384×8192; bf16 everywhere, f32 and f16 too unless quick.
pub fn gpu_cases(ops: &[&'static OpDef], quick: bool) -> Vec<Case> {
    let shapes: Vec<Shape> = DECODE_SHAPES.iter().chain(&PREFILL_SHAPES).chain([&GPU_SHAPE]).copied().collect();
    let dtypes = if quick { vec![DType::BF16] } else { DTYPES.to_vec() };
    cases(ops, &shapes, &dtypes)
}

/// Elements per activation in the hidden-size sweep (32 MB in bf16, the size of 4096 × 4096, so the
/// data streams from memory rather than from a large last-level cache).
pub const SWEEP_ELEMENTS: usize = 16 << 20;

/// The hidden-size sweep: every op in bf16 at T·H = [`SWEEP_ELEMENTS`], H from 256 to 16384 (quick:
/// 512, 2048, 8192), for the plot of bandwidth against hidden size.
pub fn sweep_cases(ops: &[&'static OpDef], quick: bool) -> Vec<Case> {
    let hidden: &[usize] = if quick { &[512, 2048, 8192] } else { &[256, 512, 1024, 2048, 4096, 8192, 16384] };
    let shapes: Vec<Shape> = hidden.iter().map(|&h| Shape::new(SWEEP_ELEMENTS / h, h)).collect();
    cases(ops, &shapes, &[DType::BF16])
}

fn cases(ops: &[&'static OpDef], shapes: &[Shape], dtypes: &[DType]) -> Vec<Case> {
    let mut out = Vec::new();
    for &op in ops {
        for &dtype in dtypes {
            for &shape in shapes {
                out.push(Case { op, shape, dtype });
            }
        }
    }
    out
}

/// A case's host arguments (from the op's own generator) and native's outputs on them.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// The case.
    pub case: Case,
    /// The bound arguments.
    pub values: Vec<Value>,
    /// Native's outputs.
    pub expected: Vec<Tensor>,
}

impl Inputs {
    /// Generates the arguments of `case` from `seed` and runs native on them.
    pub fn generate(case: Case, seed: u64) -> Result<Inputs, BenchError> {
        let spec = InputSpec {
            num_tokens: case.shape.tokens,
            hidden_size: case.shape.hidden,
            dtype: case.dtype,
            epsilon: EPSILON,
            seed,
        };
        let values = (case.op.generate_inputs)(&spec)?;
        let expected = (case.op.native)(&values)?.into_vec();
        Ok(Inputs { case, values, expected })
    }

    /// The tensor argument at `index` (generated arguments of the built-in ops are tensors there).
    pub fn tensor(&self, index: usize) -> &Tensor {
        self.values[index].as_tensor().expect("a tensor argument")
    }

    /// The activation tensors (what `maybe_inplace` donates), in order.
    pub fn activations(&self) -> impl Iterator<Item = &Tensor> {
        let indices = self.case.op.activation_indices().unwrap_or_default();
        indices.into_iter().filter_map(|i| self.values.get(i).and_then(Value::as_tensor))
    }

    /// Bytes one call moves ([`bytes_moved`]).
    pub fn bytes_moved(&self) -> u64 {
        bytes_moved(&self.values, &self.expected)
    }

    /// Bytes of the activations.
    pub fn activation_bytes(&self) -> usize {
        self.activations().map(|t| t.numel() * t.dtype().size_in_bytes()).sum()
    }

    /// Compares `actual` with native's outputs within the op's tolerance for the dtype.
    pub fn check(&self, provider: &str, actual: &[Tensor]) -> Result<(), BenchError> {
        let mismatch = |detail: String| BenchError::Mismatch {
            provider: provider.to_owned(),
            case: self.case.to_string(),
            detail,
        };
        if actual.len() != self.expected.len() {
            return Err(mismatch(format!("{} outputs, expected {}", actual.len(), self.expected.len())));
        }
        for (i, (a, e)) in actual.iter().zip(&self.expected).enumerate() {
            // Each output in its own dtype's tolerance (a quantized output in fp8's).
            let tol = tolerance(self.case.op, e.dtype()).map_err(|e| mismatch(e.to_string()))?;
            let a = a.to_cpu()?;
            allclose(&a, e, tol.atol, tol.rtol).map_err(|err| mismatch(format!("output {i}: {err}")))?;
        }
        Ok(())
    }
}

/// A prepared runner.
pub trait Timed {
    /// Runs the kernel `iters` times and returns the time they took (device work included), setup
    /// between calls excluded.
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError>;

    /// Bytes one call moves, for throughput (the copy baseline moves only the activations).
    fn bytes_per_call(&self) -> u64;
}

/// Times `iters` calls of `call`, its results dropped inside the timed region (their allocation is
/// part of the call).
#[cfg_attr(not(feature = "candle"), allow(dead_code))]
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
