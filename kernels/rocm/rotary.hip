// rotary_embedding on `rocm`: the kernel CUDA and HIP share (`kernels/gpu/rotary.h`), for f32, f16,
// bf16 and f64. Its products, difference and sum each round on their own (`c_mul`, `c_sub`,
// `c_add`, compiled with contraction off: `tests/hipcc.rs` checks the ISA has no fused
// multiply-add).

#include "element.hip.h"
#include "gpu/rotary.h"
