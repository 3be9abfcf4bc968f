// mpx::resident<T, Space>: one small value (a loss scale, a step counter, a found-inf
// flag) kept where an executor computes, so kernels read and update it in stream order
// and a training step never waits for the host. Reading it from the host is explicit
// and synchronises.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/memory_space.hpp>

#include <type_traits>

namespace mpx {

template <class T, memory_space Space>
class resident {
  static_assert(std::is_trivially_copyable_v<T>, "mpx::resident holds trivially copyable values (copied as bytes)");

 public:
  resident() = default;
  //! Allocates the value in the executor's space and enqueues its initialisation.
  template <executor Exec>
  resident(Exec const& exec, T const& initial) : buffer_(detail::allocate<T>(exec, 1)) {
    detail::require_access<Exec, Space>();
    write(exec, initial);
  }

  //! Where kernels (or host code, for host_space) find the value.
  [[nodiscard]] T* get() const noexcept { return buffer_.data(); }

  //! The current value. On a cuda_executor this waits for the stream.
  template <executor Exec>
  [[nodiscard]] T read([[maybe_unused]] Exec const& exec) const {
    detail::require_access<Exec, Space>();
    if constexpr (is_host_executor_v<Exec>) {
      return *get();
    } else {
#if MPX_HAS_CUDA_RUNTIME
      T value;
      MPX_CUDA_CHECK(cudaMemcpyAsync(&value, get(), sizeof(T), cudaMemcpyDeviceToHost, exec.stream()));
      exec.synchronize();
      return value;
#endif
    }
  }

  //! Replaces the value, in stream order (the host copy is staged before this returns).
  template <executor Exec>
  void write([[maybe_unused]] Exec const& exec, T const& value) {
    detail::require_access<Exec, Space>();
    if constexpr (is_host_executor_v<Exec>) {
      *get() = value;
    } else {
#if MPX_HAS_CUDA_RUNTIME
      MPX_CUDA_CHECK(cudaMemcpyAsync(get(), &value, sizeof(T), cudaMemcpyHostToDevice, exec.stream()));
#endif
    }
  }

 private:
   detail::buffer<T, Space> buffer_;
};

}  // namespace mpx
