//! Byte buffers behind tensors: 64-byte aligned host memory, or device memory from a kernel crate.
//!
//! `ir-core` has no GPU dependency: device memory comes through the [`DeviceBuffer`] and
//! [`DeviceAllocator`] traits, which the kernel crates implement.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::{Device, Layout, TensorMeta};

static CPU_BYTES_ALLOCATED: AtomicU64 = AtomicU64::new(0);

/// Total bytes of host storage allocated by this process so far (monotonic; for reports and demos).
pub fn cpu_bytes_allocated() -> u64 {
    CPU_BYTES_ALLOCATED.load(Ordering::Relaxed)
}

static HOST_ROUND_TRIPS: AtomicU64 = AtomicU64::new(0);

/// How many times this process moved device tensors through host memory to compute on them: a
/// native kernel given device tensors, a built-in or a copy that a backend has no device-side path
/// for. Monotonic; explicit transfers (`Tensor::to_cpu`, uploads) are not counted. An engine reads
/// it around a step to prove that step stayed on the device.
pub fn host_round_trips() -> u64 {
    HOST_ROUND_TRIPS.load(Ordering::Relaxed)
}

thread_local! {
    static THREAD_HOST_ROUND_TRIPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// [`host_round_trips`] made on the calling thread: what a step on this thread caused, whatever
/// other threads do meanwhile.
pub fn host_round_trips_on_this_thread() -> u64 {
    THREAD_HOST_ROUND_TRIPS.with(std::cell::Cell::get)
}

static REFUSE_HOST_ROUND_TRIPS: AtomicBool = AtomicBool::new(false);

/// Refuses (`true`) or allows again (`false`, the default) every host round trip of this process
/// (see [`host_round_trips`]): a refused one fails, naming the op or built-in, instead of running
/// slowly. An engine that must keep a step on the device turns this on; the host reference paths
/// stay available to tests that allow them.
pub fn refuse_host_round_trips(refuse: bool) {
    REFUSE_HOST_ROUND_TRIPS.store(refuse, Ordering::Relaxed);
}

/// Whether host round trips are refused ([`refuse_host_round_trips`]).
pub fn host_round_trips_refused() -> bool {
    REFUSE_HOST_ROUND_TRIPS.load(Ordering::Relaxed)
}

/// What a refused host round trip says (after the operation).
pub const HOST_ROUND_TRIP_REFUSED: &str =
    "refused: it would move device tensors through host memory (ir_core::storage::refuse_host_round_trips)";

/// Counts one host round trip of `operation` on device tensors of `device` (see
/// [`host_round_trips`]), or refuses it ([`refuse_host_round_trips`]).
pub fn note_host_round_trip(operation: &'static str, device: Device) -> Result<(), DeviceError> {
    if host_round_trips_refused() {
        return Err(DeviceError { device, operation, message: HOST_ROUND_TRIP_REFUSED.to_owned() });
    }
    count_host_round_trip(operation);
    Ok(())
}

/// Counts one host round trip (dispatch checks the refusal itself, to name the rejections).
pub(crate) fn count_host_round_trip(operation: &str) {
    HOST_ROUND_TRIPS.fetch_add(1, Ordering::Relaxed);
    THREAD_HOST_ROUND_TRIPS.with(|count| count.set(count.get() + 1));
    tracing::debug!(target: "ir_core::storage", operation, "device tensors through host memory");
}

/// An error from device memory management, reported by a kernel crate.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{device}: {operation} failed: {message}")]
pub struct DeviceError {
    /// The device involved.
    pub device: Device,
    /// What was attempted (`allocate`, `upload`, `download`, `copy`).
    pub operation: &'static str,
    /// The driver's description.
    pub message: String,
}

/// An elementwise operation of two tensors ([`DeviceBuffer::binary_strided`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a · b`.
    Mul,
}

impl BinaryOp {
    /// The built-in's name (`add`, `mul`).
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Mul => "mul",
        }
    }
}

/// Device memory owned by one tensor storage. Implemented by the kernel crates.
pub trait DeviceBuffer: Send + Sync + fmt::Debug + Any {
    /// The device holding the memory.
    fn device(&self) -> Device;
    /// Size in bytes.
    fn len_bytes(&self) -> usize;
    /// Copies the whole buffer to host memory (`dst.len() == self.len_bytes()`); synchronizes.
    fn download(&self, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Copies host bytes into the start of the buffer.
    fn upload(&mut self, src: &[u8]) -> Result<(), DeviceError>;
    /// Allocates another buffer on the same device, zeroed.
    fn allocate_like(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError>;
    /// Allocates another buffer on the same device whose bytes are unspecified until written: for
    /// an output whose every byte is written before anything reads it (a compact copy, `cat`,
    /// `scale`, `add`, `mul`, an upload), so no fill pass runs first. The default zeroes
    /// ([`allocate_like`](DeviceBuffer::allocate_like)); backends override it.
    fn allocate_for_overwrite(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError> {
        self.allocate_like(len_bytes)
    }
    /// Copies the elements `src` describes in this buffer into `dst` with `dst_layout` (same shape and dtype).
    ///
    /// The default goes through host memory; backends override it with a device-side copy.
    fn copy_strided(
        &self,
        src: &TensorMeta,
        dst: &mut dyn DeviceBuffer,
        dst_layout: &Layout,
    ) -> Result<(), DeviceError> {
        copy_strided_through_host(self, src, dst, dst_layout)
    }
    /// Writes the elements `src` describes in this buffer into `dst` as `dst_meta` describes them
    /// (same shape, any layout), converted to `dst_meta`'s dtype: `round_dst(v)`, or with `factor`
    /// `round_dst(round_c(v · round_c(factor)))` where `c` is the source's compute dtype (the
    /// semantics of `copy_` and `scale`). Returns `false`, leaving `dst` untouched, where the
    /// backend has no device-side conversion for the case; the caller then converts on the host.
    ///
    /// The default has none.
    fn convert_strided(
        &self,
        src: &TensorMeta,
        dst: &mut dyn DeviceBuffer,
        dst_meta: &TensorMeta,
        factor: Option<f64>,
    ) -> Result<bool, DeviceError> {
        let _ = (src, dst, dst_meta, factor);
        Ok(false)
    }
    /// Writes `round(a ∘ b)` (`op`) of the elements `a` describes in this buffer and `b` describes in
    /// `other` (same shape and dtype) into `dst` as `dst_meta` describes them (compact), computed in
    /// the dtype's compute dtype and rounded once to the dtype: the `add` and `mul` built-ins.
    /// Returns `false`, leaving `dst` untouched, where the backend has no device-side kernel for the
    /// case; the caller then computes on the host.
    ///
    /// The default has none.
    fn binary_strided(
        &self,
        a: &TensorMeta,
        other: &dyn DeviceBuffer,
        b: &TensorMeta,
        op: BinaryOp,
        dst: &mut dyn DeviceBuffer,
        dst_meta: &TensorMeta,
    ) -> Result<bool, DeviceError> {
        let _ = (a, other, b, op, dst, dst_meta);
        Ok(false)
    }
    /// For downcasting to the backend's concrete buffer type.
    fn as_any(&self) -> &dyn Any;
    /// For downcasting to the backend's concrete buffer type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// [`DeviceBuffer::copy_strided`] through host memory: both buffers downloaded, the elements moved
/// on the host, the destination uploaded. The default of the trait, and the fallback of backends
/// whose device-side copy does not cover a case.
pub fn copy_strided_through_host(
    src_buffer: &(impl DeviceBuffer + ?Sized),
    src: &TensorMeta,
    dst: &mut dyn DeviceBuffer,
    dst_layout: &Layout,
) -> Result<(), DeviceError> {
    note_host_round_trip("copy", src_buffer.device())?;
    let size = src.dtype.size_in_bytes();
    let mut src_bytes = vec![0u8; src_buffer.len_bytes()];
    src_buffer.download(&mut src_bytes)?;
    let mut dst_bytes = vec![0u8; dst.len_bytes()];
    dst.download(&mut dst_bytes)?;
    for (from, to) in src.layout.storage_indices().zip(dst_layout.storage_indices()) {
        dst_bytes[to * size..(to + 1) * size].copy_from_slice(&src_bytes[from * size..(from + 1) * size]);
    }
    dst.upload(&dst_bytes)
}

/// Allocates device memory on one device. Implemented by the kernel crates.
pub trait DeviceAllocator: Send + Sync {
    /// The device allocated on.
    fn device(&self) -> Device;
    /// A zero-filled buffer of `len_bytes` bytes.
    fn allocate(&self, len_bytes: usize) -> Result<Box<dyn DeviceBuffer>, DeviceError>;
}

/// The memory behind one or more tensors.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuBuffer),
    /// Device memory.
    Device(Box<dyn DeviceBuffer>),
}

impl Storage {
    /// The device holding the memory.
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Device(buffer) => buffer.device(),
        }
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        match self {
            Storage::Cpu(buffer) => buffer.len_bytes(),
            Storage::Device(buffer) => buffer.len_bytes(),
        }
    }

    /// Whether tensors may write this memory (read-only host memory from another library is not).
    #[inline]
    pub fn is_writable(&self) -> bool {
        match self {
            Storage::Cpu(buffer) => buffer.access() == HostAccess::ReadWrite,
            Storage::Device(_) => true,
        }
    }
}

/// A host allocation the allocator refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("out of memory: cannot allocate {bytes} bytes")]
pub struct OutOfMemory {
    /// The bytes asked for.
    pub bytes: usize,
}

/// Who may write a host buffer's memory through tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostAccess {
    /// Tensors may write the memory when they own it uniquely (in-place kernels, `copy_`).
    ReadWrite,
    /// Tensors never write the memory: an in-place call copies first, `copy_` into it is refused.
    ReadOnly,
}

/// Host memory: where it starts, and what keeps it alive.
///
/// Buffers allocated here own a `Vec<T>` of the dtype's element type, with the start moved to the
/// first 64-byte boundary (so the vector can be handed to another library without a copy);
/// buffers over someone else's memory (a moved-in vector, a candle tensor, a DLPack producer) own
/// whatever keeps that memory alive.
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    len_bytes: usize,
    access: HostAccess,
    owner: Owner,
}

/// What keeps a host buffer's memory alive: owned by the buffer alone, or shared (a view's keep
/// handle, held without an allocation of its own).
enum Owner {
    Boxed(Box<dyn Any + Send + Sync>),
    Shared(Arc<dyn Any + Send + Sync>),
}

impl Owner {
    fn get(&self) -> &(dyn Any + Send + Sync) {
        match self {
            Owner::Boxed(owner) => &**owner,
            Owner::Shared(owner) => &**owner,
        }
    }
}

// SAFETY: the memory is plain bytes reachable from any thread; `owner` is `Send + Sync`, and the
// unsafe constructor's contract makes the memory valid for access from any thread while it lives.
unsafe impl Send for CpuBuffer {}
// SAFETY: as above; shared access only reads (`bytes`), writes need `&mut self`.
unsafe impl Sync for CpuBuffer {}

/// The alignment of buffers allocated here.
pub const CPU_ALIGNMENT: usize = 64;

/// Host buffers at least this large are kept when freed and reused by the next allocation of the
/// same dtype and size from any thread (smaller ones are kept by the thread that frees them, see
/// [`THREAD_CACHE_BYTES`]).
pub const HOST_POOL_MIN_BYTES: usize = 1 << 20;
/// The most bytes of freed small host buffers (under [`HOST_POOL_MIN_BYTES`]) each thread keeps
/// for its next buffer of the same dtype and size, in at most [`THREAD_CACHE_BLOCKS`] buffers. A
/// decode step allocates the same small outputs every layer: a kept buffer saves the allocator's
/// call and, for [`CpuBuffer::for_overwrite`], the zeroing (about 100 ns of a 16 KB output, as much
/// as the kernel that fills it). A host pool capacity of 0 ([`set_host_pool_capacity`]) turns this
/// cache off too.
pub const THREAD_CACHE_BYTES: usize = 4 << 20;
/// The most freed small buffers each thread keeps ([`THREAD_CACHE_BYTES`]).
pub const THREAD_CACHE_BLOCKS: usize = 32;
/// The most bytes of freed buffers the host pool keeps unless [`set_host_pool_capacity`] says
/// otherwise (the `vllm-ir` crate's `registry()` applies `VLLM_IR_HOST_POOL_MIB`).
pub const HOST_POOL_DEFAULT_BYTES: usize = 1 << 30;

/// Whether a new buffer must read as zeros.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fill {
    Zeros,
    Unspecified,
}

/// A vector of `elements + padding` zeroed `T`s, where `padding` leaves room to move the start to
/// the next 64-byte boundary, and the buffer's byte length.
fn aligned_vec<T: bytemuck::Pod>(elements: usize) -> Result<(Vec<T>, usize), OutOfMemory> {
    let size = size_of::<T>();
    let len_bytes = elements.checked_mul(size).ok_or(OutOfMemory { bytes: usize::MAX })?;
    let padding = CPU_ALIGNMENT / size;
    // The allocation's layout is checked too: a size past `isize::MAX` is refused, not wrapped.
    let total = elements.checked_add(padding).ok_or(OutOfMemory { bytes: len_bytes })?;
    let vec = bytemuck::allocation::try_zeroed_vec::<T>(total).map_err(|()| OutOfMemory { bytes: len_bytes })?;
    Ok((vec, len_bytes))
}

/// Freed large host buffers, by dtype and element count, kept for reuse up to a byte bound.
///
/// At prefill sizes a fresh buffer costs more than the kernel that fills it: the system allocator
/// maps new pages for it and unmaps them when it is freed, so every call pays the operating system's
/// page faults and zeroing (82% of a 4096×4096 f32 `rms_norm` on the development machine). A decoder
/// allocates the same sizes every step, so a buffer kept by dtype and size is taken again at once.
struct HostPool {
    /// Most bytes kept ([`set_host_pool_capacity`]).
    capacity: std::sync::atomic::AtomicUsize,
    state: std::sync::Mutex<PoolState>,
}

/// Freed vectors (`Vec<T>` of the dtype's element type, boxed) by dtype and element count.
type FreeBlocks = std::collections::HashMap<(crate::DType, usize), Vec<Box<dyn Any + Send + Sync>>>;

#[derive(Default)]
struct PoolState {
    /// Created at the first buffer put back (a `static` cannot build a hash map).
    free: Option<FreeBlocks>,
    held_bytes: usize,
}

fn host_pool() -> &'static HostPool {
    static POOL: HostPool = HostPool {
        capacity: std::sync::atomic::AtomicUsize::new(HOST_POOL_DEFAULT_BYTES),
        state: std::sync::Mutex::new(PoolState { free: None, held_bytes: 0 }),
    };
    &POOL
}

/// Bounds the bytes of freed host buffers the process keeps for reuse (`0` turns the pool off);
/// buffers held beyond the new bound are freed now.
pub fn set_host_pool_capacity(bytes: usize) {
    let pool = host_pool();
    pool.capacity.store(bytes, Ordering::Relaxed);
    let mut state = pool.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let PoolState { free, held_bytes } = &mut *state;
    for ((dtype, elements), blocks) in free.iter_mut().flatten() {
        while *held_bytes > bytes && blocks.pop().is_some() {
            *held_bytes -= elements * dtype.size_in_bytes();
        }
    }
}

/// The bound [`set_host_pool_capacity`] set (by default [`HOST_POOL_DEFAULT_BYTES`]).
pub fn host_pool_capacity() -> usize {
    host_pool().capacity.load(Ordering::Relaxed)
}

impl HostPool {
    fn take<T: 'static>(&self, key: (crate::DType, usize)) -> Option<Vec<T>> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let block = state.free.as_mut()?.get_mut(&key)?.pop()?;
        state.held_bytes -= key.1 * key.0.size_in_bytes();
        drop(state);
        block.downcast::<Vec<T>>().ok().map(|vec| *vec)
    }

    fn put(&self, key: (crate::DType, usize), bytes: usize, vec: Box<dyn Any + Send + Sync>) {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if state.held_bytes + bytes > self.capacity.load(Ordering::Relaxed) {
            drop(state);
            tracing::trace!(target: "ir_core::storage", bytes, "host pool full; freeing the buffer");
            return;
        }
        state.held_bytes += bytes;
        state.free.get_or_insert_default().entry(key).or_default().push(vec);
    }
}

/// A freed block's vector (`Vec<T>` of the dtype's element type, boxed) with its dtype and element
/// count.
type Block = ((crate::DType, usize), Box<dyn Any + Send + Sync>);

/// The freed small buffers of one thread ([`THREAD_CACHE_BYTES`]).
struct ThreadCache {
    blocks: Vec<Block>,
    bytes: usize,
}

thread_local! {
    static THREAD_CACHE: std::cell::RefCell<ThreadCache> =
        const { std::cell::RefCell::new(ThreadCache { blocks: Vec::new(), bytes: 0 }) };
}

/// A freed small block of this thread with `key`, if it keeps one.
fn thread_cache_take(key: (crate::DType, usize)) -> Option<Box<dyn Any + Send + Sync>> {
    THREAD_CACHE
        .try_with(|cache| {
            let mut cache = cache.try_borrow_mut().ok()?;
            let at = cache.blocks.iter().rposition(|(k, _)| *k == key)?;
            let (_, block) = cache.blocks.swap_remove(at);
            cache.bytes -= key.1 * key.0.size_in_bytes();
            Some(block)
        })
        .ok()
        .flatten()
}

/// Keeps a freed small block in this thread's cache when it has room (else, or while the thread
/// exits, the block is freed).
fn thread_cache_put(key: (crate::DType, usize), bytes: usize, block: Box<dyn Any + Send + Sync>) {
    let mut block = Some(block);
    let _ = THREAD_CACHE.try_with(|cache| {
        let Ok(mut cache) = cache.try_borrow_mut() else { return };
        let room = cache.blocks.len() < THREAD_CACHE_BLOCKS && cache.bytes + bytes <= THREAD_CACHE_BYTES;
        if room && host_pool_capacity() > 0 {
            cache.bytes += bytes;
            cache.blocks.extend(block.take().map(|block| (key, block)));
        }
    });
    // Not kept: freed here, after the cache's borrow ended.
    drop(block);
}

/// Bytes of freed small buffers this thread keeps now ([`THREAD_CACHE_BYTES`]; for tests).
pub fn thread_cache_bytes() -> usize {
    THREAD_CACHE.try_with(|cache| cache.try_borrow().map_or(0, |cache| cache.bytes)).unwrap_or(0)
}

/// Bytes of freed host buffers the pool holds now (for reports and tests).
pub fn host_pool_bytes() -> usize {
    host_pool().state.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).held_bytes
}

/// A pooled buffer's vector: goes back to the pool when the buffer is dropped (unless the candle
/// conversion took it over).
pub(crate) struct PooledBlock {
    key: (crate::DType, usize),
    bytes: usize,
    vec: Option<Box<dyn Any + Send + Sync>>,
}

impl PooledBlock {
    /// Whether the block goes back to its thread's cache rather than the shared pool.
    fn is_small(&self) -> bool {
        self.bytes < HOST_POOL_MIN_BYTES
    }
}

impl PooledBlock {
    /// Whether the block holds a `Vec<T>`.
    #[cfg(feature = "candle")]
    pub(crate) fn holds<T: 'static>(&self) -> bool {
        self.vec.as_ref().is_some_and(|vec| vec.is::<Vec<T>>())
    }

    /// Takes the vector out (it then leaves the pool for good).
    #[cfg(feature = "candle")]
    pub(crate) fn take_vec<T: 'static>(&mut self) -> Option<Vec<T>> {
        let vec = self.vec.take()?;
        match vec.downcast::<Vec<T>>() {
            Ok(vec) => Some(*vec),
            Err(other) => {
                self.vec = Some(other);
                None
            }
        }
    }
}

impl Drop for PooledBlock {
    fn drop(&mut self) {
        if let Some(vec) = self.vec.take() {
            if self.is_small() {
                thread_cache_put(self.key, self.bytes, vec);
            } else {
                host_pool().put(self.key, self.bytes, vec);
            }
        }
    }
}

impl CpuBuffer {
    /// A zero-filled buffer of `len_bytes` bytes starting at a 64-byte boundary, or
    /// [`OutOfMemory`] when the allocator refuses it (never an abort). Zeroed pages come from the
    /// allocator (`calloc`-style), not written here.
    pub fn zeroed(len_bytes: usize) -> Result<CpuBuffer, OutOfMemory> {
        CpuBuffer::zeroed_elements::<u8>(len_bytes)
    }

    /// A zero-filled buffer for `len_bytes` bytes of `dtype` elements, owning a `Vec` of the
    /// dtype's element type (so [`CpuBuffer::into_vec`] and the candle conversion can hand it over
    /// without a copy). `len_bytes` is rounded up to whole elements. Buffers of at least
    /// [`HOST_POOL_MIN_BYTES`] may reuse a freed one of the same size (zeroed here).
    pub fn zeroed_for(dtype: crate::DType, len_bytes: usize) -> Result<CpuBuffer, OutOfMemory> {
        CpuBuffer::for_dtype(dtype, len_bytes, Fill::Zeros)
    }

    /// A buffer for `len_bytes` bytes of `dtype` elements whose contents are unspecified (zeros, or
    /// the values of a dropped tensor's buffer of the same size): for kernels that write every
    /// element of their output. Always initialized memory (never undefined behaviour to read); large
    /// buffers come from the host pool without the page faults and zeroing of fresh memory.
    pub fn for_overwrite(dtype: crate::DType, len_bytes: usize) -> Result<CpuBuffer, OutOfMemory> {
        CpuBuffer::for_dtype(dtype, len_bytes, Fill::Unspecified)
    }

    fn for_dtype(dtype: crate::DType, len_bytes: usize, fill: Fill) -> Result<CpuBuffer, OutOfMemory> {
        let elements = len_bytes.div_ceil(dtype.size_in_bytes());
        let mut buffer = match dtype {
            crate::DType::F32 => CpuBuffer::elements::<f32>(dtype, elements, fill)?,
            crate::DType::F16 => CpuBuffer::elements::<half::f16>(dtype, elements, fill)?,
            crate::DType::BF16 => CpuBuffer::elements::<half::bf16>(dtype, elements, fill)?,
            crate::DType::F64 => CpuBuffer::elements::<f64>(dtype, elements, fill)?,
            crate::DType::F8E4M3FN => CpuBuffer::elements::<crate::F8E4M3>(dtype, elements, fill)?,
            crate::DType::F8E5M2 => CpuBuffer::elements::<crate::F8E5M2>(dtype, elements, fill)?,
            crate::DType::I8 => CpuBuffer::elements::<i8>(dtype, elements, fill)?,
            crate::DType::I64 => CpuBuffer::elements::<i64>(dtype, elements, fill)?,
        };
        buffer.len_bytes = len_bytes;
        Ok(buffer)
    }

    fn zeroed_elements<T: bytemuck::Pod + Send + Sync>(elements: usize) -> Result<CpuBuffer, OutOfMemory> {
        let (vec, len_bytes) = aligned_vec::<T>(elements)?;
        Ok(CpuBuffer::over_aligned_vec(vec, len_bytes, |vec| Box::new(vec)))
    }

    /// `elements` of `T` (the element type of `dtype`): from the shared pool when large enough, from
    /// this thread's cache when small, else fresh.
    fn elements<T: bytemuck::Pod + Send + Sync>(
        dtype: crate::DType,
        elements: usize,
        fill: Fill,
    ) -> Result<CpuBuffer, OutOfMemory> {
        let len_bytes = elements.checked_mul(size_of::<T>()).ok_or(OutOfMemory { bytes: usize::MAX })?;
        if host_pool_capacity() == 0 {
            return CpuBuffer::zeroed_elements::<T>(elements);
        }
        let key = (dtype, elements);
        if len_bytes < HOST_POOL_MIN_BYTES {
            return CpuBuffer::small_elements::<T>(key, len_bytes, fill);
        }
        let vec = match host_pool().take::<T>(key) {
            Some(mut vec) => {
                if fill == Fill::Zeros {
                    vec.fill(T::zeroed());
                }
                vec
            }
            None => aligned_vec::<T>(elements)?.0,
        };
        Ok(CpuBuffer::over_aligned_vec(vec, len_bytes, |vec| {
            Box::new(PooledBlock { key, bytes: len_bytes, vec: Some(Box::new(vec)) })
        }))
    }

    /// A small buffer: a block this thread freed (kept boxed, so taking it allocates nothing), or
    /// fresh; it goes back to the cache of the thread that frees it.
    fn small_elements<T: bytemuck::Pod + Send + Sync>(
        key: (crate::DType, usize),
        len_bytes: usize,
        fill: Fill,
    ) -> Result<CpuBuffer, OutOfMemory> {
        let mut block = match thread_cache_take(key) {
            Some(mut block) if block.is::<Vec<T>>() => {
                if fill == Fill::Zeros {
                    block.downcast_mut::<Vec<T>>().expect("checked above").fill(T::zeroed());
                }
                block
            }
            // A fresh vector reads as zeros.
            _ => Box::new(aligned_vec::<T>(key.1)?.0) as Box<dyn Any + Send + Sync>,
        };
        let start = CpuBuffer::aligned_start(block.downcast_mut::<Vec<T>>().expect("a Vec<T> by construction"));
        CPU_BYTES_ALLOCATED.fetch_add(len_bytes as u64, Ordering::Relaxed);
        Ok(CpuBuffer {
            ptr: start,
            len_bytes,
            access: HostAccess::ReadWrite,
            owner: Owner::Boxed(Box::new(PooledBlock { key, bytes: len_bytes, vec: Some(block) })),
        })
    }

    /// The first 64-byte boundary of a vector from [`aligned_vec`].
    fn aligned_start<T>(vec: &mut Vec<T>) -> NonNull<u8> {
        let padding = CPU_ALIGNMENT / size_of::<T>();
        let base = vec.as_mut_ptr();
        let skip = base.align_offset(CPU_ALIGNMENT).min(padding);
        // SAFETY: `skip <= padding`, inside the allocation of `elements + padding` elements.
        let start = unsafe { base.add(skip) }.cast::<u8>();
        NonNull::new(start).expect("a vector's pointer is never null")
    }

    /// A buffer over `vec`'s first 64-byte boundary (see [`aligned_vec`]), kept alive by `owner(vec)`.
    fn over_aligned_vec<T: bytemuck::Pod + Send + Sync>(
        mut vec: Vec<T>,
        len_bytes: usize,
        owner: impl FnOnce(Vec<T>) -> Box<dyn Any + Send + Sync>,
    ) -> CpuBuffer {
        // Moving the vector into its owner does not move its heap allocation.
        let start = CpuBuffer::aligned_start(&mut vec);
        CPU_BYTES_ALLOCATED.fetch_add(len_bytes as u64, Ordering::Relaxed);
        CpuBuffer { ptr: start, len_bytes, access: HostAccess::ReadWrite, owner: Owner::Boxed(owner(vec)) }
    }

    /// A buffer over a vector's elements, without a copy (writable; the start is wherever the
    /// vector's allocation is, aligned to `T`).
    pub fn from_vec<T: crate::Element>(mut vec: Vec<T>) -> CpuBuffer {
        let len_bytes = size_of_val(vec.as_slice());
        let ptr = NonNull::new(vec.as_mut_ptr().cast::<u8>()).expect("a vector's pointer is never null");
        CpuBuffer { ptr, len_bytes, access: HostAccess::ReadWrite, owner: Owner::Boxed(Box::new(vec)) }
    }

    /// A buffer over memory someone else owns, without a copy. `owner` is kept alive as long as
    /// the buffer (and every tensor over it) and dropped after the last one.
    ///
    /// # Safety
    ///
    /// For as long as `owner` is alive:
    /// - `ptr` is valid for reads of `len_bytes` bytes (and, with [`HostAccess::ReadWrite`], for
    ///   writes) from any thread, and the memory does not move;
    /// - nothing but tensors over this buffer writes the memory while a tensor over it is alive
    ///   (with `ReadOnly`: nothing writes it at all), so kernels reading it never race a writer;
    /// - `len_bytes <= isize::MAX`.
    pub unsafe fn from_external(
        ptr: NonNull<u8>,
        len_bytes: usize,
        access: HostAccess,
        owner: impl Any + Send + Sync,
    ) -> CpuBuffer {
        CpuBuffer { ptr, len_bytes, access, owner: Owner::Boxed(Box::new(owner)) }
    }

    /// As [`CpuBuffer::from_external`], kept alive by a handle the caller shares (one more
    /// reference, no allocation): for views made per call under a lock, whose owner counts them.
    ///
    /// # Safety
    ///
    /// The contract of [`CpuBuffer::from_external`], for as long as `owner` (this handle or any
    /// clone of it) is alive.
    pub unsafe fn from_external_shared(
        ptr: NonNull<u8>,
        len_bytes: usize,
        access: HostAccess,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> CpuBuffer {
        CpuBuffer { ptr, len_bytes, access, owner: Owner::Shared(owner) }
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Whether tensors may write this memory.
    pub fn access(&self) -> HostAccess {
        self.access
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// What keeps the memory alive (the vector allocated here, a moved-in vector, a candle tensor,
    /// a DLPack tensor, or an engine's owner value).
    pub fn owner(&self) -> &(dyn Any + Send + Sync) {
        self.owner.get()
    }

    /// The vector behind the buffer, when it is a `Vec<T>` whose elements the buffer covers from
    /// its first (a buffer from [`CpuBuffer::from_vec`]); the buffer back otherwise.
    pub fn into_vec<T: crate::Element>(self) -> Result<Vec<T>, CpuBuffer> {
        let CpuBuffer { ptr, len_bytes, access, owner } = self;
        match owner {
            Owner::Boxed(owner)
                if owner.downcast_ref::<Vec<T>>().is_some_and(|vec| {
                    vec.as_ptr().cast::<u8>() == ptr.as_ptr() && size_of_val(vec.as_slice()) == len_bytes
                }) =>
            {
                Ok(*owner.downcast::<Vec<T>>().expect("checked above"))
            }
            owner => Err(CpuBuffer { ptr, len_bytes, access, owner }),
        }
    }

    /// The first byte and what keeps the memory alive, giving the buffer up.
    #[cfg(feature = "candle")]
    /// The buffer back when its owner is shared.
    pub(crate) fn into_owner(self) -> Result<(NonNull<u8>, Box<dyn Any + Send + Sync>), CpuBuffer> {
        match self.owner {
            Owner::Boxed(owner) => Ok((self.ptr, owner)),
            owner @ Owner::Shared(_) => Err(CpuBuffer { owner, ..self }),
        }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for reads of `len_bytes` while `owner` lives (allocated here, or
        // the contract of `from_external`); writes need `&mut self`, which this borrow excludes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }

    /// The bytes, mutably.
    ///
    /// Tensors never hand out a read-only buffer mutably ([`Tensor::storage_mut`] refuses it),
    /// and a read-only buffer is only made by [`CpuBuffer::from_external`], whose caller owns it.
    ///
    /// # Panics
    ///
    /// On a [`HostAccess::ReadOnly`] buffer.
    ///
    /// [`Tensor::storage_mut`]: crate::Tensor::storage_mut
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(self.access == HostAccess::ReadWrite, "a read-only host buffer cannot be written");
        // SAFETY: valid for writes (allocated here, or `ReadWrite` under `from_external`'s
        // contract), and `&mut self` excludes every other access through this buffer.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }

    /// The buffer as elements of `T` (the whole buffer, `len_bytes / size_of::<T>()` elements).
    ///
    /// This is the whole storage, not a tensor's view of it: read a tensor's own elements with
    /// [`Tensor::to_vec`](crate::Tensor::to_vec).
    pub fn typed<T: bytemuck::Pod>(&self) -> &[T] {
        let whole = self.bytes();
        let n = whole.len() / size_of::<T>();
        bytemuck::cast_slice(&whole[..n * size_of::<T>()])
    }

    /// The buffer as elements of `T`, mutably.
    pub fn typed_mut<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        let whole = self.bytes_mut();
        let n = whole.len() / size_of::<T>();
        bytemuck::cast_slice_mut(&mut whole[..n * size_of::<T>()])
    }
}

impl fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuBuffer({} bytes, {:?})", self.len_bytes, self.access)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Each pool test uses a size of its own: the pool is shared by the tests running in parallel.

    #[test]
    fn a_freed_large_buffer_is_reused_and_reads_as_zeros_when_asked() {
        let bytes = HOST_POOL_MIN_BYTES + 4 * 4001;
        let mut first = CpuBuffer::for_overwrite(crate::DType::F32, bytes).unwrap();
        assert_eq!(first.bytes().len(), bytes);
        assert_eq!(first.as_ptr() as usize % CPU_ALIGNMENT, 0);
        first.bytes_mut().fill(0xab);
        let start = first.as_ptr();
        drop(first);
        let again = CpuBuffer::for_overwrite(crate::DType::F32, bytes).unwrap();
        assert_eq!(again.as_ptr(), start, "the freed buffer came back");
        assert!(again.bytes().iter().all(|&b| b == 0xab), "for_overwrite leaves the old contents");
        drop(again);
        let zeroed = CpuBuffer::zeroed_for(crate::DType::F32, bytes).unwrap();
        assert_eq!(zeroed.as_ptr(), start, "reused again");
        assert!(zeroed.bytes().iter().all(|&b| b == 0), "zeroed_for zeroes a reused buffer");
        // Another dtype of the same byte size does not take it.
        drop(zeroed);
        let other = CpuBuffer::for_overwrite(crate::DType::BF16, bytes).unwrap();
        assert_ne!(other.as_ptr(), start);
    }

    #[test]
    fn small_buffers_come_back_to_the_thread_that_freed_them() {
        // Sizes of this test's own: the cache is per thread, but a test thread may run other tests.
        let bytes = 4 * 3001;
        let before = thread_cache_bytes();
        let mut first = CpuBuffer::for_overwrite(crate::DType::F32, bytes).unwrap();
        assert_eq!(first.as_ptr() as usize % CPU_ALIGNMENT, 0);
        assert!(first.bytes().iter().all(|&b| b == 0), "a fresh buffer reads as zeros");
        first.bytes_mut().fill(0xcd);
        let start = first.as_ptr();
        drop(first);
        assert_eq!(thread_cache_bytes(), before + bytes, "kept by this thread");
        let again = CpuBuffer::for_overwrite(crate::DType::F32, bytes).unwrap();
        assert_eq!(again.as_ptr(), start, "the freed buffer came back");
        assert!(again.bytes().iter().all(|&b| b == 0xcd), "for_overwrite leaves the old contents");
        assert_eq!(thread_cache_bytes(), before);
        drop(again);
        let zeroed = CpuBuffer::zeroed_for(crate::DType::F32, bytes).unwrap();
        assert_eq!(zeroed.as_ptr(), start, "reused again");
        assert!(zeroed.bytes().iter().all(|&b| b == 0), "zeroed_for zeroes a reused buffer");
        drop(zeroed);
        assert!(CpuBuffer::for_overwrite(crate::DType::BF16, bytes).unwrap().as_ptr() != start, "another dtype");
        assert!(CpuBuffer::for_overwrite(crate::DType::F32, bytes + 4).unwrap().as_ptr() != start, "another size");
        // Freed on another thread: kept there, not here.
        let elsewhere = CpuBuffer::for_overwrite(crate::DType::F32, bytes).unwrap();
        assert_eq!(elsewhere.as_ptr(), start);
        let here = thread_cache_bytes();
        let kept_there = std::thread::spawn(move || {
            drop(elsewhere);
            thread_cache_bytes()
        })
        .join()
        .unwrap();
        assert_eq!(kept_there, bytes);
        assert_eq!(thread_cache_bytes(), here, "nothing came back here");
        let large = CpuBuffer::for_overwrite(crate::DType::F32, HOST_POOL_MIN_BYTES + 4 * 4003).unwrap();
        assert!(large.owner().is::<PooledBlock>());
    }

    #[test]
    fn a_thread_keeps_at_most_its_cache_bound() {
        let bytes = HOST_POOL_MIN_BYTES - 4096;
        let fit = THREAD_CACHE_BYTES / bytes;
        assert!(fit < 6, "the test frees more than fit");
        let kept = std::thread::spawn(move || {
            let buffers: Vec<CpuBuffer> =
                (0..6).map(|_| CpuBuffer::for_overwrite(crate::DType::BF16, bytes).unwrap()).collect();
            drop(buffers);
            let by_bytes = thread_cache_bytes();
            let many: Vec<CpuBuffer> =
                (0..THREAD_CACHE_BLOCKS + 8).map(|_| CpuBuffer::for_overwrite(crate::DType::I8, 64).unwrap()).collect();
            drop(many);
            (by_bytes, thread_cache_bytes() - by_bytes)
        })
        .join()
        .unwrap();
        assert_eq!(kept.0, fit * bytes, "as many as fit under the byte bound");
        assert_eq!(kept.1, (THREAD_CACHE_BLOCKS - fit) * 64, "the rest up to the block bound");
    }

    #[test]
    fn the_pool_keeps_at_most_its_capacity() {
        let pool =
            HostPool { capacity: std::sync::atomic::AtomicUsize::new(3 << 20), state: std::sync::Mutex::default() };
        let key = (crate::DType::F32, (1 << 20) / 4);
        for _ in 0..5 {
            pool.put(key, 1 << 20, Box::new(vec![0f32; (1 << 20) / 4]));
        }
        let held = pool.state.lock().unwrap().held_bytes;
        assert_eq!(held, 3 << 20, "two of the five were freed");
        assert!(pool.take::<f32>(key).is_some());
        assert_eq!(pool.state.lock().unwrap().held_bytes, 2 << 20);
        assert!(pool.take::<f32>((crate::DType::F32, 17)).is_none(), "no buffer of another size");
    }

    #[test]
    fn cpu_buffers_are_aligned_and_zeroed() {
        for len in [0, 1, 63, 64, 65, 4096] {
            let buffer = CpuBuffer::zeroed(len).unwrap();
            assert_eq!(buffer.bytes().len(), len);
            assert_eq!(buffer.bytes().as_ptr() as usize % 64, 0);
            assert!(buffer.bytes().iter().all(|&b| b == 0));
        }
        let mut buffer = CpuBuffer::zeroed(12).unwrap();
        buffer.typed_mut::<f32>()[2] = 1.5;
        assert_eq!(buffer.typed::<f32>(), &[0.0, 0.0, 1.5]);
    }
}
