// gelu_and_mul on `rocm`: the op's source CUDA and HIP share (`kernels/gpu/gelu_and_mul.h`), after the gated row
// kernel (`kernels/gpu/gated.h`).

#include "element.hip.h"
#include "gpu/gated.h"
#include "gpu/gelu_and_mul.h"
