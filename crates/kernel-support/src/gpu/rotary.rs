//! `rotary_embedding`'s host code.

use ir_core::{DType, KernelError, Tensor, UniqueTensor};

use super::{GpuRuntime, Grid, KernelArgs, KernelKey};
use crate::{RotaryCall, device_buffer, device_buffer_mut};

/// `rotary_embedding` on runtime `R`: rotates query and key (when given) in their storage, one
/// group per token. The positions stay on the device (a call never waits for the host); a token
/// whose position lies outside the cache is left unrotated (the kernel cannot report it). The
/// kernel is `rotary_embedding_<dtype>(q, long long q_row_stride, k, long long k_row_stride, int
/// has_key, const long long* positions, const elem_t* cache, long long cache_row_stride, long long
/// tokens, int heads, int kv_heads, int head_size, int rotary_dim, int max_position, int is_neox,
/// int round_products)`.
pub fn run_rotary<R: GpuRuntime>(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let RotaryCall { positions, mut query, mut key, cos_sin_cache, launch, round_products } = call;
    let dtype = query.tensor().dtype();
    let tokens = launch.geometry.tokens;
    if tokens > 0 {
        let [heads, kv_heads, head_size, rotary_dim, max_position] = launch.dims()?;
        let positions_buffer = device_buffer::<R::Buffer>(positions, "positions", R::MEMORY)?;
        let cache_buffer = device_buffer::<R::Buffer>(cos_sin_cache, "cos_sin_cache", R::MEMORY)?;
        let q_buffer = device_buffer_mut::<R::Buffer>(&mut query, "query", R::MEMORY)?;
        let queue = R::queue(q_buffer)?;
        let kernel = R::kernel(q_buffer, KernelKey::Rotary { dtype })?;
        let k_buffer = match key.as_mut() {
            Some(key) => Some(device_buffer_mut::<R::Buffer>(key, "key", R::MEMORY)?),
            None => None,
        };
        let (q, c) = (launch.query, launch.cache);
        let mut args = KernelArgs::new();
        args.write(q_buffer, offset(q.offset)?, dtype).long(q.row_stride);
        match (k_buffer, launch.key) {
            (Some(buffer), Some(k)) => args.write(buffer, offset(k.offset)?, dtype).long(k.row_stride),
            // Without a key the kernel never touches `k` (`has_key` is 0): null.
            _ => args.null().long(0),
        };
        args.int(i32::from(launch.key.is_some()))
            .read(positions_buffer, offset(launch.positions_offset)?, DType::I64)
            .read(cache_buffer, offset(c.offset)?, dtype)
            .long(c.row_stride)
            .long(q.n_rows)
            .int(heads)
            .int(kv_heads)
            .int(head_size)
            .int(rotary_dim)
            .int(max_position)
            .int(i32::from(launch.geometry.is_neox_style))
            .int(i32::from(round_products));
        let grid = Grid { groups: tokens, group_size: launch.threads_per_token(), what: "tokens", grid_stride: true };
        // SAFETY: the arguments follow the prototype above, each integer converted without loss
        // (`Rows::kernel_args`, `RotaryLaunch::dims`). Query's and key's rows lie inside their
        // buffers (their layouts were checked against their storage; the meta function checked
        // that heads · head_size is each row's width), and both are uniquely owned (the call's
        // activations); `tokens` positions lie from their offset (compact, the predicate); a cache
        // row is read only for a position below `max_position`, the cache's row count. A null key
        // is never dereferenced: `has_key` is 0.
        unsafe { R::launch(&queue, &kernel, grid, args) }?;
    }
    Ok((query.into_tensor(), key.map(UniqueTensor::into_tensor)))
}

/// A storage offset a kernel integer carried back to an element index.
fn offset(value: i64) -> Result<usize, KernelError> {
    usize::try_from(value).map_err(|_| crate::out_of_range("storage offset", value, 0, isize::MAX))
}
