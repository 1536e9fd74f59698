//! candle-nn's CPU `rms_norm` on the same data (feature `candle`): the fused op is candle's `add`
//! then `rms_norm`, both allocating their outputs (candle's API has no other form).

use std::time::Duration;

use candle_core::{DType as CandleDType, Device, Tensor as CandleTensor};
use ir_core::{DType, Tensor};

use crate::BenchError;
use crate::kernels::{BenchOp, EPSILON, Inputs, Timed, time_calls};

pub(crate) struct CandleBench {
    op: BenchOp,
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
    };
    CandleTensor::from_vec(values, t.shape(), &Device::Cpu).and_then(|c| c.to_dtype(dtype)).map_err(candle_error)
}

fn from_candle(c: &CandleTensor, dtype: DType) -> Result<Tensor, BenchError> {
    let values: Vec<f32> =
        c.to_dtype(CandleDType::F32).and_then(|c| c.flatten_all()).and_then(|c| c.to_vec1()).map_err(candle_error)?;
    Ok(Tensor::from_f32(dtype, c.dims(), &values)?)
}

impl CandleBench {
    pub(crate) fn new(inputs: &Inputs, expected: &[Tensor]) -> Result<CandleBench, BenchError> {
        let bench = CandleBench {
            op: inputs.case.op,
            x: to_candle(&inputs.x)?,
            residual: to_candle(&inputs.residual)?,
            weight: to_candle(&inputs.weight)?,
            bytes: inputs.case.bytes_moved(),
        };
        let outputs = bench.call()?;
        let outputs: Vec<Tensor> =
            outputs.iter().map(|c| from_candle(c, inputs.case.dtype)).collect::<Result<_, _>>()?;
        inputs.check("candle", &outputs, expected)?;
        Ok(bench)
    }

    fn call(&self) -> Result<Vec<CandleTensor>, BenchError> {
        let eps = EPSILON as f32;
        match self.op {
            BenchOp::RmsNorm => Ok(vec![candle_nn::ops::rms_norm(&self.x, &self.weight, eps).map_err(candle_error)?]),
            BenchOp::FusedAddRmsNorm => {
                let sum = (&self.x + &self.residual).map_err(candle_error)?;
                let out = candle_nn::ops::rms_norm(&sum, &self.weight, eps).map_err(candle_error)?;
                Ok(vec![out, sum])
            }
        }
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
