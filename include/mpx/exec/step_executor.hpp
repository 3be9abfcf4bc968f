// mpx::step_executor: an executor as a plain value whose type is erased, for code that
// must not be a template over the executor (type-erased hooks, std::function).
#pragma once

#include <mpx/exec/executor.hpp>

#include <utility>

namespace mpx {

//! The executor a training step runs on, type-erased (as mpx::replica_hooks carry it): the
//! stream of a cuda_executor (null: the legacy default stream), nothing for the host executor.
//! `as<Exec>()` gives the executor back to code that knows its type (data_parallel).
class step_executor {
 public:
  constexpr step_executor() noexcept = default;  //!< the host executor, or the legacy default stream
  template <executor Exec>
  explicit step_executor(Exec const& exec) noexcept {
    if constexpr (!is_host_executor_v<Exec>) stream_ = exec.stream();
  }
  template <executor Exec>
  [[nodiscard]] Exec as() const noexcept {
    if constexpr (is_host_executor_v<Exec>) return Exec{};
    else return Exec(static_cast<decltype(std::declval<Exec const&>().stream())>(stream_));
  }
  //! The stream (a cudaStream_t), type-erased; null on the host.
  [[nodiscard]] void* stream() const noexcept { return stream_; }
  friend bool operator==(step_executor const&, step_executor const&) = default;

 private:
  void* stream_ = nullptr;
};

}  // namespace mpx
