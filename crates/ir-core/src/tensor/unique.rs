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
    /// Wraps `tensor` if its storage is uniquely owned and its layout gives every element its own
    /// address ([`Layout::overlaps_itself`](crate::Layout::overlaps_itself)); gives it back
    /// otherwise.
    #[inline]
    pub fn new(tensor: Tensor) -> Result<UniqueTensor, Tensor> {
        if tensor.is_uniquely_owned() && !tensor.layout().overlaps_itself() {
            return Ok(UniqueTensor(tensor));
        }
        Err(tensor)
    }

    /// Wraps `tensor` if its storage is uniquely owned and its layout gives every element its own
    /// address; says why it may not be written otherwise.
    #[inline]
    pub(crate) fn writable(tensor: Tensor) -> Result<UniqueTensor, TensorError> {
        if !tensor.is_uniquely_owned() {
            return Err(tensor.write_refusal());
        }
        if tensor.layout().overlaps_itself() {
            return Err(TensorError::OverlappingLayout { meta: Box::new(tensor.meta().clone()) });
        }
        Ok(UniqueTensor(tensor))
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
