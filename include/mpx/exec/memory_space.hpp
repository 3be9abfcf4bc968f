// Where a tensor's memory lives (host_space, device_space) and the move-only buffers
// that own it. Device memory is stream-ordered (cudaMallocAsync from the device's
// pool), so allocating a tensor in a training step does not synchronise the GPU.
#pragma once

#include <mpx/core/error.hpp>

#include <cstddef>
#include <cstdio>
#include <memory>
#include <new>
#include <string_view>
#include <type_traits>

namespace mpx {

//! Ordinary host memory (64-byte aligned, so vectorised host loops and device copies
//! start on a cache line).
struct host_space {
  static constexpr std::string_view name = "host_space";
};

//! GPU global memory, allocated on a stream.
struct device_space {
  static constexpr std::string_view name = "device_space";
};

template <class S>
concept memory_space = std::is_same_v<S, host_space> || std::is_same_v<S, device_space>;

namespace detail {

inline constexpr std::size_t host_alignment = 64;

struct host_release {
  void operator()(void* p) const noexcept { ::operator delete(p, std::align_val_t{host_alignment}); }
};

template <class T, class Space>
class buffer;

//! Owns `size` elements of T in host memory. Move-only; a moved-from buffer is empty.
template <class T>
class buffer<T, host_space> {
 public:
  buffer() = default;
  explicit buffer(std::size_t size)
      : data_(size ? static_cast<T*>(::operator new(size * sizeof(T), std::align_val_t{host_alignment})) : nullptr) {}
  [[nodiscard]] T* data() const noexcept { return data_.get(); }

 private:
  std::unique_ptr<T, host_release> data_;
};

#if MPX_HAS_CUDA_RUNTIME
//! Frees device memory in the order of the stream it was allocated on.
struct device_release {
  cudaStream_t stream = nullptr;
  void operator()(void* p) const noexcept {
    // A destructor cannot throw; a failed free means the context is already broken
    // (an earlier kernel faulted), and the next checked call reports that.
    if (cudaError_t status = cudaFreeAsync(p, stream); status != cudaSuccess)
      std::fprintf(stderr, "mpx: cudaFreeAsync failed while freeing a device buffer: %s\n",
                   cudaGetErrorString(status));
  }
};

//! Owns `size` elements of T in device memory, allocated and freed in the order of
//! `stream`. Move-only; a moved-from buffer is empty.
template <class T>
class buffer<T, device_space> {
 public:
  buffer() = default;
  buffer(std::size_t size, cudaStream_t stream) : data_(nullptr, device_release{stream}) {
    if (size) {
      void* p = nullptr;
      MPX_CUDA_CHECK(cudaMallocAsync(&p, size * sizeof(T), stream));
      data_.reset(static_cast<T*>(p));
    }
  }
  [[nodiscard]] T* data() const noexcept { return data_.get(); }

 private:
  std::unique_ptr<T, device_release> data_;
};
#endif

}  // namespace detail
}  // namespace mpx
