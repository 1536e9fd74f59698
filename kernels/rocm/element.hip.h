// The element types of the `rocm` kernels: the HIP portability header, then the element layer the
// CUDA and HIP kernels share (`kernels/gpu/elem.h`: `Elem<DTYPE>`, `Compute<DTYPE>`, `RowChunk`).
// Included by every kernel source.

#pragma once

#include "port.hip.h"
#include "gpu/elem.h"
