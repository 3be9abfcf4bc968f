// The few macros mpx has, all here: host/device annotations that vanish under a plain
// C++ compiler, and the check that wraps every CUDA runtime call.
// Dependency-free on purpose: every other header may include it.
#pragma once

#if defined(__CUDACC__)
#define MPX_HD __host__ __device__
#define MPX_DEVICE __device__
#define MPX_HAS_CUDA 1
#else
#define MPX_HD
#define MPX_DEVICE
#define MPX_HAS_CUDA 0
#endif

//! Asks nvcc to unroll the next loop in device code; nothing in host code, where the
//! host compiler (g++ behind nvcc too) would warn about an unknown pragma.
#if defined(__CUDA_ARCH__)
#define MPX_UNROLL _Pragma("unroll")
#else
#define MPX_UNROLL
#endif

#if defined(__CUDA_ARCH__)
#define MPX_DEVICE_PASS 1
#else
#define MPX_DEVICE_PASS 0
#endif

//! Checks a CUDA runtime call (or cudaGetLastError after a launch); throws
//! mpx::cuda_error naming the call, the CUDA message, file and line. Needs
//! <mpx/core/error.hpp> (expanded lazily, so this header stays dependency-free).
#define MPX_CUDA_CHECK(expr) ::mpx::detail::check_cuda((expr), #expr, __FILE__, __LINE__)

//! Checks the launch of the kernel just enqueued (bad configuration, missing image).
#define MPX_CUDA_CHECK_LAUNCH(what) \
  ::mpx::detail::check_cuda(cudaGetLastError(), "launch of " what, __FILE__, __LINE__)
