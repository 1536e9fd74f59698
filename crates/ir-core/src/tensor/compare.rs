//! Bit-exact and tolerance-based comparison of tensors.

use std::fmt;

use crate::{DType, Tensor, TensorError};

/// Same shape and dtype, identical bits in logical order. Tensors that cannot be read compare unequal.
pub fn bit_eq(a: &Tensor, b: &Tensor) -> bool {
    if a.shape() != b.shape() || a.dtype() != b.dtype() {
        return false;
    }
    match (logical_bytes(a), logical_bytes(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// The element bytes in logical order (a compact host copy).
fn logical_bytes(t: &Tensor) -> Result<Vec<u8>, TensorError> {
    let compact = t.to_cpu()?.contiguous()?;
    Ok(compact.cpu_buffer().expect("a host copy is on the host").bytes().to_vec())
}

/// Why [`allclose`] failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AllcloseError {
    /// The tensors cannot be compared element by element.
    #[error("cannot compare {actual_dtype}{actual:?} with {expected_dtype}{expected:?}: shapes differ")]
    ShapeMismatch {
        /// Shape of the actual tensor.
        actual: Vec<usize>,
        /// Shape of the expected tensor.
        expected: Vec<usize>,
        /// Dtype of the actual tensor.
        actual_dtype: DType,
        /// Dtype of the expected tensor.
        expected_dtype: DType,
    },
    /// A tensor could not be read.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// Elements outside the tolerance.
    #[error("{0}")]
    Mismatch(Mismatch),
}

/// A summary of the elements that failed a tolerance check.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// Number of failing elements.
    pub count: usize,
    /// Number of elements compared.
    pub total: usize,
    /// Largest absolute error over all elements (finite pairs only).
    pub max_abs: f64,
    /// Largest relative error over all elements (finite pairs only).
    pub max_rel: f64,
    /// Multi-index of the first failing element.
    pub first_index: Vec<usize>,
    /// Actual value there.
    pub actual: f64,
    /// Expected value there.
    pub expected: f64,
    /// Absolute tolerance used.
    pub atol: f64,
    /// Relative tolerance used.
    pub rtol: f64,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} elements differ beyond atol {:e} + rtol {:e}; largest absolute error {:e}, \
             largest relative error {:e}; first at {:?}: {} vs expected {}",
            self.count,
            self.total,
            self.atol,
            self.rtol,
            self.max_abs,
            self.max_rel,
            self.first_index,
            self.actual,
            self.expected
        )
    }
}

/// Each element passes iff |a − e| ≤ atol + rtol·|e| (in f64); NaN passes only against NaN and ±inf
/// only against the same infinity.
pub fn allclose(actual: &Tensor, expected: &Tensor, atol: f64, rtol: f64) -> Result<(), AllcloseError> {
    if actual.shape() != expected.shape() {
        return Err(AllcloseError::ShapeMismatch {
            actual: actual.shape().to_vec(),
            expected: expected.shape().to_vec(),
            actual_dtype: actual.dtype(),
            expected_dtype: expected.dtype(),
        });
    }
    let a = actual.to_f64_vec()?;
    let e = expected.to_f64_vec()?;
    let mut mismatch: Option<Mismatch> = None;
    let mut max_abs = 0.0f64;
    let mut max_rel = 0.0f64;
    let mut count = 0;
    for (i, (&x, &y)) in a.iter().zip(&e).enumerate() {
        let passes = if x.is_nan() || y.is_nan() {
            x.is_nan() && y.is_nan()
        } else if x.is_infinite() || y.is_infinite() {
            x == y
        } else {
            let abs = (x - y).abs();
            max_abs = max_abs.max(abs);
            if y != 0.0 {
                max_rel = max_rel.max(abs / y.abs());
            }
            abs <= atol + rtol * y.abs()
        };
        if passes {
            continue;
        }
        count += 1;
        if mismatch.is_none() {
            mismatch = Some(Mismatch {
                count: 0,
                total: a.len(),
                max_abs: 0.0,
                max_rel: 0.0,
                first_index: unravel(i, actual.shape()),
                actual: x,
                expected: y,
                atol,
                rtol,
            });
        }
    }
    match mismatch {
        None => Ok(()),
        Some(mismatch) => Err(AllcloseError::Mismatch(Mismatch { count, max_abs, max_rel, ..mismatch })),
    }
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (slot, &size) in index.iter_mut().zip(shape).rev() {
        *slot = flat % size;
        flat /= size;
    }
    index
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(values: &[f64]) -> Tensor {
        Tensor::from_f64(DType::F64, &[values.len()], values).unwrap()
    }

    #[test]
    fn tolerance_rule() {
        assert!(allclose(&t(&[1.0, 100.0]), &t(&[1.0005, 100.05]), 1e-3, 1e-3).is_ok());
        let err = allclose(&t(&[1.0, 2.0, 3.0]), &t(&[1.0, 2.1, 3.2]), 1e-3, 1e-3).unwrap_err();
        let AllcloseError::Mismatch(m) = err else { panic!("expected a mismatch, got {err}") };
        assert_eq!(m.count, 2);
        assert_eq!(m.first_index, vec![1]);
        assert!((m.max_abs - 0.2).abs() < 1e-12);
        assert!(m.to_string().starts_with("2 of 3 elements differ"), "{m}");
    }

    #[test]
    fn special_values() {
        assert!(allclose(&t(&[f64::NAN]), &t(&[f64::NAN]), 0.0, 0.0).is_ok());
        assert!(allclose(&t(&[f64::NAN]), &t(&[1.0]), 1.0, 1.0).is_err());
        assert!(allclose(&t(&[1.0]), &t(&[f64::NAN]), 1.0, 1.0).is_err());
        assert!(allclose(&t(&[f64::INFINITY]), &t(&[f64::INFINITY]), 0.0, 0.0).is_ok());
        assert!(allclose(&t(&[f64::INFINITY]), &t(&[f64::NEG_INFINITY]), 1.0, 1.0).is_err());
        assert!(allclose(&t(&[1e300]), &t(&[f64::INFINITY]), 1.0, 1.0).is_err());
    }

    #[test]
    fn bit_equality() {
        assert!(bit_eq(&t(&[0.0, 1.0]), &t(&[0.0, 1.0])));
        assert!(!bit_eq(&t(&[-0.0]), &t(&[0.0])));
        assert!(!bit_eq(&t(&[1.0]), &Tensor::from_f64(DType::F32, &[1], &[1.0]).unwrap()));
        assert!(!bit_eq(&t(&[1.0, 2.0]), &t(&[1.0])));
    }
}
