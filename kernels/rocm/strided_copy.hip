// The strided kernels on `rocm`: the copies, conversions and `add`/`mul` CUDA and HIP share
// (`kernels/gpu/strided_copy.h`, `kernels/gpu/strided_convert.h`), after the fp8 conversion
// (`kernels/gpu/fp8.h`).

#include "element.hip.h"
#include "gpu/fp8.h"
#include "gpu/strided_copy.h"
#include "gpu/strided_convert.h"
