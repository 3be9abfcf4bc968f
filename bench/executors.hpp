// How every mpx benchmark picks its executors from --executor host|cuda|all: the host
// executor, and the GPU (on a stream of its own) where one is visible. Errors end the
// program with a message and exit status 1, as asking for CUDA rows that cannot be had.
#pragma once

#include <mpx/mpx.hpp>

#include <cstdio>
#include <exception>
#include <string_view>

namespace mpx_bench {

//! Calls run(exec) for each executor `which` names; returns main's exit status.
template <class Run>
int run_on_executors(std::string_view which, Run&& run) {
  try {
    if (which == "host" || which == "all") run(mpx::host_executor{});
#if MPX_HAS_CUDA
    int devices = 0;
    bool const gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
    if (gpu && (which == "cuda" || which == "all")) {
      cudaDeviceProp prop{};
      MPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
      std::printf("GPU: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
      cudaStream_t stream = nullptr;
      MPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      run(mpx::cuda_executor{stream});
      MPX_CUDA_CHECK(cudaStreamSynchronize(stream));
      MPX_CUDA_CHECK(cudaStreamDestroy(stream));
    } else if (which == "cuda") {
      std::fprintf(stderr, "no GPU visible: no CUDA rows\n");
      return 1;
    }
#else
    if (which == "cuda") {
      std::fprintf(stderr, "built without nvcc: no CUDA rows\n");
      return 1;
    }
#endif
  } catch (std::exception const& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace mpx_bench
