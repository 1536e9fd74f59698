//! fp8 quantization on the xpu: `static_scaled_fp8_quant` and `dynamic_per_token_scaled_fp8_quant`.
//!
//! One program per input dtype, `kernels/quant.cl` after the element prelude, holding both kernels;
//! the fp8 format is a kernel argument. The scales stay on the device: the kernels read them there. The host code is the
//! shared one of [`kernel_support::gpu`]; each buffer parameter is followed by its element offset.

use crate::module::ELEMENT;

/// The quantization kernels' source (after the element prelude).
pub const QUANT: &str = include_str!("../kernels/quant.cl");

/// Work-items per work-group (`QUANT_GROUP` in `quant.cl`): one group per row.
pub const QUANT_GROUP: usize = 128;

/// The program source of the quantization kernels: the element prelude, then `quant.cl`.
pub fn program() -> String {
    format!("{ELEMENT}\n{QUANT}")
}

/// The norm + quantization kernel's source (after the element prelude and `quant.cl`).
pub const NORM_QUANT: &str = include_str!("../kernels/norm_quant.cl");

/// The program source of the norm + quantization kernel.
pub fn norm_quant_program() -> String {
    format!("{ELEMENT}\n{QUANT}\n{NORM_QUANT}")
}

/// The program source of the norm + quantization kernel for a weight of `weight`'s dtype, another
/// than x's (`norm_quant_w<weight>_<dtype>`): `norm_quant.cl` with the element prelude's `WDTYPE`.
pub fn mixed_norm_quant_program(weight: ir_core::DType) -> Result<String, ir_core::KernelError> {
    let code = kernel_support::compute_dtype_code(weight, "xpu")?;
    Ok(format!("#define WDTYPE {code}\n{}", norm_quant_program()))
}
