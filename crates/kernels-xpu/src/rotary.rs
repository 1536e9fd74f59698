//! `rotary_embedding` on the xpu, in place on query and key: `kernels/rotary.cl` after the element
//! prelude, one program per dtype, one work-group per token. The positions stay on the device; a
//! token whose position lies outside the cache is left unrotated (the kernel cannot report it).

use crate::module::ELEMENT;

/// The rotary kernel's source (after the element prelude).
pub const ROTARY: &str = include_str!("../kernels/rotary.cl");

/// The program source of the rotary kernel.
pub fn program() -> String {
    format!("{ELEMENT}\n{ROTARY}")
}
