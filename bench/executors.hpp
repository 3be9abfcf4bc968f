// How every mpx benchmark picks its executors from --executor host|cuda|all: the host
// executor, and the GPU (on a stream of its own) where one is visible. Errors, as asking
// for CUDA rows that cannot be had, are thrown: main reports them (mpx_programs::report_failure).
#pragma once

#include <mpx/mpx.hpp>

#include "../examples/common/command_line.hpp"

#include <cstdio>
#include <string_view>

namespace mpx_bench {

//! Calls run(exec) for each executor `which` names; returns main's exit status.
template <class Run>
int run_on_executors(std::string_view which, Run&& run) {
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
    throw mpx::error("--executor cuda: no GPU visible: no CUDA rows");
  }
#else
  if (which == "cuda") throw mpx::error("--executor cuda: built without nvcc: no CUDA rows");
#endif
  return 0;
}

}  // namespace mpx_bench
