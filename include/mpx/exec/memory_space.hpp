// Where a tensor's memory lives (host_space, device_space) and the move-only buffers
// that own it. Device memory is stream-ordered (cudaMallocAsync from the device's
// pool), so allocating a tensor in a training step does not synchronise the GPU.
#pragma once

#include <mpx/core/error.hpp>

#include <cstddef>
#include <cstdio>
#include <new>
#include <string_view>
#include <type_traits>
#include <utility>

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

template <class T, class Space>
class buffer;

//! Owns `size` elements of T in host memory. Move-only.
template <class T>
class buffer<T, host_space> {
 public:
  static constexpr std::size_t alignment = 64;
  buffer() = default;
  explicit buffer(std::size_t size)
      : data_(size ? static_cast<T*>(::operator new(size * sizeof(T), std::align_val_t{alignment})) : nullptr),
        size_(size) {}
  buffer(buffer&& other) noexcept : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  buffer& operator=(buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  buffer(buffer const&) = delete;
  buffer& operator=(buffer const&) = delete;
  ~buffer() { release(); }

  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  void release() noexcept {
    if (data_) ::operator delete(data_, std::align_val_t{alignment});
    data_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

#if MPX_HAS_CUDA_RUNTIME
//! Owns `size` elements of T in device memory, allocated and freed in the order of
//! `stream`. Move-only.
template <class T>
class buffer<T, device_space> {
 public:
  buffer() = default;
  buffer(std::size_t size, cudaStream_t stream) : size_(size), stream_(stream) {
    if (size) {
      void* p = nullptr;
      MPX_CUDA_CHECK(cudaMallocAsync(&p, size * sizeof(T), stream));
      data_ = static_cast<T*>(p);
    }
  }
  buffer(buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), stream_(other.stream_) {}
  buffer& operator=(buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      stream_ = other.stream_;
    }
    return *this;
  }
  buffer(buffer const&) = delete;
  buffer& operator=(buffer const&) = delete;
  ~buffer() { release(); }

  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

 private:
  void release() noexcept {
    if (!data_) return;
    // A destructor cannot throw; a failed free means the context is already broken
    // (an earlier kernel faulted), and the next checked call reports that.
    if (cudaError_t status = cudaFreeAsync(data_, stream_); status != cudaSuccess)
      std::fprintf(stderr, "mpx: cudaFreeAsync failed while freeing a device buffer: %s\n",
                   cudaGetErrorString(status));
    data_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
  cudaStream_t stream_ = nullptr;
};
#endif

}  // namespace detail
}  // namespace mpx
