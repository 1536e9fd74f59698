//! The ops on candle tensors (feature `candle`): each call runs the registry's dispatch (selection,
//! priorities, the selection record) on candle's own CPU memory, under candle's storage locks, and
//! writes in place where candle lets one storage be written.
//!
//! | function | writes in place | allocates |
//! |---|---|---|
//! | [`rms_norm`], [`silu_and_mul`], [`gelu_and_mul`], the quantizations, [`rms_norm_static_fp8_quant`], [`rms_norm_dynamic_per_token_quant`] | nothing | the outputs |
//! | [`fused_add_rms_norm`] | `x` ← the norm, `residual` ← `x + residual` | nothing |
//! | [`rotary_embedding`] | `query` and `key` | nothing |
//! | [`fused_add_rms_norm_static_fp8_quant`] | `residual` ← `x + residual` | the fp8 output |
//! | [`fused_add_rms_norm_dynamic_per_token_quant`] | `residual` ← `x + residual` | the fp8 output and the per-token scales |
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
//! Candle's in-place custom ops (`InplaceOp1/2/3`) hand out one storage mutably, under its write
//! lock. The in-place functions nest them: `fused_add_rms_norm` takes the residual's write lock,
//! then x's (and the weight's read lock), so its kernel writes both where they are; `rotary_embedding`
//! rotates the query, then the key, each under its own write lock, so a query and a key that are
//! column slices of one `qkv` storage are rotated in place too (never two writable views of one
//! storage at once). Like candle's own in-place ops, they write the storage every clone of the
//! tensor shares. When dispatch runs a functional provider instead (native on a fallback, say), its
//! result is copied into the candle memory, and the selection record counts the copy as a
//! defensive copy of the op.
//!
//! A tensor that is written and one that is read may not share a storage (x and the weight, say):
//! candle's lock would be taken twice. The read one is copied first (counted as a defensive copy
//! of the op in the selection record), and two written ones sharing a storage (x and the residual)
//! are computed functionally and copied back.
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
use ir_core::Device;
use ir_core::InteropError;
use ir_core::registry::{CallError, Registry};
use ir_core::storage::{CpuBuffer, DeviceBuffer, HostAccess, Storage};
use ir_core::{DType, Layout, StorageId, Tensor, TensorError};

const LIBRARY: &str = "candle";

/// Why an op on candle tensors failed.
#[derive(Debug, thiserror::Error)]
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
    unsafe fn view(&self, memory: Memory<'_>, layout: &candle::Layout, access: HostAccess) -> Result<Tensor> {
        let layout = Layout::new(layout.dims(), layout.stride(), layout.start_offset())
            .map_err(|error| InteropError::UnsupportedLayout { library: LIBRARY, reason: error.to_string() })?;
        match memory {
            Memory::Host(dtype, ptr, len_bytes) => {
                let ptr = NonNull::new(ptr).unwrap_or(NonNull::dangling());
                // SAFETY: the caller's contract, for the lease's lifetime; the views are dropped
                // before the lease ends (checked in `Drop`).
                let buffer = unsafe { CpuBuffer::from_external(ptr, len_bytes, access, Arc::clone(&self.token)) };
                Ok(Tensor::from_storage(Storage::Cpu(buffer), dtype, layout)?)
            }
            // SAFETY: the caller's contract, which is the bridge's: candle's lock is held while the
            // lease (every handle of its token) lives.
            Memory::Cuda(storage) => Ok(unsafe { cuda_bridge()?.view(storage, layout, Arc::clone(&self.token))? }),
        }
    }
}

/// A tensor's storage under its read lock, and its layout (candle's `storage_and_layout`).
type ReadGuard<'a> = (std::sync::RwLockReadGuard<'a, candle::Storage>, &'a candle::Layout);

impl Lease {
    /// A read-only view of the tensor whose read lock `guard` holds.
    ///
    /// # Safety
    ///
    /// `guard` is held until the lease ends (every view is gone).
    unsafe fn read_view(&self, (storage, layout): &ReadGuard<'_>) -> Result<Tensor> {
        // SAFETY: the read lock is held while the view lives (the caller's contract); nothing
        // writes the storage meanwhile.
        unsafe { self.view(Memory::of(storage)?, layout, HostAccess::ReadOnly) }
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
fn lendable(tensors: &[Option<&candle::Tensor>]) -> Result<()> {
    let mut tensors = tensors.iter().flatten();
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
/// once: two tensors share a storage exactly when these are equal.
fn storage_identity(tensor: &candle::Tensor) -> usize {
    let (storage, _) = tensor.storage_and_layout();
    std::ptr::from_ref::<candle::Storage>(&*storage) as usize
}

/// `tensor`, or a copy of it when it shares a storage with one of `written` (the identities of the
/// storages whose write locks will be held while `tensor` is read), counted as a defensive copy
/// of `op`.
fn apart_from(registry: &Registry, op: &str, tensor: &candle::Tensor, written: &[usize]) -> Result<candle::Tensor> {
    if written.contains(&storage_identity(tensor)) {
        registry.count_defensive_copy(op);
        return Ok(tensor.copy()?);
    }
    Ok(tensor.clone())
}

/// Runs `f` on read-only views of `inputs` (read locks held throughout, taken in order) and
/// converts its outputs to candle tensors (without a copy when the kernel's output owns its
/// vector, as fresh outputs do).
fn functional<const N: usize>(
    op: &'static str,
    inputs: [Option<&candle::Tensor>; N],
    f: impl FnOnce(&[Option<Tensor>; N]) -> std::result::Result<Vec<Tensor>, CallError>,
) -> Result<Vec<candle::Tensor>> {
    lendable(&inputs)?;
    let anchor = inputs.iter().flatten().next().copied();
    let guards: Vec<_> = inputs.iter().map(|t| t.map(candle::Tensor::storage_and_layout)).collect();
    let outputs = {
        let lease = Lease::new(op);
        let mut views: [Option<Tensor>; N] = std::array::from_fn(|_| None);
        for (view, guard) in views.iter_mut().zip(&guards) {
            if let Some(guard) = guard {
                // SAFETY: the read lock is held until `guards` is dropped, after the lease.
                *view = Some(unsafe { lease.read_view(guard)? });
            }
        }
        let outputs = f(&views);
        drop(views);
        outputs?
    };
    drop(guards);
    let anchor = anchor.expect("every op reads a tensor");
    outputs.into_iter().map(|t| output_to_candle(t, anchor)).collect()
}

/// `rms_norm(x, weight, epsilon)` as a fresh candle tensor (candle-nn's `ops::rms_norm`).
pub fn rms_norm(
    registry: &Registry,
    x: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
) -> Result<candle::Tensor> {
    let mut out = functional("rms_norm", [Some(x), weight], |[x, w]| {
        let x = x.as_ref().expect("given");
        Ok(vec![crate::rms_norm::rms_norm(registry, x, w.as_ref(), epsilon, None)?])
    })?;
    Ok(out.remove(0))
}

/// `silu(gate) * up` of `x = [..., gate | up]` as a fresh candle tensor: the gate is the first half
/// of the last dimension, as vLLM's merged `gate_up_proj` weight gives it.
pub fn silu_and_mul(registry: &Registry, x: &candle::Tensor) -> Result<candle::Tensor> {
    let mut out = functional("silu_and_mul", [Some(x)], |[x]| {
        Ok(vec![crate::silu_and_mul::silu_and_mul(registry, x.as_ref().expect("given"))?])
    })?;
    Ok(out.remove(0))
}

/// `gelu(gate) * up` of `x = [..., gate | up]` as a fresh candle tensor.
pub fn gelu_and_mul(registry: &Registry, x: &candle::Tensor, approximate: Approximate) -> Result<candle::Tensor> {
    let mut out = functional("gelu_and_mul", [Some(x)], |[x]| {
        Ok(vec![crate::gelu_and_mul::gelu_and_mul(registry, x.as_ref().expect("given"), approximate)?])
    })?;
    Ok(out.remove(0))
}

/// fp8 quantization with a static scale (`scale`: one f32): the codes as a candle tensor
/// (`out_dtype` must have a candle counterpart: e4m3).
pub fn static_scaled_fp8_quant(
    registry: &Registry,
    x: &candle::Tensor,
    scale: &candle::Tensor,
    out_dtype: DType,
) -> Result<candle::Tensor> {
    let mut out = functional("static_scaled_fp8_quant", [Some(x), Some(scale)], |[x, s]| {
        let (x, s) = (x.as_ref().expect("given"), s.as_ref().expect("given"));
        Ok(vec![crate::static_scaled_fp8_quant::static_scaled_fp8_quant(registry, x, s, out_dtype)?])
    })?;
    Ok(out.remove(0))
}

/// Dynamic per-token fp8 quantization: `(codes, scales [..., 1])`.
pub fn dynamic_per_token_scaled_fp8_quant(
    registry: &Registry,
    x: &candle::Tensor,
    scale_ub: Option<&candle::Tensor>,
    out_dtype: DType,
) -> Result<(candle::Tensor, candle::Tensor)> {
    let out = functional("dynamic_per_token_scaled_fp8_quant", [Some(x), scale_ub], |[x, ub]| {
        let x = x.as_ref().expect("given");
        let (q, s) = crate::dynamic_per_token_scaled_fp8_quant::dynamic_per_token_scaled_fp8_quant(
            registry,
            x,
            ub.as_ref(),
            out_dtype,
        )?;
        Ok(vec![q, s])
    })?;
    let [q, s]: [candle::Tensor; 2] = out.try_into().expect("two outputs");
    Ok((q, s))
}

/// `rms_norm` then static fp8 quantization, fused: the codes.
pub fn rms_norm_static_fp8_quant(
    registry: &Registry,
    x: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale: &candle::Tensor,
    out_dtype: DType,
) -> Result<candle::Tensor> {
    let mut out = functional("rms_norm_static_fp8_quant", [Some(x), weight, Some(scale)], |[x, w, s]| {
        let (x, s) = (x.as_ref().expect("given"), s.as_ref().expect("given"));
        Ok(vec![crate::rms_norm_static_fp8_quant::rms_norm_static_fp8_quant(
            registry,
            x,
            w.as_ref(),
            epsilon,
            s,
            out_dtype,
        )?])
    })?;
    Ok(out.remove(0))
}

/// `rms_norm` then dynamic per-token fp8 quantization, fused: `(codes, scales [..., 1])`.
pub fn rms_norm_dynamic_per_token_quant(
    registry: &Registry,
    x: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale_ub: Option<&candle::Tensor>,
    out_dtype: DType,
) -> Result<(candle::Tensor, candle::Tensor)> {
    let out = functional("rms_norm_dynamic_per_token_quant", [Some(x), weight, scale_ub], |[x, w, ub]| {
        let x = x.as_ref().expect("given");
        let (q, s) = crate::rms_norm_dynamic_per_token_quant::rms_norm_dynamic_per_token_quant(
            registry,
            x,
            w.as_ref(),
            epsilon,
            ub.as_ref(),
            out_dtype,
        )?;
        Ok(vec![q, s])
    })?;
    let [q, s]: [candle::Tensor; 2] = out.try_into().expect("two outputs");
    Ok((q, s))
}

/// What an in-place op's kernel call reports back through candle's `InplaceOp` (whose error type
/// is candle's): this module's error, kept typed.
struct Outcome(RefCell<Option<CandleOpError>>);

impl Outcome {
    fn new() -> Outcome {
        Outcome(RefCell::new(None))
    }

    /// Turns `result` into candle's result, keeping the error here.
    fn keep<T>(&self, result: Result<T>) -> candle::Result<T> {
        result.map_err(|error| {
            let message = candle::Error::msg(error.to_string());
            *self.0.borrow_mut() = Some(error);
            message
        })
    }

    /// The result of the candle call that ran the op: the kept error first.
    fn finish(self, result: candle::Result<()>) -> Result<()> {
        match (self.0.into_inner(), result) {
            (Some(error), _) => Err(error),
            (None, result) => Ok(result?),
        }
    }
}

/// Leaves `result` where it is when a provider wrote it into the view `written` (same storage),
/// else copies it into `target` (a functional provider's fresh output), counted as a defensive copy
/// of the lease's op.
fn land(
    registry: &Registry,
    lease: &Lease,
    written: Option<StorageId>,
    target: Memory<'_>,
    layout: &candle::Layout,
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
    lendable(&[Some(x), Some(residual), weight])?;
    let written = [storage_identity(x), storage_identity(residual)];
    let weight = weight.map(|w| apart_from(registry, "fused_add_rms_norm", w, &written)).transpose()?;
    let outcome = Outcome::new();
    let op = FusedAddRmsNorm { registry, x, weight: weight.as_ref(), epsilon, rounding, outcome: &outcome };
    let result = if written[0] == written[1] {
        // One storage: one write lock; computed functionally and written back.
        residual.inplace_op1(&SharedFused(op))
    } else {
        residual.inplace_op1(&op)
    };
    outcome.finish(result)
}

struct FusedAddRmsNorm<'a> {
    registry: &'a Registry,
    x: &'a candle::Tensor,
    weight: Option<&'a candle::Tensor>,
    epsilon: f64,
    rounding: Rounding,
    outcome: &'a Outcome,
}

impl FusedAddRmsNorm<'_> {
    /// Under the residual's write lock: takes x's (and the weight's read lock), then runs.
    fn run(&self, residual: Memory<'_>, residual_layout: &candle::Layout) -> candle::Result<()> {
        let inner = FusedInner { outer: self, residual: std::cell::Cell::new(Some((residual, residual_layout))) };
        let result = match self.weight {
            Some(weight) => self.x.inplace_op2(weight, &inner),
            None => self.x.inplace_op1(&inner),
        };
        // An error the inner op kept is in the outcome; candle's own errors pass through.
        if self.outcome.0.borrow().is_some() {
            return Err(candle::Error::msg("fused_add_rms_norm failed"));
        }
        result
    }
}

impl candle::InplaceOp1 for FusedAddRmsNorm<'_> {
    fn name(&self) -> &'static str {
        "vllm-ir-fused-add-rms-norm"
    }

    fn cpu_fwd(&self, residual: &mut candle::CpuStorage, residual_layout: &candle::Layout) -> candle::Result<()> {
        let residual = self.outcome.keep(Memory::host_mut(residual))?;
        self.run(residual, residual_layout)
    }

    fn cuda_fwd(&self, residual: &mut candle::CudaStorage, residual_layout: &candle::Layout) -> candle::Result<()> {
        self.run(Memory::Cuda(residual), residual_layout)
    }
}

/// The inner half of [`FusedAddRmsNorm`]: x's storage, with the residual's lent from the outer op.
struct FusedInner<'a, 'b> {
    outer: &'a FusedAddRmsNorm<'a>,
    residual: std::cell::Cell<Option<(Memory<'b>, &'b candle::Layout)>>,
}

/// A storage read by an in-place op, and its layout.
type ReadPart<'a> = (Memory<'a>, &'a candle::Layout);

impl FusedInner<'_, '_> {
    fn run(&self, x: Memory<'_>, x_layout: &candle::Layout, weight: Option<ReadPart<'_>>) -> Result<()> {
        let outer = self.outer;
        let (residual, residual_layout) = self.residual.take().expect("run once");
        let lease = Lease::new("fused_add_rms_norm");
        // SAFETY: x's and the residual's write locks are held (distinct storages: checked before the
        // outer op), the weight's read lock too; each view covers its own storage.
        let (x_view, r_view, w_view) = unsafe {
            (
                lease.view(x, x_layout, HostAccess::ReadWrite)?,
                lease.view(residual, residual_layout, HostAccess::ReadWrite)?,
                weight.map(|(memory, layout)| lease.view(memory, layout, HostAccess::ReadOnly)).transpose()?,
            )
        };
        let (x_id, r_id) = (Some(x_view.storage_id()), Some(r_view.storage_id()));
        let (out, res) = crate::fused_add_rms_norm::maybe_inplace(
            outer.registry,
            x_view,
            r_view,
            w_view.as_ref(),
            outer.epsilon,
            None,
            outer.rounding,
        )?;
        drop(w_view);
        // A provider that ran functionally returned fresh tensors: they are copied into place.
        land(outer.registry, &lease, x_id, x, x_layout, out)?;
        land(outer.registry, &lease, r_id, residual, residual_layout, res)
    }
}

impl candle::InplaceOp1 for FusedInner<'_, '_> {
    fn name(&self) -> &'static str {
        "vllm-ir-fused-add-rms-norm-x"
    }

    fn cpu_fwd(&self, x: &mut candle::CpuStorage, layout: &candle::Layout) -> candle::Result<()> {
        self.outer.outcome.keep(Memory::host_mut(x).and_then(|x| self.run(x, layout, None)))
    }

    fn cuda_fwd(&self, x: &mut candle::CudaStorage, layout: &candle::Layout) -> candle::Result<()> {
        self.outer.outcome.keep(self.run(Memory::Cuda(x), layout, None))
    }
}

impl candle::InplaceOp2 for FusedInner<'_, '_> {
    fn name(&self) -> &'static str {
        "vllm-ir-fused-add-rms-norm-x"
    }

    fn cpu_fwd(
        &self,
        x: &mut candle::CpuStorage,
        x_layout: &candle::Layout,
        weight: &candle::CpuStorage,
        weight_layout: &candle::Layout,
    ) -> candle::Result<()> {
        let result = (|| self.run(Memory::host_mut(x)?, x_layout, Some((Memory::host(weight)?, weight_layout))))();
        self.outer.outcome.keep(result)
    }

    fn cuda_fwd(
        &self,
        x: &mut candle::CudaStorage,
        x_layout: &candle::Layout,
        weight: &candle::CudaStorage,
        weight_layout: &candle::Layout,
    ) -> candle::Result<()> {
        self.outer.outcome.keep(self.run(Memory::Cuda(x), x_layout, Some((Memory::Cuda(weight), weight_layout))))
    }
}

/// [`FusedAddRmsNorm`] when x and the residual share one storage: functional, then both results
/// written back (never two writable views of one storage at once).
struct SharedFused<'a>(FusedAddRmsNorm<'a>);

impl SharedFused<'_> {
    fn run(&self, whole: Memory<'_>, residual_layout: &candle::Layout) -> Result<()> {
        let op = &self.0;
        let x_layout = op.x.layout();
        let lease = Lease::new("fused_add_rms_norm");
        let (out, res) = {
            let weight = op.weight.map(candle::Tensor::storage_and_layout);
            // SAFETY: the storage's write lock is held (both views only read it until they are
            // dropped below); the weight's read lock is held while its view lives.
            let (x_view, r_view, w_view) = unsafe {
                (
                    lease.view(whole, x_layout, HostAccess::ReadOnly)?,
                    lease.view(whole, residual_layout, HostAccess::ReadOnly)?,
                    weight.as_ref().map(|guard| lease.read_view(guard)).transpose()?,
                )
            };
            let outputs = crate::fused_add_rms_norm::fused_add_rms_norm(
                op.registry,
                &x_view,
                &r_view,
                w_view.as_ref(),
                op.epsilon,
                None,
                op.rounding,
            );
            drop((x_view, r_view, w_view));
            outputs?
        };
        // Fresh tensors (the views were read-only): both copied into place.
        land(op.registry, &lease, None, whole, x_layout, out)?;
        land(op.registry, &lease, None, whole, residual_layout, res)
    }
}

impl candle::InplaceOp1 for SharedFused<'_> {
    fn name(&self) -> &'static str {
        "vllm-ir-fused-add-rms-norm-shared"
    }

    fn cpu_fwd(&self, storage: &mut candle::CpuStorage, residual_layout: &candle::Layout) -> candle::Result<()> {
        self.0.outcome.keep(Memory::host_mut(storage).and_then(|whole| self.run(whole, residual_layout)))
    }

    fn cuda_fwd(&self, storage: &mut candle::CudaStorage, residual_layout: &candle::Layout) -> candle::Result<()> {
        self.0.outcome.keep(self.run(Memory::Cuda(storage), residual_layout))
    }
}

/// Rotary position embedding in place on candle tensors: `query` and `key` (when given) are
/// rotated where they are, each under its own write lock, so column slices of one `qkv` storage
/// are rotated without a copy. `positions` are i64 or u32 (candle's usual index type, converted to
/// i64 first: one small copy); `cos_sin_cache` is `[max_position, rotary_dim]`, cos then sin.
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
    lendable(&[Some(query), key, Some(positions), Some(cos_sin_cache)])?;
    let targets: Vec<&candle::Tensor> = [Some(query), key].into_iter().flatten().collect();
    let written: Vec<usize> = targets.iter().map(|t| storage_identity(t)).collect();
    let positions = match positions.dtype() {
        candle::DType::U32 => positions.to_dtype(candle::DType::I64)?,
        _ => apart_from(registry, "rotary_embedding", positions, &written)?,
    };
    let cache = apart_from(registry, "rotary_embedding", cos_sin_cache, &written)?;
    let to_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
    for target in targets {
        let outcome = Outcome::new();
        let op = Rotary {
            registry,
            head_size: to_i64(head_size),
            rotary_dim: to_i64(rotary_dim),
            is_neox_style,
            rounding,
            outcome: &outcome,
        };
        let result = target.inplace_op3(&positions, &cache, &op);
        outcome.finish(result)?;
    }
    Ok(())
}

struct Rotary<'a> {
    registry: &'a Registry,
    head_size: i64,
    rotary_dim: i64,
    is_neox_style: bool,
    rounding: Rounding,
    outcome: &'a Outcome,
}

impl Rotary<'_> {
    fn run(
        &self,
        target: Memory<'_>,
        target_layout: &candle::Layout,
        (positions, positions_layout): ReadPart<'_>,
        (cache, cache_layout): ReadPart<'_>,
    ) -> Result<()> {
        let lease = Lease::new("rotary_embedding");
        // SAFETY: the target's write lock and the read locks of the positions and the cache
        // (other storages: copied apart before) are held; one writable view.
        let (q, p, c) = unsafe {
            (
                lease.view(target, target_layout, HostAccess::ReadWrite)?,
                lease.view(positions, positions_layout, HostAccess::ReadOnly)?,
                lease.view(cache, cache_layout, HostAccess::ReadOnly)?,
            )
        };
        let written = Some(q.storage_id());
        let (rotated, _) = crate::rotary_embedding::maybe_inplace(
            self.registry,
            &p,
            q,
            None,
            &c,
            self.head_size,
            self.rotary_dim,
            self.is_neox_style,
            self.rounding,
        )?;
        drop((p, c));
        land(self.registry, &lease, written, target, target_layout, rotated)
    }
}

impl candle::InplaceOp3 for Rotary<'_> {
    fn name(&self) -> &'static str {
        "vllm-ir-rotary-embedding"
    }

    fn cpu_fwd(
        &self,
        target: &mut candle::CpuStorage,
        target_layout: &candle::Layout,
        positions: &candle::CpuStorage,
        positions_layout: &candle::Layout,
        cache: &candle::CpuStorage,
        cache_layout: &candle::Layout,
    ) -> candle::Result<()> {
        let result = (|| {
            let (positions, cache) =
                ((Memory::host(positions)?, positions_layout), (Memory::host(cache)?, cache_layout));
            self.run(Memory::host_mut(target)?, target_layout, positions, cache)
        })();
        self.outcome.keep(result)
    }

    fn cuda_fwd(
        &self,
        target: &mut candle::CudaStorage,
        target_layout: &candle::Layout,
        positions: &candle::CudaStorage,
        positions_layout: &candle::Layout,
        cache: &candle::CudaStorage,
        cache_layout: &candle::Layout,
    ) -> candle::Result<()> {
        let (positions, cache) = ((Memory::Cuda(positions), positions_layout), (Memory::Cuda(cache), cache_layout));
        self.outcome.keep(self.run(Memory::Cuda(target), target_layout, positions, cache))
    }
}

/// `fused_add_rms_norm` then static fp8 quantization, fused: `residual ← x + residual` in place,
/// and the codes of the norm as a fresh candle tensor.
pub fn fused_add_rms_norm_static_fp8_quant(
    registry: &Registry,
    x: &candle::Tensor,
    residual: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale: &candle::Tensor,
    out_dtype: DType,
) -> Result<candle::Tensor> {
    let (codes, _) = fused_quant(registry, x, residual, weight, epsilon, Some(scale), false, out_dtype)?;
    Ok(codes)
}

/// `fused_add_rms_norm` then dynamic per-token fp8 quantization, fused (the residual form of
/// vLLM's `rms_norm_dynamic_per_token_quant`): `residual ← x + residual` in place, and the codes
/// of the norm and the per-token scales (`[..., 1]`, f32) as fresh candle tensors. `scale_ub`
/// bounds each row's absmax.
pub fn fused_add_rms_norm_dynamic_per_token_quant(
    registry: &Registry,
    x: &candle::Tensor,
    residual: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale_ub: Option<&candle::Tensor>,
    out_dtype: DType,
) -> Result<(candle::Tensor, candle::Tensor)> {
    let (codes, scales) = fused_quant(registry, x, residual, weight, epsilon, scale_ub, true, out_dtype)?;
    Ok((codes, scales.expect("the per-token form returns scales")))
}

/// The fused add + norm + quantization in place on the residual: the static form (`scale` given)
/// or the per-token one (`dynamic`, with an optional bound). Returns the codes, and the scales of
/// the per-token form.
#[allow(clippy::too_many_arguments)]
fn fused_quant(
    registry: &Registry,
    x: &candle::Tensor,
    residual: &candle::Tensor,
    weight: Option<&candle::Tensor>,
    epsilon: f64,
    scale: Option<&candle::Tensor>,
    dynamic: bool,
    out_dtype: DType,
) -> Result<(candle::Tensor, Option<candle::Tensor>)> {
    lendable(&[Some(residual), Some(x), weight, scale])?;
    let op = if dynamic { FUSED_DYNAMIC } else { FUSED_STATIC };
    let written = [storage_identity(residual)];
    let x = apart_from(registry, op, x, &written)?;
    let weight = weight.map(|w| apart_from(registry, op, w, &written)).transpose()?;
    let scale = scale.map(|s| apart_from(registry, op, s, &written)).transpose()?;
    let outcome = Outcome::new();
    let outputs = RefCell::new(None);
    let fused = FusedQuant {
        registry,
        x: &x,
        weight: weight.as_ref(),
        scale: scale.as_ref(),
        dynamic,
        epsilon,
        out_dtype,
        outcome: &outcome,
        outputs: &outputs,
    };
    let result = residual.inplace_op1(&fused);
    outcome.finish(result)?;
    let (codes, scales): (Tensor, Option<Tensor>) = outputs.into_inner().expect("set by a successful call");
    let scales = scales.map(|scales| output_to_candle(scales, residual)).transpose()?;
    Ok((output_to_candle(codes, residual)?, scales))
}

const FUSED_STATIC: &str = "fused_add_rms_norm_static_fp8_quant";
const FUSED_DYNAMIC: &str = "fused_add_rms_norm_dynamic_per_token_quant";

struct FusedQuant<'a> {
    registry: &'a Registry,
    x: &'a candle::Tensor,
    weight: Option<&'a candle::Tensor>,
    /// The static scale, or the per-token form's optional bound.
    scale: Option<&'a candle::Tensor>,
    dynamic: bool,
    epsilon: f64,
    out_dtype: DType,
    outcome: &'a Outcome,
    /// The codes, and the per-token form's scales.
    outputs: &'a RefCell<Option<(Tensor, Option<Tensor>)>>,
}

impl candle::InplaceOp1 for FusedQuant<'_> {
    fn name(&self) -> &'static str {
        if self.dynamic {
            "vllm-ir-fused-add-rms-norm-dynamic-per-token-quant"
        } else {
            "vllm-ir-fused-add-rms-norm-static-fp8-quant"
        }
    }

    fn cpu_fwd(&self, residual: &mut candle::CpuStorage, residual_layout: &candle::Layout) -> candle::Result<()> {
        self.outcome.keep(Memory::host_mut(residual).and_then(|residual| self.run(residual, residual_layout)))
    }

    fn cuda_fwd(&self, residual: &mut candle::CudaStorage, residual_layout: &candle::Layout) -> candle::Result<()> {
        self.outcome.keep(self.run(Memory::Cuda(residual), residual_layout))
    }
}

impl FusedQuant<'_> {
    fn run(&self, residual: Memory<'_>, residual_layout: &candle::Layout) -> Result<()> {
        let lease = Lease::new(if self.dynamic { FUSED_DYNAMIC } else { FUSED_STATIC });
        let reads: Vec<_> =
            [Some(self.x), self.weight, self.scale].iter().map(|t| t.map(candle::Tensor::storage_and_layout)).collect();
        // SAFETY: the read locks are held while `reads` lives, past every view.
        let read_view = |index: usize| reads[index].as_ref().map(|guard| unsafe { lease.read_view(guard) }).transpose();
        let (x, w, s) = (read_view(0)?.expect("given"), read_view(1)?, read_view(2)?);
        // SAFETY: the residual's write lock is held; its storage differs from the others'.
        let r = unsafe { lease.view(residual, residual_layout, HostAccess::ReadWrite)? };
        let written = Some(r.storage_id());
        let (res, q, scales) = if self.dynamic {
            let (res, q, scales) = crate::fused_add_rms_norm_dynamic_per_token_quant::maybe_inplace(
                self.registry,
                &x,
                r,
                w.as_ref(),
                self.epsilon,
                s.as_ref(),
                self.out_dtype,
            )?;
            (res, q, Some(scales))
        } else {
            let s = s.as_ref().ok_or_else(|| candle::Error::Msg(format!("{FUSED_STATIC}: no scale")))?;
            let (res, q) = crate::fused_add_rms_norm_static_fp8_quant::maybe_inplace(
                self.registry,
                &x,
                r,
                w.as_ref(),
                self.epsilon,
                s,
                self.out_dtype,
            )?;
            (res, q, None)
        };
        drop((x, w, s));
        land(self.registry, &lease, written, residual, residual_layout, res)?;
        *self.outputs.borrow_mut() = Some((q, scales));
        drop(reads);
        Ok(())
    }
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
}
