// silu_and_mul on `rocm`: the op's source CUDA and HIP share (`kernels/gpu/silu_and_mul.h`), after the gated row
// kernel (`kernels/gpu/gated.h`).

#include "element.hip.h"
#include "gpu/gated.h"
#include "gpu/silu_and_mul.h"
