//! `rotary_embedding` on `rocm:0`, in place on query and key: the kernel CUDA and HIP share,
//! `kernels/gpu/rotary.h` (which `kernels/rotary.hip` includes; `build.rs` compiles it into the
//! code object with every other source), `rotary_embedding_<dtype>`, one block per
//! token. The positions stay on the device; a token whose position lies outside the cache is left
//! unrotated (the kernel cannot report it).

/// The kernel of this module (`rotary_embedding_<dtype>`).
pub const KERNEL: &str = "rotary_embedding";
