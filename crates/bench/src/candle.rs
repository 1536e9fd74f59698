//! candle-nn's CPU `rms_norm` on the same data (feature `candle`): the fused op is candle's `add`
//! then `rms_norm`, both allocating their outputs (candle's API has no other form).

use std::time::Duration;

use candle_core::{DType as CandleDType, Device, Tensor as CandleTensor};
use ir_core::{DType, Tensor};

use crate::BenchError;
use crate::cases::{EPSILON, Inputs, Timed, time_calls};

pub(crate) struct CandleBench {
    fused: bool,
    x: CandleTensor,
    residual: CandleTensor,
    weight: CandleTensor,
    bytes: u64,
}

fn candle_error(e: candle_core::Error) -> BenchError {
    BenchError::Unavailable { provider: "candle".to_owned(), reason: e.to_string() }
}

fn to_candle(t: &Tensor) -> Result<CandleTensor, BenchError> {
    let values: Vec<f32> = t.to_f64_vec()?.into_iter().map(|v| v as f32).collect();
    let dtype = match t.dtype() {
        DType::F32 => CandleDType::F32,
        DType::F16 => CandleDType::F16,
        DType::BF16 => CandleDType::BF16,
        DType::F64 => CandleDType::F64,
        other => {
            let reason = format!("the candle baseline compares norms of f32, f16, bf16 and f64, not {other}");
            return Err(BenchError::Unavailable { provider: "candle".to_owned(), reason });
        }
    };
    CandleTensor::from_vec(values, t.shape(), &Device::Cpu).and_then(|c| c.to_dtype(dtype)).map_err(candle_error)
}

fn from_candle(c: &CandleTensor, dtype: DType) -> Result<Tensor, BenchError> {
    let values: Vec<f32> =
        c.to_dtype(CandleDType::F32).and_then(|c| c.flatten_all()).and_then(|c| c.to_vec1()).map_err(candle_error)?;
    Ok(Tensor::from_f32(dtype, c.dims(), &values)?)
}

impl CandleBench {
    pub(crate) fn new(inputs: &Inputs) -> Result<CandleBench, BenchError> {
        // rms_norm(x, weight, …) and fused_add_rms_norm(x, x_residual, weight, …).
        let fused = match inputs.case.op.name {
            "rms_norm" => false,
            "fused_add_rms_norm" => true,
            other => {
                let reason = format!("candle has no counterpart of {other}");
                return Err(BenchError::Unavailable { provider: "candle".to_owned(), reason });
            }
        };
        let (residual, weight) = if fused { (1, 2) } else { (0, 1) };
        let bench = CandleBench {
            fused,
            x: to_candle(inputs.tensor(0))?,
            residual: to_candle(inputs.tensor(residual))?,
            weight: to_candle(inputs.tensor(weight))?,
            bytes: inputs.bytes_moved(),
        };
        let outputs = bench.call()?;
        let outputs: Vec<Tensor> =
            outputs.iter().map(|c| from_candle(c, inputs.case.dtype)).collect::<Result<_, _>>()?;
        inputs.check("candle", &outputs)?;
        Ok(bench)
    }

    fn call(&self) -> Result<Vec<CandleTensor>, BenchError> {
        let eps = EPSILON as f32;
        if !self.fused {
            return Ok(vec![candle_nn::ops::rms_norm(&self.x, &self.weight, eps).map_err(candle_error)?]);
        }
        let sum = (&self.x + &self.residual).map_err(candle_error)?;
        let out = candle_nn::ops::rms_norm(&sum, &self.weight, eps).map_err(candle_error)?;
        Ok(vec![out, sum])
    }
}

impl Timed for CandleBench {
    fn time(&mut self, iters: u64) -> Result<Duration, BenchError> {
        time_calls(iters, || self.call())
    }

    fn bytes_per_call(&self) -> u64 {
        self.bytes
    }
}
