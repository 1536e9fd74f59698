//! Tensors: a reference-counted storage handle plus metadata.
//!
//! Cloning a [`Tensor`] copies the handle and shares the storage; views share it too. Writing needs
//! the storage to be *uniquely owned* (exactly one handle refers to it), checked at run time with
//! [`Arc::get_mut`], so a value someone can still read is never overwritten.

mod compare;
mod elementwise;
mod unique;

use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};

use crate::storage::{CpuBuffer, DeviceAllocator, DeviceError, Storage};
pub use crate::tensor::compare::{AllcloseError, allclose, bit_eq};
pub use crate::tensor::unique::UniqueTensor;
use crate::{DType, Device, Element, Layout, LayoutError, TensorMeta};

/// Runs `$body` with `$T` bound to the Rust element type of `$dtype`.
macro_rules! with_element_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::F8E4M3FN => {
                type $T = $crate::F8E4M3;
                $body
            }
            $crate::DType::F8E5M2 => {
                type $T = $crate::F8E5M2;
                $body
            }
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
        }
    };
}

/// Errors of tensor construction, views, copies and comparisons.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    // --- layouts and views ---
    /// An invalid layout or view.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A layout reaching past the end of its storage.
    #[error("layout {meta} needs {needed} bytes but its storage has {available}")]
    OutOfBounds {
        /// The metadata that does not fit.
        meta: Box<TensorMeta>,
        /// Bytes the layout reaches.
        needed: usize,
        /// Bytes the storage holds.
        available: usize,
    },
    /// Data whose length does not match the shape.
    #[error("shape {shape:?} needs {expected} values but {found} were given")]
    DataLength {
        /// The shape.
        shape: Vec<usize>,
        /// Elements the shape holds.
        expected: usize,
        /// Values given.
        found: usize,
    },

    // --- writes ---
    /// A write into storage that other handles or views still refer to.
    #[error("cannot write into {meta}: its storage is shared by {handles} handles (writing needs unique ownership)")]
    SharedStorage {
        /// The tensor written.
        meta: Box<TensorMeta>,
        /// How many handles refer to the storage.
        handles: usize,
    },
    /// A write through a layout that maps several elements to one storage index (a broadcast view):
    /// all but one of the values written there would be lost.
    #[error(
        "cannot write into {meta}: its layout maps several elements to one address (a broadcast view?), so all but \
         one value written there would be lost; write a contiguous copy instead"
    )]
    OverlappingLayout {
        /// The tensor written.
        meta: Box<TensorMeta>,
    },

    /// A write into memory another library lent read-only (a candle tensor, a read-only DLPack
    /// tensor, or host memory given as [`HostAccess::ReadOnly`](crate::storage::HostAccess::ReadOnly)).
    #[error("cannot write into {meta}: its memory is read-only (lent by another library)")]
    ReadOnlyStorage {
        /// The tensor written.
        meta: Box<TensorMeta>,
    },
    /// Host memory whose address is not a multiple of the element size.
    #[error("{dtype} elements need {alignment}-byte alignment, but the memory starts at {address:#x}")]
    Misaligned {
        /// The dtype.
        dtype: DType,
        /// The alignment needed.
        alignment: usize,
        /// The first element's address.
        address: usize,
    },

    // --- binary operations ---
    /// Operands with different shapes.
    #[error("{operation}: shapes {lhs:?} and {rhs:?} differ")]
    ShapeMismatch {
        /// The operation.
        operation: &'static str,
        /// Left shape.
        lhs: Vec<usize>,
        /// Right shape.
        rhs: Vec<usize>,
    },
    /// Operands with different dtypes.
    #[error("{operation}: dtypes {lhs} and {rhs} differ")]
    DTypeMismatch {
        /// The operation.
        operation: &'static str,
        /// Left dtype.
        lhs: DType,
        /// Right dtype.
        rhs: DType,
    },
    /// Operands on different devices.
    #[error("{operation}: devices {lhs} and {rhs} differ")]
    DeviceMismatch {
        /// The operation.
        operation: &'static str,
        /// Left device.
        lhs: Device,
        /// Right device.
        rhs: Device,
    },

    // --- sizes and memory ---
    /// A tensor whose byte extent exceeds `isize::MAX` (or whose element count overflows `usize`).
    #[error("{dtype}{shape:?} is too large: its bytes exceed isize::MAX")]
    TooLarge {
        /// Its dtype.
        dtype: DType,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// The host allocator refused an allocation.
    #[error("out of memory: cannot allocate {bytes} bytes")]
    OutOfMemory {
        /// The bytes asked for.
        bytes: usize,
    },

    // --- devices ---
    /// A device memory operation failed.
    #[error(transparent)]
    Device(#[from] DeviceError),

    // --- build ---
    /// Test inputs were asked of a build without ir-core's `testing` feature.
    #[error("generating test inputs needs ir-core's `testing` feature")]
    TestingDisabled,
}

impl From<crate::storage::OutOfMemory> for TensorError {
    fn from(error: crate::storage::OutOfMemory) -> TensorError {
        TensorError::OutOfMemory { bytes: error.bytes }
    }
}

/// Identity of a storage, unique for the life of the process (never reused, unlike an address), for
/// checking aliasing after handles were moved away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StorageId(u64);

static NEXT_STORAGE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A storage with its identity.
struct Shared {
    id: StorageId,
    storage: Storage,
}

impl Shared {
    fn new(storage: Storage) -> Arc<Shared> {
        let id = StorageId(NEXT_STORAGE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        Arc::new(Shared { id, storage })
    }
}

/// A storage handle plus metadata. `Clone` shares the storage.
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Shared>,
    meta: TensorMeta,
}

/// Whether two tensors share a storage (alias).
pub fn shares_storage(a: &Tensor, b: &Tensor) -> bool {
    Arc::ptr_eq(&a.storage, &b.storage)
}

impl Tensor {
    // --- construction ---

    /// A tensor over existing storage; the layout must fit inside it, and host memory must be
    /// aligned to the element size.
    pub fn from_storage(storage: Storage, dtype: DType, layout: Layout) -> Result<Tensor, TensorError> {
        let meta = TensorMeta { dtype, device: storage.device(), layout };
        check_fits(&meta, storage.len_bytes())?;
        if let Storage::Cpu(buffer) = &storage {
            let alignment = dtype.size_in_bytes();
            let address = buffer.as_ptr() as usize;
            if !address.is_multiple_of(alignment) {
                return Err(TensorError::Misaligned { dtype, alignment, address });
            }
        }
        Ok(Tensor { storage: Shared::new(storage), meta })
    }

    /// A compact CPU tensor of zeros; `TooLarge` past `isize::MAX` bytes, `OutOfMemory` when the
    /// allocator refuses.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Tensor, TensorError> {
        let too_large = || TensorError::TooLarge { dtype, shape: shape.to_vec() };
        let layout = Layout::try_compact(shape).map_err(|_| too_large())?;
        Tensor::zeros_with_layout(dtype, layout)
    }

    /// A CPU tensor of zeros with the given layout (storage sized to reach every element).
    pub fn zeros_with_layout(dtype: DType, layout: Layout) -> Result<Tensor, TensorError> {
        let meta = TensorMeta { dtype, device: Device::Cpu, layout };
        let storage = Storage::Cpu(CpuBuffer::zeroed_for(dtype, storage_bytes(&meta)?)?);
        Ok(Tensor { storage: Shared::new(storage), meta })
    }

    /// A CPU tensor with `layout` whose contents are unspecified: zeros, or the values a dropped
    /// tensor's buffer of the same size held ([`CpuBuffer::for_overwrite`]). For kernels that write
    /// every element of their output: large outputs then reuse the host pool's buffers instead of
    /// fresh pages. Reading it is never undefined behaviour, only meaningless.
    pub fn empty_with_layout(dtype: DType, layout: Layout) -> Result<Tensor, TensorError> {
        let meta = TensorMeta { dtype, device: Device::Cpu, layout };
        let storage = Storage::Cpu(CpuBuffer::for_overwrite(dtype, storage_bytes(&meta)?)?);
        Ok(Tensor { storage: Shared::new(storage), meta })
    }

    /// A compact CPU tensor of ones.
    pub fn ones(dtype: DType, shape: &[usize]) -> Result<Tensor, TensorError> {
        Tensor::full(dtype, shape, 1.0)
    }

    /// A compact CPU tensor filled with `value` (rounded to `dtype`).
    pub fn full(dtype: DType, shape: &[usize], value: f64) -> Result<Tensor, TensorError> {
        let mut tensor = Tensor::zeros(dtype, shape)?;
        let buffer = tensor.cpu_buffer_mut().ok().flatten().expect("fresh CPU storage is uniquely owned");
        with_element_type!(dtype, T => buffer.typed_mut::<T>().fill(<T as Element>::from_f64(value)));
        Ok(tensor)
    }

    /// A compact CPU tensor of `T`'s dtype holding `values` in row-major order, bit for bit (one copy
    /// into fresh 64-byte-aligned storage; [`Tensor::from_vec`] takes a vector without a copy).
    ///
    /// ```
    /// use ir_core::{half::bf16, Tensor};
    /// let t = Tensor::from_slice(&[2, 2], &[bf16::ONE, bf16::ZERO, bf16::ONE, bf16::ONE])?;
    /// assert_eq!(t.to_vec::<bf16>()?, [bf16::ONE, bf16::ZERO, bf16::ONE, bf16::ONE]);
    /// // A view reads its own elements: column 0.
    /// assert_eq!(t.slice(1, 0, 1)?.to_vec::<bf16>()?, [bf16::ONE, bf16::ONE]);
    /// # Ok::<(), ir_core::TensorError>(())
    /// ```
    pub fn from_slice<T: Element>(shape: &[usize], values: &[T]) -> Result<Tensor, TensorError> {
        let dtype = T::DTYPE;
        let expected =
            Layout::try_compact(shape).map_err(|_| TensorError::TooLarge { dtype, shape: shape.to_vec() })?.numel();
        if expected != values.len() {
            return Err(TensorError::DataLength { shape: shape.to_vec(), expected, found: values.len() });
        }
        let mut tensor = Tensor::zeros(dtype, shape)?;
        let buffer = tensor.cpu_buffer_mut().ok().flatten().expect("fresh CPU storage is uniquely owned");
        buffer.typed_mut::<T>()[..values.len()].copy_from_slice(values);
        Ok(tensor)
    }

    /// A compact CPU tensor over `values`, without a copy: the tensor's storage is the vector
    /// (aligned to `T`, not to 64 bytes), and [`Tensor::into_vec`] gives it back.
    ///
    /// ```
    /// use ir_core::Tensor;
    /// let values = vec![1.0f32, 2.0, 3.0, 4.0];
    /// let start = values.as_ptr();
    /// let t = Tensor::from_vec(&[2, 2], values)?;
    /// assert_eq!(t.cpu_buffer().unwrap().as_ptr(), start.cast());
    /// assert_eq!(t.into_vec::<f32>()?.as_ptr(), start); // the same allocation, back
    /// # Ok::<(), ir_core::TensorError>(())
    /// ```
    pub fn from_vec<T: Element>(shape: &[usize], values: Vec<T>) -> Result<Tensor, TensorError> {
        let dtype = T::DTYPE;
        let layout = Layout::try_compact(shape).map_err(|_| TensorError::TooLarge { dtype, shape: shape.to_vec() })?;
        if layout.numel() != values.len() {
            return Err(TensorError::DataLength {
                shape: shape.to_vec(),
                expected: layout.numel(),
                found: values.len(),
            });
        }
        Tensor::from_storage(Storage::Cpu(CpuBuffer::from_vec(values)), dtype, layout)
    }

    /// The tensor's elements as a vector in row-major order: without a copy when this handle owns
    /// its storage alone, the storage is a `Vec<T>` from [`Tensor::from_vec`] and the tensor covers
    /// it compactly from its first element; a copy ([`Tensor::to_vec`]) otherwise (storage
    /// allocated here starts at a 64-byte boundary inside its vector, so it is copied).
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>, TensorError> {
        if T::DTYPE != self.dtype() {
            return Err(TensorError::DTypeMismatch { operation: "into_vec", lhs: self.dtype(), rhs: T::DTYPE });
        }
        let covers_whole = |buffer: &CpuBuffer| {
            self.layout().is_compact_at_zero() && self.numel() * size_of::<T>() == buffer.len_bytes()
        };
        if !self.cpu_buffer().is_some_and(covers_whole) {
            return self.to_vec();
        }
        match self.into_unique_storage() {
            Ok((Storage::Cpu(buffer), meta)) => match buffer.into_vec::<T>() {
                Ok(vec) => Ok(vec),
                Err(buffer) => Tensor::from_storage(Storage::Cpu(buffer), meta.dtype, meta.layout)?.to_vec(),
            },
            Ok((storage, meta)) => Tensor::from_storage(storage, meta.dtype, meta.layout)?.to_vec(),
            Err(shared) => shared.to_vec(),
        }
    }

    /// The tensor's own elements in row-major order (a view reads only what it views; a device
    /// tensor is downloaded first), bit for bit. `T` must be the tensor's element type.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, TensorError> {
        if T::DTYPE != self.dtype() {
            return Err(TensorError::DTypeMismatch { operation: "to_vec", lhs: self.dtype(), rhs: T::DTYPE });
        }
        let host = self.to_cpu()?;
        let data = host.cpu_buffer().expect("to_cpu returns a CPU tensor").typed::<T>();
        Ok(host.layout().storage_indices().map(|i| data[i]).collect())
    }

    /// A compact CPU tensor from `f32` values in row-major order (rounded to `dtype`).
    pub fn from_f32(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Tensor, TensorError> {
        Tensor::from_values(dtype, shape, values.len(), values.iter().map(|&v| v as f64))
    }

    /// A compact CPU tensor from `f64` values in row-major order (rounded to `dtype`).
    pub fn from_f64(dtype: DType, shape: &[usize], values: &[f64]) -> Result<Tensor, TensorError> {
        Tensor::from_values(dtype, shape, values.len(), values.iter().copied())
    }

    fn from_values(
        dtype: DType,
        shape: &[usize],
        found: usize,
        values: impl Iterator<Item = f64>,
    ) -> Result<Tensor, TensorError> {
        let too_large = || TensorError::TooLarge { dtype, shape: shape.to_vec() };
        let expected = Layout::try_compact(shape).map_err(|_| too_large())?.numel();
        if expected != found {
            return Err(TensorError::DataLength { shape: shape.to_vec(), expected, found });
        }
        let mut tensor = Tensor::zeros(dtype, shape)?;
        let buffer = tensor.cpu_buffer_mut().ok().flatten().expect("fresh CPU storage is uniquely owned");
        with_element_type!(dtype, T => {
            for (slot, value) in buffer.typed_mut::<T>().iter_mut().zip(values) {
                *slot = <T as Element>::from_f64(value);
            }
        });
        Ok(tensor)
    }

    /// A CPU tensor with `meta`'s dtype and layout, filled with N(0, 1) values from a seeded
    /// generator (deterministic: equal seeds give equal bits); its storage is uniquely owned. An
    /// i64 tensor holds indices or positions instead: uniform in `0..8` (every cache or table a
    /// test indexes has at least 8 rows). Feature `testing`.
    #[cfg(feature = "testing")]
    pub fn randn(meta: &TensorMeta, seed: u64) -> Result<Tensor, TensorError> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let normal = rand_distr::StandardNormal;
        // The storage is allocated first (fallibly) and filled in place: no value list as large as
        // the tensor, and a tensor too large for memory is an error before any work.
        let mut whole = Tensor::zeros(meta.dtype, &[meta.layout.storage_end()])?;
        let buffer = whole.cpu_buffer_mut()?.expect("fresh CPU storage");
        if meta.dtype == DType::I64 {
            for slot in buffer.typed_mut::<i64>() {
                *slot = rng.random_range(0..8);
            }
        } else {
            with_element_type!(meta.dtype, T => {
                for slot in buffer.typed_mut::<T>() {
                    *slot = <T as Element>::from_f64(rng.sample::<f64, _>(normal));
                }
            });
        }
        let view = whole.as_strided(meta.layout.clone())?;
        drop(whole);
        Ok(view)
    }

    // --- metadata ---

    /// Dtype, device and layout.
    #[inline]
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }

    /// Device of the storage.
    pub fn device(&self) -> Device {
        self.meta.device
    }

    /// Shape, strides and offset.
    pub fn layout(&self) -> &Layout {
        &self.meta.layout
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.meta.layout.shape()
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[usize] {
        self.meta.layout.strides()
    }

    /// The storage offset, in elements.
    pub fn offset(&self) -> usize {
        self.meta.layout.offset()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.meta.layout.numel()
    }

    // --- storage ---

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage.storage
    }

    /// The identity of the storage.
    #[inline]
    pub fn storage_id(&self) -> StorageId {
        self.storage.id
    }

    /// Whether this handle is the only one referring to its storage, and the storage is writable
    /// (memory lent read-only by another library never is): what writing in place needs.
    #[inline]
    pub fn is_uniquely_owned(&self) -> bool {
        Arc::strong_count(&self.storage) == 1 && self.storage.storage.is_writable()
    }

    /// Number of handles (tensors and views) referring to the storage.
    pub fn storage_handles(&self) -> usize {
        Arc::strong_count(&self.storage)
    }

    /// The storage and metadata when this handle owns the storage alone (and may write it); the
    /// tensor back otherwise.
    pub fn into_unique_storage(self) -> Result<(Storage, TensorMeta), Tensor> {
        if !self.is_uniquely_owned() {
            return Err(self);
        }
        let Tensor { storage, meta } = self;
        match Arc::try_unwrap(storage) {
            Ok(shared) => Ok((shared.storage, meta)),
            Err(storage) => Err(Tensor { storage, meta }),
        }
    }

    /// Why this handle may not write its storage: read-only memory, or other handles.
    pub(crate) fn write_refusal(&self) -> TensorError {
        if self.storage.storage.is_writable() {
            TensorError::SharedStorage { meta: Box::new(self.meta.clone()), handles: self.storage_handles() }
        } else {
            TensorError::ReadOnlyStorage { meta: Box::new(self.meta.clone()) }
        }
    }

    /// The storage, mutably; fails unless uniquely owned and writable.
    pub fn storage_mut(&mut self) -> Result<&mut Storage, TensorError> {
        if !self.storage.storage.is_writable() {
            return Err(TensorError::ReadOnlyStorage { meta: Box::new(self.meta.clone()) });
        }
        let handles = Arc::strong_count(&self.storage);
        match Arc::get_mut(&mut self.storage) {
            Some(shared) => Ok(&mut shared.storage),
            None => Err(TensorError::SharedStorage { meta: Box::new(self.meta.clone()), handles }),
        }
    }

    /// The host buffer, when the tensor is on the CPU.
    pub fn cpu_buffer(&self) -> Option<&CpuBuffer> {
        match &self.storage.storage {
            Storage::Cpu(buffer) => Some(buffer),
            Storage::Device(_) => None,
        }
    }

    /// The host buffer mutably, when on the CPU and uniquely owned.
    pub fn cpu_buffer_mut(&mut self) -> Result<Option<&mut CpuBuffer>, TensorError> {
        match self.storage_mut()? {
            Storage::Cpu(buffer) => Ok(Some(buffer)),
            Storage::Device(_) => Ok(None),
        }
    }

    // --- views ---

    /// A view with another layout over the same storage.
    pub fn as_strided(&self, layout: Layout) -> Result<Tensor, TensorError> {
        let meta = TensorMeta { layout, ..self.meta.clone() };
        check_fits(&meta, self.storage.storage.len_bytes())?;
        Ok(Tensor { storage: Arc::clone(&self.storage), meta })
    }

    /// A view of `start..end` along `dim`.
    pub fn slice(&self, dim: usize, start: usize, end: usize) -> Result<Tensor, TensorError> {
        self.as_strided(self.meta.layout.slice(dim, start, end)?)
    }

    /// A view of `len` indices from `start` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor, TensorError> {
        self.as_strided(self.meta.layout.narrow(dim, start, len)?)
    }

    /// A view with two dimensions swapped.
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Tensor, TensorError> {
        self.as_strided(self.meta.layout.transpose(d0, d1)?)
    }

    /// A view with another shape; `NotViewable` when strides cannot express it (use `contiguous()`).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor, TensorError> {
        self.as_strided(self.meta.layout.reshape(shape)?)
    }

    // --- copies ---

    /// A copy in fresh storage: the source strides at offset 0 if the source is dense, else compact.
    pub fn deep_clone(&self) -> Result<Tensor, TensorError> {
        self.copy_into_layout(self.meta.layout.copy_layout())
    }

    /// A copy in fresh storage with exactly this tensor's layout (strides and offset), for callers
    /// whose other views must keep matching it.
    pub fn deep_clone_same_layout(&self) -> Result<Tensor, TensorError> {
        self.copy_into_layout(self.meta.layout.clone())
    }

    /// A compact copy in fresh storage.
    pub fn contiguous(&self) -> Result<Tensor, TensorError> {
        self.copy_into_layout(Layout::compact(self.shape()))
    }

    /// A copy in fresh storage (on this tensor's device) with `layout`, which must fit its shape.
    pub fn copy_into_layout(&self, layout: Layout) -> Result<Tensor, TensorError> {
        let size = self.dtype().size_in_bytes();
        let bytes = storage_bytes(&TensorMeta { layout: layout.clone(), ..self.meta.clone() })?;
        let storage = match &self.storage.storage {
            Storage::Cpu(src) => {
                // A compact copy writes every byte of its storage; another layout may leave gaps,
                // which read as zeros.
                let mut dst = if layout.offset() == 0 && layout.is_dense() {
                    CpuBuffer::for_overwrite(self.dtype(), bytes)?
                } else {
                    CpuBuffer::zeroed_for(self.dtype(), bytes)?
                };
                copy_elements(src.bytes(), self.layout(), dst.bytes_mut(), &layout, size);
                Storage::Cpu(dst)
            }
            Storage::Device(src) => {
                // As on the host: a compact copy writes every byte, another layout may leave gaps.
                let mut dst = if layout.offset() == 0 && layout.is_dense() {
                    src.allocate_for_overwrite(bytes)?
                } else {
                    src.allocate_like(bytes)?
                };
                src.copy_strided(&self.meta, dst.as_mut(), &layout)?;
                Storage::Device(dst)
            }
        };
        Tensor::from_storage(storage, self.dtype(), layout)
    }

    /// `self` and `other` joined along `dim` into a fresh compact tensor (every other dimension,
    /// the dtype and the device must agree); the elements are copied bit for bit, device tensors
    /// by their backend's strided copy.
    pub fn cat(&self, other: &Tensor, dim: usize) -> Result<Tensor, TensorError> {
        let meta = cat_meta(self.meta(), other.meta(), dim)?;
        let split = self.shape()[dim];
        let parts =
            [(self, meta.layout.slice(dim, 0, split)?), (other, meta.layout.slice(dim, split, meta.shape()[dim])?)];
        if let Storage::Device(first) = &self.storage.storage {
            // Each part copied into its slice of the result by the backend (on the device where it
            // has a strided copy).
            // The parts cover the compact result: every byte is written.
            let mut dst = first.allocate_for_overwrite(storage_bytes(&meta)?)?;
            for (src, layout) in &parts {
                let Storage::Device(from) = &src.storage.storage else { unreachable!("one device (cat_meta)") };
                from.copy_strided(src.meta(), dst.as_mut(), layout)?;
            }
            return Tensor::from_storage(Storage::Device(dst), meta.dtype, meta.layout);
        }
        let size = self.dtype().size_in_bytes();
        let mut dst = CpuBuffer::zeroed_for(self.dtype(), storage_bytes(&meta)?)?;
        for (src, layout) in parts {
            let Storage::Cpu(bytes) = &src.storage.storage else { unreachable!("both on the cpu (cat_meta)") };
            copy_elements(bytes.bytes(), src.layout(), dst.bytes_mut(), &layout, size);
        }
        Tensor::from_storage(Storage::Cpu(dst), meta.dtype, meta.layout)
    }

    /// Overwrites this tensor's elements (in its own layout) with `src`'s, converting the dtype.
    /// Tensors of one dtype are copied bit for bit (every i64, every NaN payload); on one device
    /// the backend copies or converts there where it can
    /// ([`DeviceBuffer::convert_strided`](crate::storage::DeviceBuffer::convert_strided)); other
    /// pairs convert through f64 on the host.
    ///
    /// Needs unique ownership of this tensor's storage and equal shapes.
    pub fn copy_from(&mut self, src: &Tensor) -> Result<(), TensorError> {
        if self.shape() != src.shape() {
            return Err(TensorError::ShapeMismatch {
                operation: "copy_",
                lhs: self.shape().to_vec(),
                rhs: src.shape().to_vec(),
            });
        }
        if self.dtype() == src.dtype()
            && let Storage::Cpu(from) = &src.storage.storage
        {
            let (size, layout) = (self.dtype().size_in_bytes(), self.meta.layout.clone());
            if let Storage::Cpu(to) = self.storage_mut()? {
                copy_elements(from.bytes(), src.layout(), to.bytes_mut(), &layout, size);
                return Ok(());
            }
        }
        if let Storage::Device(from) = &src.storage.storage
            && src.device() == self.device()
        {
            let dst_meta = self.meta.clone();
            let Storage::Device(to) = self.storage_mut()? else { unreachable!("on src's device") };
            if src.dtype() == dst_meta.dtype {
                from.copy_strided(src.meta(), to.as_mut(), &dst_meta.layout)?;
                return Ok(());
            }
            if from.convert_strided(src.meta(), to.as_mut(), &dst_meta, None)? {
                return Ok(());
            }
        }
        if !src.device().is_cpu() || !self.device().is_cpu() {
            let device = if src.device().is_cpu() { self.device() } else { src.device() };
            crate::storage::note_host_round_trip("copy_", device)?;
        }
        let values = src.to_f64_vec()?;
        let layout = self.meta.layout.clone();
        let dtype = self.dtype();
        match self.storage_mut()? {
            Storage::Cpu(buffer) => write_values(buffer, dtype, &layout, &values),
            Storage::Device(buffer) => {
                let mut host = CpuBuffer::zeroed(buffer.len_bytes())?;
                buffer.download(host.bytes_mut())?;
                write_values(&mut host, dtype, &layout, &values);
                buffer.upload(host.bytes())?;
            }
        }
        Ok(())
    }

    // --- values and devices ---

    /// The elements in logical (row-major) order, widened to `f64`.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>, TensorError> {
        let host = self.to_cpu()?;
        let buffer = host.cpu_buffer().expect("to_cpu returns a CPU tensor");
        Ok(with_element_type!(self.dtype(), T => {
            let data = buffer.typed::<T>();
            host.layout().storage_indices().map(|i| data[i].to_f64()).collect()
        }))
    }

    /// The same tensor on the host (a handle copy when already there; same layout otherwise).
    pub fn to_cpu(&self) -> Result<Tensor, TensorError> {
        match &self.storage.storage {
            Storage::Cpu(_) => Ok(self.clone()),
            Storage::Device(buffer) => {
                let mut host = CpuBuffer::zeroed_for(self.dtype(), buffer.len_bytes())?;
                buffer.download(host.bytes_mut())?;
                Tensor::from_storage(Storage::Cpu(host), self.dtype(), self.meta.layout.clone())
            }
        }
    }

    /// A copy on the allocator's device, with the layout a copy gets.
    pub fn to_device(&self, allocator: &dyn DeviceAllocator) -> Result<Tensor, TensorError> {
        let host = self.to_cpu()?.deep_clone()?;
        let buffer = host.cpu_buffer().expect("deep_clone of a CPU tensor is on the CPU");
        let mut device_buffer = allocator.allocate(buffer.len_bytes())?;
        device_buffer.upload(buffer.bytes())?;
        Tensor::from_storage(Storage::Device(device_buffer), self.dtype(), host.meta.layout.clone())
    }

    /// Moves a host tensor onto the device of `like` (identity when `like` is on the CPU).
    pub fn to_device_of(&self, like: &Tensor) -> Result<Tensor, TensorError> {
        match &like.storage.storage {
            Storage::Cpu(_) => self.to_cpu(),
            Storage::Device(like_buffer) => {
                let host = self.to_cpu()?.deep_clone()?;
                let buffer = host.cpu_buffer().expect("deep_clone of a CPU tensor is on the CPU");
                let mut device_buffer = like_buffer.allocate_for_overwrite(buffer.len_bytes())?;
                device_buffer.upload(buffer.bytes())?;
                Tensor::from_storage(Storage::Device(device_buffer), self.dtype(), host.meta.layout.clone())
            }
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({}, storage #{})", self.meta, self.storage_id().0)
    }
}

impl DType {
    /// A reader of this dtype's elements in host bytes: `read(bytes, index)` is element `index`
    /// (counted in elements, unaligned allowed), widened to `f64`. Reference ops read mixed dtypes
    /// through it without a generic parameter per dtype.
    pub fn element_reader(self) -> fn(&[u8], usize) -> f64 {
        fn read<T: Element>(bytes: &[u8], index: usize) -> f64 {
            let size = size_of::<T>();
            bytemuck::pod_read_unaligned::<T>(&bytes[index * size..(index + 1) * size]).to_f64()
        }
        with_element_type!(self, T => read::<T>)
    }

    /// A writer of this dtype's elements in host bytes: `write(bytes, index, value)` rounds `value`
    /// to this dtype and stores it as element `index`.
    pub fn element_writer(self) -> fn(&mut [u8], usize, f64) {
        fn write<T: Element>(bytes: &mut [u8], index: usize, value: f64) {
            let size = size_of::<T>();
            let value = <T as Element>::from_f64(value);
            bytes[index * size..(index + 1) * size].copy_from_slice(bytemuck::bytes_of(&value));
        }
        with_element_type!(self, T => write::<T>)
    }
}

/// The bytes `meta` reaches, or `TooLarge` past `isize::MAX`.
fn storage_bytes(meta: &TensorMeta) -> Result<usize, TensorError> {
    meta.storage_bytes().ok_or_else(|| TensorError::TooLarge { dtype: meta.dtype, shape: meta.shape().to_vec() })
}

fn check_fits(meta: &TensorMeta, available: usize) -> Result<(), TensorError> {
    let needed = storage_bytes(meta)?;
    if needed <= available {
        return Ok(());
    }
    Err(TensorError::OutOfBounds { meta: Box::new(meta.clone()), needed, available })
}

/// Copies elements of `size` bytes from `src` (in `src_layout`) to `dst` (in `dst_layout`), logical order.
/// The compact result of joining `a` and `b` along `dim`, or why they cannot be joined.
pub(crate) fn cat_meta(a: &TensorMeta, b: &TensorMeta, dim: usize) -> Result<TensorMeta, TensorError> {
    let (lhs, rhs) = (a.shape().to_vec(), b.shape().to_vec());
    let joinable = dim < lhs.len()
        && lhs.len() == rhs.len()
        && lhs.iter().zip(&rhs).enumerate().all(|(d, (x, y))| d == dim || x == y);
    if !joinable {
        return Err(TensorError::ShapeMismatch { operation: "cat", lhs, rhs });
    }
    if a.dtype != b.dtype {
        return Err(TensorError::DTypeMismatch { operation: "cat", lhs: a.dtype, rhs: b.dtype });
    }
    if a.device != b.device {
        return Err(TensorError::DeviceMismatch { operation: "cat", lhs: a.device, rhs: b.device });
    }
    let mut shape = lhs.clone();
    shape[dim] = lhs[dim].checked_add(rhs[dim]).ok_or(TensorError::ShapeMismatch { operation: "cat", lhs, rhs })?;
    Ok(TensorMeta { device: a.device, ..TensorMeta::compact(a.dtype, &shape) })
}

fn copy_elements(src: &[u8], src_layout: &Layout, dst: &mut [u8], dst_layout: &Layout, size: usize) {
    let n = src_layout.numel();
    if n == 0 {
        return;
    }
    let same_dense_order = src_layout.is_dense() && src_layout.strides() == dst_layout.strides();
    if same_dense_order {
        // Dense layouts with equal strides occupy `n` consecutive slots from their offsets.
        let from = src_layout.offset() * size;
        let to = dst_layout.offset() * size;
        dst[to..to + n * size].copy_from_slice(&src[from..from + n * size]);
        return;
    }
    let plan = CopyPlan::new(src_layout, dst_layout);
    match (plan.run, size) {
        // Runs of one element (a transposed view): fixed-size moves, not a `memcpy` call each.
        (1, 2) => plan.for_each_run(|from, to| dst[to * 2..to * 2 + 2].copy_from_slice(&src[from * 2..from * 2 + 2])),
        (1, 4) => plan.for_each_run(|from, to| dst[to * 4..to * 4 + 4].copy_from_slice(&src[from * 4..from * 4 + 4])),
        (1, 8) => plan.for_each_run(|from, to| dst[to * 8..to * 8 + 8].copy_from_slice(&src[from * 8..from * 8 + 8])),
        (run, _) => {
            let bytes = run * size;
            plan.for_each_run(|from, to| {
                dst[to * size..to * size + bytes].copy_from_slice(&src[from * size..from * size + bytes]);
            });
        }
    }
}

/// A strided copy as runs of elements consecutive in both layouts: the innermost dimensions whose
/// elements are adjacent in both (a row of a column slice, say) form one run, copied by one
/// `memcpy`-class move; the outer dimensions are walked with running offsets.
struct CopyPlan {
    /// Elements per run.
    run: usize,
    /// The outer dimensions' sizes and strides (source, destination), innermost last.
    outer: Vec<(usize, usize, usize)>,
    offsets: (usize, usize),
}

impl CopyPlan {
    fn new(src: &Layout, dst: &Layout) -> CopyPlan {
        let (shape, src_strides, dst_strides) = (src.shape(), src.strides(), dst.strides());
        let mut run = 1;
        let mut inner = shape.len();
        // Dimensions of size one never move; the rest join the run while both layouts keep it
        // consecutive.
        while inner > 0 {
            let dim = inner - 1;
            if shape[dim] != 1 && (src_strides[dim] != run || dst_strides[dim] != run) {
                break;
            }
            run *= shape[dim];
            inner -= 1;
        }
        let outer = (0..inner)
            .filter(|&dim| shape[dim] != 1)
            .map(|dim| (shape[dim], src_strides[dim], dst_strides[dim]))
            .collect();
        CopyPlan { run, outer, offsets: (src.offset(), dst.offset()) }
    }

    /// Calls `copy(source, destination)` with the first element index of every run, in row-major
    /// order.
    #[inline]
    fn for_each_run(&self, mut copy: impl FnMut(usize, usize)) {
        let Some(&(inner_len, inner_src, inner_dst)) = self.outer.last() else {
            copy(self.offsets.0, self.offsets.1);
            return;
        };
        let rest = &self.outer[..self.outer.len() - 1];
        let mut index = vec![0usize; rest.len()];
        let (mut from, mut to) = self.offsets;
        loop {
            // The innermost outer dimension, as a tight loop.
            let (mut a, mut b) = (from, to);
            for _ in 0..inner_len {
                copy(a, b);
                a += inner_src;
                b += inner_dst;
            }
            // Odometer over the remaining dimensions.
            let mut dim = rest.len();
            loop {
                if dim == 0 {
                    return;
                }
                dim -= 1;
                let (len, src_stride, dst_stride) = rest[dim];
                index[dim] += 1;
                from += src_stride;
                to += dst_stride;
                if index[dim] < len {
                    break;
                }
                from -= src_stride * len;
                to -= dst_stride * len;
                index[dim] = 0;
            }
        }
    }
}

fn write_values(buffer: &mut CpuBuffer, dtype: DType, layout: &Layout, values: &[f64]) {
    with_element_type!(dtype, T => {
        let data = buffer.typed_mut::<T>();
        for (index, &value) in layout.storage_indices().zip(values) {
            data[index] = <T as Element>::from_f64(value);
        }
    });
}

// The element types must stay plain old data for the casts above.
const _: () = {
    const fn assert_pod<T: bytemuck::Pod>() {}
    assert_pod::<f16>();
    assert_pod::<bf16>();
};

#[cfg(test)]
mod tests {
    /// Copies of views run as runs of consecutive elements (a column slice's rows, a transposed
    /// view's single elements, size-one dimensions anywhere): every element lands where the view
    /// reads it, for each element size, into a compact layout and into the view's own layout.
    #[test]
    fn strided_copies_keep_every_element() {
        for dtype in [DType::I8, DType::BF16, DType::F32, DType::F64] {
            let values: Vec<f64> = (0..2 * 3 * 20).map(f64::from).collect();
            let base = Tensor::from_f64(dtype, &[2, 3, 1, 20], &values).unwrap();
            let views = [
                base.narrow(3, 4, 9).unwrap(),
                base.narrow(3, 4, 9).unwrap().narrow(1, 1, 2).unwrap(),
                base.transpose(1, 3).unwrap(),
                base.transpose(0, 2).unwrap().narrow(3, 0, 1).unwrap(),
                base.reshape(&[6, 20]).unwrap().narrow(1, 16, 4).unwrap().transpose(0, 1).unwrap(),
                base.narrow(0, 1, 1).unwrap().narrow(3, 19, 1).unwrap(),
                base.narrow(3, 0, 0).unwrap(),
            ];
            for view in views {
                let expected = view.to_f64_vec().unwrap();
                let label = format!("{dtype} {:?} {:?}+{}", view.shape(), view.layout().strides(), view.offset());
                let compact = view.contiguous().unwrap();
                assert!(compact.layout().is_compact(), "{label}");
                assert_eq!(compact.to_f64_vec().unwrap(), expected, "{label}: compact");
                assert_eq!(view.deep_clone_same_layout().unwrap().to_f64_vec().unwrap(), expected, "{label}: same");
            }
        }
    }

    #[test]
    fn cat_joins_along_a_dimension_bit_for_bit() {
        let a = Tensor::from_f64(DType::BF16, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let b = Tensor::from_f64(DType::BF16, &[2, 1], &[-1.0, f64::NAN]).unwrap();
        let joined = a.cat(&b, 1).unwrap();
        assert_eq!(joined.shape(), &[2, 4]);
        assert!(joined.layout().is_compact_at_zero());
        let values = joined.to_f64_vec().unwrap();
        assert_eq!(values[..7], [1.0, 2.0, 3.0, -1.0, 4.0, 5.0, 6.0]);
        assert!(values[7].is_nan());
        // A strided view joins by its logical elements.
        let rows = a.transpose(0, 1).unwrap().cat(&Tensor::zeros(DType::BF16, &[1, 2]).unwrap(), 0).unwrap();
        assert_eq!(rows.to_f64_vec().unwrap(), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0, 0.0, 0.0]);
        let err = a.cat(&b, 0).unwrap_err();
        assert_eq!(err.to_string(), "cat: shapes [2, 3] and [2, 1] differ");
        assert!(a.cat(&b, 2).is_err(), "no dimension 2");
        let err = a.cat(&Tensor::zeros(DType::F32, &[2, 1]).unwrap(), 1).unwrap_err();
        assert_eq!(err.to_string(), "cat: dtypes bf16 and f32 differ");
    }

    use super::*;

    fn round_trip<T: Element + PartialEq>(values: Vec<T>) {
        let t = Tensor::from_vec(&[2, 3], values.clone()).unwrap();
        assert_eq!((t.dtype(), t.shape()), (T::DTYPE, &[2, 3][..]));
        assert_eq!(t.to_vec::<T>().unwrap(), values, "bit for bit");
        // The transposed view reads its own elements, in its own row-major order.
        let transposed = t.transpose(0, 1).unwrap().to_vec::<T>().unwrap();
        assert_eq!(transposed, [0, 3, 1, 4, 2, 5].map(|i| values[i]));
        let row = t.slice(0, 1, 2).unwrap().to_vec::<T>().unwrap();
        assert_eq!(row, values[3..]);
    }

    #[test]
    fn vectors_of_every_element_type_round_trip_and_views_read_their_own_elements() {
        round_trip((0..6).map(|i| i as f32 * 0.5).collect());
        round_trip((0..6).map(|i| i as f64 * -1.25).collect());
        round_trip((0..6).map(|i| half::f16::from_f32(i as f32 + 0.125)).collect());
        round_trip((0..6).map(|i| half::bf16::from_f32(i as f32 - 3.0)).collect());
        let t = Tensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap();
        let err = t.to_vec::<f64>().unwrap_err();
        assert_eq!(err.to_string(), "to_vec: dtypes f32 and f64 differ");
        let err = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0]).unwrap_err();
        assert!(matches!(err, TensorError::DataLength { expected: 4, found: 3, .. }), "{err}");
    }

    fn iota(dtype: DType, shape: &[usize]) -> Tensor {
        let n = crate::layout::numel(shape);
        let values: Vec<f64> = (0..n).map(|i| i as f64).collect();
        Tensor::from_f64(dtype, shape, &values).unwrap()
    }

    #[test]
    fn views_share_storage_and_copies_do_not() {
        let base = iota(DType::F32, &[4, 5]);
        let columns = base.slice(1, 0, 3).unwrap();
        assert!(shares_storage(&base, &columns));
        assert_eq!(columns.to_f64_vec().unwrap(), vec![0., 1., 2., 5., 6., 7., 10., 11., 12., 15., 16., 17.]);
        let copy = columns.contiguous().unwrap();
        assert!(!shares_storage(&copy, &columns));
        assert_eq!(copy.strides(), &[3, 1]);
        assert_eq!(copy.to_f64_vec().unwrap(), columns.to_f64_vec().unwrap());
        let clone = columns.deep_clone().unwrap();
        assert_eq!(clone.strides(), &[3, 1], "a non-dense source gives a compact copy");
        let transposed = base.transpose(0, 1).unwrap();
        let transposed_clone = transposed.deep_clone().unwrap();
        assert_eq!(transposed_clone.strides(), &[1, 5], "a dense source keeps its strides");
        assert!(bit_eq(&transposed_clone, &transposed));
        assert_eq!(transposed.contiguous().unwrap().strides(), &[4, 1]);
        let rows = base.slice(0, 1, 4).unwrap();
        assert_eq!(rows.offset(), 5);
        assert_eq!(rows.deep_clone().unwrap().offset(), 0);
    }

    #[test]
    fn vectors_move_in_and_out_without_a_copy() {
        let values: Vec<half::bf16> = (0..6).map(|i| half::bf16::from_f32(i as f32)).collect();
        let start = values.as_ptr();
        let t = Tensor::from_vec(&[2, 3], values).unwrap();
        assert_eq!(t.cpu_buffer().unwrap().as_ptr(), start.cast());
        assert!(t.is_uniquely_owned());
        // A view shares the vector; while it lives, into_vec copies.
        let view = t.slice(1, 1, 3).unwrap();
        let copied = t.clone().into_vec::<half::bf16>().unwrap();
        assert_ne!(copied.as_ptr(), start);
        assert_eq!(view.to_vec::<half::bf16>().unwrap().len(), 4);
        drop(view);
        let back = t.into_vec::<half::bf16>().unwrap();
        assert_eq!(back.as_ptr(), start);
        assert_eq!(back, copied);
        // Wrong length, wrong type.
        assert!(matches!(Tensor::from_vec(&[2, 2], vec![0f32; 3]), Err(TensorError::DataLength { .. })));
        let t = Tensor::from_vec(&[1], vec![1f32]).unwrap();
        assert!(matches!(t.into_vec::<f64>(), Err(TensorError::DTypeMismatch { .. })));
        // Storage allocated here is 64-byte aligned, and into_vec copies it out.
        let t = Tensor::zeros(DType::F16, &[3, 5]).unwrap();
        assert_eq!(t.cpu_buffer().unwrap().as_ptr() as usize % 64, 0);
        assert_eq!(t.into_vec::<half::f16>().unwrap(), vec![half::f16::ZERO; 15]);
    }

    #[test]
    fn read_only_host_memory_is_read_never_written() {
        use crate::storage::HostAccess;
        use std::sync::atomic::{AtomicBool, Ordering};
        static DROPPED: AtomicBool = AtomicBool::new(false);
        struct Owner(Vec<f32>);
        impl Drop for Owner {
            fn drop(&mut self) {
                DROPPED.store(true, Ordering::SeqCst);
            }
        }
        let owner = Owner(vec![1.0, 2.0, 3.0, 4.0]);
        let ptr = std::ptr::NonNull::new(owner.0.as_ptr() as *mut u8).unwrap();
        // SAFETY: the vector lives in `owner`, which the buffer keeps; nothing else writes it.
        let buffer = unsafe { CpuBuffer::from_external(ptr, 16, HostAccess::ReadOnly, owner) };
        let mut t = Tensor::from_storage(Storage::Cpu(buffer), DType::F32, Layout::compact(&[2, 2])).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        assert!(!t.is_uniquely_owned(), "read-only memory is never written in place");
        assert!(matches!(t.storage_mut(), Err(TensorError::ReadOnlyStorage { .. })));
        let src = Tensor::zeros(DType::F32, &[2, 2]).unwrap();
        let refused = t.copy_from(&src).unwrap_err();
        assert!(refused.to_string().contains("read-only"), "{refused}");
        assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        // A copy is ordinary writable memory.
        assert!(t.deep_clone().unwrap().is_uniquely_owned());
        let view = t.transpose(0, 1).unwrap();
        drop(t);
        assert!(!DROPPED.load(Ordering::SeqCst), "a view keeps the owner alive");
        assert_eq!(view.to_vec::<f32>().unwrap(), [1.0, 3.0, 2.0, 4.0]);
        drop(view);
        assert!(DROPPED.load(Ordering::SeqCst), "the owner is dropped with the last tensor");
    }

    #[test]
    fn misaligned_host_memory_is_refused() {
        use crate::storage::HostAccess;
        // A vector of u32 is 4-byte aligned, so one byte in is not (a byte vector's allocation may
        // have any alignment: Miri places them anywhere).
        let words = vec![0u32; 5];
        let ptr = std::ptr::NonNull::new(words.as_ptr().cast::<u8>().wrapping_add(1).cast_mut()).unwrap();
        assert!(!(ptr.as_ptr() as usize).is_multiple_of(4));
        let bytes = words;
        // SAFETY: 16 bytes from byte 1 lie inside the 20 bytes of `bytes`, which the buffer owns;
        // read-only.
        let buffer = unsafe { CpuBuffer::from_external(ptr, 16, HostAccess::ReadOnly, bytes) };
        let made = Tensor::from_storage(Storage::Cpu(buffer), DType::F32, Layout::compact(&[4]));
        assert!(matches!(made, Err(TensorError::Misaligned { alignment: 4, .. })), "{made:?}");
    }

    #[test]
    fn unique_ownership_guards_writes() {
        let mut a = iota(DType::BF16, &[2, 3]);
        assert!(a.is_uniquely_owned());
        let view = a.slice(0, 0, 1).unwrap();
        assert!(!a.is_uniquely_owned());
        let err = a.copy_from(&Tensor::zeros(DType::F32, &[2, 3]).unwrap()).unwrap_err();
        assert!(matches!(err, TensorError::SharedStorage { handles: 2, .. }), "{err}");
        assert_eq!(view.to_f64_vec().unwrap(), vec![0., 1., 2.]);
        drop(view);
        a.copy_from(&Tensor::full(DType::F32, &[2, 3], 2.5).unwrap()).unwrap();
        assert_eq!(a.to_f64_vec().unwrap(), vec![2.5; 6]);
    }

    #[test]
    fn copy_from_writes_in_the_destination_layout() {
        let storage = Tensor::zeros(DType::F32, &[2, 5]).unwrap();
        let mut padded = storage.as_strided(Layout::new(&[2, 3], &[5, 1], 1).unwrap()).unwrap();
        drop(storage);
        padded.copy_from(&iota(DType::F16, &[2, 3])).unwrap();
        assert_eq!(padded.to_f64_vec().unwrap(), vec![0., 1., 2., 3., 4., 5.]);
        let whole = padded.as_strided(Layout::compact(&[10])).unwrap();
        assert_eq!(whole.to_f64_vec().unwrap(), vec![0., 0., 1., 2., 0., 0., 3., 4., 5., 0.]);
        let err = padded.copy_from(&iota(DType::F32, &[3, 2])).unwrap_err();
        assert!(matches!(err, TensorError::ShapeMismatch { .. }));
    }

    #[test]
    fn f64_values_round_once_into_f16_and_bf16() {
        // Ties of f16 and bf16 broken by a bit f32 cannot hold: rounding through nearest-even f32
        // (what `half`'s own `from_f64` does) lands on the tie and rounds it to even, the wrong way.
        let f16_case = -(1.0 + 2f64.powi(-11) + 2f64.powi(-40));
        let bf16_case = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
        let built = Tensor::from_f64(DType::F16, &[1], &[f16_case]).unwrap();
        assert_eq!(built.to_vec::<f16>().unwrap(), [f16::from_f32(-(1.0 + 2f32.powi(-10)))]);
        let src = Tensor::from_slice(&[2], &[f16_case, bf16_case]).unwrap();
        let mut dst = Tensor::zeros(DType::BF16, &[2]).unwrap();
        dst.copy_from(&src).unwrap();
        assert_eq!(dst.to_vec::<bf16>().unwrap(), [bf16::from_f32(-1.0), bf16::from_f32(1.0 + 2f32.powi(-7))]);
        let filled = Tensor::full(DType::BF16, &[1], bf16_case).unwrap();
        assert_eq!(filled.to_vec::<bf16>().unwrap(), [bf16::from_f32(1.0 + 2f32.powi(-7))]);
    }

    #[test]
    fn copy_from_of_one_dtype_is_bit_exact_in_any_layout() {
        // i64 beyond f64's 53-bit mantissa, and a NaN with a payload, survive the copy.
        let big = [i64::MAX, i64::MIN, (1 << 53) + 1, -3, 0, 7];
        let src = Tensor::from_slice(&[2, 3], &big).unwrap();
        let mut dst = Tensor::zeros(DType::I64, &[3, 2]).unwrap().transpose(0, 1).unwrap();
        dst.copy_from(&src).unwrap();
        assert_eq!(dst.contiguous().unwrap().to_vec::<i64>().unwrap(), big);
        let payload = f32::from_bits(0x7fc0_1234);
        let src = Tensor::from_slice(&[3], &[payload, -0.0, 1.5]).unwrap();
        let mut dst = Tensor::zeros(DType::F32, &[3]).unwrap();
        dst.copy_from(&src.as_strided(Layout::new(&[3], &[1], 0).unwrap()).unwrap()).unwrap();
        let bits: Vec<u32> = dst.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect();
        assert_eq!(bits, [0x7fc0_1234, (-0.0f32).to_bits(), 1.5f32.to_bits()]);
    }

    #[test]
    fn construction_errors() {
        let err = Tensor::from_f32(DType::F32, &[2, 2], &[1.0, 2.0]).unwrap_err();
        assert_eq!(err.to_string(), "shape [2, 2] needs 4 values but 2 were given");
        let base = Tensor::zeros(DType::F32, &[4]).unwrap();
        let err = base.as_strided(Layout::compact(&[5])).unwrap_err();
        assert_eq!(err.to_string(), "layout f32[5] needs 20 bytes but its storage has 16");
        assert!(matches!(base.reshape(&[3]), Err(TensorError::Layout(LayoutError::NumelMismatch { .. }))));
    }

    #[test]
    fn sizes_never_wrap_and_allocations_never_abort() {
        // 2^62 f32 elements are 2^64 bytes: the byte count wraps to 0 in 64 bits.
        let err = Tensor::zeros(DType::F32, &[1 << 62]).unwrap_err();
        assert!(matches!(err, TensorError::TooLarge { dtype: DType::F32, .. }), "{err}");
        assert!(matches!(Tensor::zeros(DType::F32, &[1 << 40, 1 << 40]), Err(TensorError::TooLarge { .. })));
        assert!(matches!(Tensor::from_f64(DType::F32, &[1 << 32, 1 << 32], &[]), Err(TensorError::TooLarge { .. })));
        // 2^60 bytes fit isize but no machine's address space: a typed error, not an abort.
        let err = Tensor::zeros(DType::F32, &[1 << 58]).unwrap_err();
        assert_eq!(err, TensorError::OutOfMemory { bytes: 1 << 60 });
        assert_eq!(err.to_string(), "out of memory: cannot allocate 1152921504606846976 bytes");
        let meta = TensorMeta::compact(DType::BF16, &[1 << 62]);
        assert!(matches!(Tensor::randn(&meta, 0), Err(TensorError::TooLarge { .. })));

        let base = Tensor::zeros(DType::F32, &[2]).unwrap();
        let far = Layout::new(&[1], &[1], 1 << 62).unwrap();
        assert!(matches!(base.as_strided(far), Err(TensorError::TooLarge { .. })), "a view 2^62 elements past 8 bytes");
        let past = Layout::new(&[1], &[1], 1 << 40).unwrap();
        assert!(matches!(base.as_strided(past), Err(TensorError::OutOfBounds { .. })));
        let storage = Storage::Cpu(CpuBuffer::zeroed(8).unwrap());
        let wide = Layout::new(&[2, 2], &[1 << 61, 1], 0).unwrap();
        assert!(matches!(Tensor::from_storage(storage, DType::F32, wide), Err(TensorError::TooLarge { .. })));
    }

    #[test]
    fn rank_zero_and_empty() {
        let scalar = Tensor::full(DType::F64, &[], 3.0).unwrap();
        assert_eq!(scalar.to_f64_vec().unwrap(), vec![3.0]);
        let empty = Tensor::zeros(DType::BF16, &[0, 8]).unwrap();
        assert_eq!(empty.to_f64_vec().unwrap(), Vec::<f64>::new());
        assert_eq!(empty.deep_clone().unwrap().numel(), 0);
    }
}
