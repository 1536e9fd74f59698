//! `rotary_embedding` on CUDA, in place on query and key: `kernels/rotary.cu` after the element
//! prelude, one NVRTC program per dtype, one block per token. The positions stay on the device (a
//! call never waits for the host); a token whose position lies outside the cache is left
//! unrotated (the kernel cannot report it).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use ir_core::{DType, DeviceKind, ImplSpec, KernelError, Registry, RegistryError, Tensor, UniqueTensor};
use ir_ops::rotary_embedding::ROTARY_EMBEDDING;
use kernel_support::{RotaryCall, device_buffer, device_buffer_mut, register_rotary_with};

use crate::device::{CudaBuffer, driver_error};
use crate::module::{ELEMENT, compile, dtype_define};

/// The rotary kernel's source (after the element prelude).
pub const ROTARY: &str = include_str!("../kernels/rotary.cu");

/// The kernel of this module (`rotary_embedding_<dtype>`).
pub const KERNEL: &str = "rotary_embedding";

/// Compiles the rotary program for `dtype` to PTX for `arch`.
pub fn compile_ptx(dtype: DType, arch: Option<&'static str>) -> Result<Ptx, KernelError> {
    let source = format!("{ELEMENT}\n{ROTARY}");
    compile(&source, "rotary.cu", format!("rotary_{dtype}"), vec![dtype_define(dtype)?], arch)
}

/// Registers `rotary_embedding` (in place).
pub(crate) fn register(registry: &Registry) -> Result<(), RegistryError> {
    let spec = ImplSpec::new(crate::PROVIDER).with_probe(crate::availability);
    register_rotary_with(registry, DeviceKind::Cuda, || crate::KERNEL_DTYPES, spec, rotary_embedding_cuda)
}

/// `rotary_embedding` on CUDA: rotates query and key (when given) in their storage; the launch is
/// asynchronous, on the query's call stream.
pub fn rotary_embedding_cuda(call: RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let RotaryCall { positions, mut query, mut key, cos_sin_cache, launch, round_products } = call;
    let is_neox_style = launch.geometry.is_neox_style;
    let dtype = query.tensor().dtype();
    let size = dtype.size_in_bytes();
    let tokens = launch.geometry.tokens;
    if tokens > 0 {
        let grid = u32::try_from(tokens)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| KernelError::GridLimit { what: "tokens", count: tokens })?;
        let config =
            LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (launch.threads_per_token(), 1, 1), shared_mem_bytes: 0 };
        let [heads, kv_heads, head_size, rotary_dim, max_position] = launch.dims()?;
        let positions_buffer = device_buffer::<CudaBuffer>(positions, "positions", "CUDA")?;
        let cache_buffer = device_buffer::<CudaBuffer>(cos_sin_cache, "cos_sin_cache", "CUDA")?;
        let q_buffer = device_buffer_mut::<CudaBuffer>(&mut query, "query", "CUDA")?;
        let stream = q_buffer.call_stream()?;
        let device = std::sync::Arc::clone(&q_buffer.device);
        let arch = device.arch;
        let function = device
            .op_function(ROTARY_EMBEDDING.name, dtype, &format!("{KERNEL}_{dtype}"), || compile_ptx(dtype, arch))?;
        let k_buffer = match key.as_mut() {
            Some(key) => Some(device_buffer_mut::<CudaBuffer>(key, "key", "CUDA")?),
            None => None,
        };
        let (q, c) = (launch.query, launch.cache);
        let q_address = q_buffer.write_address(&stream);
        let k_address = k_buffer.map(|b| b.write_address(&stream));
        let p_address = positions_buffer.read_address(&stream);
        let c_address = cache_buffer.read_address(&stream);
        let q_ptr = q_address.offset(q.offset as usize * size);
        // Without a key the kernel never touches `k`: null.
        let (k_ptr, k_stride) = match (&k_address, launch.key) {
            (Some(address), Some(k)) => (address.offset(k.offset as usize * size), k.row_stride),
            _ => (0, 0),
        };
        let p_ptr = p_address.offset(launch.positions_offset as usize * 8);
        let c_ptr = c_address.offset(c.offset as usize * size);
        let has_key = i32::from(launch.key.is_some());
        let is_neox = i32::from(is_neox_style);
        let round_products = i32::from(round_products);
        let n_tokens = q.n_rows;
        let mut builder = stream.launch_builder(&function);
        // rotary_embedding_<dtype>(elem_t* q, long long q_row_stride, elem_t* k, long long k_row_stride,
        //     int has_key, const long long* positions, const elem_t* cache, long long cache_row_stride,
        //     long long tokens, int heads, int kv_heads, int head_size, int rotary_dim, int max_position,
        //     int is_neox, int round_products)
        builder.arg(&q_ptr).arg(&q.row_stride).arg(&k_ptr).arg(&k_stride).arg(&has_key);
        builder.arg(&p_ptr).arg(&c_ptr).arg(&c.row_stride).arg(&n_tokens);
        builder.arg(&heads).arg(&kv_heads).arg(&head_size).arg(&rotary_dim).arg(&max_position).arg(&is_neox);
        builder.arg(&round_products);
        // SAFETY: the arguments follow the kernel's prototype above, each integer converted without
        // loss (`Rows::kernel_args`, `RotaryLaunch::dims`). Query's and key's addresses cover every
        // element their rows reach (their layouts were checked against their storage; the meta
        // function checked that heads · head_size is each row's width), and both are uniquely owned
        // (the call's activations); `tokens` positions lie from their offset (compact, the
        // predicate); a cache row is read only for a position below `max_position`, the cache's
        // row count. A null key is never dereferenced: `has_key` is 0. The address guards record
        // every use on the call's stream for cudarc's ordering.
        unsafe { builder.launch(config) }.map_err(driver_error)?;
    }
    Ok((query.into_tensor(), key.map(UniqueTensor::into_tensor)))
}
