//! candle's CUDA tensors through the `cuda` provider (feature `candle`): the bridge
//! [`ir_ops::candle_ops`] asks for when its functions get candle CUDA tensors.
//!
//! A view of a candle `CudaStorage` is a [`CudaBuffer`] over its memory, adopted without a copy,
//! whose kernels launch on the stream of the slice candle keeps (its device's stream): they are
//! ordered with candle's own kernels, and nothing synchronizes the host. Fresh outputs are
//! allocated on that stream too, and their memory moves into a candle slice on it.
//!
//! [`register`](crate::register) installs the bridge; [`install`] does it alone (for an engine
//! that registers the providers it wants by hand).

use std::any::Any;
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use ir_core::interop::InteropError;
use ir_core::storage::DeviceBuffer;
use ir_core::{DType, Layout, Tensor};
use ir_ops::candle_ops::{CudaBridge, install_cuda_bridge};

use crate::device::CudaBuffer;

const LIBRARY: &str = "candle";

/// Lends candle's CUDA storages as [`CudaBuffer`]s and hands fresh outputs back as candle slices.
#[derive(Clone, Copy, Debug, Default)]
pub struct CandleBridge;

/// Installs [`CandleBridge`] for [`ir_ops::candle_ops`]; `false` when a bridge was
/// installed before (this one, by an earlier call).
pub fn install() -> bool {
    install_cuda_bridge(Box::new(CandleBridge))
}

/// The dtype, address, byte length and stream of a candle slice. The address is read on the
/// slice's own stream, where every kernel on it is queued.
fn raw<T>(slice: &CudaSlice<T>, dtype: DType) -> (DType, CUdeviceptr, usize, Arc<CudaStream>) {
    let stream = Arc::clone(slice.stream());
    let (ptr, guard) = slice.device_ptr(&stream);
    drop(guard);
    (dtype, ptr, size_of::<T>() * slice.len(), stream)
}

fn unsupported(storage: &CudaStorage) -> InteropError {
    InteropError::UnsupportedDType { library: LIBRARY, dtype: format!("{:?}", storage.dtype()) }
}

impl CudaBridge for CandleBridge {
    unsafe fn view(&self, storage: &CudaStorage, layout: Layout, keep: Arc<()>) -> Result<Tensor, InteropError> {
        let (dtype, ptr, len_bytes, stream) = match &storage.slice {
            CudaStorageSlice::F32(slice) => raw(slice, DType::F32),
            CudaStorageSlice::F16(slice) => raw(slice, DType::F16),
            CudaStorageSlice::BF16(slice) => raw(slice, DType::BF16),
            CudaStorageSlice::F64(slice) => raw(slice, DType::F64),
            CudaStorageSlice::F8E4M3(slice) => raw(slice, DType::F8E4M3FN),
            CudaStorageSlice::I64(slice) => raw(slice, DType::I64),
            _ => return Err(unsupported(storage)),
        };
        // SAFETY: the memory is candle's slice, kept allocated and written by nothing else while
        // `keep` lives (the caller's contract: candle's lock on the storage is held); kernels on
        // it launch on the slice's stream, where candle's own work on it is queued.
        let buffer = unsafe { CudaBuffer::from_raw_parts(ptr, len_bytes, stream, keep) }
            .map_err(|error| InteropError::Library { library: "cuda", message: error.to_string() })?;
        Ok(buffer.into_tensor(dtype, layout)?)
    }

    fn adopt_output(
        &self,
        buffer: Box<dyn DeviceBuffer>,
        dtype: DType,
        numel: usize,
        like: &CudaStorage,
    ) -> Result<CudaStorage, InteropError> {
        let buffer: Box<dyn Any> = buffer;
        let buffer = buffer.downcast::<CudaBuffer>().map_err(|_| InteropError::Library {
            library: "cuda",
            message: "a device output of a call on candle CUDA tensors is not CUDA memory".to_owned(),
        })?;
        if numel * dtype.size_in_bytes() > buffer.len_bytes() {
            return Err(InteropError::Library {
                library: "cuda",
                message: format!("{numel} {dtype} elements do not fit a {}-byte output", buffer.len_bytes()),
            });
        }
        let stream = like.device.cuda_stream();
        let ptr = buffer
            .into_device_ptr(&stream)
            .map_err(|error| InteropError::Library { library: "cuda", message: error.to_string() })?;
        // SAFETY (each arm): `ptr` is an allocation of at least `numel` elements of the dtype
        // (checked above) that nothing else owns any more, written by the call's kernel (queued on
        // `stream`, or on a stream `stream` now waits for); the slice frees it on `stream`.
        let slice = unsafe {
            match dtype {
                DType::F32 => CudaStorageSlice::F32(stream.upgrade_device_ptr(ptr, numel)),
                DType::F16 => CudaStorageSlice::F16(stream.upgrade_device_ptr(ptr, numel)),
                DType::BF16 => CudaStorageSlice::BF16(stream.upgrade_device_ptr(ptr, numel)),
                DType::F64 => CudaStorageSlice::F64(stream.upgrade_device_ptr(ptr, numel)),
                DType::F8E4M3FN => CudaStorageSlice::F8E4M3(stream.upgrade_device_ptr(ptr, numel)),
                DType::I64 => CudaStorageSlice::I64(stream.upgrade_device_ptr(ptr, numel)),
                // Freed on the stream as bytes: candle has no slice of this dtype.
                DType::F8E5M2 | DType::I8 => {
                    drop(stream.upgrade_device_ptr::<u8>(ptr, numel));
                    return Err(InteropError::UnsupportedDType { library: LIBRARY, dtype: dtype.to_string() });
                }
            }
        };
        Ok(CudaStorage { slice, device: like.device.clone() })
    }
}
