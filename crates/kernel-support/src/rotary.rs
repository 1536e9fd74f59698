//! Rotary embedding's launch plumbing: the geometry and rows a kernel is given
//! (`RotaryLaunch`, `RotaryCall`) and the registration of a provider's kernel.

use ir_core::{DeviceKind, KernelError, Tensor, UniqueTensor};

use crate::{KernelDTypes, RowArgs, Rows, kernel_int, rotary_support_with};

/// What a `rotary_embedding` kernel is given: the geometry, the rows of query, key and the cache,
/// and the positions' storage offset, each as kernel integers.
#[derive(Clone, Copy, Debug)]
pub struct RotaryLaunch {
    /// The call's geometry.
    pub geometry: ir_ops::rotary_embedding::RotaryGeometry,
    /// Query rows.
    pub query: RowArgs,
    /// Key rows (`None` without a key).
    pub key: Option<RowArgs>,
    /// Cache rows.
    pub cache: RowArgs,
    /// Storage offset of the first position, in elements.
    pub positions_offset: i64,
}

impl RotaryLaunch {
    /// The launch of a call on these tensors (the meta function has checked them).
    pub fn of(
        positions: &Tensor,
        query: &Tensor,
        key: Option<&Tensor>,
        cos_sin_cache: &Tensor,
        head_size: i64,
        rotary_dim: i64,
        is_neox_style: bool,
    ) -> Result<RotaryLaunch, KernelError> {
        use ir_ops::rotary_embedding::RotaryGeometry;
        let (q, c) = (query, cos_sin_cache);
        Ok(RotaryLaunch {
            geometry: RotaryGeometry::of_tensors(positions, q, key, c, head_size, rotary_dim, is_neox_style),
            query: Rows::for_kernel(q.meta())?.kernel_args()?,
            key: key.map(|k| Rows::for_kernel(k.meta())?.kernel_args()).transpose()?,
            cache: Rows::for_kernel(c.meta())?.kernel_args()?,
            positions_offset: kernel_int(positions.offset(), "positions offset")?,
        })
    }

    /// Work-items per token (each rotates pairs `i`, `i + threads`, … of every head): the pairs of
    /// the larger of query and key, rounded up to a multiple of 32 and capped at 256.
    pub fn threads_per_token(&self) -> u32 {
        let g = &self.geometry;
        let pairs = g.heads.max(g.kv_heads) * (g.rotary_dim / 2);
        (pairs.div_ceil(32) * 32).clamp(32, 256) as u32
    }

    /// The geometry's integers as the kernels take them: `(heads, kv_heads, head_size, rotary_dim,
    /// max_position)`.
    pub fn dims(&self) -> Result<[i32; 5], KernelError> {
        let g = &self.geometry;
        Ok([
            kernel_int(g.heads, "heads")?,
            kernel_int(g.kv_heads, "key heads")?,
            kernel_int(g.head_size, "head_size")?,
            kernel_int(g.rotary_dim, "rotary_dim")?,
            kernel_int(g.max_position, "cache rows")?,
        ])
    }
}

/// A `rotary_embedding` call as a provider's kernel receives it: the arguments, query and key
/// uniquely owned (the kernel rotates them in their storage), and the launch derived from them.
#[derive(Debug)]
pub struct RotaryCall<'a> {
    /// Token positions (i64).
    pub positions: &'a Tensor,
    /// The query, written in place.
    pub query: UniqueTensor,
    /// The key, written in place, when given.
    pub key: Option<UniqueTensor>,
    /// `[max_position, rotary_dim]`.
    pub cos_sin_cache: &'a Tensor,
    /// Geometry and kernel integers.
    pub launch: RotaryLaunch,
    /// Whether the cos and sin, each product and the sum are rounded to the query's dtype
    /// (`rounding = "dtype"` on 16-bit tensors; [`ir_ops::rotary_embedding::rotate_pair_rounded`]).
    pub round_products: bool,
}

/// A provider's rotary kernel: the rotated query and key, written in their storage.
pub type RotaryKernel = fn(RotaryCall<'_>) -> Result<(Tensor, Option<Tensor>), KernelError>;

/// Registers a provider's in-place `rotary_embedding` kernel on `device`, with the standard
/// predicate ([`rotary_support`](crate::rotary_support)); `kernel` returns the rotated query and key.
pub fn register_rotary(
    registry: &ir_core::Registry,
    device: DeviceKind,
    spec: ir_core::ImplSpec,
    kernel: RotaryKernel,
) -> Result<(), ir_core::RegistryError> {
    register_rotary_with(registry, device, || KernelDTypes::Reduced, spec, kernel)
}

/// [`register_rotary`] for a provider whose kernel computes on the dtypes `dtypes` says (asked at
/// each selection).
pub fn register_rotary_with(
    registry: &ir_core::Registry,
    device: DeviceKind,
    dtypes: fn() -> KernelDTypes,
    spec: ir_core::ImplSpec,
    kernel: RotaryKernel,
) -> Result<(), ir_core::RegistryError> {
    use ir_ops::rotary_embedding;
    let spec = spec.with_supports(move |args| rotary_support_with(args, device, dtypes()));
    let call = move |positions: &Tensor,
                     query: UniqueTensor,
                     key: Option<UniqueTensor>,
                     cos_sin_cache: &Tensor,
                     head_size: i64,
                     rotary_dim: i64,
                     is_neox_style: bool,
                     rounding: ir_ops::Rounding| {
        let key_tensor = key.as_ref().map(UniqueTensor::tensor);
        let round_products = rounding.rounds_intermediates(query.tensor().dtype());
        let launch = RotaryLaunch::of(
            positions,
            query.tensor(),
            key_tensor,
            cos_sin_cache,
            head_size,
            rotary_dim,
            is_neox_style,
        )?;
        kernel(RotaryCall { positions, query, key, cos_sin_cache, launch, round_products })
    };
    rotary_embedding::register(registry, spec, rotary_embedding::Impl::inplace(call))
}
