// fp8 quantization on `rocm`: the kernels CUDA and HIP share (`kernels/gpu/quant.h`, the static and
// dynamic per-token quantizations, and `kernels/gpu/norm_quant.h`, the norm + quantization), after
// the fp8 conversion (`kernels/gpu/fp8.h`: software on every ROCm target).

#include "element.hip.h"
#include "gpu/fp8.h"
#include "gpu/quant.h"
#include "gpu/norm_quant.h"
