// Helpers for work that runs on a stream of mpx's own beside the executor's: an event
// used only to order streams, and a side stream ordered after and before another by
// such events (GPU-side waits; the host never blocks).
#pragma once

#include <mpx/core/error.hpp>

#if MPX_HAS_CUDA_RUNTIME
#include <cuda_runtime_api.h>

namespace mpx::detail {

//! An event used only for ordering (no timing, which makes record and wait cheaper).
class ordering_event {
 public:
  ordering_event() { MPX_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~ordering_event() { report_if_failed(cudaEventDestroy(event_), "cudaEventDestroy"); }
  ordering_event(ordering_event const&) = delete;
  ordering_event& operator=(ordering_event const&) = delete;
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

//! A non-blocking stream of mpx's own. Work enqueued between follow(s) and precede(s)
//! runs after everything enqueued on s before follow, and before everything enqueued
//! on s after precede: to s it looks as if the work had been enqueued on s itself.
//! Destroying it does not wait; the driver releases the stream once its work is done.
class side_stream {
 public:
  side_stream() { MPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~side_stream() { report_if_failed(cudaStreamDestroy(stream), "cudaStreamDestroy"); }
  side_stream(side_stream const&) = delete;
  side_stream& operator=(side_stream const&) = delete;

  void follow(cudaStream_t other) {
    MPX_CUDA_CHECK(cudaEventRecord(entered_.get(), other));
    MPX_CUDA_CHECK(cudaStreamWaitEvent(stream, entered_.get(), 0));
  }
  void precede(cudaStream_t other) {
    MPX_CUDA_CHECK(cudaEventRecord(left_.get(), stream));
    MPX_CUDA_CHECK(cudaStreamWaitEvent(other, left_.get(), 0));
  }

  cudaStream_t stream = nullptr;

 private:
  ordering_event entered_, left_;
};

}  // namespace mpx::detail
#endif
