//! Exchanging tensors with other libraries: candle (feature `candle`) and DLPack (feature
//! `dlpack`, through the `dlpark` crate), so PyTorch or any DLPack producer can hand tensors over.
//!
//! | conversion | without a copy when | otherwise |
//! |---|---|---|
//! | [`Tensor::from_vec`] / [`Tensor::into_vec`] | always / the tensor owns its vector alone, compactly | copies |
//! | `Tensor::into_candle` | the tensor owns its storage alone and is compact from some offset | copies |
//! | `Tensor::from_candle_shared` (`unsafe`) | the candle tensor is on the CPU, any strides | — |
//! | `Tensor::from_candle` | never (safe, copies) | copies |
//! | `Tensor::from_dlpack` | the DLPack tensor is in CPU memory, aligned, non-negative strides | an error naming the problem |
//! | `Tensor::to_dlpack` | always (shares the storage; read-only unless the tensor owned it alone) | — |
//!
//! Memory another library lends stays owned by it: the tensor keeps the lender (the candle tensor,
//! the DLPack capsule) alive and drops it with its last view. Memory lent read-only is never written:
//! an in-place call copies it first (`maybe_inplace`) or is refused (`copy_`, in-place kernels),
//! exactly as for a shared storage.
//!
//! [`Tensor::from_vec`]: crate::Tensor::from_vec
//! [`Tensor::into_vec`]: crate::Tensor::into_vec

#[cfg(feature = "candle")]
mod candle;
#[cfg(feature = "dlpack")]
mod dlpack;

use crate::TensorError;

/// An exchange with another library that could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InteropError {
    /// An element type one side has and the other lacks (candle's `u32`, this crate's `f8e5m2` in candle).
    #[error("dtype {dtype} has no counterpart between {library} and vllm-ir")]
    UnsupportedDType {
        /// The other library.
        library: &'static str,
        /// Its name of the dtype.
        dtype: String,
    },
    /// Memory this conversion cannot reach.
    #[error("{library} tensor on {device}: only host memory converts here ({hint})")]
    UnsupportedDevice {
        /// The other library.
        library: &'static str,
        /// Its name of the device.
        device: String,
        /// What to do instead.
        hint: &'static str,
    },
    /// A layout this crate cannot express (a negative stride, for instance).
    #[error("{library} layout not supported: {reason}")]
    UnsupportedLayout {
        /// The other library.
        library: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A descriptor whose address range cannot be memory (a DLPack tensor's data pointer and byte
    /// offset): refused before anything reads it.
    #[error("{library} tensor at an impossible address: {problem}")]
    BadAddress {
        /// The other library.
        library: &'static str,
        /// What is wrong with the address.
        problem: AddressProblem,
    },
    /// The other library reported an error.
    #[error("{library}: {message}")]
    Library {
        /// The other library.
        library: &'static str,
        /// Its message.
        message: String,
    },
    /// Building the tensor failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// Why a descriptor's address range cannot be memory ([`InteropError::BadAddress`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AddressProblem {
    /// A null data pointer for a tensor with elements.
    #[error("a null data pointer for {len_bytes} bytes of elements")]
    NullData {
        /// The bytes its elements span.
        len_bytes: usize,
    },
    /// The byte offset and the elements after it pass `isize::MAX` bytes or the end of the address
    /// space.
    #[error(
        "data at {address:#x} + byte offset {byte_offset} + {len_bytes} bytes of elements passes the address space"
    )]
    PastAddressSpace {
        /// The data pointer.
        address: usize,
        /// The byte offset.
        byte_offset: u64,
        /// The bytes the elements span.
        len_bytes: usize,
    },
}
