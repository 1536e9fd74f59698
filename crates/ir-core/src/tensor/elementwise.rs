//! Elementwise built-ins (`add`, `mul`, `scale`): compute in the compute dtype, round once, compact output.
//!
//! Device tensors are computed on the device where their backend has the kernel (`scale`:
//! [`DeviceBuffer::convert_strided`](crate::storage::DeviceBuffer::convert_strided), `add` and
//! `mul`: [`DeviceBuffer::binary_strided`](crate::storage::DeviceBuffer::binary_strided)); the rest
//! go through a host round trip (correct, slow, and counted by
//! [`host_round_trips`](crate::storage::host_round_trips)).

use super::storage_bytes;
use crate::storage::{BinaryOp, Storage};
use crate::{Tensor, TensorError};

impl Tensor {
    /// `self + other`, computed in the compute dtype and rounded once; compact output.
    pub fn add(&self, other: &Tensor) -> Result<Tensor, TensorError> {
        self.binary(BinaryOp::Add, other, |a, b| a + b)
    }

    /// `self * other`, computed in the compute dtype and rounded once; compact output.
    pub fn mul(&self, other: &Tensor) -> Result<Tensor, TensorError> {
        self.binary(BinaryOp::Mul, other, |a, b| a * b)
    }

    /// `self * factor`, computed in the compute dtype and rounded once; compact output.
    /// Device tensors are scaled on the device where the backend can
    /// ([`DeviceBuffer::convert_strided`](crate::storage::DeviceBuffer::convert_strided)).
    pub fn scale(&self, factor: f64) -> Result<Tensor, TensorError> {
        if let Storage::Device(src) = &self.storage.storage {
            let meta = self.meta.compact_like();
            let mut dst = src.allocate_for_overwrite(storage_bytes(&meta)?)?;
            if src.convert_strided(&self.meta, dst.as_mut(), &meta, Some(factor))? {
                return Tensor::from_storage(Storage::Device(dst), meta.dtype, meta.layout);
            }
        }
        self.note_round_trip("scale")?;
        let compute = self.dtype().compute_dtype();
        let factor = compute.round(factor);
        self.map_values(self.to_f64_vec()?.into_iter().map(|a| compute.round(a * factor)))
    }

    fn binary(&self, op: BinaryOp, other: &Tensor, f: impl Fn(f64, f64) -> f64) -> Result<Tensor, TensorError> {
        let operation = op.name();
        if self.shape() != other.shape() {
            return Err(TensorError::ShapeMismatch {
                operation,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
            });
        }
        if self.dtype() != other.dtype() {
            return Err(TensorError::DTypeMismatch { operation, lhs: self.dtype(), rhs: other.dtype() });
        }
        if self.device() != other.device() {
            return Err(TensorError::DeviceMismatch { operation, lhs: self.device(), rhs: other.device() });
        }
        if let (Storage::Device(a), Storage::Device(b)) = (&self.storage.storage, &other.storage.storage) {
            let meta = self.meta.compact_like();
            let mut dst = a.allocate_for_overwrite(storage_bytes(&meta)?)?;
            if a.binary_strided(&self.meta, b.as_ref(), &other.meta, op, dst.as_mut(), &meta)? {
                return Tensor::from_storage(Storage::Device(dst), meta.dtype, meta.layout);
            }
        }
        self.note_round_trip(operation)?;
        let compute = self.dtype().compute_dtype();
        let b = other.to_f64_vec()?;
        let values = self.to_f64_vec()?.into_iter().zip(b).map(|(x, y)| compute.round(f(x, y)));
        self.map_values(values)
    }

    /// Counts (or refuses) the host round trip `operation` makes when this tensor is on a device.
    fn note_round_trip(&self, operation: &'static str) -> Result<(), TensorError> {
        if !self.device().is_cpu() {
            crate::storage::note_host_round_trip(operation, self.device())?;
        }
        Ok(())
    }

    fn map_values(&self, values: impl Iterator<Item = f64>) -> Result<Tensor, TensorError> {
        // Values are exact in the compute dtype; one rounding to the element dtype follows.
        let values: Vec<f64> = values.collect();
        let host = Tensor::from_f64(self.dtype(), self.shape(), &values)?;
        if self.device().is_cpu() {
            return Ok(host);
        }
        host.to_device_of(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn rounds_once() {
        let a = Tensor::from_f64(DType::BF16, &[2], &[1.0, 3.0]).unwrap();
        let b = Tensor::from_f64(DType::BF16, &[2], &[2f64.powi(-8), 1.0]).unwrap();
        // 1 + 2^-8 computed in f32 is exact, then rounds to bf16 1.0 (tie to even).
        assert_eq!(a.add(&b).unwrap().to_f64_vec().unwrap(), vec![1.0, 4.0]);
        assert_eq!(a.mul(&b).unwrap().to_f64_vec().unwrap(), vec![2f64.powi(-8), 3.0]);
        assert_eq!(a.scale(0.5).unwrap().to_f64_vec().unwrap(), vec![0.5, 1.5]);
        let err = a.add(&Tensor::zeros(DType::F32, &[2]).unwrap()).unwrap_err();
        assert_eq!(err.to_string(), "add: dtypes bf16 and f32 differ");
        let err = a.mul(&Tensor::zeros(DType::BF16, &[3]).unwrap()).unwrap_err();
        assert_eq!(err.to_string(), "mul: shapes [2] and [3] differ");
    }

    #[test]
    fn output_is_compact() {
        let base = Tensor::zeros(DType::F32, &[4, 5]).unwrap();
        let columns = base.slice(1, 0, 3).unwrap();
        let scaled = columns.scale(2.0).unwrap();
        assert_eq!(scaled.strides(), &[3, 1]);
    }
}
