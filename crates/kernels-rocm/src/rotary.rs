//! `rotary_embedding` on `rocm:0`, in place on query and key: `kernels/rotary.hip` (compiled into
//! the code object with every other source by `build.rs`), `rotary_embedding_<dtype>`, one block per
//! token. The positions stay on the device; a token whose position lies outside the cache is left
//! unrotated (the kernel cannot report it).

use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor};
use kernel_support::{RotaryCall, register_rotary_with};

/// The kernel of this module (`rotary_embedding_<dtype>`).
pub const KERNEL: &str = "rotary_embedding";

/// Registers `rotary_embedding` (in place).
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = ImplSpec::new(crate::PROVIDER).with_probe(crate::availability);
    register_rotary_with(registry, DeviceKind::Rocm, || crate::KERNEL_DTYPES, spec, rotary_embedding_rocm)
}

/// `rotary_embedding` on `rocm:0`: rotates query and key (when given) in their storage.
pub fn rotary_embedding_rocm(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    #[cfg(feature = "rocm")]
    return launch::rotary(call);
    #[cfg(not(feature = "rocm"))]
    {
        let _ = call;
        Err(crate::not_built())
    }
}

#[cfg(feature = "rocm")]
mod launch {
    use std::ffi::c_void;

    use ir_core::{DType, KernelError, Tensor, UniqueTensor};
    use kernel_support::{RotaryCall, device_buffer, device_buffer_mut};

    use super::KERNEL;
    use crate::device::{HipBuffer, device};
    use crate::launch::element_ptr;

    pub(super) fn rotary(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
        let RotaryCall { positions, mut query, mut key, cos_sin_cache, launch, round_products } = call;
        let is_neox_style = launch.geometry.is_neox_style;
        let dtype = query.tensor().dtype();
        let tokens = launch.geometry.tokens;
        if tokens > 0 {
            let device = device().map_err(|message| KernelError::Driver { backend: "rocm", message })?;
            let blocks = u32::try_from(tokens).map_err(|_| KernelError::GridLimit { what: "tokens", count: tokens })?;
            let [mut heads, mut kv_heads, mut head_size, mut rotary_dim, mut max_position] = launch.dims()?;
            let (q, c) = (launch.query, launch.cache);
            let mut q_ptr = element_ptr(
                device_buffer_mut::<HipBuffer>(&mut query, "query", "HIP")?.pointer,
                q.offset as usize,
                dtype,
            );
            // Without a key the kernel never touches `k`: null.
            let (mut k_ptr, mut k_stride) = match (key.as_mut(), launch.key) {
                (Some(key), Some(k)) => (
                    element_ptr(device_buffer_mut::<HipBuffer>(key, "key", "HIP")?.pointer, k.offset as usize, dtype),
                    k.row_stride,
                ),
                _ => (std::ptr::null_mut(), 0),
            };
            let mut p_ptr = element_ptr(
                device_buffer::<HipBuffer>(positions, "positions", "HIP")?.pointer,
                launch.positions_offset as usize,
                DType::I64,
            );
            let mut c_ptr = element_ptr(
                device_buffer::<HipBuffer>(cos_sin_cache, "cos_sin_cache", "HIP")?.pointer,
                c.offset as usize,
                dtype,
            );
            let (mut q_stride, mut c_stride, mut n_tokens) = (q.row_stride, c.row_stride, q.n_rows);
            let mut has_key = i32::from(launch.key.is_some());
            let mut is_neox = i32::from(is_neox_style);
            let mut round_products = i32::from(round_products);
            // rotary_embedding_<dtype>(q, long long q_row_stride, k, long long k_row_stride, int has_key,
            //     const long long* positions, cache, long long cache_row_stride, long long tokens,
            //     int heads, int kv_heads, int head_size, int rotary_dim, int max_position, int is_neox,
            //     int round_products)
            let mut params: [*mut c_void; 16] = [
                &mut q_ptr as *mut _ as *mut c_void,
                &mut q_stride as *mut _ as *mut c_void,
                &mut k_ptr as *mut _ as *mut c_void,
                &mut k_stride as *mut _ as *mut c_void,
                &mut has_key as *mut _ as *mut c_void,
                &mut p_ptr as *mut _ as *mut c_void,
                &mut c_ptr as *mut _ as *mut c_void,
                &mut c_stride as *mut _ as *mut c_void,
                &mut n_tokens as *mut _ as *mut c_void,
                &mut heads as *mut _ as *mut c_void,
                &mut kv_heads as *mut _ as *mut c_void,
                &mut head_size as *mut _ as *mut c_void,
                &mut rotary_dim as *mut _ as *mut c_void,
                &mut max_position as *mut _ as *mut c_void,
                &mut is_neox as *mut _ as *mut c_void,
                &mut round_products as *mut _ as *mut c_void,
            ];
            // SAFETY: the parameters point to locals of the kernel's declared types in prototype
            // order, each integer converted without loss (`Rows::kernel_args`, `RotaryLaunch::dims`).
            // Query's and key's rows lie inside their buffers (their layouts were checked against
            // their storage; the meta function checked that heads · head_size is each row's width),
            // and both are uniquely owned (the call's activations); `tokens` positions lie from
            // their offset (compact, the predicate); a cache row is read only for a position below
            // `max_position`, the cache's row count. A null key is never dereferenced: `has_key` is 0.
            unsafe { device.launch(&format!("{KERNEL}_{dtype}"), blocks, launch.threads_per_token(), &mut params) }?;
        }
        Ok((query.into_tensor(), key.map(UniqueTensor::into_tensor)))
    }
}
