// Fixed-width integer types and limits for kernels compiled by NVRTC.
//
// NVRTC ships no C++ standard library headers (<cstdint>, <type_traits>, ... cannot be opened), but the
// CCCL headers (libcu++) are on the include path. This header brings in the cheap ones:
//   * int8_t ... uint64_t, intptr_t, uintptr_t, size_t, ptrdiff_t in the global namespace, as
//     <stdint.h>/<stddef.h> would, and the INT32_MAX / INT_MAX style macros.
// Include it first in every .cu file. It adds about 0.1 s to a compile. Type traits are in
// std_traits.cuh instead: <cuda/std/type_traits> costs about 1.5 s of NVRTC time per compile, so only
// include it where needed (nvshmem_includes.cuh does). Under nvcc (not NVRTC) the real headers are used.
#pragma once

#ifdef __CUDACC_RTC__
#include <cuda/std/climits>
#include <cuda/std/cstddef>
#include <cuda/std/cstdint>

using cuda::std::int8_t;
using cuda::std::int16_t;
using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint8_t;
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::intptr_t;
using cuda::std::uintptr_t;
using cuda::std::size_t;
using cuda::std::ptrdiff_t;
#else
#include <climits>
#include <cstddef>
#include <cstdint>
#endif
