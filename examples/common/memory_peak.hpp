// A run's peak memory, for the examples' tables: on the host the process's peak resident
// size, on the GPU the high-water marks of the stream-ordered pool (tensors, cuDNN's
// workspaces) and of the graph pool (what a captured step allocates) plus cuBLASLt's
// workspaces, which are plain allocations. The two GPU marks may be reached at different
// times, so their sum is an upper bound. Made before the run (it restarts the marks),
// read after.
#pragma once

#include <mpx/exec/executor.hpp>
#include <mpx/kernels/cublaslt.hpp>

#include <sys/resource.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

namespace mpx_programs {

template <class Exec>
class memory_peak {
 public:
  memory_peak() {
#if MPX_HAS_CUDA
    if constexpr (!mpx::is_host_executor_v<Exec>) {
      MPX_CUDA_CHECK(cudaDeviceSynchronize());  // the previous run's frees finish first
      MPX_CUDA_CHECK(cudaGetDevice(&device_));
      MPX_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool_, device_));
      std::uint64_t zero = 0;
      MPX_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero));
      MPX_CUDA_CHECK(cudaDeviceSetGraphMemAttribute(device_, cudaGraphMemAttrUsedMemHigh, &zero));
      return;
    }
#endif
    // Linux keeps a process's peak resident size (VmHWM in /proc/self/status), and
    // writing 5 to /proc/self/clear_refs resets it. Where that cannot be done, the figure
    // is the peak of the whole process so far.
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.close();
    host_reset_ = !clear.fail();
  }

  //! The peak since construction, in MiB.
  [[nodiscard]] double mib() const {
#if MPX_HAS_CUDA
    if constexpr (!mpx::is_host_executor_v<Exec>) {
      std::uint64_t pool_high = 0, graph_high = 0;
      MPX_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &pool_high));
      MPX_CUDA_CHECK(cudaDeviceGetGraphMemAttribute(device_, cudaGraphMemAttrUsedMemHigh, &graph_high));
      return static_cast<double>(pool_high + graph_high + mpx::gemm_workspace_bytes()) / (1024.0 * 1024.0);
    }
#endif
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmHWM:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024.0;  // in kB
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_maxrss) / 1024.0;  // kilobytes on Linux
  }

  //! What mib() measures, for the table.
  [[nodiscard]] char const* kind() const noexcept {
    if constexpr (!mpx::is_host_executor_v<Exec>) return "GPU (pools' high-water + cuBLASLt workspaces)";
    return host_reset_ ? "host (peak RSS of this run)" : "host (process peak RSS)";
  }

 private:
  bool host_reset_ = false;
#if MPX_HAS_CUDA
  int device_ = 0;
  cudaMemPool_t pool_{};
#endif
};

}  // namespace mpx_programs
