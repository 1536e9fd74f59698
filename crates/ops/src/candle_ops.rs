//! The ops on candle tensors (feature `candle`): each call runs the registry's dispatch (selection,
//! priorities, the selection record) on candle's own CPU memory, under candle's storage locks, and
//! writes in place where candle lets one storage be written.
//!
//! | function | writes in place | allocates |
//! |---|---|---|
//! | [`rms_norm`], [`silu_and_mul`], [`gelu_and_mul`], [`gelu_and_mul_sparse`], the quantizations, [`rms_norm_static_fp8_quant`], [`rms_norm_dynamic_per_token_quant`] | nothing | the outputs |
//! | [`fused_add_rms_norm`] | `x` ← the norm, `residual` ← `x + residual` | nothing |
//! | [`rotary_embedding`] | `query` and `key` | nothing |
//! | [`fused_add_rms_norm_static_fp8_quant`] | `residual` ← `x + residual` | the fp8 output |
//! | [`fused_add_rms_norm_dynamic_per_token_quant`] | `residual` ← `x + residual` | the fp8 output and the per-token scales |
//!
//! Every op a registry defines, built-in or an engine's own, runs on candle tensors through the
//! typed calls its `define_op!` declaration generates, on [`Candle`]: `op::call(&Candle(&registry),
//! ..)` reads its tensors and returns fresh ones, `op::call_maybe_inplace` writes its outputs into
//! the given activations in place and returns them. [`call`] is the untyped form (the op as data).
//! The functions in the table are those generated calls with candle-nn-shaped signatures.
//!
//! A candle engine swaps each candle-nn call for one line:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use ir_ops::Rounding;
//! use ir_ops::candle_ops;
//!
//! let registry = ir_ops::registry();
//! let x = Tensor::randn(0f32, 1.0, (4, 64), &Device::Cpu)?;
//! let residual = Tensor::randn(0f32, 1.0, (4, 64), &Device::Cpu)?;
//! let weight = Tensor::ones(64, DType::F32, &Device::Cpu)?;
//! // candle_nn::ops::rms_norm(&x, &weight, 1e-6)?, as a fresh tensor:
//! let y = candle_ops::rms_norm(&registry, &x, Some(&weight), 1e-6)?;
//! // The residual stream in place: residual += x, then x = rms_norm(residual) * weight.
//! candle_ops::fused_add_rms_norm(&registry, &x, &residual, Some(&weight), 1e-6, Rounding::Exact)?;
//! assert_eq!(x.dims(), y.dims());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # In place
//!
//! Candle's in-place custom ops (`InplaceOp1`) hand out one storage mutably, under its write lock.
//! A call takes the lock of every storage it touches, the write lock of those it writes and the
//! read lock of the others, each once and all in one global order (by the storage's address,
//! whatever the tensors' roles), so two calls on the same tensors in different roles never
//! deadlock; then the kernel writes candle's memory where it is. Like candle's own in-place ops,
//! the in-place functions write the storage every clone of the tensor shares. When dispatch runs a
//! functional provider instead (native on a fallback, say), its result is copied into the candle
//! memory, and the selection record counts the copy as a defensive copy of the op.
//!
//! Every argument is checked before the first byte is written, and these calls are refused with
//! an error, nothing written:
//! - a written tensor whose layout maps several elements to one address (a `broadcast_as` view):
//!   an in-place write would keep one value per address;
//! - two written tensors that share an element (a key that is the query, a clone of it or a view
//!   overlapping it): the shared elements would be written twice.
//!
//! A tensor that is read and one that is written may share a storage (x and the weight, say): the
//! read one is copied first (counted as a defensive copy of the op). Two written tensors in one
//! storage without a shared element (x and the residual as column slices of one buffer) are
//! computed functionally and copied back, except a query and a key (column slices of one `qkv`
//! buffer), which are rotated in place one after the other.
//!
//! # Soundness
//!
//! The views over candle memory live only inside one call, while candle's lock is held: each is
//! owned by a lease whose last handle this module drops after the call. A provider that kept a
//! handle to a view past the call (which would then point at memory candle may write or free) is a
//! broken contract the process cannot survive soundly; the call aborts the process with a message
//! naming the op.
//!
//! # Devices
//!
//! On candle CPU tensors the views are `ir-core`'s host buffers over candle's vectors. On candle
//! CUDA tensors they are device buffers over candle's `CudaStorage`, lent by a [`CudaBridge`]:
//! `vllm-ir-kernels-cuda` built with its `candle` feature installs one when it registers the
//! `cuda` provider. Its kernels then run on the stream of candle's device, ordered with candle's
//! own work, and fresh outputs are allocated on that stream and handed to candle without a copy.
//! The same table holds: in place where it says so, one allocation per output otherwise. CUDA
//! tensors without an installed bridge, and Metal tensors, are refused with an error naming the
//! device; so are the tensors of one call on different devices.

use std::cell::RefCell;
use std::ptr::NonNull;
use std::sync::Arc;

use candle_core as candle;
use candle_core::backend::BackendStorage;

use crate::Rounding;
use crate::gelu_and_mul::Approximate;
use ir_core::CallArgs;
use ir_core::Device;
use ir_core::interop::InteropError;
use ir_core::op::StrEnum;
use ir_core::op::{Arg, ArgMeta, Handles, OpDef, Outputs, Overload, Value, Values};
use ir_core::storage::{CpuBuffer, DeviceBuffer, HostAccess, Storage};
use ir_core::{CallError, Registry};
use ir_core::{DType, Layout, StorageId, Tensor, TensorError, TensorMeta};
use smallvec::SmallVec;

const LIBRARY: &str = "candle";

/// Why an op on candle tensors failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CandleOpError {
    /// The op's call failed (a shape or dtype the op refuses, a kernel error, a strict registry's
    /// refused fallback).
    #[error(transparent)]
    Call(#[from] CallError),
    /// The tensors could not be lent (a dtype or device without a counterpart).
    #[error(transparent)]
    Interop(#[from] InteropError),
    /// Candle failed (converting positions, copying a read tensor).
    #[error("candle: {0}")]
    Candle(#[from] candle::Error),
    /// A tensor the call writes shares elements with another tensor it writes (a key that is the
    /// query, a clone of it, or a view overlapping it): writing one would change the other.
    #[error(
        "{op}: `{written}` and `{other}` share elements of one candle storage, so writing one in place would \
         change the other; pass tensors that do not overlap (a copy of one)"
    )]
    Overlap {
        /// The op.
        op: &'static str,
        /// The written tensor.
        written: &'static str,
        /// The tensor it overlaps.
        other: &'static str,
    },
    /// A tensor the call writes maps several elements to one address (a `broadcast_as` or `expand`
    /// view): an in-place write would keep one value per address.
    #[error(
        "{op}: `{param}` (shape {shape:?}, strides {strides:?}) maps several elements to one address (a broadcast \
         view?), so an in-place write would keep only one value per address; pass a contiguous copy"
    )]
    OverlappingWrite {
        /// The op.
        op: &'static str,
        /// The written tensor.
        param: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// Its strides (elements).
        strides: Vec<usize>,
    },
}

impl From<TensorError> for CandleOpError {
    fn from(error: TensorError) -> CandleOpError {
        CandleOpError::Interop(InteropError::Tensor(error))
    }
}

impl From<CandleOpError> for candle::Error {
    fn from(error: CandleOpError) -> candle::Error {
        match error {
            CandleOpError::Candle(error) => error,
            other => candle::Error::wrap(other),
        }
    }
}

type Result<T> = std::result::Result<T, CandleOpError>;

/// Lends candle's CUDA storages to this crate's dispatch, and hands fresh device outputs back to
/// candle. Implemented by the crate that owns CUDA device buffers (`vllm-ir-kernels-cuda`, feature
/// `candle`), which installs it with [`install_cuda_bridge`]; this crate cannot name CUDA memory.
pub trait CudaBridge: Send + Sync + 'static {
    /// A tensor with `layout` over the memory of `storage`, on the stream of candle's device; the
    /// tensor's buffer keeps `keep` (a handle of the call's lease) until it is dropped.
    ///
    /// # Safety
    ///
    /// While any handle of `keep` lives, the memory of `storage` stays allocated, nothing but the
    /// returned tensor writes it, and (for a storage lent for reading) nothing writes it at all:
    /// the caller holds candle's lock on the storage (the write lock for a written one).
    unsafe fn view(
        &self,
        storage: &candle::CudaStorage,
        layout: Layout,
        keep: Arc<()>,
    ) -> std::result::Result<Tensor, InteropError>;

    /// A candle storage owning `buffer`, the memory of a fresh compact output of `numel` elements of
    /// `dtype`, on the device of `like` (a storage of the same call): without a copy when the
    /// buffer owns its memory.
    fn adopt_output(
        &self,
        buffer: Box<dyn DeviceBuffer>,
        dtype: DType,
        numel: usize,
        like: &candle::CudaStorage,
    ) -> std::result::Result<candle::CudaStorage, InteropError>;
}

static CUDA_BRIDGE: std::sync::OnceLock<Box<dyn CudaBridge>> = std::sync::OnceLock::new();

/// Installs the bridge that lends candle's CUDA storages (once per process: a second bridge is
/// ignored, and `false` says so).
pub fn install_cuda_bridge(bridge: Box<dyn CudaBridge>) -> bool {
    CUDA_BRIDGE.set(bridge).is_ok()
}

/// Whether a bridge for candle's CUDA storages is installed.
pub fn cuda_bridge_installed() -> bool {
    CUDA_BRIDGE.get().is_some()
}

fn cuda_bridge() -> Result<&'static dyn CudaBridge> {
    CUDA_BRIDGE.get().map(|bridge| &**bridge).ok_or_else(|| {
        CandleOpError::Interop(InteropError::UnsupportedDevice {
            library: LIBRARY,
            device: "cuda".to_owned(),
            hint: "no bridge for candle's CUDA storage is installed: build vllm-ir-kernels-cuda with its `candle` \
                   feature and register the `cuda` provider (`kernels_cuda::register`)",
        })
    })
}

/// The memory of one candle storage a call views: host bytes, or a CUDA storage lent through the
/// [`CudaBridge`].
#[derive(Clone, Copy)]
enum Memory<'s> {
    /// The dtype, first byte and byte length of a CPU storage.
    Host(DType, *mut u8, usize),
    /// A CUDA storage.
    Cuda(&'s candle::CudaStorage),
}

impl<'s> Memory<'s> {
    /// A CPU storage, for reading.
    fn host(storage: &'s candle::CpuStorage) -> Result<Memory<'s>> {
        let (dtype, ptr, len) = parts(storage)?;
        Ok(Memory::Host(dtype, ptr, len))
    }

    /// A CPU storage, for writing (the pointer derived from the mutable borrow).
    fn host_mut(storage: &'s mut candle::CpuStorage) -> Result<Memory<'s>> {
        let (dtype, ptr, len) = parts_mut(storage)?;
        Ok(Memory::Host(dtype, ptr, len))
    }

    /// Any storage this module views, for reading.
    fn of(storage: &'s candle::Storage) -> Result<Memory<'s>> {
        match storage {
            candle::Storage::Cpu(cpu) => Memory::host(cpu),
            candle::Storage::Cuda(cuda) => Ok(Memory::Cuda(cuda)),
            candle::Storage::Metal(_) => Err(unsupported_device("metal")),
        }
    }
}

/// The views of one call: each buffer over candle memory owns a handle to the lease, and the
/// lease checks, when it ends, that every view is gone.
struct Lease {
    op: &'static str,
    token: Arc<()>,
}

impl Lease {
    fn new(op: &'static str) -> Lease {
        Lease { op, token: Arc::new(()) }
    }

    /// A tensor over `memory` with candle's `layout`.
    ///
    /// # Safety
    ///
    /// For as long as the lease lives, the memory is valid for reads (and, with
    /// [`HostAccess::ReadWrite`], writes) and nothing else writes it (candle's lock on its
    /// storage is held: a read lock for `ReadOnly`, the write lock for `ReadWrite`); with
    /// `ReadWrite`, no other view of this lease covers the memory.
    unsafe fn view(&self, memory: Memory<'_>, layout: &Layout, access: HostAccess) -> Result<Tensor> {
        let layout = layout.clone();
        match memory {
            Memory::Host(dtype, ptr, len_bytes) => {
                let ptr = NonNull::new(ptr).unwrap_or(NonNull::dangling());
                // SAFETY: the caller's contract, for the lease's lifetime; the views are dropped
                // before the lease ends (checked in `Drop`).
                let buffer = unsafe {
                    CpuBuffer::from_external_shared(ptr, len_bytes, access, Arc::clone(&self.token) as Arc<_>)
                };
                Ok(Tensor::from_storage(Storage::Cpu(buffer), dtype, layout)?)
            }
            // SAFETY: the caller's contract, which is the bridge's: candle's lock is held while the
            // lease (every handle of its token) lives.
            Memory::Cuda(storage) => Ok(unsafe { cuda_bridge()?.view(storage, layout, Arc::clone(&self.token))? }),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if Arc::strong_count(&self.token) != 1 {
            // A provider kept a tensor over candle memory past the call: it would read memory candle
            // writes or frees from now on. Nothing sound is left to do.
            eprintln!(
                "vllm-ir: a provider of `{}` kept a tensor over candle memory after the call returned; aborting",
                self.op
            );
            std::process::abort();
        }
    }
}

/// The dtype, first byte and byte length of a candle CPU storage, for reading.
fn parts(storage: &candle::CpuStorage) -> Result<(DType, *mut u8, usize)> {
    fn of<T>(values: &[T], dtype: DType) -> (DType, *mut u8, usize) {
        (dtype, values.as_ptr().cast_mut().cast(), size_of_val(values))
    }
    Ok(match storage {
        candle::CpuStorage::F32(values) => of(values, DType::F32),
        candle::CpuStorage::F16(values) => of(values, DType::F16),
        candle::CpuStorage::BF16(values) => of(values, DType::BF16),
        candle::CpuStorage::F64(values) => of(values, DType::F64),
        candle::CpuStorage::F8E4M3(values) => of(values, DType::F8E4M3FN),
        candle::CpuStorage::I64(values) => of(values, DType::I64),
        other => return Err(unsupported_dtype(other.dtype())),
    })
}

/// As [`parts`], for writing (the pointer derived from a mutable borrow).
fn parts_mut(storage: &mut candle::CpuStorage) -> Result<(DType, *mut u8, usize)> {
    fn of<T>(values: &mut [T], dtype: DType) -> (DType, *mut u8, usize) {
        (dtype, values.as_mut_ptr().cast(), size_of_val(values))
    }
    Ok(match storage {
        candle::CpuStorage::F32(values) => of(values, DType::F32),
        candle::CpuStorage::F16(values) => of(values, DType::F16),
        candle::CpuStorage::BF16(values) => of(values, DType::BF16),
        candle::CpuStorage::F64(values) => of(values, DType::F64),
        candle::CpuStorage::F8E4M3(values) => of(values, DType::F8E4M3FN),
        candle::CpuStorage::I64(values) => of(values, DType::I64),
        other => return Err(unsupported_dtype(other.dtype())),
    })
}

fn unsupported_dtype(dtype: candle::DType) -> CandleOpError {
    CandleOpError::Interop(InteropError::UnsupportedDType { library: LIBRARY, dtype: format!("{dtype:?}") })
}

fn unsupported_device(device: &str) -> CandleOpError {
    CandleOpError::Interop(InteropError::UnsupportedDevice {
        library: LIBRARY,
        device: device.to_owned(),
        hint: "the candle ops run on candle CPU tensors, and on CUDA tensors once the `cuda` provider's bridge is \
               installed",
    })
}

/// Refuses tensors this module cannot view (Metal; CUDA without a bridge) and the tensors of one
/// call on different devices.
fn lendable<'t>(tensors: impl IntoIterator<Item = &'t candle::Tensor>) -> Result<()> {
    let mut tensors = tensors.into_iter();
    let Some(first) = tensors.next() else { return Ok(()) };
    match first.device() {
        candle::Device::Cpu => {}
        candle::Device::Cuda(_) => {
            cuda_bridge()?;
        }
        candle::Device::Metal(_) => return Err(unsupported_device("metal")),
    }
    for tensor in tensors {
        if !tensor.device().same_device(first.device()) {
            return Err(CandleOpError::Interop(InteropError::UnsupportedDevice {
                library: LIBRARY,
                device: format!("{:?} and {:?}", first.device().location(), tensor.device().location()),
                hint: "the tensors of one call must be on one device",
            }));
        }
    }
    Ok(())
}

/// A fresh output as a candle tensor on `anchor`'s device: a CPU output through
/// [`Tensor::into_candle`], a device output through the [`CudaBridge`] (both without a copy when the
/// output owns its memory alone, as fresh outputs do).
fn output_to_candle(output: Tensor, anchor: &candle::Tensor) -> Result<candle::Tensor> {
    if output.device() == Device::Cpu && anchor.device().is_cpu() {
        return Ok(output.into_candle()?);
    }
    let adopt = Adopt(RefCell::new(Some(output)));
    Ok(anchor.apply_op1_no_bwd(&adopt)?)
}

/// Candle has no public constructor from a `CudaStorage`; a custom op on a tensor of the same
/// device returns one. This one returns the output it holds, whatever its input.
struct Adopt(RefCell<Option<Tensor>>);

impl candle::CustomOp1 for Adopt {
    fn name(&self) -> &'static str {
        "vllm-ir-output"
    }

    fn cpu_fwd(
        &self,
        _: &candle::CpuStorage,
        _: &candle::Layout,
    ) -> candle::Result<(candle::CpuStorage, candle::Shape)> {
        candle::bail!("vllm-ir: a device output cannot become a CPU tensor")
    }

    fn cuda_fwd(
        &self,
        like: &candle::CudaStorage,
        _: &candle::Layout,
    ) -> candle::Result<(candle::CudaStorage, candle::Shape)> {
        let output = self.0.borrow_mut().take().ok_or_else(|| candle::Error::msg("vllm-ir: output taken twice"))?;
        let (dtype, shape) = (output.dtype(), output.shape().to_vec());
        let fresh = output.layout().is_compact_at_zero() && output.is_uniquely_owned();
        let output = if fresh { output } else { output.contiguous().map_err(candle::Error::wrap)? };
        let numel = output.numel();
        let buffer = match output.into_unique_storage() {
            Ok((Storage::Device(buffer), _)) => buffer,
            _ => candle::bail!("vllm-ir: a CUDA call returned an output that is not in device memory"),
        };
        let storage = cuda_bridge()
            .map_err(candle::Error::wrap)?
            .adopt_output(buffer, dtype, numel, like)
            .map_err(candle::Error::wrap)?;
        Ok((storage, candle::Shape::from(shape)))
    }
}

/// The identity of a tensor's storage (its lock's address), read under a read lock released at
/// once: two tensors share a storage exactly when these are equal, and calls take their locks in
/// the order of these addresses.
fn storage_identity(tensor: &candle::Tensor) -> usize {
    let (storage, _) = tensor.storage_and_layout();
    std::ptr::from_ref::<candle::Storage>(&*storage) as usize
}

/// This crate's layout of a candle layout.
fn our_layout(layout: &candle::Layout) -> Result<Layout> {
    Layout::new(layout.dims(), layout.stride(), layout.start_offset()).map_err(|error| {
        CandleOpError::Interop(InteropError::UnsupportedLayout { library: LIBRARY, reason: error.to_string() })
    })
}

/// The metadata a view of `tensor` has (dtype, device, layout), read without a lock.
fn meta_of(tensor: &candle::Tensor) -> Result<TensorMeta> {
    let dtype = match tensor.dtype() {
        candle::DType::F32 => DType::F32,
        candle::DType::F16 => DType::F16,
        candle::DType::BF16 => DType::BF16,
        candle::DType::F64 => DType::F64,
        candle::DType::F8E4M3 => DType::F8E4M3FN,
        candle::DType::I64 => DType::I64,
        other => return Err(unsupported_dtype(other)),
    };
    let device = match tensor.device().location() {
        candle::DeviceLocation::Cpu => Device::Cpu,
        candle::DeviceLocation::Cuda { gpu_id } => Device::Cuda(u32::try_from(gpu_id).unwrap_or(u32::MAX)),
        candle::DeviceLocation::Metal { .. } => return Err(unsupported_device("metal")),
    };
    Ok(TensorMeta { dtype, device, layout: our_layout(tensor.layout())? })
}

/// How a call uses one of its candle tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Only read.
    Read,
    /// Written in place.
    Written,
}

/// One candle tensor of a call: the function's name for it, the tensor, and how the call uses it.
struct Part {
    name: &'static str,
    tensor: candle::Tensor,
    /// The tensor's layout, as this crate's.
    layout: Layout,
    role: Role,
}

/// The tensors of one call, checked before anything is locked or written, and their storages in
/// lock order.
///
/// # Locks
///
/// Every call takes the lock of each storage it touches once (the write lock of a storage it writes,
/// else the read lock), all before it runs and in one global order: by the storage's address. Two
/// calls on the same tensors in different roles (one writes `a` and reads `b`, the other reads `a`,
/// then `b`) therefore never wait on each other in a cycle.
struct Call<'r> {
    registry: &'r Registry,
    parts: SmallVec<[Part; 4]>,
    /// For each part, the index of its storage in `storages`.
    storage_of: SmallVec<[usize; 4]>,
    /// The distinct storages in lock order: their identity, a tensor on each, and whether the call
    /// writes it.
    storages: SmallVec<[(usize, candle::Tensor, Role); 4]>,
}

impl<'r> Call<'r> {
    /// Checks the tensors of a call of `op` (absent optional ones are `None`) before anything is
    /// locked or written: one device this module can view, no written tensor whose layout maps two
    /// elements to one address, no written tensor overlapping another written one. A read tensor on
    /// a storage the call writes is copied apart first (counted as a defensive copy of `op`).
    #[inline]
    fn new<'t>(
        registry: &'r Registry,
        op: &'static str,
        parts_given: impl IntoIterator<Item = Option<(&'static str, &'t candle::Tensor, Role)>>,
    ) -> Result<Call<'r>> {
        // Pushed one by one: collecting through `Result` moves the inline parts twice more.
        let mut parts: SmallVec<[Part; 4]> = SmallVec::new();
        for (name, tensor, role) in parts_given.into_iter().flatten() {
            parts.push(Part { name, tensor: tensor.clone(), layout: our_layout(tensor.layout())?, role });
        }
        lendable(parts.iter().map(|part| &part.tensor))?;
        let mut identities: SmallVec<[usize; 4]> = parts.iter().map(|part| storage_identity(&part.tensor)).collect();
        for (index, part) in parts.iter().enumerate().filter(|(_, part)| part.role == Role::Written) {
            let layout = &part.layout;
            if layout.overlaps_itself() {
                return Err(CandleOpError::OverlappingWrite {
                    op,
                    param: part.name,
                    shape: part.tensor.dims().to_vec(),
                    strides: part.tensor.stride().to_vec(),
                });
            }
            for (other_index, other) in parts.iter().enumerate() {
                let apart = other_index == index
                    || identities[other_index] != identities[index]
                    || other.role == Role::Read
                    || !layout.shares_element_with(&other.layout);
                if !apart {
                    return Err(CandleOpError::Overlap { op, written: part.name, other: other.name });
                }
            }
        }
        let written: SmallVec<[usize; 4]> =
            parts.iter().zip(&identities).filter(|(part, _)| part.role == Role::Written).map(|(_, &id)| id).collect();
        for (part, identity) in parts.iter_mut().zip(identities.iter_mut()) {
            if part.role == Role::Read && written.contains(identity) {
                registry.count_defensive_copy(op);
                part.tensor = part.tensor.copy()?;
                part.layout = our_layout(part.tensor.layout())?;
                *identity = storage_identity(&part.tensor);
            }
        }
        let mut order: SmallVec<[usize; 4]> = (0..parts.len()).collect();
        order.sort_by_key(|&index| identities[index]);
        let mut storages: SmallVec<[(usize, candle::Tensor, Role); 4]> = SmallVec::new();
        let mut storage_of: SmallVec<[usize; 4]> = smallvec::smallvec![0; parts.len()];
        for index in order {
            let part = &parts[index];
            match storages.last_mut() {
                Some((identity, _, role)) if *identity == identities[index] => {
                    if part.role == Role::Written {
                        *role = Role::Written;
                    }
                }
                _ => storages.push((identities[index], part.tensor.clone(), part.role)),
            }
            storage_of[index] = storages.len() - 1;
        }
        Ok(Call { registry, parts, storage_of, storages })
    }

    /// Whether the written parts `a` and `b` lie in one storage.
    fn same_storage(&self, a: usize, b: usize) -> bool {
        self.storage_of[a] == self.storage_of[b]
    }

    /// Takes every storage's lock in the order of [`Call`]'s "Locks", then runs `body` with each
    /// part's memory (in the order of the parts).
    fn locked<R>(&self, body: impl FnOnce(&[Memory<'_>]) -> Result<R>) -> Result<R> {
        let mut body = Some(body);
        let mut result = None;
        let storage_of = &self.storage_of;
        acquire(&self.storages, &[], &mut |memories: &[Memory<'_>]| {
            let parts: SmallVec<[Memory<'_>; 4]> = storage_of.iter().map(|&storage| memories[storage]).collect();
            result = Some((body.take().expect("the locks are taken once"))(&parts)?);
            Ok(())
        })?;
        Ok(result.expect("set once the locks were taken"))
    }

    /// A view of part `index` over its locked `memory`.
    ///
    /// # Safety
    ///
    /// `memory` is the part's memory from [`Call::locked`], used inside its body; with
    /// [`HostAccess::ReadWrite`] the part is written and no other view of `lease` covers it.
    unsafe fn view(&self, lease: &Lease, index: usize, memory: Memory<'_>, access: HostAccess) -> Result<Tensor> {
        // SAFETY: the lock of the part's storage is held (a write lock for a written part, whose
        // storage no read part shares: copied apart in `Call::new`); the caller's contract.
        unsafe { lease.view(memory, &self.parts[index].layout, access) }
    }

    /// Copies `result` into written part `index` unless a provider wrote it there (the view whose
    /// storage is `written`), counted as a defensive copy.
    fn land(
        &self,
        lease: &Lease,
        index: usize,
        memory: Memory<'_>,
        written: Option<StorageId>,
        result: Tensor,
    ) -> Result<()> {
        land(self.registry, lease, written, memory, &self.parts[index].layout, result)
    }
}

/// The body of a call under its locks.
type Body<'b> = dyn FnMut(&[Memory<'_>]) -> Result<()> + 'b;

/// Takes the lock of each of `storages` in order (holding those of `held` already), then runs
/// `body` with the memory of every storage.
fn acquire(storages: &[(usize, candle::Tensor, Role)], held: &[Memory<'_>], body: &mut Body<'_>) -> Result<()> {
    let Some(((_, tensor, role), rest)) = storages.split_first() else { return body(held) };
    match role {
        Role::Read => {
            let (guard, _) = tensor.storage_and_layout();
            let mut now: SmallVec<[Memory<'_>; 4]> = held.iter().copied().collect();
            now.push(Memory::of(&guard)?);
            acquire(rest, &now, body)
        }
        Role::Written => {
            let step = Acquire { rest, held, body: RefCell::new(body), outcome: RefCell::new(None) };
            let result = tensor.inplace_op1(&step);
            match step.outcome.into_inner() {
                Some(outcome) => outcome,
                // Candle refused before handing the storage over.
                None => Ok(result?),
            }
        }
    }
}

/// One write lock of [`acquire`]: candle's `InplaceOp1` hands the storage over under its write lock,
/// and the rest of the locks are taken inside.
struct Acquire<'a, 'm, 'b> {
    rest: &'a [(usize, candle::Tensor, Role)],
    held: &'a [Memory<'m>],
    body: RefCell<&'a mut Body<'b>>,
    /// The call's result (candle's error type cannot carry it).
    outcome: RefCell<Option<Result<()>>>,
}

impl Acquire<'_, '_, '_> {
    fn then(&self, memory: Result<Memory<'_>>) -> candle::Result<()> {
        let outcome = memory.and_then(|memory| {
            let mut now: SmallVec<[Memory<'_>; 4]> = self.held.iter().copied().collect();
            now.push(memory);
            acquire(self.rest, &now, &mut **self.body.borrow_mut())
        });
        let failed = outcome.is_err();
        *self.outcome.borrow_mut() = Some(outcome);
        if failed { Err(candle::Error::msg("vllm-ir: the call failed")) } else { Ok(()) }
    }
}

impl candle::InplaceOp1 for Acquire<'_, '_, '_> {
    fn name(&self) -> &'static str {
        "vllm-ir-call"
    }

    fn cpu_fwd(&self, storage: &mut candle::CpuStorage, _: &candle::Layout) -> candle::Result<()> {
        self.then(Memory::host_mut(storage))
    }

    fn cuda_fwd(&self, storage: &mut candle::CudaStorage, _: &candle::Layout) -> candle::Result<()> {
        self.then(Ok(Memory::Cuda(storage)))
    }
}

/// One argument of [`call`]: a candle tensor, `none` or a constant, in the op's parameter order.
pub type CandleArg<'t> = Arg<&'t candle::Tensor, &'t str, &'t [i64]>;

/// Runs any op the registry defines on candle tensors: the binding every op has by construction,
/// read from its definition. A tensor parameter is read, except the given activations of an op with
/// a `maybe_inplace` form (`OpDef::allow_inplace`), which are written in place with the op's first
/// outputs (output i into the i-th given activation), under candle's write locks; the other outputs
/// are returned as fresh candle tensors, in order. Trailing parameters with a default may be left
/// out.
///
/// Every argument is checked before a byte is written: the rules of this module's "In place" before
/// a lock is taken, the kinds and the op's meta function by the dispatch, before its kernel runs. Written tensors in separate storages are donated to
/// the call, so an in-place kernel writes candle's memory; written tensors in one storage are
/// computed functionally and copied back (counted as defensive copies of the op). A read tensor of
/// u32, candle's usual index type (token positions), is read as i64, the ops' index type (one copy
/// of it).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use ir_core::op::Arg;
/// use ir_ops::candle_ops;
///
/// let registry = ir_ops::registry();
/// let x = Tensor::randn(0f32, 1.0, (4, 64), &Device::Cpu)?;
/// let gate_up = Tensor::randn(0f32, 1.0, (4, 128), &Device::Cpu)?;
/// let out = candle_ops::call(&registry, &ir_ops::silu_and_mul::SILU_AND_MUL, &[Arg::Tensor(&gate_up)])?;
/// assert_eq!(out[0].dims(), [4, 64]);
/// // `rms_norm(x, weight = none, epsilon)`; `variance_size` keeps its default.
/// let y = candle_ops::call(&registry, &ir_ops::rms_norm::RMS_NORM, &[Arg::Tensor(&x), Arg::None, Arg::F64(1e-6)])?;
/// assert_eq!(y[0].dims(), x.dims());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn call(registry: &Registry, op: &'static OpDef, args: &[CandleArg<'_>]) -> Result<Vec<candle::Tensor>> {
    let overload = if op.allow_inplace { Overload::MaybeInplace } else { Overload::Default };
    Ok(run(registry, op, overload, args)?.fresh.into_vec())
}

/// Every op's typed calls on candle tensors, generated by `define_op!` with the op: the op module's
/// `call(&Candle(&registry), ..)` reads its tensors and returns fresh candle tensors, and
/// `call_maybe_inplace(&Candle(&registry), ..)` (ops with a `maybe_inplace` form) writes its
/// outputs into the given activations in place (under candle's write locks, as [`call`] does) and
/// returns them (the same candle tensors) before the fresh outputs.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use ir_ops::candle_ops::Candle;
/// use ir_ops::{Rounding, fused_add_rms_norm, rms_norm};
///
/// let registry = ir_ops::registry();
/// let ops = Candle(&registry);
/// let x = Tensor::randn(0f32, 1.0, (4, 64), &Device::Cpu)?;
/// let residual = Tensor::randn(0f32, 1.0, (4, 64), &Device::Cpu)?;
/// let y = rms_norm::call(&ops, &x, None, 1e-6, None)?;
/// assert_eq!(y.dims(), x.dims());
/// // In place: `residual += x`, then `x = rms_norm(residual)`; the same tensors come back.
/// let (out, res) =
///     fused_add_rms_norm::call_maybe_inplace(&ops, x.clone(), residual.clone(), None, 1e-6, None, Rounding::Exact)?;
/// assert!(out.id() == x.id() && res.id() == residual.id());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Candle<'r>(pub &'r Registry);

impl ir_core::OpCaller for Candle<'_> {
    type Tensor = candle::Tensor;
    type Error = CandleOpError;

    fn call_op(
        &self,
        op: &'static OpDef,
        overload: Overload,
        args: CallArgs<candle::Tensor>,
    ) -> Result<Handles<candle::Tensor>> {
        let Ran { written, fresh } = run(self.0, op, overload, &args)?;
        if written.is_empty() {
            return Ok(fresh);
        }
        let written = written.iter().filter_map(|&index| args[index].as_tensor().cloned());
        Ok(written.chain(fresh).collect())
    }
}

/// What [`run`] did: the arguments it wrote in place (their indices, in the op's activation order),
/// and the fresh outputs.
struct Ran {
    written: SmallVec<[usize; 4]>,
    fresh: Handles<candle::Tensor>,
}

/// Runs `op` on candle tensors: with [`Overload::MaybeInplace`], the given activations are written
/// in place with the op's first outputs (see [`call`]); with [`Overload::Default`], every tensor is
/// only read.
fn run<T, S, L>(registry: &Registry, op: &'static OpDef, overload: Overload, args: &[Arg<T, S, L>]) -> Result<Ran>
where
    T: std::borrow::Borrow<candle::Tensor>,
    S: AsRef<str>,
    L: AsRef<[i64]>,
{
    // The kinds, the defaults and the op's meta function are checked by the dispatch below, before
    // its kernel writes anything; the overlap rules by `Call::new`, before any lock is taken.
    if args.len() > op.params.len() {
        let error = ir_core::op::BindError::TooManyArgs { op: op.name, expected: op.params.len(), found: args.len() };
        return Err(CallError::from(error).into());
    }
    // The activations in the op's order: output i goes into the i-th given one. A registry defines
    // only ops whose activations resolve; another op fails in the dispatch below.
    let activations = match overload {
        Overload::MaybeInplace => op.activation_indices().unwrap_or_default(),
        _ => Vec::new(),
    };
    let written = |index: usize| activations.contains(&index);
    // A read tensor of candle's usual index type, u32 (token positions), is read as the i64 the ops
    // take: one small copy.
    let mut widened: SmallVec<[Option<candle::Tensor>; 8]> = SmallVec::new();
    for (index, arg) in args.iter().enumerate() {
        let u32_read = arg.as_tensor().filter(|t| t.borrow().dtype() == candle::DType::U32 && !written(index));
        widened.push(u32_read.map(|t| t.borrow().to_dtype(candle::DType::I64)).transpose()?);
    }
    let parts = args.iter().zip(&widened).enumerate().map(|(index, (arg, widened))| {
        let role = if written(index) { Role::Written } else { Role::Read };
        arg.as_tensor().map(|tensor| (op.params[index].name, widened.as_ref().unwrap_or(tensor.borrow()), role))
    });
    let call = Call::new(registry, op.name, parts)?;
    if call.parts.is_empty() {
        // No candle tensor says where the outputs go.
        return Err(
            candle::Error::Msg(format!("{}: no candle tensor argument to place the outputs beside", op.name)).into()
        );
    }
    // Part index of each tensor argument, and the written parts in the activations' order.
    let mut part_of: SmallVec<[Option<usize>; 8]> = SmallVec::new();
    let mut next = 0;
    for arg in args {
        part_of.push(arg.as_tensor().map(|_| {
            next += 1;
            next - 1
        }));
    }
    let written_args: SmallVec<[usize; 4]> =
        activations.iter().copied().filter(|&index| part_of.get(index).copied().flatten().is_some()).collect();
    let written_parts: SmallVec<[usize; 4]> = written_args.iter().filter_map(|&index| part_of[index]).collect();
    let shared =
        written_parts.iter().enumerate().any(|(i, &a)| written_parts[i + 1..].iter().any(|&b| call.same_storage(a, b)));
    let outputs = call.locked(|memories| {
        let lease = Lease::new(op.name);
        let mut values = Values::new();
        // Per part, the storage a writable view donates.
        let mut donated: SmallVec<[Option<StorageId>; 4]> = smallvec::smallvec![None; call.parts.len()];
        for (index, arg) in args.iter().enumerate() {
            let value = match (arg, part_of[index]) {
                (Arg::Tensor(_), Some(part)) => {
                    let write = written(index) && !shared;
                    let access = if write { HostAccess::ReadWrite } else { HostAccess::ReadOnly };
                    // SAFETY: views of locked parts, dropped before the lease: a written part is
                    // viewed writably only when no other written part shares its storage (and no
                    // read part does: copied apart in `Call::new`).
                    let view = unsafe { call.view(&lease, part, memories[part], access)? };
                    donated[part] = write.then(|| view.storage_id());
                    Value::Tensor(view)
                }
                (constant, _) => {
                    constant.borrowed().map(|_| unreachable!("tensors have parts"), str::to_owned, <[i64]>::to_vec)
                }
            };
            values.push(value);
        }
        let overload = if donated.iter().any(Option::is_some) { Overload::MaybeInplace } else { Overload::Default };
        let mut outputs = registry.run(ir_core::Call::new(op, overload, values))?.into_iter();
        for &part in &written_parts {
            let output =
                outputs.next().ok_or_else(|| candle::Error::Msg(format!("{}: an output is missing", op.name)))?;
            call.land(&lease, part, memories[part], donated[part], output)?;
        }
        Ok(outputs.collect::<Outputs>())
    })?;
    let anchor = &call.parts[0].tensor;
    let fresh = outputs.into_iter().map(|t| output_to_candle(t, anchor)).collect::<Result<_>>()?;
    Ok(Ran { written: written_args, fresh })
}

/// `rms_norm(x, weight, epsilon)` as a fresh candle tensor (candle-nn's `ops::rms_norm`).
pub fn rms_norm(
    registry: &Registry,
    x: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
) -> Result<candle::Tensor> {
    crate::rms_norm::call(&Candle(registry), x, weight, epsilon, None)
}

/// `silu(gate) * up` of `x = [..., gate | up]` as a fresh candle tensor: the gate is the first half
/// of the last dimension, as vLLM's merged `gate_up_proj` weight gives it.
pub fn silu_and_mul(registry: &Registry, x: &candle::Tensor) -> Result<candle::Tensor> {
    crate::silu_and_mul::call(&Candle(registry), x)
}

/// `gelu(gate) * up` of `x = [..., gate | up]` as a fresh candle tensor.
pub fn gelu_and_mul(registry: &Registry, x: &candle::Tensor, approximate: Approximate) -> Result<candle::Tensor> {
    crate::gelu_and_mul::call(&Candle(registry), x, approximate)
}

/// `gelu(sparse(gate)) * up` of `x = [..., gate | up]` as a fresh candle tensor: the gate's values
/// below `mean + std_multiplier · std` of its row are cut to zero first (Gemma 3n's activation
/// sparsity).
pub fn gelu_and_mul_sparse(
    registry: &Registry,
    x: &candle::Tensor,
    std_multiplier: f64,
    approximate: Approximate,
) -> Result<candle::Tensor> {
    crate::gelu_and_mul_sparse::call(&Candle(registry), x, std_multiplier, approximate)
}

/// fp8 quantization with a static scale (`scale`: one f32): the codes as a candle tensor
/// (`out_dtype` must have a candle counterpart: e4m3). `rounding` as the op's.
pub fn static_scaled_fp8_quant(
    registry: &Registry,
    x: &candle::Tensor,
    scale: &candle::Tensor,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<candle::Tensor> {
    crate::static_scaled_fp8_quant::call(&Candle(registry), x, scale, out_dtype, rounding)
}

/// Dynamic per-token fp8 quantization: `(codes, scales [..., 1])`.
pub fn dynamic_per_token_scaled_fp8_quant(
    registry: &Registry,
    x: &candle::Tensor,
    scale_ub: Option<&candle::Tensor>,
    out_dtype: DType,
) -> Result<(candle::Tensor, candle::Tensor)> {
    crate::dynamic_per_token_scaled_fp8_quant::call(&Candle(registry), x, scale_ub, out_dtype)
}

/// `rms_norm` then static fp8 quantization, fused: the codes. `rounding` as the op's.
pub fn rms_norm_static_fp8_quant(
    registry: &Registry,
    x: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale: &candle::Tensor,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<candle::Tensor> {
    crate::rms_norm_static_fp8_quant::call(&Candle(registry), x, weight, epsilon, scale, out_dtype, rounding)
}

/// `rms_norm` then dynamic per-token fp8 quantization, fused: `(codes, scales [..., 1])`.
/// `rounding` as the op's.
pub fn rms_norm_dynamic_per_token_quant(
    registry: &Registry,
    x: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale_ub: Option<&candle::Tensor>,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<(candle::Tensor, candle::Tensor)> {
    let call = crate::rms_norm_dynamic_per_token_quant::call;
    call(&Candle(registry), x, weight, epsilon, scale_ub, out_dtype, rounding)
}

/// Leaves `result` where it is when a provider wrote it into the view `written` (same storage),
/// else copies it into `target` (a functional provider's fresh output), counted as a defensive copy
/// of the lease's op.
fn land(
    registry: &Registry,
    lease: &Lease,
    written: Option<StorageId>,
    target: Memory<'_>,
    layout: &Layout,
    result: Tensor,
) -> Result<()> {
    if written == Some(result.storage_id()) {
        return Ok(());
    }
    // SAFETY: the caller holds candle's write lock on the target's storage, and no other view of
    // the lease covers it (`result` lies elsewhere, the views passed to the call are gone).
    let mut view = unsafe { lease.view(target, layout, HostAccess::ReadWrite)? };
    view.copy_from(&result)?;
    registry.count_defensive_copy(lease.op);
    Ok(())
}

/// `fused_add_rms_norm` in place on candle tensors: `residual ← x + residual`, then `x ←
/// rms_norm(residual) · weight` (vLLM's in-place `fused_add_rms_norm`), both written where they are
/// under candle's write locks.
pub fn fused_add_rms_norm(
    registry: &Registry,
    x: &candle::Tensor,
    residual: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    rounding: Rounding,
) -> Result<()> {
    let call = crate::fused_add_rms_norm::call_maybe_inplace;
    call(&Candle(registry), x.clone(), residual.clone(), weight, epsilon, None, rounding)?;
    Ok(())
}

/// Rotary position embedding in place on candle tensors: `query` and `key` (when given) are
/// rotated where they are, under their storages' write locks, so column slices of one `qkv` storage
/// are rotated without a copy. `positions` are i64 or u32 (candle's usual index type, converted to
/// i64 first: one small copy); `cos_sin_cache` is `[max_position, rotary_dim]`, cos then sin.
///
/// Every argument is checked before anything is written. A key that overlaps the query (the query
/// itself, a clone or a view sharing any element) is refused: rotating it would rotate the shared
/// elements twice. A query and a key in one storage (disjoint column slices) are rotated one after
/// the other under the one write lock; in separate storages, in one dispatch.
#[allow(clippy::too_many_arguments)]
pub fn rotary_embedding(
    registry: &Registry,
    positions: &candle::Tensor,
    query: &candle::Tensor,
    key: Option<&candle::Tensor>,
    cos_sin_cache: &candle::Tensor,
    head_size: usize,
    rotary_dim: usize,
    is_neox_style: bool,
    rounding: Rounding,
) -> Result<()> {
    let op = crate::rotary_embedding::ROTARY_EMBEDDING.name;
    let positions = match positions.dtype() {
        candle::DType::U32 => positions.to_dtype(candle::DType::I64)?,
        _ => positions.clone(),
    };
    let parts = [
        Some(("query", query, Role::Written)),
        key.map(|k| ("key", k, Role::Written)),
        Some(("positions", &positions, Role::Read)),
        Some(("cos_sin_cache", cos_sin_cache, Role::Read)),
    ];
    let call = Call::new(registry, op, parts)?;
    let (key_index, positions_index, cache_index) = match key {
        Some(_) => (Some(1), 2, 3),
        None => (None, 1, 2),
    };
    let to_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
    let (head_size, rotary_dim) = (to_i64(head_size), to_i64(rotary_dim));
    let split = key_index.is_some_and(|key| call.same_storage(0, key));
    if split {
        // Two dispatches, the query's first: the op's own checks of every argument run before
        // it, so nothing is written when the key is refused. (One dispatch checks them itself.)
        let metas =
            call.parts.iter().map(|part| meta_of(&part.tensor)).collect::<Result<SmallVec<[TensorMeta; 4]>>>()?;
        let tensor = |index: Option<usize>| index.map_or(ArgMeta::None, |index| ArgMeta::Tensor(&metas[index]));
        let args = [
            tensor(Some(positions_index)),
            tensor(Some(0)),
            tensor(key_index),
            tensor(Some(cache_index)),
            ArgMeta::I64(head_size),
            ArgMeta::I64(rotary_dim),
            ArgMeta::Bool(is_neox_style),
            ArgMeta::Str(rounding.as_str()),
        ];
        (crate::rotary_embedding::ROTARY_EMBEDDING.meta)(&crate::rotary_embedding::ROTARY_EMBEDDING, &args)
            .map_err(CallError::from)?;
    }
    call.locked(|memories| {
        let lease = Lease::new(op);
        // SAFETY (every view below): views of locked parts; the query and the key are written, and
        // when they share a storage only one of them is viewed at a time.
        let (p, c) = unsafe {
            (
                call.view(&lease, positions_index, memories[positions_index], HostAccess::ReadOnly)?,
                call.view(&lease, cache_index, memories[cache_index], HostAccess::ReadOnly)?,
            )
        };
        let rotate = crate::rotary_embedding::maybe_inplace;
        if split {
            for target in [Some(0), key_index].into_iter().flatten() {
                // SAFETY: above; the other target's view is gone.
                let q = unsafe { call.view(&lease, target, memories[target], HostAccess::ReadWrite)? };
                let written = Some(q.storage_id());
                let (rotated, _) = rotate(registry, &p, q, None, &c, head_size, rotary_dim, is_neox_style, rounding)?;
                call.land(&lease, target, memories[target], written, rotated)?;
            }
            return Ok(());
        }
        // SAFETY: above; separate storages.
        let (q, k) = unsafe {
            let q = call.view(&lease, 0, memories[0], HostAccess::ReadWrite)?;
            let k = key_index.map(|k| call.view(&lease, k, memories[k], HostAccess::ReadWrite)).transpose()?;
            (q, k)
        };
        let written = (Some(q.storage_id()), k.as_ref().map(Tensor::storage_id));
        let (rq, rk) = rotate(registry, &p, q, k, &c, head_size, rotary_dim, is_neox_style, rounding)?;
        drop((p, c));
        call.land(&lease, 0, memories[0], written.0, rq)?;
        match (key_index, rk) {
            (Some(k), Some(rk)) => call.land(&lease, k, memories[k], written.1, rk),
            _ => Ok(()),
        }
    })
}

/// `fused_add_rms_norm` then static fp8 quantization, fused: `residual ← x + residual` in place,
/// and the codes of the norm as a fresh candle tensor.
#[allow(clippy::too_many_arguments)] // one argument per parameter of the op
pub fn fused_add_rms_norm_static_fp8_quant(
    registry: &Registry,
    x: &candle::Tensor,
    residual: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale: &candle::Tensor,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<candle::Tensor> {
    let call = crate::fused_add_rms_norm_static_fp8_quant::call_maybe_inplace;
    let (_, codes) = call(&Candle(registry), x, residual.clone(), weight, epsilon, scale, out_dtype, rounding)?;
    Ok(codes)
}

/// `fused_add_rms_norm` then dynamic per-token fp8 quantization, fused (the residual form of
/// vLLM's `rms_norm_dynamic_per_token_quant`): `residual ← x + residual` in place, and the codes
/// of the norm and the per-token scales (`[..., 1]`, f32) as fresh candle tensors. `scale_ub`
/// bounds each row's absmax.
#[allow(clippy::too_many_arguments)] // one argument per parameter of the op
pub fn fused_add_rms_norm_dynamic_per_token_quant(
    registry: &Registry,
    x: &candle::Tensor,
    residual: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale_ub: Option<&candle::Tensor>,
    out_dtype: DType,
    rounding: Rounding,
) -> Result<(candle::Tensor, candle::Tensor)> {
    let call = crate::fused_add_rms_norm_dynamic_per_token_quant::call_maybe_inplace;
    let (_, codes, scales) =
        call(&Candle(registry), x, residual.clone(), weight, epsilon, scale_ub, out_dtype, rounding)?;
    Ok((codes, scales))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_add_rms_norm::{self, FusedAddRmsNormImpl};
    use ir_core::ImplSpec;
    use ir_core::{KernelError, UniqueTensor, bit_eq};

    /// An in-place provider: native's results written into the donated tensors.
    fn in_place(
        x: UniqueTensor,
        r: UniqueTensor,
        w: Option<&Tensor>,
        eps: f64,
        variance: Option<i64>,
        rounding: Rounding,
    ) -> std::result::Result<(Tensor, Tensor), KernelError> {
        let (out, res) = fused_add_rms_norm::native(x.tensor(), r.tensor(), w, eps, variance, rounding)?;
        let (mut x, mut r) = (x.into_tensor(), r.into_tensor());
        x.copy_from(&out)?;
        r.copy_from(&res)?;
        Ok((x, r))
    }

    /// The views over candle memory through an in-place provider, a functional one, and one
    /// storage shared by the written tensors (small enough for Miri, which CI runs on it).
    #[test]
    fn candle_memory_is_written_through_the_views() {
        let registry = crate::registry();
        fused_add_rms_norm::register(&registry, ImplSpec::new("test"), FusedAddRmsNormImpl::inplace(in_place)).unwrap();
        let _guard = registry.override_priority("fused_add_rms_norm", &["test"]).unwrap();
        let device = candle::Device::Cpu;
        let values = |seed: f32| (0..24).map(|i| (i as f32 * seed).sin()).collect::<Vec<f32>>();
        let copy = |t: &candle::Tensor| Tensor::from_candle(t).unwrap();
        for shared in [false, true] {
            let (x, residual) = if shared {
                let both = candle::Tensor::from_vec(values(0.7), (3, 8), &device).unwrap();
                (both.narrow(1, 0, 4).unwrap(), both.narrow(1, 4, 4).unwrap())
            } else {
                (
                    candle::Tensor::from_vec(values(0.7)[..12].to_vec(), (3, 4), &device).unwrap(),
                    candle::Tensor::from_vec(values(0.3)[..12].to_vec(), (3, 4), &device).unwrap(),
                )
            };
            let weight = candle::Tensor::from_vec(vec![1.0f32, 2.0, 0.5, -1.0], 4, &device).unwrap();
            let (xo, ro, wo) = (copy(&x), copy(&residual), copy(&weight));
            fused_add_rms_norm(&registry, &x, &residual, Some(&weight), 1e-6, crate::Rounding::Exact).unwrap();
            let (out, res) =
                fused_add_rms_norm::native(&xo, &ro, Some(&wo), 1e-6, None, crate::Rounding::Exact).unwrap();
            assert!(bit_eq(&copy(&x), &out) && bit_eq(&copy(&residual), &res), "shared storage: {shared}");
        }
        let record = registry.selection_record();
        assert_eq!(record.op("fused_add_rms_norm").unwrap().inplace_writes, 2, "the separate storages in place");
        let y = rms_norm(&registry, &candle::Tensor::from_vec(values(0.5), (3, 8), &device).unwrap(), None, 1e-6);
        assert_eq!(y.unwrap().dims(), [3, 8]);
    }

    /// Rotary through an in-place provider: a query and a key in separate storages (one dispatch,
    /// two writable views), and as column slices of one storage (one writable view at a time);
    /// small enough for Miri.
    #[test]
    fn rotary_writes_candle_memory_through_one_view_per_storage_at_a_time() {
        use crate::rotary_embedding::{self as rotary, Impl};
        let registry = crate::registry();
        let in_place = Impl::inplace(|p, q: UniqueTensor, k: Option<UniqueTensor>, c, h, r, neox, rounding| {
            let (rq, rk) =
                rotary::native(p, q.tensor(), k.as_ref().map(UniqueTensor::tensor), c, h, r, neox, rounding)?;
            let mut q = q.into_tensor();
            q.copy_from(&rq)?;
            let k = match (k, rk) {
                (Some(k), Some(rk)) => {
                    let mut k = k.into_tensor();
                    k.copy_from(&rk)?;
                    Some(k)
                }
                _ => None,
            };
            Ok((q, k))
        });
        rotary::register(&registry, ImplSpec::new("test"), in_place).unwrap();
        let _guard = registry.override_priority("rotary_embedding", &["test"]).unwrap();
        let device = candle::Device::Cpu;
        let values = |n: usize, seed: f32| (0..n).map(|i| (i as f32 * seed).sin()).collect::<Vec<f32>>();
        let cache = rotary::cos_sin_cache(DType::F32, 4, 4, 100.0).unwrap();
        let positions = candle::Tensor::from_vec(vec![1i64, 3], 2, &device).unwrap();
        let ours_positions = Tensor::from_vec(&[2], vec![1i64, 3]).unwrap();
        let candle_cache = cache.clone().into_candle().unwrap();
        let copy = |t: &candle::Tensor| Tensor::from_candle(t).unwrap();
        let separate = (
            candle::Tensor::from_vec(values(8, 0.7), (2, 4), &device).unwrap(),
            candle::Tensor::from_vec(values(8, 0.3), (2, 4), &device).unwrap(),
        );
        let qkv = candle::Tensor::from_vec(values(16, 0.5), (2, 8), &device).unwrap();
        let shared = (qkv.narrow(1, 0, 4).unwrap(), qkv.narrow(1, 4, 4).unwrap());
        for (q, k) in [separate, shared] {
            let (qo, ko) = (copy(&q), copy(&k));
            rotary_embedding(&registry, &positions, &q, Some(&k), &candle_cache, 4, 4, true, Rounding::Exact).unwrap();
            let (eq, ek) =
                rotary::native(&ours_positions, &qo, Some(&ko), &cache, 4, 4, true, Rounding::Exact).unwrap();
            assert!(bit_eq(&copy(&q), &eq) && bit_eq(&copy(&k), &ek.unwrap()));
        }
        let record = registry.selection_record();
        let op = record.op("rotary_embedding").unwrap();
        assert_eq!((op.inplace_writes, op.defensive_copies), (4, 0), "every view written in place");
    }
}
