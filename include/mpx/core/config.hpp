// The few macros mpx has, all here: host/device annotations that vanish under a plain
// C++ compiler, and the check that wraps every CUDA runtime call.
// Dependency-free on purpose: every other header may include it.
#pragma once

// mpx is C++20 (concepts, designated initialisers, std::span); nvcc's default is C++17.
#if !defined(_MSVC_LANG) && __cplusplus < 202002L
#error "mpx needs C++20: compile with -std=c++20 (nvcc: -std=c++20; CMake: CMAKE_CXX_STANDARD 20 and CMAKE_CUDA_STANDARD 20; Meson: cpp_std=c++20)"
#elif defined(_MSVC_LANG) && _MSVC_LANG < 202002L
#error "mpx needs C++20: compile with /std:c++20"
#endif

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

//! The GPU architectures the including translation unit is compiled for, as nvcc lists
//! them ("800,900"; empty outside nvcc): a GPU with no code among them is told so.
#if defined(__CUDA_ARCH_LIST__)
#define MPX_DETAIL_STRINGIFY_(x) #x
#define MPX_DETAIL_STRINGIFY(x) MPX_DETAIL_STRINGIFY_(x)
#define MPX_BUILT_ARCHITECTURES MPX_DETAIL_STRINGIFY(__CUDA_ARCH_LIST__)
#else
#define MPX_BUILT_ARCHITECTURES ""
#endif

//! Checks the launch of the kernel just enqueued (`what`: its name). The error found may
//! be this launch's (bad configuration, missing image) or an earlier operation's (an
//! asynchronous fault of a kernel enqueued before); the message says which (see
//! mpx::detail::launch_failure in <mpx/core/error.hpp>). A GPU the program has no code
//! for is named, with the architectures it was built for.
#define MPX_CUDA_CHECK_LAUNCH(what) \
  ::mpx::detail::check_launch((what), __FILE__, __LINE__, MPX_BUILT_ARCHITECTURES)
