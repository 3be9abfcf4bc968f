// The one way mpx's benchmarks time a piece of work: the median of `repeat` runs after
// a warm-up, measured by events on the stream for a cuda_executor (what the GPU spent,
// not the launch overhead of an idle host) and by a steady clock for the host.
#pragma once

#include <mpx/mpx.hpp>

#include <algorithm>
#include <chrono>
#include <vector>

namespace mpx_bench {

#if MPX_HAS_CUDA
//! One CUDA event, destroyed with its owner.
class cuda_event {
 public:
  cuda_event() { MPX_CUDA_CHECK(cudaEventCreate(&event_)); }
  cuda_event(cuda_event const&) = delete;
  cuda_event& operator=(cuda_event const&) = delete;
  ~cuda_event() { cudaEventDestroy(event_); }
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};
#endif

//! Seconds per call of run(): the median over `repeat` timings of `inner` calls each
//! (inner > 1 for calls too short to time one at a time), after one warm-up call
//! (first-touch page faults, module loading, pool growth, plan creation).
template <class Exec, class F>
double median_seconds(Exec const& exec, int repeat, F&& run, int inner = 1) {
  run();
  exec.synchronize();
  std::vector<double> times;
#if MPX_HAS_CUDA
  if constexpr (mpx::is_cuda_executor_v<Exec>) {
    cuda_event start, stop;
    for (int r = 0; r < repeat; ++r) {
      MPX_CUDA_CHECK(cudaEventRecord(start.get(), exec.stream()));
      for (int i = 0; i < inner; ++i) run();
      MPX_CUDA_CHECK(cudaEventRecord(stop.get(), exec.stream()));
      MPX_CUDA_CHECK(cudaEventSynchronize(stop.get()));
      float ms = 0;
      MPX_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
      times.push_back(ms / 1e3 / inner);
    }
  } else
#endif
  {
    for (int r = 0; r < repeat; ++r) {
      auto const t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < inner; ++i) run();
      exec.synchronize();
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / inner);
    }
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace mpx_bench
