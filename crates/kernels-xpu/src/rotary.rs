//! `rotary_embedding` on the xpu, in place on query and key: `kernels/rotary.cl` after the element
//! prelude, one program per dtype, one work-group per token. The positions stay on the device; a
//! token whose position lies outside the cache is left unrotated (the kernel cannot report it).

use ir_core::{DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};
use ir_ops::rotary_embedding::ROTARY_EMBEDDING;
use kernel_support::{RotaryCall, device_buffer, device_buffer_mut, register_rotary_with};
use opencl3::kernel::ExecuteKernel;
use opencl3::memory::ClMem;

use crate::device::{XpuBuffer, cl_error};
use crate::module::ELEMENT;

/// The rotary kernel's source (after the element prelude).
pub const ROTARY: &str = include_str!("../kernels/rotary.cl");

/// The program source of the rotary kernel.
pub fn program() -> String {
    format!("{ELEMENT}\n{ROTARY}")
}

/// Registers `rotary_embedding` (in place).
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = ImplSpec::new(crate::PROVIDER).with_probe(crate::availability).with_platform_detection(crate::is_gpu);
    register_rotary_with(registry, DeviceKind::Xpu, crate::kernel_dtypes, spec, rotary_embedding_xpu)
}

/// `rotary_embedding` on `xpu:0`: rotates query and key (when given) in their storage.
pub fn rotary_embedding_xpu(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let RotaryCall { positions, mut query, mut key, cos_sin_cache, launch, round_products } = call;
    let is_neox_style = launch.geometry.is_neox_style;
    let dtype = query.tensor().dtype();
    let tokens = launch.geometry.tokens;
    if tokens > 0 {
        let group = launch.threads_per_token() as usize;
        let global =
            tokens.checked_mul(group).ok_or_else(|| KernelError::GridLimit { what: "tokens", count: tokens })?;
        let [heads, kv_heads, head_size, rotary_dim, max_position] = launch.dims()?;
        let positions_buffer = device_buffer::<XpuBuffer>(positions, "positions", "xpu")?;
        let cache_buffer = device_buffer::<XpuBuffer>(cos_sin_cache, "cos_sin_cache", "xpu")?;
        let q_buffer = &*device_buffer_mut::<XpuBuffer>(&mut query, "query", "xpu")?;
        let k_buffer = match key.as_mut() {
            Some(key) => Some(&*device_buffer_mut::<XpuBuffer>(key, "key", "xpu")?),
            None => None,
        };
        let queue = q_buffer.call_queue()?;
        for buffer in [Some(q_buffer), k_buffer, Some(positions_buffer), Some(cache_buffer)].into_iter().flatten() {
            buffer.use_on(&queue)?;
        }
        let kernel =
            q_buffer.device.op_kernel(ROTARY_EMBEDDING.name, dtype, &format!("rotary_embedding_{dtype}"), program)?;
        let kernel = kernel.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let q_mem = q_buffer.buffer.get();
        // Without a key the kernel never touches `k`; the query's buffer stands in.
        let k_mem = k_buffer.map_or(q_mem, |k| k.buffer.get());
        let (p_mem, c_mem) = (positions_buffer.buffer.get(), cache_buffer.buffer.get());
        let (q, c) = (launch.query, launch.cache);
        let (k_stride, k_offset) = launch.key.map_or((0, 0), |k| (k.row_stride, k.offset));
        let has_key = i32::from(launch.key.is_some());
        let n_tokens = q.n_rows;
        let is_neox = i32::from(is_neox_style);
        let round_products = i32::from(round_products);
        // rotary_embedding_<dtype>(q, long q_row_stride, long q_offset, k, long k_row_stride,
        //     long k_offset, int has_key, positions, long positions_offset, cache,
        //     long cache_row_stride, long cache_offset, long tokens, int heads, int kv_heads,
        //     int head_size, int rotary_dim, int max_position, int is_neox, int round_products)
        // SAFETY: the arguments follow the kernel's prototype above, with the types it declares,
        // each integer converted without loss (`Rows::kernel_args`, `RotaryLaunch::dims`). Query's
        // and key's rows lie inside their buffers (their layouts were checked against their
        // storage; the meta function checked that heads · head_size is each row's width), and
        // both are uniquely owned (the call's activations), so the kernel's writes race with no
        // other user; `tokens` positions lie from their offset inside their buffer (compact, the
        // predicate); the cache row a position selects is read only when the position is below
        // `max_position`, the cache's row count, and each holds `rotary_dim` elements.
        unsafe {
            ExecuteKernel::new(&kernel)
                .set_arg(&q_mem)
                .set_arg(&q.row_stride)
                .set_arg(&q.offset)
                .set_arg(&k_mem)
                .set_arg(&k_stride)
                .set_arg(&k_offset)
                .set_arg(&has_key)
                .set_arg(&p_mem)
                .set_arg(&launch.positions_offset)
                .set_arg(&c_mem)
                .set_arg(&c.row_stride)
                .set_arg(&c.offset)
                .set_arg(&n_tokens)
                .set_arg(&heads)
                .set_arg(&kv_heads)
                .set_arg(&head_size)
                .set_arg(&rotary_dim)
                .set_arg(&max_position)
                .set_arg(&is_neox)
                .set_arg(&round_products)
                .set_global_work_size(global)
                .set_local_work_size(group)
                .enqueue_nd_range(&queue)
        }
        .map_err(cl_error)?;
    }
    Ok((query.into_tensor(), key.map(UniqueTensor::into_tensor)))
}
