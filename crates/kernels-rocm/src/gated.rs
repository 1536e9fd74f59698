//! The gated activations (`silu_and_mul`, `gelu_and_mul`, …) on `rocm:0`.
//!
//! Each op is one kernel source `kernels/<op>.hip` (compiled into the code object with every other
//! source by `build.rs`) and one line of [`GATED_OPS`]. The op's scalar parameters reach the kernel
//! through [`GatedScalars`](kernel_support::GatedScalars).

use ir_core::op::Value;
use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use ir_ops::gelu_and_mul::GELU_AND_MUL;
use ir_ops::silu_and_mul::SILU_AND_MUL;
use kernel_support::{GatedKernel, gated_support_with};

/// The shared row kernel of the gated ops.
pub const GATED: &str = include_str!("../kernels/gated.hip.h");

/// Threads per block of the gated kernels (`GATED_BLOCK` in `gated.hip.h`): one block per row.
pub const GATED_BLOCK: u32 = 256;

/// Every gated op this provider implements: adding one is a kernel source and a line here.
pub const GATED_OPS: &[GatedKernel] = &[
    GatedKernel { def: &SILU_AND_MUL, source: include_str!("../kernels/silu_and_mul.hip") },
    GatedKernel { def: &GELU_AND_MUL, source: include_str!("../kernels/gelu_and_mul.hip") },
    GatedKernel {
        def: &ir_ops::gelu_and_mul_sparse::GELU_AND_MUL_SPARSE,
        source: include_str!("../kernels/gelu_and_mul_sparse.hip"),
    },
];

/// Registers every op of [`GATED_OPS`].
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = || {
        ImplSpec::new(crate::PROVIDER)
            .with_probe(crate::availability)
            .with_supports(|args| gated_support_with(args, DeviceKind::Rocm, crate::KERNEL_DTYPES))
    };
    GatedKernel::register_all(GATED_OPS, registry, spec, run)
}

/// Runs `op` on the bound `args` (x first): a fresh compact `[..., d]` output.
pub fn run(op: &GatedKernel, args: &[Value]) -> Result<Tensor, KernelError> {
    #[cfg(feature = "rocm")]
    return launch::run(op, args);
    #[cfg(not(feature = "rocm"))]
    {
        let _ = (op, args);
        Err(KernelError::Driver { backend: "rocm", message: "built without feature `rocm`".to_owned() })
    }
}

#[cfg(feature = "rocm")]
mod launch {
    use std::ffi::c_void;

    use ir_core::op::Value;
    use ir_core::storage::{DeviceAllocator, Storage};
    use ir_core::{KernelError, Tensor, TensorError};
    use kernel_support::{ComputeScalar, GatedCall, GatedGeometry, device_buffer, kernel_int};

    use kernel_support::GatedKernel;

    use super::GATED_BLOCK;
    use crate::device::{HipBuffer, allocator, device};
    use crate::launch::{compute_param, element_ptr};

    pub(super) fn run(op: &GatedKernel, args: &[Value]) -> Result<Tensor, KernelError> {
        let GatedCall { x, scalars, geometry } = GatedCall::new(op.def, args)?;
        let empty = geometry.is_empty();
        let GatedGeometry { rows, d, out_layout } = geometry;
        let dtype = x.dtype();
        let allocator = allocator().map_err(|message| KernelError::Driver { backend: "rocm", message })?;
        let mut out =
            allocator.allocate(out_layout.storage_end() * dtype.size_in_bytes()).map_err(TensorError::from)?;
        if !empty {
            let device = device().map_err(|message| KernelError::Driver { backend: "rocm", message })?;
            let mut x_ptr = element_ptr(device_buffer::<HipBuffer>(x, "x", "HIP")?.pointer, rows.offset, dtype);
            let mut out_ptr = out.as_any_mut().downcast_mut::<HipBuffer>().expect("allocated by this crate").pointer;
            let blocks =
                u32::try_from(rows.n_rows).map_err(|_| KernelError::GridLimit { what: "rows", count: rows.n_rows })?;
            let mut n_rows: i64 = kernel_int(rows.n_rows, "rows")?;
            let mut d: i32 = kernel_int(d, "output width")?;
            let mut x_stride: i64 = kernel_int(rows.row_stride, "x row stride")?;
            let mut out_stride = i64::from(d);
            let [mut f0, mut f1] = scalars.floats.map(|v| ComputeScalar::new(dtype, v));
            let [mut i0, mut i1] = scalars.ints;
            // <op>_<dtype>(out, x, long long n_rows, int d, long long x_row_stride, long long out_row_stride,
            //              Compute<DTYPE> f0, Compute<DTYPE> f1, int i0, int i1)
            let mut params: [*mut c_void; 10] = [
                &mut out_ptr as *mut _ as *mut c_void,
                &mut x_ptr as *mut _ as *mut c_void,
                &mut n_rows as *mut _ as *mut c_void,
                &mut d as *mut _ as *mut c_void,
                &mut x_stride as *mut _ as *mut c_void,
                &mut out_stride as *mut _ as *mut c_void,
                compute_param(&mut f0),
                compute_param(&mut f1),
                &mut i0 as *mut _ as *mut c_void,
                &mut i1 as *mut _ as *mut c_void,
            ];
            // SAFETY: the parameters point to locals of the kernel's declared types in prototype
            // order, each integer converted without loss by `kernel_int`. x's rows lie inside its
            // buffer (its layout was checked against its storage by `check_fits`, and the rows come
            // from that layout); `out` holds n_rows · d elements, written densely.
            unsafe { device.launch(&op.kernel_name(dtype), blocks, GATED_BLOCK, &mut params) }?;
        }
        Ok(Tensor::from_storage(Storage::Device(out), dtype, out_layout)?)
    }
}
