// Executors decide where an algorithm runs: host_executor (plain C++, the reference)
// or cuda_executor{stream} (kernels on a stream). They are cheap values; traits say
// which memory space each one reaches, and reaching the wrong one is a compile error.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/memory_space.hpp>

#include <cstddef>
#include <string_view>
#include <type_traits>

namespace mpx {

//! Runs algorithms on the calling thread over host memory. Always available.
struct host_executor {
  using memory_space = host_space;
  static constexpr std::string_view name = "host";
  void synchronize() const noexcept {}  //!< Host work is done when the call returns.
  //! Never: host work is not captured (see cuda_executor::capturing).
  [[nodiscard]] static constexpr bool capturing() noexcept { return false; }
};

#if MPX_HAS_CUDA_RUNTIME
//! Enqueues algorithms on a CUDA stream (the legacy default stream if none is given).
//! Algorithms return once their work is enqueued, except those that return a value to
//! the host (all_finite, stats): those synchronise the stream, and say so.
//! Launching kernels needs nvcc; holding one and copying memory does not. As CUDA's
//! launches require, the stream's device must be the current one (cudaSetDevice) when
//! an algorithm is called: mpx takes the device it allocates on and plans for (pools,
//! cuBLASLt's handle, the fp8 products' capability check) from the current device. The
//! stream stays the caller's: before destroying one that ran mpx::gemm, call
//! mpx::release_gemm_workspace(stream), which frees the cuBLASLt workspace kept for it.
class cuda_executor {
 public:
  using memory_space = device_space;
  static constexpr std::string_view name = "cuda";

  cuda_executor() = default;
  explicit cuda_executor(cudaStream_t stream) noexcept : stream_(stream) {}

  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  //! The same executor on another stream.
  [[nodiscard]] cuda_executor on(cudaStream_t stream) const noexcept { return cuda_executor(stream); }
  //! Waits for everything enqueued on the stream; throws mpx::cuda_error if it failed.
  void synchronize() const { MPX_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  //! Whether the stream is capturing a CUDA graph: then nothing may be created,
  //! allocated or waited for, and what is enqueued runs only when the graph is launched.
  [[nodiscard]] bool capturing() const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    MPX_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
    return status != cudaStreamCaptureStatusNone;
  }

 private:
  cudaStream_t stream_ = nullptr;
};
#endif

//! A GPU's compute capability: sm_90 is {9, 0}.
struct compute_capability {
  int major = 0, minor = 0;
  [[nodiscard]] constexpr int sm() const noexcept { return major * 10 + minor; }
};

#if MPX_HAS_CUDA_RUNTIME
namespace detail {
//! The compute capability of `device`.
inline compute_capability compute_capability_of(int device) {
  compute_capability cc;
  MPX_CUDA_CHECK(cudaDeviceGetAttribute(&cc.major, cudaDevAttrComputeCapabilityMajor, device));
  MPX_CUDA_CHECK(cudaDeviceGetAttribute(&cc.minor, cudaDevAttrComputeCapabilityMinor, device));
  return cc;
}
//! The compute capability of the current device, where mpx's products run.
inline compute_capability current_compute_capability() {
  int device = 0;
  MPX_CUDA_CHECK(cudaGetDevice(&device));
  return compute_capability_of(device);
}
}  // namespace detail
#endif

template <class E>
inline constexpr bool is_host_executor_v = std::is_same_v<std::remove_cvref_t<E>, host_executor>;

#if MPX_HAS_CUDA_RUNTIME
template <class E>
inline constexpr bool is_cuda_executor_v = std::is_same_v<std::remove_cvref_t<E>, cuda_executor>;
#else
template <class E>
inline constexpr bool is_cuda_executor_v = false;
#endif

template <class E>
concept executor = is_host_executor_v<E> || is_cuda_executor_v<E>;

//! The memory space an executor's algorithms read and write.
template <executor E>
using memory_space_t = typename std::remove_cvref_t<E>::memory_space;

//! Whether executor E's algorithms can read and write memory in Space.
template <class E, class Space>
inline constexpr bool can_access_v = executor<E> && std::is_same_v<memory_space_t<E>, Space>;

namespace detail {
template <class>
inline constexpr bool always_false_v = false;

//! The one place the space check lives, so every algorithm refuses the same way.
template <class Exec, class... Spaces>
constexpr void require_access() {
  static_assert(executor<Exec>, "mpx: expected an executor (mpx::host_executor or mpx::cuda_executor)");
  static_assert((can_access_v<Exec, Spaces> && ...),
                "mpx: the executor cannot reach this tensor's memory: a device_space tensor was "
                "given to the host_executor, or a host_space tensor to the cuda_executor. Copy it "
                "with mpx::copy / mpx::to_host / mpx::to_device, or use the matching executor");
}
//! Stops compilation where an algorithm that launches kernels is called on a
//! cuda_executor from a file the plain C++ compiler builds (the one place this message
//! lives; tests/compile_fail checks it).
template <class Exec>
constexpr void kernels_need_nvcc() {
  static_assert(always_false_v<Exec>,
                "mpx: algorithms on a cuda_executor launch kernels and must be compiled by nvcc "
                "(call them from a .cu file)");
}

//! An uninitialised buffer of n elements in the executor's space (on its stream, for
//! the GPU): the one place tensors and resident values get their memory.
template <class T, executor Exec>
buffer<T, memory_space_t<Exec>> allocate([[maybe_unused]] Exec const& exec, std::size_t n) {
  if constexpr (is_host_executor_v<Exec>) {
    return buffer<T, host_space>(n);
  } else {
    return buffer<T, memory_space_t<Exec>>(n, exec.stream());
  }
}
}  // namespace detail

}  // namespace mpx
