//! A tensor an in-place kernel may write.

use crate::storage::Storage;
use crate::{Tensor, TensorError};

/// A tensor whose storage was uniquely owned when the dispatcher handed it to an in-place kernel.
///
/// In-place implementations receive their activations as `UniqueTensor`s, so the precondition of the
/// in-place contract is in the type. It does not implement `Clone`.
#[derive(Debug)]
pub struct UniqueTensor(Tensor);

impl UniqueTensor {
    /// Wraps `tensor` if its storage is uniquely owned; gives it back otherwise.
    #[inline]
    pub fn new(tensor: Tensor) -> Result<UniqueTensor, Tensor> {
        if tensor.is_uniquely_owned() {
            return Ok(UniqueTensor(tensor));
        }
        Err(tensor)
    }

    /// Wraps `tensor` if its storage is uniquely owned; says why it may not be written otherwise.
    #[inline]
    pub(crate) fn writable(tensor: Tensor) -> Result<UniqueTensor, TensorError> {
        if tensor.is_uniquely_owned() {
            return Ok(UniqueTensor(tensor));
        }
        Err(tensor.write_refusal())
    }

    /// The tensor, for reading metadata and data.
    #[inline]
    pub fn tensor(&self) -> &Tensor {
        &self.0
    }

    /// The storage, for writing. Fails only if the kernel made another handle in the meantime.
    pub fn storage_mut(&mut self) -> Result<&mut Storage, TensorError> {
        self.0.storage_mut()
    }

    /// Unwraps the tensor (the kernel's output).
    #[inline]
    pub fn into_tensor(self) -> Tensor {
        self.0
    }
}
