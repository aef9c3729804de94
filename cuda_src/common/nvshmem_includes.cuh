// NVSHMEM device API for kernels compiled by NVRTC.
//
// Include this (never <nvshmem.h> directly) in sources built with BuildSpec(nvshmem=True): NVSHMEM's
// device headers need the std:: traits of std_traits.cuh first. The JIT adds NVSHMEM's include
// directory, compiles with -rdc=true and links libnvshmem_device.a only for such specs.
#pragma once

#include "nvrtc_compat.cuh"
#include "std_traits.cuh"

#include <nvshmem.h>
#include <nvshmemx.h>
