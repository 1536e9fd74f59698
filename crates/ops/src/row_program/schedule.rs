//! The passes of a row: which steps run where.

use super::{Extent, Op, RowProgram, ValueId};

/// Which steps run in which pass of a row ([`RowProgram::schedule`]): what every executor that
/// walks a row in passes follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Per step: the pass after which its value exists (element steps: the pass they run in; a
    /// reduction: one past its operand's).
    pub phase: Vec<usize>,
    /// Per pass: the element steps it runs, in step order.
    pub elements: Vec<Vec<usize>>,
    /// Per pass: the reductions it accumulates.
    pub reductions: Vec<Vec<usize>>,
}

impl RowProgram {
    /// The passes a row needs: one more than the longest chain of reductions that depend on each
    /// other. A pass runs the element steps its reductions (and, in the last pass, the element
    /// outputs) need, recomputing earlier passes' element steps from the loads; a row step runs
    /// once its operands exist; a reduction accumulates in the pass where its operand and its count
    /// exist, and its value exists from the next.
    pub fn schedule(&self) -> Schedule {
        let program = self;
        let steps = program.steps();
        let mut phase = vec![0usize; steps.len()];
        // The pass a reduction accumulates in: once its operand and its count exist.
        let mut accumulates = vec![0usize; steps.len()];
        for (index, step) in steps.iter().enumerate() {
            let of = |v: ValueId| phase[v.0 as usize];
            phase[index] = match step.op {
                Op::Unary(_, x) | Op::Pair { x, .. } => of(x),
                Op::Binary(_, a, b) => of(a).max(of(b)),
                Op::Reduce { x, count, .. } => {
                    accumulates[index] = of(x).max(count.map_or(0, of));
                    accumulates[index] + 1
                }
                _ => 0,
            };
        }
        let element_outputs: Vec<usize> = program
            .outputs()
            .iter()
            .map(|o| o.value.0 as usize)
            .filter(|&v| steps[v].extent == Extent::Element)
            .collect();
        let is_reduction = |index: usize| matches!(steps[index].op, Op::Reduce { .. });
        let last = element_outputs
            .iter()
            .map(|&v| phase[v])
            .chain((0..steps.len()).filter(|&s| is_reduction(s)).map(|s| accumulates[s]))
            .max()
            .unwrap_or(0);
        let mut elements = vec![Vec::new(); last + 1];
        let mut reductions = vec![Vec::new(); last + 1];
        for pass in 0..=last {
            let mut needed = vec![false; steps.len()];
            let mut roots: Vec<usize> = Vec::new();
            for (index, step) in steps.iter().enumerate() {
                if let Op::Reduce { x, .. } = step.op
                    && accumulates[index] == pass
                {
                    reductions[pass].push(index);
                    roots.push(x.0 as usize);
                }
            }
            if pass == last {
                roots.extend(&element_outputs);
            }
            while let Some(step) = roots.pop() {
                if needed[step] || steps[step].extent != Extent::Element {
                    continue;
                }
                needed[step] = true;
                match steps[step].op {
                    Op::Unary(_, x) | Op::Pair { x, .. } => roots.push(x.0 as usize),
                    Op::Binary(_, a, b) => roots.extend([a.0 as usize, b.0 as usize]),
                    _ => {}
                }
            }
            elements[pass] = (0..steps.len()).filter(|&s| needed[s]).collect();
        }
        Schedule { phase, elements, reductions }
    }
}

/// Significant bits of `dtype`'s values (24 for f32; 53 for f64 and what is not a float).
fn significant_bits(dtype: ir_core::DType) -> u32 {
    use ir_core::DType;
    match dtype {
        DType::F32 => 24,
        DType::F16 => 11,
        DType::BF16 => 8,
        DType::F8E4M3FN => 4,
        DType::F8E5M2 => 3,
        _ => 53,
    }
}

impl RowProgram {
    /// Per step, for a call bound as `binding`: whether its operation on its operands is exact in
    /// f32, so an executor that computes it in f32 and then rounds to a narrower precision rounds
    /// once, as the reference does (it computes in `f64`). True for the operations that return an
    /// operand (`round`, `neg`, `abs`, `relu`, `min`, `max`, `pair`), for loads (a cache's too) and for a product whose operands'
    /// significant bits (their dtype's, or their precision's) add up to at most 24 (barring a
    /// product beyond f32's range, which f32 turns into an infinity or a subnormal first: bf16
    /// operands near its limits, as the hand-written kernels' f32 products do); an executor computes
    /// the other steps rounded to f16, bf16 or fp8 in `f64`.
    pub fn exact_in_f32(&self, binding: &super::Binding) -> Vec<bool> {
        use super::{BinaryOp, Precision, UnaryOp};
        let steps = self.steps();
        let mut bits = vec![53u32; steps.len()];
        let mut exact = vec![false; steps.len()];
        for (index, step) in steps.iter().enumerate() {
            let of = |v: ValueId| bits[v.0 as usize];
            let (operation_bits, is_exact) = match step.op {
                Op::Load { input, .. } | Op::Weight { input } | Op::Cos { cache: input } | Op::Sin { cache: input } => {
                    let dtype = binding.dtypes.get(input).copied().flatten().unwrap_or(binding.compute);
                    (significant_bits(dtype), true)
                }
                Op::Unary(UnaryOp::Round | UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu, x) | Op::Pair { x, .. } => {
                    (of(x), true)
                }
                Op::Binary(BinaryOp::Min | BinaryOp::Max, a, b) => (of(a).max(of(b)), true),
                Op::Binary(BinaryOp::Mul, a, b) => (of(a) + of(b), of(a) + of(b) <= 24),
                _ => (53, false),
            };
            let rounded = match binding.precision_dtype(step.precision) {
                Some(dtype) => significant_bits(dtype).min(operation_bits),
                None => operation_bits,
            };
            bits[index] = match step.precision {
                Precision::Wide => operation_bits,
                _ => rounded,
            };
            exact[index] = is_exact;
        }
        exact
    }
}
