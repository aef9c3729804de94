// std:: type traits under NVRTC, taken from libcu++.
//
// Third-party device headers (NVSHMEM 3.4+) name std::is_integral / is_signed / is_unsigned without
// including anything, and NVRTC has no <type_traits>. This header includes <cuda/std/type_traits> and
// <cuda/std/limits> and makes the common traits visible in namespace std. It costs about 1.5 s of NVRTC
// time, so include it only where needed. Under nvcc the real <type_traits> and <limits> are used.
#pragma once

#include "nvrtc_compat.cuh"

#ifdef __CUDACC_RTC__
#include <cuda/std/limits>
#include <cuda/std/type_traits>

namespace std {
using cuda::std::conditional;
using cuda::std::enable_if;
using cuda::std::integral_constant;
using cuda::std::is_floating_point;
using cuda::std::is_integral;
using cuda::std::is_same;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
using cuda::std::numeric_limits;
}  // namespace std
#else
#include <limits>
#include <type_traits>
#endif
