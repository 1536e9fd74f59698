//! The `unfused` baseline of the norm + quantization ops: the cpu provider's norm kernel, its output
//! stored, then the cpu quantization kernel reading it back, on the fused op's own inputs. Beside the
//! fused `cpu` row it shows what fusion saves; its throughput is computed from the fused op's bytes
//! (so the two rows compare times), and [`UnfusedBench::pair_bytes`] counts what the pair moves.

use std::time::{Duration, Instant};

use ir_core::op::Value;
use ir_core::{Tensor, UniqueTensor};
use kernels_cpu::quant::{dynamic_per_token_scaled_fp8_quant_cpu, static_scaled_fp8_quant_cpu};
use kernels_cpu::{fused_add_rms_norm_cpu, rms_norm_cpu_into};

use crate::BenchError;
use crate::cases::{Inputs, Timed};

/// The ops with an unfused baseline.
pub const UNFUSED_OPS: [&str; 4] = [
    "rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_quant",
    "fused_add_rms_norm_static_fp8_quant",
    "fused_add_rms_norm_dynamic_per_token_quant",
];

/// Which pair runs.
enum Pair {
    /// `rms_norm` into a preallocated output, then the static or per-token quantization.
    Norm { x: Tensor, weight: Option<Tensor>, out: Tensor, dynamic: bool },
    /// `fused_add_rms_norm` in place on copies of x and the residual (reset before each call,
    /// outside the timed region), then the static or per-token quantization.
    FusedAdd { x: Tensor, residual: Tensor, weight: Option<Tensor>, pristine: Box<(Tensor, Tensor)>, dynamic: bool },
}

/// The unfused pair on the cpu provider.
pub struct UnfusedBench {
    pair: Pair,
    epsilon: f64,
    /// The static scale or the per-token bound.
    scale: Option<Tensor>,
    out_dtype: ir_core::DType,
    /// The fused op's `rounding`, which both calls of the pair take.
    rounding: ir_ops::Rounding,
    bytes: u64,
}

fn tensor(values: &[Value], index: usize) -> Option<Tensor> {
    values.get(index).and_then(Value::as_tensor).cloned()
}

fn missing(what: &str) -> BenchError {
    BenchError::Kernel(ir_core::KernelError::InvalidArguments { reason: format!("unfused baseline: no `{what}`") })
}

impl UnfusedBench {
    /// Prepares the pair on `inputs` and checks its result against native's.
    pub fn new(inputs: &Inputs) -> Result<UnfusedBench, BenchError> {
        let v = &inputs.values;
        let f64_at = |i: usize| match v.get(i) {
            Some(Value::F64(e)) => Ok(*e),
            _ => Err(missing("epsilon")),
        };
        let dtype_at = |i: usize| match v.get(i) {
            Some(Value::DType(d)) => Ok(*d),
            _ => Err(missing("out_dtype")),
        };
        let rounding_at = |i: usize| match v.get(i) {
            Some(Value::Str(r)) => {
                <ir_ops::Rounding as ir_core::op::StrEnum>::from_str(r).ok_or_else(|| missing("rounding"))
            }
            _ => Err(missing("rounding")),
        };
        let (pair, epsilon, scale, out_dtype, rounding) = match inputs.case.op.name {
            "rms_norm_static_fp8_quant" | "rms_norm_dynamic_per_token_quant" => {
                let x = tensor(v, 0).ok_or_else(|| missing("x"))?.deep_clone()?;
                let out = Tensor::zeros(x.dtype(), x.shape())?;
                let dynamic = inputs.case.op.name == "rms_norm_dynamic_per_token_quant";
                let pair = Pair::Norm { x, weight: tensor(v, 1), out, dynamic };
                (pair, f64_at(2)?, tensor(v, 3), dtype_at(4)?, rounding_at(5)?)
            }
            "fused_add_rms_norm_static_fp8_quant" | "fused_add_rms_norm_dynamic_per_token_quant" => {
                let x = tensor(v, 0).ok_or_else(|| missing("x"))?;
                let residual = tensor(v, 1).ok_or_else(|| missing("x_residual"))?;
                let pristine = Box::new((x.deep_clone()?, residual.deep_clone()?));
                let pair = Pair::FusedAdd {
                    x: x.deep_clone()?,
                    residual: residual.deep_clone()?,
                    weight: tensor(v, 2),
                    pristine,
                    dynamic: inputs.case.op.name == "fused_add_rms_norm_dynamic_per_token_quant",
                };
                (pair, f64_at(3)?, tensor(v, 4), dtype_at(5)?, rounding_at(6)?)
            }
            other => return Err(missing(&format!("pair for {other}"))),
        };
        let mut bench = UnfusedBench { pair, epsilon, scale, out_dtype, rounding, bytes: inputs.bytes_moved() };
        {
            let outputs = bench.call()?;
            inputs.check("unfused", &outputs)?;
        }
        bench.reset()?;
        Ok(bench)
    }

    /// Bytes the pair moves: the fused op's, plus the normalized tensor written and read back.
    pub fn pair_bytes(inputs: &Inputs) -> u64 {
        let x = inputs.values.first().and_then(Value::as_tensor);
        inputs.bytes_moved() + x.map_or(0, |x| 2 * (x.numel() * x.dtype().size_in_bytes()) as u64)
    }

    fn reset(&mut self) -> Result<(), BenchError> {
        if let Pair::FusedAdd { x, residual, pristine, .. } = &mut self.pair {
            x.copy_from(&pristine.0)?;
            residual.copy_from(&pristine.1)?;
        }
        Ok(())
    }

    /// One call of the pair; returns the fused op's outputs.
    fn call(&mut self) -> Result<Vec<Tensor>, BenchError> {
        let (epsilon, out_dtype, rounding) = (self.epsilon, self.out_dtype, self.rounding);
        let quantize =
            |normalized: &Tensor, scale: Option<&Tensor>, dynamic: bool| -> Result<Vec<Tensor>, BenchError> {
                if dynamic {
                    let (q, scales) = dynamic_per_token_scaled_fp8_quant_cpu(normalized, scale, out_dtype)?;
                    return Ok(vec![q, scales]);
                }
                Ok(vec![static_scaled_fp8_quant_cpu(
                    normalized,
                    scale.ok_or_else(|| missing("scale"))?,
                    out_dtype,
                    rounding,
                )?])
            };
        match &mut self.pair {
            Pair::Norm { x, weight, out, dynamic } => {
                rms_norm_cpu_into(x, weight.as_ref(), epsilon, None, out)?;
                quantize(out, self.scale.as_ref(), *dynamic)
            }
            Pair::FusedAdd { x, residual, weight, dynamic, .. } => {
                // The kernel takes unique ownership; the tensors come back as its outputs.
                let x_owned = std::mem::replace(x, Tensor::zeros(x.dtype(), &[0])?);
                let r_owned = std::mem::replace(residual, Tensor::zeros(x_owned.dtype(), &[0])?);
                let unique = |t: Tensor| UniqueTensor::new(t).map_err(|_| missing("a uniquely owned activation"));
                let (out, sum) = fused_add_rms_norm_cpu(
                    unique(x_owned)?,
                    unique(r_owned)?,
                    weight.as_ref(),
                    epsilon,
                    None,
                    rounding,
                )?;
                let quantized = quantize(&out, self.scale.as_ref(), *dynamic)?;
                *x = out;
                *residual = sum.clone();
                Ok(std::iter::once(sum).chain(quantized).collect())
            }
        }
    }
}

impl Timed for UnfusedBench {
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError> {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            self.reset()?;
            let start = Instant::now();
            std::hint::black_box(self.call()?);
            total += start.elapsed();
        }
        Ok(total)
    }

    fn bytes_per_call(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{Case, Provider, Shape};

    /// Each pair prepares (its result checked against native), runs, and is offered for exactly the
    /// four norm + quantization ops; the fused-add pair restores its in-place inputs between calls.
    #[test]
    fn every_pair_matches_native_and_runs_repeatedly() {
        let registry = ir_ops::registry();
        kernels_cpu::register(&registry).unwrap();
        for def in ir_ops::BUILTIN_OPS {
            let offered = Provider::for_op(&registry, def).contains(&Provider::Unfused);
            assert_eq!(offered, UNFUSED_OPS.contains(&def.name), "{}", def.name);
        }
        for name in UNFUSED_OPS {
            let op = registry.op_def(name).unwrap();
            for dtype in [ir_core::DType::BF16, ir_core::DType::F32] {
                // Seeds 7 and 8: both roundings.
                for seed in [7, 8] {
                    let inputs = Inputs::generate(Case { op, shape: Shape::new(300, 256), dtype }, seed).unwrap();
                    let mut bench =
                        UnfusedBench::new(&inputs).unwrap_or_else(|e| panic!("{name} {dtype} seed {seed}: {e}"));
                    bench.time(3).unwrap();
                    assert!(UnfusedBench::pair_bytes(&inputs) > bench.bytes_per_call());
                }
            }
        }
    }
}
